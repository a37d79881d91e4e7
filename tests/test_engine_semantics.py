"""Engine semantics beyond random-plan parity: token weighting, collective counts and memory
accounting, recompute, frozen / rarely-used / tied parameters, no unit-sized tensor in a
microbatch's backward, clipping, state dicts, evaluation,
the reduce-scatter fallback, dropout replay and input validation (no hang on bad input).

One 2-rank process group runs every multi-rank sub-case; one 1-rank group checks dropout replay.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_cephalo.engine import CephaloEngine, EnginePrecision
from hf_cephalo.models.toy import ToyConfig, ToyLM, ToyStaged
from tests.dist_utils import budget_s, run_ranks, test_timeout

RTOL, ATOL = 1e-5, 1e-6


# ---- helpers ----------------------------------------------------------------------------------
def gather_grads(engine: CephaloEngine) -> dict[str, torch.Tensor]:
    """Full gradients by parameter name, assembled from every rank's shard grads (collective)."""
    out = {}
    for meta, param in zip(engine.shard_metadata(), engine.parameters()):
        local = param.grad if param.grad is not None else torch.zeros_like(param)
        pieces = [None] * engine.world_size
        dist.all_gather_object(pieces, local.detach().cpu())
        flat = torch.cat(pieces)
        assert flat.numel() == meta.trainable_numel
        for info in meta.params:
            if info.requires_grad:
                out[info.fqn] = flat[info.offset:info.offset + info.numel].view(info.shape)
    return out


def reference_grads(model: ToyLM, ids, labels) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    loss, _ = ref(ids, labels)
    loss.backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def assert_grads_close(got, expected, what):
    assert set(got) == set(expected), (what, sorted(set(got) ^ set(expected)))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: {name}: {m}")


def padded_batch(lengths, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    seq = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=gen)
    labels = ids.clone()
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
        labels[b, n:] = -100
    return ids, labels


def mbs_of(ids, labels, sizes):
    out, k = [], 0
    for s in sizes:
        out.append({"input_ids": ids[k:k + s], "labels": labels[k:k + s]})
        k += s
    return out


def fresh(cfg, seed=0, **engine_kw):
    torch.manual_seed(seed)
    model = ToyLM(cfg)
    reference = copy.deepcopy(model)
    return CephaloEngine(ToyStaged(model), **engine_kw), reference


# ---- sub-cases (each runs on every rank) ------------------------------------------------------
def case_token_weighting(rank, world):
    """8 sequences of lengths 3..40; splits {8}, {4,4}, {1x8}, {3,5} give the token-mean grad."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=40)
    ids, labels = padded_batch([3, 40, 7, 12, 25, 5, 33, 18], cfg.vocab_size, seed=1)
    splits = {"{8}": ([8, 0], [[8], []]), "{4,4}": ([4, 4], [[4], [4]]),
              "{1x8}": ([8, 0], [[1] * 8, []]), "{3,5}": ([3, 5], [[3], [5]]),
              "{3,5} as 2+1, 1+4": ([3, 5], [[2, 1], [1, 4]])}
    for name, (sizes_b, micro) in splits.items():
        engine, ref = fresh(cfg, state_ratios=[0.6, 0.4])
        start = sum(sizes_b[:rank])
        mine = mbs_of(ids[start:start + sizes_b[rank]], labels[start:start + sizes_b[rank]],
                      micro[rank])
        engine.train_step(mine)
        assert_grads_close(gather_grads(engine), reference_grads(ref, ids, labels), name)


def case_uneven_batches_vs_naive_mean(rank, world):
    """Local batches 2 and 6 equal the full-batch step on 8, and differ from the average of
    per-rank means (the naive data-parallel answer)."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=24)
    ids, labels = padded_batch([4, 24, 9, 13, 20, 6, 17, 11], cfg.vocab_size, seed=2)
    engine, ref = fresh(cfg)
    lo, hi = (0, 2) if rank == 0 else (2, 8)
    engine.train_step(mbs_of(ids[lo:hi], labels[lo:hi], [hi - lo]))
    got = gather_grads(engine)
    full = reference_grads(ref, ids, labels)
    assert_grads_close(got, full, "2+6 vs full batch")
    g0, g1 = reference_grads(ref, ids[:2], labels[:2]), reference_grads(ref, ids[2:], labels[2:])
    naive = {k: (g0[k] + g1[k]) / 2 for k in full}
    worst = max(float((got[k] - naive[k]).abs().max()) for k in full)
    assert worst > 1e-3, f"engine gradient equals the naive mean of per-rank means ({worst})"


