"""Evaluation through the engine for the Trainer doors (``CephaloTrainer`` and the TRL trainers).

``EngineEvaluationMixin.evaluation_loop`` replaces stock's loop body: the layered forward over
this rank's microbatches of an unshuffled rank-weighted split, the loss as the global item mean
over the whole eval set, and predictions (after ``preprocess_logits_for_metrics``) and labels of
every sample gathered exactly once, in dataset order, before ``compute_metrics``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

__all__ = ["EngineEvaluationMixin"]


def _stack_padded(rows: list[torch.Tensor], pad_value: float) -> np.ndarray:
    """Stack per-sample tensors of possibly different shapes, padding to the largest.

    bfloat16 (logits under ``--bf16`` autocast) becomes float32: numpy has no bfloat16 (stock
    Trainer's ``nested_numpify`` does the same)."""
    shape = [max(sizes) for sizes in zip(*(r.shape for r in rows))]
    dtype = torch.float32 if rows[0].dtype == torch.bfloat16 else rows[0].dtype
    out = torch.full((len(rows), *shape), pad_value, dtype=dtype)
    for i, r in enumerate(rows):
        out[(i, *(slice(0, s) for s in r.shape))] = r
    return out.numpy()


class _PredictionRow(NamedTuple):
    """One evaluated sample on its way to the gather: its dataset index, its prediction row,
    its label rows (one per ``label_names`` key), and with ``include_for_metrics`` its main
    input row and its evaluation microbatch's mean loss."""

    index: int
    prediction: torch.Tensor
    labels: tuple[torch.Tensor | None, ...]
    inputs: torch.Tensor | None
    loss: float | None


class _GatheredPredictions(NamedTuple):
    """What ``evaluation_loop`` hands ``compute_metrics``, every sample once in dataset order."""

    predictions: np.ndarray | None
    label_ids: np.ndarray | tuple[np.ndarray, ...] | None
    inputs: np.ndarray | None
    losses: np.ndarray | None


class EngineEvaluationMixin:
    """``evaluation_loop`` through ``self.session`` (see the module note). Mixed into a
    ``Trainer`` subclass whose ``engine`` is the session's and whose eval loaders come from
    ``Session.eval_loader``."""

    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Layered forward through the engine; loss = global item mean over the whole eval set.

        Predictions (after ``preprocess_logits_for_metrics``) and labels of every sample are
        gathered exactly once, in dataset order, padded with -100 where lengths differ. The
        head runs once per microbatch; predictions move to the CPU microbatch by microbatch,
        and with ``prediction_loss_only`` no logits are kept at all.

        As stock ``prediction_step``: the labels are the ``label_names`` keys (a tuple of arrays
        for several), and the loss is reported only when every microbatch holds all of them.
        ``include_for_metrics``: "inputs" adds each sample's main input (padded with -100),
        "loss" each sample's evaluation-microbatch mean loss, to the ``EvalPrediction``.
        """
        if prediction_loss_only is None:
            prediction_loss_only = self.args.prediction_loss_only
        if not prediction_loss_only:
            self._check_prediction_outputs()
        self.model.eval()
        loss_sum, num_items, local, has_labels = 0.0, 0, [], bool(self.label_names)
        for indices, microbatches in zip(dataloader.batch_sampler.local_batches(), dataloader):
            microbatches = self._prepare_input(microbatches)
            out = self._engine_evaluate(
                microbatches, return_logits=not prediction_loss_only and self._returns_logits(),
                process_logits=self._microbatch_predictions)
            if out.num_items:
                loss_sum += out.loss * out.num_items
                num_items += out.num_items
            has_labels = has_labels and all(mb.get(k) is not None for mb in microbatches
                                            for k in self.label_names)
            if not prediction_loss_only:
                local += self._step_predictions(indices, microbatches, out)
        metrics: dict[str, Any] = {}
        if num_items and has_labels:
            metrics["loss"] = loss_sum / num_items
        predictions = label_ids = None
        num_samples = dataloader.batch_sampler.dataset_length
        if not prediction_loss_only:
            gathered = self._finish_predictions(
                self._gather_predictions(local, num_samples, has_labels))
            predictions, label_ids = gathered.predictions, gathered.label_ids
            if self.compute_metrics is not None and label_ids is not None:
                extra = {"inputs": gathered.inputs, "losses": gathered.losses}
                metrics.update(self.compute_metrics(EvalPrediction(predictions=predictions,
                                                                   label_ids=label_ids, **extra)))
        metrics = denumpify_detensorize(metrics)
        metrics = {k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}": v
                   for k, v in metrics.items()}
        return EvalLoopOutput(predictions=predictions, label_ids=label_ids, metrics=metrics,
                              num_samples=num_samples)

    def _engine_evaluate(self, microbatches, **kwargs):
        """``engine.evaluate`` of one evaluation step; a user loss in the head runs in the two
        phases of [Note: collectives inside the engine's head] (``head_calls.py``), so its eval
        metrics are those of the whole step's batch."""
        head_calls = getattr(self, "_head_calls", None)
        if head_calls is None:
            return self.session.evaluate(microbatches, **kwargs)
        with head_calls.step(microbatches):
            out = self.session.evaluate(microbatches, **kwargs)
        head_calls.finish(out.num_items)
        return out

    # ---- what a door that predicts otherwise (generated tokens: seq2seq.py) replaces -----
    def _returns_logits(self) -> bool:
        """Whether the evaluation's forward returns logits (the predictions)."""
        return True

    def _step_predictions(self, indices: list[int], microbatches, out) -> list:
        """This rank's ``_PredictionRow``s of one evaluation step (``out``: its
        ``engine.evaluate``); collective in a door whose predictions need one."""
        return self._local_predictions(indices, microbatches, out)

    def _prediction_pad_value(self) -> int:
        """What pads the gathered predictions to the widest (stock's eval loop: -100)."""
        return -100

    def _finish_predictions(self, gathered: "_GatheredPredictions") -> "_GatheredPredictions":
        """The gathered predictions and labels as ``compute_metrics`` gets them."""
        return gathered

    def _prediction_outputs(self) -> tuple[str, ...]:
        """The model outputs the staged head stacks on the last dimension of its logits (a
        question-answering model's ``start_logits`` and ``end_logits``), which stock's
        evaluation returns as a tuple of predictions; () for one output."""
        return tuple(getattr(self.session.staged, "prediction_outputs", None) or ())

    def _check_prediction_outputs(self) -> None:
        """ValueError, on every rank before the evaluation's first collective, for
        ``preprocess_logits_for_metrics`` on a model with several outputs: stock hands it the
        tuple of outputs, which the engine's per-row predictions do not reproduce."""
        outputs = self._prediction_outputs()
        if outputs and self.preprocess_logits_for_metrics is not None:
            raise ValueError(
                f"preprocess_logits_for_metrics is not supported for "
                f"{type(self.session.staged.model).__name__}: stock hands it the tuple "
                f"({', '.join(outputs)}), and hf_cephalo's evaluation keeps one tensor per row; "
                "drop it and compute from the predictions tuple in compute_metrics instead.")

    def _microbatch_predictions(self, logits: torch.Tensor, microbatch) -> torch.Tensor:
        """One microbatch's predictions on the CPU: ``preprocess_logits_for_metrics`` (on the
        device, as stock Trainer applies it) of its logits. The engine calls this right after
        the microbatch's head, so no device logits outlive their microbatch."""
        if self.preprocess_logits_for_metrics is not None:
            logits = self.preprocess_logits_for_metrics(logits, microbatch.get("labels"))
        return logits.detach().cpu()

    def _local_predictions(self, indices: list[int], microbatches, out,
                           predictions=None) -> list[_PredictionRow]:
        """One ``_PredictionRow`` per sample of this rank (CPU tensors): labels = one row per
        ``label_names`` key; the main input and the microbatch's loss only when
        ``include_for_metrics`` asks for them. ``predictions``: per microbatch, its rows'
        predictions (default: ``out.logits``)."""
        wanted = self.args.include_for_metrics
        name = getattr(self.model, "main_input_name", "input_ids")
        rows = []
        position = 0
        predictions = out.logits if predictions is None else predictions
        for k, (mb, mb_predictions) in enumerate(zip(microbatches, predictions)):
            for j in range(len(mb_predictions)):
                labels = tuple(None if mb.get(key) is None else mb[key][j].detach().cpu()
                               for key in self.label_names)
                rows.append(_PredictionRow(
                    indices[position], mb_predictions[j], labels,
                    mb[name][j].detach().cpu() if "inputs" in wanted and name in mb else None,
                    out.microbatch_losses[k] if "loss" in wanted else None))
                position += 1
        return rows

    def _gather_predictions(self, local: list[_PredictionRow], dataset_length: int,
                            has_labels: bool) -> _GatheredPredictions:
        """Every rank's rows in dataset order, stacked as stock's evaluation loop concatenates
        them (padded with -100): predictions (N, ...), label_ids (N, ...) or a tuple of them
        (one per ``label_names`` key; None without labels), inputs (N, S) and losses (N,)."""
        from accelerate.utils import gather_object

        rows = gather_object(local) if self.args.world_size > 1 else local
        rows.sort(key=lambda row: row.index)
        if [row.index for row in rows] != list(range(dataset_length)):
            raise RuntimeError(f"evaluation gathered {len(rows)} predictions for {dataset_length} "
                               "samples (internal error: each sample must appear exactly once)")
        if not rows:
            return _GatheredPredictions(None, None, None, None)
        predictions = _stack_padded([row.prediction for row in rows],
                                    self._prediction_pad_value())
        if self._prediction_outputs():  # (N, S, k) -> k arrays (N, S), as stock's tuple
            predictions = tuple(predictions[..., j] for j in range(predictions.shape[-1]))
        labels = None
        if has_labels:
            labels = tuple(_stack_padded([row.labels[k] for row in rows], -100)
                           for k in range(len(self.label_names)))
            labels = labels[0] if len(labels) == 1 else labels
        inputs = None if rows[0].inputs is None else _stack_padded([r.inputs for r in rows], -100)
        losses = None if rows[0].loss is None or not has_labels else \
            np.array([row.loss for row in rows], dtype=np.float32)
        return _GatheredPredictions(predictions, labels, inputs, losses)

