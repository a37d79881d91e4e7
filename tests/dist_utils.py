"""Run a function on several gloo ranks in fresh processes, with a hard timeout.

Each test module should call ``run_ranks`` few times and loop over many sub-cases inside the
function. Ranks are forked from one forkserver per test session that has already imported
torch, transformers, accelerate, PEFT, TRL and hf_cephalo, so a rank starts in tens of
milliseconds instead of the 2-5 s those imports cost per process on 2 cores; each rank still
starts from a clean interpreter state (the server never runs test code) and gets the parent's
current environment variables, working directory and ``sys.path``.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


SLOWDOWN = float(os.environ.get("CEPHALO_TEST_SLOWDOWN", "6"))
"""How many times slower than measured a machine may be before a multi-process test times out.

[Note: test time budgets]
A hang must fail a test, yet a busy CI machine (2 cores shared with other jobs) must not: each
multi-process job gets ``budget_s(quiet_s)`` = SLOWDOWN x its measured time (measured on the
2-core development machine, itself under load 5-8, so the quiet time is smaller still), and
each test that runs such jobs (its module fixture included: pytest-timeout counts fixture
setup against the first test that needs it) gets ``test_timeout(...)``, the sum of its jobs'
budgets plus a margin, so the job's own timeout (which names the hung ranks) fires first.
The README's test command runs two pytest workers, so a job may share the cores with another
file's job: measured at most 3x its time alone, inside the factor. Override with
CEPHALO_TEST_SLOWDOWN (e.g. 10 on a very slow machine).
"""


def budget_s(quiet_s: float) -> float:
    """Seconds a job measured at ``quiet_s`` seconds may take: SLOWDOWN x quiet_s."""
    return SLOWDOWN * quiet_s


def test_timeout(*quiet_s: float, margin_s: float = 60.0):
    """``pytest.mark.timeout`` for a test (or module) running jobs of ``quiet_s`` seconds each
    one after the other: the sum of their budgets plus ``margin_s`` seconds (imports,
    single-process work)."""
    import pytest

    return pytest.mark.timeout(sum(budget_s(q) for q in quiet_s) + margin_s)


test_timeout.__test__ = False  # not a test, despite its name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed", "numpy", "transformers", "accelerate", "datasets",
            "peft", "trl", "hf_cephalo", "hf_cephalo.engine", "hf_cephalo.models",
            "hf_cephalo.integrations", "tests.dist_utils"]
"""Modules the forkserver imports once (a missing optional one is skipped by multiprocessing)."""

_context = None


def _mp_context():
    """The session's forkserver context, started with ``_PRELOAD`` imported (once)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out,
            env: dict) -> None:
    import gc

    import torch
    import torch.distributed as dist

    # The preloaded modules' ~430k objects are never garbage: out of the collector's sight, a
    # gc.collect() (stock Trainer.train runs one through accelerate's free_memory) takes ~1 ms
    # instead of 0.2-0.4 s; what the test creates is collected as before
    gc.freeze()
    os.environ.clear()  # the forkserver's environment is the one it started with
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        out.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent, including assertion errors
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(fn: Callable, world_size: int, *args: Any) -> tuple[list, Any]:
    """Start ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (daemon processes);
    return the processes and the queue each puts ``(rank, "ok" | "error", payload)`` on."""
    ctx = _mp_context()
    out = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out, env),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, out


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be a module-level function (spawned processes import it). Raises AssertionError
    with the failing rank's traceback, or TimeoutError (all processes killed) after
    ``timeout_s`` seconds so a hung collective fails the test instead of stalling CI.
    """
    procs, out = start_ranks(fn, world_size, *args)
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = out.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} did not "
                                   f"finish within {timeout_s} s (hang?)") from None
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are probably blocked in a collective now
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def portable(obj: Any, to_numpy: bool) -> Any:
    """Tensors <-> numpy arrays inside dicts, lists and tuples (tuples come back as lists):
    results cross process boundaries by value (torch's queue pickling shares memory with the
    worker, which has exited by then). bf16 tensors travel as their int16 bits (numpy has no
    bf16)."""
    import numpy as np
    import torch

    if to_numpy and isinstance(obj, torch.Tensor) and obj.dtype == torch.bfloat16:
        return {"__bf16__": obj.view(torch.int16).numpy()}
    if not to_numpy and isinstance(obj, dict) and "__bf16__" in obj:
        return torch.from_numpy(obj["__bf16__"]).view(torch.bfloat16)
    if isinstance(obj, dict):
        return {k: portable(v, to_numpy) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v, to_numpy) for v in obj]
    if to_numpy and isinstance(obj, torch.Tensor):
        return obj.numpy()
    if not to_numpy and isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    return obj
