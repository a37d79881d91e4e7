"""CephaloTrainer on the generic path vs STOCK Trainer with the whole global batch in one process
(issue 36): the 2026 zoo of tests/zoo_fixtures.py (Qwen3, Qwen3-MoE with the router loss on and
off, Gemma 3, GPT-OSS, Phi-3, Granite, OLMo 2, SmolLM3, Qwen3ForSequenceClassification with left
padding), and Gemma 3n text and Gemma 4 E (``SIDE``: per-layer inputs, side inputs the
embedding makes: docs/engine.md, "Side inputs"; Gemma 4 E at lr 0.01, see
tests/test_generic_engine_parity.py's ``LR``).

2 ranks with an uneven plan (b = [1, 3], m = [1, 2], r = [0.35, 0.65]) and 3 ranks with an idle
rank that holds state (b = [2, 0, 2], m = [1, 1, 2], r = [0.0, 0.6, 0.4]); stock Trainer with
per_device_train_batch_size = the global batch (4), sequential order, so both see the same
global batches. Compared: the logged loss and gradient norm of each step (SGD with gradient
clipping) and the final weights (the user's model object after ``trainer.unshard_model()``).
On 2 ranks also ``qwen3_lora``: a LoRA ``PeftModel`` of the Qwen3 model (adapters on attention
and MLP projections) with AdamW and weight decay 0.1 (stock puts the adapter matrices in the
decay group: issue 37 found them all in the no-decay group, silently).

Parameters the forward never reaches (docs/engine.md, "Parameters without a gradient"): stock
skips them (their ``.grad`` is None), so they must come out unchanged, not decayed, on both
world sizes with SGD and weight decay 0.1 for ``glm5`` (GLM-5's DSA indexer), ``gemma3_vlm``
(``Gemma3ForConditionalGeneration`` on text: its vision tower) and ``gemma4``
(``Gemma4ForConditionalGeneration`` as its 31B checkpoint is: no per-layer inputs, wider
full-attention layers). On 2 ranks also: ``glm5_user_optimizer``, an SGD the user assigns to
``trainer.optimizer`` over the shards; ``glm5_adamw``, AdamW with weight decay 0.1 (epsilon
1e-2, so that Adam's g / (|g| + eps) does not blow the fp32 rounding of a near-cancelled
gradient element up to the tolerance: at 1e-3 stock's own fp32 run is 1.9e-6 from its float64
run at embed_tokens[91, 6], beyond atol, and the engine 1.2e-6 from stock there; at 1e-2
stock's fp32 is at most 9.8e-8 from float64 anywhere) saved at the end: its optimizer state holds the indexer
weights at a fresh state (zeros, step 0), and resumed on 3 ranks for one more step (constant
LR, so that the reference, stock's 3 steps, has the same schedule) it equals stock.
fp32, rtol 1e-5, atol 1e-6.

On both world sizes also the encoder-decoders (``SEQ2SEQ`` of tests/zoo_fixtures.py: T5 and
BART ``...ForConditionalGeneration`` on ``DataCollatorForSeq2Seq`` batches: inputs and labels
of their own lengths, padded per global batch, the decoder inputs the collator's shift of the
labels; LED, PEGASUS-X and T5Gemma alike; Whisper on random log-mel features with its labels
padded with -100, as Whisper fine-tuning scripts collate them) through ``CephaloSeq2SeqTrainer`` against STOCK
``Seq2SeqTrainer``, with the model's own loss: besides the training, ``evaluate``'s loss,
``predict``'s logits (at the labelled positions) and the model ``save_model`` writes (loaded
back with ``from_pretrained``) equal stock's ([Note: encoder-decoders at the doors] in
runtime/door_models.py). ``trainer.generate`` (greedy, 2 prompts) equals the stock-trained
model's own ``generate`` for all but Whisper, which is refused (its encoder reads features).
For T5 and BART (``GENERATE``) also ``predict_with_generate=True`` ([Note: predict_with_generate]
in integrations/trainer/seq2seq.py), set after training on both trainers: ``predict`` with
``generation_max_length`` 8 (ids padded to the model's max_length 20), ``evaluate``, and
``predict`` with 20..24 new tokens (ids wider than 20) give the same ids, labels (exact) and
loss and ``compute_metrics`` (RTOL / ATOL) as stock; ``num_beams=2`` is refused with every
torch.distributed collective patched to fail; and sampled ids equal one process decoding the 5
rows keyed by their dataset index.
On 2 ranks also a loss of the user's on an encoder-decoder: T5 with ``label_smoothing_factor``
0.1 (training and ``evaluate``'s loss) and BART with a ``compute_loss_func`` (summed token cross
entropy / ``num_items_in_batch``), each against stock ``Seq2SeqTrainer`` with the same setting.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from tests.dist_utils import budget_s, run_ranks, test_timeout
from tests.zoo_fixtures import SEQ2SEQ, ZOO, build_zoo

RTOL, ATOL = 1e-5, 1e-6
LR, MAX_NORM, SEED, N_TRAIN, STEPS, SEQ = 0.1, 0.5, 7, 8, 2, 10
PLANS = {2: ([1, 3], [1, 2], [0.35, 0.65]), 3: ([2, 0, 2], [1, 1, 2], [0.0, 0.6, 0.4])}
GLOBAL_BATCH = 4


def _samples(name: str, n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rows of SEQ tokens with uneven padding (left padding for the classifier, right
    otherwise) and, for causal LMs, ignored labels at the start of some rows."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 97, (SEQ,), generator=g)
        length = SEQ - (i % 3) * 2
        mask = torch.zeros(SEQ, dtype=torch.long)
        if name.endswith("_cls"):
            mask[SEQ - length:] = 1
            row = {"labels": torch.tensor(i % 3)}
        else:
            mask[:length] = 1
            labels = ids.masked_fill(mask == 0, -100)
            labels[: int(torch.randint(0, 4, (), generator=g))] = -100
            row = {"labels": labels}
        row.update(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask)
        rows.append(row)
    return rows


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _seq2seq_rows(n: int, seed: int, name: str = "t5") -> list[dict[str, list]]:
    """Token rows of 3..9 inputs and 2..6 labels, as a tokenized seq2seq dataset holds them;
    Whisper's: log-mel features (8 mel bins x 24 frames, the length its feature extractor pads
    every clip to) and 2..6 labels."""
    g = torch.Generator().manual_seed(seed)
    if name == "whisper":
        return [{"input_features": torch.randn(8, 24, generator=g).tolist(),
                 "labels": torch.randint(3, 97, (int(torch.randint(2, 7, (), generator=g)),),
                                         generator=g).tolist()} for _ in range(n)]
    return [{"input_ids": torch.randint(3, 97, (int(torch.randint(3, 10, (), generator=g)),),
                                        generator=g).tolist(),
             "labels": torch.randint(3, 97, (int(torch.randint(2, 7, (), generator=g)),),
                                     generator=g).tolist()} for _ in range(n)]


def _data(name: str, model: torch.nn.Module) -> tuple:
    """(collator, train rows) of ``name``: ``DataCollatorForSeq2Seq`` (right padding, labels
    padded with -100, ``decoder_input_ids`` from ``model``) for the encoder-decoders."""
    if _base(name) not in SEQ2SEQ:
        return _collate, _samples(name, N_TRAIN)
    if name == "whisper":
        return _speech_collate, _seq2seq_rows(N_TRAIN, seed=5, name=name)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, 97)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>")
    return (transformers.DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
            _seq2seq_rows(N_TRAIN, seed=5))


def _speech_collate(rows):
    """A Whisper fine-tuning collator: the features stacked (all of one length), the labels
    padded with -100 to the batch's longest."""
    width = max(len(r["labels"]) for r in rows)
    return {"input_features": torch.tensor([r["input_features"] for r in rows]),
            "labels": torch.tensor([r["labels"] + [-100] * (width - len(r["labels"]))
                                    for r in rows])}


