"""Cost model (docs/design.md contract 2) against hand-computed values."""

import math

import pytest

from hf_cephalo.planner import cost
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile


def _dev(**kw):
    base = dict(name="g", memory_capacity_bytes=100.0, microbatch_sizes=[1, 2, 4],
                fwd_s=[1.0, 1.5, 2.5], bwd_s=[2.0, 3.0, 5.0], compute_memory_bytes=[10.0, 12.0, 16.0])
    base.update(kw)
    return DeviceProfile(**base)


def test_interpolation_and_extrapolation():
    d = _dev()
    # profiled points exactly, then linear interpolation between 2 and 4
    assert cost.fwd_time_s(d, [1, 2, 4]).tolist() == [1.0, 1.5, 2.5]
    assert float(cost.fwd_time_s(d, 3)) == pytest.approx(2.0)
    assert float(cost.bwd_time_s(d, 3)) == pytest.approx(4.0)
    # beyond m = 4: least-squares line through the upper points (2, 1.5), (4, 2.5): 0.5 m + 0.5
    assert float(cost.fwd_time_s(d, 8)) == pytest.approx(4.5)
    assert float(cost.bwd_time_s(d, 8)) == pytest.approx(9.0)  # line 1.0 m + 1.0


def test_extrapolation_uses_least_squares_of_upper_half():
    d = _dev(microbatch_sizes=[1, 2, 3, 4, 5], fwd_s=[1.0, 1.2, 2.0, 2.9, 4.1],
             bwd_s=[1.0] * 5, compute_memory_bytes=[1.0] * 5)
    # upper half = m 3, 4, 5 -> least squares slope 2.1 / 2 = 1.05, intercept 3.0 - 4.2 = -1.2
    assert float(cost.fwd_time_s(d, 10)) == pytest.approx(9.3)


def test_single_point_profile_is_proportional():
    d = _dev(microbatch_sizes=[1], fwd_s=[0.5], bwd_s=[1.0], compute_memory_bytes=[3.0])
    assert float(cost.fwd_time_s(d, 6)) == pytest.approx(3.0)
    assert float(cost.compute_memory_bytes(d, 6)) == pytest.approx(18.0)


def test_memory_line_and_idle():
    d = _dev()
    # exact line through (1,10), (2,12), (4,16): 2 m + 8
    assert float(cost.compute_memory_bytes(d, 5)) == pytest.approx(18.0)
    assert float(cost.compute_memory_bytes(d, 3)) == pytest.approx(14.0)
    assert float(cost.compute_memory_bytes(d, 0)) == 0.0


def test_unit_time_overlap_cases():
    comm = CommProfile(allgather_s=1.5, reducescatter_s=1.0)
    # compute-bound: max(2·1, 1.5) + max(2·(1+2), 2.5) = 2 + 6
    assert float(cost.unit_time_s(1.0, 2.0, 2, comm, uneven=False)) == pytest.approx(8.0)
    comm = CommProfile(allgather_s=3.0, reducescatter_s=5.0)
    # communication-bound: max(2, 3) + max(6, 8) = 11
    assert float(cost.unit_time_s(1.0, 2.0, 2, comm, uneven=False)) == pytest.approx(11.0)
    # uneven: collectives x1.15 -> 3.45 + 9.2
    assert float(cost.unit_time_s(1.0, 2.0, 2, comm, uneven=True)) == pytest.approx(12.65)
    assert cost.idle_unit_time_s(comm, False) == pytest.approx(11.0)
    assert cost.idle_unit_time_s(comm, True) == pytest.approx(12.65)
    assert cost.UNEVEN_FACTOR == 1.15 and cost.DEFAULT_MEMORY_FRACTION == 0.8


def test_iteration_time_and_uneven_rule():
    assert cost.iteration_time_s([1.0, 2.5, 2.0], 4) == pytest.approx(10.0)
    d = _dev(memory_capacity_bytes=100.0)
    cl = ClusterProfile(model=ModelProfile(num_units=1, params_per_unit=10, params_other=0,
                                           state_bytes_per_param=10.0),  # S = 100
                        devices=[d, d], comm=CommProfile(allgather_s=0, reducescatter_s=0))
    # S/N = 50; cap 80: 50 + 30 = 80 fits (even), 50 + 31 does not (uneven)
    assert not cost.is_uneven(cl, [30.0, 0.0], 0.8)
    assert cost.is_uneven(cl, [31.0, 0.0], 0.8)
    assert math.isclose(cl.model.state_bytes, 100.0)


