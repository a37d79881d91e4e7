"""Engine parity on every HF architecture (issue 4, item 7): 2 and 3 gloo ranks, uneven plans.

For each architecture variant, every rank runs 3 optimizer steps of ``CephaloEngine`` on its
own slice of the global batch (uneven b_i including a rank with none, uneven m_i, uneven state
ratios r_i including a zero share) and the result is compared with a single-process full-batch
reference (``model(**batch).loss.backward()`` + the same optimizer): per-step global losses and
every parameter after the last step. Models are in eval mode (dropout off).

Two passes per variant:
- fp32 with SGD (rtol 1e-5, atol 1e-6): the parameter difference is lr x the gradient
  difference, so this checks the fp32 gradients themselves.
- fp64 with AdamW (rtol 1e-10, atol 1e-12). AdamW's first steps move every element by about
  lr x sign(grad), so in fp32 an element whose gradient is ~0 turns summation-order noise
  (microbatches vs one full batch) into a ~lr-sized difference; fp64 keeps that noise far
  below the tolerance, and the comparison is then tighter than fp32's, not looser.
"""

from __future__ import annotations

import copy

import torch

from hf_cephalo.engine import CephaloEngine
from hf_cephalo.models import stage_model
from tests.dist_utils import budget_s, run_ranks, test_timeout
from tests.models_fixtures import build, make_batch

# dtype -> (optimizer factory, rtol, atol)
PASSES = {
    torch.float32: (lambda params: torch.optim.SGD(params, lr=0.1), 1e-5, 1e-6),
    torch.float64: (lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
                    1e-10, 1e-12),
}

# (name, arch, config overrides, batch options, freeze embeddings)
VARIANTS = [
    ("llama", "llama", {}, {"padding": True}, False),
    ("llama_tied_packed", "llama", {"tie_word_embeddings": True}, {"packed": True}, False),
    ("llama_frozen_embeddings", "llama", {}, {"padding": True}, True),
    ("mistral", "mistral", {}, {"padding": True}, False),
    ("qwen2", "qwen2", {}, {"padding": True}, False),
    ("gpt2", "gpt2", {}, {"padding": True}, False),
    ("gpt2_unused_cross_attention", "gpt2", {"add_cross_attention": True}, {}, False),
    ("gpt_neox", "gpt_neox", {}, {"padding": True}, False),
    ("vit", "vit", {}, {}, False),
    ("bert", "bert", {}, {"padding": True}, False),
]
# per world size: batch size b_i, microbatch size m_i, state ratio r_i per rank. With 3 ranks,
# rank 0 computes but holds no state, rank 1 holds the largest state share but has no samples.
PLANS = {2: ([4, 1], [3, 1], [0.7, 0.3]),
         3: ([2, 0, 3], [1, 1, 2], [0.0, 0.6, 0.4])}


def _freeze_embeddings(model) -> None:
    model.get_input_embeddings().requires_grad_(False)


def _rank_microbatches(batch, sizes_b, sizes_m, rank):
    start = sum(sizes_b[:rank])
    mine = {k: v[start:start + sizes_b[rank]] for k, v in batch.items()}
    m = sizes_m[rank]
    return [{k: v[j:j + m] for k, v in mine.items()} for j in range(0, sizes_b[rank], m)]


def _reference_loss(model, batch, dtype) -> torch.Tensor:
    """The full-batch mean loss. fp32: the model's own loss. fp64: the same definition computed
    in fp64 (HF's causal LM loss casts logits to fp32, which would cap the precision)."""
    if dtype == torch.float32:
        return model(**batch).loss
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"]
    if logits.dim() == 3:  # causal LM: position t predicts label t+1
        logits, labels = logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1), ignore_index=-100)


def _to(batch, dtype):
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def _run_variant(rank: int, world: int, variant, dtype) -> None:
    name, arch, overrides, batch_opts, freeze = variant
    name = f"{name}/{dtype}"
    make_opt, rtol, atol = PASSES[dtype]
    sizes_b, sizes_m, ratios = PLANS[world]
    model = build(arch, seed=11, **overrides).to(dtype)
    if freeze:
        _freeze_embeddings(model)
    staged = stage_model(model)
    staged.prepare_for_training()
    ref = copy.deepcopy(model)
    initial_emb = model.get_input_embeddings().weight.detach().clone() if freeze else None
    engine = CephaloEngine(staged, ratios)
    opt = make_opt(engine.parameters())
    ref_opt = make_opt([p for p in ref.parameters() if p.requires_grad])
    for step in range(3):
        batch = _to(make_batch(arch, sum(sizes_b), seed=100 + step, **batch_opts), dtype)
        out = engine.train_step(_rank_microbatches(batch, sizes_b, sizes_m, rank))
        opt.step()
        engine.zero_grad()
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = _reference_loss(ref, batch, dtype)
        ref_loss.backward()
        for p in ref.parameters():
            # [unused parameters] the engine's flat shards give an unused parameter a ZERO
            # gradient (as DDP / FSDP do), so AdamW still applies weight decay to it; a None
            # gradient would make AdamW skip it. The reference follows the data-parallel rule.
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_opt.step()
        torch.testing.assert_close(out.loss, float(ref_loss.detach()), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name} world {world} step {step} loss: {m}")
    full = engine.full_state_dict()
    if rank == 0:
        expected = ref.state_dict()
        assert list(full) == list(expected), name
        for key, value in expected.items():
            torch.testing.assert_close(full[key], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{name} world {world} {key}: {m}")
        if freeze:  # frozen weights unchanged, trainable ones moved
            emb_key = next(k for k in expected if "embed_tokens" in k)
            torch.testing.assert_close(full[emb_key], initial_emb)


def parity_worker(rank: int, world: int) -> list[str]:
    torch.use_deterministic_algorithms(True)
    done = []
    for variant in VARIANTS:
        for dtype in PASSES:
            _run_variant(rank, world, variant, dtype)
        done.append(variant[0])
    return done


@test_timeout(35)
def test_hf_models_engine_parity_two_ranks():
    names = [v[0] for v in VARIANTS]
    assert run_ranks(parity_worker, 2, timeout_s=budget_s(35)) == [names] * 2


@test_timeout(45)
def test_hf_models_engine_parity_three_ranks():
    names = [v[0] for v in VARIANTS]
    assert run_ranks(parity_worker, 3, timeout_s=budget_s(45)) == [names] * 3
