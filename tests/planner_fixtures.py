"""Shared helpers for planner tests: random monotone profiles and a brute-force solver."""

from __future__ import annotations

import numpy as np

from hf_cephalo.planner import cost, memory
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile

GIB = float(1 << 30)


def random_device(rng: np.random.Generator, name: str, shared_memory=None) -> DeviceProfile:
    """Monotone profile: sublinear times for small m; memory either random or a shared line."""
    # A shared memory line needs >= 2 points (one point extrapolates through the origin).
    n = int(rng.integers(1 if shared_memory is None else 2, 5))
    ms = sorted({1, *rng.choice(np.arange(2, 9), size=n - 1, replace=False).tolist()})
    base = rng.uniform(0.5, 3.0)
    fwd = np.cumsum(rng.uniform(0.2, 1.0, size=len(ms))) * base
    bwd = fwd * rng.uniform(1.5, 2.5)
    if shared_memory is None:
        mem0, slope = rng.uniform(0.0, 2.0), rng.uniform(0.3, 2.0)
    else:
        mem0, slope = shared_memory
    mem = [(mem0 + slope * m) * GIB for m in ms]
    device = DeviceProfile(name=name, memory_capacity_bytes=float(rng.uniform(2.0, 16.0)) * GIB,
                           microbatch_sizes=ms, fwd_s=fwd.tolist(), bwd_s=bwd.tolist(),
                           compute_memory_bytes=mem)
    # Half the devices carry the step terms outside the units (cost.py [Note: step terms]),
    # drawn from their own stream so the instances above stay those of older versions.
    sub = np.random.default_rng(int(fwd.sum() * 1e6) % (1 << 32))
    if sub.random() < 0.5:
        device.embed_s = (fwd * sub.uniform(0.1, 1.0)).tolist()
        device.head_s = (fwd * sub.uniform(0.2, 3.0)).tolist()
        device.microbatch_overhead_s = float(sub.uniform(0.0, 0.3)) * float(fwd[0])
        device.optimizer_s_per_param = float(sub.uniform(0.0, 1e-3))
        device.step_overhead_s = float(sub.uniform(0.0, 2.0))
    return device


def with_kept_graphs(rng: np.random.Generator, cluster: ClusterProfile) -> ClusterProfile:
    """The cluster with a random ``kept_graph_bytes`` line on every device profile (0.05-1.5 x
    the activation memory at each m), so plans without activation checkpointing can be priced."""
    for d in {id(d): d for d in cluster.devices}.values():
        d.kept_graph_bytes = [float(v) * float(rng.uniform(0.05, 1.5))
                              for v in d.compute_memory_bytes]
    return cluster


def random_cluster(rng: np.random.Generator, n: int, shared_memory=None) -> ClusterProfile:
    kinds = [random_device(rng, f"gpu{k}", shared_memory) for k in range(int(rng.integers(1, n + 1)))]
    devices = [kinds[int(rng.integers(0, len(kinds)))] for _ in range(n)]
    # Training state between 5 % and 110 % of the usable memory: feasible and infeasible mixes.
    total = 0.8 * sum(d.memory_capacity_bytes for d in devices)
    units = int(rng.integers(1, 5))
    model = ModelProfile(name="rand", num_units=units, params_per_unit=1, params_other=0,
                         state_bytes_per_param=float(rng.uniform(0.05, 1.1)) * total / units)
    comm = CommProfile(allgather_s=float(rng.uniform(0, 4)), reducescatter_s=float(rng.uniform(0, 4)))
    # a quarter of the clusters adds the collectives to the compute (CPU ranks, gloo), from a
    # stream of their own so the instances above stay those of older versions
    comm.overlaps_compute = np.random.default_rng(int(comm.allgather_s * 1e6)).random() >= 0.25
    return ClusterProfile(model=model, devices=devices, comm=comm)


