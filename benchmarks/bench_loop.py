"""A custom Accelerate loop on Cephalo vs CephaloTrainer (same plan) vs the same loop on stock FSDP2.

Two gloo ranks on CPU emulate a 1x and a 3x slower device (``--slowdown 1,3``: the slow rank
waits (f - 1) x its measured compute after every unit call and unit backward;
``profiler.emulate``). One profile is measured with that emulation and planned once
(``planner.optimize``, global batch ``--global-batch-size``); then, in ONE run, rounds of
``--steps`` optimizer steps of the same Llama-shaped model on the same data alternate between:

  (a) ``CephaloTrainer`` on the plan (its step: the session's step timer, from the Trainer's
      step begin to its step end: forward/backward, clipping, fused AdamW, zero_grad);
  (b) the stock-shaped loop on ``CephaloAccelerator`` with the same plan (``prepare`` +
      ``model(**batch)`` + ``accelerator.backward`` + ``clip_grad_norm_`` + ``optimizer.step``;
      the same step timer, from drawing the batch to ``optimizer.step``);
  (c) the same loop on stock FSDP2 (torch's ``fully_shard`` per decoder layer and at the root,
      as Accelerate's FSDP2 preparation does on GPUs: Accelerate 1.15 on CPU falls back to DDP
      even with an FSDP plugin; Accelerate's loaders: an even split, B / 2 rows per rank in one
      forward), the slow rank emulated by forward / backward hooks on every decoder layer that
      wait (f - 1) x the layer's measured time, the step timed from drawing the batch to
      ``optimizer.step``.

Every step's time is the slowest rank's (a max all-reduce after the step); medians over the
steps after each round's first. Printed: (b) / (a) (goal <= 1.02), (b) / (c), and each against
the physical bound: the fast device's measured time for the whole batch in one process
(forward + backward, no collectives, no recompute) divided by the summed speeds
sum_i 1 / f_i; plus the collectives per step (Cephalo: the engine's counters; FSDP2: the
profiler's all-gathers and reduce-scatters of one traced step).

Usage: python benchmarks/bench_loop.py [--steps 6] [--rounds 2] [--global-batch-size 16]
       [--slowdown 1,3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from rank_launch import free_port, run_ranks  # this folder is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=args.seq, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def dataset(args):
    gen = torch.Generator().manual_seed(0)
    n = args.global_batch_size * (args.steps + 1) * args.rounds
    ids = torch.randint(0, args.vocab, (n, args.seq), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# ---- (a) CephaloTrainer ------------------------------------------------------------------------
def run_trainer(args, plan_file, out_dir) -> list[float]:
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

    targs = CephaloTrainingArguments(
        output_dir=out_dir, report_to="none", learning_rate=1e-4, max_steps=args.steps,
        logging_steps=args.steps, save_strategy="no", disable_tqdm=True, seed=0,
        cephalo_plan_file=plan_file, cephalo_emulate_slowdown=args.slowdown_text,
        cephalo_adaptive="off", max_grad_norm=1.0)
    trainer = CephaloTrainer(model=build_model(args), args=targs, train_dataset=dataset(args),
                             data_collator=collate)
    trainer.train()
    return [slowest(s.step_s) for s in trainer.session.timer.steps]


# ---- (b) the loop on CephaloAccelerator ----------------------------------------------------------
def run_loop(args, plan_file, out_dir) -> tuple[list[float], dict]:
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    from hf_cephalo import CephaloAccelerator, CephaloPlugin

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = CephaloAccelerator(project_dir=out_dir, cephalo_plugin=CephaloPlugin(
        plan_file=plan_file, emulate_slowdown=args.slowdown_text, adaptive="off"))
    model = build_model(args).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loader = DataLoader(dataset(args), batch_size=args.global_batch_size // 2, shuffle=True,
                        collate_fn=collate, generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine = accelerator.cephalo_session.engine
    for step, batch in enumerate(loader):
        if step == 1:
            engine.stats.reset()
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 >= args.steps:
            break
    stats = engine.stats.as_dict()
    per_step = {k: stats[k] / max(args.steps - 1, 1) for k in
                ("all_gather_count", "reduce_scatter_count", "all_reduce_count")}
    return [slowest(s.step_s) for s in accelerator.cephalo_session.timer.steps], per_step


# ---- (c) the loop on stock FSDP2 -----------------------------------------------------------------
def slow_layers(model, factor: float) -> None:
    """Every decoder layer waits (factor - 1) x its measured forward / backward time."""
    if factor == 1.0:
        return
    for layer in model.model.layers:
        start = {}

        def pre(module, inputs, start=start):
            start["f"] = time.perf_counter()

        def post(module, inputs, output, start=start):
            time.sleep((factor - 1) * (time.perf_counter() - start["f"]))

        def bpre(module, grad_output, start=start):
            start["b"] = time.perf_counter()

        def bpost(module, grad_input, grad_output, start=start):
            time.sleep((factor - 1) * (time.perf_counter() - start["b"]))

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
        layer.register_full_backward_pre_hook(bpre)
        layer.register_full_backward_hook(bpost)


def run_fsdp2(args, rank) -> tuple[list[float], dict]:
    """The loop on stock FSDP2. Accelerate 1.15 on CPU (``cpu=True``) prepares DDP even with an
    FSDP plugin, so the model is sharded here with torch's ``fully_shard`` per decoder layer and
    at the root (what Accelerate's ``fsdp2_prepare_model`` does on GPUs); the loaders are
    Accelerate's (an even split), the loop is the same."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = build_model(args).train()
    slow_layers(model, args.slowdown[rank])
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loader = DataLoader(dataset(args), batch_size=args.global_batch_size // 2, shuffle=True,
                        collate_fn=collate, generator=torch.Generator().manual_seed(0))
    optimizer, loader = accelerator.prepare(optimizer, loader)
    times, counts = [], {}
    for step, batch in enumerate(loader):
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
            if step == 1 else None
        if prof is not None:
            prof.__enter__()
        t = time.perf_counter()
        outputs = model(**batch)
        outputs.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        elapsed = time.perf_counter() - t
        if prof is not None:
            prof.__exit__(None, None, None)
            counts = _count(prof)
        times.append(slowest(elapsed))
        if step + 1 >= args.steps:
            break
    return times, counts


def _count(prof) -> dict:
    out = {"all_gather_count": 0, "reduce_scatter_count": 0, "all_reduce_count": 0}
    for e in prof.events():
        if e.name == "c10d::_allgather_base_":
            out["all_gather_count"] += 1
        elif e.name == "c10d::_reduce_scatter_base_":
            out["reduce_scatter_count"] += 1
        elif e.name == "c10d::allreduce_":
            out["all_reduce_count"] += 1
    return out


# ---- the physical bound --------------------------------------------------------------------------
def bound_s(args) -> float:
    """The fast device's time for the whole global batch in one process (forward + backward,
    no collectives, no recompute), divided by the summed speeds sum_i 1 / f_i."""
    model = build_model(args).train()
    batch = collate(dataset(args)[:args.global_batch_size])
    times = []
    for _ in range(3):
        t = time.perf_counter()
        model(**batch).loss.backward()
        times.append(time.perf_counter() - t)
        model.zero_grad()
    return min(times) / sum(1.0 / f for f in args.slowdown)


# ---- the run --------------------------------------------------------------------------------------
def plan_once(args, rank, directory) -> str:
    """Profile (emulated) and plan once; every rank gets the same plan file."""
    from hf_cephalo.models import stage_model
    from hf_cephalo.planner import optimize
    from hf_cephalo.profiler.emulate import EmulationConfig
    from hf_cephalo.profiler.measure import MeasureConfig, profile_cluster

    cluster = profile_cluster(stage_model(build_model(args)),
                              MeasureConfig(max_microbatch_size=min(8, args.global_batch_size),
                                            sequence_length=args.seq, progress=rank == 0),
                              emulation=EmulationConfig(slowdown=args.slowdown), cache=False)
    plan = optimize(cluster, args.global_batch_size)
    path = os.path.join(directory, "plan.json")
    if rank == 0:
        plan.save(path)
    dist.barrier()
    return path


def worker(rank, args, port, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            shared = os.path.join(tempfile.gettempdir(), f"bench_loop_{port}")
            os.makedirs(shared, exist_ok=True)
            plan_file = plan_once(args, rank, shared)
            result = {"trainer": [], "loop": [], "fsdp2": [], "plan": json.load(open(plan_file))}
            for r in range(args.rounds):  # alternate: load changes hit all three alike
                result["trainer"].append(run_trainer(args, plan_file, os.path.join(tmp, f"t{r}")))
                times, result["loop_collectives"] = run_loop(args, plan_file,
                                                             os.path.join(tmp, f"l{r}"))
                result["loop"].append(times)
                times, result["fsdp2_collectives"] = run_fsdp2(args, rank)
                result["fsdp2"].append(times)
            result["bound_s"] = bound_s(args) if rank == 0 else None
        out_q.put((rank, result))
    finally:
        dist.destroy_process_group()


def median_after_first(rounds: list[list[float]]) -> float:
    return statistics.median([t for times in rounds for t in times[1:]])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--slowdown", default="1,3")
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--smoke", action="store_true",
                        help="smallest settings: --quick with 1 round of 2 steps, B = 4 (the suite's "
                             "check that the benchmark runs; numbers meaningless)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.quick, args.rounds, args.steps, args.global_batch_size = True, 1, 2, 4
    args.slowdown_text = args.slowdown
    args.slowdown = [float(x) for x in args.slowdown.split(",")]
    assert len(args.slowdown) == 2, "two ranks"
    shape = dict(vocab=64, hidden=32, intermediate=64, layers=2, heads=4, seq=16) if args.smoke \
        else dict(vocab=512, hidden=128, intermediate=256, layers=2, heads=4, seq=64) \
        if args.quick else dict(vocab=2048, hidden=256, intermediate=768, layers=4, heads=4, seq=128)
    for k, v in shape.items():
        setattr(args, k, v)
    port = free_port()
    results = dict(run_ranks(worker, [(r, args, port) for r in range(2)], timeout_s=3600))
    r0 = results[0]
    trainer, loop, fsdp2 = (median_after_first(r0[k]) for k in ("trainer", "loop", "fsdp2"))
    bound = r0["bound_s"]
    plan = r0["plan"]
    print(f"plan: b_i {[r['batch_size'] for r in plan['ranks']]}, m_i "
          f"{[r['microbatch_size'] for r in plan['ranks']]}, r_i "
          f"{[round(r['state_ratio'], 3) for r in plan['ranks']]}; slowdown {args.slowdown}, "
          f"global batch {args.global_batch_size}, {args.rounds} rounds x {args.steps} steps")
    print(f"{'system':<34} {'step s (median)':>16} {'x bound':>8}")
    for name, value in (("CephaloTrainer", trainer), ("loop on CephaloAccelerator", loop),
                        ("loop on stock FSDP2 (even split)", fsdp2)):
        print(f"{name:<34} {value:>16.4f} {value / bound:>8.2f}")
    print(f"physical bound (one process / summed speeds): {bound:.4f} s")
    print(f"loop / CephaloTrainer = {loop / trainer:.3f} (goal <= 1.02); "
          f"loop / FSDP2 = {loop / fsdp2:.3f}")
    print(f"collectives per step: Cephalo {r0['loop_collectives']}, FSDP2 "
          f"{r0['fsdp2_collectives']}")
    print("every step (s, slowest rank; the first of each round left out of the medians): "
          + "; ".join(f"{k} {[[round(t, 3) for t in ts] for ts in r0[k]]}"
                      for k in ("trainer", "loop", "fsdp2")))


if __name__ == "__main__":
    main()