# per step, L >= 1 layer units: (all-gathers, reduce-scatters); docs/engine.md "Collectives"
EXPECTED_COUNTS = {  # (tied, root_resident) -> f(L)
    (False, False): lambda L: (2 * L + 2, L + 2),  # embed twice, head once
    (True, False): lambda L: (2 * L + 3, L + 3),   # tied embed three times, reduced twice
    (False, True): lambda L: (2 * L + 1, L + 2),   # root gathered once, kept all step
    (True, True): lambda L: (2 * L + 1, L + 2),
}


def case_collective_counts_and_accounting(rank, world):
    """Counts/bytes of all-gathers and reduce-scatters per step do not depend on the number of
    microbatches and follow EXPECTED_COUNTS for tied / untied embeddings, split / resident
    root; with the split root the full parameters and gradients alive at once stay within the
    largest root phase + 2 layer units (never the whole root beside a layer's gradient), and
    the resident root within the whole root + 2 units; evaluation gathers the split root once
    per use."""
    for tied, resident in EXPECTED_COUNTS:
        cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=4, max_seq_len=12,
                        tie_embeddings=tied)
        ids, labels = padded_batch([12] * 8, cfg.vocab_size, seed=3)
        mine = slice(0, 4) if rank == 0 else slice(4, 8)
        per_l = {}
        for micro in ([4], [2, 2], [1, 1, 1, 1], [3, 1]):
            engine, ref = fresh(cfg, state_ratios=[0.7, 0.3], root_resident=resident)
            engine.stats.reset()
            engine.train_step(mbs_of(ids[mine], labels[mine], micro if rank == 0 else [4]))
            s = engine.stats
            per_l[len(micro)] = (s.all_gather_count, s.all_gather_sent_bytes,
                                 s.all_gather_received_bytes, s.reduce_scatter_count,
                                 s.reduce_scatter_sent_bytes, s.reduce_scatter_received_bytes,
                                 s.all_reduce_count)
            L = engine.num_units
            what = f"tied={tied} resident={resident} {micro}: {s}"
            assert (s.all_gather_count, s.reduce_scatter_count) == \
                EXPECTED_COUNTS[tied, resident](L), what
            metas = engine.shard_metadata()
            assert [m.name for m in metas[-2:]] == ["embed", "head"]
            embed, head = metas[-2], metas[-1]
            unit_nt = max(m.trainable_numel for m in metas[:-2])
            unit_n = max(m.numel for m in metas[:-2])
            if resident:  # the whole root all step
                root_nt, root_n = embed.trainable_numel + head.trainable_numel, \
                    embed.numel + head.numel
            else:  # the largest root phase: embedding alone, or the head (+ tied embedding)
                root_nt = max(embed.trainable_numel, head.trainable_numel +
                              (embed.trainable_numel if tied else 0))
                root_n = max(embed.numel, head.numel + (embed.numel if tied else 0))
            all_nt = sum(m.trainable_numel for m in metas)
            assert s.peak_unsharded_grad_numel <= root_nt + 2 * unit_nt < all_nt, what
            assert s.peak_unsharded_numel <= root_n + 2 * unit_n, what
            if not resident and not tied:  # the embedding is never gathered beside the head
                assert s.peak_unsharded_numel < embed.numel + head.numel + unit_n, what
            assert all(u.state.value == "sharded" for u in engine.all_units())
            assert_grads_close(gather_grads(engine), reference_grads(ref, ids, labels), what)
        assert len(set(per_l.values())) == 1, per_l
        engine.stats.reset()
        engine.evaluate(mbs_of(ids[mine], labels[mine], [2, 2]))
        split_gathers = L + 2 + (1 if tied else 0)  # E, layers, H (+ E again when tied)
        assert engine.stats.all_gather_count == (L + 2 if resident else split_gathers), \
            (tied, resident, engine.stats)


def case_no_layer_units(rank, world):
    """L = 0 (embedding straight into the head): with a tied weight the embedding unit stays
    gathered from the head phase into the embedding backward and is reduce-scattered once;
    gradients equal the reference for tied / untied x split / resident."""
    ids, labels = padded_batch([8, 5, 7, 6], 32, seed=16)
    for tied, resident in EXPECTED_COUNTS:
        cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=0, max_seq_len=8,
                        tie_embeddings=tied)
        engine, ref = fresh(cfg, state_ratios=[0.3, 0.7], root_resident=resident)
        engine.stats.reset()
        engine.train_step(mbs_of(ids, labels, [1, 3]) if rank == 0 else [])
        gathers = 2 if resident else (2 if tied else 3)  # E (+ H), head phase, E again
        assert (engine.stats.all_gather_count, engine.stats.reduce_scatter_count) == \
            (gathers, 2), (tied, resident, engine.stats)
        assert_grads_close(gather_grads(engine), reference_grads(ref, ids, labels),
                           f"no layers, tied={tied} resident={resident}")


