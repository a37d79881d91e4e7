"""Exactness of the optimizer: brute force, the paper's recurrence, the public 24/12 GB failure."""

import dataclasses
import importlib

import numpy as np
import pytest

from hf_cephalo.planner import cost, memory
from hf_cephalo.planner.optimize import InfeasiblePlanError, optimize, solve_assignment
from hf_cephalo.planner.reference import reference_unit_time
from hf_cephalo.planner.simulate import predict
from hf_cephalo.planner.types import Plan
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile
from tests.planner_fixtures import (GIB, brute_force, brute_force_scored, forward_heavy_pair,
                                   random_cluster, with_host_limits, with_kept_graphs)


def _same(a: float, b: float) -> bool:
    if not (np.isfinite(a) and np.isfinite(b)):  # inf - inf <= 1e-12 * inf would accept anything
        return a == b
    return a == b or abs(a - b) <= 1e-12 * max(1.0, abs(b))


def _solve_or_inf(cluster, B, allow_idle=True) -> float:
    try:
        return solve_assignment(cluster, B, allow_idle=allow_idle).unit_time_s
    except InfeasiblePlanError:
        return float("inf")


def _check_assignment(cluster, B, a, c=0.8):
    """The returned assignment itself satisfies (I)-(III) and achieves the claimed time."""
    assert sum(a.batch_sizes) == B
    devs, S = cluster.devices, cluster.model.state_bytes
    mems = []
    for i, (d, b, m, l) in enumerate(zip(devs, a.batch_sizes, a.microbatch_sizes,
                                         a.num_microbatches)):
        assert b == l * m
        mem = float(memory.rank_memory_bytes(cluster, i, m, b))
        mems.append(mem)
        assert mem <= c * d.memory_capacity_bytes * (1 + 1e-12)
    assert S + sum(mems) <= c * sum(d.memory_capacity_bytes for d in devs) * (1 + 1e-12)
    uneven = cost.is_uneven(cluster, mems, c)
    # the compute phase per unit: T_i plus the root compute and bookkeeping over L units
    times = [cost.idle_unit_time_s(cluster.comm, uneven) if b == 0 else
             float(cost.unit_time_s(cost.fwd_time_s(d, m), cost.bwd_time_s(d, m), l,
                                    cluster.comm, uneven))
             + float(cost.rank_extra_s(cluster, i, b, m)) / cluster.model.num_units
             for i, (d, b, m, l) in enumerate(zip(devs, a.batch_sizes, a.microbatch_sizes,
                                                  a.num_microbatches))]
    assert _same(max(times), a.unit_time_s)


def test_equals_brute_force_on_random_instances():
    rng = np.random.default_rng(2024)
    outcomes = {"feasible": 0, "infeasible": 0, "uneven": 0, "idle": 0}
    for k in range(320):
        n, B = int(rng.integers(1, 5)), int(rng.integers(1, 17))
        cluster = random_cluster(rng, n)
        allow_idle = k % 4 != 0
        expected = brute_force(cluster, B, allow_idle=allow_idle)
        got = _solve_or_inf(cluster, B, allow_idle)
        assert _same(got, expected), (k, n, B, got, expected)
        if np.isfinite(got):
            a = solve_assignment(cluster, B, allow_idle=allow_idle)
            _check_assignment(cluster, B, a)
            outcomes["feasible"] += 1
            outcomes["uneven"] += a.uneven
            outcomes["idle"] += 0 in a.batch_sizes
        else:
            outcomes["infeasible"] += 1
    # the instances exercise every branch, not just the easy one
    assert min(outcomes.values()) >= 10, outcomes