def _eval_and_predict(trainer, name: str) -> dict:
    """``evaluate``'s loss and ``predict``'s logits (the first prediction output) and labels."""
    rows = _seq2seq_rows(5, seed=9, name=name)
    out = trainer.predict(rows)
    logits = out.predictions[0] if isinstance(out.predictions, tuple) else out.predictions
    return dict(eval_loss=trainer.evaluate(rows)["eval_loss"], logits=logits,
                label_ids=out.label_ids)


GENERATE = ("t5", "bart")  # predict_with_generate=True after the teacher-forced evaluation
GEN_MAX_LENGTH, GEN_LONG = 8, 24  # decoder tokens (with the start token) / completion tokens


def _generation_metrics(prediction) -> dict:
    """compute_metrics of a generating evaluation: exact matches of the generated ids with
    the labels (-100 and padding included), and their sum and count beside -100."""
    predictions, labels = prediction.predictions, prediction.label_ids
    width = min(predictions.shape[1], labels.shape[1])
    return {"match": float((predictions[:, :width] == labels[:, :width]).mean()),
            "kept": float((predictions != -100).sum()),
            "total": float(predictions[predictions != -100].sum() / 1000)}


def _generate_and_score(trainer, name: str) -> dict:
    """``predict_with_generate=True`` (set on the arguments after training, as a script may):
    ``predict`` with ``generation_max_length`` (ids shorter than the model's max_length 20,
    padded to it), ``evaluate``'s loss and metrics, and ``predict`` with at least 20 new
    tokens (a keyword's logits processor; ids of the longest row's width, labels padded to
    20)."""
    trainer.args.predict_with_generate, trainer.args.generation_max_length = True, GEN_MAX_LENGTH
    trainer.args.generation_num_beams = 1
    trainer.compute_metrics = _generation_metrics
    rows = _seq2seq_rows(5, seed=9, name=name)
    out = trainer.predict(rows)
    long = trainer.predict(rows, max_new_tokens=GEN_LONG, min_new_tokens=20).predictions
    return dict(predictions=out.predictions, label_ids=out.label_ids, metrics=out.metrics,
                eval=trainer.evaluate(rows), long=long)


