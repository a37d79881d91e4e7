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
next to the targets: (a) <= r_i + 2 units;
(b) <= the plan's predicted memory within 15 % (``planner.predict``: r_i·S + M_i(1, 1), every
engine buffer of planner/memory.py with the plan's shard layout, A_i measured by the profiler on
a 1-layer model of the same shapes); (c) rank 0 <= r_0 + one output shard + 2 units (unit = the
largest engine unit: the head, final norm + lm_head, with the split root).

Peak RSS: the kernel's high-water mark of the process (``VmHWM`` in /proc/self/status), reset
to the current RSS at the start of each phase by writing 5 to /proc/self/clear_refs (Linux >= 4.0).
Unlike a sampling thread it misses no short peak (a sampler needs the GIL, which long C++
calls hold). RSS counts file pages mapped into the process too (safetensors reads through mmap).

(c) measures ``save_pretrained_streamed`` (``--save-files 8``: max_shard_size = P/8, several
files); ``(c) old`` the save before it, ``engine.full_state_dict()`` (every unit gathered to rank
0) + ``safetensors.torch.save_file`` on rank 0. ``malloc_trim(0)`` runs before each phase, so a
phase starts from live memory rather than from pages an earlier phase freed into the heap.

Usage: python benchmarks/bench_memory.py [--quick] [--foreach] [--save-files 8]
(--quick: a ~50 M-parameter model; --foreach: AdamW's foreach kernels instead of torch's CPU
default, the per-tensor loop)
"""

from __future__ import annotations

import argparse
import ctypes
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile

import torch
import torch.distributed as dist

from rank_launch import free_port, run_ranks  # this folder is on sys.path

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


def config(quick: bool, smoke: bool = False):
    from transformers import LlamaConfig

    hidden, layers, vocab = (64, 2, 256) if smoke else (512, 8, 16000) if quick else \
        (1024, 24, 32000)
    heads = 4 if smoke else 16
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=heads,
                       max_position_embeddings=64, tie_word_embeddings=False)


def save_checkpoint(cfg, path: str, max_shard_size: str) -> int:
    """Random-init model saved sharded; returns its parameter count."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return n


def predicted_memory_bytes(cfg) -> list[float]:
    """The planner's own predicted memory of this job per rank (bytes): ``planner.predict`` of
    the plan (b_i = m_i = 1, state ratios ``RATIOS``) on a profile of THIS model: its
    ``ModelProfile`` from the full config built on the meta device (parameter counts, the
    root's split), the activation memory A_i(m) and the boundary bytes measured by the
    profiler on CPU on a 1-layer model of the same shapes (a unit's activations do not depend on
    the number of layers). r_i·S + M_i(1, 1): the state plus every engine buffer
    (planner/memory.py [Note: memory terms]) with the plan's own shard layout."""
    from transformers import LlamaForCausalLM

    from hf_cephalo.models import stage_model
    from hf_cephalo.planner import Plan
    from hf_cephalo.planner.predict import predict
    from hf_cephalo.profiler.measure import (MeasureConfig, boundary_bytes_per_sample,
                                             measure_device, model_profile,
                                             synthetic_microbatch)
    from hf_cephalo.profiles.types import ClusterProfile, CommProfile

    small = stage_model(LlamaForCausalLM(cfg.__class__(**{**cfg.to_dict(),
                                                          "num_hidden_layers": 1})))
    device = measure_device(small, MeasureConfig(max_microbatch_size=2, sequence_length=SEQ,
                                                 warmup=0, repeats=1, progress=False),
                            device="cpu", name="cpu", capacity_bytes=1e12)
    a = boundary_bytes_per_sample(small, lambda m: synthetic_microbatch(small.model, m, SEQ),
                                  "cpu")
    with torch.device("meta"):
        full = stage_model(LlamaForCausalLM(cfg))
    cluster = ClusterProfile(model=model_profile(full, "bench", a), devices=[device] * len(RATIOS),
                             comm=CommProfile(allgather_s=0.0, reducescatter_s=0.0))
    plan = Plan.from_ratios([1] * len(RATIOS), [1] * len(RATIOS), list(RATIOS))
    return [r.memory_bytes for r in predict(plan, cluster).ranks]


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


