"""CephaloTrainingArguments: parsing, environment fallbacks, validation, batch size rules."""

import json

import pytest
import torch
from transformers import HfArgumentParser

from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

ENV_NAMES = ["PLAN_FILE", "PROFILE_FILE", "GLOBAL_BATCH_SIZE", "MEMORY_FRACTION",
             "ACTIVATION_OFFLOAD", "EMULATE_SLOWDOWN", "EMULATE_MEMORY_CAP_BYTES",
             "SAVE_FULL_MODEL", "MAX_SHARD_SIZE", "PARAM_DTYPE", "REDUCE_DTYPE",
             "EMULATE_SLOWDOWN_SCHEDULE", "ADAPTIVE", "ADAPTIVE_THRESHOLD", "ADAPTIVE_INTERVAL",
             "ADAPTIVE_HYSTERESIS_STEPS"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv("HF_CEPHALO_" + name, raising=False)


def _args(tmp_path, **kw):
    return CephaloTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", **kw)


def test_defaults(tmp_path):
    args = _args(tmp_path)
    assert args.cephalo_plan_file is None and args.cephalo_global_batch_size is None
    assert args.cephalo_memory_fraction == 0.8
    assert args.cephalo_activation_offload == "auto" and args.cephalo_settings().offload_activations is None
    assert args.cephalo_save_full_model is False and args.cephalo_max_shard_size == "50GB"
    if not torch.cuda.is_available():
        assert args.use_cpu  # so accelerate-launched workers build a MULTI_CPU state


def test_hf_argument_parser(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({}))
    parser = HfArgumentParser(CephaloTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path / "o"), "--report_to", "none",
        "--cephalo_plan_file", str(plan), "--cephalo_global_batch_size", "12",
        "--cephalo_memory_fraction", "0.5", "--cephalo_activation_offload", "off",
        "--cephalo_emulate_slowdown", "1", "2.5", "--cephalo_emulate_memory_cap_bytes", "4000000000", "2000000000"])
    assert args.cephalo_plan_file == str(plan)
    assert args.cephalo_global_batch_size == 12 and args.cephalo_memory_fraction == 0.5
    assert args.cephalo_settings().offload_activations is False
    assert args.cephalo_emulate_slowdown == [1.0, 2.5]
    assert args.cephalo_emulate_memory_cap_bytes == [4_000_000_000, 2_000_000_000]
    with pytest.raises(SystemExit):  # argparse rejects a value outside the choices
        parser.parse_args_into_dataclasses(["--output_dir", "o", "--cephalo_activation_offload", "maybe"])


@pytest.mark.parametrize("slowdown, caps", [
    (["1,3"], ["8e9,4e9"]),               # the form the docs and the env variables use
    (["1", "3"], ["8e9", "4e9"]),         # one token per rank, 8e9-style whole bytes
    (["1,", "3"], ["8000000000,", "4e9"]),
])
def test_cli_emulation_lists_accept_env_forms(tmp_path, slowdown, caps):
    parser = HfArgumentParser(CephaloTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path / "o"), "--report_to", "none",
        "--cephalo_emulate_slowdown", *slowdown, "--cephalo_emulate_memory_cap_bytes", *caps])
    assert args.cephalo_emulate_slowdown == [1.0, 3.0]
    assert args.cephalo_emulate_memory_cap_bytes == [8_000_000_000, 4_000_000_000]
    assert all(type(x) is int for x in args.cephalo_emulate_memory_cap_bytes)
    with pytest.raises(ValueError, match="emulate_memory_cap_bytes.*whole numbers"):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path / "o"), "--report_to", "none",
                                            "--cephalo_emulate_memory_cap_bytes", "1.5e0,2"])


