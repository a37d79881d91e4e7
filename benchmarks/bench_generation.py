"""Generation on the sharded engine: decode modes and the planned split g_i on emulated devices.

Two gloo ranks on CPU emulate a 1x and a 3x slower device (``--slowdown``; the slow rank sleeps
2x the measured time of each layer's decode forward, ``runtime.generation_plan.emulated_decode``).
A Qwen3-shaped model (``--layers`` x ``--hidden``) is sharded by the engine (r = 0.5 / 0.5), each
rank measures its decode speed (``measure_decode_profiles``: two row counts, gather once), the
planner (``planner/generation.py``) chooses the split g_i and the mode for a round of ``--rows``
prompts of ``--prompt`` tokens and ``--new`` new tokens, and four ways of decoding the same
round are timed (median of ``--repeats``, each round ending when its slowest rank ends):

  even split, gather once | even split, sharded decode | planned split, gather once |
  planned split, sharded decode

Printed per way: wall seconds, tokens / s, the ratio against the even split gathered once (the
baseline, ZeRO-3's ``ds3_gather_for_generation`` with an even split), the planner's prediction
where it priced that way, and the counted all-gathers / all-reduces per round. The physical
bound: one process at 1x decoding all rows alone, over the summed speed of the ranks (with
slowdowns s_i, the bound is t_1x * sum(1/s_i)^-1 ... printed as the measured one-process 1x
time / sum_i(1/s_i)). Every way gives the same completions (keyed sampling); the benchmark
checks it.

Usage: python benchmarks/bench_generation.py [--rows 16] [--new 32] [--slowdown 1,3]
       [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from rank_launch import free_port, run_ranks  # this folder is on sys.path

WAYS = (("even split, gather once", "even", "gather_once"),
        ("even split, sharded decode", "even", "sharded"),
        ("planned split, gather once", "planned", "gather_once"),
        ("planned split, sharded decode", "planned", "sharded"))


def build_model(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2,
                      head_dim=args.hidden // 4, max_position_embeddings=args.prompt + args.new,
                      tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval()


def prompts(args) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(2, args.vocab, (args.prompt - (j % 3),), generator=gen).tolist()
            for j in range(args.rows)]


def params(args):
    from hf_cephalo.runtime.generation import SamplingParams

    return SamplingParams(max_new_tokens=args.new, temperature=0.8, top_k=50, eos_token_ids=(),
                          pad_token_id=0, seed=2)


def _round(engine, rows, todo, args, mode):
    """(seconds until the slowest rank ends, this rank's completions, all-gathers,
    all-reduces) of one decode round of this rank's rows ``todo``."""
    from hf_cephalo.runtime.generation_plan import emulated_decode

    engine.stats.reset()
    dist.barrier()
    t0 = time.perf_counter()
    with emulated_decode(engine.staged):
        out = engine.generate([rows[r] for r in todo], todo, params(args), 0, mode=mode)
    local = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return float(local), out.completions, engine.stats.all_gather_count, \
        engine.stats.all_reduce_count