def test_engine_buffers_stash_and_host_memory_equal_brute_force():
    """Units of real size (the engine's buffers matter), boundary activations stashed on the
    device or offloaded to host RAM shared per machine: still the exact optimum."""
    rng = np.random.default_rng(7)
    outcomes = {"feasible": 0, "infeasible": 0, "host binds": 0, "uneven": 0}
    for k in range(160):
        n, B = int(rng.integers(1, 5)), int(rng.integers(1, 13))
        cluster = random_cluster(rng, n)
        model = cluster.model
        model.params_per_unit, model.params_other = 1000, int(rng.integers(0, 3000))
        model.state_bytes_per_param /= 1000
        model.param_bytes = float(rng.uniform(0.0, 0.1)) * GIB / 1000
        if k % 2:
            cluster = with_host_limits(rng, cluster, B)
        else:
            model.boundary_bytes_per_sample = float(rng.uniform(0.0, 0.1)) * GIB
        expected = brute_force(cluster, B)
        got = _solve_or_inf(cluster, B)
        assert _same(got, expected), (k, n, B, got, expected)
        if np.isfinite(got):
            a = solve_assignment(cluster, B)
            _check_assignment(cluster, B, a)
            outcomes["feasible"] += 1
            outcomes["uneven"] += a.uneven
        else:
            outcomes["infeasible"] += 1
        if k % 2:
            free = dataclasses.replace(cluster, host_memory_bytes=None)
            outcomes["host binds"] += not _same(_solve_or_inf(free, B), got)
    assert min(outcomes.values()) >= 8, outcomes


def test_host_memory_error_names_the_machines():
    cluster = _two_card_cluster()
    cluster.model.boundary_bytes_per_sample = 0.1 * GIB
    cluster.offload_activations = True
    cluster.machine_of_rank = [0, 0]
    cluster.host_memory_bytes = [4 * 13 * 0.1 * GIB]  # 0.8 x 5.2 GiB: 3 samples of 1.3 GiB
    with pytest.raises(InfeasiblePlanError, match=r"host memory: the offloaded boundary "
                       r"activations need 1\.3 GiB .*machine 0: 4\.2 GiB = 3 samples"):
        optimize(cluster, 8)
    plan = optimize(cluster, 3)
    assert plan.global_batch_size == 3 and predict(plan, cluster).machines[0].fits


def test_equals_paper_recurrence_on_small_instances():
    rng = np.random.default_rng(7)
    finite = 0
    for _ in range(60):
        n, B = int(rng.integers(1, 5)), int(rng.integers(1, 13))
        shared = (float(rng.uniform(0.0, 2.0)), float(rng.uniform(0.3, 2.0)))
        cluster = random_cluster(rng, n, shared_memory=shared)
        ref = reference_unit_time(cluster, B)
        assert _same(_solve_or_inf(cluster, B, allow_idle=False), ref)
        assert _same(brute_force(cluster, B, allow_idle=False), ref)
        finite += bool(np.isfinite(ref))
    assert finite >= 15


def test_reference_rejects_per_device_memory_models():
    rng = np.random.default_rng(3)
    cluster = random_cluster(rng, 3)
    while len({cost.memory_line(d) for d in cluster.devices}) < 2:
        cluster = random_cluster(rng, 3)
    with pytest.raises(ValueError, match="one compute-memory model"):
        reference_unit_time(cluster, 4)


def _two_card_cluster(state_gib=8.0):
    """A 24 GiB card beside a 12 GiB card of half the speed (the public failure)."""
    ms = [1, 2, 4, 8]

    def dev(name, cap_gib, sec_per_sample):
        return DeviceProfile(name=name, memory_capacity_bytes=cap_gib * GIB, microbatch_sizes=ms,
                             fwd_s=[0.002 + sec_per_sample * m for m in ms],
                             bwd_s=[0.004 + 2 * sec_per_sample * m for m in ms],
                             compute_memory_bytes=[(0.5 + 0.75 * m) * GIB for m in ms])

    model = ModelProfile(name="toy", num_units=12, params_per_unit=int(state_gib * GIB / 16 / 12),
                         params_other=0)
    return ClusterProfile(model=model, devices=[dev("big", 24, 0.01), dev("small", 12, 0.02)],
                          comm=CommProfile(allgather_s=0.005, reducescatter_s=0.005))


