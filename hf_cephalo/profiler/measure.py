"""Profile the whole cluster: ``profile_cluster`` (paper §2.4 profiler; docs/design.md contract 1).

``profile_cluster`` measures on every rank (collective when the world size is > 1), uses the
on-disk cache (``profiles.cache``) when it can, and returns the same ``ClusterProfile`` on
every rank. The measuring lives beside it: ``inputs`` (``MeasureConfig``, synthetic
microbatches), ``hardware`` (device name, capacity, ranks per host), ``model_facts``
(``model_profile``), ``compute`` (one unit's times and memory, ``measure_device``), ``comm``
(the collectives, ``measure_comm``) and ``profile_checks`` (``check_profile_matches`` refuses
a profile of another model or device). This module is their public front: the names in
``__all__`` are imported from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics

import torch
import torch.distributed as dist

from hf_cephalo.engine.compile import CompiledUnits, CompileOptions
from hf_cephalo.engine.rank_precision import DTYPES
from hf_cephalo.models.base import AutocastStagedModel, StagedModel
from hf_cephalo.planner.state import skewed_state_ratios
from hf_cephalo.profiles.cache import (ProfileCache, comm_key, device_key, model_description,
                                       model_fingerprint)
from hf_cephalo.profiler.comm import measure_comm
from hf_cephalo.profiler.compute import measure_device
from hf_cephalo.profiler.emulate import EmulatedStagedModel, EmulationConfig, emulated_device_name
from hf_cephalo.profiler.hardware import (all_gather_objects, device_capacity_bytes,
                                          local_device_name, local_world_size, machine_layout,
                                          preserved_rng, rank_and_world_size)
from hf_cephalo.profiler.inputs import (MakeMicrobatch, MeasureConfig, build_model_from_config,
                                        max_positions, precision_tag, sequence_length_of,
                                        synthetic_microbatch)
from hf_cephalo.profiler.model_facts import (boundary_bytes_per_sample, model_dtype,
                                             model_profile, refuse_reshaping_units,
                                             side_bytes_per_sample)
from hf_cephalo.profiler.profile_checks import check_profile_matches, check_profile_precision
from hf_cephalo.profiles.precision import PRECISIONS
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile

__all__ = ["MeasureConfig", "synthetic_microbatch", "build_model_from_config", "model_profile",
           "local_device_name",
           "device_capacity_bytes", "local_world_size", "measure_device", "measure_comm", "profile_cluster",
           "check_profile_matches", "check_profile_precision", "sequence_length_of", "max_positions",
           "precision_tag", "PRECISIONS",
           "boundary_bytes_per_sample", "machine_layout"]


def profile_cluster(staged: StagedModel, config: MeasureConfig | None = None, *,
                    device: torch.device | str = "cpu", emulation: EmulationConfig | None = None,
                    cache: ProfileCache | None | bool = True,
                    group: dist.ProcessGroup | None = None,
                    make_microbatch: MakeMicrobatch | None = None,
                    model_name: str | None = None,
                    remeasure_hint: str | None = None) -> ClusterProfile:
    """Profile every rank and the collectives; the same ``ClusterProfile`` on every rank.

    Collective when a process group with world size > 1 is initialized (every rank must call
    it); plain single-process use needs no process group.

    Args:
        staged: the model (a plain adapter; emulation wraps it here if ``emulation`` slows
            this rank).
        config: what to profile (default ``MeasureConfig()``).
        device: this rank's compute device.
        emulation: per-rank emulated slowdown / memory capacity (recorded in device names and
            capacities, see ``profiler.emulate``). Without an emulated capacity a CPU rank's
            capacity is the host's RAM divided by the ranks on the host
            (``local_world_size``, ``device_capacity_bytes``).
        cache: True (default directory), a ``ProfileCache``, or False/None (always measure).
        make_microbatch: ``m -> microbatch`` override of ``synthetic_microbatch``.
        remeasure_hint: how the caller's user measures again instead of reusing a cached
            measurement (e.g. ``"pass --no-cache"``), said in the one line that reports the
            reuse; default: delete the cached file or point the cache elsewhere.
    The caller's random streams are left as they were (``hardware.preserved_rng``).

    Raises:
        ValueError: bad config or emulation lists that do not match the world size.
    """
    refuse_reshaping_units(staged)
    config = config or MeasureConfig()
    compiled = None
    if config.compile_backend is not None:  # time the units the engine will run
        compiled = CompiledUnits(staged.units(), CompileOptions(backend=config.compile_backend,
                                                                mode=config.compile_mode))
    # the units run compiled while measured only: the model is left as it came (eager)
    with compiled.active(strict=False) if compiled is not None else contextlib.nullcontext(), \
            preserved_rng(device):
        return _profile_cluster(staged, config, device=device, emulation=emulation, cache=cache,
                                group=group, make_microbatch=make_microbatch,
                                model_name=model_name, remeasure_hint=remeasure_hint)


def _measured_model_profile(base: StagedModel, model_name, make_microbatch, device,
                            config: MeasureConfig) -> ModelProfile:
    """The model profile with the bytes per sample the engine keeps measured on ``device``:
    the boundary hidden state and the side inputs (``model_facts``)."""
    make = make_microbatch or (lambda m: synthetic_microbatch(
        base.model, m, config.sequence_length, device))
    return model_profile(base, model_name, boundary_bytes_per_sample(
        base, make, device, config.gather_dtype), precision=config.precision_spec,
        side_bytes_per_sample=side_bytes_per_sample(base, make, device))


def _profile_cluster(staged: StagedModel, config: MeasureConfig, *, device, emulation, cache,
                     group, make_microbatch, model_name, remeasure_hint) -> ClusterProfile:
    """``profile_cluster`` with the units as they are to be timed."""
    device = torch.device(device)
    rank, world_size = rank_and_world_size(group)
    if emulation is not None:
        emulation.check_world_size(world_size)
    slowdown = 1.0 if emulation is None else emulation.slowdown_of(rank)
    cap = None if emulation is None else emulation.cap_of(rank)
    base = staged.inner if isinstance(staged, EmulatedStagedModel) else staged
    timed = AutocastStagedModel(base, torch.device(device).type, DTYPES[config.precision]) \
        if config.precision != "fp32" else base
    measured = EmulatedStagedModel(timed, slowdown, device) if slowdown != 1.0 else timed
    name = emulated_device_name(local_device_name(device), slowdown, cap)
    # Every rank calls it (it may be a collective), capped or not.
    local = local_world_size(group)
    capacity = float(cap) if cap is not None else device_capacity_bytes(device, local)
    dtype = precision_tag(str(model_dtype(base)).replace("torch.", ""), config.precision,
                          config.param_dtype, config.reduce_dtype)
    fingerprint = model_fingerprint(base.model)
    store = ProfileCache() if cache is True else (cache or None)
    # The capacity does not change timings: the key names the (emulated) speed only.
    timing_name = emulated_device_name(local_device_name(device), slowdown, None)
    if config.compile_backend is not None:  # compiled units time differently
        timing_name += f" compiled-{config.compile_backend}-{config.compile_mode or 'default'}"
    key = device_key(fingerprint, timing_name, dtype, config.sequence_length,
                     config.microbatch_sizes)
    dev = store.get_device(key) if store is not None else None
    reused = _all_ranks(dev is not None, device, group, world_size)
    if reused:
        dev.name, dev.memory_capacity_bytes = name, capacity
        if config.prints(rank):
            print(reuse_line(rank, name, store.root / f"{key}.json", world_size, remeasure_hint),
                  flush=True)
    else:
        dev = _measure_in_lockstep(measured, config, device, name, capacity, rank, group,
                                   world_size, make_microbatch)
    gathered = all_gather_objects({"device": dev.to_json(), "key": key}, group, world_size)
    devices = one_profile_per_device([DeviceProfile.from_json(g["device"]) for g in gathered],
                                     [g["key"] for g in gathered])
    if store is not None and not reused:
        store.put_device(key, devices[rank])
    model = _measured_model_profile(base, model_name, make_microbatch, device, config)
    ratios = skewed_state_ratios(model.state_bytes, [d.memory_capacity_bytes for d in devices])
    comm = _cluster_comm(base, store, fingerprint, dtype, [d.name for d in devices], device,
                         config, group, world_size, ratios)
    machines, host_ram = machine_layout(group)
    return ClusterProfile(
        model=model, devices=devices, comm=comm, source="measured",
        offload_activations=device.type == "cuda", machine_of_rank=machines,
        host_memory_bytes=host_ram,
        extra={"model_fingerprint": fingerprint, "model_class": type(base.model).__name__,
               "model_description": model_description(base.model),
               "dtype": dtype, "sequence_length": config.sequence_length,
               "emulated": emulation is not None,
               # where the measured step terms go back at train end (cache.write_back_measured)
               **({"profile_cache": {"root": str(store.root),
                                     "device_keys": [g["key"] for g in gathered]}}
                  if store is not None else {})})


def _measure_in_lockstep(measured, config, device, name, capacity, rank, group, world_size,
                         make_microbatch) -> DeviceProfile:
    """This rank's device profile, measured (collective with world size > 1).

    [Note: lockstep profiling] Every rank measures, in lockstep (a barrier before each timed
    item), even where its own cache entry exists: ranks share the machine's cores and memory
    bandwidth as they will in training, where a fast rank waits for the slow one at every
    collective. Without it a fast rank would finish early and the slow rank would be profiled
    alone, faster than it will train."""
    barrier = (lambda: dist.barrier(group)) if world_size > 1 else None
    any_rank = (lambda flag: not _all_ranks(not flag, device, group, world_size)) \
        if world_size > 1 else None
    rank_codes = (lambda code: _rank_codes(code, device, group, world_size)) \
        if world_size > 1 else None
    return measure_device(measured, config, device=device, name=name, capacity_bytes=capacity,
                          rank=rank, make_microbatch=make_microbatch, before_each=barrier,
                          any_rank=any_rank, rank_codes=rank_codes)


# [Note: one profile per device]
# Ranks whose cache keys are equal (the same device, or the same emulated speed, for the same
# model, dtype, sequence length and microbatch sizes) get ONE device profile: the mean of their
# measured times and the largest of their memory figures. The cache holds one entry per key, so
# every start after the first plans from one profile for them anyway; without this the first
# (cold) start planned from each rank's own noise, e.g. b = 19/13 on two equal CPU ranks whose
# next start, from the cache, planned 16/16. Now the cold start's plan is the cached start's.
# Computed from the gathered profiles, so every rank holds the same result.
_TIMES = ("fwd_s", "bwd_s", "embed_s", "head_s", "microbatch_overhead_s",
          "optimizer_s_per_param", "step_overhead_s")
_BYTES = ("compute_memory_bytes", "head_memory_bytes", "kept_graph_bytes")


def one_profile_per_device(devices: list[DeviceProfile], keys: list[str]) -> list[DeviceProfile]:
    """``devices`` (one per rank) with the ranks of one cache key given one profile ([Note: one
    profile per device]); each rank keeps its own name and memory capacity."""
    out = list(devices)
    for key in dict.fromkeys(keys):
        members = [i for i, k in enumerate(keys) if k == key]
        if len(members) < 2:
            continue
        group = [devices[i] for i in members]
        merged = {f: _combine([getattr(d, f) for d in group], statistics.fmean) for f in _TIMES}
        merged.update({f: _combine([getattr(d, f) for d in group], max) for f in _BYTES})
        for i in members:
            out[i] = dataclasses.replace(devices[i], **merged)
    return out


def _combine(values: list, how):
    """``how`` over the ranks' ``values``: scalars, or lists element by element (None stays)."""
    if any(v is None for v in values):
        return values[0]
    if isinstance(values[0], list):
        return [how(column) for column in zip(*values)]
    return how(values)


