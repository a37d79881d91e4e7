"""In-memory re-layout of r_i (``hf_cephalo.engine.relayout``) at a step boundary.

Two process groups (2 and 3 gloo ranks) loop over the sub-cases; the 2-rank group also runs
CephaloTrainer twice.

* Exactness: a run whose r_i switches at step SWITCH_AT (a rank going to, or coming from, a
  zero-size shard; one case also changes b_i / m_i / l_i; tied embeddings; frozen norms; two
  AdamW param groups) gives the per-step losses and final parameters of the same run without
  the switch and of the single-process full-batch reference (fp32, rtol 1e-5 / atol 1e-6).
* Bit for bit: right after the re-layout, every rank's parameter shards (trainable and frozen)
  and AdamW state (exp_avg, exp_avg_sq, step) equal (``torch.equal``) those of an engine built
  for the new plan that loaded a checkpoint saved just before; the next steps then give equal
  losses and shards too. A persisting gradient moves exactly as well, and so does the frozen
  bf16 base of a LoRA model (2 ranks, in its own dtype).
* Bytes and memory: each rank's counted all-to-all bytes equal the ideal (the elements whose
  owner changes, computed here from the two layouts), the peak of new shards alive equals one
  unit's shard-set on that rank (not the model's).
* Bad input: another world size, another model, not a Plan, mid-step: errors before any
  collective (the collective counters do not move); ranks passing different plans: the same
  ValueError on every rank, nothing moved; afterwards a re-layout still works (no hang).
* Trainer: ``trainer.session.relayout_state`` from a callback at step 2 (AdamW through
  Accelerate, a linear LR schedule, weight decay masks): same losses and parameters as the
  run without the switch; the trainer and the engine hold the new plan; the scheduler and
  the wrapped optimizer still point at the same optimizer.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest
import torch

from tests.dist_utils import budget_s, portable, run_ranks, test_timeout

RTOL, ATOL = 1e-5, 1e-6
LR, WD, MAX_NORM = 1e-3, 0.01, 1.0
STEPS, SWITCH_AT = 5, 2
# seconds per process group, measured on 2 shared cores at load ~10 (44 s and 25 s):
# [Note: test time budgets] in tests/dist_utils.py
JOB2_S, JOB3_S = 45.0, 30.0
pytestmark = test_timeout(JOB2_S, JOB3_S)


class Case(NamedTuple):
    """One switch: the model's options and the plans before / after it, each as
    (batch sizes b_i, microbatch sizes m_i, state ratios r_i[, root_resident])."""

    name: str
    tie: bool
    frozen_norm: bool
    old: tuple
    new: tuple


CASES = {
    2: [Case("to_zero", False, True, ([3, 2], [2, 1], [0.5, 0.5]), ([3, 2], [2, 1], [1.0, 0.0])),
        Case("from_zero_new_batches_resident_root", True, False, ([2, 3], [1, 2], [0.0, 1.0]),
             ([4, 1], [2, 1], [0.7, 0.3], True))],
    3: [Case("to_zero", True, True, ([3, 2, 1], [1, 2, 1], [0.5, 0.3, 0.2]),
             ([3, 2, 1], [1, 2, 1], [0.0, 0.4, 0.6])),
        Case("from_zero_new_batches", False, False, ([1, 2, 3], [1, 1, 2], [0.0, 0.4, 0.6]),
             ([2, 2, 2], [2, 1, 1], [0.2, 0.2, 0.6]))],
}


# ---- helpers (run inside the ranks) -------------------------------------------------------------
def _plan(spec):
    from hf_cephalo.planner import Plan

    return Plan.from_ratios(*spec[:3], root_resident=bool(spec[3:] and spec[3]))


def _model(case: Case, seed: int):
    from hf_cephalo.models.toy import ToyConfig, ToyLM

    torch.manual_seed(seed)
    return ToyLM(ToyConfig(vocab_size=24, hidden_size=8, num_heads=2, num_layers=2, mlp_ratio=2,
                           max_seq_len=8, tie_embeddings=case.tie, frozen_norm=case.frozen_norm))


def _setup(case: Case, plan, seed: int):
    """Engine for ``plan``'s r_i + AdamW with two param groups: the layers decay, the root
    units do not."""
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models.toy import ToyStaged

    engine = CephaloEngine(ToyStaged(_model(case, seed)), plan.state_ratios,
                           root_resident=plan.root_resident)
    params = engine.parameters()
    layers = params[:engine.num_units]
    opt = torch.optim.AdamW([{"params": layers, "weight_decay": WD},
                             {"params": params[engine.num_units:], "weight_decay": 0.0}], lr=LR)
    return engine, opt


def _batches(case: Case, total: int):
    from tests.test_engine_parity import make_batch

    gen = torch.Generator().manual_seed(len(case.name))
    return [make_batch(gen, total, 6, 24) for _ in range(STEPS)]


def _train(engine, opt, batches, steps, plan_of):
    from tests.test_engine_parity import split_microbatches

    losses = []
    for step in steps:
        plan = plan_of()
        ids, labels = batches[step]
        out = engine.train_step(split_microbatches(ids, labels, plan.batch_sizes,
                                                   plan.microbatch_sizes, engine.rank))
        engine.clip_grad_norm_(MAX_NORM)
        opt.step()
        engine.zero_grad()
        losses.append(out.loss)
    return losses


def _reference(case: Case, batches):
    from tests.test_engine_parity import reference_step

    ref = _model(case, 0)
    decay = [p for p in ref.blocks.parameters()]
    ids_decay = {id(p) for p in decay}
    rest = [p for p in ref.parameters() if id(p) not in ids_decay]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": rest, "weight_decay": 0.0}], lr=LR)
    losses = [reference_step(ref, opt, ids, labels, MAX_NORM)[0] for ids, labels in batches]
    return losses, {k: v.clone() for k, v in ref.state_dict().items()}


def _local(engine, opt):
    """This rank's shards and optimizer state, per unit (clones)."""
    out = []
    for unit, p in zip(engine.all_units(), engine.parameters()):
        out.append(dict(param=p.detach().clone(), frozen=unit.frozen.local.clone(),
                        grad=None if p.grad is None else p.grad.clone(),
                        state={k: v.clone() for k, v in opt.state.get(p, {}).items()}))
    return out


