"""The paper's qualitative findings (§4, Fig. 6 left and Fig. 7) on SPEC-SHEET clusters.

Cluster A (examples/clusters/cluster_a.yaml) with ViT-e, GPT 2.7B and Llama 3B, global batch
size up to 256; Cluster B (cluster_b.yaml) with Llama 7B. Numbers, and where the spec-sheet
model departs from the paper's measurements: docs/paper_reproduction.md. No tolerance here is
tuned to make a finding hold; a finding that does not hold is an expected failure with the
reason (strict, so it is noticed if the model changes).
"""

from __future__ import annotations

import pytest

from hf_cephalo.planner import cost
from hf_cephalo.planner.simulate import compare_plans, compute_balance_plan, predict
from hf_cephalo.profiles.specs import (
    ClusterSpec, estimate_cluster_profile, get_gpu_spec, load_cluster_yaml,
)

BATCH_SIZES = (16, 32, 64, 96, 128, 160, 192, 224, 256)
MODELS = ("vit-e", "gpt-2.7b", "llama-3b")


def _peaks(cluster):
    return [get_gpu_spec(d.name).fp32_tflops for d in cluster.devices]


@pytest.fixture(scope="module")
def cluster_a():
    spec = load_cluster_yaml("examples/clusters/cluster_a.yaml")
    out = {}
    for model in MODELS:
        cluster = estimate_cluster_profile(spec, model)
        rows = {B: {r.name: r for r in compare_plans(cluster, B, peak_flops=_peaks(cluster))}
                for B in BATCH_SIZES}
        out[model] = (cluster, rows)
    return out


def _first_oom_batch_size(cluster, upto: int) -> int | None:
    """Smallest B <= upto whose compute-balance-only plan does not fit (every B checked)."""
    for B in range(1, upto + 1):
        if not predict(compute_balance_plan(cluster, B), cluster).fits:
            return B
    return None


@pytest.mark.parametrize("model", [
    pytest.param("vit-e", marks=pytest.mark.xfail(strict=True, reason=(
        "spec-sheet ViT-e needs only ~42 MB of activations per sample and layer (Korthikanti "
        "formula, fp32, 257 tokens, no vocabulary logits) with boundary activations offloaded, "
        "so compute balance alone first runs out of memory at B = 1072, not within 256 as "
        "measured in the paper; see docs/paper_reproduction.md"))),
    "gpt-2.7b", "llama-3b"])
def test_compute_balance_alone_runs_out_of_memory_beyond_some_batch_size(cluster_a, model):
    cluster, rows = cluster_a[model]
    first = _first_oom_batch_size(cluster, 256)
    assert first is not None, f"{model}: compute balance alone fits every B <= 256"
    # Beyond the threshold it stays out of memory; below it, it fits and beats the even split.
    for B in BATCH_SIZES:
        row = rows[B]["compute_balance"]
        assert row.fits == (B < first), (model, B, first)
        if row.fits:
            assert row.samples_per_s > rows[B]["even"].samples_per_s
    # ... while Cephalo still fits there.
    assert all(rows[B]["cephalo"].fits for B in BATCH_SIZES)


@pytest.mark.parametrize("model", MODELS)
def test_memory_balance_alone_with_microbatch_one_is_slower_than_the_even_split(cluster_a, model):
    _, rows = cluster_a[model]
    for B in BATCH_SIZES:
        mb, even = rows[B]["memory_balance"], rows[B]["even"]
        assert mb.fits and even.fits, (model, B)
        assert mb.samples_per_s < even.samples_per_s, (model, B)


@pytest.mark.parametrize("model", MODELS)
def test_cephalo_is_fastest_at_every_batch_size(cluster_a, model):
    cluster, rows = cluster_a[model]
    for B in BATCH_SIZES:
        ceph = rows[B]["cephalo"]
        assert ceph.fits, (model, B)
        others = [r for name, r in rows[B].items() if name != "cephalo" and r.fits]
        assert others, (model, B)
        # At least as fast as every plan that fits (ties: compute balance with room to spare
        # IS the optimum) ...
        for r in others:
            assert ceph.samples_per_s >= r.samples_per_s * (1 - 1e-12), (model, B, r.name)
        # ... and strictly faster than the even split unless that one is bound by the
        # collectives alone (T_i = AG + AG + RS on every rank, a floor no plan can beat:
        # ViT-e at B = 16, two samples per GPU).
        even = rows[B]["even"]
        floor = cost.idle_unit_time_s(cluster.comm, False)
        if all(p.unit_time_s == pytest.approx(floor, rel=1e-12) for p in even.prediction.ranks):
            assert ceph.samples_per_s == pytest.approx(even.samples_per_s, rel=1e-12)
        else:
            assert ceph.samples_per_s > even.samples_per_s, (model, B)


def _cluster_b_subset(types):
    spec = load_cluster_yaml("examples/clusters/cluster_b.yaml")
    machines = [m for m in spec.machines if m and m[0] in types]
    return ClusterSpec(name="+".join(types), machines=machines,
                       interconnect_gbps=spec.interconnect_gbps,
                       intra_machine_gbps=spec.intra_machine_gbps)


def test_cluster_b_adding_slower_gpus_to_the_a10gs_raises_throughput():
    B = 512
    speed, peak = {}, {}
    for types in (("A10G",), ("A10G", "V100-16GB"), ("A10G", "V100-16GB", "T4")):
        cluster = estimate_cluster_profile(_cluster_b_subset(types), "llama-7b")
        row = {r.name: r for r in compare_plans(cluster, B, peak_flops=_peaks(cluster))}["cephalo"]
        assert row.fits
        speed[types], peak[types] = row.samples_per_s, sum(_peaks(cluster))
    a10g, a10g_v100, full = speed.values()
    ratio = full / a10g
    print(f"cluster B, llama-7b, B={B}: A10G only {a10g:.2f}, +V100 {a10g_v100:.2f}, "
          f"all {full:.2f} samples/s; all / A10G = {ratio:.3f}")
    assert a10g < a10g_v100 < full
    # The paper reports "almost 2x"; a meaningful increase is well above 1.5x. It cannot exceed
    # the ratio of aggregate peak FLOP/s (times are 1/peak per GPU in the spec-sheet model).
    assert 1.5 < ratio <= max(peak.values()) / min(peak.values()) * (1 + 1e-9)
