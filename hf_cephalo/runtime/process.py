"""Process-group set-up and teardown for every front end.

``ensure_process_group`` gives a plain ``python train.py`` run a 1-rank group (the engine needs
one); under a launcher the group exists already (torchrun / ``accelerate launch``).
``register_exit_teardown`` ends the group cleanly at interpreter exit when a script does not
(``accelerator.end_training()`` / ``destroy_process_group``): see
``_teardown_process_group_at_exit``.
"""

from __future__ import annotations

import atexit
import datetime
import sys

import torch
import torch.distributed as dist

__all__ = ["ensure_process_group", "register_exit_teardown", "EXIT_BARRIER_TIMEOUT_S"]


def ensure_process_group(device: torch.device) -> None:
    """A 1-rank group for plain ``python train.py`` runs (the engine needs a process group)."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


EXIT_BARRIER_TIMEOUT_S = 120.0  # seconds the exit barrier waits for the other ranks (gloo)
_exit_teardown_registered = False


def register_exit_teardown() -> None:
    """Register (once per process) ``_teardown_process_group_at_exit`` with ``atexit``."""
    global _exit_teardown_registered
    if not _exit_teardown_registered:
        atexit.register(_teardown_process_group_at_exit)
        _exit_teardown_registered = True


def _teardown_process_group_at_exit() -> None:
    """Barrier, then ``destroy_process_group``, when a script ends without
    ``accelerator.end_training()``.

    Without it the process groups live into interpreter finalization. A gloo worker thread
    (``ProcessGroupGloo::runLoop``) that releases a finished work object (e.g. an all-gather)
    drops its tensors' Python objects and takes the GIL; once ``Py_FinalizeEx`` has begun, taking
    the GIL ends the thread with ``pthread_exit``, whose forced unwind through the C++ destructor
    calls ``std::terminate``: ``terminate called without an active exception``, exit code -6
    (seen in a core dump of rank 1). Destroying the groups here, before finalization, joins those
    threads. The barrier lets no rank tear down while another still sends; on gloo it is a
    ``monitored_barrier`` bounded by ``EXIT_BARRIER_TIMEOUT_S`` seconds. A
    process ending with an uncaught exception skips the barrier (the other ranks may be inside a
    collective it would never match) and leaves the group to the launcher, as before.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return  # the script called end_training() / destroy_process_group() itself
    if getattr(sys, "last_value", None) is not None:
        return  # uncaught exception: do not start a collective that may never complete
    try:
        if dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=EXIT_BARRIER_TIMEOUT_S))
            else:
                dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - at exit, report and let the process end
        print(f"hf_cephalo: could not end the process group cleanly at exit: {exc}",
              file=sys.stderr, flush=True)
