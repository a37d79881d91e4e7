"""CUDA paths of the engine (side streams, pinned-memory offload), one GPU.

Skipped without CUDA. Run by scripts/gpu_check.sh. Each worker runs under the gloo harness and
builds a one-rank NCCL group for the engine, so the NCCL collectives on the all-gather stream,
the offload stream and their events are all exercised.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from hf_cephalo.engine import CephaloEngine
from hf_cephalo.models.toy import ToyConfig, ToyLM, ToyStaged
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _batch(n, seq, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, seq), generator=gen)
    labels = ids.clone()
    labels[::3, seq // 2:] = -100
    return ids, labels


def cuda_parity_worker(rank, world):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", 0)
    group = dist.new_group(backend="nccl")
    cfg = ToyConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=3, max_seq_len=16,
                    tie_embeddings=True, frozen_norm=True)
    for micro in ([8], [4, 4], [1] * 8, [3, 5]):
        torch.manual_seed(0)
        model = ToyLM(cfg).to(device)
        ref = copy.deepcopy(model)
        engine = CephaloEngine(ToyStaged(model), process_group=group, device=device,
                               activation_checkpointing=micro != [3, 5])
        assert engine.offload_activations and engine.streams is not None
        opt = torch.optim.AdamW(engine.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for step in range(3):
            ids, labels = _batch(8, 16, cfg.vocab_size, seed=step)
            ids, labels = ids.to(device), labels.to(device)
            mbs, k = [], 0
            for m in micro:
                mbs.append({"input_ids": ids[k:k + m], "labels": labels[k:k + m]})
                k += m
            engine.stats.reset()
            out = engine.train_step(mbs)
            assert engine.stats.peak_stash_host_bytes > 0
            assert engine.stats.peak_stash_device_bytes == 0
            opt.step()
            engine.zero_grad()
            ref_opt.zero_grad()
            loss, _ = ref(ids, labels)
            loss.backward()
            ref_opt.step()
            torch.testing.assert_close(out.loss, float(loss), rtol=1e-5, atol=1e-6)
        full = engine.full_state_dict()
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(full[key], value.cpu(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{micro} {key}: {m}")
    return True


def cuda_memory_worker(rank, world):
    """Peak device memory of a step does not grow with the number of microbatches at a fixed
    microbatch size once boundary activations are offloaded (paper §3.3)."""
    device = torch.device("cuda", 0)
    group = dist.new_group(backend="nccl")
    cfg = ToyConfig(vocab_size=256, hidden_size=256, num_heads=4, num_layers=4,
                    max_seq_len=256)
    peaks = {}
    for num_mb in (1, 8):
        torch.manual_seed(0)
        engine = CephaloEngine(ToyStaged(ToyLM(cfg).to(device)), process_group=group,
                               device=device)
        ids, _ = _batch(2 * num_mb, 256, cfg.vocab_size, seed=1)
        mbs = [{"input_ids": ids[k:k + 2].to(device)} for k in range(0, 2 * num_mb, 2)]
        engine.train_step(mbs)
        engine.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        engine.train_step(mbs)
        torch.cuda.synchronize()
        peaks[num_mb] = torch.cuda.max_memory_allocated() - base
    # inputs on the device grow with l (tiny); everything else must not
    assert peaks[8] <= 1.15 * peaks[1], peaks
    return peaks


@requires_cuda
def test_cuda_streams_offload_parity():
    assert run_ranks(cuda_parity_worker, 1, timeout_s=300) == [True]


@requires_cuda
def test_cuda_peak_memory_flat_in_microbatches():
    run_ranks(cuda_memory_worker, 1, timeout_s=300)
