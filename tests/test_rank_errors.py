"""An error under a launcher is printed once and named in the launcher's report (rank_errors.py).

In-process: the hook itself, driven as two ranks of one job would drive it (the environment a
torchrun worker sees, a private temp directory): the election, the error files read back by
torch's own ``ProcessFailure`` / ``ChildFailedError`` (the launcher's report), the lost-connection
line, the fallbacks, the classifier, the opt-out and the stale-directory clean-up.

Launched (few launches, each a few seconds): torchrun workers raising on every rank, on one rank
while the other waits in a collective, and with the opt-out (the same count of printed
tracebacks must then double: the assertions can fail); ``hf-cephalo profile`` printing its
``error: ...`` (no traceback, exit status 2); ``examples/train_clm.py`` under
``accelerate launch`` with a plan file that does not exist.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from hf_cephalo import rank_errors
from hf_cephalo.rank_errors import (ALL_RANK_ERRORS_ENV, ErrorKind, classify_error,
                                    error_file_record, install_rank_error_hook)
from tests.dist_utils import budget_s, free_port, test_timeout
from tests.launch_utils import ROOT, start_launch, start_torchrun, wait_all

SCRIPT = ROOT / "tests" / "launch_scripts" / "raise_on_ranks.py"
MESSAGE = "lr = -1 (--learning_rate): must be > 0"  # the script's
GLOO_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
               "peer [127.0.0.1]:6551. This is typically caused by a remote worker crashing.")
# a torchrun launch of the tiny script measured 6-11 s on 2 cores under load; train_clm 13 s
TORCHRUN_S, CLM_S = 15.0, 30.0


# ---- in process ---------------------------------------------------------------------------

class _Recorder:
    """Stands for the previous ``sys.excepthook``: records what it was asked to print."""

    def __init__(self):
        self.calls: list[BaseException] = []

    def __call__(self, exc_type, exc, tb) -> None:
        self.calls.append(exc)


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A two-rank job's environment with a private temp directory; ``job(rank)`` makes this
    process rank ``rank`` (its own error file) and returns that file."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", ALL_RANK_ERRORS_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))

    def become(rank: int) -> Path:
        error_file = tmp_path / "attempt_0" / str(rank) / "error.json"
        error_file.parent.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        return error_file

    return become


def _raise(exc: BaseException, previous: _Recorder) -> None:
    """Deliver ``exc`` (with a real traceback) to a fresh hook, as Python does at exit."""
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - the hook receives every kind
        rank_errors._RankErrorHook(previous, ignore_sigterm=False)(type(e), e, e.__traceback__)


def _failure(rank: int, error_file: Path) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1, error_file=str(error_file))


def test_same_error_is_printed_by_the_first_rank_only(job, capsys):
    previous = _Recorder()
    file0 = job(0)
    _raise(ValueError(MESSAGE), previous)
    assert len(previous.calls) == 1 and capsys.readouterr().err == (
        "rank 0 failed first with the error below; other ranks with the same error stay quiet "
        f"({ALL_RANK_ERRORS_ENV}=1 shows them)\n")
    file1 = job(1)
    _raise(ValueError(MESSAGE), previous)
    assert len(previous.calls) == 1 and capsys.readouterr().err == ""  # quiet

    # torch's own reader of error files, as the launcher uses it
    failures = {0: _failure(0, file0), 1: _failure(1, file1)}
    assert failures[0].message == {"message": f"ValueError: {MESSAGE}", "extraInfo": {
        "py_callstack": f"ValueError: {MESSAGE}", "timestamp": str(failures[0].timestamp)}}
    assert failures[1].timestamp == failures[0].timestamp + 1  # ordered after its cause
    report = ChildFailedError("train.py", failures).format_msg()
    root = report.split("Root Cause (first observed failure):")[1]
    assert "rank      : 0 (local_rank: 0)" in root and f"traceback : ValueError: {MESSAGE}" in root
    assert report.count(MESSAGE) == 1 and "To enable traceback" not in report
    assert ("traceback : ValueError: same error as rank 0 (its traceback is printed above)"
            in report)

    # another message is news: printed, even on a rank that stayed quiet before
    _raise(ValueError(MESSAGE + "!"), previous)
    assert len(previous.calls) == 2 and "rank 1 failed first" in capsys.readouterr().err


def test_same_error_in_another_order_is_printed_once(job, capsys):
    """transformers' "No columns in the dataset match ..." lists column sets, in an order of
    each process's own (string hashing is seeded per process): the same error on both ranks,
    so the second rank stays quiet (it printed twice when whole messages were compared)."""
    from tests.launch_scripts.raise_on_ranks import no_columns_message

    previous = _Recorder()
    job(0)
    _raise(ValueError(no_columns_message(reverse=False)), previous)
    assert len(previous.calls) == 1 and "rank 0 failed first" in capsys.readouterr().err
    file1 = job(1)
    _raise(ValueError(no_columns_message(reverse=True)), previous)
    assert len(previous.calls) == 1 and capsys.readouterr().err == ""  # quiet
    record = json.loads(file1.read_text())["message"]
    assert record["message"] == f"ValueError: {no_columns_message(reverse=True)}"  # its own
    assert record["extraInfo"]["py_callstack"] == ("ValueError: same error as rank 0 (its "
                                                   "traceback is printed above)")
    # an object's address differs per process: the same error
    _raise(ValueError("cannot pickle <Lock object at 0x7f3a1c2b4d60>"), previous)
    job(0)
    _raise(ValueError("cannot pickle <Lock object at 0x7f90aa01ee30>"), previous)
    assert len(previous.calls) == 2
    capsys.readouterr()
    # news: another type with the same message; numbers in another order (a shape)
    _raise(TypeError(no_columns_message(reverse=False)), previous)
    _raise(ValueError("expected shape (8, 4), got (4, 8)"), previous)
    job(1)
    _raise(ValueError("expected shape (4, 8), got (8, 4)"), previous)
    assert len(previous.calls) == 5


def test_normalized_message():
    n = rank_errors.normalized_message
    assert n("columns (b, a) ignored: [y, x]; {'q', 'p'}") == "columns (a, b) ignored: [x, y]; {'p', 'q'}"
    assert n("{('b', 1), ('a', 2)}") == n("{('a', 2), ('b', 1)}") == "{('a', 2), ('b', 1)}"
    assert n("shape (8, 4), ids [3, 1], lr (1e-3, .5)") == "shape (8, 4), ids [3, 1], lr (1e-3, .5)"
    assert n("at 0x7f3a1c2b4d60 in /tmp/tmpk2j4_x9a/f") == "at 0x? in /tmp/tmp?/f"
    assert n("unbalanced (b, a] and 1) x") == "unbalanced (b, a] and 1) x"  # left as it is
    assert rank_errors.error_identity("ValueError", "[b, a]") == "ValueError: [a, b]"


def test_compile_failure_on_two_ranks_is_printed_once(job, capsys):
    """The engine's CompileFailure on two ranks (each built from its own exception, then
    naming every failing rank after the ranks exchanged their results) is one message: the
    first rank prints it, the other stays quiet."""
    from hf_cephalo.engine.compile import CompileFailure, CompileOptions

    def failure(rank: int) -> CompileFailure:
        try:
            raise ImportError("Please install apache-tvm")
        except ImportError as exc:
            own = CompileFailure(0, "unit 0 (LlamaDecoderLayer)", CompileOptions(), [rank], exc)
        return own.on_ranks([1, 1])

    previous = _Recorder()
    job(0)
    _raise(failure(0), previous)
    assert len(previous.calls) == 1 and "rank 0 failed first" in capsys.readouterr().err
    assert "failed on ranks 0, 1: ImportError: Please install apache-tvm" in str(previous.calls[0])
    job(1)
    _raise(failure(1), previous)
    assert len(previous.calls) == 1 and capsys.readouterr().err == ""  # quiet


def test_report_error_once_for_errors_a_program_prints_itself(job, monkeypatch):
    """hf-cephalo prints ``error: ...`` and exits 2 (no excepthook): the same election, and the
    launcher's report names the message; without a launcher every call says print."""
    file0 = job(0)
    assert rank_errors.report_error_once(MESSAGE) is True
    file1 = job(1)
    assert rank_errors.report_error_once(MESSAGE) is False  # the same message: quiet
    failures = {0: _failure(0, file0), 1: _failure(1, file1)}
    assert failures[0].message["message"] == f"ValueError: {MESSAGE}"
    assert failures[1].timestamp == failures[0].timestamp + 1
    report = ChildFailedError("hf-cephalo", failures).format_msg()
    root = report.split("Root Cause (first observed failure):")[1]
    assert "rank      : 0 (local_rank: 0)" in root and f"traceback : ValueError: {MESSAGE}" in root
    assert "traceback : ValueError: same error as rank 0 (its message is printed above)" in report
    assert rank_errors.report_error_once(MESSAGE, kind="OSError") is True  # another headline
    # the exception hook's election: a later uncaught ValueError with that message is quiet
    previous = _Recorder()
    job(1)
    _raise(ValueError(MESSAGE), previous)
    assert previous.calls == []
    monkeypatch.setenv(ALL_RANK_ERRORS_ENV, "1")
    assert rank_errors.report_error_once(MESSAGE) is True  # the opt-out
    monkeypatch.delenv(ALL_RANK_ERRORS_ENV)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rank_errors.report_error_once(MESSAGE) is True  # no launch with several ranks


