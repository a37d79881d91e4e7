"""Worker for tests/test_trainer_launch.py: the same training runs through stock ``Trainer``
under DDP or through ``CephaloTrainer``, both launched by torchrun on 2 CPU processes (gloo).

Usage: fields_as_stock.py {stock|cephalo} OUT_DIR

Each run is a few steps of a tiny Llama on fixed-length rows whose tails are padding (attention
mask 0, labels -100), with stock fields whose behaviour depends on the number of processes
(data order and seeds, dataloader workers, token and FLOP counts, logging, evaluation
gathering, saving, JIT checkpoint agreement). Rank 0 writes OUT_DIR/<kind>.json: per run the log
history, the train metrics, the checkpoints left, the last trainer_state.json, the evaluation
inputs compute_metrics saw, and the final weights (as lists).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.models_fixtures import build  # noqa: E402

SEQ, N_TRAIN, N_EVAL = 12, 16, 5
SIZES, MICRO, RATIOS = [1, 3], [1, 2], [0.35, 0.65]  # the Cephalo plan; stock: 2 per process


def samples(n: int, seed: int) -> list[dict]:
    """Rows of SEQ tokens whose last 0-5 positions are padding (mask 0, token 0, label -100);
    every row scores 6 tokens (labels -100 on the first real tokens), so each row's mean loss
    weighs the same in stock's per-batch eval mean and in the global token mean."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        pad = int(torch.randint(0, 6, (), generator=g))
        real = SEQ - pad
        ids = torch.randint(1, 97, (SEQ,), generator=g)
        ids[real:] = 0
        mask = torch.ones(SEQ, dtype=torch.long)
        mask[real:] = 0
        labels = ids.clone()
        labels[real:] = -100
        labels[: real - 6] = -100
        rows.append({"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                     "labels": labels.tolist(), "length": real, "sample_id": len(rows)})
    return rows


def collate(rows):
    """The model inputs, plus sample_id where column pruning kept it (it is in label_names)."""
    keys = [k for k in ("input_ids", "attention_mask", "labels", "sample_id") if k in rows[0]]
    return {k: torch.tensor([r[k] for r in rows]) for k in keys}


def argmax_logits(logits, labels):
    return logits.argmax(-1)


def metrics(pred):
    """What compute_metrics saw: counts and sums of predictions, labels, inputs and losses."""
    labels = pred.label_ids
    out = {}
    if isinstance(labels, tuple):  # label_names = ["labels", "sample_id"]
        labels, ids = labels
        out["sample_order"] = int(sum(p * int(i) for p, i in enumerate(ids)))  # 0*i0 + 1*i1 ...
    mask = labels != -100
    out.update(n=int(labels.shape[0]), label_sum=int(labels[mask].sum()),
               pred_sum=int(pred.predictions[mask].sum()))
    if pred.inputs is not None:
        out.update(inputs_n=int(pred.inputs.shape[0]),
                   input_sum=int(pred.inputs[pred.inputs != -100].sum()))
    if pred.losses is not None:
        out.update(losses_n=int(np.asarray(pred.losses).shape[0]),
                   losses_mean=float(np.asarray(pred.losses).mean()))
    return out


def squares_loss(outputs, labels, num_items_in_batch=None):
    """A user loss in the HF convention: a sum over scored tokens / num_items_in_batch."""
    logits, targets = outputs.logits[..., :-1, :], labels[..., 1:]
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0),
                                                  reduction="none") + 0.01 * logits.pow(2).mean(-1)
    return (per_token * (targets != -100)).sum() / num_items_in_batch