def run(rank, args):
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models.registry import stage_model
    from hf_cephalo.profiler.emulate import EmulatedStagedModel
    from hf_cephalo.runtime.generation_plan import decode_model, measure_decode_profiles
    from hf_cephalo.planner.generation import plan_generation

    world = len(args.slowdown)
    staged = EmulatedStagedModel(stage_model(build_model(args)), args.slowdown[rank])
    engine = CephaloEngine(staged, state_ratios=[1 / world] * world)
    rows = prompts(args)
    profiles = measure_decode_profiles(engine, rows=(1, max(2, args.rows // 2)),
                                       prompt_tokens=args.prompt, new_tokens=min(args.new, 8))
    model = decode_model(engine)
    plans = {mode: plan_generation(profiles, model, args.rows, args.prompt, args.new,
                                   modes=(mode,)) for mode in ("gather_once", "sharded")}
    even = [args.rows // world + (1 if r < args.rows % world else 0) for r in range(world)]
    splits = {"even": even}
    times = {name: [] for name, _, _ in WAYS}
    done = {}
    for rep in range(args.repeats + 1):  # the first round warms up
        for name, split_name, mode in WAYS:
            split = splits.get(split_name) or plans[mode].rows
            start = sum(split[:rank])
            todo = list(range(start, start + split[rank]))
            wall, completions, ags, ars = _round(engine, rows, todo, args, mode)
            if rep:
                times[name].append(wall)
            done[name] = (dict(zip(todo, completions)), ags, ars, split)
    return dict(times=times, done=done, profiles=[(p.fixed_s, p.per_row_s) for p in profiles],
                predicted={m: p.predicted_s for m, p in plans.items()})


def one_process_s(args) -> float:
    """Wall seconds of one process at 1x decoding every row (the physical bound's base)."""
    from hf_cephalo.runtime.generation import generate_rows

    model, rows = build_model(args), prompts(args)
    generate_rows(model, rows, list(range(len(rows))), params(args), 0)
    t0 = time.perf_counter()
    generate_rows(model, rows, list(range(len(rows))), params(args), 0)
    return time.perf_counter() - t0


def worker(rank, args, port, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=len(args.slowdown))
    try:
        out_q.put((rank, run(rank, args)))
    finally:
        dist.destroy_process_group()


def report(args, results) -> None:
    r0 = results[0]
    merged = {name: {} for name, _, _ in WAYS}
    for res in results.values():
        for name, (rows, _, _, _) in res["done"].items():
            merged[name].update(rows)
    same = all(merged[name] == merged[WAYS[0][0]] for name, _, _ in WAYS)
    base = statistics.median(r0["times"][WAYS[0][0]])
    tokens = args.rows * args.new
    single = one_process_s(args)
    bound = single / sum(1.0 / s for s in args.slowdown)
    print(f"{args.rows} rows x {args.new} new tokens, prompts of ~{args.prompt}, "
          f"Qwen3 {args.layers} x {args.hidden}, slowdowns {args.slowdown}, "
          f"median of {args.repeats}")
    print(f"decode profiles (a_i, c_i) s/step: "
          + ", ".join(f"rank {r}: ({a:.4f}, {c:.5f})" for r, (a, c) in enumerate(r0["profiles"])))
    print(f"{'way':<32}{'split g_i':<12}{'wall s':>8}{'tok/s':>9}{'vs base':>9}"
          f"{'predicted':>11}{'AG':>6}{'AR':>6}")
    for name, split_name, mode in WAYS:
        wall = statistics.median(r0["times"][name])
        _, ags, ars, split = r0["done"][name]
        pred = f"{r0['predicted'][mode]:.3f}" if split_name == "planned" else "-"
        print(f"{name:<32}{str(split):<12}{wall:>8.3f}{tokens / wall:>9.1f}"
              f"{base / wall:>8.2f}x{pred:>11}{ags:>6}{ars:>6}")
    print(f"physical bound: one process at 1x {single:.3f} s / sum(1/s_i) = {bound:.3f} s "
          f"({tokens / bound:.1f} tok/s)")
    print(f"completions identical across the four ways: {same}")
    if not same:
        raise SystemExit("completions differ between ways of decoding")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slowdown", default="1,3")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="smallest sizes, one timed round")
    args = p.parse_args(argv)
    args.slowdown = [float(x) for x in args.slowdown.split(",")]
    if args.smoke:
        args.rows, args.prompt, args.new, args.layers, args.hidden, args.vocab = 4, 4, 3, 2, 32, 64
        args.repeats = 1
    port = free_port()
    results = dict(run_ranks(worker, [(r, args, port) for r in range(len(args.slowdown))],
                             timeout_s=1800))
    report(args, results)


if __name__ == "__main__":
    main()