def test_lost_connection_prints_one_line_per_machine(job, capsys):
    previous = _Recorder()
    file0 = job(0)
    _raise(ValueError(MESSAGE), previous)  # the cause, on rank 0
    capsys.readouterr()
    file1 = job(1)
    _raise(RuntimeError(GLOO_CLOSED), previous)
    line = ("rank 1 stopped: lost the connection to another rank, which failed first "
            f"(RuntimeError: {GLOO_CLOSED})")
    assert len(previous.calls) == 1 and capsys.readouterr().err == line + "\n"
    _raise(dist.DistNetworkError("Connection reset by peer"), previous)  # a second lost peer
    assert len(previous.calls) == 1 and capsys.readouterr().err == ""
    failures = {0: _failure(0, file0), 1: _failure(1, file1)}
    assert ChildFailedError("train.py", failures).get_first_failure()[0] == 0
    assert failures[1].message["extraInfo"]["py_callstack"].startswith("rank 1 stopped: lost")


def test_the_hook_falls_back_to_the_full_traceback(job, tmp_path, monkeypatch, capsys):
    previous = _Recorder()
    job(0)
    _raise(ValueError(MESSAGE), previous)
    job(1)
    _raise(KeyboardInterrupt(), previous)  # a person stopping the job: the default report
    assert len(previous.calls) == 2 and isinstance(previous.calls[1], KeyboardInterrupt)
    # an unusable temp directory: the hook prints the duplicate rather than hide it
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setattr("tempfile.tempdir", str(blocker))
    capsys.readouterr()
    _raise(ValueError(MESSAGE), previous)
    assert len(previous.calls) == 3 and capsys.readouterr().err == ""
    # an unwritable error file: the same
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "missing" / "error.json"))
    _raise(ValueError(MESSAGE), previous)
    assert len(previous.calls) == 4


