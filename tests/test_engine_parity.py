"""Engine parity: >= 100 random plans vs a single-process full-batch reference (fp32).

Each plan draws per-rank batch sizes b_i (zeros allowed), microbatch sizes m_i, and either
state ratios r_i (zeros allowed, laid out by the planner) or an explicit random per-unit
element layout (zero-size shards, odd splits); about 30% of the plans run without activation
checkpointing (kept graphs, storage freed and refilled across reshard); about half tie the
embeddings (the embedding unit then gets two reduce-scatters per step); about 25% keep the root
resident (``root_resident=True``), the rest gather it around its uses. After 3 AdamW steps
(some plans with global-norm clipping) the gathered parameters, the per-step losses and the
clip norms must equal the reference at rtol 1e-5, atol 1e-6 (fp32; 3 float64 plans per group
at 1e-10 / 1e-12). Three process groups (2, 3, 4 ranks) loop over the plans; the 2- and
3-rank groups also run fixed plans of a toy whose layer unit makes a side input every later
unit reads (``memory_from``, an encoder output's shape: ``made_side_plans``), with an uneven
plan on 2 ranks and an idle rank on 3, with and without activation checkpointing.
"""

from __future__ import annotations

import copy
import random

import torch

from hf_cephalo.engine import CephaloEngine
from hf_cephalo.models.toy import ToyConfig, ToyLM, ToyStaged
from tests.dist_utils import budget_s, run_ranks, test_timeout

RTOL, ATOL = 1e-5, 1e-6
# float64 plans show the engine is exact beyond fp32 rounding (different summation order of
# microbatches is the only difference from the reference).
RTOL64, ATOL64 = 1e-10, 1e-12
LR, WD = 1e-3, 0.01  # torch.optim.AdamW's default lr


def make_batch(gen: torch.Generator, batch: int, seq: int, vocab: int, pad_frac=0.5):
    """(B, S) token ids and labels; some rows right-padded with label -100."""
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = ids.clone()
    for b in range(batch):
        if torch.rand((), generator=gen) < pad_frac:
            length = int(torch.randint(2, seq + 1, (), generator=gen))
            labels[b, length:] = -100
    return ids, labels


def split_microbatches(ids, labels, sizes_b, sizes_m, rank):
    """This rank's slice of the global batch, cut into microbatches of m_i (last may be short)."""
    start = sum(sizes_b[:rank])
    mine_ids, mine_labels = ids[start:start + sizes_b[rank]], labels[start:start + sizes_b[rank]]
    m = sizes_m[rank]
    return [{"input_ids": mine_ids[k:k + m], "labels": mine_labels[k:k + m]}
            for k in range(0, sizes_b[rank], m)]


def random_layout(rng: random.Random, numel: int, world: int) -> list[int]:
    cuts = sorted(rng.randint(0, numel) for _ in range(world - 1))
    bounds = [0] + cuts + [numel]
    sizes = [bounds[r + 1] - bounds[r] for r in range(world)]
    rng.shuffle(sizes)
    return sizes


def unit_numels(model: ToyLM) -> list[int]:
    """Engine order: layers, the embedding unit, the head unit (a tied weight in the first)."""
    embed = torch.nn.ModuleList([model.wte, model.wpe])
    units = list(model.blocks) + [embed, torch.nn.ModuleList([model.ln_f, model.head])]
    sizes = [sum(p.numel() for p in {id(p): p for p in u.parameters()}.values()) for u in units]
    if model.cfg.tie_embeddings:
        sizes[-1] -= model.head.weight.numel()
    return sizes


def reference_step(ref: ToyLM, opt, ids, labels, max_norm):
    opt.zero_grad(set_to_none=True)
    loss, _ = ref(ids, labels)
    loss.backward()
    norm = None
    if max_norm is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    opt.step()
    return float(loss.detach()), norm


def draw_plan(rng: random.Random, world: int, dtype=torch.float32) -> dict:
    sizes_b = [rng.choice([0, 1, 2, 3, 5]) for _ in range(world)]
    if sum(sizes_b) == 0:
        sizes_b[rng.randrange(world)] = 2
    sizes_m = [rng.randint(1, max(1, b)) for b in sizes_b]
    ratios = [rng.choice([0.0, 1.0, 2.0, 3.0]) for _ in range(world)]
    if sum(ratios) == 0:
        ratios[rng.randrange(world)] = 1.0
    ratios = [r / sum(ratios) for r in ratios]
    cfg = ToyConfig(vocab_size=24, hidden_size=8, num_heads=2, num_layers=rng.randint(1, 3),
                    mlp_ratio=2, max_seq_len=8, tie_embeddings=rng.random() < 0.5,
                    frozen_norm=rng.random() < 0.3)
    return dict(sizes_b=sizes_b, sizes_m=sizes_m, ratios=ratios, cfg=cfg,
                explicit_layout=rng.random() < 0.5, seq=rng.randint(3, 8),
                max_norm=rng.choice([None, 0.5, 100.0]), seed=rng.randrange(1 << 30),
                dtype=dtype, activation_checkpointing=rng.random() < 0.7,
                root_resident=rng.random() < 0.25)


