"""GRPO benchmark: whole GRPO steps, stock GRPOTrainer (FSDP2) vs CephaloGRPOTrainer even / planned.

Two gloo ranks on CPU emulate a 1x and a 3x slower device. Every way trains the same Qwen3-shaped
model (built from its config: ``--layers`` x ``--hidden``) on the same task as
examples/train_grpo.py (its prompts, character tokenizer and two reward functions), with the
same GRPOConfig: a generation batch of ``--global-batch-size`` rows (``--generations`` per
prompt), ``--new`` new tokens at most, temperature 0.9, ``beta`` 0.04 (a reference model: one
forward-only scoring pass per step), fp32, AdamW. One step = generation + rewards + the
reference log-probabilities + the training step. Ways, all in ONE run of the same two ranks:

  (a) stock ``GRPOTrainer`` on accelerate's FSDP2 path with the even split FSDP2 needs (B / 2
      rows per rank), its own generation (``model.generate`` on the FSDP2 model, one all-gather
      per layer per token, ``synced_gpus``). Accelerate refuses FSDP on a CPU-only state, so the
      Accelerator is switched to FSDP2 after the Trainer built it (``bench_sft.use_fsdp2``:
      everything after is stock). The 3x rank runs each decoder layer's forward and backward,
      policy and reference, followed by a sleep of 2x their time (``bench_sft.emulate_layers``).
  (b) ``CephaloGRPOTrainer``, built-in generation, the even plan (b_i = B / 2, r_i = 1/2, the
      even split's best m: ``planner.simulate.even_split_plan``), each rank decoding its rows
      (``--cephalo_generation_split rows``), ``--cephalo_emulate_slowdown 1 3``.
  (c) ``CephaloGRPOTrainer`` planned: the start plan (b_i, m_i, r_i) from its profile and the
      generation split g_i from each rank's measured decode speed
      (``--cephalo_generation_split plan``).

Printed per way: the median wall seconds of a step over ``--steps`` steps after ``--warmup``
(rank 0's, between consecutive step ends: the ranks meet in every step's collectives), the
ratio against (a), the collectives counted per step (every call into torch.distributed and
the engine's collective functions, outermost call only: all-gathers, all-reduces,
reduce-scatters, others), and per phase (generation / scoring: rewards and reference
log-probabilities / training: the rest of the step) the measured seconds on rank 0 and, for
Cephalo's ways, ``planner.generation.price_rl_step``'s prediction from the planned run's
cluster profile and measured decode profiles. The physical bound: stock GRPOTrainer on ONE
process at 1x (no emulation, no communication) doing the whole step, over the summed speeds
sum_i 1/s_i. Cephalo's two ways must give the same completions (keyed sampling: the run does
not depend on the plan) and the same losses (rtol 1e-5); the benchmark checks and prints it.
Benchmarks never assert wall clock.

Usage: python benchmarks/bench_grpo.py [--steps 4] [--global-batch-size 16] [--new 16]
       [--slowdown 1,3] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from bench_sft import StepClock, emulate_layers, use_fsdp2  # this folder is on sys.path
from rank_launch import free_port, run_ranks

WAYS = ("stock GRPOTrainer, FSDP2, even", "CephaloGRPOTrainer, even", "CephaloGRPOTrainer, planned")
KINDS = ("all_gather", "all_reduce", "reduce_scatter", "other")
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def task(args):
    """(tokenizer, prompt dataset, reward functions) of examples/train_grpo.py."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import train_grpo

    return (train_grpo.char_tokenizer(), train_grpo.prompts(args.prompts),
            [train_grpo.format_reward, train_grpo.count_reward])


