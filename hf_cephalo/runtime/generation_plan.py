"""The generation split g_i and decode mode from measured decode speed (contract 9).

``measure_decode_profiles`` times this job's own decode on every rank (the gather-once mode,
so each rank measures its own compute and memory traffic, no collective inside the timed
steps) at two row counts and fits ``DecodeProfile`` (``planner/generation.py``, [Note: the
decode cost model]); ``plan_generation_split`` prices the round for the engine's model (its
gathered bytes, KV cache per token, the training profile's collective times) and returns the
planner's ``GenerationPlan``: g_i and the mode. ``emulated_decode`` stretches the layers'
decode compute by a rank's emulated slowdown, as ``EmulatedStagedModel`` stretches training
(docs/profiling.md, "Emulated heterogeneity"): forward hooks on the layer modules, timed after
the sharded decode's gather, so collectives keep their real speed; the embedding and the head
are not stretched.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch

from ..engine.generation import gathered_bytes, kv_cache_bytes_per_token
from ..engine.sampling import SamplingParams
from ..planner.generation import DecodeModel, DecodeProfile, GenerationPlan, plan_generation
from ..profiler.emulate import find_emulated
from .generation import generation_budget_bytes

__all__ = ["emulated_decode", "measure_decode_profiles", "decode_model",
           "plan_generation_split"]


@contextlib.contextmanager
def emulated_decode(staged):
    """While decoding: each layer module of ``staged`` (a session's or engine's staged model)
    is timed and followed by a sleep of (slowdown - 1) x its time, when this rank runs an
    emulated slowdown (an ``EmulatedStagedModel`` in the wrapper chain); else nothing."""
    emulated = find_emulated(staged)
    factor = 1.0 if emulated is None else float(emulated.slowdown)
    if factor <= 1.0:
        yield
        return
    starts: dict[int, float] = {}
    handles = []

    def pre(module, args):
        starts[id(module)] = time.perf_counter()

    def post(module, args, output):
        elapsed = time.perf_counter() - starts.pop(id(module), time.perf_counter())
        time.sleep((factor - 1.0) * elapsed)

    try:
        for module in staged.units():
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _timed_round(engine, rows: int, prompt_tokens: int, new_tokens: int, seed: int) -> float:
    """Seconds per decode step of ``rows`` stand-in rows on this rank (gather once; every rank
    calls it with the same arguments; the second of two calls is timed)."""
    params = SamplingParams(max_new_tokens=new_tokens, do_sample=True, eos_token_ids=(),
                            pad_token_id=0, seed=seed)
    prompts = [[1] * prompt_tokens for _ in range(rows)]
    with emulated_decode(engine.staged):
        engine.generate(prompts, list(range(rows)), params, 0, mode="gather_once")
        t0 = time.perf_counter()
        out = engine.generate(prompts, list(range(rows)), params, 1, mode="gather_once")
        return (time.perf_counter() - t0) / max(out.steps, 1)


def measure_decode_profiles(engine, rows: Sequence[int] = (1, 4), prompt_tokens: int = 8,
                            new_tokens: int = 4, *, seed: int = 0,
                            memory_budget_bytes: float | None = None) -> list[DecodeProfile]:
    """Collective: every rank's ``DecodeProfile`` (rank order), fitted to its timed decode
    steps at each row count of ``rows`` (at least two), with this rank's
    ``memory_budget_bytes``. Costs two decode rounds of stand-in prompts per row count on every
    rank."""
    import torch.distributed as dist

    timings = [_timed_round(engine, int(r), prompt_tokens, new_tokens, seed) for r in rows]
    name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    mine = DecodeProfile.from_timings(f"rank {engine.rank} ({name})", rows, timings,
                                      memory_budget_bytes)
    everyone: list = [None] * engine.world_size
    dist.all_gather_object(everyone, mine, group=engine.group)
    return everyone


def decode_model(engine, comm=None) -> DecodeModel:
    """The engine's model as the generation planner prices it: gathered bytes (full, root,
    largest layer unit), KV cache bytes per token, and the collective times of ``comm`` (a
    ``CommProfile``; 0 without one)."""
    full, root, layer = gathered_bytes(engine)
    units = engine.num_units
    element = engine.units[0].param_element_size if engine.units else 4
    kv = kv_cache_bytes_per_token(getattr(engine.staged.model, "config", None), element)
    ag = float(getattr(comm, "allgather_s", 0.0) or 0.0)
    ar = float(getattr(comm, "allreduce_s", 0.0) or 0.0)
    return DecodeModel(weight_bytes=full, root_bytes=root, unit_bytes=layer,
                       num_units=units, kv_bytes_per_token=kv, allgather_s_per_unit=ag,
                       allreduce_s=ar, gather_all_s=ag * (units + 2))


def plan_generation_split(session, rows: int, prompt_tokens: int, new_tokens: int,
                          profiles: Sequence[DecodeProfile] | None = None) -> GenerationPlan:
    """Collective when ``profiles`` is None (they are measured): the planner's g_i and decode
    mode for a round of ``rows`` rows (``plan_generation`` over the session's engine, its
    cluster profile's collective times, each rank's budget from the plan; raises its
    InfeasibleGenerationError)."""
    if profiles is None:
        budget = generation_budget_bytes(session.plan, session.job.rank)
        profiles = measure_decode_profiles(session.engine, seed=session.job.seed,
                                           memory_budget_bytes=budget)
    comm = getattr(session.cluster_profile, "comm", None)
    return plan_generation(list(profiles), decode_model(session.engine, comm), rows,
                           prompt_tokens, new_tokens)
