"""Baseline plans of ``planner/simulate.py`` against brute force, and ``hf-cephalo simulate``."""

from __future__ import annotations

import dataclasses

import itertools
import math

import numpy as np
import pytest

from hf_cephalo.cli import SUBCOMMANDS, main
from hf_cephalo.planner import cost
from hf_cephalo.planner.simulate import (
    BASELINES, compare_plans, compute_balance_plan, even_split_plan, format_comparison_table,
    format_sweep_table, memory_balance_plan, predict, speed_proportional_plan,
)
from hf_cephalo.planner.state import integer_targets, partition_state
from hf_cephalo.planner.types import Plan
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile
from tests.planner_fixtures import random_cluster

GIB = float(1 << 30)


def _device(name, cap_gib, per_sample_s, mem_per_sample_gib, fixed_gib=1.0):
    ms = [1, 2, 4, 8]
    return DeviceProfile(name=name, memory_capacity_bytes=cap_gib * GIB, microbatch_sizes=ms,
                         fwd_s=[1e-3 + m * per_sample_s for m in ms],
                         bwd_s=[1e-3 + 2 * m * per_sample_s for m in ms],
                         compute_memory_bytes=[(fixed_gib + m * mem_per_sample_gib) * GIB
                                               for m in ms])


def _two_type_cluster(state_gib=8.0):
    """A fast GPU with little memory and a slow one with much: compute balance overloads the
    fast one's memory (the paper's Fig. 2 mismatch)."""
    fast = _device("fast", 8, 1e-2, 0.5)
    slow = _device("slow", 32, 4e-2, 0.5)
    model = ModelProfile(name="toy", num_units=4, params_per_unit=1,
                         params_other=0, state_bytes_per_param=state_gib * GIB / 4)
    return ClusterProfile(model=model, devices=[fast, fast, slow],
                          comm=CommProfile(allgather_s=1e-3, reducescatter_s=1e-3))


