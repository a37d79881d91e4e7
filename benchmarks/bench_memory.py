"""Host memory of a 2-rank CPU job at start, in training and while saving (issue 12).

A Llama of about 0.47 B parameters (hidden 1024, 24 layers, vocabulary 32000, untied; ~1.9 GB
in fp32) is built from its config with random init, saved ONCE as sharded safetensors
(``save_pretrained(max_shard_size="400MB")``) to a temporary folder, and freed. Then, per mode,
2 gloo ranks are started (one mode at a time, so the machine holds one job's memory):

- ``old``: the start before sharded loading: every rank ``from_pretrained`` the whole model, then
  builds the engine (state ratios 0.8 / 0.2). (a) only.
- ``new``: ``hf_cephalo.from_pretrained_sharded`` (meta device) + engine: each rank reads only its
  shards. Then (b) 3 training steps (AdamW, batch 1, 16 tokens) and (c) a save.

Per rank it prints, as multiples of P (the model's fp32 parameter bytes), the peak RSS minus the
process's RSS right before loading:
  (a) at start, (b) over 3 training steps, (c) during save,
next to the targets: (a) <= r_i + 2 units (unit = the largest unit, the root here);
(b) <= the plan's predicted memory r_i·S + M_i(m_i) (S = 16 bytes x parameters: 4 P; M_i
measured by the profiler on a 1-layer model of the same shapes) within 15 %; (c) rank 0 <= r_0 +
one output shard + 2 units.

Peak RSS: the kernel's high-water mark of the process (``VmHWM`` in /proc/self/status), reset
to the current RSS at the start of each phase by writing 5 to /proc/self/clear_refs (Linux >= 4.0).
Unlike a sampling thread it misses no short peak (a sampler needs the GIL, which long C++
calls hold). RSS counts file pages mapped into the process too (safetensors reads through mmap).

(c) measures the save on THIS branch: ``engine.full_state_dict()`` (every unit gathered to rank
0) + ``safetensors.torch.save_file`` on rank 0 — the streamed sharded save is another branch's.

Usage: python benchmarks/bench_memory.py [--quick]   (--quick: a ~60 M-parameter model)
"""

from __future__ import annotations

import argparse
import io
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RATIOS = (0.8, 0.2)
BASELINE_REF = "1008393"  # the commit before sharded loading (issue 12): today's start
STEPS = 3
SEQ = 16


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


class PeakRss:
    """Peak RSS of a phase, in bytes above ``base_bytes`` (kernel high-water mark)."""

    def __init__(self):
        self.base_bytes = _status_kib("VmRSS") * 1024

    @staticmethod
    def reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak_bytes(self) -> int:
        return _status_kib("VmHWM") * 1024 - self.base_bytes

    def now_bytes(self) -> int:
        return _status_kib("VmRSS") * 1024 - self.base_bytes


def config(quick: bool):
    from transformers import LlamaConfig

    hidden, layers, vocab = (512, 8, 16000) if quick else (1024, 24, 32000)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                       max_position_embeddings=64, tie_word_embeddings=False)


def save_checkpoint(cfg, path: str, max_shard_size: str) -> int:
    """Random-init model saved sharded; returns its parameter count."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return n


def predicted_compute_bytes(cfg) -> list[float]:
    """M_i(m) at m = 1 for each rank: the profiler on a 1-layer model of the same shapes."""
    from transformers import LlamaForCausalLM

    from hf_cephalo.models import stage_model
    from hf_cephalo.planner import cost
    from hf_cephalo.profiler.measure import MeasureConfig, measure_device

    small = cfg.__class__(**{**cfg.to_dict(), "num_hidden_layers": 1})
    staged = stage_model(LlamaForCausalLM(small))
    profile = measure_device(staged, MeasureConfig(max_microbatch_size=2, sequence_length=SEQ,
                                                   warmup=0, repeats=1, progress=False),
                             device="cpu", name="cpu", capacity_bytes=24 * 2 ** 30)
    return [float(cost.compute_memory_bytes(profile, 1))] * len(RATIOS)


def extract_baseline(ref: str, dest: str) -> str | None:
    """``hf_cephalo`` as of git ``ref`` (the code before sharded loading) extracted into
    ``dest``; None (with a note) when git or the ref is not available."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        tar = subprocess.run(["git", "-C", repo, "archive", "--format=tar", ref, "hf_cephalo"],
                             check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"baseline: cannot extract hf_cephalo at {ref!r} ({exc}); skipped", flush=True)
        return None
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(dest, filter="data")
    return dest


def _warm_up() -> None:
    """Imports and lazy initializations a load pulls in, done before the baseline RSS (they are
    a fixed few tens of MB, not part of loading)."""
    import safetensors.torch  # noqa: F401
    import transformers

    from hf_cephalo.engine import CephaloEngine  # noqa: F401
    from hf_cephalo.models import stage_model

    with torch.device("meta"):
        stage_model(transformers.LlamaForCausalLM(config(True)))


