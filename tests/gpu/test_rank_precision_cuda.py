"""Precision per rank on CUDA (one GPU; skipped without CUDA; run by scripts/gpu_check.sh).

* ``auto`` from the real device's compute capability (bf16 on >= 8.0, fp16 on 7.x / 6.0).
* The claim behind ONE scaler on every rank (docs/engine.md "Precision per rank"): a bf16 or
  fp32 rank that scales its loss by the job's power-of-2 scale and unscales its shard gradients
  computes exactly what it computes without the scaler. Checked on the real CUDA kernels: the
  first step's unscaled shard gradients and the parameters after 3 AdamW steps of the scaled
  run equal the unscaled run's bit for bit (deterministic algorithms on, so both runs use the
  same kernels and summation orders; fp32 gathers, as in a job whose ranks differ).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hf_cephalo.engine import CephaloEngine
from hf_cephalo.engine.rank_precision import device_precisions, rank_precision
from hf_cephalo.models.toy import ToyConfig, ToyLM, ToyStaged
from hf_cephalo.profiles.precision import auto_precision
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model():
    torch.manual_seed(0)
    return ToyLM(ToyConfig(vocab_size=512, hidden_size=256, num_heads=4, num_layers=3,
                           mlp_ratio=4, max_seq_len=64, tie_embeddings=False))


def _run(device, group, precision: str, scaled: bool, batches):
    """3 steps of one rank computing in ``precision`` (as in a mixed job: fp32 gathers);
    returns (first step's unscaled shard grads, final shards)."""
    mine = rank_precision([precision, "fp16" if precision != "fp16" else "fp32"], 0)
    engine = CephaloEngine(ToyStaged(_model()), [1.0], process_group=group, device=device,
                           precision=mine.engine)
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    scaler = engine.make_grad_scaler(init_scale=2.0 ** 16) if scaled else None
    first = None
    for mbs in batches:
        engine.zero_grad()
        engine.train_step(mbs, loss_scale=scaler)
        if scaler is not None:
            scaler.unscale_(opt)
        if first is None:
            first = [p.grad.detach().clone() for p in engine.parameters()]
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return first, [p.detach().clone() for p in engine.parameters()]


def cuda_rank_precision_worker(rank, world):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = dist.new_group(backend="nccl")
    capability = torch.cuda.get_device_capability(device)
    expected = "bf16" if capability[0] >= 8 else \
        "fp16" if capability[0] >= 7 or capability == (6, 0) else "fp32"
    assert auto_precision(capability) == expected == device_precisions(device)[0], capability
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 512, (8, 64), generator=gen)
        batches.append([{"input_ids": ids[k:k + 4].to(device), "labels": ids[k:k + 4].to(device)}
                        for k in (0, 4)])
    report = {}
    for precision in [p for p in ("bf16", "fp32") if p in device_precisions(device)]:
        g_plain, p_plain = _run(device, group, precision, False, batches)
        g_scaled, p_scaled = _run(device, group, precision, True, batches)
        diff = max(float((a - b).abs().max()) for a, b in zip(g_plain + p_plain,
                                                              g_scaled + p_scaled) if a.numel())
        assert all(torch.equal(a, b) for a, b in zip(g_plain, g_scaled)), (precision, diff)
        assert all(torch.equal(a, b) for a, b in zip(p_plain, p_scaled)), (precision, diff)
        report[precision] = diff
    return report


@requires_cuda
def test_cuda_rank_precision_scaler_exact():
    print(run_ranks(cuda_rank_precision_worker, 1, timeout_s=300))