def test_public_failure_fast_big_card_gets_twice_the_batch():
    cluster = _two_card_cluster()
    B = 24
    plan = optimize(cluster, B)
    big, small = plan.ranks
    assert 1.6 <= big.batch_size / small.batch_size <= 2.5, plan.batch_sizes
    pred = predict(plan, cluster)
    assert pred.fits
    for r, p in zip(plan.ranks, pred.ranks):
        assert p.memory_bytes <= 0.8 * r.memory_capacity_bytes
        assert r.predicted_memory_bytes == pytest.approx(p.memory_bytes)
    # the even split either runs the small card out of memory or is slower
    even = [predict(Plan.even(2, B, m), cluster) for m in range(1, B // 2 + 1)]
    assert not predict(Plan.even(2, B), cluster).fits  # one microbatch of 12: OOM on 12 GiB
    best_even = min(p.iteration_s for p in even if p.fits)
    assert plan.predicted_iteration_s < best_even
    assert plan.predicted_iteration_s == pytest.approx(pred.iteration_s)


def test_uneven_plan_state_partition_keeps_every_rank_under_cap():
    rng = np.random.default_rng(11)
    seen_uneven = 0
    for _ in range(150):
        cluster = random_cluster(rng, int(rng.integers(2, 5)))
        try:
            plan = optimize(cluster, int(rng.integers(1, 17)))
        except InfeasiblePlanError:
            continue
        pred = predict(plan, cluster)
        assert pred.fits, plan
        seen_uneven += plan.uneven_state
        if not plan.uneven_state:
            assert plan.state_ratios == [1 / cluster.world_size] * cluster.world_size
    assert seen_uneven >= 5


def test_error_aggregate_memory_names_the_numbers():
    cluster = _two_card_cluster(state_gib=40.0)  # 40 GiB state > 0.8 x 36 GiB
    with pytest.raises(InfeasiblePlanError,
                       # least compute: one rank at m = 1 (1.25 GiB + the engine's buffers,
                       # 4.5 units of 40 GiB / 16 / 12 params x 4 B = 3.75 GiB), one idle rank
                       # (its buffers: a unit gathered, its zero reduce-scatter input + half-unit
                       # output, the next all-gather, the previous reduce-scatter: 5 units =
                       # 4.2 GiB)
                       match=r"aggregate memory: model state 40\.0 GiB \+ compute 9\.2 GiB "
                             r"exceeds 0\.8 × 36\.0 GiB, at any global batch size"
                             r" \(B = 1 still needs compute 9\.2 GiB\)") as e:
        optimize(cluster, 8)
    # the state alone exceeds the budget: no smaller global batch is a remedy
    assert e.value.constraint == "state"


def test_error_microbatch_one_too_big_names_the_rank():
    cluster = _two_card_cluster()
    for d in cluster.devices:
        d.compute_memory_bytes = [x + 20 * GIB for x in d.compute_memory_bytes]
    with pytest.raises(ValueError) as e:
        optimize(cluster, 8)
    msg = str(e.value)
    # 21.25 GiB of activations + the engine's buffers (4.5 units of 8 GiB / 16 / 12 params)
    assert "rank 0 (big): microbatch size 1 needs 22.0 GiB, cap 19.2 GiB" in msg
    assert "rank 1 (small): microbatch size 1 needs 22.0 GiB, cap 9.6 GiB" in msg
    # with idle ranks forbidden, one rank that cannot run m = 1 is enough
    cluster = _two_card_cluster()
    cluster.devices[1].compute_memory_bytes = [x + 12 * GIB for x in
                                               cluster.devices[1].compute_memory_bytes]
    assert optimize(cluster, 8).batch_sizes == [8, 0]
    with pytest.raises(ValueError, match=r"rank 1 \(small\): microbatch size 1"):
        optimize(cluster, 8, allow_idle=False)


@pytest.mark.parametrize("B", [0, -3, 2.5, True])
def test_error_bad_batch_size(B):
    with pytest.raises(ValueError, match="global batch size"):
        optimize(_two_card_cluster(), B)


def test_error_bad_memory_fraction():
    with pytest.raises(ValueError, match="memory fraction"):
        optimize(_two_card_cluster(), 8, memory_fraction=1.5)


def test_idle_rank_is_allowed_and_priced():
    cluster = _two_card_cluster()
    cluster.devices[1].fwd_s = [x * 1000 for x in cluster.devices[1].fwd_s]  # useless card
    plan = optimize(cluster, 4)
    assert plan.batch_sizes == [4, 0]
    small = plan.ranks[1]
    assert (small.microbatch_size, small.num_microbatches) == (0, 0)
    assert small.state_ratio > 0  # an idle rank still holds state


def _spec_cluster(copies):
    from hf_cephalo.profiles.specs import ClusterSpec, estimate_cluster_profile

    machines = ([["A10G"] * 8] * 2 + [["V100-16GB"] * 8] * 2 + [["T4"] * 8] * 4) * copies
    return estimate_cluster_profile(ClusterSpec(name="b", machines=machines,
                                                interconnect_gbps=100), "gpt-6.7b")


def test_too_large_instances_are_refused_upfront():
    opt = importlib.import_module("hf_cephalo.planner.optimize")
    from hf_cephalo.planner.solver import device_groups
    from hf_cephalo.profiles.specs import estimate_cluster_profile, load_cluster_yaml

    cluster = estimate_cluster_profile(load_cluster_yaml("examples/clusters/cluster_a.yaml"),
                                       "llama-3b")
    # Absurd B: refused from closed-form estimates, before anything of size B is allocated
    # (without the check this raised MemoryError or ran out of memory).
    for B in (10**15, 10**8, 10**6):
        with pytest.raises(ValueError) as e:
            optimize(cluster, B)
        msg = str(e.value)
        assert f"global batch size {B} is too large" in msg and "8 ranks" in msg
        assert "limit" in msg and "MAX_SOLVER_WORK" in msg
    largest = int(msg.split("limits for this cluster is ")[1].split(".")[0])
    assert 10**4 < largest < 10**6
    opt.check_problem_size(cluster, largest)
    with pytest.raises(ValueError, match="too large"):
        opt.check_problem_size(cluster, largest + 1)
    # The documented targets stay inside the limits: 512 GPUs at B = 4096, and 512 ranks
    # whose measured profiles all differ (no grouping of identical devices).
    big = _spec_cluster(8)
    opt.check_problem_size(big, 4096)
    big.devices = [dataclasses.replace(d, fwd_s=[f * (1 + 1e-4 * i) for f in d.fwd_s])
                   for i, d in enumerate(big.devices)]
    assert len(device_groups(big)) == 512
    opt.check_problem_size(big, 4096)
    work, mem = opt.estimate_problem_size(big, 4096)
    assert work <= opt.MAX_SOLVER_WORK and mem <= opt.MAX_SOLVER_MEMORY_BYTES


def test_problem_size_limit_is_the_module_constant(monkeypatch):
    opt = importlib.import_module("hf_cephalo.planner.optimize")

    cluster = _two_card_cluster()
    optimize(cluster, 64)
    monkeypatch.setattr(opt, "MAX_SOLVER_WORK", 1.0)
    with pytest.raises(ValueError, match=r"global batch size 64 is too large .*limit 1"):
        optimize(cluster, 64)


def test_error_messages_use_adaptive_units():
    dev = DeviceProfile(name="tiny", memory_capacity_bytes=100_000, microbatch_sizes=[1, 2],
                        fwd_s=[0.01, 0.02], bwd_s=[0.02, 0.04],
                        compute_memory_bytes=[200_000, 300_000])
    cluster = ClusterProfile(model=ModelProfile(name="t", num_units=1, params_per_unit=10,
                                                params_other=0),
                             devices=[dev], comm=CommProfile(allgather_s=0.0, reducescatter_s=0.0))
    with pytest.raises(InfeasiblePlanError,
                       # 200 000 B of activations + 80 B of engine buffers: the one unit gathered
                       # + its gradient (2 x 10 x 4 B); with one unit and an empty root no other
                       # collective is in flight during its backward
                       match=r"microbatch size 1 needs 195\.4 KiB, cap 78\.1 KiB"):
        optimize(cluster, 4)


# ---- activation checkpointing as a planned choice ------------------------------------------
def test_without_checkpointing_equals_brute_force_on_random_instances():
    """The exact search with activation checkpointing off (kept graphs priced by
    ``kept_graph_bytes``, no recompute in T_i) equals brute force over every assignment."""
    rng = np.random.default_rng(77)
    seen = {"feasible": 0, "infeasible": 0, "uneven": 0}
    for k in range(120):
        n, B = int(rng.integers(1, 4)), int(rng.integers(1, 13))
        cluster = with_kept_graphs(rng, random_cluster(rng, n))
        if k % 3 == 0:  # activation offload and host RAM limits: the stash's other terms
            cluster = with_host_limits(rng, cluster, B)
        expected = brute_force(cluster, B, activation_checkpointing=False)
        try:
            a = solve_assignment(cluster, B, activation_checkpointing=False)
            got = a.unit_time_s
        except InfeasiblePlanError as e:
            got, a = float("inf"), None
            reason = str(e).split(" fits: ", 1)[1]  # never empty, never an empty list item
            assert reason.strip() and ": ;" not in str(e) and not reason.startswith(";"), str(e)
        assert _same(got, expected), (k, n, B, got, expected)
        seen["feasible" if a else "infeasible"] += 1
        seen["uneven"] += bool(a and a.uneven)
    assert min(seen.values()) >= 5, seen


def _kept_cluster(kept_gib: float, capacity_gib: float = 16.0) -> ClusterProfile:
    """Two identical devices, 2 units; activations 0.1 GiB/sample, kept graphs ``kept_gib``
    per sample and unit; backward 2x forward, so no recompute saves 1/4 of the unit time."""
    ms = [1, 2, 4, 8]
    dev = DeviceProfile(name="gpu", memory_capacity_bytes=capacity_gib * GIB,
                        microbatch_sizes=ms, fwd_s=[0.01 * m for m in ms],
                        bwd_s=[0.02 * m for m in ms],
                        compute_memory_bytes=[0.1 * GIB * m for m in ms],
                        kept_graph_bytes=[kept_gib * GIB * m for m in ms])
    model = ModelProfile(name="m", num_units=2, params_per_unit=1000, params_other=0,
                         state_bytes_per_param=16.0)
    return ClusterProfile(model=model, devices=[dev, dataclasses.replace(dev)],
                          comm=CommProfile(allgather_s=0.0, reducescatter_s=0.0))


def test_auto_picks_no_checkpointing_when_it_fits_and_checkpointing_when_only_that_fits():
    small = _kept_cluster(0.05)  # 8 samples x 2 units x 0.05 GiB: fits easily
    auto = optimize(small, 16, activation_checkpointing=None)
    on = optimize(small, 16, activation_checkpointing=True)
    off = optimize(small, 16, activation_checkpointing=False)
    assert auto.activation_checkpointing is False and on.activation_checkpointing is True
    assert auto.predicted_iteration_s == off.predicted_iteration_s < on.predicted_iteration_s
    # no recompute: l·(F + B) instead of l·F + l·(F + B), F = B/2 -> 3/4 of the unit time
    assert off.predicted_iteration_s == pytest.approx(0.75 * on.predicted_iteration_s)
    from hf_cephalo.planner.predict import predicted_unit_compute_s  # what a run's refit scales
    for r in off.ranks:
        fb = r.num_microbatches * 0.03 * r.microbatch_size  # l·(F + B)
        assert predicted_unit_compute_s(off, small, r.rank) == pytest.approx(2 * fb)
    assert predict(auto, small).fits
    big = _kept_cluster(4.0)  # one sample's kept graphs (2 x 4 GiB) do not fit 0.8 x 16 GiB
    with pytest.raises(InfeasiblePlanError):
        optimize(big, 16, activation_checkpointing=False)
    auto = optimize(big, 16, activation_checkpointing=None)
    assert auto.activation_checkpointing is True
    assert auto.predicted_iteration_s == optimize(big, 16).predicted_iteration_s
    # neither fits: the checkpointing plan's error
    with pytest.raises(InfeasiblePlanError, match="no plan for global batch size"):
        optimize(_kept_cluster(4.0, capacity_gib=0.01), 16, activation_checkpointing=None)


def test_no_checkpointing_that_does_not_fit_names_the_kept_graphs_with_numbers():
    """m = 1 fits, but the kept graphs L·b_i·K grow with b_i: each rank takes at most 12 of
    the 64 samples (2 units x 0.5 GiB per sample = 1 GiB per sample, cap 0.8 x 16 GiB). The
    reason says so with numbers (it was empty: "no rank can take a microbatch: ;")."""
    cluster = _kept_cluster(0.5)
    with pytest.raises(InfeasiblePlanError) as info:
        optimize(cluster, 64, activation_checkpointing=False)
    text = str(info.value)
    assert info.value.constraint == "batch" and ": ;" not in text
    assert "no rank can take a microbatch" not in text
    assert "kept forward graphs of all microbatches, L·b_i·K(m_i)" in text and "L = 2" in text
    assert ("ranks 0-1 (gpu): b_i <= 12 (b_i = 13 needs at least 13.0 GiB at m_i = 1, "
            "13.0 GiB of it kept graphs; cap 12.8 GiB)") in text
    assert "together at most 24 samples, fewer than the global batch size 64" in text
    # B = 24 is the largest that fits: the numbers are the planner's own limit
    assert optimize(cluster, 24, activation_checkpointing=False).global_batch_size == 24
    with pytest.raises(InfeasiblePlanError):
        optimize(cluster, 25, activation_checkpointing=False)


def test_auto_says_why_it_chose():
    """``optimize_auto_checkpointing``: the plan of ``optimize(None)`` and the reason printed
    after "[auto: ...]": off did not fit (with its diagnosis), or both predicted times."""
    from hf_cephalo.planner.optimize import optimize_auto_checkpointing

    fits = optimize_auto_checkpointing(_kept_cluster(0.05), 16)
    on = optimize(_kept_cluster(0.05), 16).predicted_iteration_s
    assert fits.plan.activation_checkpointing is False
    assert fits.reason == (f"faster than on, predicted {fits.plan.predicted_iteration_s:.3f} s "
                           f"vs {on:.3f} s")
    big = optimize_auto_checkpointing(_kept_cluster(0.5), 64)
    assert big.plan.activation_checkpointing is True
    assert big.plan.predicted_iteration_s == optimize(_kept_cluster(0.5), 64).predicted_iteration_s
    assert big.reason.startswith("off does not fit: without activation checkpointing the kept ")
    assert "together at most 24 samples" in big.reason
    cluster = _kept_cluster(0.05)
    for d in cluster.devices:
        d.kept_graph_bytes = None
    assert "only on was planned" in optimize_auto_checkpointing(cluster, 16).reason


def test_auto_between_settings_is_the_faster_feasible_one_on_random_instances():
    rng = np.random.default_rng(5)
    picked = {True: 0, False: 0}
    for _ in range(40):
        cluster = with_kept_graphs(rng, random_cluster(rng, int(rng.integers(1, 4))))
        B = int(rng.integers(1, 13))
        times = {}
        for ac in (True, False):
            try:
                times[ac] = optimize(cluster, B, activation_checkpointing=ac).predicted_iteration_s
            except InfeasiblePlanError:
                pass
        if not times:
            continue
        auto = optimize(cluster, B, activation_checkpointing=None)
        assert auto.predicted_iteration_s == min(times.values())
        assert times[auto.activation_checkpointing] == auto.predicted_iteration_s
        picked[auto.activation_checkpointing] += 1
    assert min(picked.values()) >= 3, picked


def test_no_kept_graph_profile_plans_checkpointing_only():
    cluster = _kept_cluster(0.05)
    for d in cluster.devices:
        d.kept_graph_bytes = None
    assert optimize(cluster, 16, activation_checkpointing=None).activation_checkpointing is True
    with pytest.raises(ValueError, match="kept_graph_bytes"):
        optimize(cluster, 16, activation_checkpointing=False)


# ---- scoring passes in the objective (solver.py [Note: scoring passes]) ----------------------
def _scored_objective(cluster, a, k, c=0.8) -> tuple[float, float]:
    """(max_i (T_i + extra_i / L) + k·max_i s_i, max_i s_i) of an assignment, priced as
    ``brute_force_scored`` (u decided by the assignment's memory)."""
    devs, comm = cluster.devices, cost.unit_comm(cluster)
    mems = [float(memory.rank_memory_bytes(cluster, i, m, b))
            for i, (m, b) in enumerate(zip(a.microbatch_sizes, a.batch_sizes))]
    uneven = cost.is_uneven(cluster, mems, c)
    times, scoring = [], []
    for i, (d, b, m, l) in enumerate(zip(devs, a.batch_sizes, a.microbatch_sizes,
                                         a.num_microbatches)):
        times.append(cost.idle_unit_time_s(comm, uneven) if b == 0 else
                     float(cost.unit_time_s(cost.fwd_time_s(d, m), cost.bwd_time_s(d, m), l,
                                            comm, uneven))
                     + float(cost.rank_extra_s(cluster, i, b, m)) / cluster.model.num_units)
        scoring.append(float(cost.forward_unit_time_s(
            cost.rank_compute_s(d, b, max(m, 1)).fwd_s, comm, uneven)))
    return max(times) + k * max(scoring), max(scoring)


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= 1e-9 * max(1.0, abs(b))


@pytest.mark.parametrize("k", [0, 1, 2])
def test_scored_optimum_equals_brute_force_on_random_instances(k):
    """optimize(..., scoring_passes=k) minimizes training + k forward-only passes exactly:
    on 100 random clusters of 2-4 ranks (uneven speeds, forward / backward ratios (backward
    rescaled per device) and memory; even and uneven state, idle ranks, infeasible ones,
    collectives overlapped or not), B <= 12, its plan's objective is
    brute force's minimum over every split, its split is one of brute force's optimal ones,
    and its L x max_i s_i is what ``forward_pass_s`` prices for the plan."""
    from hf_cephalo.planner.generation import forward_pass_s

    rng = np.random.default_rng(46)
    seen = {"feasible": 0, "infeasible": 0, "uneven": 0, "moved by k": 0}
    for case in range(100):
        n, B = int(rng.integers(2, 5)), int(rng.integers(1, 13))
        cluster = random_cluster(rng, n)
        for d in {id(d): d for d in cluster.devices}.values():  # forward / backward ratios
            d.bwd_s = [v * float(rng.uniform(0.05, 1.0)) for v in d.bwd_s]  # that differ more
        expected, splits = brute_force_scored(cluster, B, k)
        try:
            a = solve_assignment(cluster, B, scoring_passes=k)
        except InfeasiblePlanError:
            assert expected == np.inf, (case, expected)
            seen["infeasible"] += 1
            continue
        got, s_max = _scored_objective(cluster, a, k)
        assert _close(got, expected), (case, n, B, got, expected)
        assert tuple(a.batch_sizes) in splits, (case, a.batch_sizes, splits)
        plan = optimize(cluster, B, scoring_passes=k)
        assert plan.batch_sizes == a.batch_sizes
        assert _close(forward_pass_s(plan, cluster), cluster.model.num_units * s_max)
        if k == 0:  # bit-identical to the training-only optimizer
            assert solve_assignment(cluster, B) == a
        seen["feasible"] += 1
        seen["uneven"] += plan.uneven_state
        seen["moved by k"] += a.batch_sizes != solve_assignment(cluster, B).batch_sizes
    assert seen["feasible"] >= 20 and seen["infeasible"] >= 3 and seen["uneven"] >= 3, seen
    if k:  # the passes matter on these clusters, so the test is not vacuous
        assert seen["moved by k"] >= 3, seen


def test_scoring_passes_move_the_batch_off_a_slow_forward_rank():
    """Training alone balances at b = (5, 7) (1.240 s: 4 x max(5 x 62, 7 x 42) ms); with one
    scoring pass (4, 8) is better (1.344 + 0.480 = 1.824 s against 1.240 + 0.600 = 1.840 s),
    with two (2, 10) (1.680 + 2 x 0.240 = 2.160 s against 2.440 s). Each plan is brute
    force's only optimum, and the priced whole step (``scored_step_s``) of every other
    plan is no lower."""
    from hf_cephalo.planner.optimize import scored_step_s

    cluster = forward_heavy_pair()
    plans = {k: optimize(cluster, 12, scoring_passes=k) for k in (0, 1, 2)}
    assert {k: p.batch_sizes for k, p in plans.items()} == \
        {0: [5, 7], 1: [4, 8], 2: [2, 10]}
    for k, plan in plans.items():
        assert brute_force_scored(cluster, 12, k)[1] == [tuple(plan.batch_sizes)]
        for other in plans.values():
            assert scored_step_s(plan, cluster, k) <= scored_step_s(other, cluster, k) + 1e-12
    assert scored_step_s(plans[1], cluster, 1) == pytest.approx(1.824)
    assert scored_step_s(plans[0], cluster, 1) == pytest.approx(1.840)
    assert scored_step_s(plans[2], cluster, 2) == pytest.approx(2.160)
    assert plans[2].predicted_iteration_s == pytest.approx(1.680)  # the training step alone


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "1"])
def test_scoring_passes_must_be_a_finite_number_at_least_zero(bad):
    with pytest.raises(ValueError, match="scoring_passes must be a finite number >= 0"):
        optimize(forward_heavy_pair(), 12, scoring_passes=bad)