def test_even_split_takes_the_fastest_fitting_microbatch():
    cluster = _two_type_cluster()
    for B in (3, 7, 24, 40):
        plan = even_split_plan(cluster, B)
        n = cluster.world_size
        assert plan.batch_sizes == [B // n + (i < B % n) for i in range(n)]
        assert plan.state_ratios == [1 / n] * n and not plan.uneven_state
        assert len(set(r.microbatch_size for r in plan.ranks if r.batch_size)) == 1
        got = predict(plan, cluster)
        assert got.fits
        for m in range(1, max(plan.batch_sizes) + 1):
            other = predict(Plan.even(n, B, microbatch_size=m), cluster)
            if other.fits:
                assert got.iteration_s <= other.iteration_s * (1 + 1e-12), (B, m)


def test_even_split_that_cannot_fit_is_marked_not_dropped():
    cluster = _two_type_cluster(state_gib=22.0)  # S/N = 7.3 GiB + 1.5 GiB > 0.8 × 8 GiB
    plan = even_split_plan(cluster, 12)
    assert plan.microbatch_sizes == [1, 1, 1]
    pred = predict(plan, cluster)
    assert not pred.fits and [p.fits for p in pred.ranks] == [False, False, True]
    row = compare_plans(cluster, 12)[0]
    assert row.name == "even" and not row.fits and row.plan is not None
    assert row.note == "out of memory: fast (ranks 0, 1)"


def test_compute_balance_is_the_exact_minimax_without_accumulation():
    rng = np.random.default_rng(7)
    for _ in range(40):
        n = int(rng.integers(1, 4))
        cluster = random_cluster(rng, n)
        B = int(rng.integers(1, 10))
        plan = compute_balance_plan(cluster, B)
        assert plan.batch_sizes == plan.microbatch_sizes and sum(plan.batch_sizes) == B
        assert plan.state_ratios == pytest.approx([1 / n] * n)
        got = predict(plan, cluster).iteration_s
        best = math.inf
        for sizes in itertools.product(range(B + 1), repeat=n):
            if sum(sizes) != B:
                continue
            hand = Plan.from_ratios(sizes, sizes, [1 / n] * n)
            best = min(best, predict(hand, cluster).iteration_s)
        assert got == pytest.approx(best, rel=1e-12)


def test_memory_balance_uses_microbatch_one_and_the_greedy_state():
    cluster = _two_type_cluster()
    plan = memory_balance_plan(cluster, 10)
    assert plan.batch_sizes == [4, 3, 3] and plan.microbatch_sizes == [1, 1, 1]
    assert plan.num_microbatches == [4, 3, 3] and plan.uneven_state
    mem = [float(cost.compute_memory_bytes(d, 1)) for d in cluster.devices]
    expect = partition_state(cluster.model.state_bytes, mem,
                             [d.memory_capacity_bytes for d in cluster.devices])
    assert plan.state_ratios == pytest.approx(expect)
    assert plan.state_ratios[2] > plan.state_ratios[0]  # the big-memory GPU holds more
    assert predict(plan, cluster).fits


def _superlinear_cluster():
    """Microbatches above 4 get slower per sample (the largest m that fits is not the best)."""
    ms = [1, 2, 4, 8]
    dev = DeviceProfile(name="sl", memory_capacity_bytes=32 * GIB, microbatch_sizes=ms,
                        fwd_s=[1e-2, 2e-2, 4e-2, 12e-2], bwd_s=[2e-2, 4e-2, 8e-2, 24e-2],
                        compute_memory_bytes=[(1 + 0.5 * m) * GIB for m in ms])
    model = ModelProfile(name="toy", num_units=4, params_per_unit=1, params_other=0,
                         state_bytes_per_param=GIB)
    return ClusterProfile(model=model, devices=[dev, dev, _device("slow", 32, 4e-2, 0.5)],
                          comm=CommProfile(allgather_s=1e-3, reducescatter_s=1e-3))


@pytest.mark.parametrize("make_cluster", [_two_type_cluster, _superlinear_cluster])
def test_speed_proportional_batches_and_per_rank_microbatch(make_cluster):
    cluster = make_cluster()
    B, peaks = 31, [4.0, 4.0, 1.0]
    plan = speed_proportional_plan(cluster, B, peaks)
    assert plan.batch_sizes == integer_targets([p / 9 for p in peaks], B) == [14, 14, 3]
    assert plan.state_ratios == [1 / 3] * 3
    S, n, c = cluster.model.state_bytes, 3, plan.memory_fraction
    for r, d in zip(plan.ranks, cluster.devices):
        fits = [m for m in range(1, r.batch_size + 1)
                if S / n + cost.compute_memory_bytes(d, m) <= c * d.memory_capacity_bytes]
        times = {m: predict(Plan.from_ratios([r.batch_size], [m], [1.0]),
                            ClusterProfile(model=cluster.model, devices=[d],
                                           comm=cluster.comm)).iteration_s for m in fits}
        assert r.microbatch_size == min(times, key=lambda m: (times[m], m))
    if make_cluster is _superlinear_cluster:
        assert max(plan.microbatch_sizes[:2]) <= 4  # per-sample time rises above m = 4
    with pytest.raises(ValueError, match="one positive value per rank"):
        speed_proportional_plan(cluster, B, [1.0, 2.0])
    with pytest.raises(ValueError, match="one positive value per rank"):
        speed_proportional_plan(cluster, B, [1.0, 0.0, 2.0])


def test_compare_plans_marks_out_of_memory_and_missing_plans():
    cluster = _two_type_cluster()
    rows = compare_plans(cluster, 64)
    assert [r.name for r in rows] == list(BASELINES)
    by = {r.name: r for r in rows}
    # One microbatch of ~25 samples needs ~13 GiB on an 8 GiB GPU.
    assert not by["compute_balance"].fits
    assert by["compute_balance"].note.startswith("out of memory: fast (ranks 0, 1)")
    assert by["speed_proportional"].plan is None and "peak FLOP/s" in by["speed_proportional"].note
    assert by["cephalo"].fits
    fitting = [r.samples_per_s for r in rows if r.fits]
    assert by["cephalo"].samples_per_s >= max(fitting) * (1 - 1e-12)
    # The OOM plan still reports what it would have done (it is faster, but does not fit).
    assert by["compute_balance"].samples_per_s > by["cephalo"].samples_per_s
    table = format_comparison_table(cluster, rows)
    assert "!" in table and "out of memory: fast" in table and "peak FLOP/s" in table
    sweep = format_sweep_table({64: rows, 8: compare_plans(cluster, 8)})
    assert "OOM (" in sweep and "B=8" in sweep.splitlines()[0]


def test_compare_plans_reports_an_infeasible_cephalo_problem():
    cluster = _two_type_cluster(state_gib=60.0)  # more than 0.8 × 48 GiB in total
    rows = compare_plans(cluster, 8, peak_flops=[4, 4, 1])
    by = {r.name: r for r in rows}
    assert by["cephalo"].plan is None and by["cephalo"].note.startswith("infeasible:")
    assert "aggregate memory" in by["cephalo"].note
    assert all(not r.fits for r in rows)
    with pytest.raises(ValueError, match="global batch size"):
        compare_plans(cluster, 0)
    with pytest.raises(ValueError, match="memory fraction"):
        compare_plans(cluster, 8, 1.5)


def test_simulate_cli_table_and_plot(tmp_path, capsys):
    assert "simulate" in SUBCOMMANDS
    png = tmp_path / "sim.png"
    rc = main(["simulate", "--cluster", "examples/clusters/cluster_b.yaml", "--model", "llama-7b",
               "--global-batch-size", "512", "--plot", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    for label in ("even FSDP split", "compute balance only", "memory balance only (m=1)",
                  "batch ∝ peak FLOP/s", "Cephalo", "A10G", "V100-16GB", "T4", "samples/s"):
        assert label in out
    assert "64 ranks (16 x A10G, 16 x V100-16GB, 32 x T4)" in out
    assert png.read_bytes()[:4] == b"\x89PNG"

    png2 = tmp_path / "sweep.png"
    rc = main(["simulate", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "llama-3b",
               "-B", "64", "256", "--plot", str(png2)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "predicted samples/s by global batch size" in out and "OOM (" in out
    assert png2.read_bytes()[:4] == b"\x89PNG"

    rc = main(["simulate", "--cluster", "examples/clusters/cluster_b.yaml", "--model", "llama-7b",
               "-B", "512", "--gpu-types", "A10G"])
    assert rc == 0
    assert "16 ranks (16 x A10G)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--gpu-types", "H100"], "no machine of"),
    (["--gpu-types", "nonsense"], "unknown GPU type"),
    (["-B", "0"], "global batch size must be an integer >= 1"),
    (["--memory-fraction", "0"], "memory fraction must be in (0, 1]"),
])
def test_simulate_cli_errors_exit_2(argv, message, capsys):
    base = ["simulate", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "gpt-2.7b"]
    if "-B" not in argv:
        base += ["-B", "32"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_simulate_cli_gpu_types_needs_a_cluster_yaml(tmp_path, capsys):
    prof = tmp_path / "p.json"
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "gpt-2.7b",
                 "-B", "16", "--save-profile", str(prof)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--profile", str(prof), "-B", "16", "--gpu-types", "L4"]) == 2
    assert "--gpu-types needs --cluster" in capsys.readouterr().err
    # A measured-style profile simulates too; the spec tables give the peaks by device name.
    assert main(["simulate", "--profile", str(prof), "-B", "16"]) == 0
    out = capsys.readouterr().out
    assert "batch ∝ peak FLOP/s" in out and "no peak FLOP/s" not in out


def test_comparison_figure_memory_panel_matches_the_memory_model():
    pytest.importorskip("matplotlib")
    from hf_cephalo.planner.simulate import comparison_figure

    cluster = _two_type_cluster(state_gib=22.0)  # the even split overflows the fast GPUs
    rows = compare_plans(cluster, 12)
    _, mem = comparison_figure({12: rows}).axes
    assert mem.get_ylabel() == "GiB"
    with_plan = [r for r in rows if r.prediction is not None]
    assert len(with_plan) == 4  # no peak FLOP/s: the speed-proportional row has no plan
    caps = []
    for t in ("fast", "slow"):
        (bars,) = [c for c in mem.containers if c.get_label() == t]
        want = [max(p.memory_bytes for r, p in zip(row.plan.ranks, row.prediction.ranks)
                    if r.device == t) for row in with_plan]
        assert [b.get_height() for b in bars.patches] == pytest.approx(
            [w / GIB for w in want], rel=1e-12)
        # hatched exactly where the type's fullest rank is over its cap
        assert [bool(b.get_hatch()) for b in bars.patches] == \
            [w > 0.8 * (8 if t == "fast" else 32) * GIB for w in want]
        caps += [0.8 * (8 if t == "fast" else 32)] * len(with_plan)
    assert any(b.get_hatch() for b in mem.containers[0].patches)
    (cap_line,) = [ln for ln in mem.get_lines() if ln.get_label() == "usable cap c·C_i"]
    assert list(cap_line.get_ydata()) == pytest.approx(caps, rel=1e-12)

    # several B: the fullest rank's memory / cap per plan, against the cap line at 1
    results = {B: compare_plans(cluster, B) for B in (6, 12)}
    _, mem = comparison_figure(results).axes
    for name in ("even", "cephalo"):
        (line,) = [ln for ln in mem.get_lines()
                   if ln.get_label() == results[6][BASELINES.index(name)].label]
        assert list(line.get_ydata()) == pytest.approx(
            [max(p.memory_bytes / p.cap_bytes for p in results[B][BASELINES.index(name)]
                 .prediction.ranks) for B in (6, 12)], rel=1e-12)
    assert [ln.get_ydata()[0] for ln in mem.get_lines()
            if ln.get_label() == "usable cap c·C_i"] == [1.0]


def test_extrapolation_note_names_ranks_beyond_the_profiled_microbatch_sizes():
    from hf_cephalo.planner.simulate import extrapolation_note
    from hf_cephalo.profiles.specs import estimate_cluster_profile, load_cluster_yaml

    spec_sheet = estimate_cluster_profile(load_cluster_yaml("examples/clusters/cluster_a.yaml"),
                                          "llama-3b", efficiency=0.5, precision="fp32")
    # the same numbers as if measured (a spec-sheet estimate is linear in m: no note for it)
    cluster = dataclasses.replace(spec_sheet, source="measured")
    top = max(cluster.devices[0].microbatch_sizes)  # 16 in the spec-sheet profiles
    inside = Plan.even(8, 8 * top, microbatch_size=top)
    assert extrapolation_note(inside, cluster) is None
    beyond = Plan.from_ratios(batch_sizes=[2 * top] + [top] * 7,
                              microbatch_sizes=[2 * top] + [top] * 7,
                              state_ratios=[1 / 8] * 8)
    note = extrapolation_note(beyond, cluster)
    assert note.startswith(f"note: rank 0 m={2 * top} (profiled up to {top}): beyond the "
                           "profiled microbatch sizes"), note
    assert "rank 1" not in note and "--max-microbatch-size" in note
    assert extrapolation_note(beyond, spec_sheet) is None
