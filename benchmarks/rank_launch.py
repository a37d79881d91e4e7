"""Start a benchmark's ranks; a rank that dies ends the others at once, as the product's launches do.

``run_ranks(target, rank_args, timeout_s=...)`` starts one process per entry of ``rank_args``
(``target(*args, queue)``: the result queue is each target's last argument, as every benchmark's
worker takes it), collects what the ranks put on the queue and returns it. While waiting it
watches every rank: one that exits with a non-zero status (an exception, a kill) or exits without
its result ends every other rank within ``POLL_S`` seconds (SIGKILL: the survivors are blocked
in a collective with the dead rank and would wait for it until killed) and raises RuntimeError
naming the rank and its exit status; the timeout ends them all too. A rank also ends when the
benchmark process itself dies (a watchdog thread joins its parent's sentinel), so no rank outlives
its benchmark ([Note: parent death] in hf_cephalo/parent_death.py for the launcher's version).

Ranks are spawned (a fresh interpreter each, what the measurements assume: an environment
variable such as ``MALLOC_MMAP_THRESHOLD_`` set by the benchmark reaches the new process's
allocator). With ``HF_CEPHALO_BENCH_START=forkserver`` they come from a forkserver that imports
torch, transformers and hf_cephalo once, so a rank starts in a fraction of a second after the
first: the smoke test runs every benchmark in one process that way
(tests/test_benchmarks_smoke.py). Either way each rank gets the benchmark's environment as it
is when the ranks start.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import threading
import time
from typing import Any, Callable, Sequence

__all__ = ["run_ranks", "free_port", "POLL_S", "START_ENV"]

POLL_S = 0.25
"""Seconds between two looks at the ranks' exit statuses while waiting for results."""

_PRELOAD = ["torch", "torch.distributed", "transformers", "hf_cephalo", "hf_cephalo.engine",
            "hf_cephalo.models"]


def free_port() -> int:
    """A free TCP port on the loopback interface (the ranks' MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START_ENV = "HF_CEPHALO_BENCH_START"
"""Environment variable: ``spawn`` (default) or ``forkserver`` (the smoke test's)."""


def _context():
    method = os.environ.get(START_ENV, "spawn")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_ENV}={method!r}: give spawn or forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # no effect once this process's forkserver runs
    return ctx


def _end_with_parent() -> None:
    """End this rank when the benchmark process that started it ends."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)
    threading.Thread(target=watch, name="benchmark-parent-death", daemon=True).start()


def _rank_main(target: Callable, args: tuple, env: dict) -> None:
    _end_with_parent()
    os.environ.clear()  # a forkserver's environment is the one it started with
    os.environ.update(env)
    target(*args)


def run_ranks(target: Callable, rank_args: Sequence[tuple], *, timeout_s: float,
              expect: int | None = None) -> list[Any]:
    """Run ``target(*rank_args[i], queue)`` in one process per rank; return the ``expect``
    items (default: one per rank) the ranks put on ``queue``, in arrival order.

    Raises:
        RuntimeError: a rank exited with a non-zero status, or every rank exited before all
            results came (the others were ended at once).
        TimeoutError: the results did not all come within ``timeout_s`` seconds.
    """
    ctx = _context()
    out = ctx.Queue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(target, (*args, out), env))
             for args in rank_args]
    for p in procs:
        p.start()
    expect = len(procs) if expect is None else expect
    results: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < expect:
            try:
                results.append(out.get(timeout=POLL_S))
                continue
            except queue_module.Empty:
                pass
            if all(p.exitcode == 0 for p in procs):  # what they put before exiting is in
                results += _drain(out, expect - len(results))  # the pipe: read it all first
            _check_ranks(procs, len(results), expect, deadline, timeout_s)
    finally:
        failed = len(results) < expect
        for p in procs:
            if failed and p.is_alive():
                p.kill()
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def _drain(out, most: int) -> list[Any]:
    got = []
    while len(got) < most:
        try:
            got.append(out.get(timeout=1.0))
        except queue_module.Empty:
            break
    return got


def _check_ranks(procs, received: int, expect: int, deadline: float, timeout_s: float) -> None:
    """Raise when a rank died, when every rank has exited short of the results, or past the
    deadline (``run_ranks`` then ends the other ranks)."""
    if received >= expect:
        return
    dead = [f"rank {rank} exited with status {p.exitcode}" for rank, p in enumerate(procs)
            if p.exitcode not in (None, 0)]
    if dead:
        raise RuntimeError(f"benchmark {', '.join(dead)} (traceback above); the other ranks "
                           "were ended")
    if received < expect and all(p.exitcode == 0 for p in procs):
        raise RuntimeError(f"every rank exited but only {received} of {expect} results came")
    if time.monotonic() > deadline:
        raise TimeoutError(f"the ranks did not finish within {timeout_s:.0f} s; they were ended")
