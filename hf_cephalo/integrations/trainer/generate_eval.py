"""``predict_with_generate=True`` for ``CephaloSeq2SeqTrainer``: evaluation and prediction score
generated token ids, as stock ``Seq2SeqTrainer.prediction_step`` does, decoded on the sharded
engine ([Note: predict_with_generate] in seq2seq.py).
"""

from __future__ import annotations

import numpy as np
import torch

from hf_cephalo.runtime import resolve_generation

__all__ = ["GenerateEvaluationMixin", "stock_gen_kwargs", "generation_problems"]


def stock_gen_kwargs(args, gen_kwargs: dict) -> dict:
    """The generation keywords stock ``Seq2SeqTrainer.evaluate`` / ``predict`` hand
    ``prediction_step``: ``gen_kwargs``, plus ``max_length`` from ``generation_max_length``
    when neither ``max_length`` nor ``max_new_tokens`` is given, plus ``num_beams`` from
    ``generation_num_beams`` when not given; keys left None dropped (as ``prediction_step``
    drops them)."""
    kwargs = dict(gen_kwargs)
    if kwargs.get("max_length") is None and kwargs.get("max_new_tokens") is None and \
            args.generation_max_length is not None:
        kwargs["max_length"] = args.generation_max_length
    if kwargs.get("num_beams") is None and args.generation_num_beams is not None:
        kwargs["num_beams"] = args.generation_num_beams
    return {k: v for k, v in kwargs.items()
            if not (k in ("max_length", "num_beams") and v is None)}


def generation_problems(model, args) -> list[str]:
    """One message per reason ``predict_with_generate=True`` cannot run on ``model`` with
    ``args`` (checked with every other refusal, before any process group exists): a model that
    is not an encoder-decoder reading token ids, a generation setting the keyed decode does not
    honour (``runtime.resolve_generation``). ``generation_num_beams`` > 1 is refused by the
    arguments themselves (``CephaloSeq2SeqTrainingArguments.refused_settings``)."""
    if not getattr(args, "predict_with_generate", False) or model is None:
        return []
    name = type(model).__name__
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return [f"--predict_with_generate = True is not supported for {name}: hf_cephalo "
                "generates inside evaluate() / predict() for encoder-decoders (T5, BART, ...) "
                "only; a decoder-only model would generate from the whole evaluation input; "
                "leave it False (eval loss and teacher-forced logits)"]
    from transformers import Seq2SeqTrainer

    config = None if args.generation_config is None else \
        Seq2SeqTrainer.load_generation_config(args.generation_config)
    beams = args.generation_num_beams
    kwargs = stock_gen_kwargs(args, {})
    if beams is not None and beams > 1:  # reported by the arguments
        kwargs.pop("num_beams")
    try:
        resolve_generation(model, kwargs, args.seed, generation_config=config)
    except ValueError as exc:
        return [f"--predict_with_generate = True is not supported for {name} with these "
                f"settings: {exc}"]
    return []