def case_recompute_sees_gathered_params(rank, world):
    """Every unit call (forward and recompute) sees full-shape parameters; l forward + l
    recompute calls per unit (l - 1 recomputes for the last unit); a frozen norm inside each
    unit gets no grad, no optimizer state and keeps its value."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=3, max_seq_len=10,
                    frozen_norm=True)
    engine, ref = fresh(cfg, state_ratios=[1.0, 0.0])
    calls = []
    shapes = {n: p.shape for n, p in ref.blocks[0].named_parameters()}

    def check(module, args):
        for n, p in module.named_parameters():
            assert p.shape == shapes[n], f"{n} has shape {tuple(p.shape)} inside the unit"
        calls.append(module)

    hooks = [b.register_forward_pre_hook(check) for b in engine.staged.model.blocks]
    ids, labels = padded_batch([10, 6, 8, 9, 4, 10], cfg.vocab_size, seed=4)
    lo, hi = (0, 3) if rank == 0 else (3, 6)
    engine.train_step(mbs_of(ids[lo:hi], labels[lo:hi], [1, 1, 1]))
    # 3 units x 3 microbatches x (forward + recompute), minus the last unit's last microbatch,
    # whose forward graph is kept instead of recomputed
    assert len(calls) == 3 * 3 * 2 - 1, len(calls)
    for h in hooks:
        h.remove()
    got = gather_grads(engine)
    assert not any(".ln1." in k for k in got), "frozen norm got a gradient"
    assert_grads_close(got, reference_grads(ref, ids, labels), "frozen norm")
    trainable = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    local = torch.tensor([sum(p.numel() for p in engine.parameters())])
    dist.all_reduce(local)
    assert int(local) == trainable
    opt = torch.optim.AdamW(engine.parameters(), lr=0.1)
    opt.step()
    state_numel = sum(v.numel() for st in opt.state.values() for v in st.values() if v.dim())
    assert state_numel == 2 * sum(p.numel() for p in engine.parameters())
    full = engine.full_state_dict()
    if rank == 0:
        for k, v in ref.state_dict().items():
            if ".ln1." in k:
                torch.testing.assert_close(full[k], v, rtol=0, atol=0)


def case_param_used_by_last_microbatch(rank, world):
    """``rare`` is used only when a microbatch holds token 0; only the last one does."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8,
                    rare_token_id=0)
    ids, labels = padded_batch([8] * 6, cfg.vocab_size, seed=5)  # ids in 1..31
    ids[5, 3] = 0
    engine, ref = fresh(cfg, state_ratios=[0.5, 0.5])
    lo, hi = (0, 6) if rank == 0 else (6, 6)
    engine.train_step(mbs_of(ids[lo:hi], labels[lo:hi], [2, 2, 2]) if rank == 0 else [])
    got = gather_grads(engine)
    assert_grads_close(got, reference_grads(ref, ids, labels), "rare parameter")
    assert float(got["blocks.0.rare"].abs().max()) > 0


def case_no_unit_sized_tensor_in_backward(rank, world):
    """No microbatch's backward allocates a tensor of any unit's trainable size: the unit's
    flat gradient exists before it and the parameter gradients are added into it in place
    (flat_param.py [Note: parameter views while unsharded]; one split of a flat leaf made a
    concatenation per backward). Recompute and kept graphs; tied embeddings, a frozen norm, a
    parameter only the last microbatch uses, an idle rank; gradients equal the reference."""
    from tests.alloc_counts import UnitSizedAllocations

    # vocab 37: the embedding unit's 37·16 + 8·16 = 720 elements match no activation or weight
    # gradient of this model (40 would give 768, the qkv weight's); the head unit (its final
    # norm, 32 elements, the tied weight lives in the embedding unit) is too small to tell
    cfg = ToyConfig(vocab_size=37, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8,
                    tie_embeddings=True, frozen_norm=True, rare_token_id=0)
    ids, labels = padded_batch([8] * 6, cfg.vocab_size, seed=7)
    ids[5, 3] = 0
    for checkpointing in (True, False):
        engine, ref = fresh(cfg, state_ratios=[0.5, 0.5], activation_checkpointing=checkpointing)
        numels = {u.trainable_numel for u in engine.all_units() if u.trainable_numel > 32}
        assert len(numels) == 2, numels  # the layer units' and the embedding unit's
        calls, backward = [], torch.autograd.backward

        def counted(*args, **kwargs):
            with UnitSizedAllocations(numels) as mode:
                backward(*args, **kwargs)
            calls.append(mode.ops)
        torch.autograd.backward = counted
        try:
            engine.train_step(mbs_of(ids, labels, [2, 2, 2]) if rank == 0 else [])
        finally:
            torch.autograd.backward = backward
        what = f"activation_checkpointing={checkpointing}"
        # rank 0: 3 head, 3 x 2 unit, 3 embedding backwards; the idle rank: none
        assert len(calls) == (12 if rank == 0 else 0), (what, len(calls))
        assert all(ops == [] for ops in calls), (what, numels, calls)
        assert_grads_close(gather_grads(engine), reference_grads(ref, ids, labels), what)


