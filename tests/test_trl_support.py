"""TRL's support matrix (hf_cephalo/integrations/trl/support.py) is complete, documented and
enforced: every field SFTConfig adds to TrainingArguments is classified, every "works as stock"
entry names an existing test, docs/trl.md holds the rendered tables, refused settings and TRL
trainers that generate are refused in ONE message before any process group exists, and the
package imports without TRL. Single process, no collectives.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from hf_cephalo.integrations.trainer.support import RefusedSettings, Status
from tests.test_trainer_support import ROOT, _test_names

trl = pytest.importorskip("trl")


def _sft_fields(config=None) -> list[str]:
    import transformers

    stock = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return [f.name for f in dataclasses.fields(config or trl.SFTConfig) if f.name not in stock]


def test_every_sft_config_field_is_classified():
    """A field a future TRL adds to SFTConfig fails here until trl_support.py classifies it."""
    from hf_cephalo.integrations.trl.support import SFT_FIELD_SUPPORT

    names = _sft_fields()
    assert [n for n in names if n not in SFT_FIELD_SUPPORT] == []
    assert set(SFT_FIELD_SUPPORT) - set(names) == set(), "entries for fields that no longer exist"


def test_every_dpo_config_field_is_classified():
    """A field a future TRL adds to DPOConfig fails here until trl_support.py classifies it."""
    from hf_cephalo.integrations.trl.support import DPO_FIELD_SUPPORT

    names = _sft_fields(trl.DPOConfig)
    assert [n for n in names if n not in DPO_FIELD_SUPPORT] == []
    assert set(DPO_FIELD_SUPPORT) - set(names) == set(), "entries for fields that no longer exist"


@pytest.mark.parametrize("config, table", [("RewardConfig", "REWARD_FIELD_SUPPORT"),
                                           ("KTOConfig", "KTO_FIELD_SUPPORT")])
def test_every_reward_and_kto_config_field_is_classified(config, table):
    """A field a future TRL adds to RewardConfig / KTOConfig fails here until support.py
    classifies it."""
    from hf_cephalo.integrations.trl import support

    names, entries = _sft_fields(getattr(trl, config)), getattr(support, table)
    assert [n for n in names if n not in entries] == []
    assert set(entries) - set(names) == set(), "entries for fields that no longer exist"


def test_stock_entries_name_existing_tests():
    from hf_cephalo.integrations.trl.support import (DPO_FIELD_SUPPORT, KTO_FIELD_SUPPORT,
                                                     REWARD_FIELD_SUPPORT, SFT_FIELD_SUPPORT,
                                                     TRL_TRAINER_SUPPORT)

    for name, support in {**SFT_FIELD_SUPPORT, **DPO_FIELD_SUPPORT, **REWARD_FIELD_SUPPORT,
                          **KTO_FIELD_SUPPORT, **TRL_TRAINER_SUPPORT}.items():
        assert support.note, name
        if support.status is Status.STOCK:
            path, _, func = support.test.partition("::")
            assert func in _test_names(path), f"{name}: {support.test} does not exist"


def test_every_trl_trainer_is_classified():
    """Every trainer class TRL exports (stable and experimental) has an entry: a new one is
    refused as 'not validated' anyway, but should be classified with its reason."""
    from hf_cephalo.integrations.trl.support import TRL_TRAINER_SUPPORT

    exported = {name for name in dir(trl) if name.endswith("Trainer")}
    assert exported - set(TRL_TRAINER_SUPPORT) == set()


def test_docs_page_is_the_rendered_matrix():
    from hf_cephalo.integrations.trl.support import render_markdown

    with open(os.path.join(ROOT, "docs", "trl.md")) as f:
        page = f.read()
    assert render_markdown() in page, ("regenerate the tables of docs/trl.md: python -c "
                                       "\"from hf_cephalo.integrations.trl.support import "
                                       "render_markdown as r; print(r())\"")


def _config(tmp_path, **kw):
    from hf_cephalo.integrations import CephaloSFTConfig

    return CephaloSFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False, **kw)


def _chat():
    from tests.trl_fixtures import chat_dataset

    return chat_dataset("messages", 4)


def test_sft_defaults_are_trl_defaults(tmp_path):
    """CephaloSFTConfig keeps SFTConfig's defaults (not TrainingArguments'), help included."""
    from hf_cephalo.integrations import CephaloSFTConfig

    stock = trl.SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    ours = CephaloSFTConfig(output_dir=str(tmp_path), report_to="none")
    for name in ("learning_rate", "logging_steps", "bf16", "gradient_checkpointing",
                 "max_length", "packing_strategy", "loss_type"):
        assert getattr(ours, name) == getattr(stock, name), name
    fields = {f.name: f for f in dataclasses.fields(CephaloSFTConfig)}
    assert fields["learning_rate"].metadata == \
        {f.name: f for f in dataclasses.fields(trl.SFTConfig)}["learning_rate"].metadata
    from hf_cephalo.integrations import CephaloTrainingArguments

    plain = CephaloTrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert "cephalo_plan_file" in fields  # every Cephalo setting, with its own default
    assert all(getattr(ours, f) == getattr(plain, f) for f in fields if f.startswith("cephalo_"))


def test_refused_in_one_message_before_any_collective(tmp_path, monkeypatch):
    """activation_offloading, use_liger_kernel and pad_to_multiple_of with padding-free
    packing: one numbered message, raised before SFTTrainer prepares anything and before any
    process group exists; CephaloTrainer refuses a model given by name in the same message
    (stock Trainer takes a model object; the TRL doors load a name: next test)."""
    from hf_cephalo.integrations import CephaloTrainer, CephaloTrainingArguments
    from hf_cephalo.integrations import CephaloSFTTrainer
    from tests.trl_fixtures import tiny_llama

    monkeypatch.delenv("HF_CEPHALO_PLAN_FILE", raising=False)
    args = _config(tmp_path, activation_offloading=True, use_liger_kernel=True, packing=True,
                   pad_to_multiple_of=8)
    prepared = []
    monkeypatch.setattr(trl.SFTTrainer, "_prepare_dataset",
                        lambda *a, **k: prepared.append(1))
    with pytest.raises(RefusedSettings) as info:
        CephaloSFTTrainer(model=tiny_llama(32), args=args, train_dataset=_chat())
    message = str(info.value)
    assert "refuses 3 settings" in message, message
    for needle in ("--use_liger_kernel", "--activation_offloading", "--pad_to_multiple_of = 8",
                   "--cephalo_activation_offload"):
        assert needle in message, (needle, message)
    assert not prepared and not torch.distributed.is_initialized()
    with pytest.raises(RefusedSettings, match="from_pretrained_sharded"):
        CephaloTrainer(model="some/llama", args=CephaloTrainingArguments(
            output_dir=str(tmp_path), report_to="none"), train_dataset=[{}])
    with pytest.raises(RefusedSettings, match="activation_offloading"):  # a model object too
        CephaloSFTTrainer(model=tiny_llama(32), args=_config(tmp_path, activation_offloading=True),
                          train_dataset=_chat())


def test_model_by_name_refusals(tmp_path, monkeypatch):
    """A model given by name (as TRL's scripts pass it) is loaded on the meta device; the
    model_init_kwargs the engine cannot honour are refused, naming the key and what to do,
    before any process group exists."""
    from hf_cephalo.integrations import CephaloSFTTrainer
    from tests.trl_fixtures import tiny_llama

    monkeypatch.delenv("HF_CEPHALO_PLAN_FILE", raising=False)
    folder = str(tmp_path / "saved")
    tiny_llama(32).save_pretrained(folder)
    for kwargs, needle in [({"dtype": "bfloat16"}, "dtype='bfloat16'.*bf16=True"),
                           ({"quantization_config": {"load_in_4bit": True}},
                            r"\['quantization_config'\].*pass the object"),
                           ({"device_map": {"": 0}}, "device_map")]:
        with pytest.raises(ValueError, match=needle):
            CephaloSFTTrainer(model=folder, args=_config(tmp_path, model_init_kwargs=kwargs),
                              train_dataset=_chat())
    assert not torch.distributed.is_initialized()
    # honoured as stock's from_pretrained honours them: "auto" on a float32 checkpoint, a
    # config override, a loading option set to None
    from hf_cephalo.runtime.pretrained import load_named_model

    model = load_named_model(folder, {"dtype": "auto", "use_cache": False,
                                      "quantization_config": None}, door="CephaloSFTTrainer")
    assert model.config.use_cache is False and all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("name, why", [("GRPOTrainer", "through CephaloGRPOTrainer only"),
                                       ("RLOOTrainer", "through CephaloRLOOTrainer only"),
                                       ("DistillationTrainer", "generates completions")])
def test_trl_trainers_that_cannot_run_are_refused(tmp_path, name, why, monkeypatch):
    """A TRL trainer the engine cannot run, put on the runtime by the same mixin, is refused
    with what is missing, before its own __init__ runs."""
    from hf_cephalo.integrations import CephaloTrainerMixin
    from tests.trl_fixtures import tiny_llama

    monkeypatch.delenv("HF_CEPHALO_PLAN_FILE", raising=False)
    cls = type(f"Cephalo{name}", (CephaloTrainerMixin, getattr(trl, name)), {})
    monkeypatch.setattr(getattr(trl, name), "__init__",
                        lambda *a, **k: pytest.fail("the TRL trainer's __init__ ran"))
    with pytest.raises(RefusedSettings, match=why) as info:
        cls(model=tiny_llama(32), args=_config(tmp_path), train_dataset=_chat())
    assert name in str(info.value)


def test_sft_config_is_required(tmp_path):
    """A stock SFTConfig (no cephalo_* settings) is refused with the class to use."""
    from hf_cephalo.integrations import CephaloSFTTrainer
    from tests.trl_fixtures import tiny_llama

    with pytest.raises(TypeError, match="needs CephaloTrainingArguments"):
        CephaloSFTTrainer(model=tiny_llama(32),
                          args=trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True),
                          train_dataset=_chat())


def test_package_imports_without_trl():
    """hf_cephalo, its CLI and CephaloTrainer import with TRL absent; the TRL names raise an
    ImportError naming the extra."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'trl' or name.startswith('trl.'):\n"
        "            raise ImportError('trl is not installed')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import hf_cephalo, hf_cephalo.cli\n"
        "from hf_cephalo.integrations import CephaloTrainer, CephaloTrainingArguments\n"
        "try:\n"
        "    from hf_cephalo.integrations import CephaloSFTTrainer\n"
        "except ImportError as e:\n"
        "    print('IMPORT-ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR" in out.stdout and "hf-cephalo[trl]" in out.stdout, out.stdout
