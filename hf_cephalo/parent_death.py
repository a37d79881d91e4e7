"""Under a launcher, end this worker when the launcher dies.

[Note: parent death]
Under ``torchrun`` and ``accelerate launch`` every worker is a child of the launcher's elastic
agent: the ``torchrun`` process itself, and for ``accelerate launch`` the ``accelerate launch``
process (it runs torch's agent in-process; tests/test_parent_death.py checks both trees). When
the launcher is killed with SIGKILL (a scheduler pre-empting or cancelling the job), nothing
stops its workers: they are re-parented to init (or a subreaper) and go on training and
writing checkpoints into the output directory. ``install_parent_death_guard`` (called when
``hf_cephalo`` is imported, only under torchelastic: ``TORCHELASTIC_RUN_ID`` set) ends the
worker within about a second of its launcher's death, by two routes:

- Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes: the kernel sends SIGKILL when
  the thread that started the worker exits (torch's agent starts workers from its main thread,
  so: when the launcher process ends).
- Everywhere (and as the fallback where prctl is missing, or when the worker started before
  the guard was set): a daemon thread polls ``os.getppid()`` every ``POLL_S`` seconds and ends
  the process with ``os._exit`` (no handler, no ``atexit``) once the parent is no longer the
  launcher it started under.

Why SIGKILL / ``os._exit`` and not SIGTERM: SIGTERM is the launcher's ordinary "stop" and, with
``enable_jit_checkpoint``, stock Trainer's cue to write a checkpoint. A worker whose launcher
is gone must not start that save: the other ranks are being ended at the same time, so the
save's collectives would fail or wait for peers that are gone. Parent death therefore takes
its own path that runs no Python code of the training script. A worker ended in the middle of
a checkpoint leaves only the hidden staging directory ``.tmp-checkpoint-N``: the completeness
marker is written and the directory renamed into place only after every rank finished
writing (hf_cephalo/engine/checkpoint/atomic.py, [Note: atomic checkpoints]), so no ``checkpoint-N``
is ever published partial.

A worker started by a plain ``python train.py`` (no ``TORCHELASTIC_RUN_ID``) is left alone:
there the parent is a shell, and ``nohup``/a closed terminal must not end a training run.
Not covered: a launcher that dies between starting the worker and the worker's
``import hf_cephalo`` (the guard then records the new parent as the launcher).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["POLL_S", "install_parent_death_guard", "under_torchelastic"]

POLL_S = 0.5
"""Seconds between two checks of the parent pid by the watchdog thread."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_EXIT_STATUS = 128 + signal.SIGKILL  # what the launcher would have seen for a SIGKILLed worker
_installed = False


def under_torchelastic() -> bool:
    """True in a worker started by torch's elastic agent (``torchrun``, ``accelerate launch``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _set_pdeathsig() -> bool:
    """Ask the kernel for SIGKILL on parent death; False where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end(launcher_pid: int) -> None:
    try:
        os.write(2, (f"hf_cephalo: the launcher (pid {launcher_pid}) is gone; ending this worker "
                     f"(pid {os.getpid()}, rank {os.environ.get('RANK', '?')})\n").encode())
    except OSError:
        pass  # stderr may have gone with the launcher
    os._exit(_EXIT_STATUS)


def _watch(launcher_pid: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != launcher_pid:
            _end(launcher_pid)


def install_parent_death_guard() -> bool:
    """Under torchelastic, end this process when its launcher dies ([Note: parent death]).

    Idempotent; does nothing (returns False) outside torchelastic. Returns True when the guard
    is installed (the watchdog thread always; prctl where available).
    """
    global _installed
    if _installed or not under_torchelastic():
        return _installed
    launcher_pid = os.getppid()
    _set_pdeathsig()
    if os.getppid() != launcher_pid:  # it died while the signal was being set
        _end(launcher_pid)
    threading.Thread(target=_watch, args=(launcher_pid,), name="hf_cephalo-parent-death",
                     daemon=True).start()
    _installed = True
    return True
