"""Rank 0's peak host memory while saving a model: full state dict (old) vs streamed (new).

2 gloo ranks on CPU, a Llama of about 158 M parameters (633 MB in fp32; ``--quick``: ~24 M),
state ratios 0.8 / 0.2. In ONE run, each rank measures, around each save:

* ``old``: ``engine.full_state_dict()`` on rank 0 + ``model.save_pretrained(state_dict=...)``
  (what ``CephaloTrainer.save_model`` did before the streamed save);
* ``streamed 1 file``: ``save_pretrained_streamed`` with the default ``max_shard_size`` (50 GB:
  the whole model is one output file, so rank 0 still holds it once);
* ``streamed N files``: ``save_pretrained_streamed`` with ``--max-shard-size`` (default 50MB).

Peak = ``VmHWM`` (the kernel's peak RSS, reset through ``/proc/self/clear_refs`` before each
phase; a sampler thread reading ``VmRSS`` every millisecond is the fallback where the reset is
not allowed) minus ``VmRSS`` just before the phase, printed as a multiple of P = the model's fp32
parameter bytes. ``malloc_trim(0)`` runs between phases so freed heap pages of one phase are not
reused (and hidden) by the next.

    python benchmarks/bench_save_memory.py [--quick] [--max-shard-size 50MB]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# most parameters in the layers (as in a 7B model, where the root is ~4%), so the "one unit"
# part of the bound is one layer; a small vocabulary keeps the root unit below one layer's size
MODEL = dict(vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256)
QUICK = dict(MODEL, vocab_size=4000, hidden_size=512, intermediate_size=1408,
             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)
SMOKE = dict(MODEL, vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
RATIOS = [0.8, 0.2]


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class PeakRSS:
    """Context manager: ``delta_bytes`` = peak RSS during the body minus RSS at entry (bytes)."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s, self.delta_bytes, self._peak_kib = interval_s, 0, 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak_kib = max(self._peak_kib, _status_kib("VmRSS"))
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakRSS":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self._base_kib = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self._hwm = True
        except OSError:
            self._hwm = False
        self._peak_kib = self._base_kib
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        peak = max(self._peak_kib, _status_kib("VmHWM") if self._hwm else 0)
        self.delta_bytes = (peak - self._base_kib) * 1024


def _worker(rank: int, world_size: int, port: int, config: dict, shard: str, out_dir: str, q):
    import torch
    import torch.distributed as dist
    import transformers

    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.engine.export import save_pretrained_streamed
    from hf_cephalo.models import stage_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    fp32_bytes = sum(p.numel() for p in model.parameters()) * 4
    engine = CephaloEngine(stage_model(model), RATIOS)
    results = {}

    def old(path):
        state_dict = engine.full_state_dict()
        if rank == 0:
            model.save_pretrained(path, state_dict=state_dict)

    phases = [("old: full_state_dict + save_pretrained", old),
              ("streamed, 1 file (50GB default)", lambda p: save_pretrained_streamed(engine, p)),
              (f"streamed, max_shard_size {shard}",
               lambda p: save_pretrained_streamed(engine, p, max_shard_size=shard))]
    for i, (name, save) in enumerate(phases):
        dist.barrier()
        path = os.path.join(out_dir, f"phase{i}")
        with PeakRSS() as peak:
            save(path)
        dist.barrier()
        files = len([n for n in os.listdir(path) if n.endswith(".safetensors")]) if rank == 0 else 0
        results[name] = (peak.delta_bytes / fp32_bytes, files)
    q.put((rank, fp32_bytes, results))
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~24 M parameter model")
    parser.add_argument("--max-shard-size", default="50MB")
    parser.add_argument("--smoke", action="store_true",
                        help="smallest settings: 2 layers of hidden 64, 20 kB shards (the "
                             "suite's check that the benchmark runs; numbers meaningless)")
    args = parser.parse_args(argv)
    from rank_launch import free_port, run_ranks

    config = SMOKE if args.smoke else QUICK if args.quick else MODEL
    if args.smoke:
        args.max_shard_size = "20kB"
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        got = sorted(run_ranks(_worker, [(r, 2, port, config, args.max_shard_size, out_dir)
                                         for r in range(2)], timeout_s=600))
    fp32_bytes = got[0][1]
    print(f"Llama {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, vocab "
          f"{config['vocab_size']}: P = {fp32_bytes / 1e6:.0f} MB fp32; ratios {RATIOS}")
    print(f"{'phase':<42} {'rank 0 peak-base / P':>21} {'rank 1':>8} {'files':>6}")
    for name in got[0][2]:
        (r0, files), (r1, _) = got[0][2][name], got[1][2][name]
        print(f"{name:<42} {r0:>21.2f} {r1:>8.2f} {files:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