def case_clip_norm_uneven(rank, world):
    """The clipped global norm and the clipped grads equal torch's single-process ones."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8,
                    tie_embeddings=True)
    ids, labels = padded_batch([8, 5, 7, 8, 3], cfg.vocab_size, seed=6)
    for ratios in ([0.9, 0.1], [1.0, 0.0], [0.0, 1.0]):
        engine, ref = fresh(cfg, state_ratios=ratios)
        lo, hi = (0, 1) if rank == 0 else (1, 5)
        engine.train_step(mbs_of(ids[lo:hi], labels[lo:hi], [1] * (hi - lo)))
        norm = engine.clip_grad_norm_(0.1)
        loss, _ = ref(ids, labels)
        loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL)
        expected = {n: p.grad for n, p in ref.named_parameters()}
        assert_grads_close(gather_grads(engine), expected, f"clipped grads {ratios}")


def case_state_dict_roundtrip_and_eval(rank, world):
    """load_full_state_dict -> full_state_dict is the identity (tied keys included); evaluate
    gives the reference loss and this rank's logits."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8,
                    tie_embeddings=True)
    engine, ref = fresh(cfg, shard_layout=None, state_ratios=[0.25, 0.75])
    torch.manual_seed(99)
    other = ToyLM(cfg).state_dict()
    engine.load_full_state_dict(other)
    full = engine.full_state_dict()
    if rank == 0:
        assert list(full) == list(ref.state_dict()) and "head.weight" in full
        for k in other:
            torch.testing.assert_close(full[k], other[k], rtol=0, atol=0)
    ref.load_state_dict(other)
    ids, labels = padded_batch([8, 6, 7], cfg.vocab_size, seed=7)
    lo, hi = (0, 2) if rank == 0 else (2, 3)
    out = engine.evaluate(mbs_of(ids[lo:hi], labels[lo:hi], [1] * (hi - lo)))
    with torch.no_grad():
        ref_loss, ref_logits = ref(ids, labels)
    torch.testing.assert_close(out.loss, float(ref_loss), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.cat(out.logits), ref_logits[lo:hi], rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="missing"):
        engine.load_full_state_dict({k: v for k, v in other.items() if k != "wpe.weight"})


def case_eval_head_once_and_logits_released(rank, world):
    """evaluate runs the head ONCE per microbatch; with return_logits=False it keeps no logits
    (each microbatch's logits are gone before the next head runs and after the call); with
    process_logits the raw logits are released per microbatch too. Loss, logits and processed
    predictions equal the single-process reference."""
    import weakref

    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8)
    engine, ref = fresh(cfg, state_ratios=[0.6, 0.4])
    ids, labels = padded_batch([8, 6, 7, 5, 8], cfg.vocab_size, seed=21)
    lo, hi = (0, 3) if rank == 0 else (3, 5)
    mbs = mbs_of(ids[lo:hi], labels[lo:hi], [1] * (hi - lo))
    head_logits, made, alive_at_call = engine.staged.head_logits, [], []

    def counting_head_logits(*args):
        alive_at_call.append(sum(r() is not None for r in made))
        out = head_logits(*args)
        made.append(weakref.ref(out))
        return out

    engine.staged.head_logits = counting_head_logits
    try:
        with torch.no_grad():
            ref_loss, ref_logits = ref(ids, labels)
        for kwargs in (dict(), dict(return_logits=False),
                       dict(process_logits=lambda logits, mb: logits.argmax(-1))):
            made.clear()
            alive_at_call.clear()
            out = engine.evaluate(mbs, **kwargs)
            assert len(made) == len(mbs), (kwargs, len(made))  # one head pass per microbatch
            torch.testing.assert_close(out.loss, float(ref_loss), rtol=RTOL, atol=ATOL)
            if kwargs.get("return_logits", True) is False:
                assert out.logits == []
            if "process_logits" in kwargs:
                assert torch.equal(torch.cat(out.logits), ref_logits[lo:hi].argmax(-1))
            if kwargs:  # no raw logits survive their microbatch
                assert alive_at_call == [0] * len(mbs) and all(r() is None for r in made), kwargs
            else:
                torch.testing.assert_close(torch.cat(out.logits), ref_logits[lo:hi],
                                           rtol=RTOL, atol=ATOL)
    finally:
        del engine.staged.head_logits