def _refused_beams_without_collectives(trainer, name: str) -> str:
    """evaluate(num_beams=2) with predict_with_generate=True: the ValueError, raised while
    every torch.distributed collective is patched to fail (so none ran)."""
    import torch.distributed as dist
    from unittest import mock

    names = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier",
             "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor",
             "broadcast_object_list")
    with pytest.raises(ValueError, match="beam search and the other strategies are not built"
                       ) as caught, mock.patch.multiple(dist, **{
                           n: mock.Mock(side_effect=AssertionError(f"collective {n} ran"))
                           for n in names}):
        trainer.evaluate(_seq2seq_rows(5, seed=9, name=name), num_beams=2)
    return str(caught.value)


def _sampled(trainer, name: str):
    """predict with keyed sampling: the rows' completions depend on the dataset index only."""
    return trainer.predict(_seq2seq_rows(5, seed=9, name=name), do_sample=True,
                           top_k=0).predictions


LORA = "qwen3_lora"  # 2 ranks only
UNREACHED = "glm5"  # SGD with weight decay: its indexer weights get no gradient
VLM = "gemma3_vlm"  # SGD with weight decay: text only, its vision tower gets no gradient
GEMMA4 = "gemma4"  # Gemma4ForConditionalGeneration on text, layers of two sizes
UNREACHED_ADAMW = "glm5_adamw"  # AdamW with weight decay, saved at the end (2 ranks only)
USER_OPTIMIZER = "glm5_user_optimizer"  # trainer.optimizer = SGD(shards, weight_decay=0.1)
PLANNED = "gemma4_planned"  # Gemma 4's layers of two sizes with no plan: profiled (its largest
# layer), planned per layer, trained (2 ranks only)
UNSHIFTED = "bart_causal"  # its own loss takes the labels as given; label smoothing on, which
# stock shifts for a class in the causal-LM mapping whatever the model's loss does (2 ranks only)
SMOOTHED = "t5_smoothed"  # T5 with label smoothing: stock's smoother on an encoder-decoder's
# logits, unshifted, and its eval loss (2 ranks only)
LOSS_FUNC = "bart_loss_func"  # BART with a compute_loss_func of the user's (2 ranks only)


