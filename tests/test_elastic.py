"""Elastic training without processes (pure) plus one 1-rank trainer run for the bad inputs.

- Data order is world-independent: the global batch of every step (sample ids, rank order
  concatenated) is the same list for any plan with the same B, and a plan change at ANY step
  keeps every sample exactly once per epoch (``sampler.global_batches`` / ``rank_batches``).
- ``select_world_devices``: a profile file as a pool of device profiles by name.
- ``check_resume`` / ``_missing_devices`` / ``format_plan_change``: the messages.
- Through ``CephaloTrainer``: a checkpoint of another global batch size or another model, and a
  world with a device the profile file does not know, are refused with ValueErrors.
The end-to-end elastic run (torchrun agents, 2 -> 3 -> 2) is in test_elastic_launch.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from hf_cephalo.runtime import elastic
from hf_cephalo.runtime import planning as replan
from hf_cephalo.runtime.sampler import WeightedBatchSampler, global_batches
from hf_cephalo.planner import Plan
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile
from tests.dist_utils import run_ranks

PLANS_B12 = [[12], [4, 4, 4], [6, 6], [1, 5, 6], [0, 7, 5], [3, 0, 0, 9], [2, 2, 2, 2, 2, 2]]


def _steps(n: int, sizes: list[int], epoch: int, seed: int = 7) -> list[list[int]]:
    """Per step, the global batch as the ranks take it: rank 0's ids, then rank 1's, ..."""
    sampler = WeightedBatchSampler(n, sizes, 0, seed=seed)
    sampler.set_epoch(epoch)
    per_rank = [sampler.rank_batches(r) for r in range(len(sizes))]
    return [[i for rank in per_rank for i in rank[step]] for step in range(len(sampler))]


@pytest.mark.parametrize("num_samples", [40, 36, 5, 0])
def test_global_batches_do_not_depend_on_the_plan(num_samples):
    for epoch in (0, 1, 2):
        expected = global_batches(num_samples, 12, epoch=epoch, seed=7)
        for sizes in PLANS_B12:
            assert _steps(num_samples, sizes, epoch) == expected, (sizes, epoch)


@pytest.mark.parametrize("num_samples", [40, 13])
def test_a_plan_change_at_any_step_uses_every_sample_once(num_samples):
    for before, after in [([4, 4, 4], [6, 6]), ([6, 6], [4, 4, 4]), ([1, 5, 6], [0, 7, 5])]:
        a, b = _steps(num_samples, before, 1), _steps(num_samples, after, 1)
        for change in range(len(a) + 1):
            ids = [i for step in a[:change] + b[change:] for i in step]
            assert sorted(ids) == list(range(num_samples)), (before, after, change)


def _device(name: str, capacity: float = 4e9) -> DeviceProfile:
    return DeviceProfile(name=name, memory_capacity_bytes=capacity, microbatch_sizes=[1, 2],
                         fwd_s=[0.01, 0.015], bwd_s=[0.02, 0.03], compute_memory_bytes=[1e6, 2e6])


def _cluster(names: list[str]) -> ClusterProfile:
    return ClusterProfile(model=ModelProfile(name="m", num_units=2, params_per_unit=10,
                                             params_other=5),
                          devices=[_device(n, 8e9 if n == "A100" else 4e9) for n in names],
                          comm=CommProfile(allgather_s=0.001, reducescatter_s=0.002))


def test_profile_file_is_a_device_pool():
    pool = _cluster(["A100", "V100", "V100"])
    assert replan.select_world_devices(pool, ["A100", "V100", "V100"], "f") is pool
    two = replan.select_world_devices(pool, ["V100", "A100"], "f")
    assert [d.name for d in two.devices] == ["V100", "A100"]
    assert two.devices[1].memory_capacity_bytes == 8e9 and two.comm == pool.comm
    with pytest.raises(ValueError, match=r"no profile for device\(s\) \['H100'\].*knows "
                                         r"\['A100', 'V100'\]"):
        replan.select_world_devices(pool, ["A100", "H100"], "cephalo_profile_file 'p.json'")


def _record(**kw) -> elastic.RunRecord:
    base = dict(global_batch_size=12, model_fingerprint="abc", model_class="LlamaForCausalLM",
                world_size=3, device_names=["cpu"] * 3, global_step=4, saved_time_s=1.0)
    return elastic.RunRecord(**{**base, **kw})


def test_check_resume_refuses_another_model_or_batch_size():
    plan = Plan.from_ratios([6, 6], [6, 6], [0.5, 0.5])
    elastic.check_resume("ckpt", _record(), Plan.from_ratios([12], [4], [1.0]), "abc", "L", True)
    elastic.check_resume("ckpt", None, plan, "zzz", "L", False)  # an older checkpoint: no record
    with pytest.raises(ValueError, match=r"global batch size 8 but this run plans 12 \(--cephalo_"
                                         r"global_batch_size is not set.*2 ranks now, 3 then.*"
                                         r"set --cephalo_global_batch_size 8"):
        elastic.check_resume("ckpt", _record(global_batch_size=8), plan, "abc", "L", False)
    with pytest.raises(ValueError, match=r"ckpt was trained on another model \(LlamaForCausalLM, "
                                         r"fingerprint abc\) than this run's \(GPT2LMHeadModel"):
        elastic.check_resume("ckpt", _record(), plan, "def", "GPT2LMHeadModel", True)


def test_run_record_roundtrip_and_plan_change_table(tmp_path):
    plan3 = Plan.from_ratios([4, 4, 4], [4, 4, 4], [0.4, 0.3, 0.3], devices=["A100", "V100", "V100"])
    plan2 = Plan.from_ratios([7, 5], [7, 5], [0.6, 0.4], devices=["A100", "V100"])
    elastic.write_checkpoint_record(str(tmp_path), plan3, _record())
    plan, record = elastic.read_checkpoint_record(str(tmp_path))
    assert plan.to_json() == plan3.to_json() and record == _record()
    assert elastic.read_checkpoint_record(str(tmp_path / "none")) == (None, None)
    table = elastic.format_plan_change(plan3, plan2)
    assert "3 -> 2 ranks" in table and table.count("\n") == 4
    assert "A100" in table.splitlines()[2] and "40.00" in table and "60.00" in table
    # a plain resume on the same world and plan is no re-plan; another plan on as many ranks is
    # a re-plan, not an elastic one
    assert (elastic.format_plan_change(plan2, Plan.from_json(plan2.to_json()))
            == "Cephalo resume on the same plan: 2 ranks, global batch size 12")
    other = Plan.from_ratios([6, 6], [6, 6], [0.5, 0.5], devices=["A100", "V100"])
    table = elastic.format_plan_change(plan2, other)
    assert table.startswith("Cephalo re-plan on the same 2 ranks, global batch size 12\n")
    assert "elastic" not in table and table.count("\n") == 3
    # the same split with another activation checkpointing is a re-plan and says so
    kept = Plan.from_ratios([7, 5], [7, 5], [0.6, 0.4], devices=["A100", "V100"],
                            activation_checkpointing=False)
    assert elastic.format_plan_change(plan2, kept).startswith(
        "Cephalo re-plan on the same 2 ranks, activation checkpointing on -> off, ")
    (tmp_path / elastic.RUN_RECORD_NAME).write_text("{")
    with pytest.raises(ValueError, match="unreadable run record"):
        elastic.read_checkpoint_record(str(tmp_path))


def test_world_too_small_names_the_missing_devices(tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    plan = Plan.from_ratios([4, 4, 4], [4, 4, 4], [0.4, 0.3, 0.3], devices=["A100", "V100", "V100"])
    plan.save(ckpt / elastic.PLAN_NAME)
    (ckpt / "cephalo_complete.json").write_text("{}")  # only a complete checkpoint is resumed
    msg = replan._missing_devices(str(tmp_path), ["V100"])
    assert "ran on 3 (A100, V100, V100)" in msg and "A100 x1, V100 x1" in msg
    assert "cannot hold the job" in replan._missing_devices(str(tmp_path / "empty"), ["V100"])


def _bad_inputs(rank, world_size, out_dir, profile_path, unknown_profile_path):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from tests.models_fixtures import build

    rows = [{"input_ids": torch.arange(1, 13) + i, "labels": torch.arange(1, 13) + i}
            for i in range(8)]

    def collate(batch):
        return {k: torch.stack([r[k] for r in batch]) for k in batch[0]}

    def trainer(global_batch_size, profile=profile_path, model=None, plan=None):
        args = CephaloTrainingArguments(
            output_dir=out_dir, report_to="none", max_steps=2, save_strategy="steps",
            save_steps=2, disable_tqdm=True, cephalo_profile_file=profile,
            cephalo_global_batch_size=global_batch_size)
        return CephaloTrainer(model=model or build("llama"), args=args, plan=plan,
                              train_dataset=rows, data_collator=collate)

    trainer(4).train()
    record = json.load(open(os.path.join(out_dir, "checkpoint-2", elastic.RUN_RECORD_NAME)))
    errors = {}
    for name, make in [("batch", lambda: trainer(6)),
                       ("model", lambda: trainer(4, None, build("llama", rms_norm_eps=1e-3),
                                                 Plan.from_ratios([4], [4], [1.0]))),
                       ("device", lambda: trainer(4, unknown_profile_path))]:
        try:
            make().train(resume_from_checkpoint=True)
        except ValueError as exc:
            errors[name] = str(exc)
    return record, errors


def test_trainer_refuses_bad_checkpoints_and_unknown_devices(tmp_path):
    from hf_cephalo.models import stage_model
    from hf_cephalo.profiler.measure import model_profile
    from tests.models_fixtures import build

    model = model_profile(stage_model(build("llama")))
    for name, path in (("cpu", tmp_path / "profile.json"), ("A100", tmp_path / "a100.json")):
        ClusterProfile(model=model, devices=[_device(name)],
                       comm=CommProfile(allgather_s=0.001, reducescatter_s=0.001)).save(path)
    record, errors = run_ranks(_bad_inputs, 1, str(tmp_path / "out"), str(tmp_path / "profile.json"),
                               str(tmp_path / "a100.json"), timeout_s=300)[0]
    assert record["global_batch_size"] == 4 and record["global_step"] == 2
    assert record["world_size"] == 1 and record["device_names"] == ["cpu"]
    assert "trained with global batch size 4 but this run plans 6" in errors["batch"]
    assert "trained on another model" in errors["model"]
    assert "no profile for device(s) ['cpu']" in errors["device"]
    assert "knows ['A100']" in errors["device"]


def test_run_fingerprint_ignores_what_save_pretrained_sets(tmp_path):
    from tests.models_fixtures import build

    model = build("llama")
    before = elastic.run_fingerprint(model)
    model.save_pretrained(tmp_path)  # sets config.architectures and config.dtype
    assert elastic.run_fingerprint(model) == before
    # Trainer.train aligns the special tokens with the tokenizer after the resume check
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 5, 6, 7
    assert elastic.run_fingerprint(model) == before
    assert elastic.run_fingerprint(build("llama", rms_norm_eps=1e-3)) != before


def test_resume_adopts_a_checkpoint_plan_only_with_the_running_activation_checkpointing():
    """The engine is built with the running plan's activation checkpointing: a checkpoint's
    whole plan (re-laid r_i) is adopted only with the same choice; its split alone keeps the
    running plan's choice."""
    from hf_cephalo.runtime.planning import adopt_checkpoint_split, adopt_checkpoint_state

    running = Plan.from_ratios([7, 5], [7, 5], [0.5, 0.5], devices=["A100", "V100"],
                               activation_checkpointing=False)
    moved = Plan.from_ratios([6, 6], [3, 3], [0.6, 0.4], devices=["A100", "V100"],
                             activation_checkpointing=False)
    assert adopt_checkpoint_state(running, moved, None) is moved
    other = Plan.from_json({**moved.to_json(), "activation_checkpointing": True})
    assert adopt_checkpoint_state(running, other, None) is None
    split = adopt_checkpoint_split(running, other, None)
    assert split.batch_sizes == [6, 6] and split.activation_checkpointing is False
    # the banner above the plan a resume continues on says what was adopted, and that the
    # checkpoint ran with the other activation checkpointing (it said "the plan its checkpoint
    # ran on" with the running setting)
    from hf_cephalo.runtime.planning import resume_banner

    assert resume_banner(moved, moved, True) == ("resume continues on the plan its checkpoint "
                                                 "ran on (the live re-balancing before it)")
    text = resume_banner(split, other, False)
    assert "the plan its checkpoint ran on" not in text
    assert text.startswith("resume continues on the split (b_i, m_i, l_i) its checkpoint ran on")
    assert text.endswith("this run's activation checkpointing off (the checkpoint ran with it "
                         "on)"), text
    assert "checkpoint ran with it" not in resume_banner(split, moved, False)
