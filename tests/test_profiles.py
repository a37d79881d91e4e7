"""Profile types (docs/design.md contract 1) and spec-sheet estimates."""

import json
import math
import subprocess
import sys

import pytest

from hf_cephalo.planner import memory
from hf_cephalo.profiles.specs import (GPU_SPECS, MODEL_SHAPES, estimate_cluster_profile,
                                       estimate_device_profile, get_gpu_spec, load_cluster_yaml)
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile


def _device_json(**kw):
    d = {"name": "T4", "memory_capacity_bytes": 16 * 2**30, "microbatch_sizes": [1, 2, 4],
         "fwd_s": [0.01, 0.015, 0.028], "bwd_s": [0.02, 0.03, 0.056],
         "compute_memory_bytes": [1e9, 1.4e9, 2.2e9]}
    d.update(kw)
    return d


def _cluster_json():
    return {"model": {"name": "m", "num_units": 4, "params_per_unit": 1000, "params_other": 10},
            "comm": {"allgather_s": 0.01, "reducescatter_s": 0.01},
            "devices": [_device_json(), _device_json(name="A10G")]}


def test_cluster_profile_json_round_trip(tmp_path):
    cl = ClusterProfile.from_json(_cluster_json())
    path = tmp_path / "profile.json"
    cl.save(path)
    again = ClusterProfile.load(path)
    assert again == cl
    assert again.model.state_bytes == 16 * (4 * 1000 + 10)
    assert json.loads(path.read_text())["format"] == "hf_cephalo.cluster_profile/1"


@pytest.mark.parametrize("patch, match", [
    ({"microbatch_sizes": [2, 4, 8]}, "must include microbatch size 1"),
    ({"fwd_s": [0.01, -0.015, 0.028]}, r"fwd_s\[m=2\] must be positive"),
    ({"bwd_s": [0.02, float("nan"), 0.05]}, r"bwd_s\[m=2\] must be finite"),
    ({"compute_memory_bytes": [1e9, None, 2e9]}, r"compute_memory_bytes\[m=2\] must be a number"),
    ({"fwd_s": [0.01, 0.02]}, "one value per microbatch size"),
    ({"microbatch_sizes": [1, 4, 2]}, "strictly increasing"),
    ({"memory_capacity_bytes": -1}, "memory_capacity_bytes must be positive"),
])
def test_device_profile_validation(patch, match):
    with pytest.raises(ValueError, match=match):
        DeviceProfile.from_json(_device_json(**patch))


def test_missing_fields_and_no_devices():
    d = _device_json()
    del d["bwd_s"]
    with pytest.raises(ValueError, match=r"missing field\(s\) \['bwd_s'\]"):
        DeviceProfile.from_json(d)
    data = _cluster_json()
    data["devices"] = []
    with pytest.raises(ValueError, match="no devices"):
        ClusterProfile.from_json(data)
    with pytest.raises(ValueError, match="allgather_s must be non-negative"):
        CommProfile(allgather_s=-1.0, reducescatter_s=0.0)
    with pytest.raises(ValueError, match="num_units must be >= 1"):
        ModelProfile(num_units=0, params_per_unit=1, params_other=0)


def test_gpu_table_is_complete_and_sourced():
    wanted = {"L4", "A6000", "P40", "P100", "V100-16GB", "T4", "A10G", "A100-40GB", "A100-80GB",
              "H100", "H200"}
    assert wanted <= set(GPU_SPECS)
    for spec in GPU_SPECS.values():
        assert spec.memory_gib > 0 and spec.fp32_tflops > 0
        assert spec.bf16_tflops is None or spec.bf16_tflops > spec.fp32_tflops
        assert "http" in spec.source
    assert get_gpu_spec("t4").name == "T4"
    with pytest.raises(ValueError, match="unknown GPU type 'X9'"):
        get_gpu_spec("X9")


def test_model_shapes_match_nominal_sizes():
    wanted = {"gpt-1.3b", "gpt-2.7b", "gpt-6.7b", "llama-3b", "llama-7b", "vit-g", "vit-e",
              "bert-large"}
    assert wanted <= set(MODEL_SHAPES)
    for shape in MODEL_SHAPES.values():
        assert abs(shape.num_params / shape.nominal_params - 1) < 0.1, shape.name
        assert shape.source


def test_llama3_shapes_match_known_totals():
    """GQA and tied heads are counted: the totals equal the released checkpoints' safetensors
    parameter counts (8,030,261,248 and 1,235,814,400 on the meta-llama/Meta-Llama-3-8B and
    meta-llama/Llama-3.2-1B model pages: 8.03B, 1.24B)."""
    big, small = MODEL_SHAPES["llama-3-8b"], MODEL_SHAPES["llama-3.2-1b"]
    assert big.num_params == 8_030_261_248 and round(big.num_params / 1e9, 2) == 8.03
    assert small.num_params == 1_235_814_400 and round(small.num_params / 1e9, 2) == 1.24
    assert (big.kv_heads, big.tied, small.kv_heads, small.tied) == (8, False, 8, True)
    # the root: 2 x 525M untied (split: one half live at a time), one 263M embedding tied
    assert big.params_other == 2 * 128256 * 4096 + 4096
    # the engine's two root units, as the planner's memory model reads them
    prof, sprof = big.model_profile(), small.model_profile()
    assert (prof.params_embed, prof.params_head, prof.head_ties_embedding) == \
        (128256 * 4096, 128256 * 4096 + 4096, False)
    assert (sprof.params_embed, sprof.params_head, sprof.head_ties_embedding) == \
        (128256 * 2048, 2048, True)
    # the resident root keeps both units gathered + the head's gradient beside every layer's
    # backward; the split root has at most the head's reduce-scatter in flight there: the
    # resident one costs at least the whole root (4 B x 1.05B) more
    split, resident = memory.engine_buffers(prof, 8), memory.engine_buffers(prof, 8,
                                                                            root_resident=True)
    assert resident.unit_bytes - split.unit_bytes >= 4 * prof.params_other