def save_model(args, tokenizer, path: str) -> str:
    """The Qwen3-shaped model saved under ``path`` (stock TRL builds its reference from the
    policy's name)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=args.hidden,
                      intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                      max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def grpo_kwargs(args, out_dir: str) -> dict:
    return dict(output_dir=out_dir, report_to="none", learning_rate=1e-4,
                max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no",
                seed=args.seed, bf16=False, use_cpu=True, disable_tqdm=True,
                gradient_checkpointing=False, num_generations=args.generations,
                max_completion_length=args.new, temperature=0.9, beta=0.04, shuffle_dataset=False)


# ---- counting and timing -------------------------------------------------------------------

class CollectiveCount:
    """Counts, per kind, the outermost calls into ``torch.distributed``'s collectives and the
    engine's collective functions (bound at import, so patched where they are looked up);
    nested calls (``all_gather_object`` -> ``all_gather``) count once."""

    PATCH = {"all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
             "all_gather_object": "all_gather", "all_reduce": "all_reduce",
             "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
             "broadcast": "other", "broadcast_object_list": "other", "barrier": "other",
             "all_to_all": "other", "all_to_all_single": "other", "gather": "other",
             "scatter": "other", "send": "other", "recv": "other"}
    ENGINE = {"_all_gather_single": "all_gather", "_reduce_scatter_single": "reduce_scatter"}

    def __init__(self) -> None:
        self.counts = dict.fromkeys(KINDS, 0)
        self._inside = threading.local()

    def snapshot(self) -> dict:
        return dict(self.counts)

    def _wrap(self, fn, kind):
        def counted(*a, **kw):
            if getattr(self._inside, "depth", 0):
                return fn(*a, **kw)
            self._inside.depth = 1
            self.counts[kind] += 1
            try:
                return fn(*a, **kw)
            finally:
                self._inside.depth = 0
        return counted

    @contextlib.contextmanager
    def active(self):
        from hf_cephalo.engine import collectives

        saved = []
        for module, table in ((dist, self.PATCH), (collectives, self.ENGINE)):
            for name, kind in table.items():
                if hasattr(module, name):
                    saved.append((module, name, getattr(module, name)))
                    setattr(module, name, self._wrap(getattr(module, name), kind))
        try:
            yield self
        finally:
            for module, name, fn in saved:
                setattr(module, name, fn)


class Phases:
    """Seconds of this rank's generation and scoring per step, from wrapped trainer methods:
    ``whole`` (generation + rewards + log-probabilities: the step's rollout) and ``generation``
    (the decode alone)."""

    def __init__(self) -> None:
        self.now = {"whole": 0.0, "generation": 0.0}

    def wrap(self, obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.now[key] += time.perf_counter() - t
        setattr(obj, name, timed)

    def take(self) -> dict:
        out, self.now = self.now, {"whole": 0.0, "generation": 0.0}
        return out


def measured(trainer, clock, count, phases, per_step) -> None:
    """Train under the counter; per step (from the clock's step ends): its seconds, its
    collectives and its phases, into ``per_step``."""
    from transformers import TrainerCallback

    class Snap(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            per_step.append(dict(counts=count.snapshot(), phases=phases.take()))

    trainer.add_callback(Snap())
    with count.active():
        trainer.train()


def summary(clock, per_step, args) -> dict:
    """Medians over the timed steps (step k's time needs the end of step k - 1)."""
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])][args.warmup - 1:]
    counts = [{k: b["counts"][k] - a["counts"][k] for k in KINDS}
              for a, b in zip(per_step, per_step[1:])][args.warmup - 1:]
    timed = per_step[args.warmup:]
    gen = statistics.median(p["phases"]["generation"] for p in timed)
    whole = statistics.median(p["phases"]["whole"] for p in timed)
    step = statistics.median(steps)
    return dict(step_s=step, counts={k: statistics.median(c[k] for c in counts) for k in KINDS},
                phases=dict(generation=gen, scoring=whole - gen, training=step - whole))


# ---- the three ways ------------------------------------------------------------------------

