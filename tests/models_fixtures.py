"""Tiny Hugging Face models built from configs (no downloads) and a single-process staged runner.

Shared by tests/test_models_*.py. Every config: 2 layers, hidden 64, 4 heads, small vocab; the
decoder sequence classifiers (``SEQ_CLS_BUILDERS``): 2 layers, hidden 32, 4 heads, 3 labels, pad
token 0.
"""

from __future__ import annotations

from typing import Callable

import torch
import transformers

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


PAD = 0
"""The pad token id of the decoder classifiers' configs and of padded batches (real tokens are
drawn from 1..VOCAB-1, so only padding is PAD)."""
NUM_LABELS = 3
SEQ_CLS_COMMON = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                      num_labels=NUM_LABELS, pad_token_id=PAD)


def _seq_cls(config_cls, model_cls, defaults, kw):
    return model_cls(config_cls(**{**SEQ_CLS_COMMON, **defaults, **kw}))


def _llama_cls(**kw):
    return _seq_cls(transformers.LlamaConfig, transformers.LlamaForSequenceClassification,
                    dict(vocab_size=VOCAB, intermediate_size=64, num_key_value_heads=2,
                         max_position_embeddings=64), kw)


def _mistral_cls(**kw):
    # a window shorter than the sequence so the sliding-window mask matters
    return _seq_cls(transformers.MistralConfig, transformers.MistralForSequenceClassification,
                    dict(vocab_size=VOCAB, intermediate_size=64, num_key_value_heads=2,
                         max_position_embeddings=64, sliding_window=5), kw)


def _qwen2_cls(**kw):
    return _seq_cls(transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification,
                    dict(vocab_size=VOCAB, intermediate_size=64, num_key_value_heads=2,
                         max_position_embeddings=64), kw)


def _gpt2_cls(**kw):
    return _seq_cls(transformers.GPT2Config, transformers.GPT2ForSequenceClassification,
                    dict(vocab_size=VOCAB, n_positions=64, bos_token_id=1, eos_token_id=2), kw)


BUILDERS: dict[str, Callable[..., torch.nn.Module]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gpt2": _gpt2, "gpt_neox": _gpt_neox,
    "vit": _vit, "bert": _bert}
SEQ_CLS_BUILDERS: dict[str, Callable[..., torch.nn.Module]] = {
    "llama_cls": _llama_cls, "mistral_cls": _mistral_cls, "qwen2_cls": _qwen2_cls,
    "gpt2_cls": _gpt2_cls}
"""Decoder sequence classifiers (last non-pad token pooling). Kept apart from ``BUILDERS``,
which tests of every architecture iterate with counts of their own (tests/test_loading.py)."""
CAUSAL = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox")
REQUIRED = ("llama", "gpt2", "vit")


def build(arch: str, seed: int = 0, **config_overrides) -> torch.nn.Module:
    """A tiny model of ``arch`` in eval mode (dropout off), fp32, deterministic init."""
    torch.manual_seed(seed)
    builder = BUILDERS.get(arch) or SEQ_CLS_BUILDERS[arch]
    return builder(**config_overrides).eval()


def make_batch(arch: str, batch_size: int, *, seed: int = 0, padding: bool | str = False,
               packed: bool = False) -> dict[str, torch.Tensor]:
    """A batch with the conventional keys for ``arch``.

    padding: True or "right": right padding, "left": left padding; attention_mask 0 and
        input_ids PAD on the pad, labels -100 there (causal LMs) and varying lengths per row.
        packed: two sequences per row, position_ids restart at 0. Classifiers (BERT and
        ``SEQ_CLS_BUILDERS``) get one int64 label per row.
    """
    if padding not in (False, True, "right", "left"):
        raise ValueError(f"padding={padding!r}: use False, True / 'right' or 'left'")
    g = torch.Generator().manual_seed(seed)
    if arch == "vit":
        return {"pixel_values": torch.randn(batch_size, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 5, (batch_size,), generator=g)}
    input_ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    batch = {"input_ids": input_ids}
    if padding:
        lengths = torch.randint(3, SEQ + 1, (batch_size,), generator=g)
        lengths[0] = SEQ  # at least one full row
        positions = torch.arange(SEQ)[None, :]
        if padding == "left":
            positions = positions.flip(-1)
        mask = (positions < lengths[:, None]).long()
        batch["input_ids"] = input_ids.masked_fill(mask == 0, PAD)
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
    elif arch in SEQ_CLS_BUILDERS:
        batch["labels"] = torch.randint(0, NUM_LABELS, (batch_size,), generator=g)
    else:
        labels = batch["input_ids"].clone()
        if padding:
            labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
        labels[:, 1] = -100  # some ignored labels in the middle too
        batch["labels"] = labels
    return batch


PROBLEMS: dict[str, dict] = {
    "single_label_classification": {},
    "regression": {"num_labels": 1},
    "multi_label_classification": {"problem_type": "multi_label_classification"}}
"""HF ``problem_type`` -> the config overrides of a classifier that resolves to it."""


def with_problem(batch: dict[str, torch.Tensor], problem: str,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """A classifier ``batch`` with labels for ``problem``: single-label int64 ids with row 1
    set to -100 (ignored); regression (m,) float targets (for num_labels 1); multi-label
    (m, NUM_LABELS) 0/1 floats."""
    g = torch.Generator().manual_seed(seed)
    m = batch["input_ids"].shape[0]
    labels = batch["labels"].clone()
    if problem == "single_label_classification":
        labels[1] = -100
    elif problem == "regression":
        labels = torch.randn(m, generator=g)
    elif problem == "multi_label_classification":
        labels = torch.randint(0, 2, (m, NUM_LABELS), generator=g).float()
    else:
        raise ValueError(f"problem={problem!r}: use one of {sorted(PROBLEMS)}")
    return {**batch, "labels": labels}


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


def stock_num_items(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``num_items_in_batch`` as stock ``Trainer`` passes it to the model's forward for this
    batch (``Trainer._get_num_items_in_batch``): labels after the causal shift when the model's
    ``loss_type`` maps to transformers' ``ForCausalLMLoss``, else every label (GPT-2, whose
    ``loss_type`` is None, divides its shifted loss sum by the unshifted count)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    shifts = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    labels = batch["labels"][..., 1:] if shifts else batch["labels"]
    return labels.ne(-100).sum()