def _base(name: str) -> str:
    """The zoo model a case trains (``SMOOTHED`` is T5, ``LOSS_FUNC`` BART)."""
    return {SMOOTHED: "t5", LOSS_FUNC: "bart"}.get(name, name)


def _user_loss_func(name: str):
    """``LOSS_FUNC``'s compute_loss_func: token cross entropy summed over the labels != -100
    and divided by ``num_items_in_batch`` (the sum-over-items form a user loss must have)."""
    if name != LOSS_FUNC:
        return None

    def loss(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"].float()
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
            ignore_index=-100, reduction="sum") / num_items_in_batch
    return loss


SIDE = ("gemma3n", "gemma4_e")  # per-layer inputs: side inputs the embedding makes
SIDE_LR = {"gemma4_e": 0.01}  # ill-conditioned tiny copy: tests/test_generic_engine_parity.py LR


def _names(world: int) -> list[str]:
    both = [*ZOO, UNREACHED, VLM, GEMMA4, *SIDE, *SEQ2SEQ]
    return [*both, LORA, UNREACHED_ADAMW, USER_OPTIMIZER, UNSHIFTED, SMOOTHED, LOSS_FUNC,
            PLANNED] if world == 2 \
        else both


def _user_sgd(params):
    """The optimizer a user builds: plain SGD, one group, weight decay on every parameter."""
    return torch.optim.SGD(params, lr=LR, weight_decay=0.1)


def _model(name: str) -> torch.nn.Module:
    if name in (UNREACHED_ADAMW, USER_OPTIMIZER):
        return build_zoo(UNREACHED, seed=3)
    if name == PLANNED:
        return build_zoo(GEMMA4, seed=3)
    if name != LORA:
        return build_zoo(_base(name), seed=3)
    from peft import LoraConfig, get_peft_model

    base = build_zoo("qwen3", seed=3)
    torch.manual_seed(4)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                        target_modules=["q_proj", "v_proj", "gate_proj"], task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def _args(name: str, out_dir: str) -> dict:
    optim = dict(optim="adamw_torch", weight_decay=0.1) if name == LORA else \
        dict(optim="sgd", weight_decay=0.1) if name in (UNREACHED, VLM, GEMMA4, PLANNED) else \
        dict(optim="adamw_torch", weight_decay=0.1, adam_epsilon=1e-2, save_strategy="steps",
             save_steps=STEPS, lr_scheduler_type="constant") if name == UNREACHED_ADAMW else \
        dict(optim="sgd", label_smoothing_factor=0.1) if name in (UNSHIFTED, SMOOTHED) else \
        dict(optim="sgd")
    return dict(output_dir=os.path.join(out_dir, name), report_to="none",
                learning_rate=SIDE_LR.get(name, LR), max_grad_norm=MAX_NORM, max_steps=STEPS,
                logging_steps=1,
                seed=SEED, train_sampling_strategy="sequential", disable_tqdm=True,
                use_cpu=True, **{"save_strategy": "no", **optim})


