"""Plan (docs/design.md contract 3): constructors, JSON round-trip, validation."""

import json

import pytest

from hf_cephalo.planner.types import Plan, RankPlan
from hf_cephalo.profiles.types import ModelProfile


def test_even_plan():
    p = Plan.even(3, 10)
    assert p.batch_sizes == [4, 3, 3] and p.microbatch_sizes == [4, 3, 3]
    assert p.num_microbatches == [1, 1, 1] and not p.uneven_state
    assert p.state_ratios == pytest.approx([1 / 3] * 3)
    p = Plan.even(2, 7, microbatch_size=2)
    assert p.batch_sizes == [4, 3] and p.num_microbatches == [2, 2]
    assert p.ranks[1].last_microbatch_size == 1  # 3 = 2 + 1: last microbatch smaller


def test_from_ratios_with_idle_rank():
    p = Plan.from_ratios([5, 0, 3], [2, 4, 3], [0.5, 0.25, 0.25], devices=["a", "b", "c"])
    assert p.global_batch_size == 8 and p.uneven_state
    assert p.num_microbatches == [3, 0, 1] and p.microbatch_sizes == [2, 0, 3]
    assert p.ranks[0].last_microbatch_size == 1


def test_json_round_trip(tmp_path):
    p = Plan.from_ratios([5, 0, 3], [2, 4, 3], [0.5, 0.25, 0.25])
    p.predicted_iteration_s = 1.5
    p.model = {"name": "m", "num_units": 2, "params_per_unit": 10, "params_other": 3}
    path = tmp_path / "plan.json"
    p.save(path)
    q = Plan.load(path)
    assert q == p
    assert json.loads(path.read_text())["format"] == "hf_cephalo.plan/1"


def test_validate_for_world_size_and_model():
    p = Plan.even(4, 8)
    p.validate_for(4)
    with pytest.raises(ValueError, match="world size 4 but the job has world size 2"):
        p.validate_for(2)
    p.model = {"name": "m", "num_units": 2, "params_per_unit": 10, "params_other": 3}
    p.validate_for(4, ModelProfile(name="m", num_units=2, params_per_unit=10, params_other=3))
    with pytest.raises(ValueError, match="plan was made for model 'm'"):
        p.validate_for(4, ModelProfile(name="x", num_units=3, params_per_unit=10, params_other=3))


@pytest.mark.parametrize("bad, match", [
    ({"global_batch_size": 9}, "must equal the sum"),
    ({"ranks": []}, "no ranks"),
    ({"memory_fraction": 0.0}, "memory_fraction"),
])
def test_plan_validation(bad, match):
    fields = dict(global_batch_size=8, ranks=Plan.even(2, 8).ranks)
    fields.update(bad)
    with pytest.raises(ValueError, match=match):
        Plan(**fields)


def test_rank_validation():
    with pytest.raises(ValueError, match="ceil"):
        RankPlan(rank=0, batch_size=5, microbatch_size=2, num_microbatches=2, state_ratio=1.0)
    with pytest.raises(ValueError, match="batch_size 0"):
        RankPlan(rank=0, batch_size=0, microbatch_size=2, num_microbatches=1, state_ratio=1.0)
    with pytest.raises(ValueError, match="state_ratio"):
        RankPlan(rank=0, batch_size=1, microbatch_size=1, num_microbatches=1, state_ratio=-0.1)
    with pytest.raises(ValueError, match="sum to"):
        Plan.from_ratios([1, 1], [1, 1], [0.5, 0.6])
    with pytest.raises(ValueError, match="rank order"):
        Plan(global_batch_size=2, ranks=list(reversed(Plan.even(2, 2).ranks)))


def test_unit_layout_uses_ratios():
    p = Plan.from_ratios([1, 1], [1, 1], [0.75, 0.25])
    assert p.unit_layout([4, 4]) == [[3, 1], [3, 1]]  # every unit split 3:1


