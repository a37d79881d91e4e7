"""Whether a class is a causal LM by what its own forward computes on text, whatever its name.

A vision-language ``...ForConditionalGeneration`` on text is one where its forward returns
logits over the vocabulary and their next-token loss; a masked LM, whose loss scores the labels
as given and whose logits read later tokens, is not. The self-check (``models/self_check.py``)
asks this before it stages a class as a causal LM on the generic path.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.generic import forward_inputs
from hf_cephalo.models.hf_common import causal_lm_loss_sum


def causal_lm_problem(model: nn.Module, batch: Microbatch) -> tuple[str | None, bool]:
    """(None, label_shift) when the model's own forward on ``batch`` (``input_ids``,
    ``attention_mask``, ``labels`` (B, S)) is a causal LM's: ``logits`` (B, S, V) with V the
    text vocabulary (or the output embeddings' rows) and a ``loss`` equal to the mean
    cross entropy of those logits against the labels shifted by one (label_shift True,
    ``ForCausalLMLoss``) or, where not, against the labels as given (False:
    ``BartForCausalLM`` and the other causal LMs of encoder-decoder families, whose callers
    shift); else (what differs, True). What makes a class a causal LM here is what it
    computes, not its name (a vision-language model's ``...ForConditionalGeneration`` on text
    is one). A MoE router loss is switched off for the comparison (the generic path adds it
    apart). On random weights the two conventions give different losses, so at most one
    matches."""
    extra = {k: False for k in ("output_router_logits", "use_cache")
             if k in inspect.signature(type(model).forward).parameters}
    try:
        with torch.no_grad():
            out = model(**forward_inputs(model, batch), labels=batch["labels"], **extra)
    except Exception as exc:  # noqa: BLE001 - a forward that needs other inputs is no text LM
        first = (str(exc).splitlines() or [""])[0][:200]  # one line: it goes into tables
        return f"it fails on text alone ({type(exc).__name__}: {first}){_needs(model, exc)}", True
    logits, loss = getattr(out, "logits", None), getattr(out, "loss", None)
    ids = batch["input_ids"]
    if not torch.is_tensor(logits) or logits.dim() != 3 or logits.shape[:2] != ids.shape:
        shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        return f"its logits are {shape}, not one row of scores per token {tuple(ids.shape)}", True
    vocab = {getattr(model.config.get_text_config(), "vocab_size", None)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(getattr(head, "weight", None), torch.Tensor):
        vocab.add(head.weight.shape[0])
    if logits.shape[-1] not in vocab:
        return f"its logits score {logits.shape[-1]} classes, not the vocabulary {vocab}", True
    if not torch.is_tensor(loss):
        return "it returns no loss for labels", True
    means = {}
    for shift in (True, False):
        ref = causal_lm_loss_sum(logits.float(), batch["labels"], shift)
        means[shift] = ref.loss_sum / max(ref.num_items, 1)
        if torch.allclose(loss.float(), means[shift], rtol=1e-4, atol=1e-5):
            if not shift and not _reads_left_only(model, batch, logits, extra):
                return ("its loss scores the labels as given and its logits at a position "
                        "depend on later tokens: a masked LM's loss, not a causal LM's"), True
            return None, shift
    return (f"its loss {float(loss):.6g} is the cross entropy of its logits neither against "
            f"the next labels ({float(means[True]):.6g}) nor against the labels as given "
            f"({float(means[False]):.6g})"), True


def _reads_left_only(model: nn.Module, batch: Microbatch, logits: torch.Tensor,
                     extra: dict[str, Any]) -> bool:
    """Whether the logits at positions < S - 1 stay the same when each row's last token changes
    (a causal LM's do; a masked LM's, which attends both ways, do not). ``logits`` (B, S, V):
    the model's on ``batch``."""
    inputs = forward_inputs(model, batch)
    ids = inputs["input_ids"].clone()
    ids[:, -1] = (ids[:, -1] + 1) % logits.shape[-1]
    with torch.no_grad():
        other = model(**{**inputs, "input_ids": ids}, **extra).logits
    return torch.allclose(other[:, :-1].float(), logits[:, :-1].float(), rtol=1e-5, atol=1e-6)


TEXT_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "token_type_ids",
                         "labels"})
"""What a text batch gives a forward (``causal_lm_problem``'s batch, and the ids the tokenizer
adds)."""


def _needs(model: nn.Module, exc: BaseException) -> str:
    """For a forward that fails on text alone: the tensor inputs it takes besides text, in
    plain words (those its error names, else all but ``inputs_embeds``, which every model
    takes in place of ids): an image-conditioned LM's ``pixel_values``, a draft model's
    ``inputs_embeds`` and ``shared_kv_states`` from the model it drafts for. Empty where
    there are none."""
    params = inspect.signature(type(model).forward).parameters
    tensors = [n for n, p in params.items() if n not in TEXT_INPUTS and n not in (
        "cache", "past_key_values", "cache_position", "logits_to_keep", "num_items_in_batch")
        and "Tensor" in str(p.annotation)]
    named = [n for n in tensors if n in str(exc)]
    names = named or [n for n in tensors if n != "inputs_embeds"]
    if not names:
        return ""
    return (f"; besides text (input_ids, attention_mask, labels) its forward takes "
            f"{', '.join(names)}, which a text batch does not provide: a model that needs "
            f"{'them' if len(names) > 1 else 'it'} (an image, or states of another model) "
            f"does not train on text alone")
