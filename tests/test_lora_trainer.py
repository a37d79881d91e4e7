"""CephaloTrainer on a LoRA PeftModel (2 ranks, uneven plan): trains, ``save_model`` writes the
adapter in PEFT's format (``PeftModel.from_pretrained`` gives the trained model's logits; the
frozen base is the untouched one), a checkpoint resumes onto another plan with the same next
losses, and ``hf-cephalo export --merge-lora`` of the last checkpoint writes exactly the tensors
of PEFT's own ``merge_and_unload()`` of the saved adapter (``from_pretrained`` of the base class
gives the trained model's logits); a mismatched adapter config, an adapter of another base model
and a plain export of the LoRA checkpoint are refused with errors that name the fix.

One run_ranks call (train 4 steps saving at 2, resume from step 2 on another plan).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("peft")

from tests.dist_utils import budget_s, run_ranks, test_timeout  # noqa: E402
from tests.models_fixtures import build  # noqa: E402
from tests.test_lora import peft_model  # noqa: E402

JOB_S = 40.0
pytestmark = test_timeout(JOB_S)
N_TRAIN = 16


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 97, (12,), generator=g),
             "attention_mask": torch.ones(12, dtype=torch.long),
             "labels": torch.randint(0, 3, (), generator=g)} for _ in range(n)]


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _trainer(out_dir, plan, **kw):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

    args = CephaloTrainingArguments(output_dir=out_dir, report_to="none", learning_rate=1e-2,
                                    max_steps=4, logging_steps=1, save_strategy="steps",
                                    save_steps=2, seed=3, disable_tqdm=True, **kw)
    return CephaloTrainer(model=peft_model("bert"), args=args, plan=plan, data_collator=_collate,
                          train_dataset=_rows(N_TRAIN, 0))


def _worker(rank, world_size, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    from hf_cephalo.planner import Plan

    trainer = _trainer(out_dir, Plan.from_ratios([3, 1], [1, 1], [0.7, 0.3]))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    save_dir = os.path.join(out_dir, "adapter")
    trainer.save_model(save_dir)
    expected_logits = None
    batch = _collate(_rows(4, 9))
    model = trainer.unshard_model()
    model.eval()
    with torch.no_grad():
        expected_logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    # resume at step 2 on another plan (other cut points through the adapters)
    other = _trainer(os.path.join(out_dir, "resumed"), Plan.from_ratios([2, 2], [2, 1], [0.1, 0.9]))
    other.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    resumed = [h["loss"] for h in other.state.log_history if "loss" in h and "train_loss" not in h]
    return dict(losses=losses, resumed=resumed, save_dir=save_dir, out_dir=out_dir,
                logits=expected_logits.numpy(), files=sorted(os.listdir(save_dir)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("lora_trainer"))
    return run_ranks(_worker, 2, out_dir, timeout_s=budget_s(JOB_S))[0]


def test_save_model_writes_a_peft_adapter(trained):
    from peft import PeftModel

    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(trained["files"])
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in trained["files"])
    base = build("bert", seed=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    loaded = PeftModel.from_pretrained(base, trained["save_dir"]).eval()
    batch = _collate(_rows(4, 9))
    with torch.no_grad():
        logits = loaded(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.testing.assert_close(logits, torch.from_numpy(trained["logits"]), rtol=1e-5, atol=1e-6)


def test_checkpoint_resumes_onto_another_plan(trained):
    # the resumed run's history: the checkpoint's 2 logged steps, then its own steps 3 and 4
    assert len(trained["losses"]) == 4 and len(trained["resumed"]) == 4
    torch.testing.assert_close(torch.tensor(trained["resumed"]), torch.tensor(trained["losses"]),
                               rtol=1e-5, atol=1e-6)


def test_adapter_of_another_base_is_refused(trained):
    import transformers

    from hf_cephalo.engine.peft_save import check_adapter_matches

    check_adapter_matches(trained["save_dir"], build("bert", seed=0))  # its own base: fine
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, num_labels=3)
    with pytest.raises(ValueError, match=r"does not fit the base model .*load that base model"):
        check_adapter_matches(trained["save_dir"], transformers.BertForSequenceClassification(cfg))


def _merged_reference(save_dir):
    """Single-process PEFT: the saved adapter on its base, ``merge_and_unload()``."""
    from peft import PeftModel

    base = build("bert", seed=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return PeftModel.from_pretrained(base, save_dir).merge_and_unload().eval()


def test_export_merge_lora_equals_peft_merge_and_unload(trained, tmp_path, capsys):
    import transformers
    from safetensors.torch import load_file

    from hf_cephalo.cli import main

    checkpoint = os.path.join(trained["out_dir"], "checkpoint-4")
    assert os.path.isfile(os.path.join(checkpoint, "adapter_config.json"))
    out = str(tmp_path / "merged")
    assert main(["export", checkpoint, "--out", out, "--merge-lora"]) == 0
    assert "with the LoRA adapter merged" in capsys.readouterr().out
    want = _merged_reference(trained["save_dir"]).state_dict()
    got = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for key, value in want.items():  # PEFT's own merge per layer: the same bits
        assert torch.equal(got[key], value), key
    loaded, info = transformers.BertForSequenceClassification.from_pretrained(
        out, output_loading_info=True)
    assert not any(info.values()), info
    batch = _collate(_rows(4, 9))
    with torch.no_grad():
        logits = loaded.eval()(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.testing.assert_close(logits, torch.from_numpy(trained["logits"]), rtol=1e-5, atol=1e-6)


def test_merge_lora_bad_inputs(trained, tmp_path):
    import transformers
    from peft import LoraConfig, get_peft_model

    from hf_cephalo.engine.checkpoint import CheckpointError, export_hf
    from hf_cephalo.engine.peft_merge import export_merged_lora

    checkpoint = os.path.join(trained["out_dir"], "checkpoint-4")
    with pytest.raises(CheckpointError, match=r"is a LoRA checkpoint .*lora_A.*--merge-lora"):
        export_hf(checkpoint, str(tmp_path / "plain"))  # LoRA keys: the plain export says why
    # an adapter config that targets modules this base lacks, or of another rank
    for name, config in {"llama_targets": LoraConfig(target_modules=["q_proj", "v_proj"]),
                         "rank8": LoraConfig(r=8, target_modules=["query", "value"],
                                             task_type="SEQ_CLS")}.items():
        config.save_pretrained(str(tmp_path / name))
        with pytest.raises(CheckpointError, match=r"give the adapter config of this run"):
            export_merged_lora(checkpoint, str(tmp_path / "out"),
                               adapter_config=str(tmp_path / name))
    # an adapter trained on another base model (wider BERT)
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, num_labels=3)
    other = get_peft_model(transformers.BertForSequenceClassification(cfg),
                           LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))
    other.save_pretrained(str(tmp_path / "other_base"))
    with pytest.raises(ValueError, match=r"does not fit the base model .*load that base model"):
        export_merged_lora(checkpoint, str(tmp_path / "out"),
                           adapter_config=str(tmp_path / "other_base"))
    # a LoRA checkpoint without its adapter config (e.g. an engine-level save_checkpoint)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(checkpoint):
        if name.startswith("cephalo_"):
            os.link(os.path.join(checkpoint, name), bare / name)
    with pytest.raises(CheckpointError, match=r"adapter_config.json: missing .*--adapter-config"):
        export_merged_lora(str(bare), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")  # nothing written by a refused export
