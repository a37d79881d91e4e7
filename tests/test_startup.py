"""Start-up on equal ranks (benchmarks/bench_startup.py measures it): ranks of one device get
one device profile ([Note: one profile per device] in profiler/measure.py), so the cold
start plans what every cached start plans; and a reused profile is said in one line, on rank 0
only, with its file, when it was measured and how to measure again.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
import transformers

from hf_cephalo.profiler.measure import one_profile_per_device
from hf_cephalo.profiles.types import DeviceProfile
from tests.dist_utils import budget_s, run_ranks, test_timeout

RANKS_S = 30.0  # the 2-rank run: two profiles of a 2-layer model, m = 1..2 ([Note: test time budgets])


def _device(name, fwd, bwd, memory, overhead=0.0, capacity=1e9):
    return DeviceProfile(name=name, memory_capacity_bytes=capacity, microbatch_sizes=[1, 2],
                         fwd_s=fwd, bwd_s=bwd, compute_memory_bytes=memory,
                         microbatch_overhead_s=overhead)


def test_ranks_of_one_key_get_one_profile_others_keep_theirs():
    a = _device("cpu", [1.0, 2.0], [2.0, 4.0], [10.0, 30.0], 0.1, capacity=5e9)
    b = _device("cpu", [3.0, 4.0], [2.0, 6.0], [20.0, 20.0], 0.3, capacity=6e9)
    c = _device("cpu [emulated 3x slower]", [9.0, 9.0], [9.0, 9.0], [1.0, 1.0])
    out = one_profile_per_device([a, b, c], ["k", "k", "slow"])
    for d, capacity in zip(out[:2], (5e9, 6e9)):
        # times: the mean; memory: the largest; name and capacity: the rank's own
        assert d.fwd_s == [2.0, 3.0] and d.bwd_s == [2.0, 5.0]
        assert d.compute_memory_bytes == [20.0, 30.0]
        assert d.microbatch_overhead_s == pytest.approx(0.2)
        assert d.name == "cpu" and d.memory_capacity_bytes == capacity
    assert out[2] is c
    # equal profiles (a cached start: one entry read by every rank) come back unchanged, exactly
    same = one_profile_per_device([a, a], ["k", "k"])
    assert [d.to_json() for d in same] == [a.to_json(), a.to_json()]


def _cold_then_cached(rank, world_size, cache_dir):
    from hf_cephalo.models import stage_model
    from hf_cephalo.planner import optimize
    from hf_cephalo.profiler.measure import MeasureConfig, profile_cluster
    from hf_cephalo.profiles.cache import ProfileCache

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    staged = stage_model(transformers.LlamaForCausalLM(cfg))
    config = MeasureConfig(max_microbatch_size=2, sequence_length=16, repeats=1)
    outputs = []
    clusters = []
    for _ in range(2):  # cold (measured in lockstep), then from the cache it wrote
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            clusters.append(profile_cluster(staged, config, cache=ProfileCache(cache_dir)))
        outputs.append(text.getvalue())
    plans = [optimize(c, 8, 0.9).to_json() for c in clusters]
    return {"devices": [[d.to_json() for d in c.devices] for c in clusters],
            "plans": plans, "cached_output": outputs[1]}


@test_timeout(RANKS_S)
def test_equal_ranks_plan_the_same_cold_and_cached_and_say_the_reuse(tmp_path):
    results = run_ranks(_cold_then_cached, 2, str(tmp_path), timeout_s=budget_s(RANKS_S))
    cold, cached = results[0]["devices"]
    assert results[1]["devices"] == results[0]["devices"]  # every rank holds the same
    assert cold[0] == cold[1] and cached == cold  # one profile for the two equal ranks
    [entry] = tmp_path.glob("device-*.json")
    stored = json.loads(entry.read_text())
    assert {k: stored[k] for k in cold[0]} == cold[0]
    plan_cold, plan_cached = results[0]["plans"]
    assert plan_cold == plan_cached
    assert [r["batch_size"] for r in plan_cold["ranks"]] == [4, 4]
    # the reuse in ONE line, on rank 0: the file, when it was measured, how to measure again
    lines = [line for line in results[0]["cached_output"].splitlines() if "reused" in line]
    assert lines == [line for line in results[0]["cached_output"].splitlines() if line]
    [line] = lines
    assert line.startswith(f"[hf-cephalo profile] every rank: reused the cached measurement "
                           f"{entry}, measured 20")
    assert line.endswith(" UTC (nothing timed); to measure again: delete that file, or set "
                         "HF_CEPHALO_PROFILE_CACHE to another directory")
    assert results[1]["cached_output"] == ""


def test_staging_a_generic_model_builds_no_unsupported_model_error(monkeypatch):
    """The generic path stages most models; the unsupported-model message (which imports every
    hand-written adapter's transformers module) is built only when it is raised."""
    from hf_cephalo.models import registry, stage_model

    def built(model):
        raise AssertionError(f"the unsupported-model error was built for {type(model).__name__}")

    monkeypatch.setattr(registry, "_unsupported", built)
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    staged = stage_model(transformers.BertForSequenceClassification(cfg))
    assert staged.num_units == 1