def case_all_reduce_fallback(rank, world):
    """The all-reduce-and-slice path gives the same gradients as reduce-scatter."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8)
    ids, labels = padded_batch([8, 5, 7, 6], cfg.vocab_size, seed=8)
    engine, ref = fresh(cfg, state_ratios=[0.8, 0.2], reduce_scatter_fallback=True)
    lo, hi = (0, 3) if rank == 0 else (3, 4)
    engine.train_step(mbs_of(ids[lo:hi], labels[lo:hi], [hi - lo]))
    assert_grads_close(gather_grads(engine), reference_grads(ref, ids, labels), "fallback")


def case_bad_input(rank, world):
    """Bad input raises ValueError on every rank before any collective (no hang)."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8)
    staged = lambda: ToyStaged(ToyLM(cfg))  # noqa: E731
    with pytest.raises(ValueError, match="world size"):
        CephaloEngine(staged(), [1.0])
    with pytest.raises(ValueError, match="sum to 1"):
        CephaloEngine(staged(), [0.5, 0.6])
    with pytest.raises(ValueError, match="non-negative"):
        CephaloEngine(staged(), [1.5, -0.5])
    with pytest.raises(ValueError, match="rows"):
        CephaloEngine(staged(), shard_layout=[[1, 1]])
    numels = [sum(p.numel() for p in b.parameters()) for b in ToyLM(cfg).blocks]
    with pytest.raises(ValueError, match="2 layers, then the embedding and the head unit"):
        CephaloEngine(staged(), shard_layout=[[numels[0], 0], [numels[1], 0], [0, 0]])
    with pytest.raises(ValueError, match="summing to"):
        CephaloEngine(staged(), shard_layout=[[numels[0], 1], [numels[1], 0], [0, 0], [0, 0]])
    mixed = ToyLM(cfg)
    mixed.blocks[1].fc1.double()
    with pytest.raises(ValueError, match="mixes parameter dtypes"):
        CephaloEngine(ToyStaged(mixed))

    class Uncovered(ToyStaged):
        def head_modules(self):
            return super().head_modules()[:-1]

    with pytest.raises(ValueError, match="head.weight"):
        CephaloEngine(Uncovered(ToyLM(cfg)))
    engine, _ = fresh(cfg)
    ids, labels = padded_batch([8], cfg.vocab_size, seed=9)
    with pytest.raises(ValueError, match="no items"):
        engine.train_step(mbs_of(ids, torch.full_like(labels, -100), [1]) if rank == 0 else [])
    engine.train_step(mbs_of(ids, labels, [1]) if rank == 1 else [])  # still in lockstep


