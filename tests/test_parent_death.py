"""Killing the launcher ends its workers (hf_cephalo/parent_death.py, [Note: parent death]).

A scheduler that pre-empts a job may SIGKILL the launcher only. Its workers must then end
within seconds instead of training on as orphans, and leave no checkpoint published partial.
One real 2-rank ``accelerate launch`` job and one real 2-rank ``torchrun`` job (tiny Llama, a
plan file, a checkpoint every 2 steps, run side by side): once both have published a
checkpoint, each launcher (only that process, not its process group) gets SIGKILL; no worker
may be alive 30 s later, and every ``checkpoint-N`` must carry its completeness marker with
every file the marker lists at the recorded size.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.dist_utils import budget_s, test_timeout
from tests.launch_utils import ROOT, start_launch, start_torchrun

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "launch_scripts" / "orphan_train.py"
START_S = 40.0  # start-up to the first checkpoint: imports, process group, 2 steps, one save
WORKERS_GONE_S = 30.0  # the bound the issue sets for the workers to end after the launcher
pytestmark = [pytestmark, test_timeout(START_S, WORKERS_GONE_S)]


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaps, e.g. under a container's init, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(condition, timeout_s: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}:\n{p.read_text()[-3000:]}" for p in logs)
            raise AssertionError(f"{what} not within {timeout_s:.0f} s\n{tails}")
        time.sleep(0.5)


def _check_checkpoints(out: Path) -> list[str]:
    """Every published checkpoint-N is complete: marker present, every listed file at its
    recorded size. Returns the names."""
    from hf_cephalo.engine.checkpoint import FILES

    names = sorted(p.name for p in out.glob("checkpoint-*"))
    for name in names:
        marker = out / name / FILES.COMPLETE
        assert marker.is_file(), f"{name} published without its completeness marker"
        for file, record in json.loads(marker.read_text())["files"].items():
            assert (out / name / file).stat().st_size == record["size_bytes"], (name, file)
    return names


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_sigkill_of_the_launcher_ends_its_workers(tmp_path):
    from hf_cephalo.planner import Plan

    plan = tmp_path / "plan.json"
    Plan.from_ratios([1, 3], [1, 3], [0.4, 0.6]).save(plan)
    env = {"HF_CEPHALO_PLAN_FILE": str(plan), "TQDM_DISABLE": "1"}
    jobs = {}
    for name in ("accelerate", "torchrun"):
        out, log = tmp_path / name, tmp_path / f"{name}.log"
        out.mkdir()
        with open(log, "w") as stdout:
            if name == "accelerate":
                proc = start_launch(ROOT / "accelerate_configs" / "cephalo_cpu.yaml", SCRIPT,
                                    (str(out),), env_extra=env, stdout=stdout)
            else:
                proc = start_torchrun(SCRIPT, (str(out),), env_extra=env, stdout=stdout)
        jobs[name] = (proc, out, log)
    logs = [log for _, _, log in jobs.values()]
    try:
        def started(out: Path) -> bool:
            return (len(list(out.glob("worker-*.json"))) == 2
                    and any(out.glob("checkpoint-*")))

        _wait_for(lambda: all(started(out) for _, out, _ in jobs.values()), budget_s(START_S),
                  "both jobs training with a published checkpoint", logs)
        workers = {}
        for name, (proc, out, _) in jobs.items():
            records = [json.loads(p.read_text()) for p in out.glob("worker-*.json")]
            # the process tree the guard relies on: the launcher is every worker's parent
            assert [r["ppid"] for r in records] == [proc.pid] * 2, (name, proc.pid, records)
            workers[name] = [r["pid"] for r in records]
            os.kill(proc.pid, signal.SIGKILL)  # the launcher only, as a scheduler would
        _wait_for(lambda: not any(_alive(p) for pids in workers.values() for p in pids),
                  WORKERS_GONE_S, f"every worker ({workers}) ended after its launcher's SIGKILL",
                  logs)
        for name, (_, out, _) in jobs.items():
            assert _check_checkpoints(out), name
    finally:
        for proc, _, _ in jobs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the job's session
            except ProcessLookupError:
                pass
            proc.wait()


_CHILD = """
import os, sys, time
import hf_cephalo.parent_death as pd
assert not pd.install_parent_death_guard()  # outside torchelastic: nothing installed
os.environ["TORCHELASTIC_RUN_ID"] = "test"
pd._set_pdeathsig = lambda: False  # as where prctl is missing: the watchdog alone
assert pd.install_parent_death_guard()
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(120)
"""
_PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stderr=open(sys.argv[3], "w"))
time.sleep(120)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
@test_timeout(10.0)
def test_watchdog_ends_the_worker_without_prctl(tmp_path):
    """The fallback route alone (prctl patched out): a process whose parent is SIGKILLed ends
    itself (os._exit) and says why on stderr; outside torchelastic no guard is installed."""
    import subprocess
    import sys

    pid_file, err = tmp_path / "pid", tmp_path / "stderr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, str(pid_file), str(err)],
                              cwd=ROOT, env=env, start_new_session=True)
    try:
        _wait_for(lambda: pid_file.is_file() and pid_file.read_text(), budget_s(10.0),
                  "the child started", [err])
        child = int(pid_file.read_text())
        assert _alive(child)
        parent.kill()
        parent.wait()
        _wait_for(lambda: not _alive(child), WORKERS_GONE_S, "the child ended", [err])
        assert f"the launcher (pid {parent.pid}) is gone; ending this worker" in err.read_text()
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
