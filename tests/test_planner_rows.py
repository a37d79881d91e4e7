"""Samples of several rows (planner/rows.py): a per-sample cluster prices a microbatch of m
samples as k·m rows of the per-row profile, exactly; the optimizer's plan on it is the optimum
of a brute force over samples priced with the per-row functions; a pair that does not fit any
rank is one clear error naming it."""

import dataclasses

import numpy as np
import pytest

from hf_cephalo.planner import cost, memory
from hf_cephalo.planner.optimize import InfeasiblePlanError, optimize, solve_assignment
from hf_cephalo.planner.rows import ROWS_PER_SAMPLE_KEY, per_sample_cluster
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile
from tests.planner_fixtures import (GIB, brute_force, random_cluster, with_host_limits,
                                   with_kept_graphs)


def _same(a: float, b: float) -> bool:
    if not (np.isfinite(a) and np.isfinite(b)):
        return a == b
    return a == b or abs(a - b) <= 1e-12 * max(1.0, abs(b))


def _real_units(rng, cluster: ClusterProfile) -> ClusterProfile:
    """Units of real size, a boundary stash and side inputs (engine/schedule.py [Note: side
    inputs]), as test_planner_optimize's engine-buffer case."""
    model = cluster.model
    model.params_per_unit, model.params_other = 1000, int(rng.integers(0, 3000))
    model.state_bytes_per_param /= 1000
    model.param_bytes = float(rng.uniform(0.0, 0.1)) * GIB / 1000
    model.boundary_bytes_per_sample = float(rng.uniform(0.0, 0.1)) * GIB
    model.side_bytes_per_sample = float(rng.uniform(0.0, 0.05)) * GIB  # per-layer inputs
    return cluster


def test_per_sample_terms_equal_per_row_terms_at_k_rows():
    """For every rank and (m, b): M_i, F_i, B_i, root compute and kept graphs of the per-sample
    cluster equal the per-row cluster's at (k·m, k·b), idle ranks unchanged."""
    rng = np.random.default_rng(11)
    for trial in range(12):
        k = 2 + trial % 2
        cluster = with_kept_graphs(rng, _real_units(rng, random_cluster(rng, 3)))
        if trial % 3 == 0:
            cluster = with_host_limits(rng, cluster, 8)
        per_sample = per_sample_cluster(cluster, k)
        assert per_sample.extra[ROWS_PER_SAMPLE_KEY] == k
        assert ROWS_PER_SAMPLE_KEY not in cluster.extra  # the input is not changed
        for i, (row, sample) in enumerate(zip(cluster.devices, per_sample.devices)):
            for m in range(1, 9):
                assert float(cost.fwd_time_s(sample, m)) == float(cost.fwd_time_s(row, k * m))
                assert float(cost.bwd_time_s(sample, m)) == float(cost.bwd_time_s(row, k * m))
                for b in range(m, 9):
                    for ac in (True, False):
                        got = float(memory.rank_memory_bytes(per_sample, i, m, b,
                                                             activation_checkpointing=ac))
                        want = float(memory.rank_memory_bytes(cluster, i, k * m, k * b,
                                                              activation_checkpointing=ac))
                        assert abs(got - want) <= 1e-12 * max(1.0, want), (trial, i, m, b, ac)
                    assert _same(float(cost.rank_extra_s(per_sample, i, b, m)),
                                 float(cost.rank_extra_s(cluster, i, k * b, k * m)))
            assert float(memory.rank_memory_bytes(per_sample, i, 0, 0)) == \
                float(memory.rank_memory_bytes(cluster, i, 0, 0))
            # (k·a)·b against a·(k·b): equal up to the last bit of rounding
            assert _same(float(memory.host_memory_bytes(per_sample.model, 3, True)),
                         float(memory.host_memory_bytes(cluster.model, 3 * k, True)))


def test_optimum_per_sample_equals_brute_force_over_samples_of_k_rows():
    """The exact optimum: the optimizer on the per-sample cluster equals the brute force over
    sample assignments priced with the per-row profile at k rows per sample."""
    rng = np.random.default_rng(5)
    outcomes = {"feasible": 0, "infeasible": 0, "differs from k = 1": 0}
    for trial in range(90):
        n, B, k = int(rng.integers(1, 4)), int(rng.integers(1, 10)), 2 + trial % 2
        cluster = random_cluster(rng, n)
        if trial % 2:
            cluster = _real_units(rng, cluster)
        expected = brute_force(cluster, B, rows_per_sample=k)
        try:
            got = solve_assignment(per_sample_cluster(cluster, k), B).unit_time_s
        except InfeasiblePlanError:
            got = float("inf")
        assert _same(got, expected), (trial, n, B, k, got, expected)
        outcomes["feasible" if np.isfinite(got) else "infeasible"] += 1
        outcomes["differs from k = 1"] += not _same(got, brute_force(cluster, B))
    assert min(outcomes.values()) >= 10, outcomes