def test_sigterm_is_ignored_while_the_hook_reports(job):
    """[Note: one error report per job]: the launcher's SIGTERM, sent when another rank exits,
    must not end a rank while it prints; afterwards SIGTERM acts as before."""
    import signal

    seen = []
    job(0)
    before = signal.getsignal(signal.SIGTERM)
    hook = rank_errors._RankErrorHook(lambda *a: seen.append(signal.getsignal(signal.SIGTERM)))
    try:
        raise ValueError(MESSAGE)
    except ValueError as e:
        hook(ValueError, e, e.__traceback__)
    assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGTERM) is before


def test_classify_error():
    def raised_from(exc: BaseException, cause: BaseException) -> BaseException:
        try:
            raise exc from cause
        except BaseException as e:  # noqa: BLE001
            return e

    def during(exc: BaseException, context: BaseException) -> BaseException:
        try:
            try:
                raise context
            except BaseException:  # noqa: BLE001
                raise exc
        except BaseException as e:  # noqa: BLE001
            return e

    consequence, cause = ErrorKind.CONSEQUENCE, ErrorKind.CAUSE
    cases = [
        (RuntimeError(GLOO_CLOSED), consequence),
        (RuntimeError("[../gloo/transport/tcp/pair.cc:598] Connection reset by peer"), consequence),
        (dist.DistNetworkError("failed to recv, got 0 bytes"), consequence),  # by its type
        (dist.DistStoreError("Broken pipe"), consequence),
        (dist.DistBackendError("NCCL communicator was aborted on rank 1."), consequence),
        (dist.DistBackendError("NCCL error: invalid usage"), cause),
        (dist.DistStoreError("Timed out after 901 seconds waiting for clients"), cause),
        (raised_from(RuntimeError("step 3 failed"), RuntimeError(GLOO_CLOSED)), consequence),
        (during(ValueError("cleanup failed"), RuntimeError(GLOO_CLOSED)), cause),
        # this process's own sockets and pipes (a download, a closed stdout) are causes
        (ConnectionResetError(104, "Connection reset by peer"), cause),
        (BrokenPipeError(32, "Broken pipe"), cause),
        (raised_from(OSError("download failed"), ConnectionResetError(104, "reset by peer")), cause),
        (ValueError(f"plan_file = 'x' (...): no such file; {GLOO_CLOSED}"), cause),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), cause),
    ]
    for exc, kind in cases:
        assert classify_error(exc) is kind, repr(exc)


