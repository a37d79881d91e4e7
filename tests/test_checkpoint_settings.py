"""What CephaloTrainer checkpoints hold under every save setting, and what can be done with them.

Two process groups (2 gloo ranks each):

1. The checkpoint-content matrix: one training step and one checkpoint for every combination of
   ``save_only_model`` x ``cephalo_save_full_model`` x (Llama | LoRA BERT), plus ``--fp16``.
   In the same group: a weights-only resume from a ``save_only_model`` checkpoint onto ANOTHER
   plan (as stock: weights and trainer state restored, optimizer and LR schedule fresh; for
   LoRA the adapter file into the trainable shards);
   checkpoints with a promised file removed (scheduler, weights, scaler) refused on resume
   naming the file and the setting; a save whose weights never arrive is not marked complete;
   ``resume_from_checkpoint=True`` skipping a newer incomplete checkpoint, and refusing when
   none is complete.
2. ``load_best_model_at_end`` (metric, ``greater_is_better``, ``save_total_limit``): the engine's
   parameters after training equal those of a reference run stopped at the best step, from the
   sharded checkpoint and (on another plan) from a ``save_only_model`` checkpoint; evaluate,
   save_model and unshard_model see them.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

pytest.importorskip("peft")

from tests.dist_utils import budget_s, portable, run_ranks, test_timeout  # noqa: E402
from tests.models_fixtures import build  # noqa: E402

MATRIX_S, BEST_S = 60.0, 35.0  # seconds per process group: measured 55 s and 27 s (2 cores, load ~8)
pytestmark = test_timeout(MATRIX_S, BEST_S)
PLAN = ([3, 1], [1, 1], [0.7, 0.3])
OTHER_PLAN = ([1, 3], [1, 3], [0.2, 0.8])
SETTINGS = [dict(save_only_model=som, cephalo_save_full_model=full, lora=lora)
            for som in (False, True) for full in (False, True) for lora in (False, True)]
SETTINGS += [dict(save_only_model=som, cephalo_save_full_model=False, lora=False, fp16=True)
             for som in (False, True)]  # the fp16 loss scaler: scaler.pt unless save_only_model


def _name(setting) -> str:
    return "-".join(f"{k}={int(v)}" for k, v in setting.items())


def _causal_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 97, (12,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, 6, (), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _class_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 97, (12,), generator=g),
             "attention_mask": torch.ones(12, dtype=torch.long),
             "labels": torch.randint(0, 3, (), generator=g)} for _ in range(n)]


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _env(rank, world_size):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))


def _trainer(out_dir, plan=PLAN, *, lora=False, cls=None, trainer_kw=None, **kw):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan
    from tests.test_lora import peft_model

    kw = {"max_steps": 1, "save_strategy": "steps", "save_steps": 1, **kw}
    args = CephaloTrainingArguments(output_dir=out_dir, report_to="none", learning_rate=3e-3,
                                    adam_epsilon=1e-4, logging_steps=1, seed=5,
                                    disable_tqdm=True, **kw)
    model = peft_model("bert") if lora else build("llama").train()
    rows = _class_rows(16, 0) if lora else _causal_rows(16, 0)
    return (cls or CephaloTrainer)(model=model, args=args, plan=Plan.from_ratios(*plan),
                                   train_dataset=rows, data_collator=_collate,
                                   **(trainer_kw or {}))


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _full_params(trainer):
    state = trainer.engine.full_state_dict()  # collective; rank 0 gets it
    return None if state is None else {k: v.detach().clone() for k, v in state.items()}


def _record_at_train_begin(record: dict):
    """A callback storing the engine's full parameters and the step when training begins
    (after a resume's load) into ``record`` (``record["trainer"]`` must be set by then)."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            record["params"] = _full_params(record["trainer"])
            record["step"] = state.global_step

    return Record()


# ---- group 1: the checkpoint-content matrix, resumes, refusals ---------------------------------
def _matrix_worker(rank, world_size, root):
    import torch.distributed as dist

    _env(rank, world_size)
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer

    out = {"runs": {}}
    for setting in SETTINGS:
        run_dir = os.path.join(root, _name(setting))
        trainer = _trainer(run_dir, **setting)
        trainer.train()
        out["runs"][_name(setting)] = dict(dir=os.path.join(run_dir, "checkpoint-1"),
                                           params=_full_params(trainer))

    som = os.path.join(root, _name(dict(save_only_model=True, cephalo_save_full_model=False,
                                        lora=False)), "checkpoint-1")
    full = os.path.join(root, _name(dict(save_only_model=False, cephalo_save_full_model=False,
                                         lora=False)), "checkpoint-1")
    fp16 = os.path.join(root, _name(dict(save_only_model=False, cephalo_save_full_model=False,
                                         lora=False, fp16=True)), "checkpoint-1")
    # weights-only resume (stock's behaviour for save_only_model) onto another plan
    record = {}
    trainer = _trainer(os.path.join(root, "resumed"), OTHER_PLAN, max_steps=2,
                       save_strategy="no",
                       trainer_kw=dict(callbacks=[_record_at_train_begin(record)]))
    record["trainer"] = trainer
    with _capture_warnings() as warnings:
        error = _error(lambda: trainer.train(resume_from_checkpoint=som))
    if error is not None:  # every rank raised the same error (errors_on_every_rank)
        out["weights_only"] = dict(error=error)
    else:
        opt_steps = {float(s["step"]) for s in trainer.optimizer.optimizer.state.values()}
        logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
        out["weights_only"] = dict(at_begin=record["params"], begin_step=record["step"],
                                   steps=[h["step"] for h in logs], opt_steps=sorted(opt_steps),
                                   scheduler_steps=trainer.lr_scheduler.last_epoch,
                                   warned=any("save_only_model=True" in w for w in warnings))
    lora_som = out["runs"][_name(dict(save_only_model=True, cephalo_save_full_model=False,
                                      lora=True))]["dir"]
    record = {}
    trainer = _trainer(os.path.join(root, "lora_resumed"), OTHER_PLAN, lora=True, max_steps=2,
                       save_strategy="no",
                       trainer_kw=dict(callbacks=[_record_at_train_begin(record)]))
    record["trainer"] = trainer
    out["lora_weights_only"] = dict(
        error=_error(lambda: trainer.train(resume_from_checkpoint=lora_som)),
        at_begin=record.get("params"))

    # a promised file removed: refused on resume, naming the file and the setting
    out["refused"] = {}
    for case, (src, removed, fp16_run) in {"scheduler": (full, "scheduler.pt", False),
                                           "weights": (som, "model.safetensors", False),
                                           "scaler": (fp16, "scaler.pt", True)}.items():
        damaged = os.path.join(root, f"damaged-{case}", "checkpoint-1")
        if rank == 0:
            shutil.copytree(src, damaged)
            if os.path.exists(os.path.join(damaged, removed)):  # (a release that never wrote it)
                os.remove(os.path.join(damaged, removed))
        dist.barrier()
        kw = {"fp16": True} if fp16_run else {}
        trainer = _trainer(os.path.join(root, f"resume-{case}"), max_steps=2, **kw)
        out["refused"][case] = _error(lambda: trainer.train(resume_from_checkpoint=damaged))

    # the old bug, simulated: save_model writes nothing; the checkpoint must not be published
    class NoWeights(CephaloTrainer):
        def save_model(self, output_dir=None, _internal_call=False):
            if not _internal_call:
                super().save_model(output_dir, _internal_call)

    no_weights = os.path.join(root, "no-weights")
    trainer = _trainer(no_weights, cls=NoWeights, save_only_model=True)
    out["no_weights_error"] = _error(trainer.train)
    out["no_weights_listing"] = sorted(os.listdir(no_weights))

    # resume_from_checkpoint=True: the newest COMPLETE checkpoint, newer incomplete ones skipped
    picked = os.path.join(root, "picked")
    if rank == 0:
        shutil.copytree(full, os.path.join(picked, "checkpoint-1"))
        shutil.copytree(full, os.path.join(picked, "checkpoint-3"))
        os.remove(os.path.join(picked, "checkpoint-3", "cephalo_complete.json"))
        shutil.copytree(os.path.join(picked, "checkpoint-3"), os.path.join(root, "none",
                                                                             "checkpoint-3"))
    dist.barrier()
    trainer = _trainer(picked, max_steps=2, save_strategy="no")
    with _capture_warnings() as warnings:
        out["picked_error"] = _error(lambda: trainer.train(resume_from_checkpoint=True))
    logs = [h["step"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    out["picked"] = dict(steps=logs, warnings=[w for w in warnings if "incomplete" in w])
    trainer = _trainer(os.path.join(root, "none"), max_steps=2, save_strategy="no")
    out["none_complete"] = _error(lambda: trainer.train(resume_from_checkpoint=True))
    return portable(out, True)


class _capture_warnings:
    """Collect the warnings hf_cephalo logs inside a ``with`` block."""

    def __enter__(self):
        self.records: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: self.records.append(record.getMessage())
        self.handler = handler
        logging.getLogger("hf_cephalo").addHandler(handler)
        return self.records

    def __exit__(self, *exc):
        logging.getLogger("hf_cephalo").removeHandler(self.handler)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_settings"))
    return portable(run_ranks(_matrix_worker, 2, root, timeout_s=budget_s(MATRIX_S))[0], False)


SHARDED = {"cephalo_layout.json", "cephalo_buffers.safetensors", "cephalo_shard_rank0.safetensors",
           "cephalo_shard_rank1.safetensors", "scheduler.pt", "rng_state_0.pth",
           "rng_state_1.pth"}
ALWAYS = {"trainer_state.json", "training_args.bin", "cephalo_complete.json",
          "cephalo_contents.json", "cephalo_run.json", "plan.json"}


@pytest.mark.parametrize("setting", SETTINGS, ids=_name)
def test_checkpoint_content_matrix(matrix, setting):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_cephalo.engine import checkpoint as ckpt

    run = matrix["runs"][_name(setting)]
    directory, final = run["dir"], run["params"]
    files = set(os.listdir(directory))
    # what save_model writes: PEFT's save_pretrained adds its model card (README.md)
    model_files = {"adapter_model.safetensors", "adapter_config.json", "README.md"} \
        if setting["lora"] else {"model.safetensors", "config.json", "generation_config.json"}
    want = set(ALWAYS)
    if not setting["save_only_model"]:
        want |= SHARDED | ({"scaler.pt"} if setting.get("fp16") else set())
    if setting["save_only_model"] or setting["cephalo_save_full_model"]:
        want |= model_files
    if setting["lora"]:
        want.add("adapter_config.json")  # the LoRA config, for export --merge-lora
    assert files == want, (sorted(files - want), sorted(want - files))
    assert ckpt.is_complete(directory)
    # each part loads, equal to the engine's parameters after the step the checkpoint saved
    if not setting["save_only_model"]:
        merged = ckpt.read_full_state_dict(directory)
        for key, value in final.items():
            assert torch.equal(merged[key], value), key
    else:  # nothing to export: the message says where the weights are
        with pytest.raises(ckpt.CheckpointError, match="from_pretrained"):
            ckpt.read_full_state_dict(directory)
    if "model.safetensors" in want:
        loaded = AutoModelForCausalLM.from_pretrained(directory).state_dict()
        for key, value in final.items():
            assert torch.equal(loaded[key], value), key
    if "adapter_model.safetensors" in want:
        base = build("bert", seed=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        loaded = PeftModel.from_pretrained(base, directory).state_dict()
        trained = [k for k in final if "lora_" in k or "modules_to_save" in k]
        assert trained
        for key in trained:  # the engine names the PeftModel's inner model's parameters
            assert torch.equal(loaded["base_model.model." + key], final[key]), key


def test_save_only_model_resumes_weights_only_as_stock(matrix):
    som = matrix["runs"][_name(dict(save_only_model=True, cephalo_save_full_model=False,
                                    lora=False))]
    info = matrix["weights_only"]
    assert "error" not in info, info
    # the weights (read slice by slice onto the other plan) are the checkpoint's, bit for bit
    for key, value in som["params"].items():
        assert torch.equal(info["at_begin"][key], value), key
    assert info["begin_step"] == 1 and info["steps"] == [1, 2]  # trainer state restored
    # stock finds no optimizer.pt / scheduler.pt: a fresh AdamW and a fresh LR schedule, each
    # stepped once since the resume (a full resume would show 2 for both)
    assert info["opt_steps"] == [1.0] and info["scheduler_steps"] == 1
    assert info["warned"]
    # LoRA: the adapter file's tensors into the trainable shards of another plan, base kept
    lora = matrix["lora_weights_only"]
    assert lora["error"] is None, lora["error"]
    lora_run = matrix["runs"][_name(dict(save_only_model=True, cephalo_save_full_model=False,
                                         lora=True))]
    for key, value in lora_run["params"].items():
        assert torch.equal(lora["at_begin"][key], value), key


def test_missing_promised_file_is_refused_naming_file_and_setting(matrix):
    refused = matrix["refused"]
    assert "scheduler.pt: missing" in refused["scheduler"]
    assert "save_only_model=False" in refused["scheduler"]
    assert "model.safetensors: missing" in refused["weights"]
    assert "save_only_model=True" in refused["weights"]
    assert "scaler.pt: missing" in refused["scaler"] and "fp16=True" in refused["scaler"]
    for message in refused.values():
        assert message.startswith("CheckpointError")


def test_checkpoint_without_its_weights_is_never_marked_complete(matrix):
    assert "model.safetensors: missing" in matrix["no_weights_error"]
    assert "not marked complete" in matrix["no_weights_error"]
    assert "checkpoint-1" not in matrix["no_weights_listing"]  # never published
    assert ".tmp-checkpoint-1" in matrix["no_weights_listing"]


def test_resume_true_picks_newest_complete_checkpoint(matrix):
    picked = matrix["picked"]
    assert matrix["picked_error"] is None
    assert picked["steps"] == [1, 2]  # resumed from checkpoint-1, not the incomplete -3
    assert len(picked["warnings"]) == 1 and "checkpoint-3" in picked["warnings"][0]
    assert "no complete checkpoint-N" in matrix["none_complete"]
    assert "checkpoint-3" in matrix["none_complete"]


def test_latest_checkpoint_skips_incomplete(tmp_path, caplog):
    from hf_cephalo import latest_checkpoint

    for step, complete in ((2, True), (10, False), (4, False), (3, True)):
        os.makedirs(tmp_path / f"checkpoint-{step}")
        if complete:
            (tmp_path / f"checkpoint-{step}" / "cephalo_complete.json").write_text("{}")
    os.makedirs(tmp_path / ".tmp-checkpoint-12")
    with caplog.at_level(logging.WARNING, logger="hf_cephalo"):
        assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-3")
    assert "checkpoint-10" in caplog.text and "checkpoint-4" in caplog.text
    assert latest_checkpoint(str(tmp_path / "missing")) is None


# ---- group 2: load_best_model_at_end -------------------------------------------------------
SCORES = [1.0, 5.0, 2.0, 3.0, 0.0, 0.0]  # "score" at evaluations 1..: step 2 is the best


def _best_trainer(out_dir, plan, **kw):
    calls = []

    def score(_prediction):
        calls.append(1)
        return {"score": SCORES[len(calls) - 1]}

    return _trainer(out_dir, plan, max_steps=4, eval_strategy="steps", eval_steps=1,
                    save_steps=1, lr_scheduler_type="constant", load_best_model_at_end=True,
                    metric_for_best_model="score", greater_is_better=True, save_total_limit=2,
                    trainer_kw=dict(eval_dataset=_causal_rows(4, 7), compute_metrics=score),
                    **kw)


def _best_worker(rank, world_size, root):
    _env(rank, world_size)
    out = {}
    for name, plan, kw in (("sharded", PLAN, {}), ("save_only_model", OTHER_PLAN,
                                                     dict(save_only_model=True))):
        run_dir = os.path.join(root, name)
        trainer = _best_trainer(run_dir, plan, **kw)
        trainer.train()
        evals = [h for h in trainer.state.log_history if "eval_score" in h]
        saved = os.path.join(root, f"{name}-saved")
        trainer.save_model(saved)
        after = trainer.evaluate()
        params = _full_params(trainer)
        model = trainer.unshard_model()
        out[name] = dict(params=params, best=trainer.state.best_model_checkpoint,
                         best_metric=trainer.state.best_metric,
                         eval_losses=[h["eval_loss"] for h in evals], eval_after=after["eval_loss"],
                         listing=sorted(n for n in os.listdir(run_dir) if n.startswith("check")),
                         saved=saved, unsharded={k: v.detach().clone()
                                                 for k, v in model.state_dict().items()})
    # the reference: the same run stopped at the best step (constant LR: same first two steps)
    reference = _trainer(os.path.join(root, "stopped"), PLAN, max_steps=2, save_strategy="no",
                         lr_scheduler_type="constant")
    reference.train()
    out["stopped"] = _full_params(reference)
    return portable(out, True)


@pytest.fixture(scope="module")
def best(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("load_best"))
    return portable(run_ranks(_best_worker, 2, root, timeout_s=budget_s(BEST_S))[0], False)


def test_load_best_model_at_end_equals_run_stopped_at_best_step(best):
    from safetensors.torch import load_file

    stopped = best["stopped"]
    for name in ("sharded", "save_only_model"):
        run = best[name]
        assert run["best"].endswith("checkpoint-2") and run["best_metric"] == 5.0
        # save_total_limit=2 keeps the best checkpoint and the newest, as stock rotation does
        assert run["listing"] == ["checkpoint-2", "checkpoint-4"]
        saved = load_file(os.path.join(run["saved"], "model.safetensors"))
        for key, value in stopped.items():
            if name == "sharded":  # same plan as the reference: bit for bit
                assert torch.equal(run["params"][key], value), key
            else:  # trained on another plan: the sums run in another order
                torch.testing.assert_close(run["params"][key], value, rtol=1e-5, atol=1e-6)
            assert torch.equal(saved[key], run["params"][key]), key  # save_model sees them
            assert torch.equal(run["unsharded"][key], run["params"][key]), key
        # evaluate() after training scores the best step's weights
        assert run["eval_after"] == pytest.approx(run["eval_losses"][1], rel=1e-6, abs=1e-7)
        assert run["eval_after"] != pytest.approx(run["eval_losses"][-1], rel=1e-6, abs=1e-7)
    # from the save_only_model checkpoint's files exactly (no rounding on the way in)
    best_files = load_file(os.path.join(best["save_only_model"]["best"], "model.safetensors"))
    for key, value in best_files.items():
        assert torch.equal(best["save_only_model"]["params"][key], value), key


def test_load_best_model_at_end_without_eval_strategy_gets_stock_error(tmp_path):
    from transformers import TrainingArguments

    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

    kw = dict(output_dir=str(tmp_path), report_to="none", load_best_model_at_end=True,
              save_strategy="steps", eval_strategy="no")
    messages = []
    for cls in (TrainingArguments, CephaloTrainingArguments):
        with pytest.raises(ValueError) as info:
            cls(**kw)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "load_best_model_at_end" in messages[0]