class GenerateEvaluationMixin:
    """``evaluate`` / ``predict`` with ``predict_with_generate=True``: the loss as before (the
    teacher-forced forward), the predictions the generated token ids (see [Note:
    predict_with_generate] in seq2seq.py). Mixed in before ``CephaloTrainerMixin``."""

    _generation = None  # ResolvedGeneration of the running evaluate() / predict(), else None

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval",
                 **gen_kwargs):
        """Stock ``Seq2SeqTrainer.evaluate`` (generation keywords as there). Raises ValueError
        on every rank, before any collective, for a generation setting the sharded decode
        does not honour (``num_beams`` > 1, ...)."""
        self._generation = self._resolve_generation(gen_kwargs)
        try:
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys,
                                    metric_key_prefix=metric_key_prefix, **gen_kwargs)
        finally:
            self._generation = None

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test",
                **gen_kwargs):
        """Stock ``Seq2SeqTrainer.predict``; raises as ``evaluate``."""
        self._generation = self._resolve_generation(gen_kwargs)
        try:
            return super().predict(test_dataset, ignore_keys=ignore_keys,
                                   metric_key_prefix=metric_key_prefix, **gen_kwargs)
        finally:
            self._generation = None

    def _resolve_generation(self, gen_kwargs: dict):
        if not self.args.predict_with_generate:
            return None
        return resolve_generation(self.model, stock_gen_kwargs(self.args, gen_kwargs),
                                  self.args.seed)

    # ---- the evaluation loop's hooks (evaluation.py) --------------------------------------
    def _returns_logits(self) -> bool:
        return self._generation is None

    def _prediction_pad_value(self) -> int:
        # generate pads the rows of one batch with the generation pad to the longest
        return -100 if self._generation is None else self._generation.params.pad_token_id

    def _step_predictions(self, indices: list[int], microbatches, out) -> list:
        """Collective: this step's rows decoded on the sharded engine (every rank, its rows
        possibly none), each prediction the decoder start token and the completion."""
        if self._generation is None:
            return super()._step_predictions(indices, microbatches, out)
        prompts, prefixed = [], False
        for mb in microbatches:
            ids, mask = mb["input_ids"].cpu(), mb.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask.cpu()
            prompts += [row[m.bool()].tolist() for row, m in zip(ids, mask)]
            decoder, labels = mb.get("decoder_input_ids"), mb.get("labels")
            prefixed |= decoder is not None and (labels is None or decoder.shape != labels.shape)
        if self.session.any_rank(prefixed):  # stock would continue these decoder inputs
            raise ValueError("predict_with_generate: an evaluation batch holds decoder_input_ids "
                             "not shaped like its labels, which stock generate continues from; "
                             "hf_cephalo decodes from the decoder start token: drop them")
        params, config = self._generation
        got = self.session.generate(prompts, indices[:len(prompts)], params,
                                    self.session.global_step, generation_config=config)
        rows = iter([torch.tensor([*got.decoder_start, *c], dtype=torch.long)
                     for c in got.completions])
        per_mb = [[next(rows) for _ in range(mb["input_ids"].shape[0])] for mb in microbatches]
        return self._local_predictions(indices, microbatches, out, predictions=per_mb)

    def _finish_predictions(self, gathered):
        """As stock ``prediction_step`` pads a batch (here: the whole evaluation set as one):
        generated ids and labels shorter than the model's ``generation_config.max_length``
        (its defaults filled in, as stock fills them) padded to it, else to
        ``max_new_tokens + 1``, with the pad token (``_pad_tensors_to_max_len``); then
        ``preprocess_logits_for_metrics``, as stock's loop applies it to a step's output."""
        if self._generation is None or gathered.predictions is None:
            return gathered
        config = self.model.generation_config
        if getattr(config, "_from_model_config", False):  # as stock's prediction_step
            config._from_model_config = False
        config.update(**type(config)._get_default_generation_params(), defaults_only=True)

        def padded(array):
            tensor = torch.as_tensor(array)
            width = tensor.shape[-1]
            if width < config.max_length:
                return self._pad_tensors_to_max_len(tensor, config.max_length)
            if config.max_new_tokens is not None and width < config.max_new_tokens + 1:
                return self._pad_tensors_to_max_len(tensor, config.max_new_tokens + 1)
            return tensor

        predictions = padded(gathered.predictions)
        labels = gathered.label_ids
        labels = padded(labels) if isinstance(labels, np.ndarray) else labels
        if self.preprocess_logits_for_metrics is not None:
            predictions = self.preprocess_logits_for_metrics(
                predictions, labels if isinstance(labels, torch.Tensor) else None)
        return gathered._replace(predictions=np.asarray(predictions),
                                 label_ids=labels.numpy() if isinstance(labels, torch.Tensor)
                                 else labels)