def test_env_fallbacks_and_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_CEPHALO_GLOBAL_BATCH_SIZE", "24")
    monkeypatch.setenv("HF_CEPHALO_MEMORY_FRACTION", "0.6")
    monkeypatch.setenv("HF_CEPHALO_ACTIVATION_OFFLOAD", "ON")
    monkeypatch.setenv("HF_CEPHALO_EMULATE_SLOWDOWN", "1, 3")
    monkeypatch.setenv("HF_CEPHALO_EMULATE_MEMORY_CAP_BYTES", "8e9,4e9")
    args = _args(tmp_path)
    assert args.cephalo_global_batch_size == 24 and args.cephalo_memory_fraction == 0.6
    assert args.cephalo_settings().offload_activations is True
    assert args.cephalo_emulate_slowdown == [1.0, 3.0]
    assert args.cephalo_emulate_memory_cap_bytes == [8_000_000_000, 4_000_000_000]
    explicit = _args(tmp_path, cephalo_global_batch_size=8, cephalo_memory_fraction=0.9)
    assert explicit.cephalo_global_batch_size == 8 and explicit.cephalo_memory_fraction == 0.9


def test_precision_defaults_follow_the_compute_dtype(tmp_path, monkeypatch):
    from hf_cephalo.engine import EnginePrecision
    from hf_cephalo.integrations.trainer.training_args import check_bf16_support

    bf16, fp16 = torch.bfloat16, torch.float16
    assert _args(tmp_path).engine_precision() == EnginePrecision(None, None, None)
    assert _args(tmp_path, bf16=True).engine_precision() == EnginePrecision(bf16, bf16, None)
    assert _args(tmp_path, fp16=True).engine_precision() == EnginePrecision(fp16, fp16, None)
    assert _args(tmp_path, bf16=True, cephalo_param_dtype="fp32").engine_precision() == \
        EnginePrecision(bf16, None, None)  # fp32 all-gathers on request
    monkeypatch.setenv("HF_CEPHALO_REDUCE_DTYPE", "bf16")
    assert _args(tmp_path, bf16=True).engine_precision() == EnginePrecision(bf16, bf16, bf16)
    with pytest.raises(ValueError, match=r"--bf16 on Tesla V100.*7.0 < 8.0.*use --fp16"):
        check_bf16_support("Tesla V100", (7, 0))
    check_bf16_support("A100", (8, 0))


