"""Live re-balancing benchmark: a rank slows down mid-run; static plan vs adaptive vs oracle.

CPU gloo ranks train a real Llama-shaped model through ``CephaloTrainer`` (the whole path: the
weighted sampler, the engine, the callbacks) for ``--steps`` steps while
``--cephalo_emulate_slowdown_schedule`` makes ranks slower from ``--change-step`` on
(``profiler.emulate``: a slowed rank really waits (s - 1) x its measured compute after every
unit call and unit backward). Each rank profiles itself once at its own speed
(``profile_cluster``); three runs then start from plans made from that profile:

  static:   the plan for the speeds at step 0, ``--cephalo_adaptive off``;
  adaptive: the same start plan, ``--cephalo_adaptive batch`` (default threshold, interval,
            hysteresis): the plan follows the measured speeds;
  oracle:   the plan made for the speeds after the change from the start (the profile with
            each rank's forward/backward times multiplied by its new factor, exactly what the
            emulation does to compute), ``--cephalo_adaptive off``.

All three run the same schedule, data and model. Measured: each step's wall time on rank 0
(the session's ``StepTimer``; ranks finish a step together at its last collective), median
over steps [``--from-step``, ``--steps``). Printed: adaptive / oracle (goal <= 1.10),
static / adaptive (goal >= 1.5 for 1x -> 3x), steps from the change to the switch, and the
predicted vs measured step time after adaptation (the whole step as planner/cost.py prices it:
units, embedding and head, optimizer step, collectives and waiting, [Note: step terms]). The
drift cases: 2 ranks 1x -> 3x, and 3 ranks drifting to 1x/2x/4x.

The noisy case (``noisy``): 2 ranks at FIXED speeds 2x / 1x (the demo's), planned for them,
while a co-tenant process on the same cores is busy ``--load-busy-s`` seconds, then idle
``--load-idle-s`` seconds, over and over (started after profiling, stopped after training):
the speeds never change, so every switch the adaptive run takes follows the noise (goal: at
most 1). Two runs, static and adaptive, ``--noisy-steps`` steps each; printed: the switches
and both median step times.

Usage: python benchmarks/bench_adaptive.py [--steps 40] [--change-step 10] [--cases 2,3,noisy]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from rank_launch import free_port, run_ranks
from bench_hetero import build_model  # the same Llama-shaped model (this folder is on sys.path)

CASES = {"2": [1.0, 3.0], "3": [1.0, 2.0, 4.0]}  # drift cases: factors from the change step on
NOISY_FACTORS = [2.0, 1.0]  # the noisy case: fixed speeds, from step 0
RUNS = ("static", "adaptive", "oracle")
NOISY_RUNS = ("static", "adaptive")
# The co-tenant of the noisy case: busy (a pure-Python loop) for BUSY s, then idle for IDLE s.
LOAD_SCRIPT = """
import sys, time
busy, idle = float(sys.argv[1]), float(sys.argv[2])
while True:
    end = time.perf_counter() + busy
    while time.perf_counter() < end:
        pass
    time.sleep(idle)