def _trim() -> None:
    """Return the heap's free pages to the kernel (glibc ``malloc_trim``), so a phase's RSS
    starts from live memory, not from what an earlier phase freed into the allocator."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _rank(rank: int, world_size: int, port: int, mode: str, path: str, baseline: str | None,
          opts: dict, out) -> None:
    if baseline is not None:  # today's code, imported instead of this branch's
        sys.path.insert(0, baseline)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import transformers

    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models import stage_model

    _warm_up()
    _trim()
    rss = PeakRss()
    rss.reset()
    if mode == "old":
        model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        import hf_cephalo

        model = hf_cephalo.from_pretrained_sharded(path)
    engine = CephaloEngine(stage_model(model), list(RATIOS))
    root = engine.root  # the split root's two units (today's code: one root unit)
    units = engine.units + (list(root.both()) if hasattr(root, "both") else [root])
    result = {"a": rss.peak_bytes(), "a_after": rss.now_bytes(),
              "shards": sum(u.local_numel for u in units) * 4}
    if mode == "new":
        result["b"], result["b_after"], result["b_live"] = _train(engine, rss, rank,
                                                                  opts["foreach"])
        (result["c"], result["files"], result["c_before"],
         result["c_live"]) = _save_streamed(engine, rss, path, opts["shard_bytes"])
        result["c_old"] = _save_full(engine, rss, rank, path)
    out.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def _train(engine, rss: PeakRss, rank: int, foreach: bool | None) -> tuple[int, int, int]:
    """Peak and final RSS above the base over STEPS AdamW steps, and the peak of the tensors
    the steps allocate (``LiveTensorBytes``: gathered units, gradients, Adam's moments, ...).
    ``foreach`` None: torch's default, the per-tensor loop on CPU; True: the foreach kernels,
    which make temporary copies of every shard's moments."""
    from hf_cephalo.profiler.live_memory import LiveTensorBytes  # not at import: baseline runs

    vocab = engine.staged.model.config.vocab_size
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-4, foreach=foreach)
    _trim()
    rss.reset()
    with LiveTensorBytes() as live:
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + rank)
            ids = torch.randint(0, vocab, (1, SEQ), generator=gen)
            engine.train_step([{"input_ids": ids, "labels": ids}])
            engine.clip_grad_norm_(1.0)
            opt.step()
            engine.zero_grad()
    return rss.peak_bytes(), rss.now_bytes(), live.peak_bytes


def _save_streamed(engine, rss: PeakRss, path: str,
                   shard_bytes: int) -> tuple[int, int, int, int]:
    """Peak RSS above the base during ``save_pretrained_streamed`` (files of at most
    ``shard_bytes``), the number of files written (rank 0; 0 elsewhere) and the RSS above the
    base right before the save, and the peak of the tensors the save allocates."""
    from hf_cephalo.engine.export import save_pretrained_streamed
    from hf_cephalo.profiler.live_memory import LiveTensorBytes

    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        dist.barrier()
        _trim()
        rss.reset()
        before = rss.now_bytes()
        with LiveTensorBytes() as live:
            save_pretrained_streamed(engine, os.path.join(tmp, "out"),
                                     max_shard_size=shard_bytes)
        peak = rss.peak_bytes()
        files = len([f for f in os.listdir(os.path.join(tmp, "out"))
                     if f.endswith(".safetensors")]) if engine.rank == 0 else 0
        dist.barrier()
    return peak, files, before, live.peak_bytes


def _save_full(engine, rss: PeakRss, rank: int, path: str) -> int:
    """The save before the streamed one (baseline): ``engine.full_state_dict()`` (every unit
    gathered to rank 0) + one ``save_file`` on rank 0."""
    from safetensors.torch import save_file

    dist.barrier()
    _trim()
    rss.reset()
    state = engine.full_state_dict()
    if rank == 0:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
            save_file(state, os.path.join(tmp, "model.safetensors"))
    del state
    dist.barrier()
    return rss.peak_bytes()


