"""The generation planner (planner/generation.py, [Note: the decode cost model]): the split of a
generation batch g_i and the decode mode, exact against brute force over every split."""

from __future__ import annotations

import itertools
import random

import pytest

from hf_cephalo.planner.generation import (DecodeModel, DecodeProfile, spec_decode,
                                           InfeasibleGenerationError, plan_generation)

MODEL = DecodeModel(weight_bytes=1000.0, root_bytes=100.0, unit_bytes=200.0, num_units=4,
                    kv_bytes_per_token=2.0, allgather_s_per_unit=0.01, allreduce_s=0.001,
                    gather_all_s=0.05)


def _brute(ranks, model, rows, prompt, new, mode):
    """The least predicted time of ``mode`` over every split that fits memory."""
    best = None
    tokens = prompt + new
    for split in itertools.product(range(rows + 1), repeat=len(ranks)):
        if sum(split) != rows:
            continue
        fits = all(r.memory_budget_bytes is None or
                   model.decode_memory(mode, g, tokens) <= r.memory_budget_bytes
                   for r, g in zip(ranks, split))
        if not fits:
            continue
        if mode == "gather_once":
            t = max(new * r.step_s(g) for r, g in zip(ranks, split)) + model.gather_all_s
        else:
            t = new * (max(r.step_s(max(g, 1)) for r, g in zip(ranks, split))
                       + model.num_units * model.allgather_s_per_unit + model.allreduce_s)
        best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_split_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4])
    rows = rng.randint(1, 9)
    ranks = [DecodeProfile(f"gpu{i}", rng.uniform(0.001, 0.05), rng.uniform(0.0, 0.02),
                           rng.choice([None, 1100.0, 1500.0, 450.0, 2000.0]))
             for i in range(world)]
    want = {m: _brute(ranks, MODEL, rows, 3, 5, m) for m in ("gather_once", "sharded")}
    feasible = [t for t in want.values() if t is not None]
    if not feasible:
        with pytest.raises(InfeasibleGenerationError, match="no decode mode fits"):
            plan_generation(ranks, MODEL, rows, 3, 5)
        return
    got = plan_generation(ranks, MODEL, rows, 3, 5)
    assert sum(got.rows) == rows
    assert got.predicted_s == pytest.approx(min(feasible), rel=1e-12)
    assert got.predicted_s == pytest.approx(want[got.mode], rel=1e-12)


def test_fast_memory_takes_more_rows_and_idle_ranks_cost_nothing_gathered():
    fast = DecodeProfile("H100", 0.002, 0.0001)
    slow = DecodeProfile("T4", 0.02, 0.001)
    plan = plan_generation([fast, slow, slow], MODEL, 12, 4, 8)
    assert plan.mode == "gather_once"
    assert plan.rows[0] > plan.rows[1] and plan.rows[1] == plan.rows[2]
    # a rank that cannot hold the full weights forces the sharded decode on every rank
    tight = DecodeProfile("small", 0.002, 0.0001, memory_budget_bytes=600.0)
    assert plan_generation([tight, slow], MODEL, 4, 4, 8).mode == "sharded"


def test_profiles_from_timings_and_spec_sheets():
    prof = DecodeProfile.from_timings("x", [1, 4, 16], [0.011, 0.014, 0.026])
    assert prof.fixed_s == pytest.approx(0.01, abs=1e-4)
    assert prof.per_row_s == pytest.approx(0.001, abs=1e-4)
    with pytest.raises(ValueError, match="two or more row counts"):
        DecodeProfile.from_timings("x", [2, 2], [0.1, 0.1])
    with pytest.raises(ValueError, match="fixed_s must be >= 0"):
        DecodeProfile("x", -1.0, 0.0)
    h100 = DecodeProfile.from_spec("H100", weight_bytes=16e9, kv_bytes_per_token=131072,
                                   context_tokens=1024, flops_per_token=16e9,
                                   bandwidth_gbs=3350, peak_tflops=989.4)
    t4 = DecodeProfile.from_spec("T4", weight_bytes=16e9, kv_bytes_per_token=131072,
                                 context_tokens=1024, flops_per_token=16e9, bandwidth_gbs=320,
                                 peak_tflops=65.0)
    assert h100.fixed_s == pytest.approx(16e9 / (3350e9 * 0.5))
    assert t4.fixed_s / h100.fixed_s == pytest.approx(3350 / 320)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="rows"):
        plan_generation([DecodeProfile("a", 0.01, 0.0)], MODEL, 0, 3, 5)