@pytest.mark.parametrize("kw, match", [
    (dict(cephalo_memory_fraction=0.0), r"memory_fraction = 0.0 \(--cephalo_memory_fraction, CephaloPlugin\(memory_fraction=\.\.\.\) or env HF_CEPHALO_MEMORY_FRACTION\)"),
    (dict(cephalo_memory_fraction=1.5), "memory_fraction = 1.5"),
    (dict(cephalo_memory_fraction=float("nan")), "memory_fraction = nan"),
    (dict(cephalo_global_batch_size=0), "global_batch_size = 0"),
    (dict(cephalo_activation_offload="sometimes"), "activation_offload = 'sometimes'"),
    (dict(cephalo_emulate_slowdown=[1.0, 0.5]), r"emulate_slowdown = \[1.0, 0.5\]"),
    (dict(cephalo_emulate_slowdown="1,x"), r"emulate_slowdown = '1,x' is not a list of numbers "
                                           r"\(--cephalo_emulate_slowdown, CephaloPlugin\(emulate_slowdown=\.\.\.\) or env "
                                           r"HF_CEPHALO_EMULATE_SLOWDOWN: use e.g. '1,2.5'\)"),
    (dict(cephalo_emulate_memory_cap_bytes=[0]), r"emulate_memory_cap_bytes = \[0\]"),
    (dict(cephalo_emulate_memory_cap_bytes="1.5"), "whole numbers"),
    (dict(cephalo_emulate_slowdown=[1, 2], cephalo_emulate_memory_cap_bytes=[5]), "one value per rank"),
    (dict(cephalo_plan_file="/nonexistent/plan.json"), "plan_file = '/nonexistent/plan.json'.*no such file"),
    (dict(cephalo_profile_file="/nonexistent/p.json"), "cephalo_profile_file"),
    (dict(cephalo_global_batch_size=2.5), "global_batch_size = 2.5"),
    (dict(cephalo_emulate_slowdown=[1.0, float("inf")]), "emulate_slowdown"),
    (dict(per_device_eval_batch_size=0), "--per_device_eval_batch_size = 0: need at least 1"),
    (dict(per_device_train_batch_size=0), "--per_device_train_batch_size = 0: need at least 1"),
    (dict(fp16=True, bf16=True), "--fp16 and --bf16 are both set"),
    (dict(cephalo_param_dtype="bf16"), r"cephalo_param_dtype = 'bf16' but the compute dtype is fp32"),
    (dict(bf16=True, cephalo_param_dtype="fp16"), "cephalo_param_dtype = 'fp16' but the compute dtype is bf16"),
    (dict(bf16=True, cephalo_param_dtype="fp32", cephalo_reduce_dtype="bf16"), "cephalo_reduce_dtype = 'bf16' is lower"),
    (dict(cephalo_param_dtype="int8"), r"param_dtype = 'int8' \(--cephalo_param_dtype, CephaloPlugin\(param_dtype=\.\.\.\) or env HF_CEPHALO_PARAM_DTYPE\)"),
    (dict(cephalo_save_full_model="maybe"), r"save_full_model = 'maybe' \(--cephalo_save_full_model, CephaloPlugin\(save_full_model=\.\.\.\) or env HF_CEPHALO_SAVE_FULL_MODEL\)"),
    (dict(cephalo_max_shard_size="5XB"), r"max_shard_size = '5XB' \(--cephalo_max_shard_size, CephaloPlugin\(max_shard_size=\.\.\.\) or env HF_CEPHALO_MAX_SHARD_SIZE\)"),
    (dict(cephalo_max_shard_size="0"), "max_shard_size = '0'"),
])
def test_validation(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _args(tmp_path, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(fp16_full_eval=True), "--fp16_full_eval is not supported"),
    (dict(bf16_full_eval=True), "--bf16_full_eval is not supported"),
])
def test_refused_fields_are_reported_by_the_trainer_checks(tmp_path, kw, match):
    """Constructing the arguments succeeds; the refusal comes with every other refusal of the
    script from CephaloTrainer (check_training_args: [Note: one refusal message])."""
    from hf_cephalo.integrations.trainer.support import check_training_args

    args = _args(tmp_path, per_device_train_batch_size=8, **kw)
    with pytest.raises(ValueError, match=match):
        check_training_args(args)


def test_save_settings_from_flags_and_env(tmp_path, monkeypatch):
    parser = HfArgumentParser(CephaloTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path / "o"), "--report_to", "none",
        "--cephalo_save_full_model", "true", "--cephalo_max_shard_size", "2GB"])
    assert args.cephalo_save_full_model is True and args.cephalo_max_shard_size == "2GB"
    monkeypatch.setenv("HF_CEPHALO_SAVE_FULL_MODEL", "yes")
    monkeypatch.setenv("HF_CEPHALO_MAX_SHARD_SIZE", "1000000")
    args = _args(tmp_path)
    assert args.cephalo_save_full_model is True and args.cephalo_max_shard_size == 1_000_000
    assert _args(tmp_path, cephalo_save_full_model=False).cephalo_save_full_model is False