def case_accumulate_and_empty_rank_eval(rank, world):
    """Two train_steps without zero_grad ADD their gradients (documented); a rank with no
    microbatches still joins evaluate and gets no logits."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8)
    ids, labels = padded_batch([8, 5, 7, 6], cfg.vocab_size, seed=11)
    engine, ref = fresh(cfg, state_ratios=[0.5, 0.5])
    for _ in range(2):
        engine.train_step(mbs_of(ids, labels, [2, 2]) if rank == 0 else [])
    expected = {k: 2 * v for k, v in reference_grads(ref, ids, labels).items()}
    assert_grads_close(gather_grads(engine), expected, "two steps accumulate")
    out = engine.evaluate(mbs_of(ids, labels, [4]) if rank == 1 else [])
    with torch.no_grad():
        ref_loss, _ = ref(ids, labels)
    torch.testing.assert_close(out.loss, float(ref_loss), rtol=RTOL, atol=ATOL)
    assert len(out.logits) == (1 if rank == 1 else 0)


def case_prefetch_schedule(rank, world):
    """Every stashed tensor the schedule reads was prefetched (start_reload) while it held that
    very tensor, or was stashed by the immediately preceding write (nothing to overlap with):
    on CUDA each microbatch's reload overlaps the previous microbatch's compute, across unit
    boundaries too, and no prefetch is stale. Recorded on CPU, where reloads are no-ops."""
    import hf_cephalo.engine.engine as engine_module
    from hf_cephalo.engine.offload import ActivationStash

    class RecordingStash(ActivationStash):
        log: list = []

        def _put(self, key, item):
            super()._put(key, item)
            self.last_put, self.prefetched = key, getattr(self, "prefetched", {})
            self.prefetched.pop(key, None)

        def start_reload(self, key):
            super().start_reload(key)
            if key in self._store:
                self.prefetched[key] = self._store[key].tensor

        def _load(self, key, item):
            hit = self.prefetched.pop(key, None) is item.tensor
            RecordingStash.log.append((key, hit or key == self.last_put))
            return super()._load(key, item)

    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=3, max_seq_len=8)
    ids, labels = padded_batch([8, 5, 7, 6], cfg.vocab_size, seed=13)
    saved = engine_module.ActivationStash
    engine_module.ActivationStash = RecordingStash
    try:
        for checkpointing in (True, False):
            engine, _ = fresh(cfg, activation_checkpointing=checkpointing)
            for sizes in ([1, 1, 1], [2], [1, 2]):
                RecordingStash.log = []
                engine.train_step(mbs_of(ids, labels, sizes) if rank == 0 else
                                  mbs_of(ids[:1], labels[:1], [1]))
                misses = [key for key, ok in RecordingStash.log if not ok]
                assert RecordingStash.log and not misses, (checkpointing, sizes, misses)
            engine.zero_grad()
    finally:
        engine_module.ActivationStash = saved


def case_offload_bookkeeping(rank, world):
    """The CUDA offload path of the stash (copy out, live tensor, keep, prefetch, stale-prefetch
    drop) run on CPU with copies as clones: gradients still equal the reference, every copy back
    issued is consumed, with one microbatch the forward never copies back (live tensor), and a
    prefetch of a value replaced before it is read is not returned."""
    import hf_cephalo.engine.engine as engine_module
    from hf_cephalo.engine.offload import ActivationStash

    class HostOffloadStash(ActivationStash):
        made: list = []

        def __init__(self, offload, streams, stats=None):
            super().__init__(offload, streams, stats)
            self.offload, self.copies_back, self.unconsumed = True, 0, set()
            HostOffloadStash.made.append(self)

        def _offloadable(self, t):
            return True

        def _copy_out(self, t):
            return t.clone(), None

        def _issue_reload(self, item):
            self.copies_back += 1
            copy = item.tensor.clone()
            self.unconsumed.add(id(copy))
            return copy, None

        def _wait_reload(self, gpu, done, device):
            self.unconsumed.discard(id(gpu))

    stash = HostOffloadStash(True, None)
    old_value, new_value, other = torch.zeros(3), torch.ones(3), torch.full((3,), 2.0)
    stash.start_offload(("a",), old_value)
    stash.start_offload(("b",), other)  # ("a",) is no longer live: a prefetch copies back
    stash.start_reload(("a",))
    stash.start_offload(("a",), new_value)
    stash.start_offload(("b",), other)
    assert torch.equal(stash.pop(("a",)), new_value)

    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=3, max_seq_len=8)
    ids, labels = padded_batch([8, 5, 7, 6, 3, 8], cfg.vocab_size, seed=14)
    saved = engine_module.ActivationStash
    engine_module.ActivationStash = HostOffloadStash
    try:
        for checkpointing in (True, False):
            for sizes in ([1], [1, 1, 1], [2, 1]):
                engine, ref = fresh(cfg, state_ratios=[0.4, 0.6],
                                    activation_checkpointing=checkpointing)
                HostOffloadStash.made = []
                mine = (ids[:sum(sizes)], labels[:sum(sizes)], sizes) if rank == 0 else \
                    (ids[sum(sizes):], labels[sum(sizes):], [2, 1])
                engine.train_step(mbs_of(*mine))
                what = f"host offload ckpt={checkpointing} {sizes}"
                assert_grads_close(gather_grads(engine), reference_grads(
                    ref, ids[:sum(sizes) + 3], labels[:sum(sizes) + 3]), what)
                (stash,) = HostOffloadStash.made
                assert not stash._reloads and not stash.unconsumed, (what, list(stash._reloads))
                if rank == 0 and sizes == [1]:  # backward recompute inputs only (unit 0..L-2)
                    expected = cfg.num_layers - 1 if checkpointing else 0
                    assert stash.copies_back == expected, (what, stash.copies_back)
    finally:
        engine_module.ActivationStash = saved


def case_host_sync_counts(rank, world):
    """Where the schedule makes the host wait for the compute stream ([Note: host waits for
    the compute stream] in engine/offload.py), counted on CPU with the CUDA decision forced:
    without offload once per unit and pass (2 L per step, whatever l), with offload once per
    microbatch boundary ((2 L + 3) l per step: embed, L units, head, L units, embedding
    backward), never per unit. Gradients stay the reference's."""
    import hf_cephalo.engine.engine as engine_module
    from hf_cephalo.engine.offload import ActivationStash

    class CudaDecisionStash(ActivationStash):
        offloading = False

        def __init__(self, offload, streams, stats=None):
            super().__init__(offload, streams, stats)
            self.offload = CudaDecisionStash.offloading  # CPU tensors still stay in place

        @staticmethod
        def _is_cuda(device):
            return True

        def _host_wait(self, device):
            self.stats.host_syncs += 1  # the decision is under test, not the CUDA call

    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=3, max_seq_len=8)
    ids, labels = padded_batch([8, 5, 7, 6], cfg.vocab_size, seed=17)
    L = cfg.num_layers
    saved = engine_module.ActivationStash
    engine_module.ActivationStash = CudaDecisionStash
    try:
        for offloading in (False, True):
            CudaDecisionStash.offloading = offloading
            for checkpointing in (True, False):
                for sizes in ([1], [1, 1, 1]):
                    engine, ref = fresh(cfg, activation_checkpointing=checkpointing)
                    mine = sizes if rank == 0 else []
                    engine.stats.reset()
                    engine.train_step(mbs_of(ids, labels, mine))
                    what = f"offload={offloading} ckpt={checkpointing} l={len(mine)}"
                    expected = (2 * L + 3) * len(mine) if offloading else 2 * L
                    assert engine.stats.host_syncs == expected, (what, engine.stats.host_syncs)
                    n = sum(sizes)
                    assert_grads_close(gather_grads(engine), reference_grads(
                        ref, ids[:n], labels[:n]), what)
    finally:
        engine_module.ActivationStash = saved
    engine.stats.reset()
    engine.evaluate(mbs_of(ids, labels, [2, 2]) if rank == 0 else [])
    assert engine.stats.host_syncs == 0  # CPU: evaluate never waits


