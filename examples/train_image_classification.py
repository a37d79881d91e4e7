"""Image classification with CephaloTrainer: a small ViT on scikit-learn's digits (no download).

    accelerate launch --config_file accelerate_configs/cephalo_cpu.yaml \\
        examples/train_image_classification.py --output_dir outputs/vit

The 1797 8x8 digit images (bundled with scikit-learn) are upscaled to ``--image_size`` pixels,
split stratified into train and a held-out test split (``--test_fraction``), and a ViT built from
its config is trained on the train split; the accuracy on the held-out split (gathered through
the engine, every test image exactly once) is printed at the end. ``--model_name_or_path`` fine-
tunes a ViT checkpoint instead (its image size and channels are used; its classifier is replaced
by a 10-class one). Every ``TrainingArguments`` and ``--cephalo_*`` flag works; this script's
defaults (``TRAINING_DEFAULTS``: learning rate 1e-3, 10 epochs, 10% warmup) reach about 0.93
held-out accuracy.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import numpy as np
from transformers.utils import logging as hf_logging
from transformers import (HfArgumentParser, ViTConfig, ViTForImageClassification,
                          default_data_collator, set_seed)

from hf_cephalo import CephaloTrainer, CephaloTrainingArguments
from hf_cephalo.demo_data import digits_image_datasets
from hf_cephalo.integrations import (format_loss_trend, progress_bars_from_rank_zero,
                                     quiet_load_report)

_NUM_CLASSES = 10
# Defaults for this example (any flag overrides them): a ViT built from its config needs a larger
# learning rate than Trainer's 5e-5 fine-tuning default to learn the digits in a few epochs.
# Measured on 2 CPU processes with this script's defaults (global batch 16, ~70 s of training):
# held-out accuracy 0.93 on the 360 held-out digits (3 epochs at 2e-3 reach only ~0.50).
# Progress bars only on a terminal: written to a log file (a batch job, `> log`) every refresh
# of Trainer's bar lands in it (the default run's log: 42 KB, 530 refreshes, re-plan lines in
# the middle of bar lines; 8 KB without); there the logged losses (Trainer prints them when its
# bar is off) say the same. --disable_tqdm false/true overrides it.
TRAINING_DEFAULTS = {"learning_rate": 1e-3, "num_train_epochs": 10.0, "warmup_steps": 0.1,
                     "logging_steps": 20, "disable_tqdm": not sys.stderr.isatty()}


@dataclass(kw_only=True)
class ModelArguments:
    """Which ViT to train. Sizes apply to a model built from scratch (no --model_name_or_path)."""

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Hub id or local directory of a ViT checkpoint to fine-tune (from_pretrained)."})
    image_size: int = field(default=32, metadata={"help": "Image side in pixels (>= 8) of a new model."})
    patch_size: int = field(default=8, metadata={"help": "Patch side in pixels; divides image_size."})
    hidden_size: int = field(default=64, metadata={"help": "Hidden size (features) of a new model."})
    num_layers: int = field(default=4, metadata={"help": "Number of transformer layers of a new model."})
    num_heads: int = field(default=4, metadata={"help": "Attention heads of a new model."})

    def __post_init__(self) -> None:
        if self.image_size < 8 or self.patch_size < 1 or self.image_size % self.patch_size:
            raise ValueError(f"--image_size {self.image_size} (>= 8 pixels) must be a multiple of "
                             f"--patch_size {self.patch_size} (>= 1)")
        if min(self.hidden_size, self.num_layers, self.num_heads) < 1 or self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden_size {self.hidden_size} must be a positive multiple of "
                             f"--num_heads {self.num_heads}; --num_layers {self.num_layers} >= 1")


@dataclass(kw_only=True)
class DataArguments:
    """The held-out split."""

    test_fraction: float = field(default=0.2, metadata={
        "help": "Fraction in (0, 1) of the 1797 images held out for the accuracy."})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "Keep at most this many training images (samples)."})

    def __post_init__(self) -> None:
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"--test_fraction {self.test_fraction} must be in (0, 1)")
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise ValueError(f"--max_train_samples {self.max_train_samples} must be >= 1")


def build_model(model_args: ModelArguments, process_index: int) -> ViTForImageClassification:
    labels = {"id2label": {i: str(i) for i in range(_NUM_CLASSES)},
              "label2id": {str(i): i for i in range(_NUM_CLASSES)}}
    if model_args.model_name_or_path is not None:
        # every rank loads the same checkpoint: its load report (the new 10-class head) once
        with quiet_load_report(process_index != 0):
            return ViTForImageClassification.from_pretrained(
                model_args.model_name_or_path, num_labels=_NUM_CLASSES,
                ignore_mismatched_sizes=True, **labels)
    h = model_args.hidden_size
    config = ViTConfig(image_size=model_args.image_size, patch_size=model_args.patch_size,
                       num_channels=3, hidden_size=h, intermediate_size=4 * h,
                       num_hidden_layers=model_args.num_layers,
                       num_attention_heads=model_args.num_heads, num_labels=_NUM_CLASSES, **labels)
    return ViTForImageClassification(config)


def accuracy(prediction) -> dict[str, float]:
    """Top-1 accuracy; ``prediction.predictions`` (N, 10) logits, ``label_ids`` (N,)."""
    predicted = np.argmax(prediction.predictions, axis=-1)
    return {"accuracy": float((predicted == prediction.label_ids).mean()),
            "num_samples": int(len(prediction.label_ids))}


def main(argv: list[str] | None = None) -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, CephaloTrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)  # a from-scratch ViT needs more than Trainer's 5e-5
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    # datasets' map/filter and the model-loading bars: rank 0's only, none with --disable_tqdm
    progress_bars_from_rank_zero(training_args.process_index, training_args.disable_tqdm)
    logging.basicConfig(level=logging.INFO if training_args.process_index == 0 else logging.WARNING)
    # transformers' loggers print through their own handler and, where the environment sets CI=1,
    # also propagate to the root handler configured above: every transformers warning twice
    hf_logging.disable_propagation()

    set_seed(training_args.seed)  # the same initial weights on every rank
    model = build_model(model_args, training_args.process_index)
    splits = digits_image_datasets(image_size=model.config.image_size,
                                   num_channels=model.config.num_channels,
                                   test_fraction=data_args.test_fraction, seed=training_args.seed)
    train, test = splits["train"], splits["test"]
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    if training_args.process_index == 0:
        print(f"digits: {len(train)} train, {len(test)} held-out images of "
              f"{model.config.image_size}x{model.config.image_size}; model "
              f"{sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    trainer = CephaloTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=test,
                             data_collator=default_data_collator, compute_metrics=accuracy)
    # a path, "true" for the last checkpoint-N in output_dir; a bad path raises CheckpointError
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        if losses:
            print(f"train loss: {format_loss_trend(losses)}", flush=True)
        print(f"held-out accuracy: {metrics['eval_accuracy']:.4f} on "
              f"{metrics['eval_num_samples']} images (eval loss {metrics['eval_loss']:.4f}; "
              f"chance 0.10)", flush=True)
    trainer.save_model()  # collective: every rank; rank 0 writes output_dir
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:] or None)