def run_mode(mode: str, path: str, baseline: str | None = None,
             opts: dict | None = None) -> list[dict]:
    port = free_port()
    results = dict(run_ranks(_rank, [(r, len(RATIOS), port, mode, path, baseline, opts or {})
                                     for r in range(len(RATIOS))], timeout_s=3600))
    return [results[r] for r in range(len(RATIOS))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~50 M-parameter model")
    parser.add_argument("--baseline-ref", default=BASELINE_REF, help=(
        "git ref of the code before sharded loading, run for the (a) baseline (default: the "
        "commit before issue 12)"))
    parser.add_argument("--save-files", type=int, default=8, help=(
        "(c): the streamed save's max_shard_size is P / this (default 8: several files)"))
    parser.add_argument("--foreach", action="store_true", help=(
        "(b): AdamW(foreach=True) instead of torch's CPU default (the per-tensor loop)"))
    parser.add_argument("--smoke", action="store_true",
                        help="smallest settings: a 2-layer model of hidden 64, no baseline checkout "
                             "(the suite's check that the benchmark runs; numbers meaningless)")
    args = parser.parse_args(argv)
    cfg = config(args.quick, args.smoke)
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        path = os.path.join(tmp, "ckpt")
        n = save_checkpoint(cfg, path, "100kB" if args.smoke else "50MB" if args.quick
                            else "400MB")
        P = 4.0 * n
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        h, v = cfg.hidden_size, cfg.vocab_size
        layer_p = (4 * h * h + 3 * h * cfg.intermediate_size + 2 * h) * 4 / P
        unit_p = max(layer_p, v * h * 4 / P, (v * h + h) * 4 / P)  # a layer, E, H (split root)
        shard_bytes = int(P / args.save_files)
        predicted = predicted_memory_bytes(cfg)
        print(f"model: {n / 1e6:.1f} M parameters, P = {P / 2 ** 30:.3f} GiB fp32; checkpoint "
              f"{len(files)} files; largest unit {unit_p:.4f} P (head: norm + lm_head), one "
              f"layer {layer_p:.4f} P; ratios {RATIOS}; streamed save max_shard_size "
              f"{shard_bytes / 2 ** 20:.0f} MiB (P/{args.save_files}); AdamW foreach="
              f"{args.foreach or None}", flush=True)
        baseline = None if args.smoke else \
            extract_baseline(args.baseline_ref, os.path.join(tmp, "baseline"))
        old = run_mode("old", path, baseline) if baseline else [{"a": float("nan"),
                                                                "a_after": float("nan")}] * 2
        new = run_mode("new", path, opts={"foreach": True if args.foreach else None,
                                          "shard_bytes": shard_bytes})
    print(f"{'rank':>4} {'r_i':>5} {'shards':>6} | {'(a) old':>8} {'after':>6} | "
          f"{'(a) new':>8} {'after':>6} {'target':>7} | {'(b)':>6} {'after':>6} {'pred':>6} "
          f"{'b/pred':>7} {'live':>6} | {'before':>6} {'(c)':>6} {'target':>7} {'files':>5} "
          f"{'live':>6} | "
          f"{'(c) old':>7}")
    for rank, (r, o, w) in enumerate(zip(RATIOS, old, new)):
        pred = predicted[rank] / P
        c_target = f"{r + 1 / args.save_files + 2 * unit_p:7.3f}" if rank == 0 else f"{'-':>7}"
        print(f"{rank:>4} {r:>5.2f} {w['shards'] / P:6.3f} | {o['a'] / P:8.3f} "
              f"{o['a_after'] / P:6.3f} | {w['a'] / P:8.3f} {w['a_after'] / P:6.3f} "
              f"{r + 2 * unit_p:7.3f} | {w['b'] / P:6.3f} {w['b_after'] / P:6.3f} {pred:6.3f} "
              f"{w['b'] / P / pred - 1:+7.1%} {(w['b_live'] + w['shards']) / P:6.3f} | "
              f"{w['c_before'] / P:6.3f} {w['c'] / P:6.3f} {c_target} {w['files']:>5} "
              f"{w['c_live'] / P:6.3f} | "
              f"{w['c_old'] / P:7.3f}")
    print(f"(a) old: hf_cephalo at {args.baseline_ref} (before issue 12): from_pretrained (whole "
          "model) + engine; (a) new: from_pretrained_sharded + engine; after: RSS above the "
          "base once the engine is built / after the steps; shards: this rank's shard bytes; "
          f"(b) over {STEPS} AdamW steps (batch 1, {SEQ} tokens); pred: planner.predict's "
          "memory_bytes (r_i*S + M_i(1, 1), every engine buffer, the plan's layout; A_i measured "
          "by the profiler on CPU); live: this rank's shards + the peak of the tensors the steps "
          "allocate (LiveTensorBytes); before: RSS above the base right before the save (the "
          "shards, freed pages not returned); (c) save_pretrained_streamed (max_shard_size P/"
          f"{args.save_files}), target r_0 + one output file + 2 units, live: the peak of the "
          "tensors the save allocates (above before); (c) old: "
          "full_state_dict + save_file on rank 0 (the save before the streamed one).")


if __name__ == "__main__":
    main()
