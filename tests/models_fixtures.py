"""Tiny Hugging Face models built from configs (no downloads) and a single-process staged runner.

Shared by tests/test_models_*.py. Every config: 2 layers, hidden 64, 4 heads, small vocab.
"""

from __future__ import annotations

from typing import Callable

import torch
import transformers

from hf_cephalo.models import stage_model
from hf_cephalo.models.base import StagedModel

VOCAB = 97
SEQ = 12
COMMON = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)


def _llama(**kw):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, intermediate_size=128, num_key_value_heads=2,
                                   max_position_embeddings=64, **COMMON, **kw)
    return transformers.LlamaForCausalLM(cfg)


def _mistral(**kw):
    # a window shorter than the sequence so the sliding-window mask matters
    cfg = transformers.MistralConfig(vocab_size=VOCAB, intermediate_size=128, num_key_value_heads=2,
                                     max_position_embeddings=64, sliding_window=5, **COMMON, **kw)
    return transformers.MistralForCausalLM(cfg)


def _qwen2(**kw):
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, intermediate_size=128, num_key_value_heads=2,
                                   max_position_embeddings=64, **COMMON, **kw)
    return transformers.Qwen2ForCausalLM(cfg)


def _gpt2(**kw):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  bos_token_id=1, eos_token_id=2,
                                  **kw)
    return transformers.GPT2LMHeadModel(cfg)


def _gpt_neox(**kw):
    cfg = transformers.GPTNeoXConfig(vocab_size=VOCAB, intermediate_size=128,
                                     max_position_embeddings=64, rotary_pct=0.5, **COMMON, **kw)
    return transformers.GPTNeoXForCausalLM(cfg)


def _vit(**kw):
    kw = {"num_labels": 5, **kw}
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, intermediate_size=128,
                                 **COMMON, **kw)
    return transformers.ViTForImageClassification(cfg)


def _bert(**kw):
    kw = {"num_labels": 3, **kw}
    cfg = transformers.BertConfig(vocab_size=VOCAB, intermediate_size=128,
                                  max_position_embeddings=64, **COMMON, **kw)
    return transformers.BertForSequenceClassification(cfg)


BUILDERS: dict[str, Callable[..., torch.nn.Module]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gpt2": _gpt2, "gpt_neox": _gpt_neox,
    "vit": _vit, "bert": _bert}
CAUSAL = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox")
REQUIRED = ("llama", "gpt2", "vit")


def build(arch: str, seed: int = 0, **config_overrides) -> torch.nn.Module:
    """A tiny model of ``arch`` in eval mode (dropout off), fp32, deterministic init."""
    torch.manual_seed(seed)
    return BUILDERS[arch](**config_overrides).eval()


def make_batch(arch: str, batch_size: int, *, seed: int = 0, padding: bool = False,
               packed: bool = False) -> dict[str, torch.Tensor]:
    """A batch with the conventional keys for ``arch``.

    padding: right padding, attention_mask 0 on the pad, labels -100 there (causal LMs) and
        varying lengths per row. packed: two sequences per row, position_ids restart at 0.
    """
    g = torch.Generator().manual_seed(seed)
    if arch == "vit":
        return {"pixel_values": torch.randn(batch_size, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 5, (batch_size,), generator=g)}
    input_ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    batch = {"input_ids": input_ids}
    if padding:
        lengths = torch.randint(3, SEQ + 1, (batch_size,), generator=g)
        lengths[0] = SEQ  # at least one full row
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        batch["input_ids"] = input_ids.masked_fill(mask == 0, 0)
        batch["attention_mask"] = mask
    if packed:
        cut = torch.randint(2, SEQ - 2, (batch_size,), generator=g)
        pos = torch.arange(SEQ)[None, :].repeat(batch_size, 1)
        pos = torch.where(pos >= cut[:, None], pos - cut[:, None], pos)
        batch["position_ids"] = pos
    if arch == "bert":
        second_half = (torch.arange(SEQ)[None, :] >= SEQ // 2).long()
        batch["token_type_ids"] = second_half.repeat(batch_size, 1)
        batch["labels"] = torch.randint(0, 3, (batch_size,), generator=g)
    else:
        labels = batch["input_ids"].clone()
        if padding:
            labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
        labels[:, 1] = -100  # some ignored labels in the middle too
        batch["labels"] = labels
    return batch


def split(batch: dict[str, torch.Tensor], sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    """Split a batch along dim 0 into microbatches of the given sizes."""
    out, start = [], 0
    for m in sizes:
        out.append({k: v[start:start + m] for k, v in batch.items()})
        start += m
    assert start == next(iter(batch.values())).shape[0]
    return out


def staged_logits(staged: StagedModel, microbatch) -> torch.Tensor:
    hidden, ctx = staged.embed(microbatch)
    for i in range(staged.num_units):
        hidden = staged.run_unit(i, hidden, ctx)
    return staged.head_logits(hidden, microbatch, ctx)


def staged_backward(staged: StagedModel, microbatches, num_items: int) -> float:
    """Layered single-process forward + backward like the engine: each unit's input is a detached
    leaf that requires grad (activation checkpointing boundary); every unit is recomputed in
    backward; each microbatch backpropagates loss_sum / num_items. Returns the mean loss.

    Gradients accumulate into the model's ``.grad`` fields.
    """
    total = 0.0
    for mb in microbatches:
        with torch.no_grad():  # forward pass: stash boundary activations only
            hidden, ctx = staged.embed(mb)
            boundaries = [hidden]
            for i in range(staged.num_units):
                boundaries.append(staged.run_unit(i, boundaries[-1], ctx))
        x = boundaries[-1].detach().requires_grad_(True)
        out = staged.head_loss(x, mb, ctx)
        assert out.num_items == staged.count_items(mb)
        (out.loss_sum / num_items).backward()
        total += out.loss_sum.item()
        grad = x.grad
        for i in reversed(range(staged.num_units)):  # recompute unit i, backprop its output grad
            x = boundaries[i].detach().requires_grad_(True)
            y = staged.run_unit(i, x, ctx)
            y.backward(grad)
            grad = x.grad
        hidden, _ = staged.embed(mb)  # root input step last, as the engine's root backward
        if hidden.requires_grad:  # False when every embedding parameter is frozen
            hidden.backward(grad)
    return total / num_items


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