def with_host_limits(rng: np.random.Generator, cluster: ClusterProfile, B: int) -> ClusterProfile:
    """The cluster with offload on, boundary activations, random machines and host RAM (each
    machine takes 0.3-1.5 x its even share of ``B`` samples)."""
    n = cluster.world_size
    machines = sorted(int(k) for k in rng.integers(0, max(1, n // 2) + 1, size=n))
    ids = {k: i for i, k in enumerate(dict.fromkeys(machines))}
    model = cluster.model
    model.boundary_bytes_per_sample = float(rng.uniform(0.005, 0.05)) * GIB
    per_sample = (model.num_units + 1) * model.boundary_bytes_per_sample
    cluster.offload_activations = True
    cluster.machine_of_rank = [ids[k] for k in machines]
    share = B / len(ids) / 0.8
    cluster.host_memory_bytes = [float(rng.uniform(0.3, 1.5)) * share * per_sample for _ in ids]
    return cluster


def brute_force(cluster: ClusterProfile, B: int, c: float = 0.8, allow_idle: bool = True,
                activation_checkpointing: bool = True, rows_per_sample: int = 1) -> float:
    """min over every assignment of max_i T_i with u decided by the assignment; inf if none.

    Memory per rank is ``memory.rank_memory_bytes``; with host RAM figures each machine's
    pinned offload bytes must fit c × its RAM. ``activation_checkpointing``: the engine
    setting both are priced for. ``rows_per_sample`` k: b and m count samples of k rows each,
    priced with the per-row profile's functions at k·m and k·b rows (planner/rows.py).
    """
    k = rows_per_sample
    ac = {"activation_checkpointing": activation_checkpointing}
    devs, comm = cluster.devices, cluster.comm
    N, S = len(devs), cluster.model.state_bytes
    total_cap = c * sum(d.memory_capacity_bytes for d in devs)
    per_rank = []
    for i, d in enumerate(devs):
        idle_mem = float(memory.rank_memory_bytes(cluster, i, 0, 0, **ac))
        opts = [(0, 0, idle_mem, cost.idle_unit_time_s(comm, False),
                 cost.idle_unit_time_s(comm, True))] \
            if allow_idle and idle_mem <= c * d.memory_capacity_bytes else []
        for m in range(1, B + 1):
            f, bw = float(cost.fwd_time_s(d, k * m)), float(cost.bwd_time_s(d, k * m))
            for l in range(1, B // m + 1):
                mem = float(memory.rank_memory_bytes(cluster, i, k * m, k * l * m, **ac))
                if mem > c * d.memory_capacity_bytes:
                    continue
                # the compute phase per unit (cost.py [Note: step terms])
                extra = float(cost.rank_extra_s(cluster, i, k * l * m, k * m)) / \
                    cluster.model.num_units
                opts.append((l * m, m, mem,
                             float(cost.unit_time_s(f, bw, l, comm, False, **ac)) + extra,
                             float(cost.unit_time_s(f, bw, l, comm, True, **ac)) + extra))
        per_rank.append(opts)
    best = np.inf

    def host_ok(chosen) -> bool:
        if cluster.host_memory_bytes is None:
            return True
        need = [0.0] * len(cluster.host_memory_bytes)
        for k, o in zip(cluster.machines_of_ranks, chosen):
            need[k] += float(memory.host_memory_bytes(cluster.model, rows_per_sample * o[0],
                                                      cluster.offload_activations))
        return all(x <= c * h * (1 + 1e-12) for x, h in zip(need, cluster.host_memory_bytes))

    def rec(i, left, chosen):
        nonlocal best
        if i == N:
            if left:
                return
            mems = [o[2] for o in chosen]
            if S + sum(mems) > total_cap or not host_ok(chosen):
                return
            uneven = any(S / N + mem > c * d.memory_capacity_bytes for d, mem in zip(devs, mems))
            t = max(o[4] if uneven else o[3] for o in chosen)
            best = min(best, t)
            return
        for o in per_rank[i]:
            if o[0] <= left:
                rec(i + 1, left - o[0], chosen + [o])

    rec(0, B, [])
    return best


def brute_force_scored(cluster: ClusterProfile, B: int, scoring_passes: float, c: float = 0.8,
                       allow_idle: bool = True) -> tuple[float, list[tuple[int, ...]]]:
    """(min, argmins) over every assignment of the per-unit RL-step objective
    max_i (T_i + extra_i / L) + k·max_i s_i, with s_i one unit of rank i's forward-only scoring
    pass (``cost.forward_unit_time_s`` of Σ_j F_i(m_j), as ``generation.forward_pass_s``) and
    u decided by the assignment, as ``brute_force``; argmins: the batch splits (b_i) reaching
    the minimum; (inf, []) if none fits. No host-memory limits."""
    assert cluster.host_memory_bytes is None
    devs, comm, L = cluster.devices, cost.unit_comm(cluster), cluster.model.num_units
    N, S = len(devs), cluster.model.state_bytes
    per_rank = []
    for i, d in enumerate(devs):
        idle_mem = float(memory.rank_memory_bytes(cluster, i, 0, 0))
        opts = [(0, idle_mem, [cost.idle_unit_time_s(comm, u) for u in (False, True)],
                 [float(cost.forward_unit_time_s(0.0, comm, u)) for u in (False, True)])] \
            if allow_idle and idle_mem <= c * d.memory_capacity_bytes else []
        for m in range(1, B + 1):
            f, bw = float(cost.fwd_time_s(d, m)), float(cost.bwd_time_s(d, m))
            for l in range(1, B // m + 1):
                mem = float(memory.rank_memory_bytes(cluster, i, m, l * m))
                if mem > c * d.memory_capacity_bytes:
                    continue
                extra = float(cost.rank_extra_s(cluster, i, l * m, m)) / L
                fwd = cost.rank_compute_s(d, l * m, m).fwd_s
                opts.append((l * m, mem,
                             [float(cost.unit_time_s(f, bw, l, comm, u)) + extra
                              for u in (False, True)],
                             [float(cost.forward_unit_time_s(fwd, comm, u))
                              for u in (False, True)]))
        per_rank.append(opts)
    found: list[tuple[float, tuple[int, ...]]] = []

    def rec(i, left, chosen):
        if i == N:
            mems = [o[1] for o in chosen]
            if left or S + sum(mems) > c * sum(d.memory_capacity_bytes for d in devs):
                return
            u = int(any(S / N + mem > c * d.memory_capacity_bytes for d, mem in zip(devs, mems)))
            found.append((max(o[2][u] for o in chosen)
                          + scoring_passes * max(o[3][u] for o in chosen),
                          tuple(o[0] for o in chosen)))
            return
        for o in per_rank[i]:
            if o[0] <= left:
                rec(i + 1, left - o[0], chosen + [o])

    rec(0, B, [])
    if not found:
        return np.inf, []
    best = min(v for v, _ in found)
    return best, sorted({b for v, b in found if v <= best + 1e-9 * max(1.0, best)})


def forward_heavy_pair() -> ClusterProfile:
    """Rank 0's forward is slow against its backward (F 30 ms, B 2 ms per sample and unit:
    training 2F + B = 62 ms, a scoring pass 30 ms), rank 1's the other way (F 6 ms, B 30 ms:
    training 42 ms, scoring 6 ms); 4 units, ample memory, 1 ms collectives. B = 12 plans
    b = (5, 7) for training alone, (4, 8) with one scoring pass, (2, 10) with two."""
    ms = [1, 2, 4, 8]

    def device(name, fwd, bwd):
        return DeviceProfile(name=name, memory_capacity_bytes=16 * GIB, microbatch_sizes=ms,
                             fwd_s=[fwd * m for m in ms], bwd_s=[bwd * m for m in ms],
                             compute_memory_bytes=[0.1 * GIB * m for m in ms])

    model = ModelProfile(name="toy", num_units=4, params_per_unit=1, params_other=0,
                         state_bytes_per_param=GIB)
    return ClusterProfile(model=model, devices=[device("fwd-heavy", 0.030, 0.002),
                                                device("bwd-heavy", 0.006, 0.030)],
                          comm=CommProfile(allgather_s=0.001, reducescatter_s=0.001),
                          extra={"sequence_length": 64})