def _mismatches(got, want) -> list[str]:
    """Names of the tensors that are not torch.equal (bit for bit) between two ``_local``."""
    bad = []
    for u, (g, w) in enumerate(zip(got, want)):
        for key in ("param", "frozen"):
            if g[key].dtype != w[key].dtype or not torch.equal(g[key], w[key]):
                bad.append(f"unit {u} {key}")
        if g["state"].keys() != w["state"].keys():
            bad.append(f"unit {u} state keys {sorted(g['state'])} vs {sorted(w['state'])}")
        for key in w["state"]:
            a, b = g["state"].get(key), w["state"][key]
            if a is None or a.dtype != b.dtype or a.device != b.device or not torch.equal(a, b):
                bad.append(f"unit {u} state {key}")
    return bad


def _ideal(rows_old, rows_new, units, rank: int, num_trainable_tensors: int) -> dict:
    """The bytes whose owner changes (sent / received by ``rank``) and one unit's largest new
    shard-set on ``rank``, from the two layouts alone (element owner arrays)."""
    from hf_cephalo.engine.flat_param import split_unit_row

    sent = received = peak = 0
    for old, new, unit in zip(rows_old, rows_new, units):
        if old == new:
            continue
        shard_set = 0
        for index, part, tensors in ((0, unit.trainable, num_trainable_tensors),
                                     (1, unit.frozen, 1)):
            world = torch.arange(len(old))
            was = torch.repeat_interleave(
                world, torch.tensor(split_unit_row(old, unit.trainable_numel)[index]))
            now = torch.repeat_interleave(
                world, torch.tensor(split_unit_row(new, unit.trainable_numel)[index]))
            size = tensors * part.element_size
            sent += int(((was == rank) & (now != rank)).sum()) * size
            received += int(((now == rank) & (was != rank)).sum()) * size
            shard_set += int((now == rank).sum()) * size
        peak = max(peak, shard_set)
    return dict(sent=sent, received=received, peak=peak)