def made_side_plans(world: int) -> list[dict]:
    """Plans whose toy's unit ``memory_from`` makes a side input that it and every later unit
    read (engine/schedule.py [Note: side inputs]): on 2 ranks uneven b / m / r, on 3 ranks an
    idle rank (b = 0) with a zero state share; the making unit first, in the middle and last
    (the kept graph of the last unit's last microbatch), recomputed or kept."""
    def plan(sizes_b, sizes_m, ratios, layers, memory_from, ckpt, tied, resident, seed):
        cfg = ToyConfig(vocab_size=24, hidden_size=8, num_heads=2, num_layers=layers,
                        mlp_ratio=2, max_seq_len=8, tie_embeddings=tied,
                        memory_from=memory_from)
        return dict(sizes_b=sizes_b, sizes_m=sizes_m, ratios=ratios, cfg=cfg,
                    explicit_layout=False, seq=6, max_norm=None, seed=seed,
                    dtype=torch.float32, activation_checkpointing=ckpt,
                    root_resident=resident)
    if world == 2:
        return [plan([4, 1], [3, 1], [0.7, 0.3], 3, 1, True, False, False, 11),
                plan([3, 2], [1, 2], [0.4, 0.6], 3, 2, False, True, False, 12)]
    if world == 3:
        return [plan([2, 0, 3], [1, 1, 2], [0.5, 0.0, 0.5], 2, 0, True, False, False, 13),
                plan([3, 1, 0], [2, 1, 1], [0.3, 0.3, 0.4], 3, 1, False, False, True, 14)]
    return []


def run_plan(rank: int, world: int, plan: dict) -> None:
    torch.manual_seed(plan["seed"])
    model = ToyLM(plan["cfg"]).to(plan["dtype"])
    rtol, atol = (RTOL64, ATOL64) if plan["dtype"] == torch.float64 else (RTOL, ATOL)
    ref = copy.deepcopy(model)
    layout = None
    if plan["explicit_layout"]:
        lrng = random.Random(plan["seed"])
        layout = [random_layout(lrng, n, world) for n in unit_numels(model)]
    engine = CephaloEngine(ToyStaged(model), plan["ratios"], shard_layout=layout,
                           activation_checkpointing=plan["activation_checkpointing"],
                           root_resident=plan["root_resident"])
    opt = torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=WD)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    gen = torch.Generator().manual_seed(plan["seed"] + 1)
    for step in range(3):
        ids, labels = make_batch(gen, sum(plan["sizes_b"]), plan["seq"], plan["cfg"].vocab_size)
        mbs = split_microbatches(ids, labels, plan["sizes_b"], plan["sizes_m"], rank)
        out = engine.train_step(mbs)
        norm = engine.clip_grad_norm_(plan["max_norm"]) if plan["max_norm"] is not None else None
        opt.step()
        engine.zero_grad()
        ref_loss, ref_norm = reference_step(ref, ref_opt, ids, labels, plan["max_norm"])
        torch.testing.assert_close(out.loss, ref_loss, rtol=rtol, atol=atol,
                                   msg=lambda m: f"step {step} loss, plan {plan}: {m}")
        if norm is not None:
            torch.testing.assert_close(float(norm), ref_norm, rtol=rtol, atol=atol)
    full = engine.full_state_dict()
    if rank == 0:
        expected = ref.state_dict()
        assert list(full) == list(expected), (list(full), list(expected))
        for key, value in expected.items():
            torch.testing.assert_close(full[key], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{key} after 3 steps, plan {plan}: {m}")


def parity_worker(rank: int, world: int, num_plans: int, seed: int) -> int:
    rng = random.Random(seed)
    plans = [draw_plan(rng, world) for _ in range(num_plans)]
    plans += [draw_plan(rng, world, torch.float64) for _ in range(3)]
    plans += made_side_plans(world)
    for plan in plans:
        run_plan(rank, world, plan)
    return len(plans)


@test_timeout(25)
def test_parity_two_ranks():
    assert run_ranks(parity_worker, 2, 35, 1234, timeout_s=budget_s(25)) == [40, 40]


@test_timeout(40)
def test_parity_three_ranks():
    assert run_ranks(parity_worker, 3, 34, 5678, timeout_s=budget_s(40)) == [39] * 3


@test_timeout(50)
def test_parity_four_ranks():
    assert run_ranks(parity_worker, 4, 34, 91011, timeout_s=budget_s(50)) == [37] * 4