def test_spec_sheets_price_a_mixed_cluster():
    """One H100 and three T4s decoding Llama-3-8B (fp16) from the spec tables: the H100's
    memory bandwidth (3350 vs 320 GB/s) gives it most rows, and the plan beats an even split;
    the T4 has no bf16 peak."""
    from hf_cephalo.profiles.specs import GPU_SPECS, get_model_shape

    shape = get_model_shape("llama-3-8b")
    assert GPU_SPECS["H100"].memory_bandwidth_gbs == 3350.0
    h100, model = spec_decode("H100", shape, precision="fp16")
    t4, _ = spec_decode("T4", shape, precision="fp16")
    plan = plan_generation([h100, t4, t4, t4], model, 64, 128, 256)
    assert plan.mode == "gather_once" and sum(plan.rows) == 64
    assert plan.rows[0] > 3 * max(plan.rows[1:])
    even = max(r.step_s(16) for r in (h100, t4)) * 256
    assert plan.predicted_s < even
    with pytest.raises(ValueError, match="no bf16 peak|lists no bf16"):
        spec_decode("T4", shape, precision="bf16")



def test_an_rl_step_is_priced_per_phase():
    """A GRPO step on spec sheets (two A100s and two T4s, llama-3.2-1b, bf16 / fp16 per GPU):
    generation, log-prob passes and training are priced apart; the log-prob passes are
    forward-only (cheaper than a training step), each extra pass adds the same time, and
    the round's time is shared by the steps it feeds."""
    from hf_cephalo.planner import Plan, optimize
    from hf_cephalo.planner.generation import forward_pass_s, price_rl_step
    from hf_cephalo.profiles.specs import ClusterSpec, estimate_cluster_profile, get_model_shape

    spec = ClusterSpec(name="mixed", machines=[["A100-40GB", "A100-40GB", "T4", "T4"]],
                       interconnect_gbps=100.0)
    shape = get_model_shape("llama-3.2-1b")
    cluster = estimate_cluster_profile(spec, shape, precision="fp16")
    plan = optimize(cluster, 32)
    gen = plan_generation([spec_decode(g, shape, precision="fp16")[0]
                           for g in ("A100-40GB", "A100-40GB", "T4", "T4")],
                          spec_decode("T4", shape, precision="fp16")[1], 32, 128, 256)
    one = price_rl_step(plan, cluster, gen, logprob_passes=1)
    two = price_rl_step(plan, cluster, gen, logprob_passes=2, steps_per_generation=2)
    assert 0 < forward_pass_s(plan, cluster) < one.training_s
    assert two.logprob_s == pytest.approx(2 * one.logprob_s)
    assert two.generation_s == pytest.approx(one.generation_s / 2)
    assert one.total_s == pytest.approx(one.generation_s + one.logprob_s + one.training_s)
    assert isinstance(plan, Plan) and sum(gen.rows) == 32


def test_a_given_split_is_priced_as_the_plan_prices_it():
    """price_generation of the planner's own split gives the planner's prediction in each mode;
    any other split is priced no lower; bad splits and modes are refused."""
    from hf_cephalo.planner.generation import price_generation

    ranks = [DecodeProfile("fast", 0.01, 0.002), DecodeProfile("slow", 0.03, 0.006)]
    for mode in ("gather_once", "sharded"):
        plan = plan_generation(ranks, MODEL, 8, 4, 16, modes=(mode,))
        assert price_generation(ranks, MODEL, plan.rows, 16, mode).predicted_s == \
            pytest.approx(plan.predicted_s)
        for g in range(9):
            assert price_generation(ranks, MODEL, [g, 8 - g], 16, mode).predicted_s >= \
                plan.predicted_s - 1e-12
    with pytest.raises(ValueError, match="needs 2 counts"):
        price_generation(ranks, MODEL, [8], 16, "sharded")
    with pytest.raises(ValueError, match="give gather_once or sharded"):
        price_generation(ranks, MODEL, [4, 4], 16, "beams")
