"""Worker of tests/test_rank_errors.py: an uncaught error on the ranks of a torchrun launch.

``argv[1]`` is the mode:

- ``every``: every rank raises ``ValueError(MESSAGE)`` (before any process group, as a bad
  setting does in argument parsing);
- ``unordered``: every rank raises transformers' "No columns in the dataset match ..."
  ValueError (``no_columns_message``), whose column lists come from sets in stock code and so in
  a per-process order: here rank 1 lists them reversed;
- ``rank1``: after a gloo process group and a barrier, rank 1 raises ``ValueError(MESSAGE)``
  while rank 0 waits in an all_reduce, which fails when rank 1's process exits (gloo:
  "Connection closed by peer").

SIGTERM is ignored from the start: the launcher sends it to the other ranks as soon as one rank
exits, and whether it lands before a rank reaches its error depends on timing. Ignoring it
makes every rank reach its error, so the test can count exactly what each rank prints. The
launcher still ends a rank with SIGKILL after its grace period (30 s), which a slow start on a
loaded machine (imports 6x slower) can exceed: in ``every`` mode the ranks therefore meet at a
file barrier (env ``RAISE_BARRIER_DIR``) after their imports, so no rank exits before the other
is ready to raise.
"""

import datetime
import signal
import sys
from pathlib import Path

signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hf_cephalo  # noqa: E402,F401  (installs the once-per-job error report)

MESSAGE = "lr = -1 (--learning_rate): must be > 0"


def _file_barrier(directory: str, timeout_s: float = 300.0) -> None:
    """Wait until every local rank has created its file in ``directory`` (no process group)."""
    import os
    import time

    os.makedirs(directory, exist_ok=True)
    Path(directory, f"ready-{os.environ['LOCAL_RANK']}").touch()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(directory)) < int(os.environ["LOCAL_WORLD_SIZE"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"file barrier {directory}: the other ranks never arrived")
        time.sleep(0.05)


def no_columns_message(reverse: bool) -> str:
    """transformers' ``Trainer._remove_unused_columns`` error (trainer.py, 5.x): its label
    columns come from ``list(set([...]))`` and the ignored ones from a set difference."""
    labels, ignored = ["label", "label_ids", "labels"], ["text", "idx"]
    if reverse:
        labels, ignored = labels[::-1], ignored[::-1]
    return ("No columns in the dataset match the model's forward method signature: "
            f"({', '.join(['input_ids', 'attention_mask', *labels])}). The following columns "
            f"have been ignored: [{', '.join(ignored)}]. Please check the dataset and model. You "
            "may need to set `remove_unused_columns=False` in `TrainingArguments`.")


def main(mode: str) -> None:
    if mode in ("every", "unordered"):
        import os

        if os.environ.get("RAISE_BARRIER_DIR"):
            _file_barrier(os.environ["RAISE_BARRIER_DIR"])
        if mode == "unordered":
            raise ValueError(no_columns_message(reverse=os.environ["RANK"] == "1"))
        raise ValueError(MESSAGE)
    if mode != "rank1":
        raise SystemExit(f"unknown mode {mode!r}")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    dist.barrier()  # both ranks are past start-up: rank 1's exit reaches rank 0's collective
    if dist.get_rank() == 1:
        raise ValueError(MESSAGE)
    dist.all_reduce(torch.ones(4))


if __name__ == "__main__":
    main(sys.argv[1])