def test_side_inputs_are_priced_per_sample_with_their_gradients():
    """The memory model prices side inputs by phase (planner/memory.py [Note: side inputs by
    phase]): their values s·b in every phase, their summed gradients s·b more in the unit and
    embedding phases, and E's backward re-makes one microbatch's, m·s; where they dominate, a
    rank's peak grows by s·(2·b + m), an idle rank's by nothing; the profile keeps s through
    JSON; the profiler measures s as the per-layer
    inputs' bytes (Gemma 3n: sequence x layers x per-layer width x 4 B per sample)."""
    import numpy as np

    from hf_cephalo.models import stage_model
    from hf_cephalo.planner import memory
    from hf_cephalo.profiler.model_facts import side_bytes_per_sample
    from tests.models_fixtures import make_batch
    from tests.zoo_fixtures import build_zoo

    plain = ModelProfile(name="m", num_units=3, params_per_unit=100, params_other=50,
                         boundary_bytes_per_sample=64.0)
    s = 1e12  # side inputs far above every other term: the phase holding 2·s·b + m·s peaks
    side = ModelProfile.from_json({**plain.to_json(), "side_bytes_per_sample": s})
    assert side.side_bytes_per_sample == s
    m, b = np.array([1, 2, 0]), np.array([3, 4, 0])
    assert memory.side_input_bytes(side, b).tolist() == (s * b).tolist()
    for offload in (False, True):
        with_side, without = (ClusterProfile(
            model=p, devices=[_dev(), _dev()], offload_activations=offload,
            comm=CommProfile(allgather_s=0.0, reducescatter_s=0.0)) for p in (side, plain))
        extra = memory.rank_memory_bytes(with_side, 0, m, b) - \
            memory.rank_memory_bytes(without, 0, m, b)
        np.testing.assert_allclose(extra, s * (2 * b + m), rtol=1e-9, err_msg=str(offload))
        assert extra[2] == 0.0, offload

    staged = stage_model(build_zoo("gemma3n"))
    rows = lambda n: {k: v for k, v in make_batch("llama", n, seed=0).items()}  # noqa: E731
    seq = rows(1)["input_ids"].shape[1]
    cfg = staged.model.config
    assert side_bytes_per_sample(staged, rows, "cpu") == \
        seq * cfg.num_hidden_layers * cfg.hidden_size_per_layer_input * 4
    assert side_bytes_per_sample(stage_model(build_zoo("qwen3")), rows, "cpu") == 0.0
    # with KV sharing, also the keys and values its 2 store layers make (fp32 per sample)
    kv = stage_model(build_zoo("gemma3n_kv"))
    cfg = kv.model.config
    assert side_bytes_per_sample(kv, rows, "cpu") == \
        seq * cfg.num_hidden_layers * cfg.hidden_size_per_layer_input * 4 + \
        2 * 2 * cfg.num_key_value_heads * seq * cfg.head_dim * 4
    # a side input a unit makes (the toy's memory, (1, S, H) fp32 per sample) counts too
    import torch

    from hf_cephalo.models.toy import ToyConfig, ToyLM, ToyStaged
    toy = ToyStaged(ToyLM(ToyConfig(hidden_size=8, num_heads=2, num_layers=3, memory_from=1)))
    ids = lambda n: {"input_ids": torch.zeros(n, 5, dtype=torch.long)}  # noqa: E731
    assert side_bytes_per_sample(toy, ids, "cpu") == 5 * 8 * 4


def test_forward_only_unit_time_is_the_forward_half_of_the_unit_time():
    """One unit of a scoring pass: max(Σ F, AG·u), or Σ F + AG·u when the collectives take the
    compute's cores; an idle rank waits for the all-gather; forward_pass_s is L times the
    slowest rank's, with u on an uneven plan."""
    from types import SimpleNamespace

    from hf_cephalo.planner.generation import forward_pass_s

    comm = CommProfile(allgather_s=1.0, reducescatter_s=2.0, uneven_factor=1.5)
    assert cost.forward_unit_time_s([0.0, 0.5, 3.0], comm, False).tolist() == [1.0, 1.0, 3.0]
    assert cost.forward_unit_time_s([0.5, 3.0], comm, True).tolist() == [1.5, 3.0]
    serial = CommProfile(allgather_s=1.0, reducescatter_s=2.0, overlaps_compute=False)
    assert cost.forward_unit_time_s([0.0, 3.0], serial, False).tolist() == [1.0, 4.0]
    cluster = ClusterProfile(model=ModelProfile(name="m", num_units=3, params_per_unit=1,
                                                params_other=0),
                             devices=[_dev(), _dev()], comm=comm)

    def plan(uneven, *batches):  # m = 2: F(2) = 1.5 per microbatch
        return SimpleNamespace(uneven_state=uneven, ranks=[
            SimpleNamespace(batch_size=b, microbatch_size=2) for b in batches])

    assert forward_pass_s(plan(False, 4, 0), cluster) == pytest.approx(3 * 3.0)
    assert forward_pass_s(plan(False, 0, 0), cluster) == pytest.approx(3 * 1.0)
    assert forward_pass_s(plan(True, 0, 2), cluster) == pytest.approx(3 * 1.5)