def test_error_file_record_is_read_by_torch(tmp_path):
    path = tmp_path / "error.json"
    exc = ValueError("line one\nline two")
    record = error_file_record(exc, 1_700_000_000.9, shown="ValueError: line one")
    path.write_text(json.dumps(record))
    failure = _failure(0, path)
    assert failure.timestamp == 1_700_000_000 and failure.error_file == str(path)
    assert failure.message["message"] == "ValueError: line one\nline two"
    assert "traceback : ValueError: line one\n" in ChildFailedError("x", {0: failure}).format_msg()


def test_install_only_under_a_launcher_with_several_ranks(monkeypatch):
    monkeypatch.setattr(rank_errors, "_previous_hook", None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", ALL_RANK_ERRORS_ENV):
        monkeypatch.delenv(name, raising=False)
    assert install_rank_error_hook() is False  # a plain `python train.py`
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert install_rank_error_hook() is False  # one rank: nothing to deduplicate
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(ALL_RANK_ERRORS_ENV, "1")
    assert install_rank_error_hook() is False  # the opt-out
    monkeypatch.delenv(ALL_RANK_ERRORS_ENV)
    before = sys.excepthook
    assert install_rank_error_hook() is True
    hook = sys.excepthook
    assert isinstance(hook, rank_errors._RankErrorHook) and hook.previous is before
    assert install_rank_error_hook() is True and sys.excepthook is hook  # idempotent


def test_stale_job_directories_are_removed(job, tmp_path, capsys):
    base = tmp_path / "tmp" / f"hf_cephalo-errors-{os.getuid()}"
    old, recent = base / "old", base / "recent"
    for d in (old, recent):
        d.mkdir(parents=True)
        (d / "fingerprint").write_text("0")
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (two_days_ago, two_days_ago))
    job(0)
    _raise(ValueError(MESSAGE), _Recorder())  # creates this job's directory
    assert not old.exists() and recent.exists() and len(list(base.iterdir())) == 2


# ---- launched -----------------------------------------------------------------------------

def _worker_lines(out: str, text: str) -> list[str]:
    """Lines containing ``text`` printed by the workers (not the launcher's report, whose
    entries are indented ``  traceback : ...``)."""
    return [line for line in out.splitlines()
            if text in line and not line.startswith("  traceback : ")]


def _report(out: str) -> str:
    """The launcher's ChildFailedError block."""
    assert " FAILED\n" in out, out[-4000:]
    return out[out.index(" FAILED\n"):]


@pytest.mark.slow
@test_timeout(TORCHRUN_S)  # the two launches run at the same time
def test_same_error_on_every_rank_is_printed_once(tmp_path):
    procs = [start_torchrun(SCRIPT, ["every"],
                            env_extra={"RAISE_BARRIER_DIR": str(tmp_path / "default")}),
             start_torchrun(SCRIPT, ["every"], env_extra={
                 ALL_RANK_ERRORS_ENV: "1", "RAISE_BARRIER_DIR": str(tmp_path / "opt-out")})]
    (rc, out), (rc_all, out_all) = wait_all(procs, budget_s(TORCHRUN_S))
    assert rc != 0 and rc_all != 0
    assert len(_worker_lines(out, f"ValueError: {MESSAGE}")) == 1, out
    assert len(re.findall(r"^rank [01] failed first with the error below", out, re.M)) == 1, out
    report = _report(out)
    root = report.split("Root Cause")[1]
    assert f"traceback : ValueError: {MESSAGE}" in root and "To enable traceback" not in report
    assert "traceback : ValueError: same error as rank " in report
    # the opt-out: Python's default, every rank prints, the launcher knows no message
    assert len(_worker_lines(out_all, f"ValueError: {MESSAGE}")) == 2, out_all
    assert "failed first" not in out_all and "To enable traceback" in _report(out_all)