def _rank(rank: int, world_size: int, port: int, mode: str, path: str, baseline: str | None,
          out) -> None:
    if baseline is not None:  # today's code, imported instead of this branch's
        sys.path.insert(0, baseline)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import transformers

    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models import stage_model

    _warm_up()
    rss = PeakRss()
    rss.reset()
    if mode == "old":
        model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        import hf_cephalo

        model = hf_cephalo.from_pretrained_sharded(path)
    engine = CephaloEngine(stage_model(model), list(RATIOS))
    units = engine.units + [engine.root]
    result = {"a": rss.peak_bytes(), "a_after": rss.now_bytes(),
              "shards": sum(u.local_numel for u in units) * 4}
    if mode == "new":
        result["b"] = _train(engine, rss, rank)
        result["c"] = _save(engine, rss, rank, path)
    out.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def _train(engine, rss: PeakRss, rank: int) -> int:
    vocab = engine.staged.model.config.vocab_size
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-4)
    rss.reset()
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, vocab, (1, SEQ), generator=gen)
        engine.train_step([{"input_ids": ids, "labels": ids}])
        engine.clip_grad_norm_(1.0)
        opt.step()
        engine.zero_grad()
    return rss.peak_bytes()


def _save(engine, rss: PeakRss, rank: int, path: str) -> int:
    from safetensors.torch import save_file

    rss.reset()
    state = engine.full_state_dict()
    if rank == 0:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
            save_file(state, os.path.join(tmp, "model.safetensors"))
    del state
    dist.barrier()
    return rss.peak_bytes()


def run_mode(mode: str, path: str, baseline: str | None = None) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, len(RATIOS), port, mode, path, baseline, out))
             for r in range(len(RATIOS))]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(len(RATIOS))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~50 M-parameter model")
    parser.add_argument("--baseline-ref", default=BASELINE_REF, help=(
        "git ref of the code before sharded loading, run for the (a) baseline (default: the "
        "commit this branch started from)"))
    args = parser.parse_args()
    cfg = config(args.quick)
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        path = os.path.join(tmp, "ckpt")
        n = save_checkpoint(cfg, path, "50MB" if args.quick else "400MB")
        P = 4.0 * n
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        shard_p = max(os.path.getsize(os.path.join(path, f)) for f in files) / P
        h = cfg.hidden_size
        layer_p = (4 * h * h + 3 * h * cfg.intermediate_size + 2 * h) * 4 / P
        unit_p = max(layer_p, (2 * cfg.vocab_size * h + h) * 4 / P)
        compute = predicted_compute_bytes(cfg)
        print(f"model: {n / 1e6:.1f} M parameters, P = {P / 2 ** 30:.2f} GiB fp32; "
              f"{len(files)} files (largest {shard_p:.3f} P); largest unit (root) "
              f"{unit_p:.3f} P, one layer {layer_p:.4f} P; ratios {RATIOS}", flush=True)
        baseline = extract_baseline(args.baseline_ref, os.path.join(tmp, "baseline"))
        old = run_mode("old", path, baseline)
        new = run_mode("new", path)
    print(f"{'rank':>4} {'r_i':>5} {'shards':>6} | {'(a) old':>8} {'after':>6} | "
          f"{'(a) new':>8} {'after':>6} {'target':>7} | {'(b)':>6} {'pred':>6} {'x1.15':>6} | "
          f"{'(c)':>6} {'target':>7}")
    for rank, (r, o, w) in enumerate(zip(RATIOS, old, new)):
        pred = (4 * r * P + compute[rank]) / P
        c_target = f"{r + shard_p + 2 * unit_p:7.3f}" if rank == 0 else f"{'-':>7}"
        print(f"{rank:>4} {r:>5.2f} {w['shards'] / P:6.3f} | {o['a'] / P:8.3f} "
              f"{o['a_after'] / P:6.3f} | {w['a'] / P:8.3f} {w['a_after'] / P:6.3f} "
              f"{r + 2 * unit_p:7.3f} | {w['b'] / P:6.3f} {pred:6.3f} {1.15 * pred:6.3f} | "
              f"{w['c'] / P:6.3f} {c_target}")
    print(f"(a) old: hf_cephalo at {args.baseline_ref} (today's start): from_pretrained (whole "
          "model) + engine; (a) new: from_pretrained_sharded + engine; after: RSS above the "
          "baseline once the engine is built; shards: this rank's shard bytes; (b) over "
          f"{STEPS} AdamW steps (batch 1, {SEQ} tokens); pred: r_i*16 bytes*N + M_i(1) of the "
          "profiler; (c) full_state_dict + save_file on rank 0 (this branch's save, not "
          "streamed).")


if __name__ == "__main__":
    main()
