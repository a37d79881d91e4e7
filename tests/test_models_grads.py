"""Gradients through the staged model equal the Hugging Face model's own (issue 4, items 3-5).

The staged backward (tests/models_fixtures.staged_backward) follows the engine: every unit
input is a detached leaf that requires grad, every unit is recomputed in backward, each
microbatch backpropagates loss_sum / N. Reference: ``model(**full_batch).loss.backward()``.
"""

from __future__ import annotations

import pytest
import torch

from hf_cephalo.models import stage_model
from tests.models_fixtures import BUILDERS, build, grads, make_batch, split, staged_backward


def _assert_grads_equal(model, ref, got, what):
    assert ref.keys() == got.keys()
    for name in ref:
        r, g = ref[name], got[name]
        if r is None or g is None:
            # a parameter unused by both computations: no grad, or an explicit zero grad
            other = g if r is None else r
            assert other is None or not other.any(), f"{what}: {name} grad {r} vs {g}"
            continue
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {name}: {m}")


def _reference_and_staged(model, batch, sizes):
    staged = stage_model(model)
    staged.prepare_for_training()
    model.zero_grad(set_to_none=True)
    ref_loss = model(**batch).loss
    ref_loss.backward()
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    microbatches = split(batch, sizes)
    num_items = sum(staged.count_items(mb) for mb in microbatches)
    loss = staged_backward(staged, microbatches, num_items)
    torch.testing.assert_close(torch.tensor(loss), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    return ref, grads(model)


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_staged_grads_equal_model(arch):
    model = build(arch)
    batch = make_batch(arch, 5, seed=2, padding=arch != "vit")
    ref, got = _reference_and_staged(model, batch, [3, 2])
    assert sum(g is not None and g.abs().sum() > 0 for g in got.values()) > len(got) // 2
    _assert_grads_equal(model, ref, got, arch)


@pytest.mark.parametrize("arch,overrides", [("gpt2", {}), ("llama", {"tie_word_embeddings": True})])
def test_tied_embeddings_one_storage_grad_of_both_uses(arch, overrides):
    model = build(arch, **overrides)
    staged = stage_model(model)
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is emb
    root = {id(p) for m in staged.root_modules() for p in m.parameters()}
    units = {id(p) for u in staged.units() for p in u.parameters()}
    assert id(emb) in root and not root & units
    assert root | units == {id(p) for p in model.parameters()}
    unique = {id(p): p for m in [*staged.root_modules(), *staged.units()] for p in m.parameters()}
    assert sum(p.numel() for p in unique.values()) == model.num_parameters()
    batch = make_batch(arch, 4, seed=3)
    ref, got = _reference_and_staged(model, batch, [1, 3])
    name = next(n for n, p in model.named_parameters() if p is emb)
    torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6)
    # the head use alone gives a different gradient: the embedding really got both
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        hidden = model.get_input_embeddings()(batch["input_ids"])
    model.get_output_embeddings()(hidden).sum().backward()
    assert not torch.allclose(emb.grad, ref[name])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "vit", "bert"])
def test_frozen_embeddings_layers_still_get_grads(arch):
    """The reentrant-checkpoint trap: with frozen embeddings the unit inputs do not require
    grad, and checkpointed layers would silently get no gradient. The staged backward feeds
    each unit a detached leaf that requires grad, so every trainable layer gets the reference
    gradient."""
    model = build(arch)
    embeddings = {"llama": lambda: model.model.embed_tokens,
                  "gpt2": lambda: model.transformer.wte,
                  "vit": lambda: model.vit.embeddings,
                  "bert": lambda: model.bert.embeddings}[arch]()
    if arch == "gpt2":
        model.transformer.wpe.requires_grad_(False)
        model.lm_head.weight.requires_grad_(False)  # tied to wte
    embeddings.requires_grad_(False)
    batch = make_batch(arch, 4, seed=4)
    ref, got = _reference_and_staged(model, batch, [2, 2])
    _assert_grads_equal(model, ref, got, arch)
    for unit in stage_model(model).units():
        for p in unit.parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0
    for p in embeddings.parameters():
        assert p.grad is None


def test_hf_gradient_checkpointing_is_mapped_off_with_warning():
    model = build("llama")
    model.model.embed_tokens.requires_grad_(False)
    model.train()
    with pytest.warns(FutureWarning):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.config.use_cache = True
    staged = stage_model(model)
    with pytest.warns(UserWarning, match="recomputes every layer"):
        staged.prepare_for_training()
    assert model.config.use_cache is False
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    model.eval()
    batch = make_batch("llama", 4, seed=5)
    ref, got = _reference_and_staged(model, batch, [3, 1])
    _assert_grads_equal(model, ref, got, "llama+hf-gc")


def test_bert_pooler_in_root_unit_gets_its_grad():
    model = build("bert")
    staged = stage_model(model)
    root = {id(p) for m in staged.root_modules() for p in m.parameters()}
    assert all(id(p) in root for p in model.bert.pooler.parameters())
    batch = make_batch("bert", 4, seed=6)
    ref, got = _reference_and_staged(model, batch, [1, 3])
    _assert_grads_equal(model, ref, got, "bert")
    assert got["bert.pooler.dense.weight"].abs().sum() > 0


def test_unused_parameters_get_no_grad_and_do_not_block():
    """GPT-2 built with cross-attention but run without encoder states: the cross-attention
    weights (inside the units) are unused; the staged backward completes and leaves them
    without gradient, exactly like the model's own backward."""
    model = build("gpt2", add_cross_attention=True)
    batch = make_batch("gpt2", 4, seed=7)
    ref, got = _reference_and_staged(model, batch, [2, 2])
    unused = [n for n in ref if "crossattention" in n or "ln_cross_attn" in n]
    assert unused and all(ref[n] is None and got[n] is None for n in unused)
    _assert_grads_equal(model, ref, got, "gpt2+unused")
