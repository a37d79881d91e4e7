"""A TRL door's evaluation of the whole eval set as ONE batch (the DPO and KTO doors).

[Note: evaluation of the whole set in one exchange]
Stock DPOTrainer / KTOTrainer evaluate through Trainer's loop: per eval batch, ``compute_loss``
appends that batch's metrics and the eval loss is the mean of the batches' losses; with the whole
eval set in ONE batch (``per_device_eval_batch_size`` = N, one process) they are the whole set's.
Here the eval loader splits the set by the plan's b_i (unshuffled, every sample once) and the
door prepares every step first (its reference pass; KTO's KL sums), then the engine evaluates
every step inside ONE two-phase head call spanning all of them (``head_calls.py``): the loss's
gathers of every microbatch of every rank are combined once and ``compute_loss`` replayed once,
so the metrics are the whole set's (not a mean of per-step values), and ``eval_loss`` is the
mean over its N items (each step's item mean times its items, summed, over N).
"""

from __future__ import annotations

from typing import Any

from transformers.trainer_utils import EvalLoopOutput

__all__ = ["evaluate_whole_set"]


def evaluate_whole_set(trainer: Any, steps: list[list[Any]], num_samples: int,
                       metric_key_prefix: str) -> EvalLoopOutput:
    """The engine's evaluation of ``steps`` (this rank's prepared microbatches of every eval
    step, in loader order) in ONE exchange of the trainer's head calls (module note).

    Returns ``EvalLoopOutput`` without predictions or labels; metrics ``{prefix}_loss`` (the
    mean over the eval set's items; absent when it has none). The trainer's own eval metrics
    (``_metrics["eval"]``) get ONE entry per loop from the replay. Collective: every rank, with
    the same number of steps (an idle rank's steps are empty)."""
    head_calls = trainer._head_calls
    loss_sum, num_items = 0.0, 0
    first = next((microbatches for microbatches in steps if microbatches), [])
    with head_calls.step(first):
        for microbatches in steps:
            out = trainer.session.evaluate(microbatches, return_logits=False)
            if out.num_items:
                loss_sum += out.loss * out.num_items
                num_items += out.num_items
    head_calls.finish(num_items)
    metrics = {f"{metric_key_prefix}_loss": loss_sum / num_items} if num_items else {}
    return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics,
                          num_samples=num_samples)


def no_predict(door: str, stock: str) -> str:
    """The refusal of ``predict()`` / ``compute_metrics`` / ``preprocess_logits_for_metrics``."""
    return (f"{door} does not predict (predict(), compute_metrics, "
            f"preprocess_logits_for_metrics): stock {stock} recomputes each eval batch's full "
            "vocabulary logits for them, padded to that batch's width, which the engine's "
            "evaluation (the loss and the trainer's metrics of the whole set through TRL's fused "
            "head) does not reproduce; use evaluate() for the loss and metrics, and run the saved "
            "model for logits")