"""


def dataset(args, n):
    import datasets

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (n, args.seq), generator=gen)
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    ds.set_format("torch")
    return ds


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def worker(rank, world_size, case, args, port, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    for name in ("PLAN_FILE", "PROFILE_FILE", "ADAPTIVE", "EMULATE_SLOWDOWN",
                 "EMULATE_SLOWDOWN_SCHEDULE", "ADAPTIVE_THRESHOLD", "ADAPTIVE_INTERVAL"):
        os.environ.pop("HF_CEPHALO_" + name, None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        out_q.put((rank, run(rank, world_size, case, args)))
    finally:
        dist.destroy_process_group()


def run(rank, world_size, case, args):
    from hf_cephalo.models import stage_model
    from hf_cephalo.planner import optimize
    from hf_cephalo.planner.adapt import refit_cluster
    from hf_cephalo.profiler.measure import MeasureConfig, profile_cluster

    noisy = case == "noisy"
    factors = NOISY_FACTORS if noisy else CASES[case]
    steps = args.noisy_steps if noisy else args.steps
    B = args.global_batch_size
    # the noisy case profiles at its fixed speeds (the plan is right for them); a drift case at 1x
    schedule = f"0:{','.join(f'{f:g}' for f in factors)}" if noisy else \
        (f"0:{','.join(['1'] * world_size)};"
         f"{args.change_step}:{','.join(f'{f:g}' for f in factors)}")
    t0 = time.perf_counter()
    cluster = profile_cluster(stage_model(build_model(args)),
                              MeasureConfig(max_microbatch_size=args.max_microbatch_size,
                                            sequence_length=args.seq, repeats=args.repeats),
                              cache=False, emulation=_emulation(schedule, noisy))
    profile_s = time.perf_counter() - t0
    oracle_cluster = cluster if noisy else refit_cluster(cluster, factors)
    plans = {"static": optimize(cluster, B), "adaptive": optimize(cluster, B),
             "oracle": optimize(oracle_cluster, B)}
    data = dataset(args, B * steps)
    out = dict(profile_s=profile_s, schedule=schedule, steps=steps)
    load = _start_load(args) if noisy and rank == 0 else None
    try:
        for name in NOISY_RUNS if noisy else RUNS:
            out[name] = _train(name, plans[name], cluster, oracle_cluster, data, schedule,
                               steps, args)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    return out


def _emulation(schedule: str, noisy: bool):
    """The noisy case's emulated speeds at step 0 (what its profile sees); None for a drift
    case, whose ranks start at 1x."""
    from hf_cephalo.profiler.emulate import EmulationConfig, SlowdownSchedule

    return EmulationConfig(schedule=SlowdownSchedule.parse(schedule)) if noisy else None


def _start_load(args) -> subprocess.Popen:
    """The noisy case's co-tenant: one process, busy ``--load-busy-s`` s, idle
    ``--load-idle-s`` s, until killed."""
    return subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT, str(args.load_busy_s),
                             str(args.load_idle_s)])


def _train(name, plan, cluster, oracle_cluster, data, schedule, steps, args):
    """One run of ``steps`` steps from ``plan``; its step times, plans and switches."""
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import predict

    with tempfile.TemporaryDirectory() as tmp:
        targs = CephaloTrainingArguments(
            output_dir=tmp, report_to="none", optim="adamw_torch", learning_rate=1e-4,
            max_steps=steps, logging_steps=steps, save_strategy="no",
            disable_tqdm=True, seed=0, cephalo_emulate_slowdown_schedule=schedule,
            cephalo_adaptive="batch" if name == "adaptive" else "off")
        trainer = CephaloTrainer(model=build_model(args), args=targs, plan=plan,
                                 cluster_profile=cluster, data_collator=collate,
                                 train_dataset=data)
        trainer.train()
    controller = trainer.session.controller
    decisions = [] if controller is None else controller.decisions
    return dict(
        step_s=[s.step_s for s in trainer.session.timer.steps], start_plan=plan.to_json(),
        end_plan=trainer.plan.to_json(),
        predicted_s=predict(trainer.plan, oracle_cluster).iteration_s,
        switches=[dict(step=d["step"], batch_sizes=d["batch_sizes"],
                       predicted_before_s=d["predicted_before_s"],
                       predicted_after_s=d["predicted_after_s"], scales=d["scales"])
                  for d in decisions if d["switch"]],
        not_paid=[d["reason"] for d in decisions if "did not pay" in d["reason"]])


def _table(result, runs, lo, hi):
    med = {name: statistics.median(result[name]["step_s"][lo:hi]) for name in runs}
    head = f"{'run':<9} {'start b_i':>12} {'end b_i':>12} {'median step s':>14} {'model s':>9}"
    print(head)
    print("-" * len(head))
    for name in runs:
        r = result[name]
        b0 = "/".join(str(x["batch_size"]) for x in r["start_plan"]["ranks"])
        b1 = "/".join(str(x["batch_size"]) for x in r["end_plan"]["ranks"])
        print(f"{name:<9} {b0:>12} {b1:>12} {med[name]:>14.3f} {r['predicted_s']:>9.3f}")
    return med


def report(case, world_size, args, result):
    noisy = case == "noisy"
    lo, hi = (args.from_step, result["steps"])
    what = (f"fixed speeds {result['schedule']!r} beside a co-tenant busy {args.load_busy_s:g} s "
            f"/ idle {args.load_idle_s:g} s" if noisy
            else f"slowdown schedule {result['schedule']!r}")
    print(f"\n{world_size} CPU ranks, {what}; Llama-shaped "
          f"model: {args.layers} layers, hidden {args.hidden}, sequence {args.seq}, global "
          f"batch {args.global_batch_size}; {result['steps']} steps, median step time over steps "
          f"{lo}-{hi} (profiling took {result['profile_s']:.1f} s)")
    med = _table(result, NOISY_RUNS if noisy else RUNS, lo, hi)
    switches = result["adaptive"]["switches"]
    if noisy:
        print(f"switches: {len(switches)} (goal <= 1) after steps {[s['step'] for s in switches]}"
              f" to b_i {[s['batch_sizes'] for s in switches]}; static / adaptive = "
              f"{med['static'] / med['adaptive']:.2f}; switches that did not pay: "
              f"{len(result['adaptive']['not_paid'])}")
        print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
        return
    print(f"adaptive / oracle = {med['adaptive'] / med['oracle']:.2f} (goal <= 1.10); "
          f"static / adaptive = {med['static'] / med['adaptive']:.2f} (goal >= 1.5 for 1x -> 3x)")
    if switches:
        first, last = switches[0], switches[-1]
        print(f"switches after steps {[s['step'] for s in switches]}: the first "
              f"{first['step'] - args.change_step} steps after the change (step "
              f"{args.change_step}); measured scales {['%.2f' % x for x in last['scales']]}")
        print(f"after adaptation: predicted {last['predicted_after_s']:.3f} s per step, measured "
              f"{med['adaptive']:.3f} s (error "
              f"{100 * (last['predicted_after_s'] / med['adaptive'] - 1):+.1f}%: the whole step, "
              "planner/cost.py [Note: step terms])")
    else:
        print("no switch was taken")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--change-step", type=int, default=10)
    p.add_argument("--from-step", type=int, default=20, help="first step of the median window")
    p.add_argument("--cases", default="2,3,noisy",
                   help="2 (1x -> 3x), 3 (1/2/4x), noisy (2x/1x beside an on/off co-tenant)")
    p.add_argument("--noisy-steps", type=int, default=100, help="steps per run, noisy case")
    p.add_argument("--load-busy-s", type=float, default=3.0, help="noisy case: busy seconds")
    p.add_argument("--load-idle-s", type=float, default=3.0, help="noisy case: idle seconds")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--max-microbatch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="profiler: timed runs per m (median)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--json", help="also write the raw results here")
    p.set_defaults(model="llama")  # bench_hetero.build_model's Llama-shaped model
    p.add_argument("--smoke", action="store_true",
                   help="smallest settings: case 2 only, 6 steps, a 2-layer model (the suite's "
                        "check that the benchmark runs; numbers meaningless)")
    args = p.parse_args(argv)
    if args.smoke:
        args.cases, args.steps, args.change_step, args.from_step = "2", 6, 2, 3
        args.global_batch_size, args.max_microbatch_size, args.repeats = 4, 2, 1
        args.layers, args.hidden, args.intermediate, args.vocab, args.seq = 2, 32, 64, 64, 16
    results = {}
    for case in args.cases.split(","):
        if case not in (*CASES, "noisy"):
            raise SystemExit(f"--cases: unknown case {case!r}; use 2, 3 or noisy")
        world_size = len(NOISY_FACTORS) if case == "noisy" else len(CASES[case])
        port = free_port()
        got = dict(run_ranks(worker, [(r, world_size, case, args, port)
                                      for r in range(world_size)], timeout_s=3600))
        results[case] = got[0]
        report(case, world_size, args, got[0])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
