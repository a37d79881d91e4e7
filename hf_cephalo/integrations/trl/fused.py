"""TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) answered from the engine's head.

TRL's trainers patch ``model.forward`` so that ``model(..., labels=..., fused_lm_head=True)``
runs the backbone and then TRL's chunked kernel (``trl.kernels.ChunkedLogProbFunction``), which
projects the final hidden states through ``lm_head`` in tiles of 4096 tokens x 32768 vocabulary
entries and folds each tile into per-token log-probabilities (and entropy, top-1), so the
(B, T, V) logits are never built. The engine never calls ``model.forward``: its head has the
last unit's output instead. ``FusedLMHead`` is the ``user_loss.CallVariant`` that does what the
patched forward does after its backbone, from that output: the adapter's final norm
(``final_hidden``), the causal shift, the SAME kernel call with the adapter's output projection
and the config's logit scale and softcap (as TRL reads them) — so the loss, its gradient and the metrics are TRL's, per microbatch, and the logits of a
microbatch are never materialized either. Written against TRL 1.16.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hf_cephalo.runtime import HeadView

__all__ = ["FusedLMHead"]

_OUTPUT_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _logit_scale(text_config: Any) -> float:
    """The pre-softcap logit multiplier TRL's fused head reads from the config (Granite's
    1 / logits_scaling, Cohere's logit_scale, ...; 1.0 where none); ``add_fused_lm_head``'s
    lookup order."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else scale


class FusedLMHead:
    """``model(**inputs, fused_lm_head=True)`` on the engine's head: a ``FusedCausalLMOutput``
    (loss = -sum(log_probs) / num_items_in_batch; log_probs, entropy, is_top1, label_mask:
    (m, S - 1) each, zero where the label is -100; with ``output_router_logits=True``,
    aux_loss: this microbatch's share of the router loss of the whole global batch, 0-dim,
    without gradient, so a gather of it over the step gives the global batch's
    (``StagedModel.global_loss_output``); the engine adds the term to the step's loss itself,
    so loss leaves it out), as TRL's patched forward returns it.

    Args (as ``add_fused_lm_head``'s): temperature, cast_lm_head_to_fp32, outputs — the
    per-token fields the kernel computes (SFTTrainer asks for log_probs, entropy, is_top1).
    """

    def __init__(self, *, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                 outputs: tuple[str, ...] = ("log_probs",)) -> None:
        self.temperature, self.cast_lm_head_to_fp32 = temperature, cast_lm_head_to_fp32
        self.outputs = tuple(outputs)

    def __call__(self, view: HeadView, inputs: dict[str, Any]):
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer import utils as trl_utils

        labels, shift_labels = inputs.get("labels"), inputs.get("shift_labels")
        num_items = inputs.get("num_items_in_batch")
        if labels is None and shift_labels is None:
            raise ValueError("model(..., fused_lm_head=True) needs labels (TRL's fused head "
                             "scores each next-token label)")
        text_config = view.staged.model.config.get_text_config()
        hidden = view.final_hidden()  # (m, S, H)
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]  # (m, S - 1, H), (m, S - 1)
        else:
            labels = shift_labels
        head = view.output_projection()  # TRL applies the config's scale / softcap below
        weight, bias = head.weight, head.bias
        labels = labels.to(weight.device)
        mask = labels != -100
        autocast = contextlib.nullcontext()
        if self.cast_lm_head_to_fp32:
            hidden = hidden.float()
            autocast = torch.autocast(hidden.device.type, enabled=False)
        # TRL scores only the labelled positions with Triton, every position elsewhere
        compact = _use_triton(hidden.device)
        chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)
        with autocast:
            per_token = ChunkedLogProbFunction.apply(
                hidden[mask] if compact else hidden.reshape(-1, hidden.size(-1)), weight, bias,
                labels[mask] if compact else labels.clamp(min=0).reshape(-1), self.temperature,
                chunk, getattr(text_config, "final_logit_softcapping", None),
                _logit_scale(text_config), self.outputs)
        if compact:
            per_token = (None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)
                         for x in per_token)
        else:
            per_token = (None if x is None else x.view(mask.shape).masked_fill(~mask, 0)
                         for x in per_token)
        fields = dict(zip(_OUTPUT_FIELDS, per_token))
        count = mask.sum().clamp(min=1) if num_items is None else num_items
        loss, aux = -fields["log_probs"].sum() / count, None
        if inputs.get("output_router_logits"):  # [Note: router loss in the SFT door] in sft.py
            aux = view.staged.global_loss_output(view.ctx).to(hidden.device)
        return trl_utils.FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux, **fields)

    def empty(self, model: torch.nn.Module, inputs: dict[str, Any]):
        """The same output, zeros, for the rows of ``inputs``' labels (none in
        ``head_calls.py``'s replay; a DPO replay passes one pair: ``dpo.py``)."""
        from trl.trainer.utils import FusedCausalLMOutput

        labels = inputs.get("shift_labels", inputs.get("labels"))
        seq = 0 if labels is None or labels.dim() < 2 else labels.shape[1]
        rows = 0 if labels is None or labels.dim() < 1 else labels.shape[0]  # 0 in the replay
        if inputs.get("shift_labels") is None:
            seq = max(seq - 1, 0)
        device = labels.device if labels is not None else None
        zeros = torch.zeros((rows, seq), device=device)
        fields = {name: (zeros.clone() if name in self.outputs else None)
                  for name in _OUTPUT_FIELDS}
        if fields["is_top1"] is not None:
            fields["is_top1"] = torch.zeros((rows, seq), dtype=torch.bool, device=device)
        aux = torch.zeros((), device=device) if inputs.get("output_router_logits") else None
        return FusedCausalLMOutput(loss=torch.zeros((), device=device),
                                   label_mask=torch.zeros((rows, seq), dtype=torch.bool,
                                                          device=device), aux_loss=aux, **fields)


def _use_triton(device: torch.device) -> bool:
    try:
        from trl.kernels.chunked_logprob import _use_triton as use
    except ImportError:  # a TRL without the helper: its rule
        from transformers.utils import is_triton_available

        return is_triton_available() and device.type in ("cuda", "xpu")
    return use(device)