def _gathered(engine, opt) -> list | None:
    """Rank 0: per unit the full trainable parameter, gradient and optimizer tensors (shards
    concatenated in rank order) and the frozen part; None elsewhere."""
    import torch.distributed as dist

    everyone = [None] * engine.world_size
    dist.all_gather_object(everyone, _local(engine, opt))
    if engine.rank != 0:
        return None
    out = []
    for u in range(len(everyone[0])):
        shards = [ranks[u] for ranks in everyone]
        full = {key: torch.cat([s[key] for s in shards]) for key in ("param", "frozen", "grad")
                if shards[0][key] is not None}
        for key in shards[0]["state"]:
            full[key] = shards[0]["state"][key] if key == "step" else \
                torch.cat([s["state"][key] for s in shards])
        out.append(full)
    return out


# ---- sub-cases ----------------------------------------------------------------------------------
def _switch_case(rank, world, case: Case, root: str) -> dict:
    from hf_cephalo.engine import checkpoint as ckpt
    from hf_cephalo.runtime.session import plan_layout, relayout_onto_plan

    old, new = _plan(case.old), _plan(case.new)
    batches = _batches(case, old.global_batch_size)
    engine, opt = _setup(case, old, seed=0)
    losses = _train(engine, opt, batches, range(SWITCH_AT), lambda: old)
    directory = os.path.join(root, f"{world}-{case.name}")
    ckpt.save_checkpoint(engine, directory, opt)
    rows_old = [list(u.numel_per_rank) for u in engine.all_units()]
    engine.stats.reset()
    relayout_onto_plan(engine, opt, new)
    stats = engine.stats.as_dict()
    rows_new = [list(u.numel_per_rank) for u in engine.all_units()]
    ideal = _ideal(rows_old, rows_new, engine.all_units(), rank, 3)
    twin, twin_opt = _setup(case, new, seed=1)  # other weights: the load must matter
    ckpt.load_sharded(twin, directory)
    ckpt.load_sharded_optimizer(twin, twin_opt, directory)
    at_switch = _mismatches(_local(engine, opt), _local(twin, twin_opt))
    holds_plan = rows_new == plan_layout(engine, new) and \
        engine.root.resident is new.root_resident
    losses += _train(engine, opt, batches, range(SWITCH_AT, STEPS), lambda: new)
    twin_losses = _train(twin, twin_opt, batches, range(SWITCH_AT, STEPS), lambda: new)
    after = _mismatches(_local(engine, opt), _local(twin, twin_opt))
    final = engine.full_state_dict()
    static, static_opt = _setup(case, old, seed=0)
    static_losses = _train(static, static_opt, batches, range(STEPS), lambda: old)
    static_final = static.full_state_dict()
    ref_losses, ref_final = _reference(case, batches)
    return dict(losses=losses, twin_losses=twin_losses, static_losses=static_losses,
                ref_losses=ref_losses, final=final, static_final=static_final,
                ref_final=ref_final if rank == 0 else None, at_switch=at_switch, after=after,
                holds_plan=holds_plan, rows_old=rows_old, rows_new=rows_new, stats=stats,
                ideal=ideal, state_bytes=_state_bytes(_local(engine, opt)))


def _state_bytes(local) -> int:
    """Bytes of this rank's training state in a ``_local`` snapshot (shards + optimizer)."""
    return sum(t.numel() * t.element_size() for s in local
               for t in (s["param"], s["frozen"], *s["state"].values()))


def _grad_case(rank, world) -> dict:
    """A gradient that persists (train_step without the optimizer step) moves exactly."""
    from hf_cephalo.runtime.session import relayout_onto_plan

    case = CASES[world][0]
    old, new = _plan(case.old), _plan(case.new)
    batches = _batches(case, old.global_batch_size)
    engine, opt = _setup(case, old, seed=0)
    _train(engine, opt, batches, range(1), lambda: old)
    from tests.test_engine_parity import split_microbatches

    ids, labels = batches[1]
    engine.train_step(split_microbatches(ids, labels, old.batch_sizes, old.microbatch_sizes, rank))
    before = _gathered(engine, opt)
    relayout_onto_plan(engine, opt, new)
    after = _gathered(engine, opt)
    if rank != 0:
        return {}
    bad = [f"unit {u} {k}" for u, (b, a) in enumerate(zip(before, after)) for k in b
           if k not in a or not torch.equal(a[k], b[k])]
    return dict(mismatches=bad, keys=sorted(before[0]))


