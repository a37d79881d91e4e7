"""In-memory re-layout of r_i (``engine/relayout.py``): bytes moved vs the ideal, peak extra memory,
time, next to a checkpoint save + load onto the same plan (gloo ranks on CPU).

A Llama-shaped model (transformers ``LlamaForCausalLM``, ``--layers`` layers of hidden
``--hidden``, MLP 4x, vocab ``--vocab``, fp32) is trained one AdamW step on the old plan (so
the optimizer holds exp_avg / exp_avg_sq), then per rank:

* save: ``save_checkpoint`` (shards + optimizer state) of the old layout, timed;
* re-layout: ``relayout_state`` onto the new ratios, timed; counted all-to-all bytes
  (``CollectiveStats.relayout_*``) next to the ideal (the elements whose owner changes, from the
  two layouts); resident memory (``/proc/self/status`` VmRSS before / after, VmHWM peak after
  resetting it through ``/proc/self/clear_refs``) with glibc's mmap threshold fixed at 128 KiB
  (``MALLOC_MMAP_THRESHOLD_``) so freed shards go back to the system and RSS follows live
  tensors; "extra" = peak - max(before, after), next to this rank's largest one-unit new
  shard-set and its whole training state after the move;
* load: an engine built for the new plan loads the checkpoint (``load_sharded`` +
  ``load_sharded_optimizer``), timed.

Cases: 2 ranks (0.5, 0.5) -> (1.0, 0.0); 3 ranks (0.5, 0.3, 0.2) -> (0.0, 0.4, 0.6).

Usage: python benchmarks/bench_relayout.py [--hidden 256] [--layers 6] [--vocab 2048]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from rank_launch import free_port, run_ranks  # this folder is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {2: ([0.5, 0.5], [1.0, 0.0]), 3: ([0.5, 0.3, 0.2], [0.0, 0.4, 0.6])}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _ideal(rows_old, rows_new, units, rank: int, tensors: int) -> tuple[int, int, int]:
    """(sent, received, largest one-unit new shard-set) bytes of ``rank`` from the layouts."""
    from hf_cephalo.engine.flat_param import split_unit_row

    sent = received = peak = 0
    for old, new, unit in zip(rows_old, rows_new, units):
        k_old, k_new = (split_unit_row(r, unit.trainable_numel)[0] for r in (old, new))
        world = torch.arange(len(old))
        was = torch.repeat_interleave(world, torch.tensor(k_old))
        now = torch.repeat_interleave(world, torch.tensor(k_new))
        size = tensors * unit.trainable.element_size
        sent += int(((was == rank) & (now != rank)).sum()) * size
        received += int(((now == rank) & (was != rank)).sum()) * size
        if old != new:
            peak = max(peak, int((now == rank).sum()) * size)
    return sent, received, peak


def _model(args):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                   intermediate_size=4 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=4,
                                   num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _engine(args, ratios):
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models import stage_model

    engine = CephaloEngine(stage_model(_model(args).train()), ratios)
    return engine, torch.optim.AdamW(engine.parameters(), lr=1e-4)


def _worker(rank, world, port, args, directory, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from hf_cephalo.engine import checkpoint as ckpt
    from hf_cephalo.planner import Plan
    from hf_cephalo.runtime.session import relayout_onto_plan

    old, new = CASES[world]
    engine, opt = _engine(args, old)
    ids = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(rank))
    engine.train_step([{"input_ids": ids, "labels": ids}])
    opt.step()
    engine.zero_grad()
    t0 = time.perf_counter()
    ckpt.save_checkpoint(engine, directory, opt)
    save_s = time.perf_counter() - t0
    rows_old = [list(u.numel_per_rank) for u in engine.all_units()]
    plan = Plan.from_ratios([1] * world, [1] * world, new)
    engine.stats.reset()
    dist.barrier()
    before_kib, peak_ok = _status_kib("VmRSS"), _reset_peak()
    t0 = time.perf_counter()
    relayout_onto_plan(engine, opt, plan)
    relayout_s = time.perf_counter() - t0
    after_kib, peak_kib = _status_kib("VmRSS"), _status_kib("VmHWM")
    rows_new = [list(u.numel_per_rank) for u in engine.all_units()]
    sent, received, unit_set = _ideal(rows_old, rows_new, engine.all_units(), rank, 3)
    state_bytes = sum(3 * p.numel() * p.element_size() for p in engine.parameters())
    twin, twin_opt = _engine(args, new)
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.load_checkpoint(twin, directory, twin_opt)
    load_s = time.perf_counter() - t0
    out.put(dict(rank=rank, stats=engine.stats.as_dict(), ideal_sent=sent, ideal_received=received,
                 unit_set=unit_set, state=state_bytes, before=before_kib * 1024,
                 after=after_kib * 1024, peak=peak_kib * 1024 if peak_ok else None,
                 save_s=save_s, relayout_s=relayout_s, load_s=load_s))
    dist.barrier()
    dist.destroy_process_group()


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.1f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true",
                        help="smallest settings: the 2-rank case, 2 layers of hidden 32 (the suite's check that the "
                             "benchmark runs; numbers meaningless)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.vocab = 32, 2, 64
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned ranks
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32, AdamW")
    for world, (old, new) in list(CASES.items())[:1 if args.smoke else None]:
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            rows = sorted(run_ranks(_worker, [(r, world, port, args, os.path.join(tmp, "ckpt"))
                                              for r in range(world)], timeout_s=900),
                          key=lambda r: r["rank"])
        print(f"\n{world} ranks: r = {old} -> {new}")
        print("rank | sent MiB (ideal) | received MiB (ideal) | all-to-alls | RSS before / after "
              "/ peak MiB | extra MiB | one-unit set MiB | state after MiB | peak counted MiB "
              "| relayout s | save s | load s")
        for r in rows:
            st = r["stats"]
            extra = None if r["peak"] is None else r["peak"] - max(r["before"], r["after"])
            print(f"{r['rank']} | {_mib(st['relayout_sent_bytes'])} ({_mib(r['ideal_sent'])}) | "
                  f"{_mib(st['relayout_received_bytes'])} ({_mib(r['ideal_received'])}) | "
                  f"{st['relayout_count']} | {_mib(r['before'])} / {_mib(r['after'])} / "
                  f"{_mib(r['peak'])} | {_mib(extra)} | {_mib(r['unit_set'])} | "
                  f"{_mib(r['state'])} | {_mib(st['peak_relayout_buffer_bytes'])} | "
                  f"{r['relayout_s']:.3f} | {r['save_s']:.3f} | {r['load_s']:.3f}")


if __name__ == "__main__":
    main()