def dataset(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


RUNS = {
    # random order over 2 epochs (seed), linear decay over the epoch-derived step count, token
    # count without padding, evaluation every 3 steps gathered with inputs and losses, saving
    # with rotation and best-checkpoint tracking
    "epochs": dict(num_train_epochs=2, include_num_input_tokens_seen="non_padding",
                   eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=1,
                   include_for_metrics=["inputs", "loss"], label_names=["labels"],
                   save_strategy="steps", save_steps=3, save_total_limit=2,
                   metric_for_best_model="eval_loss", logging_first_step=True),
    # sequential order, a dataloader worker, all tokens counted, non-reentrant checkpointing,
    # label smoothing, weight decay, drop_last (evaluation: 4 of 5 samples), max_steps, JIT
    # checkpointing armed (no signal), two label names (a tuple of label arrays).
    # (Not group_by_length: stock's LengthGroupedSampler draws its permutation from the global
    # torch RNG, see docs/trainer_support.md.)
    "steps": dict(max_steps=4, train_sampling_strategy="sequential",
                  include_num_input_tokens_seen=True, dataloader_num_workers=1,
                  gradient_checkpointing=True,
                  gradient_checkpointing_kwargs={"use_reentrant": False},
                  label_smoothing_factor=0.1, dataloader_drop_last=True, weight_decay=0.1,
                  enable_jit_checkpoint=True, save_strategy="no",
                  label_names=["labels", "sample_id"], per_device_eval_batch_size=2),
    # a user loss (stock DDP scales it by the number of processes, the engine sums), evaluation
    # without logits (on 4 of 5 samples: with 5, stock DDP's eval_loss would count a padded
    # duplicate sample, see per_device_eval_batch_size in docs/trainer_support.md)
    "loss_func": dict(max_steps=2, prediction_loss_only=True, save_strategy="no",
                      dataloader_drop_last=True, per_device_eval_batch_size=2),
}


def common_args(out_dir: str, name: str) -> dict:
    return dict(output_dir=os.path.join(out_dir, name), report_to="none", optim="sgd",
                learning_rate=0.1, max_grad_norm=0.5, logging_steps=1, seed=7, disable_tqdm=True,
                use_cpu=True)


def run(kind: str, out_dir: str, name: str) -> dict:
    import transformers

    train, evaluation = dataset(samples(N_TRAIN, 0)), dataset(samples(N_EVAL, 1))
    kwargs = dict(model=build("llama"), data_collator=collate, train_dataset=train,
                  eval_dataset=evaluation, compute_metrics=metrics,
                  preprocess_logits_for_metrics=argmax_logits,
                  compute_loss_func=squares_loss if name == "loss_func" else None)
    settings = {**common_args(out_dir, kind + "_" + name), **RUNS[name]}
    if kind == "stock":
        args = transformers.TrainingArguments(per_device_train_batch_size=sum(SIZES) // 2,
                                              **settings)
        trainer = transformers.Trainer(args=args, **kwargs)
    else:
        from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
        from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
        from hf_cephalo.planner import Plan

        trainer = CephaloTrainer(args=CephaloTrainingArguments(**settings),
                                 plan=Plan.from_ratios(SIZES, MICRO, RATIOS), **kwargs)
    output = trainer.train()
    evaluation = trainer.evaluate() if name != "epochs" else None
    model = trainer.unshard_model() if kind == "cephalo" else trainer.model
    run_dir = settings["output_dir"]
    checkpoints = sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint-"))
    state = None
    if checkpoints:
        with open(os.path.join(run_dir, checkpoints[-1], "trainer_state.json")) as f:
            state = json.load(f)
    return dict(log_history=trainer.state.log_history, metrics=output.metrics,
                evaluate=None if evaluation is None else
                {k: v for k, v in evaluation.items()
                 if "runtime" not in k and "per_second" not in k},
                num_input_tokens_seen=trainer.state.num_input_tokens_seen,
                total_flos=trainer.state.total_flos, checkpoints=checkpoints, state=state,
                best_model_checkpoint=(None if trainer.state.best_model_checkpoint is None else
                                       os.path.basename(trainer.state.best_model_checkpoint)),
                weights={k: v.detach().double().flatten().tolist()
                         for k, v in model.state_dict().items()})


def main(kind: str, out_dir: str) -> None:
    results = {name: run(kind, out_dir, name) for name in RUNS}
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(out_dir, f"{kind}.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