def case_bf16_autocast(rank, world):
    """EnginePrecision(compute=bfloat16): with the reference's shapes (one rank, one microbatch) the
    gradient equals single-process autocast training; with an uneven split (3 microbatches on
    two ranks) it is as close to the float64 truth as single-process bf16 training is, and
    measurably not fp32 (bf16 really ran). Other dtypes and non-fp32 parameters are refused
    (float16 with a loss scaler: tests/test_mixed_precision.py)."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8)
    ids, labels = padded_batch([8, 5, 7, 6, 8, 4], cfg.vocab_size, seed=15)
    torch.manual_seed(0)
    model = ToyLM(cfg)
    truth = {k: v.float() for k, v in reference_grads(copy.deepcopy(model).double(), ids,
                                                       labels.clone()).items()}
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, _ = ref(ids, labels)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}

    def run(split):
        engine = CephaloEngine(ToyStaged(copy.deepcopy(model)), [0.6, 0.4],
                               precision=EnginePrecision(torch.bfloat16))
        out = engine.train_step(split)
        return out, gather_grads(engine)

    out, same_shapes = run(mbs_of(ids, labels, [6]) if rank == 0 else [])
    assert_grads_close(same_shapes, ref_grads, "bf16 autocast, reference shapes")
    torch.testing.assert_close(out.loss, float(ref_loss), rtol=RTOL, atol=ATOL)
    out, uneven = run(mbs_of(ids[:4], labels[:4], [1, 3]) if rank == 0 else
                      mbs_of(ids[4:], labels[4:], [2]))

    def rel_err(grads):
        num = sum(float((grads[n] - truth[n]).pow(2).sum()) for n in truth)
        return (num / sum(float(t.pow(2).sum()) for t in truth.values())) ** 0.5

    # measured: both about 3.4e-3 (fp32 would be ~1e-7)
    e_ref, e_uneven = rel_err(ref_grads), rel_err(uneven)
    assert e_ref > 1e-4 and e_uneven > 1e-4, (e_ref, e_uneven)
    assert e_uneven < 3 * e_ref, (e_ref, e_uneven)
    assert abs(out.loss - float(ref_loss)) < 2e-2 * abs(float(ref_loss))
    with pytest.raises(ValueError, match="only torch.bfloat16, torch.float16"):
        CephaloEngine(ToyStaged(ToyLM(cfg)), precision=EnginePrecision(torch.float64))
    with pytest.raises(ValueError, match="fp32 parameters"):
        CephaloEngine(ToyStaged(ToyLM(cfg).double()), precision=EnginePrecision(torch.bfloat16))


class _Boom(RuntimeError):
    pass


def case_exception_mid_step(rank, world):
    """Every rank raises in the backward recompute of unit 1 (unit 0's all-gather in flight,
    root and unit 1 gathered with live gradients): the exception propagates, nothing stays
    gathered or accounted, every shard gradient is dropped, and later steps refuse to run.
    Runs last: the engine is unusable afterwards (by design)."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8)
    ids, labels = padded_batch([8, 5, 7, 6], cfg.vocab_size, seed=12)
    calls = {"unit 1": 0, "armed": False}

    class Failing(ToyStaged):
        def run_unit(self, i, hidden, ctx):
            if i == 1:
                calls["unit 1"] += 1
                if calls["armed"] and calls["unit 1"] == 3:  # forward j=0, kept forward j=1, recompute j=0
                    raise _Boom("injected failure")
            return super().run_unit(i, hidden, ctx)

    torch.manual_seed(0)
    engine = CephaloEngine(Failing(ToyLM(cfg)), [0.7, 0.3])
    mine = mbs_of(ids[2 * rank:2 * rank + 2], labels[2 * rank:2 * rank + 2], [1, 1])
    engine.train_step(mine)  # a good step first: shard grads exist
    assert all(p.grad is not None for p in engine.parameters() if p.numel())
    calls.update({"unit 1": 0, "armed": True})
    with pytest.raises(_Boom):
        engine.train_step(mine)
    assert all(u.state.value == "sharded" for u in engine.all_units())
    assert engine._tracker.param_numel == 0 and engine._tracker.grad_numel == 0
    assert all(p.grad is None for p in engine.parameters())
    assert all(p.numel() == 0 for p in engine.staged.model.parameters())  # placeholders
    with pytest.raises(RuntimeError, match="earlier train_step raised mid-schedule.*_Boom"):
        engine.train_step(mine)
    with pytest.raises(RuntimeError, match="evaluate refused"):
        engine.evaluate(mine)
    # every other collective entry point refuses too (a one-rank failure would hang them)
    from hf_cephalo.engine.checkpoint import load_checkpoint, save_checkpoint
    from hf_cephalo.engine.export import save_pretrained_streamed
    for name, call in (("clip_grad_norm_", lambda: engine.clip_grad_norm_(1.0)),
                       ("full_state_dict", engine.full_state_dict),
                       ("iter_full_units", engine.iter_full_units),
                       ("save_pretrained_streamed",
                        lambda: save_pretrained_streamed(engine, "/nonexistent/hf")),
                       ("load_full_state_dict", lambda: engine.load_full_state_dict({})),
                       ("save_checkpoint", lambda: save_checkpoint(engine, "/nonexistent/ck")),
                       ("load_checkpoint", lambda: load_checkpoint(engine, "/nonexistent/ck"))):
        with pytest.raises(RuntimeError, match=f"{name} refused on rank {rank}: an earlier "
                                               "train_step raised"):
            call()
    for handle in engine._abandoned:  # every rank issued them: they complete
        if hasattr(handle, "work") and handle.work is not None:
            handle.work.wait()