def _logs(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


def _worker(rank: int, world: int, out_dir: str) -> dict:
    from hf_cephalo import CephaloSeq2SeqTrainer, CephaloSeq2SeqTrainingArguments
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world),
                      HF_CEPHALO_PROFILE_CACHE=os.path.join(out_dir, "profile-cache"))
    sizes, micro, ratios = PLANS[world]
    results = {}
    for name in _names(world):
        planned = name == PLANNED  # no plan: the door profiles at start and plans
        model = _model(name)
        collator, rows = _data(name, model)
        door, door_args = (CephaloSeq2SeqTrainer, CephaloSeq2SeqTrainingArguments) \
            if _base(name) in SEQ2SEQ else (CephaloTrainer, CephaloTrainingArguments)
        trainer = door(
            model=model, args=door_args(
                **_args(name, out_dir),
                **({"per_device_train_batch_size": GLOBAL_BATCH // world} if planned else {})),
            plan=None if planned else Plan.from_ratios(sizes, micro, ratios),
            data_collator=collator, train_dataset=rows, compute_loss_func=_user_loss_func(name))

        if name == USER_OPTIMIZER:  # assigned after construction, over the shards
            trainer.optimizer = _user_sgd([p for _, p in trainer.session.named_shards()])
        trainer.train()
        losses, norms = _logs(trainer)
        if name in SEQ2SEQ:
            results[f"{name}_eval"] = _eval_and_predict(trainer, name)
            if name == "whisper":  # its encoder reads log-mel features, not token ids
                with pytest.raises(ValueError, match="reads 'input_features', not token ids"):
                    trainer.generate(input_features=torch.zeros(1, 8, 24), max_new_tokens=2)
            else:  # greedy: the decoder start token, then up to 3 tokens
                results[f"{name}_generate"] = trainer.generate(
                    input_ids=torch.tensor(PROMPT), max_new_tokens=3, do_sample=False).tolist()
            trainer.save_model(os.path.join(out_dir, name, "final"))  # Hugging Face files
            if name in GENERATE:
                results[f"{name}_generated"] = _generate_and_score(trainer, name)
                results[f"{name}_beams"] = _refused_beams_without_collectives(trainer, name)
                results[f"{name}_sampled"] = _sampled(trainer, name)
        if name == SMOOTHED:
            results[f"{name}_eval_loss"] = trainer.evaluate(_seq2seq_rows(5, seed=9))["eval_loss"]
        if planned:  # the model profile the plan was made from: each layer's size
            results["planned_units"] = trainer.session.cluster_profile.model.unit_params
        if name == UNREACHED_ADAMW:
            results["optim_steps"] = _indexer_steps(trainer.optimizer, trainer.session)
        model = trainer.unshard_model()
        results[name] = dict(losses=losses, norms=norms, state={
            k: v.detach().clone().numpy() for k, v in model.state_dict().items()})
    return results


def _indexer_steps(optimizer, session) -> dict[str, float]:
    """AdamW's step count per non-empty parameter shard (an empty one steps nothing): the
    indexer's are 0 (never stepped), the rest the steps taken."""
    return {name: float(optimizer.state[p]["step"]) for name, p in session.named_shards()
            if p in optimizer.state and p.numel()}


_STOCK: dict = {}


def _stock(name: str, out_dir: str) -> dict:
    if name not in _STOCK:
        model = _model(name)
        stock_args = transformers.Seq2SeqTrainingArguments if _base(name) in SEQ2SEQ \
            else transformers.TrainingArguments
        args = stock_args(per_device_train_batch_size=GLOBAL_BATCH, per_device_eval_batch_size=8,
                          **_args(name, out_dir))
        optimizers = (_user_sgd(model.parameters()), None) if name == USER_OPTIMIZER \
            else (None, None)
        collator, rows = _data(name, model)
        stock = transformers.Seq2SeqTrainer if _base(name) in SEQ2SEQ else transformers.Trainer
        trainer = stock(model=model, args=args, data_collator=collator, train_dataset=rows,
                        optimizers=optimizers, compute_loss_func=_user_loss_func(name))
        trainer.train()
        losses, norms = _logs(trainer)
        _STOCK[name] = dict(losses=losses, norms=norms, state={
            k: v.detach().clone() for k, v in model.state_dict().items()})
        _STOCK[f"{name}_model"] = model
        if name in SEQ2SEQ:
            _STOCK[f"{name}_eval"] = _eval_and_predict(trainer, name)
            if name != "whisper":
                _STOCK[f"{name}_generate"] = model.generate(
                    input_ids=torch.tensor(PROMPT), attention_mask=torch.ones(2, 3).long(),
                    max_new_tokens=3, do_sample=False).tolist()
        if name in GENERATE:
            _STOCK[f"{name}_generated"] = _generate_and_score(trainer, name)
        if name == SMOOTHED:
            _STOCK[f"{name}_eval_loss"] = trainer.evaluate(_seq2seq_rows(5, seed=9))["eval_loss"]
    return _STOCK[name]


PROMPT = [[5, 6, 7], [9, 10, 11]]


def _check_eval(got: dict, ref: dict, where: str) -> None:
    """Evaluation loss, labels and the logits of every labelled position equal stock's. (Each
    rank's evaluation rows are padded to its own widest; the gathered predictions are padded
    with -100 beyond a row's width, where stock's one batch holds logits of padding tokens.)"""
    for what in ("eval_loss", "label_ids"):
        torch.testing.assert_close(torch.as_tensor(got[what]), torch.as_tensor(ref[what]),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} {what}: {m}")
    labelled = torch.as_tensor(ref["label_ids"]) != -100
    assert got["logits"].shape == ref["logits"].shape, where
    torch.testing.assert_close(torch.as_tensor(got["logits"])[labelled],
                               torch.as_tensor(ref["logits"])[labelled], rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{where} logits: {m}")


def _check_generated(run: dict, name: str, where: str) -> None:
    """predict_with_generate=True: generated ids and labels exact (shapes included), loss and
    metrics within RTOL / ATOL of stock's; beams refused before any collective; sampled ids
    equal ONE process decoding the 5 rows keyed by their dataset index."""
    got, ref = run[f"{name}_generated"], _STOCK[f"{name}_generated"]
    for what in ("predictions", "label_ids", "long"):
        assert got[what].shape == ref[what].shape and (got[what] == ref[what]).all(), \
            (where, what, got[what], ref[what])
    assert ref["predictions"].shape[1] == 20 and ref["long"].shape[1] > 20, where
    for metrics in ("metrics", "eval"):
        keys = {k for k in ref[metrics]
                if k.partition("_")[2] in ("loss", "match", "kept", "total")}
        assert len(keys) == 4, (where, ref[metrics])
        for key in keys:
            torch.testing.assert_close(torch.tensor(got[metrics][key], dtype=torch.float64),
                                       torch.tensor(ref[metrics][key], dtype=torch.float64),
                                       rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} {key}: {m}")
    assert "num_beams=2" in run[f"{name}_beams"], where
    assert (run[f"{name}_sampled"] == _sampled_reference(name)).all(), where


_SAMPLED: dict = {}


def _sampled_reference(name: str):
    """The sampled predictions of one process: ``generate_rows`` on stock's trained model,
    rows keyed by dataset index, round = the steps trained, laid out as stock's one batch."""
    if name not in _SAMPLED:
        from hf_cephalo.runtime import generate_rows, resolve_generation

        model = _STOCK[f"{name}_model"]
        params, config = resolve_generation(model, dict(max_length=GEN_MAX_LENGTH, num_beams=1,
                                                         do_sample=True, top_k=0), SEED)
        rows = _seq2seq_rows(5, seed=9, name=name)
        out = generate_rows(model, [r["input_ids"] for r in rows], list(range(5)), params,
                            STEPS, generation_config=config)
        ids = torch.full((5, 20), params.pad_token_id)
        for j, tokens in enumerate(out.completions):
            ids[j, :1 + len(tokens)] = torch.tensor([*out.decoder_start, *tokens])
        _SAMPLED[name] = ids.numpy()
    return _SAMPLED[name]


def _check_world(world: int, out_dir: str) -> None:
    runs = run_ranks(_worker, world, out_dir, timeout_s=budget_s(25 * world))
    if world == 2:
        for run in runs:
            steps = run["optim_steps"]
            assert steps and all(v == (0 if ".indexer." in n else STEPS)
                                 for n, v in steps.items()), steps
        saved = os.path.join(out_dir, UNREACHED_ADAMW, f"checkpoint-{STEPS}")
        assert os.path.isdir(saved) and os.listdir(saved), saved
        sizes = [sum(p.numel() for p in layer.parameters())
                 for layer in _model(PLANNED).model.language_model.layers]
        assert len(set(sizes)) == 2 and all(run["planned_units"] == sizes for run in runs)
    for name in _names(world):
        ref = _stock(name, out_dir)
        for rank, run in enumerate(runs):
            got = run[name]
            where = f"{name} world {world} rank {rank}"
            assert len(got["losses"]) == len(ref["losses"]) == STEPS, where
            for what in ("losses", "norms"):
                torch.testing.assert_close(
                    torch.tensor(got[what], dtype=torch.float64),
                    torch.tensor(ref[what], dtype=torch.float64), rtol=RTOL, atol=ATOL,
                    msg=lambda m: f"{where} {what}: {m}")
            assert set(got["state"]) == set(ref["state"]), where
            for key, value in ref["state"].items():
                torch.testing.assert_close(torch.as_tensor(got["state"][key]), value,
                                           rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{where} {key}: {m}")
            if name in SEQ2SEQ:
                _check_eval(run[f"{name}_eval"], _STOCK[f"{name}_eval"], where)
                if name != "whisper":  # trainer.generate: stock's greedy ids, start token first
                    assert run[f"{name}_generate"] == _STOCK[f"{name}_generate"], \
                        (where, run[f"{name}_generate"], _STOCK[f"{name}_generate"])
            if name in GENERATE:
                _check_generated(run, name, where)
            if name == SMOOTHED:
                torch.testing.assert_close(run[f"{name}_eval_loss"], _STOCK[f"{name}_eval_loss"],
                                           rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: {m}")
        if name in SEQ2SEQ:  # the saved model loads back as the class, stock's weights
            saved = type(_model(name)).from_pretrained(os.path.join(out_dir, name, "final"))
            for key, value in ref["state"].items():
                torch.testing.assert_close(saved.state_dict()[key], value, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{name} world {world} saved {key}: {m}")


def _resume_worker(rank: int, world: int, out_dir: str) -> dict:
    """The 2-rank AdamW checkpoint of ``glm5_adamw`` resumed on 3 ranks for one more step."""
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    args = {**_args(UNREACHED_ADAMW, out_dir), "max_steps": STEPS + 1, "save_strategy": "no"}
    trainer = CephaloTrainer(
        model=_model(UNREACHED_ADAMW), args=CephaloTrainingArguments(**args),
        plan=Plan.from_ratios(*PLANS[3]), data_collator=_collate,
        train_dataset=_samples(UNREACHED_ADAMW, N_TRAIN))
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, UNREACHED_ADAMW,
                                                      f"checkpoint-{STEPS}"))
    steps = _indexer_steps(trainer.optimizer, trainer.session)
    model = trainer.unshard_model()
    return dict(steps=steps, state={k: v.detach().clone().numpy()
                                    for k, v in model.state_dict().items()})


def _check_resume(out_dir: str) -> None:
    """Saved on 2 ranks, resumed on 3: the indexer weights' optimizer state comes back at step
    0 (the others at STEPS + 1 after one more step), and the weights equal stock's after
    STEPS + 1 steps."""
    runs = run_ranks(_resume_worker, 3, out_dir, timeout_s=budget_s(25))
    model = _model(UNREACHED_ADAMW)
    args = {**_args(UNREACHED_ADAMW, os.path.join(out_dir, "stock")), "max_steps": STEPS + 1,
            "save_strategy": "no"}
    stock_args = transformers.TrainingArguments(per_device_train_batch_size=GLOBAL_BATCH, **args)
    transformers.Trainer(model=model, args=stock_args, data_collator=_collate,
                         train_dataset=_samples(UNREACHED_ADAMW, N_TRAIN)).train()
    for rank, run in enumerate(runs):
        assert rank == 0 or run["steps"], rank  # rank 0 holds no state (r = 0)
        assert all(v == (0 if ".indexer." in n else STEPS + 1)
                   for n, v in run["steps"].items()), (rank, run["steps"])
        for key, value in model.state_dict().items():
            torch.testing.assert_close(torch.as_tensor(run["state"][key]), value, rtol=RTOL,
                                       atol=ATOL, msg=lambda m: f"resumed rank {rank} {key}: {m}")


@test_timeout(50, 25, margin_s=120)
def test_zoo_trainer_matches_stock_two_ranks(tmp_path):
    _check_world(2, str(tmp_path))
    _check_resume(str(tmp_path))


@test_timeout(75, margin_s=120)
def test_zoo_trainer_matches_stock_three_ranks(tmp_path):
    _check_world(3, str(tmp_path))