def test_env_value_is_validated(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_CEPHALO_MEMORY_FRACTION", "abc")
    with pytest.raises(ValueError, match="memory_fraction = 'abc'"):
        _args(tmp_path)


def test_batch_size_rules_and_world_size_check(tmp_path):
    """The job's global batch, resolved once ([Note: batch size semantics] in runtime/job.py):
    stock's per-device x world (x accumulation steps), the setting, or the plan's; an emulation
    list of another length than the world is refused when the job is made."""
    from hf_cephalo.integrations.trainer.training_args import job_from_training_args
    from hf_cephalo.planner import Plan

    def batch(args, world, plan=None):
        job = job_from_training_args(args, world, plan=plan)
        return job.global_batch_size, job.global_batch_size_given

    args = _args(tmp_path, per_device_train_batch_size=3)
    assert batch(args, 4) == (12, False)  # same as stock Trainer
    assert batch(args, 4, Plan.even(4, 10)) == (10, True)
    args = _args(tmp_path, cephalo_global_batch_size=16)
    assert batch(args, 2) == (16, True)
    assert batch(args, 2, Plan.even(2, 16)) == (16, True)
    with pytest.raises(ValueError, match="cephalo_global_batch_size = 16 but the plan"):
        batch(args, 2, Plan.even(2, 10))
    args = _args(tmp_path, cephalo_emulate_slowdown=[1.0, 2.0])
    job_from_training_args(args, 2)
    with pytest.raises(ValueError, match="has 2 entries but the world size is 3"):
        job_from_training_args(args, 3)


def test_package_exports_every_public_name():
    """The package face (README: ``from hf_cephalo import CephaloTrainer, ...``) and each door
    package resolve their names lazily to the defining module; importing ``hf_cephalo`` alone
    imports no door (nor transformers)."""
    import importlib
    import importlib.util
    import subprocess
    import sys

    import hf_cephalo
    import hf_cephalo.integrations as doors

    face = {"CephaloTrainer", "CephaloTrainingArguments", "CephaloSeq2SeqTrainer",
            "CephaloSeq2SeqTrainingArguments", "CephaloAccelerator", "CephaloPlugin",
            "CephaloSFTTrainer", "CephaloSFTConfig", "CephaloDPOTrainer", "CephaloDPOConfig",
            "CephaloRewardTrainer", "CephaloRewardConfig", "CephaloKTOTrainer",
            "CephaloKTOConfig", "CephaloGRPOTrainer", "CephaloGRPOConfig", "CephaloRLOOTrainer",
            "CephaloRLOOConfig", "reproducible_rollout", "CompletionsCallback", "SamplingParams",
            "from_pretrained_sharded", "latest_checkpoint"}
    assert set(hf_cephalo.__all__) == face | {"__version__"}
    doors_installed = ["trainer", "loop"] + (["trl"] if importlib.util.find_spec("trl") else [])
    for door in doors_installed:  # the trl door needs the trl extra
        package = importlib.import_module(f"hf_cephalo.integrations.{door}")
        for name in package.__all__:
            defining = importlib.import_module(f"{package.__name__}.{package._EXPORTS[name]}")
            assert name in defining.__all__, (door, name)
            assert getattr(package, name) is getattr(defining, name) is getattr(doors, name)
            if name in face:
                assert getattr(hf_cephalo, name) is getattr(defining, name)
    from hf_cephalo.runtime.elastic import latest_checkpoint
    from hf_cephalo.runtime.pretrained import from_pretrained_sharded

    from hf_cephalo.runtime.generation import SamplingParams

    assert hf_cephalo.latest_checkpoint is latest_checkpoint
    assert hf_cephalo.from_pretrained_sharded is from_pretrained_sharded
    assert hf_cephalo.SamplingParams is SamplingParams
    code = ("import sys, hf_cephalo; print(sorted(m for m in sys.modules if m.startswith("
            "('transformers', 'hf_cephalo.integrations', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_adaptive_settings_defaults_and_errors(tmp_path, monkeypatch):
    args = _args(tmp_path)
    assert (args.cephalo_adaptive, args.cephalo_adaptive_threshold, args.cephalo_adaptive_interval,
            args.cephalo_adaptive_hysteresis_steps) == ("batch", 0.05, 5, 20)
    monkeypatch.setenv("HF_CEPHALO_EMULATE_SLOWDOWN_SCHEDULE", "0:1,1;10:1,3")
    assert _args(tmp_path).cephalo_emulate_slowdown_schedule == "0:1,1;10:1,3"
    monkeypatch.delenv("HF_CEPHALO_EMULATE_SLOWDOWN_SCHEDULE")
    for kw, match in [
        (dict(cephalo_adaptive="always"), "--cephalo_adaptive"),
        (dict(cephalo_adaptive_threshold=0.0), "--cephalo_adaptive_threshold"),
        (dict(cephalo_adaptive_threshold=1.5), "--cephalo_adaptive_threshold"),
        (dict(cephalo_adaptive_interval=0), "--cephalo_adaptive_interval"),
        (dict(cephalo_adaptive_hysteresis_steps=-1), "--cephalo_adaptive_hysteresis_steps"),
        (dict(cephalo_emulate_slowdown_schedule="0:1,1;10:1"), "one factor per rank"),
        (dict(cephalo_emulate_slowdown_schedule="0:1,1;10:1,3;5:1,1"), "strictly increasing"),
        (dict(cephalo_emulate_slowdown_schedule="3:1,1"), "start at 0"),
        (dict(cephalo_emulate_slowdown_schedule="0:1,0"), "factor that is not a finite"),
        (dict(cephalo_emulate_slowdown_schedule="0:1,-2"), "factor that is not a finite"),
        (dict(cephalo_emulate_slowdown_schedule="0=1,1"), "not STEP:F0,F1"),
        (dict(cephalo_emulate_slowdown_schedule="0:1,1", cephalo_emulate_slowdown="1,2"),
         "both set"),
    ]:
        with pytest.raises(ValueError, match=match):
            _args(tmp_path, **kw)
    args = _args(tmp_path, cephalo_emulate_slowdown_schedule="0:1,1;10:1,3")
    with pytest.raises(ValueError, match="world size is 3"):
        args.cephalo_settings().check_world_size(3)
    from hf_cephalo.profiler.emulate import EmulationConfig

    emulation = EmulationConfig.from_settings(args.cephalo_settings())
    assert emulation.slowdown == [1.0, 1.0]
    assert emulation.schedule.factors_at(9) == (1.0, 1.0)
    assert emulation.schedule.factors_at(10) == (1.0, 3.0)


def test_settings_declared_once_help_and_defaults(tmp_path):
    """Every Cephalo setting is one ``cephalo_<name>`` field of the training arguments with the
    setting's default after resolution, and the command line's --help (which argparse
    %-formats: "5%" used to make it raise) shows each one's default and environment variable."""
    from dataclasses import fields

    from transformers import HfArgumentParser

    from hf_cephalo.integrations.loop.accelerator import CephaloPlugin
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.runtime.settings import CephaloSettings, env_name

    args, plugin = _args(tmp_path), CephaloPlugin()
    names = [f.name for f in fields(CephaloSettings)]
    cephalo = [f.name for f in fields(CephaloTrainingArguments) if f.name.startswith("cephalo_")]
    assert cephalo == [f"cephalo_{n}" for n in names]
    for name in names:
        assert getattr(args, f"cephalo_{name}") == getattr(plugin, name) \
            == CephaloSettings.default_of(name), name
    text = HfArgumentParser(CephaloTrainingArguments).format_help()
    for name in names:
        assert f"--cephalo_{name}" in text and env_name(name) in text, name
    assert "(0.05 = 5%)" in text.replace("\n", " ").replace("  ", " ")


def test_a_misspelled_variable_is_named_with_the_closest_setting(monkeypatch, caplog):
    """An HF_CEPHALO_* variable that nothing reads was ignored without a word."""
    import logging

    from hf_cephalo.runtime import settings

    monkeypatch.setenv("HF_CEPHALO_MEMORY_FRACTON", "0.5")
    monkeypatch.setattr(settings, "_warned_unknown", set())
    with caplog.at_level(logging.WARNING, logger="hf_cephalo.runtime.settings"):
        assert settings.CephaloSettings().memory_fraction == settings.CephaloSettings.default_of(
            "memory_fraction")
        settings.CephaloSettings()  # said once
    said = [r.getMessage() for r in caplog.records if "HF_CEPHALO_MEMORY_FRACTON" in r.getMessage()]
    assert said == ["HF_CEPHALO_MEMORY_FRACTON is set but is not a Cephalo setting or variable, "
                    "so it is ignored; did you mean HF_CEPHALO_MEMORY_FRACTION?"], said