@pytest.mark.slow
@test_timeout(TORCHRUN_S)
def test_same_error_with_columns_in_another_order_is_printed_once(tmp_path):
    from tests.launch_scripts.raise_on_ranks import no_columns_message

    [(rc, out)] = wait_all([start_torchrun(SCRIPT, ["unordered"], env_extra={
        "RAISE_BARRIER_DIR": str(tmp_path / "barrier")})], budget_s(TORCHRUN_S))
    assert rc != 0
    printed = [no_columns_message(reverse) in line for line in
               _worker_lines(out, "ValueError: No columns in the dataset match")
               for reverse in (False, True)]
    assert sum(printed) == 1, out  # one rank's message, once
    assert len(re.findall(r"^rank [01] failed first with the error below", out, re.M)) == 1, out
    assert "traceback : ValueError: same error as rank " in _report(out)


@pytest.mark.slow
@test_timeout(TORCHRUN_S)
def test_error_on_one_rank_is_printed_once_and_its_peer_says_one_line(tmp_path):
    [(rc, out)] = wait_all([start_torchrun(SCRIPT, ["rank1"])], budget_s(TORCHRUN_S))
    assert rc != 0
    # after init_process_group torch prefixes each line of a worker's error with [rankN]:
    assert _worker_lines(out, f"ValueError: {MESSAGE}") == [f"[rank1]: ValueError: {MESSAGE}"]
    assert len(re.findall(r"^\[rank\d\]: Traceback", out, re.M)) == 1, out  # rank 1's only
    rank0 = [line for line in out.splitlines() if line.startswith("[rank0]:")]
    assert len(rank0) == 1 and rank0[0].startswith(
        "[rank0]: rank 0 stopped: lost the connection to another rank, which failed first "
        "(RuntimeError: "), out
    root = _report(out).split("Root Cause")[1]
    assert "rank      : 1 (local_rank: 1)" in root and f"traceback : ValueError: {MESSAGE}" in root


@pytest.mark.slow
@test_timeout(TORCHRUN_S)
def test_cli_error_is_printed_once_and_named_in_the_report(tmp_path):
    """hf-cephalo catches its errors and exits 2 (no excepthook): report_error_once."""
    import transformers

    transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=1,
                            n_head=2).save_pretrained(tmp_path / "gpt2")
    args = ["hf_cephalo.cli", "profile", "--model-config", str(tmp_path / "gpt2"),
            "--out", str(tmp_path / "profile.json")]
    [(rc, out)] = wait_all([start_torchrun("-m", args)], budget_s(TORCHRUN_S))
    text = "--sequence-length 128 exceeds the model's 64 positions"
    assert rc != 0 and _worker_lines(out, text) == [
        f"error: {text} (model config {str(tmp_path / 'gpt2' / 'config.json')!r}); give "
        "--sequence-length 64 or less"], out
    report = _report(out)
    assert f"traceback : ValueError: {text}" in report.split("Root Cause")[1], out
    assert "To enable traceback" not in report


@pytest.mark.slow
@test_timeout(CLM_S)
def test_train_clm_missing_plan_file_is_printed_once(tmp_path):
    args = ["--output_dir", str(tmp_path / "out"), "--hidden_size", "64", "--num_layers", "2",
            "--num_heads", "2", "--block_size", "32", "--max_steps", "2",
            "--cephalo_global_batch_size", "16", "--cephalo_plan_file", "/nonexistent/plan.json",
            "--report_to", "none"]
    proc = start_launch(ROOT / "accelerate_configs" / "cephalo_cpu.yaml",
                        ROOT / "examples" / "train_clm.py", args,
                        env_extra={"HF_DATASETS_DISABLE_PROGRESS_BARS": "1"})
    [(rc, out)] = wait_all([proc], budget_s(CLM_S))
    assert rc != 0
    text = "no such file; write one with `hf-cephalo plan --profile PROFILE -B N --out FILE`"
    # Once in a worker's traceback and once in the launcher's report (its root cause). The other
    # rank either found the message already printed (its report entry says "same error as
    # rank R") or was stopped by the launcher's SIGTERM before raising it ("Signal 15"):
    # exactly two in both cases, where every rank used to print it and the report had none.
    assert len(_worker_lines(out, text)) == 1 and out.count(text) == 2, out
    report = _report(out)
    assert text in report.split("Root Cause")[1] and "To enable traceback" not in report