def reuse_line(rank: int, name: str, path, world_size: int, hint: str | None = None) -> str:
    """The one line that says a cached measurement was reused instead of timing: whose, from
    which file, measured when, and how to measure again (``hint``, else the cache's way)."""
    import datetime

    try:
        when = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
        measured = f", measured {when:%Y-%m-%d %H:%M} UTC"
    except OSError:
        measured = ""
    ranks = "every rank" if world_size > 1 else f"rank {rank} ({name})"
    how = hint or "delete that file, or set HF_CEPHALO_PROFILE_CACHE to another directory"
    return (f"[hf-cephalo profile] {ranks}: reused the cached measurement {path}{measured} "
            f"(nothing timed); to measure again: {how}")


def _all_ranks(flag: bool, device, group, world_size: int) -> bool:
    """True iff ``flag`` is True on every rank (one int32 MIN all-reduce when world size > 1)."""
    if world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)  # int32: gloo and NCCL reduce it
    return bool(t.item())


def _rank_codes(code: int, device, group, world_size: int) -> list[int]:
    """Every rank's ``code`` (one int64 SUM all-reduce of a one-hot row), in rank order."""
    t = torch.zeros(world_size, dtype=torch.int64, device=device)
    t[dist.get_rank(group)] = int(code)
    dist.all_reduce(t, group=group)
    return [int(c) for c in t.tolist()]