def test_load_rejects_garbage(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(path)
    path.write_text(json.dumps({"ranks": []}))
    with pytest.raises(ValueError, match="global_batch_size"):
        Plan.load(path)
    # a malformed field: the message names the file, the field and how to get a valid plan
    data = Plan.even(2, 4).to_json()
    data["global_batch_size"] = 5
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        Plan.load(path)
    assert str(e.value) == (f"plan file {str(path)!r}: global_batch_size 5 must equal the sum of "
                            "per-rank batch sizes [2, 2] (= 4) and be >= 1; write the plan anew "
                            "with `hf-cephalo plan --profile PROFILE -B N --out FILE` (format: "
                            "docs/profiles.md)")


def test_microbatch_zero_with_samples_is_a_clear_error():
    with pytest.raises(ValueError, match=r"batch_size 6 needs microbatch_size >= 1, got 0") as e:
        RankPlan(rank=0, batch_size=6, microbatch_size=0, num_microbatches=0, state_ratio=1.0)
    assert "ceil" not in str(e.value)


def test_unknown_plan_format_is_refused():
    data = Plan.even(2, 8).to_json()
    assert data["format"] == "hf_cephalo.plan/1"
    Plan.from_json(data)
    data["format"] = "hf_cephalo.plan/9"
    with pytest.raises(ValueError, match=r"format 'hf_cephalo\.plan/9' is not supported"):
        Plan.from_json(data)


def test_lora_profile_prices_only_the_adapter_as_training_state():
    """LoRA (issue 16): 16 B per trainable element, frozen_bytes_per_param per frozen one;
    Llama-7B r=16 on q, v: 32 layers x 16 x (4096 + 4096) x 2 adapter elements."""
    from hf_cephalo.profiles.specs import get_model_shape, lora_model_profile
    from hf_cephalo.profiles.types import ModelProfile

    shape = get_model_shape("llama-7b")
    full = shape.model_profile()
    lora = lora_model_profile(full, shape, 16, ("q", "v"), frozen_bytes_per_param=2.0)
    adapter = 32 * 2 * 16 * (4096 + 4096)
    assert lora.trainable_params == adapter == 8_388_608
    assert lora.num_params == full.num_params + adapter
    assert lora.state_bytes == 16 * adapter + 2 * full.num_params
    assert ModelProfile.from_json(lora.to_json()) == lora
    with pytest.raises(ValueError, match="trainable_params .* exceeds"):
        ModelProfile(num_units=1, params_per_unit=10, params_other=0, trainable_params=11)


def test_plan_records_and_checks_its_precision(tmp_path):
    """A plan carries its profile's precision tag (profiles/precision.py [Note: precision tags]);
    a job of another precision is refused, plans without a tag (hand-made, older files) are
    not checked, a malformed tag is refused when read."""
    plan = Plan.from_ratios([2, 2], [1, 2], [0.5, 0.5])
    plan.validate_for(2, precision="float32+autocast-bf16+gather-bf16")  # no tag: unchecked
    plan.precision = "float32+autocast-bf16+gather-bf16"
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded.precision == "float32+autocast-bf16+gather-bf16"
    loaded.validate_for(2, precision="float32+autocast-bf16+gather-bf16")
    with pytest.raises(ValueError, match=r"plan was made for precision 'float32\+autocast-bf16"
                                         r"\+gather-bf16' but this job trains in 'float32'"):
        loaded.validate_for(2, precision="float32")
    data = json.loads((tmp_path / "p.json").read_text())
    data.pop("precision")
    assert Plan.from_json(data).precision is None  # older plan files still load
    data["precision"] = "float32+gather-int8"
    with pytest.raises(ValueError, match="precision tag"):
        Plan.from_json(data)


def test_precision_tags_round_trip():
    from hf_cephalo.profiles.precision import Precision

    for p in (Precision(), Precision("bf16"), Precision("bf16", "bf16"),
              Precision("fp16", "fp16", "fp16")):
        assert Precision.parse(p.tag("float32")) == ("float32", p)
    assert Precision("bf16", "bf16").tag() == "float32+autocast-bf16+gather-bf16"
    assert Precision.parse("float32+autocast-bf16")[1].param == "fp32"  # older profiles


def test_model_profile_gathered_and_reduce_bytes():
    m = ModelProfile(num_units=2, params_per_unit=10, params_other=4)
    assert (m.param_gather_bytes, m.grad_reduce_bytes) == (4.0, 4.0)
    m = ModelProfile.from_json({**m.to_json(), "gathered_param_bytes": 2, "reduce_bytes": 2})
    assert (m.param_gather_bytes, m.grad_reduce_bytes) == (2.0, 2.0)
    with pytest.raises(ValueError, match="gathered_param_bytes 8.0 exceeds param_bytes 4.0"):
        ModelProfile(num_units=2, params_per_unit=10, params_other=4, gathered_param_bytes=8)


def test_activation_checkpointing_round_trip_and_old_plan_files(tmp_path):
    p = Plan.from_ratios([5, 3], [5, 3], [0.5, 0.5], activation_checkpointing=False)
    path = tmp_path / "plan.json"
    p.save(path)
    assert json.loads(path.read_text())["activation_checkpointing"] is False
    assert Plan.load(path) == p and Plan.load(path).activation_checkpointing is False
    data = p.to_json()
    del data["activation_checkpointing"]  # a plan file written before the field existed
    path.write_text(json.dumps(data))
    assert Plan.load(path).activation_checkpointing is True
    data["activation_checkpointing"] = "false"  # a string is not a boolean
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="activation_checkpointing must be true or false"):
        Plan.load(path)