def run_stock(args, rank, setup, out_dir) -> dict:
    """(a): stock GRPOTrainer on FSDP2, B / 2 rows per rank, the 3x rank's layers slowed."""
    from trl import GRPOConfig, GRPOTrainer

    class FSDP2GRPOTrainer(GRPOTrainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            use_fsdp2(self, "Qwen3DecoderLayer")

    tokenizer, dataset, rewards, path = setup
    model = load_model(path)
    emulate_layers(model, args.slowdown[rank])
    clock, count, phases, per_step = StepClock(), CollectiveCount(), Phases(), []
    config = GRPOConfig(**grpo_kwargs(args, out_dir),
                        per_device_train_batch_size=args.global_batch_size // 2)
    trainer = FSDP2GRPOTrainer(model=model, reward_funcs=rewards, args=config,
                               train_dataset=dataset, processing_class=tokenizer,
                               callbacks=[clock.callback])
    # GRPOTrainer's __init__ sets the state back to MULTI_CPU after the switch (its reference
    # model was prepared on FSDP2 already): switch again before train() prepares the policy
    use_fsdp2(trainer, "Qwen3DecoderLayer")
    if trainer.ref_model is not None:
        emulate_layers(trainer.ref_model, args.slowdown[rank])
    phases.wrap(trainer, "_generate_and_score_completions", "whole")
    phases.wrap(trainer, "_generate_single_turn", "generation")
    measured(trainer, clock, count, phases, per_step)
    out = summary(clock, per_step, args)
    out["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h
                     and "train_loss" not in h]
    return out


def run_cephalo(args, rank, setup, out_dir, plan=None) -> tuple[dict, object]:
    """(b) with ``plan`` (the even plan, each rank decoding its rows), (c) without (the start
    plan and the generation planner's g_i)."""
    from hf_cephalo import CephaloGRPOConfig, CephaloGRPOTrainer

    tokenizer, dataset, rewards, path = setup
    clock, count, phases, per_step = StepClock(), CollectiveCount(), Phases(), []
    config = CephaloGRPOConfig(**grpo_kwargs(args, out_dir),
                               per_device_train_batch_size=args.global_batch_size // 2,
                               cephalo_global_batch_size=args.global_batch_size,
                               cephalo_emulate_slowdown=args.slowdown, cephalo_adaptive="off",
                               cephalo_generation_split="rows" if plan else "plan")
    trainer = CephaloGRPOTrainer(model=load_model(path), reward_funcs=rewards, args=config,
                                 train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=[clock.callback], plan=plan)
    completions: dict = {}
    rollout = trainer._cephalo_rollout

    def recorded(prompts, global_rows, generation_round):
        out = rollout(prompts, global_rows, generation_round)
        completions.update({(generation_round, r): list(c)
                            for r, c in zip(global_rows, out["completion_ids"])})
        return out
    trainer._cephalo_rollout = recorded
    phases.wrap(trainer, "_engine_microbatches", "whole")
    phases.wrap(trainer, "_cephalo_rollout", "generation")
    measured(trainer, clock, count, phases, per_step)
    out = summary(clock, per_step, args)
    out.update(losses=[h["loss"] for h in trainer.state.log_history
                       if "loss" in h and "train_loss" not in h],
               completions=completions,
               plan=[(r.batch_size, r.microbatch_size, round(r.state_ratio, 3))
                     for r in trainer.plan.ranks],
               decode=trainer._builtin.report[-1])
    return out, trainer


def predictions(args, planned, even_plan, even_mode) -> dict:
    """price_rl_step of both Cephalo ways from the planned run's cluster profile and its
    measured decode profiles (seconds per phase)."""
    from hf_cephalo.planner.generation import price_generation, price_rl_step
    from hf_cephalo.runtime.generation_plan import decode_model

    session, builtin = planned.session, planned._builtin
    cluster = session.cluster_profile
    k = session.job.scoring_passes  # the door's passes per step, which its start plan priced
    model = decode_model(session.engine, getattr(cluster, "comm", None))
    half = args.global_batch_size // 2
    even_gen = price_generation(builtin.profiles, model, [half, half], args.new, even_mode)
    out = {}
    for way, plan, gen in ((WAYS[1], even_plan, even_gen),
                           (WAYS[2], planned.plan, builtin.plan)):
        p = price_rl_step(plan, cluster, gen, logprob_passes=k)
        out[way] = dict(generation=p.generation_s, scoring=p.logprob_s, training=p.training_s,
                        total=p.total_s, split=list(gen.rows), mode=gen.mode)
    out["profiles"] = [(d.fixed_s, d.per_row_s) for d in builtin.profiles]
    # what pricing the scoring passes at start changed: the start plan minimizes the training
    # step plus k passes; the training optimum is the plan without them (g_i is planned apart,
    # from the decode profiles)
    from hf_cephalo.planner import optimize
    from hf_cephalo.planner.simulate import compute_balance_plan

    out["start_candidates"] = {
        name: price_rl_step(plan, cluster, builtin.plan, logprob_passes=k).total_s
        for name, plan in (("even", even_plan), ("compute balance",
                                                 compute_balance_plan(cluster, 2 * half)),
                           ("training optimum", optimize(
                               cluster, 2 * half, planned.plan.memory_fraction,
                               activation_checkpointing=planned.plan.activation_checkpointing)),
                           (f"start plan (training + {k:g} scoring)", planned.plan))}
    return out


def worker(rank, args, port, model_dir, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                      TRL_EXPERIMENTAL_SILENCE="1")
    torch.set_num_threads(1)
    import datasets
    from transformers.utils import logging as hf_logging

    from hf_cephalo.planner.simulate import even_split_plan

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        setup = (*task(args), model_dir)
        with tempfile.TemporaryDirectory() as tmp:
            stock = run_stock(args, rank, setup, os.path.join(tmp, "stock"))
            planned, trainer = run_cephalo(args, rank, setup, os.path.join(tmp, "planned"))
            even_plan = even_split_plan(trainer.session.cluster_profile, args.global_batch_size)
            even, _ = run_cephalo(args, rank, setup, os.path.join(tmp, "even"), even_plan)
            predicted = predictions(args, trainer, even_plan, even["decode"]["mode"])
        out_q.put((rank, dict(ways=dict(zip(WAYS, (stock, even, planned))),
                              predicted=predicted)))
    finally:
        dist.destroy_process_group()


def bound_worker(args, model_dir, out_q):
    """Stock GRPOTrainer on ONE process at 1x, the whole generation batch per step."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                      TRL_EXPERIMENTAL_SILENCE="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)
    import datasets
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    tokenizer, dataset, rewards = task(args)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(**grpo_kwargs(args, tmp),
                            per_device_train_batch_size=args.global_batch_size)
        trainer = GRPOTrainer(model=load_model(model_dir), reward_funcs=rewards, args=config,
                              train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[clock.callback])
        trainer.train()
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])][args.warmup - 1:]
    out_q.put(statistics.median(steps))


# ---- the report ----------------------------------------------------------------------------

def same_runs(results) -> tuple[bool, float]:
    """(Cephalo's two ways gave the same completions on every row of every round, the largest
    relative difference of their per-step losses)."""
    merged = {}
    for way in WAYS[1:]:
        rows: dict = {}
        for res in results.values():
            rows.update(res["ways"][way]["completions"])
        merged[way] = rows
    a, b = (results[0]["ways"][w]["losses"] for w in WAYS[1:])
    diff = max((abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)
    same = merged[WAYS[1]] == merged[WAYS[2]] and len(a) == len(b)
    return same, diff


def report(args, results, bound_one_s, load_before) -> None:
    r0 = results[0]
    bound = bound_one_s / sum(1.0 / s for s in args.slowdown)
    print(f"\n2 CPU gloo ranks emulating slowdown {args.slowdown}; Qwen3 {args.layers} x "
          f"{args.hidden}; GRPO: B = {args.global_batch_size} rows ({args.generations} per "
          f"prompt), <= {args.new} new tokens, beta 0.04 (reference pass); fp32, AdamW; median "
          f"of {args.steps} steps after {args.warmup}")
    print("baseline (a): stock TRL GRPOTrainer under Accelerate FSDP2 (fully_shard per "
          "Qwen3DecoderLayer, gloo, CPU), even split")
    base = r0["ways"][WAYS[0]]["step_s"]
    head = (f"{'way':<32}{'b_i (m_i, r_i)':<26}{'g_i / mode':<22}{'step s':>8}{'vs (a)':>8}"
            f"{'x bound':>8}{'AG':>6}{'AR':>6}{'RS':>6}{'other':>6}")
    print(head)
    print("-" * len(head))
    for way in WAYS:
        w = r0["ways"][way]
        pred = r0["predicted"].get(way)
        plan = "B/2 each" if "plan" not in w else \
            " ".join(f"{b}({m},{r:.2f})" for b, m, r in w["plan"])
        gen = "own rows" if pred is None else f"{pred['split']} {w['decode']['mode']}"
        c = w["counts"]
        print(f"{way:<32}{plan:<26}{gen:<22}{w['step_s']:>8.3f}{base / w['step_s']:>7.2f}x"
              f"{w['step_s'] / bound:>7.2f}x{c['all_gather']:>6.0f}{c['all_reduce']:>6.0f}"
              f"{c['reduce_scatter']:>6.0f}{c['other']:>6.0f}")
    print(f"{'physical bound':<32}{'one process at 1x':<26}{'':<22}{bound:>8.3f}"
          f"{base / bound:>7.2f}x   (one process {bound_one_s:.3f} s / sum(1/s_i))")
    print("\nper phase, seconds per step, measured on rank 0 / rank 1 (a phase's time on a rank "
          "includes its waits for the other rank), and predicted by price_rl_step:")
    phases = ("generation", "scoring", "training")
    for way in WAYS:
        pred = r0["predicted"].get(way)
        cells = [f"{k} " + " / ".join(f"{results[r]['ways'][way]['phases'][k]:.3f}"
                                     for r in sorted(results))
                 + (f" ({pred[k]:.3f})" if pred else "") for k in phases]
        total = f"; predicted step {pred['total']:.3f}" if pred else ""
        print(f"  {way:<32}" + ", ".join(cells) + total)
    print("  (scoring: rewards and the reference's log-probabilities; training: the rest of "
          "the step; stock is not priced)")
    print("decode profiles (a_i s, c_i s/row) per decode step, measured by the planned run: "
          + ", ".join(f"rank {r}: ({a:.4f}, {c:.5f})"
                      for r, (a, c) in enumerate(r0["predicted"]["profiles"])))
    print("priced whole step (price_rl_step, the planned g_i) of candidate training plans: "
          + ", ".join(f"{k} {v:.3f} s" for k, v in r0["predicted"]["start_candidates"].items()))
    same, diff = same_runs(results)
    print(f"\nCephalo even vs planned: same completions: {same}; largest relative loss "
          f"difference {diff:.2e} (tolerance 1e-5)")
    print(f"load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} (1 min), "
          f"{os.cpu_count()} CPUs")
    if not same or diff > 1e-5:
        raise SystemExit("Cephalo's even and planned ways differ (completions or losses)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slowdown", default="1,3", help="per-rank emulated slowdown (default 1,3)")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--generations", type=int, default=4, help="completions per prompt (G)")
    p.add_argument("--new", type=int, default=16, help="max_completion_length")
    p.add_argument("--steps", type=int, default=4, help="timed steps per way")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--smoke", action="store_true",
                   help="smallest sizes, one timed step (numbers meaningless)")
    args = p.parse_args(argv)
    if args.smoke:
        args.global_batch_size, args.generations, args.new, args.steps = 4, 2, 3, 1
        args.layers, args.hidden, args.prompts = 2, 32, 8
    args.slowdown = [float(x) for x in args.slowdown.split(",")]
    if len(args.slowdown) != 2 or args.global_batch_size % (2 * args.generations) \
            or args.warmup < 1 or args.steps < 1:
        p.error("two slowdowns, a global batch that 2 x --generations divides, --warmup >= 1 "
                "and --steps >= 1")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        # profiles measured in this run: a cached profile from another time (another load)
        # priced the planned training at 2.23 s against a measured 0.30 s
        os.environ.setdefault("HF_CEPHALO_PROFILE_CACHE", os.path.join(tmp, "profiles"))
        model_dir = save_model(args, task(args)[0], os.path.join(tmp, "model"))
        port = free_port()
        results = dict(run_ranks(worker, [(r, args, port, model_dir) for r in range(2)],
                                 timeout_s=1800))
        bound_one_s = run_ranks(bound_worker, [(args, model_dir)], timeout_s=900)[0]
    report(args, results, bound_one_s, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