CASES = [case_token_weighting, case_uneven_batches_vs_naive_mean,
         case_collective_counts_and_accounting, case_no_layer_units,
         case_recompute_sees_gathered_params,
         case_param_used_by_last_microbatch, case_no_unit_sized_tensor_in_backward,
         case_clip_norm_uneven,
         case_state_dict_roundtrip_and_eval, case_eval_head_once_and_logits_released,
         case_all_reduce_fallback,
         case_accumulate_and_empty_rank_eval, case_prefetch_schedule,
         case_offload_bookkeeping, case_host_sync_counts, case_bf16_autocast, case_bad_input,
         case_exception_mid_step]


def semantics_worker(rank, world):
    done = []
    for case in CASES:
        case(rank, world)
        done.append(case.__name__)
    return done


@test_timeout(35)
def test_engine_semantics_two_ranks():
    names = [c.__name__ for c in CASES]
    assert run_ranks(semantics_worker, 2, timeout_s=budget_s(35)) == [names, names]


def dropout_worker(rank, world):
    """One rank, one microbatch: the engine consumes the RNG in the order of a plain forward,
    so with the same seed its gradient equals the reference's only if the recompute replays
    the forward's dropout masks."""
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=3, max_seq_len=8,
                    dropout=0.3)
    ids, labels = padded_batch([8, 6, 7], cfg.vocab_size, seed=10)
    engine, ref = fresh(cfg)
    torch.manual_seed(123)
    engine.train_step(mbs_of(ids, labels, [3]))
    torch.manual_seed(123)
    expected = reference_grads(ref, ids, labels)
    assert_grads_close(gather_grads(engine), expected, "dropout replay")
    torch.manual_seed(124)
    assert float(F.dropout(torch.ones(4), 0.3).sum()) >= 0  # RNG still usable after fork_rng
    return True


@test_timeout(20)
def test_dropout_replay_one_rank():
    assert run_ranks(dropout_worker, 1, timeout_s=budget_s(20)) == [True]