def test_model_profile_with_layers_of_different_sizes():
    """unit_params lists each layer's elements, the largest being params_per_unit; the totals
    and the memory model's units follow it; a list of another length, a count above the
    largest or a params_per_unit that is not the largest is refused with what to fix."""
    from hf_cephalo.planner.memory import model_layout_numels
    from hf_cephalo.profiles.types import ModelProfile

    model = ModelProfile(num_units=3, params_per_unit=10, params_other=4, params_embed=3,
                         params_head=1, unit_params=[6, 10, 10])
    assert model.num_params == 30 and model.unit_numels() == [6, 10, 10]
    assert model_layout_numels(model) == [6, 10, 10, 3, 1]
    assert model.layer_trainable_numels() == [6.0, 10.0, 10.0]
    lora = ModelProfile(num_units=3, params_per_unit=10, params_other=4, params_embed=3,
                        params_head=1, unit_params=[6, 10, 10],
                        trainable_params=7, trainable_per_unit=2, trainable_embed=0,
                        trainable_head=1, unit_trainable=[2, 2, 2])
    assert lora.layer_trainable_numels() == [2.0, 2.0, 2.0]
    for kw, match in ((dict(unit_params=[6, 10]), "one count per layer"),
                      (dict(unit_params=[6, 12, 10]), "exceeds"),
                      (dict(unit_params=[6, 8, 8]), "must be the largest"),
                      (dict(unit_trainable=[1, 1, 1]), "needs unit_params")):
        with pytest.raises(ValueError, match=match):
            ModelProfile(num_units=3, params_per_unit=10, params_other=4, **kw)


def test_save_replaces_the_file_whole(tmp_path, monkeypatch):
    """A plan (or profile) file is written beside its path and renamed over it: a reader
    sees the old plan or the new one, never a part (every rank of a job may write the same
    plan file while another reads it), and a failed write leaves the old file and no
    partial one."""
    import os

    from hf_cephalo.file_modes import current_umask
    from hf_cephalo.profiles import types

    path = tmp_path / "plan.json"
    old = Plan.from_ratios([2, 4], [1, 2], [0.5, 0.5])
    old.save(path)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~current_umask()
    real_dumps = json.dumps

    def half_written(data, **kw):
        (tmp_path / f".plan.json.{os.getpid()}.partial").write_text(real_dumps(data)[:10])
        raise OSError("disk full")

    monkeypatch.setattr(types.json, "dumps", half_written)
    with pytest.raises(OSError, match="disk full"):
        Plan.from_ratios([3, 3], [1, 1], [0.5, 0.5]).save(path)
    monkeypatch.undo()
    assert Plan.load(path).to_json() == old.to_json()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
