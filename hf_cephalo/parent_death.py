"""Under a launcher, end this worker when the launcher dies.

[Note: parent death]
Under a torchelastic launcher (``torchrun``, ``accelerate launch``: ``TORCHELASTIC_RUN_ID`` set)
a worker must not outlive its launcher: one killed with SIGKILL (a scheduler pre-empting the
job) leaves its workers re-parented, still training and writing checkpoints.
``install_parent_death_guard`` (run when ``hf_cephalo`` is imported) ends the worker within
about a second of that death: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux and, everywhere, a
daemon thread that polls ``os.getppid()`` every ``POLL_S`` seconds and calls ``os._exit``. Never
through SIGTERM or Python handlers: SIGTERM is the launcher's ordinary stop and the cue for a
JIT checkpoint, whose collectives cannot finish while the other ranks are ending too; a save
cut off stays an unpublished ``.tmp-checkpoint-N`` ([Note: atomic checkpoints]). A plain
``python train.py`` is left alone (its parent is a shell). The two routes in detail, and what
is not covered: docs/accelerate.md, "Parent death".
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