def test_analytic_profile_shape():
    shape = MODEL_SHAPES["llama-7b"]
    t4, a10g = estimate_device_profile("T4", shape), estimate_device_profile("A10G", shape)
    # time per sample scales with 1 / peak; memory per sample does not depend on the GPU
    slope = lambda d: (d.fwd_s[-1] - d.fwd_s[0]) / (d.microbatch_sizes[-1] - 1)  # noqa: E731
    assert slope(t4) / slope(a10g) == pytest.approx(31.2 / 8.1)
    assert t4.compute_memory_bytes == a10g.compute_memory_bytes
    assert all(b > f for f, b in zip(t4.fwd_s, t4.bwd_s))
    with pytest.raises(ValueError, match="no bf16"):
        estimate_device_profile("T4", shape, precision="bf16")


def test_cluster_yaml_examples(tmp_path):
    a = load_cluster_yaml("examples/clusters/cluster_a.yaml")
    assert a.gpus == ["L4", "L4", "A6000", "P40", "P40", "P40", "P100", "P100"]
    assert a.interconnect_gbps == 50
    b = load_cluster_yaml("examples/clusters/cluster_b.yaml")
    assert len(b.gpus) == 64 and b.gpus.count("T4") == 32 and b.gpus.count("A10G") == 16
    prof = estimate_cluster_profile(a, "llama-3b")
    assert prof.world_size == 8 and prof.source == "spec-sheet estimate"
    # ring all-gather of one fp32 layer over 50 Gbit/s
    expected = 7 / 8 * 4 * MODEL_SHAPES["llama-3b"].params_per_layer / 50e9 * 8 + 7 * 2e-5
    assert math.isclose(prof.comm.allgather_s, expected)
    bad = tmp_path / "bad.yaml"
    bad.write_text("machines:\n  - gpus: [T4, Z80]\ninterconnect_gbps: 10\n")
    with pytest.raises(ValueError, match="unknown GPU type 'Z80'"):
        load_cluster_yaml(bad)
    bad.write_text("machines: []\ninterconnect_gbps: 10\n")
    with pytest.raises(ValueError, match="no devices"):
        load_cluster_yaml(bad)
    bad.write_text("machines:\n  - gpus: [T4]\n")
    with pytest.raises(ValueError, match="interconnect_gbps"):
        load_cluster_yaml(bad)


def test_planner_does_not_import_torch():
    code = ("import sys, hf_cephalo.cli, hf_cephalo.planner, hf_cephalo.profiles.specs; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_profile_format_is_refused():
    data = _cluster_json()
    data["format"] = "hf_cephalo.cluster_profile/3"
    with pytest.raises(ValueError, match=r"format 'hf_cephalo\.cluster_profile/3' is not "
                                         r"supported.*'hf_cephalo\.cluster_profile/2'"):
        ClusterProfile.from_json(data)
    data["format"] = "hf_cephalo.cluster_profile/2"
    assert not ClusterProfile.from_json(data).buffers_in_compute_memory
    # format 1: compute memory included the engine's buffers; the planner adds none to it
    data["format"] = "hf_cephalo.cluster_profile/1"
    legacy = ClusterProfile.from_json(data)
    assert legacy.buffers_in_compute_memory
    assert legacy.to_json()["format"] == "hf_cephalo.cluster_profile/1"
    del data["format"]  # files written before the field existed still load (as format 1)
    assert ClusterProfile.from_json(data).buffers_in_compute_memory


def test_times_decreasing_in_m_warn_but_load():
    import warnings

    with pytest.warns(UserWarning, match=r"fwd_s decreases with the microbatch size at m=2->4"):
        d = DeviceProfile.from_json(_device_json(fwd_s=[0.01, 0.015, 0.012]))
    assert d.fwd_s == [0.01, 0.015, 0.012]  # measured values are kept as given
    with pytest.warns(UserWarning, match=r"bwd_s decreases .* m=1->2"):
        DeviceProfile.from_json(_device_json(bwd_s=[0.02, 0.019, 0.05]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DeviceProfile.from_json(_device_json())  # non-decreasing: silent


def test_format_bytes_adaptive_units():
    from hf_cephalo.profiles.types import format_bytes

    assert format_bytes(0) == "0 B"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 1024) == "3.0 KiB"
    assert format_bytes(1.5 * 2**20) == "1.5 MiB"
    assert format_bytes(40 * 2**30) == "40.0 GiB"
    assert format_bytes(2**41) == "2.0 TiB"


def test_cache_keys_change_with_the_measurement_version(monkeypatch):
    """Entries written by older measurement code are never reused."""
    from hf_cephalo.profiles import cache

    args = ("f" * 20, "cpu", "float32", 128, [1, 2])
    before = (cache.device_key(*args), cache.comm_key("f" * 20, "float32", ["cpu"], "gloo"))
    monkeypatch.setattr(cache, "MEASUREMENT_VERSION", cache.MEASUREMENT_VERSION + 1)
    after = (cache.device_key(*args), cache.comm_key("f" * 20, "float32", ["cpu"], "gloo"))
    assert before[0] != after[0] and before[1] != after[1]
