"""Construction on CUDA: peak device memory <= this rank's shards + one unit (issue 12.1).

Skipped without CUDA. Two gloo ranks share GPU 0 (construction from a checkpoint or a seeded
init issues no collective, and each process has its own CUDA allocator statistics); each
builds the engine with state ratios 0.8 / 0.2 on ``cuda:0`` and checks
``torch.cuda.max_memory_allocated()`` against its shards' bytes + the largest unit's bytes +
the buffers' bytes (+ 1 MiB for the allocator's 512-byte rounding of a few hundred blocks).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.dist_utils import run_ranks

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SLACK_BYTES = 1 << 20


def _config():
    return transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024,
                                    num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=4, max_position_embeddings=64,
                                    tie_word_embeddings=False)


def _worker(rank, world_size, path):
    import hf_cephalo
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models import stage_model

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    out = {}
    for start in ("checkpoint", "init"):
        if start == "checkpoint":
            model = hf_cephalo.from_pretrained_sharded(path)
        else:
            with torch.device("meta"):
                model = transformers.LlamaForCausalLM(_config())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        engine = CephaloEngine(stage_model(model), [0.8, 0.2], device=device)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - base
        units = engine.units + [engine.root]
        shard_bytes = sum(p.local.numel() * p.element_size for u in units for p in u.parts)
        unit_bytes = max(u.numel for u in units) * 4
        buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        bound = shard_bytes + unit_bytes + buffer_bytes + SLACK_BYTES
        assert peak <= bound, f"{start}: peak {peak} > shards {shard_bytes} + unit {unit_bytes}"
        out[start] = (peak, bound)
        del engine, model
        torch.cuda.empty_cache()
    return out


@requires_cuda
def test_construction_peak_device_memory(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "ckpt")
    transformers.LlamaForCausalLM(_config()).save_pretrained(path, max_shard_size="5MB")
    results = run_ranks(_worker, 2, path, timeout_s=300)
    for rank, out in enumerate(results):
        for start, (peak, bound) in out.items():
            assert peak <= bound, (rank, start, peak, bound)
