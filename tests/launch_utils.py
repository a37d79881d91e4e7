"""Start real `accelerate launch` / torchrun jobs and wait for them under a hard timeout.

Every launch runs in its own session, so on timeout the whole process group (launcher, torchrun
and workers) is killed and a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, NamedTuple, Sequence

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]


class LaunchResult(NamedTuple):
    """A finished launch: the launcher's exit status and its stdout + stderr."""

    returncode: int
    output: str


def _launch_env(env_extra: dict[str, str] | None) -> dict[str, str]:
    """The caller's environment without any ``HF_CEPHALO_*`` variable (so a developer's shell
    cannot change a test), plus ``env_extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_CEPHALO_")}
    env.update(env_extra or {})
    return env


def _popen(cmd: list[str], env: dict[str, str], stdout: int | IO) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def start_launch(config: Path | None, script: Path, script_args: Sequence[str] = (), *,
                 port: int | None = None, launcher_args: Sequence[str] = (),
                 env_extra: dict[str, str] | None = None,
                 stdout: int | IO = subprocess.PIPE) -> subprocess.Popen:
    """``accelerate launch --config_file config --main_process_port port [launcher_args] script
    [script_args]`` from the repository root, in a new session.

    The environment is the caller's without any ``HF_CEPHALO_*`` variable (so a developer's
    shell cannot change a test), plus ``env_extra``. ``port`` defaults to a free one. stdout and
    stderr go together to ``stdout`` (a pipe unless a file is given). ``config`` None: no
    ``--config_file`` (stock ``accelerate launch`` then reads the default config under
    ``HF_HOME``, if there is one: point ``HF_HOME`` at an empty directory to have none).
    """
    config_args = [] if config is None else ["--config_file", str(config)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *config_args,
           "--main_process_port", str(port or free_port()), *launcher_args, str(script),
           *script_args]
    return _popen(cmd, _launch_env(env_extra), stdout)


def start_torchrun(script: Path | str, script_args: Sequence[str] = (), *, nproc_per_node: int = 2,
                   port: int | None = None, env_extra: dict[str, str] | None = None,
                   stdout: int | IO = subprocess.PIPE,
                   launcher_args: Sequence[str] = ()) -> subprocess.Popen:
    """``python -m torch.distributed.run --nproc_per_node N --master_port port [launcher_args]
    script [script_args]`` from the repository root, in a new session; environment, ``port``
    and ``stdout`` as in ``start_launch``. ``script`` ``"-m"`` runs the module named by the
    first of ``script_args``. One machine unless ``launcher_args`` say otherwise (e.g.
    ``--nnodes 2 --node_rank R --master_addr 127.0.0.1``: one launcher per emulated node)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc_per_node),
           "--master_port", str(port or free_port()), *launcher_args, str(script), *script_args]
    return _popen(cmd, _launch_env(env_extra), stdout)


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[LaunchResult]:
    """Wait for every launch, each within ``timeout_s`` seconds; on a timeout kill the process
    group of every launch still running and raise AssertionError (a hang must fail the test)."""
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            results.append(LaunchResult(proc.returncode, out))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the launch did not finish within {timeout_s} s "
                             f"(hang?)") from None
    return results