def _cluster_comm(staged, store, fingerprint, dtype, names, device, config, group,
                  world_size, state_ratios=None) -> CommProfile:
    """Cached comm profile if EVERY rank has it with a measured u (one all-reduce decides),
    else measure (even shards and the ``state_ratios`` layout)."""
    if world_size == 1:
        return CommProfile(allgather_s=0.0, reducescatter_s=0.0)
    backend = str(dist.get_backend(group))
    key = comm_key(fingerprint, dtype, names, backend)
    cached = store.get_comm(key) if store is not None else None
    usable = cached is not None and cached.uneven_factor is not None
    if _all_ranks(usable, device, group, world_size):
        times = torch.tensor([cached.allgather_s, cached.reducescatter_s, cached.uneven_factor,
                              cached.root_allgather_s, cached.root_reducescatter_s,
                              cached.allreduce_s, cached.collective_wait_s],
                             dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        return CommProfile(allgather_s=float(times[0]), reducescatter_s=float(times[1]),
                           uneven_factor=float(times[2]),
                           uneven_state_ratios=cached.uneven_state_ratios,
                           root_allgather_s=float(times[3]),
                           root_reducescatter_s=float(times[4]), allreduce_s=float(times[5]),
                           collective_wait_s=float(times[6]),
                           overlaps_compute=cached.overlaps_compute)
    comm = measure_comm(staged, device=device, repeats=config.comm_repeats, group=group,
                        state_ratios=state_ratios)
    if store is not None:
        store.put_comm(key, comm)
    return comm
