"""Gradient error of each precision mode vs the float64 truth (2 gloo ranks, CPU).

One step of a toy LM (hidden 64, 4 layers, uneven plan 0.7/0.3, l = 8 microbatches on rank 0
and 4 on rank 1): the relative L2 error ||g - g64|| / ||g64|| of the reduced fp32 shard
gradients, gathered over all units. Besides one precision for every rank, precision per rank
(docs/engine.md "Precision per rank"): each rank autocasts in its own precision, fp32
all-gathers and reduce-scatters, and every rank applies the same loss scale once a rank is fp16.
Usage: python benchmarks/bench_precision_error.py [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

from hf_cephalo.engine import CephaloEngine, EnginePrecision
from hf_cephalo.engine.rank_precision import rank_precision
from hf_cephalo.models.toy import ToyConfig, ToyLM, ToyStaged
from rank_launch import free_port, run_ranks  # this folder is on sys.path
from tests.test_engine_parity import make_batch, split_microbatches

BF16, FP16 = torch.bfloat16, torch.float16
MODES = {  # name: EnginePrecision(compute, param, reduce) arguments
    "fp32": (None, None, None),
    "bf16 autocast, fp32 gathered": (BF16, None, None),
    "bf16 gathered, fp32 reduce": (BF16, BF16, None),
    "bf16 gathered, bf16 reduce": (BF16, BF16, BF16),
    "fp16 autocast, fp32 gathered": (FP16, None, None),
    "fp16 gathered, fp32 reduce": (FP16, FP16, None),
    "fp16 gathered, fp16 reduce": (FP16, FP16, FP16),
}
PER_RANK = {  # name: per rank (rank 0 has 8 microbatches, rank 1 4) its precision
    "per rank: bf16 / fp32": ["bf16", "fp32"],
    "per rank: fp16 / fp32": ["fp16", "fp32"],
    "per rank: bf16 / fp16": ["bf16", "fp16"],
    "per rank: fp32 / bf16": ["fp32", "bf16"],
}


def _grads(rank, model, mbs, dtype=None, precision=EnginePrecision(), scaled=None):
    engine = CephaloEngine(ToyStaged(model.to(dtype) if dtype else model), [0.7, 0.3],
                           precision=precision)
    if scaled is None:
        scaled = precision.compute == FP16
    scale = 1024.0 if scaled else None  # fp16: a fixed loss scale (every rank), unscaled below
    engine.train_step(mbs, loss_scale=scale)
    grads = [p.grad.double() / (scale or 1.0) for p in engine.parameters()]
    gathered = [torch.zeros(0, dtype=torch.float64)] * 2
    out = [None, None]
    torch.distributed.all_gather_object(out, [g.tolist() for g in grads])
    return torch.cat([torch.tensor(sum((o[u] for o in out), []), dtype=torch.float64)
                      for u in range(len(grads))]) if rank == 0 else gathered[0]


def worker(rank, world, port, smoke, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out.put((rank, errors(rank, smoke)))
    finally:
        torch.distributed.destroy_process_group()


def errors(rank, smoke: bool) -> dict[str, float]:
    """Rank 0: each precision's gradient error relative to float64 (``smoke``: two modes and
    one per-rank list, on 2 layers of hidden 32)."""
    torch.manual_seed(0)
    model = ToyLM(ToyConfig(vocab_size=256, hidden_size=32 if smoke else 64, num_heads=4,
                            num_layers=2 if smoke else 4, mlp_ratio=4, max_seq_len=32,
                            tie_embeddings=False))
    gen = torch.Generator().manual_seed(1)
    ids, labels = make_batch(gen, 12, 32, 256)
    mbs = split_microbatches(ids, labels, [8, 4], [1, 1], rank)
    truth = _grads(rank, copy.deepcopy(model), mbs, torch.float64)
    out = {}
    for name, modes in list(MODES.items())[:2 if smoke else None]:
        g = _grads(rank, copy.deepcopy(model), mbs, None, EnginePrecision(*modes))
        if rank == 0:
            out[name] = float((g - truth).norm() / truth.norm())
    for name, precisions in list(PER_RANK.items())[:1 if smoke else None]:
        mine = rank_precision(precisions, rank)
        g = _grads(rank, copy.deepcopy(model), mbs, None, mine.engine, mine.loss_scaling)
        if rank == 0:
            out[name] = float((g - truth).norm() / truth.norm())
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="two precisions and one per-rank list on a 2-layer model (the "
                             "suite's check that the benchmark runs)")
    args = parser.parse_args(argv)
    port = free_port()
    got = dict(run_ranks(worker, [(r, 2, port, args.smoke) for r in range(2)], timeout_s=600))
    for name, err in got[0].items():
        print(f"| {name} | {err:.2e} |")


if __name__ == "__main__":
    main()
