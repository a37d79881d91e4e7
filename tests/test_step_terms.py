"""The step terms outside the units (planner/cost.py [Note: step terms]): priced without a
process group, older profiles keep the paper's model, a run's measurements refit the profile
and go back to the profile cache, where the next run's profile finds them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from hf_cephalo.models import stage_model
from hf_cephalo.planner import cost
from hf_cephalo.planner.predict import MeasuredStep, predict, refit_to_measured
from hf_cephalo.planner.types import Plan
from hf_cephalo.profiles.cache import ProfileCache, write_back_devices
from hf_cephalo.profiler.measure import MeasureConfig, profile_cluster
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile

GIB = float(1 << 30)


def _device(name, speed, **terms):
    """Unit times F(m) = 1·m / speed, B = 2·F; the step terms as given."""
    ms = [1, 2, 4]
    return DeviceProfile(name=name, memory_capacity_bytes=64 * GIB, microbatch_sizes=ms,
                         fwd_s=[m / speed for m in ms], bwd_s=[2 * m / speed for m in ms],
                         compute_memory_bytes=[0.0] * 3, **terms)


def _cluster(**comm_terms) -> ClusterProfile:
    model = ModelProfile(name="m", num_units=3, params_per_unit=100, params_other=50)
    slow = _device("slow", 1.0, embed_s=[0.5, 1.0, 2.0], head_s=[1.0, 2.0, 4.0],
                   microbatch_overhead_s=0.01, optimizer_s_per_param=0.002, step_overhead_s=0.3)
    fast = _device("fast", 2.0, embed_s=[0.25, 0.5, 1.0], head_s=[0.5, 1.0, 2.0],
                   microbatch_overhead_s=0.02, optimizer_s_per_param=0.001, step_overhead_s=0.1)
    comm = CommProfile(allgather_s=0.0, reducescatter_s=0.0, **comm_terms)
    return ClusterProfile(model=model, devices=[slow, fast], comm=comm)


def _plan(batch_sizes, microbatch_sizes, ratios) -> Plan:
    return Plan.from_ratios(batch_sizes=batch_sizes, microbatch_sizes=microbatch_sizes,
                            state_ratios=ratios, devices=["slow", "fast"])


def test_step_terms_by_hand():
    """Every term of the note, computed by hand for a 2-rank plan with a short last microbatch."""
    cluster = _cluster(root_allgather_s=0.4, root_reducescatter_s=0.2, allreduce_s=0.05,
                       collective_wait_s=0.01)
    plan = _plan([3, 6], [2, 4], [0.25, 0.75])
    pred = predict(plan, cluster)
    L, P = 3, 3 * 100 + 50
    # slow: microbatches 2 + 1; T = 2·F(2)+... = l·F + l·(F + B) with the last of size 1
    units0 = L * ((2 + 1) + (2 + 1) * 3)
    root0 = (1.0 + 2.0) + (0.5 + 1.0)
    book0 = 2 * L * 0.01
    # fast: microbatches 4 + 2 at half the time
    units1 = L * ((2 + 1) + (2 + 1) * 3)
    root1 = (1.0 + 2.0) + (0.5 + 1.0)
    book1 = 2 * L * 0.02
    opt = [0.25 * P * 0.002, 0.75 * P * 0.001]
    # 3 all-reduces; 3L + 8 = 17 blocking collectives, each 0.01 s of rendezvous
    comm = 0.4 + 0.2 + 3 * 0.05 + 17 * 0.01
    busy = [units0 + root0 + book0, units1 + root1 + book1]
    expected = max(busy) + max(opt) + 0.3 + comm
    assert pred.iteration_s == pytest.approx(expected, rel=1e-12)
    s0, s1 = (r.step for r in pred.ranks)
    assert (s0.units_s, s0.root_s, s0.bookkeeping_s, s0.optimizer_s, s0.host_s) == \
        pytest.approx((units0, root0, book0, opt[0], 0.3))
    assert (s1.units_s, s1.root_s, s1.bookkeeping_s, s1.optimizer_s, s1.host_s) == \
        pytest.approx((units1, root1, book1, opt[1], 0.1))
    assert s0.comm_s == s1.comm_s == pytest.approx(comm)
    # each rank's terms add up to the step: what it does not work, it waits
    for s in (s0, s1):
        assert s.step_s == pytest.approx(expected, rel=1e-12)
    assert s1.wait_s == pytest.approx((max(busy) - busy[1]) + (max(opt) - opt[1]) + 0.2)


def test_profiles_without_step_terms_keep_the_papers_model(tmp_path):
    """JSON written before the step terms loads with them at 0 and predicts L·max_i T_i."""
    cluster = _cluster()
    data = cluster.to_json()
    for d in data["devices"]:
        for k in ("embed_s", "head_s", "microbatch_overhead_s", "optimizer_s_per_param",
                  "step_overhead_s"):
            del d[k]
    for k in ("root_allgather_s", "root_reducescatter_s", "allreduce_s", "collective_wait_s",
              "overlaps_compute"):
        del data["comm"][k]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = ClusterProfile.load(path)
    d = old.devices[0]
    assert (d.embed_s, d.head_s, d.microbatch_overhead_s, d.optimizer_s_per_param,
            d.step_overhead_s) == (None, None, 0.0, 0.0, 0.0)
    assert (old.comm.root_allgather_s, old.comm.root_reducescatter_s, old.comm.allreduce_s,
            old.comm.collective_wait_s, old.comm.overlaps_compute) == (0.0, 0.0, 0.0, 0.0, True)
    plan = _plan([3, 6], [3, 6], [0.5, 0.5])
    pred = predict(plan, old)
    assert pred.iteration_s == cost.iteration_time_s([r.unit_time_s for r in pred.ranks], 3)
    # and the new fields round-trip
    cluster.save(tmp_path / "new.json")
    assert ClusterProfile.load(tmp_path / "new.json") == cluster


@pytest.mark.parametrize("field, value, match", [
    ("step_overhead_s", -1.0, "step_overhead_s must be non-negative"),
    ("optimizer_s_per_param", float("nan"), "optimizer_s_per_param must be finite"),
    ("embed_s", [0.1, 0.2], "embed_s must be a list with one value per microbatch size"),
    ("head_s", [0.1, -0.2, 0.3], r"head_s\[m=2\] must be non-negative"),
])
def test_step_term_fields_are_validated(field, value, match):
    with pytest.raises(ValueError, match=match):
        _device("d", 1.0, **{field: value})


def test_optimizer_minimizes_the_compute_phase():
    """The root compute moves samples: with a costly head on the slow rank the optimizer gives
    it fewer samples than with the units alone, and its plan predicts the best step time."""
    from hf_cephalo.planner.optimize import optimize

    base = _cluster()
    units_only = dataclasses.replace(base, devices=[
        dataclasses.replace(d, embed_s=None, head_s=None) for d in base.devices])
    heavy_head = dataclasses.replace(base, devices=[
        dataclasses.replace(base.devices[0], head_s=[5.0, 10.0, 20.0]), base.devices[1]])
    B = 12
    p_units = optimize(units_only, B)
    p_heavy = optimize(heavy_head, B)
    assert p_heavy.ranks[0].batch_size < p_units.ranks[0].batch_size
    # exact: no other split of B with its best microbatch sizes predicts a shorter step
    best = min(predict(_plan([b, B - b], [max(1, min(b, 4)), min(B - b, 4)],
                             p_heavy.state_ratios), heavy_head).iteration_s
               for b in range(1, B))
    assert p_heavy.predicted_iteration_s <= best * (1 + 1e-12)


def test_refit_to_measured_reproduces_the_measured_step():
    cluster = _cluster(root_allgather_s=0.4, root_reducescatter_s=0.2, allreduce_s=0.05)
    plan = _plan([3, 6], [2, 4], [0.25, 0.75])
    before = predict(plan, cluster)
    # rank 0 measured its units 2x and its root 3x the profile's; the step 150 s
    measured = [MeasuredStep(step_s=150.0, unit_compute_s=2 * 36.0, root_compute_s=3 * 4.5),
                MeasuredStep(step_s=140.0, unit_compute_s=None, root_compute_s=float("nan"))]
    refit = refit_to_measured(plan, cluster, measured)
    d0, d1 = refit.devices
    assert d0.fwd_s == pytest.approx([2 * f for f in cluster.devices[0].fwd_s])
    assert d0.head_s == pytest.approx([3 * h for h in cluster.devices[0].head_s])
    assert d1.fwd_s == cluster.devices[1].fwd_s and d1.head_s == cluster.devices[1].head_s
    assert predict(plan, refit).iteration_s == pytest.approx(150.0)
    assert d0.step_overhead_s > cluster.devices[0].step_overhead_s
    assert cluster.devices[0].fwd_s[0] == 1.0  # the input is unchanged
    # a step measured shorter than the model: the host term shrinks, never below 0
    short = refit_to_measured(plan, cluster, [MeasuredStep(1.0, None, None)] * 2)
    assert [d.step_overhead_s for d in short.devices] == [0.0, 0.0]
    assert predict(plan, short).iteration_s < before.iteration_s
    with pytest.raises(ValueError, match="1 measurements for world size 2"):
        refit_to_measured(plan, cluster, measured[:1])


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_measured_terms_go_back_to_the_cache_and_the_next_run_starts_from_them(tmp_path,
                                                                              monkeypatch):
    """profile (measured into the cache) -> a run's measurements refit it -> written back ->
    the next profile_cluster reads them without measuring."""
    from hf_cephalo.profiler import measure

    torch.set_num_threads(1)
    staged = stage_model(_llama())
    config = MeasureConfig(max_microbatch_size=2, sequence_length=8, repeats=1, progress=False)
    first = profile_cluster(staged, config, cache=ProfileCache(tmp_path))
    d = first.devices[0]
    assert d.embed_s is not None and d.head_s is not None
    assert all(x > 0 for x in d.embed_s + d.head_s) and d.optimizer_s_per_param > 0
    plan = Plan.from_ratios(batch_sizes=[4], microbatch_sizes=[2], state_ratios=[1.0],
                            devices=[d.name])
    step = predict(plan, first).iteration_s
    measured = [MeasuredStep(step_s=3 * step, unit_compute_s=None, root_compute_s=None)]
    refit = refit_to_measured(plan, first, measured)
    assert refit.devices[0].step_overhead_s == pytest.approx(2 * step)
    written = write_back_devices(first.extra, refit.devices)
    assert len(written) == 1 and written[0].parent == tmp_path

    monkeypatch.setattr(measure, "measure_device",
                        lambda *a, **k: pytest.fail("the next run measured again"))
    second = profile_cluster(staged, config, cache=ProfileCache(tmp_path))
    assert second.devices[0].step_overhead_s == pytest.approx(2 * step)
    assert predict(plan, second).iteration_s == pytest.approx(3 * step)
    # without a cache record (a profile file) nothing is written
    assert write_back_devices({}, refit.devices) == []


def test_collectives_add_to_the_compute_where_they_share_its_cores():
    """CPU ranks with gloo: T_i = l·F + AG + l·(F + B) + (AG + RS), not the paper's maxima."""
    overlapped = CommProfile(allgather_s=3.0, reducescatter_s=2.0)
    serial = CommProfile(allgather_s=3.0, reducescatter_s=2.0, overlaps_compute=False)
    assert float(cost.unit_time_s(1.0, 2.0, 2, overlapped, uneven=False)) == pytest.approx(9.0)
    assert float(cost.unit_time_s(1.0, 2.0, 2, serial, uneven=False)) == pytest.approx(16.0)
    assert cost.idle_unit_time_s(serial, False) == pytest.approx(8.0)
    assert CommProfile.from_json(serial.to_json()) == serial
    assert CommProfile.from_json({"allgather_s": 1, "reducescatter_s": 1}).overlaps_compute
