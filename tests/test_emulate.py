"""Emulated heterogeneity: slowdown really slows (forward and backward), memory caps raise clear
errors, and the trainer's automatic profile -> plan path on 2 gloo ranks gives the faster
emulated rank the larger batch, saves profile.json / plan.json and reuses the cache next start.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from hf_cephalo.models import stage_model
from hf_cephalo.planner import Plan
from hf_cephalo.profiler.emulate import (EmulatedOutOfMemoryError, EmulatedStagedModel,
                                         EmulationConfig, apply_memory_cap, check_plan_memory)
from hf_cephalo.profiler.measure import MeasureConfig, measure_device
from tests.dist_utils import run_ranks


def _llama(hidden=128, layers=2, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def test_emulated_slowdown_really_slows_forward_and_backward():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        staged = stage_model(_llama())
        config = MeasureConfig(max_microbatch_size=4, sequence_length=64, repeats=3,
                               progress=False)
        # Interleave real / emulated runs so machine load drifts hit both alike.
        real, slow = [], []
        emulated = EmulatedStagedModel(staged, slowdown=3.0)
        for _ in range(3):
            real.append(measure_device(staged, config, device="cpu", name="cpu", capacity_bytes=1e9))
            slow.append(measure_device(emulated, config, device="cpu", name="x", capacity_bytes=1e9))
    finally:
        torch.set_num_threads(old)

    def total(profiles, field):
        return min(sum(getattr(p, field)) for p in profiles)

    fwd_ratio = total(slow, "fwd_s") / total(real, "fwd_s")
    fb_real = total(real, "fwd_s") + total(real, "bwd_s")
    fb_slow = total(slow, "fwd_s") + total(slow, "bwd_s")
    # Target 3x; loose bounds for a shared 2-core machine (best of 3 interleaved profiles
    # each), but far from 1x.
    assert 1.8 < fwd_ratio < 5.0, fwd_ratio
    assert 1.8 < fb_slow / fb_real < 5.0, (fb_slow, fb_real)
    # The backward itself (recompute excluded) is stretched too, through the tensor hooks.
    assert total(slow, "bwd_s") > 1.5 * total(real, "bwd_s"), (slow, real)
    t = emulated.timer
    assert t.sleep_s > 0 and t.unit_s <= t.compute_s and t.calls > 0
    # Slowdown 1 only times: no waiting; gradients are unchanged by the hooks.
    x = torch.randn(2, 8, 128)
    timing = EmulatedStagedModel(staged, slowdown=1.0)
    grads = []
    for s in (staged, timing):
        for p in staged.model.parameters():
            p.grad = None
        mb = {"input_ids": torch.randint(0, 97, (2, 8))}
        _, ctx = staged.embed(mb)
        xi = x.clone().requires_grad_(True)
        s.run_unit(0, xi, ctx).square().sum().backward()
        grads.append([xi.grad.clone()] + [p.grad.clone() for p in staged.units()[0].parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert timing.timer.sleep_s == 0 and timing.timer.unit_s > 0
    with pytest.raises(ValueError, match="slowdown = 0.5"):
        EmulatedStagedModel(staged, slowdown=0.5)


def test_memory_cap_errors(tmp_path, monkeypatch):
    check_plan_memory([1e9, 2e9], [None, 3e9])  # fits
    with pytest.raises(EmulatedOutOfMemoryError,
                       match=r"rank 1 needs 1\.863 GiB \(2000000000 bytes\) but its emulated cap is "
                             r"0\.931 GiB \(1000000000 bytes\)"):
        check_plan_memory([1e9, 2e9], [None, 1e9])
    assert "accounting" in apply_memory_cap(10**9, "cpu")
    with pytest.raises(ValueError, match="need one finite factor >= 1"):
        EmulationConfig(slowdown=[1.0, 0.9])
    with pytest.raises(ValueError, match="2 entries .* world size is 3"):
        EmulationConfig(slowdown=[1.0, 2.0]).check_world_size(3)

    # Through the trainer (single process): a plan file whose rank needs more than the cap.
    from hf_cephalo.integrations.trainer import CephaloTrainer
    from hf_cephalo.integrations.training_args import CephaloTrainingArguments

    for name in ("PLAN_FILE", "PROFILE_FILE", "GLOBAL_BATCH_SIZE", "EMULATE_SLOWDOWN",
                 "EMULATE_MEMORY_CAP_BYTES"):
        monkeypatch.delenv("HF_CEPHALO_" + name, raising=False)
    monkeypatch.setenv("HF_CEPHALO_PROFILE_CACHE", str(tmp_path / "cache"))
    plan = Plan.from_ratios([4], [4], [1.0])
    plan.ranks[0].predicted_memory_bytes = 5e6
    plan.save(tmp_path / "plan.json")
    args = CephaloTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none",
                                    cephalo_plan_file=str(tmp_path / "plan.json"),
                                    cephalo_emulate_memory_cap_bytes=[4_000_000])
    with pytest.raises(EmulatedOutOfMemoryError, match="rank 0 needs .* emulated cap is"):
        CephaloTrainer(model=_llama(hidden=64), args=args)
    # Automatic planning respects the cap; a cap below the model's state is infeasible, and the
    # planner's error names the binding constraint.
    args = CephaloTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none",
                                    cephalo_global_batch_size=4,
                                    cephalo_emulate_memory_cap_bytes=[1_000_000])
    with pytest.raises(ValueError, match="no plan for global batch size 4 fits"):
        CephaloTrainer(model=_llama(hidden=64), args=args)
    assert not torch.distributed.is_initialized()


# ---- 2 gloo ranks through CephaloTrainer ----------------------------------------------------------
def _samples(n):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 97, (32,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return rows


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _trainer_worker(rank, world_size, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size),
                      HF_CEPHALO_PROFILE_CACHE=os.path.join(out_dir, "cache"),
                      HF_CEPHALO_PROFILE_MAX_MICROBATCH_SIZE="4")
    for name in ("PLAN_FILE", "PROFILE_FILE", "EMULATE_MEMORY_CAP_BYTES"):
        os.environ.pop("HF_CEPHALO_" + name, None)
    from hf_cephalo.integrations.trainer import CephaloTrainer
    from hf_cephalo.integrations.training_args import CephaloTrainingArguments
    from hf_cephalo.profiler import measure

    def make(run):
        args = CephaloTrainingArguments(
            output_dir=os.path.join(out_dir, run), report_to="none", optim="sgd", learning_rate=0.1,
            max_steps=3, logging_steps=1, save_strategy="no", disable_tqdm=True,
            cephalo_global_batch_size=16, cephalo_emulate_slowdown=[1.0, 3.0])
        return CephaloTrainer(model=_llama(hidden=128), args=args, train_dataset=_samples(48),
                              data_collator=_collate)

    trainer = make("first")
    result = dict(batch_sizes=trainer.plan.batch_sizes,
                  device_names=[d.name for d in trainer.cluster_profile.devices],
                  fwd_s=[sum(d.fwd_s) for d in trainer.cluster_profile.devices],
                  files=sorted(os.listdir(os.path.join(out_dir, "first"))) if rank == 0 else None,
                  slowdown=trainer.engine.staged.slowdown,
                  capacity=[d.memory_capacity_bytes for d in trainer.cluster_profile.devices])
    local = os.environ.pop("LOCAL_WORLD_SIZE")
    result["ranks_on_host"] = measure.local_world_size()  # without the env: hostnames
    os.environ["LOCAL_WORLD_SIZE"] = local
    trainer.train()
    (callback,) = [c for c in trainer.callback_handler.callbacks
                   if type(c).__name__ == "PlanAccuracyCallback"]
    result["rows"] = callback.rows

    def refuse(*args, **kwargs):
        raise AssertionError("measure_device called although the profile is cached")

    measure.measure_device = refuse  # second start: every device profile is a cache hit
    second = make("second")
    result["second_batch_sizes"] = second.plan.batch_sizes
    return result


def test_auto_plan_on_emulated_ranks_favours_the_faster_rank(tmp_path, capsys):
    first, second = run_ranks(_trainer_worker, 2, str(tmp_path), timeout_s=300)
    assert first["device_names"] == ["cpu", "cpu [emulated 3x slower]"]
    assert first["slowdown"] == 1.0 and second["slowdown"] == 3.0
    b0, b1 = first["batch_sizes"]
    assert b0 + b1 == 16 and b0 > b1, first["batch_sizes"]
    assert first["fwd_s"][1] > 2.0 * first["fwd_s"][0]  # the profile saw the emulated slowdown
    # The 2 CPU ranks share this host's RAM: each gets half, not all of it.
    from hf_cephalo.profiler.measure import device_capacity_bytes

    ram = device_capacity_bytes("cpu")
    assert first["capacity"] == [ram / 2, ram / 2] and first["ranks_on_host"] == 2
    assert first["files"] == ["plan.json", "profile.json"]
    # u measured on the real process group for the most skewed layout the caps allow, recorded
    profile = json.loads((tmp_path / "first" / "profile.json").read_text())
    print("measured uneven factor", profile["comm"])
    assert profile["comm"]["uneven_factor"] >= 1.0
    assert len(profile["comm"]["uneven_state_ratios"]) == 2
    assert profile["machine_of_rank"] == [0, 0] and len(profile["host_memory_bytes"]) == 1
    saved = json.loads((tmp_path / "first" / "plan.json").read_text())
    assert [r["batch_size"] for r in saved["ranks"]] == first["batch_sizes"]
    assert first["second_batch_sizes"] == second["second_batch_sizes"] == first["batch_sizes"]
    # Predicted vs measured report: one row per rank, same on both ranks, numbers filled in.
    rows = first["rows"]
    assert rows == second["rows"] and [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["step_s"] > 0 and r["memory_bytes"] > 0 and r["pred_memory_bytes"] > 0
        # A plan may leave the slow rank idle when its profile came out very slow (a loaded
        # machine); such a rank computes nothing, every other rank must report real figures.
        if first["batch_sizes"][r["rank"]] > 0:
            assert r["compute_s"] > 0 and r["pred_compute_s"] > 0, r


def test_emulated_timer_is_found_through_the_bf16_autocast_wrapper():
    """--bf16 with emulation: the engine wraps the emulated adapter in AutocastStagedModel; the
    predicted-vs-measured callback still reads the emulated ComputeTimer through it, and the
    wrapper's forward calls run under autocast while the emulation times them."""
    from types import SimpleNamespace

    from hf_cephalo.integrations.auto_plan import PlanAccuracyCallback
    from hf_cephalo.models.base import AutocastStagedModel
    from hf_cephalo.models.toy import ToyConfig, ToyLM, ToyStaged
    from hf_cephalo.profiler.emulate import EmulatedStagedModel

    emulated = EmulatedStagedModel(ToyStaged(ToyLM(ToyConfig())), 1.0)
    wrapped = AutocastStagedModel(emulated, "cpu")
    callback = PlanAccuracyCallback(SimpleNamespace(engine=SimpleNamespace(staged=wrapped)))
    assert callback._timer() is emulated.timer
    plain = PlanAccuracyCallback(SimpleNamespace(engine=SimpleNamespace(
        staged=AutocastStagedModel(ToyStaged(ToyLM(ToyConfig())), "cpu"))))
    assert plain._timer() is None
    hidden, ctx = wrapped.embed({"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    out = wrapped.run_unit(0, hidden, ctx)
    assert out.dtype == torch.float32 and emulated.timer.calls == 2  # timed; residual stays fp32