def test_without_checkpointing_the_optimum_equals_brute_force():
    """Kept forward graphs (activation checkpointing off) priced per sample of k rows too."""
    rng = np.random.default_rng(9)
    feasible = 0
    for trial in range(80):
        n, B = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        cluster = with_kept_graphs(rng, random_cluster(rng, n))
        expected = brute_force(cluster, B, activation_checkpointing=False, rows_per_sample=2)
        try:
            got = solve_assignment(per_sample_cluster(cluster, 2), B,
                                   activation_checkpointing=False).unit_time_s
        except InfeasiblePlanError:
            got = float("inf")
        assert _same(got, expected), (trial, n, B, got, expected)
        feasible += bool(np.isfinite(got))
    assert feasible >= 10


def _tight_cluster(cap_gib: float) -> ClusterProfile:
    """Two identical ranks; activation memory 1 GiB per row; state tiny."""
    device = DeviceProfile(name="small", memory_capacity_bytes=cap_gib * GIB,
                           microbatch_sizes=[1, 2, 4], fwd_s=[1.0, 1.8, 3.4],
                           bwd_s=[2.0, 3.6, 6.8], compute_memory_bytes=[1 * GIB, 2 * GIB, 4 * GIB])
    model = ModelProfile(name="m", num_units=2, params_per_unit=1, params_other=0,
                         state_bytes_per_param=1.0)
    return ClusterProfile(model=model, devices=[device, dataclasses.replace(device)],
                          comm=CommProfile(allgather_s=0.1, reducescatter_s=0.1),
                          extra={"sequence_length": 64})


def test_a_pair_that_fits_no_rank_is_one_error_naming_it():
    """1.5 GiB usable (cap 0.8 x 1.875 GiB): one row (1 GiB) fits, one pair (2 GiB) does not.
    The per-row plan trains; the pair plan is refused, naming the rows and the width."""
    cluster = _tight_cluster(1.875)
    plan = optimize(cluster, 4)
    assert [r.microbatch_size for r in plan.ranks] == [1, 1]
    with pytest.raises(InfeasiblePlanError) as err:
        optimize(per_sample_cluster(cluster, 2), 4)
    assert err.value.constraint == "device"
    text = str(err.value)
    assert "ranks 0-1 (small): microbatch size 1 (one sample = 2 sequence rows of 64 tokens " \
           "that share a microbatch) needs 2.0 GiB, cap 1.5 GiB" in text, text
    # a pair plan on enough memory: m = 1 pair per microbatch is 2 rows, priced as such
    roomy = _tight_cluster(2.6)
    pair_plan = optimize(per_sample_cluster(roomy, 2), 4)
    assert [r.microbatch_size for r in pair_plan.ranks] == [1, 1]
    # (the engine's buffers and the state are a few bytes here: the activations dominate)
    assert all(2 * GIB <= r.predicted_memory_bytes < 2 * GIB + 64 for r in pair_plan.ranks)
    assert all(1 * GIB <= r.predicted_memory_bytes < 1 * GIB + 64 for r in plan.ranks)


def test_bad_rows_and_double_pricing_are_refused():
    cluster = _tight_cluster(4.0)
    assert per_sample_cluster(cluster, 1) is cluster
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rows_per_sample must be an int >= 1"):
            per_sample_cluster(cluster, bad)
    with pytest.raises(ValueError, match="already priced per sample of 2 rows"):
        per_sample_cluster(per_sample_cluster(cluster, 2), 2)
    cached = dataclasses.replace(cluster, extra={"profile_cache": ["x"], "sequence_length": 64})
    assert "profile_cache" not in per_sample_cluster(cached, 2).extra  # never written back


def test_per_sample_profile_reads_and_writes_its_rows():
    """A per-sample profile's JSON records k (a per-row one reads and writes as before), and
    the extrapolation note counts rows: m = 2 pairs are 4 rows, beyond the profiled 2."""
    from hf_cephalo.planner.simulate import extrapolation_note

    cluster = _tight_cluster(8.0)
    per_sample = per_sample_cluster(cluster, 2)
    assert "rows_per_sample" not in cluster.to_json()["devices"][0]
    again = ClusterProfile.from_json(per_sample.to_json())
    assert [d.rows_per_sample for d in again.devices] == [2, 2]
    assert float(memory.rank_memory_bytes(again, 0, 2, 2)) == \
        float(memory.rank_memory_bytes(per_sample, 0, 2, 2))
    narrow = dataclasses.replace(cluster, devices=[
        dataclasses.replace(d, microbatch_sizes=[1, 2], fwd_s=d.fwd_s[:2], bwd_s=d.bwd_s[:2],
                            compute_memory_bytes=d.compute_memory_bytes[:2])
        for d in cluster.devices])
    plan = optimize(per_sample_cluster(narrow, 2), 4)
    assert [r.microbatch_size for r in plan.ranks] == [2, 2]
    note = extrapolation_note(plan, per_sample_cluster(narrow, 2))
    assert "rank 0 m=2 (4 rows, profiled up to 2 rows)" in note, note