def _bad_input(rank, world) -> dict:
    from hf_cephalo.planner import Plan
    from hf_cephalo.runtime.session import relayout_onto_plan

    case = CASES[world][0]
    old = _plan(case.old)
    engine, opt = _setup(case, old, seed=0)
    _train(engine, opt, _batches(case, old.global_batch_size), range(1), lambda: old)
    wrong_model = _plan(case.new)
    wrong_model.model = {"name": "other", "num_units": 7, "params_per_unit": 10,
                         "params_other": 3}
    errors, silent = {}, {}
    rows = [list(u.numel_per_rank) for u in engine.all_units()]
    attempts = [("world_size", Plan.even(world + 1, 6)), ("model", wrong_model),
                ("not_a_plan", {"ranks": []}), ("mid_step", _plan(case.new)),
                ("different_plans", Plan.from_ratios(
                    case.new[0], case.new[1], [1.0 if r == rank else 0.0 for r in range(world)]))]
    for name, plan in attempts:
        if name == "mid_step":
            engine.units[0].start_unshard()  # an all-gather in flight, as inside a step
        before = engine.stats.as_dict()
        try:
            relayout_onto_plan(engine, opt, plan)
            errors[name] = None
        except (ValueError, TypeError, RuntimeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
        after = engine.stats.as_dict()
        silent[name] = after == before  # no collective of the engine's was issued
        if name == "mid_step":
            engine.units[0].wait_unshard(requires_grad=False)
            engine.units[0].reshard()
    unmoved = rows == [list(u.numel_per_rank) for u in engine.all_units()]
    new = _plan(case.new)
    relayout_onto_plan(engine, opt, new)  # still in step with the other ranks
    _train(engine, opt, _batches(case, old.global_batch_size), range(1, 2), lambda: new)
    return dict(errors=errors, silent=silent, unmoved=unmoved,
                moved_after=engine.stats.relayout_count > 0)


def _lora_case(rank, world, root) -> dict:
    """LoRA on a bf16 base (tests/test_lora.py's model): the frozen bf16 shards move in their
    own dtype; bit for bit equal to save + resume onto the new plan, then one more step each."""
    from hf_cephalo.engine import checkpoint as ckpt
    from hf_cephalo.runtime.session import relayout_onto_plan
    from tests import test_lora as lora

    engine, opt, sizes, micro = lora._setup("llama_bf16", "two")
    lora._train(engine, opt, sizes, micro, "llama_bf16", range(2))
    directory = os.path.join(root, "lora")
    ckpt.save_checkpoint(engine, directory, opt)
    new = _plan(lora.PLANS["two_idle"])
    relayout_onto_plan(engine, opt, new)
    twin, twin_opt, *_ = lora._setup("llama_bf16", "two_idle")
    ckpt.load_checkpoint(twin, directory, twin_opt)
    at_switch = _mismatches(_local(engine, opt), _local(twin, twin_opt))
    more = [lora._train(e, o, new.batch_sizes, new.microbatch_sizes, "llama_bf16", range(2, 3))
            for e, o in ((engine, opt), (twin, twin_opt))]
    return dict(at_switch=at_switch, after=_mismatches(_local(engine, opt), _local(twin, twin_opt)),
                losses=more, frozen_dtypes=sorted({str(u.frozen.dtype) for u in engine.all_units()
                                                   if u.frozen.numel}),
                moved_frozen=any(u.frozen.numel and u.frozen_per_rank[0] == 0 and
                                 u.frozen.numel > 0 for u in engine.all_units()))


def _engine_worker(rank, world, root):
    results = {case.name: _switch_case(rank, world, case, root) for case in CASES[world]}
    results["grad"] = _grad_case(rank, world)
    results["bad_input"] = _bad_input(rank, world)
    if world == 2:
        results["lora_bf16"] = _lora_case(rank, world, root)
        results["trainer"] = {name: _trainer_run(rank, world, os.path.join(root, name), switch)
                              for name, switch in (("static", False), ("switched", True))}
    return portable(results, to_numpy=True)


# ---- trainer ------------------------------------------------------------------------------------
TRAINER_PLANS = (([2, 2], [1, 2], [0.7, 0.3]), ([2, 2], [1, 2], [0.0, 1.0]))


def _trainer_run(rank, world, out_dir, switch: bool) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    from transformers import TrainerCallback

    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from tests.models_fixtures import build

    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(12):
        ids = torch.randint(1, 97, (12,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    new_plan = _plan(TRAINER_PLANS[1])

    class SwitchAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if switch and state.global_step == 2:
                trainer.session.relayout_state(new_plan)

    # adam_epsilon 1e-4: see test_checkpoint_trainer.py (runs that reduce in another order)
    args = CephaloTrainingArguments(
        output_dir=out_dir, report_to="none", learning_rate=3e-3, adam_epsilon=1e-4,
        weight_decay=0.1, warmup_steps=1, max_steps=4, logging_steps=1, save_strategy="no",
        seed=5, max_grad_norm=1.0, disable_tqdm=True)
    trainer = CephaloTrainer(model=build("llama").train(), args=args,
                             plan=_plan(TRAINER_PLANS[0]), train_dataset=rows,
                             data_collator=lambda rs: {k: torch.stack([r[k] for r in rs])
                                                       for k in rs[0]},
                             callbacks=[SwitchAt()])
    trainer.train()
    from hf_cephalo.runtime.session import plan_layout

    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    shards = trainer.engine.param_shards
    units = trainer.engine.all_units()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return dict(losses=[h["loss"] for h in logs], params=trainer.engine.full_state_dict(),
                holds_plan=(trainer.plan is new_plan and
                            plan_layout(trainer.engine, new_plan) ==
                            [list(u.numel_per_rank) for u in units]) if switch else
                trainer.plan.state_ratios == TRAINER_PLANS[0][2],
                same_optimizer=_unwrap(_unwrap(trainer.lr_scheduler, "scheduler").optimizer,
                                       "optimizer") is inner and
                sorted(id(p) for g in inner.param_groups for p in g["params"]) ==
                sorted(id(p) for p in shards.params),
                # every per-parameter shard views its slice of the (re-laid) unit shard
                masks_fit=all(p.numel() == s.hi - s.lo and (p.numel() == 0 or p.data_ptr() ==
                              units[s.unit].shard_param[s.lo:s.hi].data_ptr())
                              for p, s in zip(shards.params, shards.slices)),
                moved=trainer.engine.stats.relayout_count,
                rows=[list(u.numel_per_rank) for u in trainer.engine.all_units()])


def _unwrap(obj, attr: str):
    """What Accelerate's wrapper (AcceleratedOptimizer / AcceleratedScheduler) wraps."""
    return getattr(obj, attr, obj)


# ---- tests --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("relayout"))
    out = {2: run_ranks(_engine_worker, 2, root, timeout_s=budget_s(JOB2_S)),
           3: run_ranks(_engine_worker, 3, root, timeout_s=budget_s(JOB3_S))}
    return {w: [portable(r, to_numpy=False) for r in res] for w, res in out.items()}


def _close(got, want):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64),
                               torch.as_tensor(want, dtype=torch.float64), rtol=RTOL, atol=ATOL)


def _params_close(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=key)


ALL = [(w, c.name) for w in CASES for c in CASES[w]]


@pytest.mark.parametrize("world,name", ALL)
def test_switch_matches_static_run_and_reference(runs, world, name):
    r0 = runs[world][0][name]
    assert r0["rows_old"] != r0["rows_new"]
    assert any(0 in (row[0], row[-1]) for row in r0["rows_old"] + r0["rows_new"])
    _close(r0["losses"], r0["static_losses"])
    _close(r0["losses"], r0["ref_losses"])
    _params_close(r0["final"], r0["static_final"])
    _params_close(r0["final"], r0["ref_final"])
    assert all(r[name]["holds_plan"] for r in runs[world])


@pytest.mark.parametrize("world,name", ALL)
def test_relayout_equals_save_and_resume_bit_for_bit(runs, world, name):
    for rank, result in enumerate(runs[world]):
        got = result[name]
        assert got["at_switch"] == [], f"rank {rank}: {got['at_switch']}"
        assert got["after"] == [], f"rank {rank}: {got['after']}"
        assert got["losses"][SWITCH_AT:] == got["twin_losses"]  # exactly the same floats


@pytest.mark.parametrize("world,name", ALL)
def test_bytes_are_the_ideal_and_memory_one_unit(runs, world, name):
    for result in runs[world]:
        stats, ideal = result[name]["stats"], result[name]["ideal"]
        assert stats["relayout_sent_bytes"] == ideal["sent"]
        assert stats["relayout_received_bytes"] == ideal["received"]
        assert stats["peak_relayout_buffer_bytes"] == ideal["peak"]
        # one unit's new shard-set, well under this rank's whole training state
        assert ideal["peak"] <= 0.6 * result[name]["state_bytes"] or ideal["peak"] == 0
        # nothing else communicated: only the one metadata exchange (all_gather_object is not
        # counted) and the all-to-alls
        assert stats["all_gather_count"] == stats["reduce_scatter_count"] == 0
    total_sent = sum(r[name]["stats"]["relayout_sent_bytes"] for r in runs[world])
    assert total_sent == sum(r[name]["stats"]["relayout_received_bytes"] for r in runs[world]) > 0


@pytest.mark.parametrize("world", sorted(CASES))
def test_persisting_gradient_moves_exactly(runs, world):
    got = runs[world][0]["grad"]
    assert "grad" in got["keys"] and "exp_avg" in got["keys"]
    assert got["mismatches"] == []


@pytest.mark.parametrize("world", sorted(CASES))
def test_bad_input_is_refused_before_any_collective(runs, world):
    for rank, result in enumerate(runs[world]):
        errors, silent = result["bad_input"]["errors"], result["bad_input"]["silent"]
        assert errors["world_size"].startswith("ValueError") and \
            f"world size {world + 1}" in errors["world_size"] and \
            f"{world} ranks" in errors["world_size"]
        assert errors["model"].startswith("ValueError") and "'other'" in errors["model"]
        assert errors["not_a_plan"].startswith("TypeError") and "Plan" in errors["not_a_plan"]
        assert errors["mid_step"].startswith("RuntimeError") and "mid-step" in errors["mid_step"]
        assert errors["different_plans"].startswith("ValueError") and \
            "different layouts" in errors["different_plans"]
        assert all(silent.values()), silent
        assert result["bad_input"]["unmoved"] and result["bad_input"]["moved_after"]
    # the same message on every rank for the disagreement found by the exchange
    assert len({r["bad_input"]["errors"]["different_plans"] for r in runs[world]}) == 1


def test_lora_bf16_base_relayout_equals_save_and_resume(runs):
    for rank, result in enumerate(runs[2]):
        got = result["lora_bf16"]
        assert got["frozen_dtypes"] == ["torch.bfloat16"] and got["moved_frozen"]
        assert got["at_switch"] == [] and got["after"] == [], (rank, got)
        assert got["losses"][0] == got["losses"][1]


def test_trainer_relayout_matches_static_run(runs):
    static, switched = (runs[2][0]["trainer"][k] for k in ("static", "switched"))
    assert len(switched["losses"]) == 4
    _close(switched["losses"], static["losses"])
    _params_close(switched["params"], static["params"])
    for result in runs[2]:
        got = result["trainer"]["switched"]
        assert got["holds_plan"] and got["same_optimizer"] and got["masks_fit"]
        assert got["moved"] > 0 and result["trainer"]["static"]["moved"] == 0
        assert all(row[0] == 0 for row in got["rows"])  # rank 0 holds no state after the switch
