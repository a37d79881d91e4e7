"""Engine benchmark: layered gradient accumulation vs torch FSDP2 with standard accumulation.

Runs ``--world-size`` gloo ranks (CPU) or NCCL ranks (``--device cuda``, one GPU per rank) on
a Llama-shaped model built from a config (no weights are downloaded). For l = 1, 4, 8
microbatches of size ``local_batch / l`` it measures, per step (forward + backward + AdamW):
  * step time (median of ``--steps`` timed steps after one warm-up; the systems' steps
    alternate so load changes on a shared machine hit both alike), and
  * all-gather / reduce-scatter counts and bytes, read from a ``torch.profiler`` trace of one
    step (the ``c10d::_allgather_base_`` / ``c10d::_reduce_scatter_base_`` ops) for BOTH
    systems, so they are counted the same way,
for the Cephalo engine and for FSDP2 (``fully_shard`` per decoder layer + root, gradient sync
only on the last microbatch, i.e. ``set_requires_gradient_sync(False)`` before the others),
with and without HF gradient checkpointing, against Cephalo with and without its activation
checkpointing (recompute in backward, the default). It prints ratios Cephalo / FSDP2-GA. It
also prints, per rank, the training-state bytes under an uneven state split (expected r_i x 16 bytes x parameters: fp32 param 4 + grad 4 + Adam 8) and
the peak memory for l = 1, 4, 8 at a fixed microbatch size (CUDA: max_memory_allocated; CPU:
only the engine's stash accounting: CPU has no offload, so the stash grows with l there).
One gradient buffer per unit (issue 18.3; per-parameter leaves: issue 24): the engine's
parameters (per-parameter leaves aliasing the gathered unit, gradients added in place into the
unit's flat gradient) against the views it used before, measured in the same run: the bytes the
backward of one decoder layer allocates per microbatch (counted per aten op, whole-unit-sized
ones apart) for "leaves", "split" (one ``torch.split`` of a flat leaf per call; its backward
concatenates the gradients) and "slices" (one slice of the leaf per parameter), and the +AC
step time at each l for "leaves" vs "split" (fp32).

Physical bound (every report): a timed entry among the systems' steps at each l (same run,
same load): rank 0 alone trains the whole global batch (world size x local batch; forward,
backward, AdamW; no accumulation, no checkpointing, no communication) with one rank's threads
while the other ranks wait; its median step time divided by the number of ranks is what the
ranks would take with the work split perfectly and free communication. Each system's
step time is printed as a multiple of it.

``--compile`` (issue 24) replaces the report: eager vs ``torch.compile`` (inductor) for Cephalo
(``CephaloEngine(compile=CompileOptions())``: each unit compiled in place; with activation
checkpointing, the default, and without it, FSDP2-GA's memory policy) and FSDP2-GA (each
decoder layer ``torch.compile(layer, fullgraph=True)`` before ``fully_shard``, as torchtitan's
``apply_compile``), steps interleaved, at each l; the engine's graph counts (recompiles) and
compile time; the bound eager and compiled; and what compile can remove at all: rank 0's
profiled self CPU time of one Cephalo step split into matmuls, SDPA attention, collectives
and the rest (``op_time_split``), with the speedup ceiling if the rest cost nothing (traced /
(traced - rest), from the one profiled step: its tracing overhead is not in the medians).

Usage: python benchmarks/bench_engine.py [--world-size 2] [--device cpu|cuda] [--quick | --smoke]
       [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from rank_launch import free_port, run_ranks


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=args.seq, tie_word_embeddings=False,
                      use_cache=False)  # training: FSDP2 and the bound must not build a KV
    # cache every forward (the engine's adapters force use_cache=False); with it, a compiled
    # layer also recompiled per layer index (the cache update reads layer_idx)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def batch(args, rank, step, size):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, args.vocab, (size, args.seq), generator=gen)
    return ids


_ELEMENT_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}


def count_collectives(prof) -> dict:
    """Counts and bytes of all-gathers (their (N,) output) and reduce-scatters (their (N,)
    input) in a profiler trace, at the traced tensors' element size (bf16 all-gathers of
    ``--param-dtype bf16`` count 2 B per element)."""
    out = {"ag": 0, "ag_bytes": 0, "rs": 0, "rs_bytes": 0}
    for e in prof.events():
        if e.name == "c10d::_allgather_base_":
            out["ag"] += 1
            out["ag_bytes"] += _ELEMENT_BYTES.get(e.input_dtypes[0], 4) * e.input_shapes[0][0]
        elif e.name == "c10d::_reduce_scatter_base_":
            out["rs"] += 1
            out["rs_bytes"] += _ELEMENT_BYTES.get(e.input_dtypes[1], 4) * e.input_shapes[1][0]
    return out


# Ops that inductor leaves to the same library kernels on the CPU (oneDNN / MKL GEMMs, the
# fused SDPA kernel) and the collectives: compile cannot make them faster.
_MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def op_time_split(prof) -> dict:
    """Self CPU seconds of one profiled step by kind: ``matmul`` (``_MATMUL_OPS``),
    ``attention`` (the SDPA kernels, forward and backward), ``collective`` (c10d ops) and
    ``rest`` (every other op and compiled kernel: elementwise, normalisation, copies, the
    gradient concatenations, the optimizer's foreach kernels), plus ``total``. The trace's
    events nest, so self times add up to the traced CPU time without double counting."""
    out = {"matmul": 0.0, "attention": 0.0, "collective": 0.0, "rest": 0.0, "total": 0.0}
    for e in prof.key_averages():
        t = e.self_cpu_time_total / 1e6
        if e.key in _MATMUL_OPS:
            kind = "matmul"
        elif "scaled_dot_product" in e.key or "flash_attention" in e.key:
            kind = "attention"
        elif e.key.startswith("c10d::") or e.key.startswith("gloo:"):
            kind = "collective"
        else:
            kind = "rest"
        out[kind] += t
        out["total"] += t
    return out


class SplitLeaves:
    """The engine's parameters before issue 24, for the baseline (stands in for
    ``flat_param.ParamLeaves``, fp32 only): the gathered (Nt,) trainable part itself is the
    autograd leaf and every read of ``leaves`` (the engine's ``use_params``, once per forward
    call) makes fresh views from ONE ``torch.split`` of it, whose backward concatenates the
    parameters' gradients into a fresh (Nt,) tensor that the leaf's accumulator adds into its
    ``.grad``. One difference from that engine: ``.grad`` is preset to the unit's zero-filled
    flat gradient, so the first microbatch's concatenation is added, not adopted (one
    unit-sized fill and add per unit and step more than it did)."""

    def __init__(self, infos, trainable, requires_grad, touched=None):
        self.infos = [i for i in infos if i.requires_grad]
        self.flat = trainable.detach().requires_grad_(requires_grad and trainable.numel() > 0)
        self.requires_grad, self.dtype, self.grad = self.flat.requires_grad, trainable.dtype, None
        if self.requires_grad and touched is not None:  # the engine's signature: its backward
            # reaches every parameter of the flat leaf at once, so mark them all (else the
            # optimizer would skip them as parameters no rank reached)
            self.flat.register_post_accumulate_grad_hook(
                lambda _leaf: touched.__setitem__(slice(None), [True] * len(touched)))

    @property
    def leaves(self) -> list:
        pieces = torch.split(self.flat, [i.numel for i in self.infos])
        return [p.view(i.shape) for p, i in zip(pieces, self.infos)]

    def accumulate_into(self, grad) -> None:
        assert grad.dtype == self.dtype, "the split baseline is fp32 only"
        self.grad = self.flat.grad = grad

    def release_grad(self) -> None:
        self.grad = self.flat.grad = None


def install_slice_views(infos, uses, leaves, frozen) -> None:
    """The engine's parameter views before issue 18.3 (``leaves``: a ``SplitLeaves``): one
    slice of the flat leaf per parameter, so backward zero-fills a unit-sized gradient per
    parameter and sums them."""
    nt = sum(i.numel for i in infos if i.requires_grad)
    for info, entries in zip(infos, uses):
        if info.requires_grad:
            view = leaves.flat[info.offset:info.offset + info.numel].view(info.shape)
        else:
            view = frozen[info.offset - nt:info.offset - nt + info.numel].view(info.shape)
        for module, attr in entries:
            module._parameters[attr] = view


def with_leaves(step, leaves_cls):
    """``step`` with ``flat_param.ParamLeaves`` replaced by ``leaves_cls`` while it runs."""
    from hf_cephalo.engine import flat_param

    def run(s):
        saved, flat_param.ParamLeaves = flat_param.ParamLeaves, leaves_cls
        try:
            step(s)
        finally:
            flat_param.ParamLeaves = saved
    return run


class AllocatedBytes(TorchDispatchMode):
    """Counts bytes of aten results in NEW storage (views and in-place results reuse an input's
    storage) and, apart, the results of exactly ``numel`` elements (whole-unit gradients)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.total_bytes, self.unit_sized, self.unit_sized_bytes = numel, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr()
                for t in _tensors([*args, *(kwargs or {}).values()])}
        for t in _tensors([out]):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                self.total_bytes += t.untyped_storage().nbytes()
                if t.numel() == self.numel:
                    self.unit_sized += 1
                    self.unit_sized_bytes += t.untyped_storage().nbytes()
        return out


def _tensors(items) -> list:
    out = []
    for a in items:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out += _tensors(a)
    return out


def unit_backward_bytes(args, num_mb: int = 2) -> dict:
    """Bytes the backward of decoder layer 0 allocates per microbatch (mean over ``num_mb``
    microbatches of ``local_batch / max(l)`` sequences, gradient accumulation included), with
    the engine's leaves ("leaves") and the two baselines ("split", "slices"), each with the
    unit's flat gradient allocated before the first microbatch as the engine does."""
    from hf_cephalo.engine.flat_param import (ParamLeaves, collect_params, install_param_views,
                                              param_infos)
    from hf_cephalo.models.registry import stage_model
    staged = stage_model(build_model(args))
    m = max(1, args.local_batch // max(args.num_mb))
    ids = batch(args, 0, 0, m)
    out = {}
    for name, leaves_cls, install in (("leaves", ParamLeaves, install_param_views),
                                      ("split", SplitLeaves, install_param_views),
                                      ("slices", SplitLeaves, install_slice_views)):
        params, uses = collect_params("unit 0", [staged.units()[0]], {})
        infos = param_infos("unit 0", params, {})
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        leaf = leaves_cls(infos, flat, requires_grad=True)
        leaf.accumulate_into(torch.zeros_like(flat))
        counts = []
        for _ in range(num_mb):
            with torch.no_grad():
                hidden, ctx = staged.embed({"input_ids": ids, "labels": ids})
            install(infos, [uses[id(p)] for p in params],
                    leaf if install is install_slice_views else leaf.leaves, flat.new_zeros(0))
            x = hidden.detach().requires_grad_(True)
            y = staged.run_unit(0, x, ctx)
            with AllocatedBytes(flat.numel()) as mode:
                torch.autograd.backward(y, torch.ones_like(y))
            counts.append(mode)
        for entries, p in zip([uses[id(p)] for p in params], params):  # restore the model
            for module, attr in entries:
                module._parameters[attr] = p
        out[name] = {"unit_bytes": flat.numel() * flat.element_size(),
                     "total_bytes": sum(c.total_bytes for c in counts) / num_mb,
                     "unit_sized": sum(c.unit_sized for c in counts) / num_mb,
                     "unit_sized_bytes": sum(c.unit_sized_bytes for c in counts) / num_mb}
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(steps: dict, args, device, profile: bool = True) -> tuple[dict, dict]:
    """Median step time (s) and profiled collectives per system; the systems' steps alternate
    so that load changes on a shared machine hit both alike."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    times = {name: [] for name in steps}
    for name, fn in steps.items():
        fn(0)  # warm-up
    for s in range(1, args.steps + 1):
        for name, fn in steps.items():
            sync(device)
            t0 = time.perf_counter()
            fn(s)
            sync(device)
            times[name].append(time.perf_counter() - t0)
    colls = {}
    for name, fn in (steps.items() if profile else ()):
        if name.startswith("bound"):  # no collective to count
            continue
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn(args.steps + 1)
        colls[name] = count_collectives(prof)
    return {k: statistics.median(v) for k, v in times.items()}, colls


def cephalo_runner(args, rank, device, num_mb, ratios=None, checkpointing=True,
                   compiled=False):
    from hf_cephalo.engine import CephaloEngine, CompileOptions, EnginePrecision
    from hf_cephalo.models.registry import stage_model
    model = build_model(args).to(device)
    low = _LOW_DTYPES.get(args.param_dtype)  # autocast + gathered params, reduce fp32
    engine = CephaloEngine(stage_model(model), ratios, device=device,
                           activation_checkpointing=checkpointing,
                           precision=EnginePrecision(low, low),
                           compile=CompileOptions() if compiled else None)
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-4)
    m = args.local_batch // num_mb

    def step(s):
        ids = batch(args, rank, s, args.local_batch).to(device)
        engine.train_step([{"input_ids": ids[k:k + m], "labels": ids[k:k + m]}
                           for k in range(0, args.local_batch, m)])
        opt.step()
        engine.zero_grad()
    return step, engine, opt


def compile_layers(model) -> None:
    """torchtitan's per-block compile (``apply_compile``): each decoder layer becomes
    ``torch.compile(layer, fullgraph=True)`` (inductor), in place in the layer list, BEFORE
    ``fully_shard`` wraps it, so FSDP2's hooks stay outside the compiled region."""
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, fullgraph=True)


def fsdp2_runner(args, rank, device, num_mb, checkpointing=False, compiled=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = build_model(args).to(device)
    if checkpointing:  # HF's public switch: non-reentrant torch.utils.checkpoint per layer
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        compile_layers(model)
    low = _LOW_DTYPES.get(args.param_dtype)
    mp = {} if low is None else \
        {"mp_policy": MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)}
    for layer in model.model.layers:
        fully_shard(layer, **mp)
    fully_shard(model, **mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    m = args.local_batch // num_mb

    def step(s):
        ids = batch(args, rank, s, args.local_batch).to(device)
        for k in range(num_mb):
            model.set_requires_gradient_sync(k == num_mb - 1)
            mb = ids[k * m:(k + 1) * m]
            (model(input_ids=mb, labels=mb).loss / num_mb).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


_LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def state_bytes(engine, opt) -> int:
    """fp32 param + grad + AdamW moments held by this rank for its shards, in bytes."""
    total = 0
    for p in engine.parameters():
        total += p.numel() * p.element_size() * 2  # parameter + gradient
        for v in opt.state.get(p, {}).values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += v.numel() * v.element_size()
    return total


def peak_memory(args, rank, device, num_mb) -> dict:
    """Peak memory (bytes) of a step with ``num_mb`` microbatches of ``args.peak_m``.

    ``device_peak``: CUDA max_memory_allocated above the memory held before the step (0 on CPU,
    where no per-step allocator peak exists); ``stash_device`` / ``stash_host``: the engine's
    peak bytes of stashed boundary tensors on the device / offloaded to pinned host memory.
    """
    local = args.local_batch
    args.local_batch = args.peak_m * num_mb
    step, engine, _ = cephalo_runner(args, rank, device, num_mb)
    step(0)
    engine.stats.reset()
    peak = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step(1)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        step(1)
    args.local_batch = local
    return {"device_peak": peak, "stash_device": engine.stats.peak_stash_device_bytes,
            "stash_host": engine.stats.peak_stash_host_bytes}


def worker(rank, args, port, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world_size)
    try:
        if args.compile:
            out_q.put((rank, compile_worker(args, rank, device)))
            return
        res = {"time": {}, "coll": {}}
        mixed = args.param_dtype != "fp32"  # the mixed-precision comparison alone
        for num_mb in args.num_mb:
            steps = {"cephalo": cephalo_runner(args, rank, device, num_mb)[0]}
            if not mixed:  # the split views baseline (before issue 24) in fp32 only
                steps["cephalo-split"] = with_leaves(
                    cephalo_runner(args, rank, device, num_mb)[0], SplitLeaves)
            steps.update({"cephalo-noac": cephalo_runner(args, rank, device, num_mb,
                                                         checkpointing=False)[0],
                          "fsdp2": fsdp2_runner(args, rank, device, num_mb),
                          "fsdp2-ac": fsdp2_runner(args, rank, device, num_mb,
                                                   checkpointing=True),
                          "bound": bound_runner(args, rank, device)})
            times, colls = time_interleaved(steps, args, device)
            for name in steps:
                res["time"][f"{name}/{num_mb}"] = times[name]
                if name in colls:  # the bound has no collective to count
                    res["coll"][f"{name}/{num_mb}"] = colls[name]
        if mixed:
            out_q.put((rank, res))
            return
        ratios = [0.7] + [0.3 / (args.world_size - 1)] * (args.world_size - 1)
        step, engine, opt = cephalo_runner(args, rank, device, 1, ratios)
        step(0)
        res["state"] = (ratios[rank], state_bytes(engine, opt),
                        sum(p.numel() for p in build_model(args).parameters()))
        res["peak"] = {l: peak_memory(args, rank, device, l) for l in args.num_mb}
        out_q.put((rank, res))
    finally:
        dist.destroy_process_group()


def compile_worker(args, rank, device) -> dict:
    """``--compile``: eager vs compiled Cephalo (per-unit compile; with activation
    checkpointing, its default, and without, FSDP2-GA's memory policy) and FSDP2-GA (per-layer
    compile as torchtitan, no activation checkpointing), steps interleaved, at each l; the
    compiled engine's graph counts and compile time (its first step, outside the timing); and
    rank 0's profiled self CPU time of one Cephalo step by kind (``op_time_split``)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from hf_cephalo.engine.compile import graph_count
    res = {"time": {}, "coll": {}, "compile": {}, "split": {}}
    # Several systems' compiled layers live in this one process and share dynamo's code cache
    # (FSDP2's layers are another class, each l another shape): more entries than the default
    # limit of 8 that one engine (at most 4 per train / eval mode) needs.
    torch._dynamo.config.recompile_limit = 64
    for num_mb in args.num_mb:
        step_c, engine, _ = cephalo_runner(args, rank, device, num_mb, compiled=True)
        graphs = [0]  # compiled during the compiled engine's steps (its probe included)

        def counted(s, step_c=step_c, graphs=graphs):
            before = graph_count()
            step_c(s)
            graphs[0] += graph_count() - before
        steps = {"cephalo": cephalo_runner(args, rank, device, num_mb)[0],
                 "cephalo-compiled": counted,
                 "cephalo-noac": cephalo_runner(args, rank, device, num_mb,
                                                checkpointing=False)[0],
                 "cephalo-noac-compiled": cephalo_runner(args, rank, device, num_mb,
                                                         checkpointing=False, compiled=True)[0],
                 "fsdp2": fsdp2_runner(args, rank, device, num_mb),
                 "fsdp2-compiled": fsdp2_runner(args, rank, device, num_mb, compiled=True),
                 "bound": bound_runner(args, rank, device),
                 "bound-compiled": bound_runner(args, rank, device, compiled=True)}
        times, _ = time_interleaved(steps, args, device, profile=False)
        for name in steps:
            res["time"][f"{name}/{num_mb}"] = times[name]
        for name in ("cephalo", "cephalo-compiled", "cephalo-noac", "cephalo-noac-compiled"):
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                steps[name](args.steps + 1)  # every rank: the step's collectives pair up
            res["split"][f"{name}/{num_mb}"] = op_time_split(prof)
        report = engine.compile_report()  # its graphs would count FSDP2's too: not used
        res["compile"][num_mb] = {"graphs": graphs[0], "probe_graphs": report.probe_graphs,
                                  "recompiles": graphs[0] - report.probe_graphs,
                                  "compile_s": report.compile_s}
    return res


def bound_runner(args, rank, device, compiled=False):
    """One step of the perfect-scaling bound, as a timed entry beside the systems' steps (same
    run, same load): rank 0 alone trains the whole global batch (world size x local batch
    sequences: forward, backward, AdamW; no accumulation, no checkpointing, no communication)
    with the threads of ONE rank (``--threads``), while the other ranks wait in a barrier. Its
    step time divided by the number of ranks is what N ranks would take with the work split
    perfectly and free communication (``print_bound``)."""
    model = opt = None
    if rank == 0:
        model = build_model(args).to(device)
        if compiled:
            compile_layers(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    low = _LOW_DTYPES.get(args.param_dtype)  # mixed precision: the same autocast

    def step(s):
        if rank == 0:
            ids = batch(args, 0, s, args.world_size * args.local_batch).to(device)
            with torch.autocast(device.type, dtype=low, enabled=low is not None):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
        dist.barrier()
    return step


def print_bound(args, results, names, bounds=("bound",)) -> None:
    """Each system's step time as a multiple of the physical bound (``bound_runner``'s step
    time / world size, measured at each l among that l's steps), per l."""
    print(f"physical bound (one process trains the global batch with one rank's "
          f"{args.threads} thread(s), step time / {args.world_size} ranks, timed among the "
          "systems' steps); each system's step time as a multiple of it:")
    for bound in bounds:
        for l in args.num_mb:
            b = slowest_s(results, bound, l) / args.world_size
            print(f"  l={l}: {bound} {b:.3f} s; " + ", ".join(
                f"{n} {slowest_s(results, n, l) / b:.2f}x" for n in names))


def report_compile(args, results):
    print(f"# bench_engine --compile: {args.world_size} ranks on {args.device}, Llama "
          f"{args.layers} layers, hidden {args.hidden}, seq {args.seq}, {args.local_batch} "
          f"sequences per rank; torch.compile inductor (Cephalo: per unit, with activation "
          f"checkpointing (+AC, its default) and without (noAC); FSDP2-GA: per layer before "
          f"fully_shard, as torchtitan, no activation checkpointing)")
    print(f"{'l':>3} {'m':>3} | {'Cephalo+AC':>10} {'compiled':>8} {'speedup':>7} | "
          f"{'noAC':>6} {'compiled':>8} {'speedup':>7} | {'FSDP2-GA':>8} {'compiled':>8} "
          f"{'speedup':>7} | {'C/F +AC':>7} {'noAC':>5} | {'graphs':>6} {'recomp':>6} "
          f"{'compile s':>9}")
    for l in args.num_mb:
        ce, cc, ne, nc, fe, fc = (slowest_s(results, n, l) for n in (
            "cephalo", "cephalo-compiled", "cephalo-noac", "cephalo-noac-compiled", "fsdp2",
            "fsdp2-compiled"))
        info = results[0]["compile"][l]
        print(f"{l:>3} {args.local_batch // l:>3} | {ce:>10.3f} {cc:>8.3f} {ce / cc:>6.2f}x | "
              f"{ne:>6.3f} {nc:>8.3f} {ne / nc:>6.2f}x | {fe:>8.3f} {fc:>8.3f} {fe / fc:>6.2f}x"
              f" | {cc / fc:>7.2f} {nc / fc:>5.2f} | {info['graphs']:>6} {info['recompiles']:>6}"
              f" {info['compile_s']:>9.1f}")
    print("(seconds per step, slowest rank; C/F: compiled Cephalo / compiled FSDP2-GA, +AC "
          "pays a recompute FSDP2-GA does not, noAC is the same memory policy; graphs: dynamo "
          "graphs rank 0 compiled during the compiled +AC engine's steps at this l (warm-up, "
          f"timed and profiled), shared by all its {args.layers} units; recomp: of those, "
          "compiled after the first step's probe; compile s: the probe's wall time; a new "
          "engine per l, the process's dynamo cache kept: a later l may reuse earlier graphs)")
    print("what compile can remove (rank 0, one profiled step each; self CPU ms by kind; "
          "matmuls and SDPA attention run the same library kernels compiled or not, so the "
          "ceiling is the eager step with every other op free: traced / (traced - rest), both "
          "from the same profiled step, whose tracing overhead the medians above do not have):")
    for l in args.num_mb:
        for eager, compiled in (("cephalo", "cephalo-compiled"),
                                ("cephalo-noac", "cephalo-noac-compiled")):
            e = results[0]["split"][f"{eager}/{l}"]
            c = results[0]["split"][f"{compiled}/{l}"]
            step_e, step_c = slowest_s(results, eager, l), slowest_s(results, compiled, l)
            ceiling = e["total"] / (e["total"] - e["rest"])  # matmuls are > 0: no zero division
            print(f"  l={l} {eager:<12}: matmul {1e3 * e['matmul']:6.1f}, attention "
                  f"{1e3 * e['attention']:5.1f}, collective {1e3 * e['collective']:4.1f}, rest "
                  f"{1e3 * e['rest']:5.1f} of {1e3 * e['total']:6.1f} traced -> compiled rest "
                  f"{1e3 * c['rest']:5.1f} ms; matmul "
                  f"{e['matmul'] / e['total']:.0%} of the traced time; ceiling "
                  f"{ceiling:.2f}x, measured {step_e / step_c:.2f}x")
    print_bound(args, results, ["cephalo", "cephalo-compiled", "cephalo-noac",
                                "cephalo-noac-compiled", "fsdp2", "fsdp2-compiled"],
                bounds=("bound", "bound-compiled"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=1, default=str)


def slowest_s(results, name: str, l: int) -> float:
    """Seconds per step of runner ``name`` at ``l`` microbatches: the slowest rank's (a step
    ends when the slowest rank ends)."""
    return max(r["time"][f"{name}/{l}"] for r in results)


def print_step_table(args, results, reduce_scatter: str) -> None:
    """The per-l table of both reports: step times (Cephalo / FSDP2, without and with
    activation checkpointing), their ratios, rank 0's all-gather count and bytes, and its
    reduce-scatters as a count (``reduce_scatter="count"``) or in MiB (``"bytes"``)."""
    r0 = results[0]
    last = f"{'RS count':>9}" if reduce_scatter == "count" else f"{'RS MiB':>15}"
    print(f"{'l':>3} {'m':>3} | {'cephalo':>7} {'+AC':>6} {'FSDP2':>6} {'+AC':>6} | "
          f"{'AC/AC':>5} {'noAC/noAC':>9} | {'AG count':>11} {'AG MiB':>15} {'AG ratio':>8} | "
          + last)
    for l in args.num_mb:
        c, f = r0["coll"][f"cephalo/{l}"], r0["coll"][f"fsdp2/{l}"]
        cn, ca, fn, fa = (slowest_s(results, name, l)
                          for name in ("cephalo-noac", "cephalo", "fsdp2", "fsdp2-ac"))
        rs = (f"{c['rs']:>3} vs {f['rs']:>3}" if reduce_scatter == "count" else
              f"{c['rs_bytes'] / 2**20:>6.1f} vs {f['rs_bytes'] / 2**20:>6.1f}")
        print(f"{l:>3} {args.local_batch // l:>3} | {cn:>7.3f} {ca:>6.3f} {fn:>6.3f} {fa:>6.3f} | "
              f"{ca / fa:>5.2f} {cn / fn:>9.2f} | {c['ag']:>4} vs {f['ag']:>4} "
              f"{c['ag_bytes'] / 2**20:>6.1f} vs {f['ag_bytes'] / 2**20:>6.1f} "
              f"{c['ag_bytes'] / f['ag_bytes']:>8.3f} | " + rs)


def report_mixed_precision(args, results):
    """Cephalo (param_dtype, reduce fp32, autocast) vs FSDP2 MixedPrecisionPolicy + GA."""
    print(f"# bench_engine --param-dtype {args.param_dtype}: {args.world_size} ranks on "
          f"{args.device}, Llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"{args.local_batch} sequences per rank; Cephalo param_dtype={args.param_dtype}, "
          f"reduce fp32, autocast {args.param_dtype} vs FSDP2 MixedPrecisionPolicy("
          f"param_dtype={args.param_dtype}, reduce_dtype=fp32) + standard GA")
    print_step_table(args, results, reduce_scatter="bytes")
    print("(seconds per step, slowest rank; AG/RS MiB: rank 0's gathered outputs / reduce-"
          "scatter inputs at their traced element size, Cephalo vs FSDP2)")
    print_bound(args, results, ["cephalo", "cephalo-noac", "fsdp2", "fsdp2-ac"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=1, default=str)


def report(args, results):
    print(f"# bench_engine: {args.world_size} ranks on {args.device}, Llama {args.layers} layers, "
          f"hidden {args.hidden}, seq {args.seq}, {args.local_batch} sequences per rank")
    print_step_table(args, results, reduce_scatter="count")

    def t(name, l):
        return slowest_s(results, name, l)
    l1 = args.num_mb[0]
    print("(seconds per step; cephalo = activation_checkpointing=False, +AC = with activation "
          "checkpointing (Cephalo's default: recompute in backward); FSDP2 = FSDP2 with standard "
          "gradient accumulation; AC/AC and noAC/noAC = Cephalo / FSDP2 at equal memory policy)")
    print(f"step time vs FSDP2 without accumulation (l={l1}): no AC "
          f"{t('cephalo-noac', l1) / t('fsdp2', l1):.2f}x, with AC "
          f"{t('cephalo', l1) / t('fsdp2-ac', l1):.2f}x; at l={args.num_mb[-1]}: no AC "
          f"{t('cephalo-noac', args.num_mb[-1]) / t('fsdp2', args.num_mb[-1]):.2f}x, with AC "
          f"{t('cephalo', args.num_mb[-1]) / t('fsdp2-ac', args.num_mb[-1]):.2f}x")
    print_bound(args, results, ["cephalo", "cephalo-noac", "fsdp2", "fsdp2-ac"])
    print("training state per rank (uneven split), expected r_i x 16 B x params:")
    for rank, r in enumerate(results):
        ratio, got, params = r["state"]
        expected = ratio * 16 * params
        print(f"  rank {rank}: r={ratio:.3f} state {got / 2**20:8.2f} MiB, expected "
              f"{expected / 2**20:8.2f} MiB, off by {100 * (got - expected) / expected:+.2f}%")
    print(f"peak memory per step at microbatch size {args.peak_m} (MiB: device peak above "
          f"the state [CUDA only] / stash on device / stash offloaded to host):")
    for rank, r in enumerate(results):
        print(f"  rank {rank}: " + ", ".join(
            f"l={l}: {r['peak'][l]['device_peak'] / 2**20:.1f}/"
            f"{r['peak'][l]['stash_device'] / 2**20:.1f}/{r['peak'][l]['stash_host'] / 2**20:.1f}"
            for l in args.num_mb))
    print("one gradient buffer per unit (+AC step time in s, per-parameter leaves / split views "
          "of the flat leaf, same run): " + ", ".join(
              f"l={l}: {t('cephalo', l):.3f} / {t('cephalo-split', l):.3f} "
              f"({t('cephalo', l) / t('cephalo-split', l):.2f}x)" for l in args.num_mb))
    print("backward of decoder layer 0, allocated per microbatch (MiB; unit = "
          f"{args.grad_bytes['leaves']['unit_bytes'] / 2**20:.2f} MiB of fp32 parameters):")
    for name, r in args.grad_bytes.items():
        print(f"  {name:>6}: {r['total_bytes'] / 2**20:8.2f} MiB in all, "
              f"{r['unit_sized']:.1f} unit-sized tensors = {r['unit_sized_bytes'] / 2**20:.2f} MiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=1, default=str)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128, help="sequence length (tokens)")
    p.add_argument("--local-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--num-mb", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--peak-m", type=int, default=1, help="microbatch size of the memory runs")
    p.add_argument("--steps", type=int, default=7, help="timed steps per configuration")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--quick", action="store_true", help="tiny settings, one timed step")
    p.add_argument("--smoke", action="store_true",
                   help="smallest settings: --quick with l = 2 microbatches of 1 sequence "
                        "(the suite's check that the benchmark runs; numbers meaningless)")
    p.add_argument("--compile", action="store_true",
                   help="only compare eager vs torch.compile (inductor): Cephalo per unit, "
                        "FSDP2-GA per layer as torchtitan, with the physical bound eager and "
                        "compiled (fp32)")
    p.add_argument("--param-dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16 / fp16: only compare Cephalo (that param_dtype, reduce fp32, "
                        "autocast) with FSDP2 MixedPrecisionPolicy(param_dtype, "
                        "reduce_dtype=fp32) + standard gradient accumulation (default fp32: "
                        "the full benchmark)")
    args = p.parse_args(argv)
    if args.smoke:
        args.quick, args.num_mb, args.local_batch = True, [2], 2
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.vocab, args.seq = 2, 64, 128, 256, 32
        args.steps = 1
    if any(args.local_batch % l for l in args.num_mb):
        p.error(f"--local-batch {args.local_batch} must be divisible by every --num-mb "
                f"{args.num_mb}")
    if args.compile and args.param_dtype != "fp32":
        p.error("--compile compares fp32 runs: drop --param-dtype")
    if args.param_dtype == "fp32" and not args.compile:
        args.grad_bytes = unit_backward_bytes(args)
    port = free_port()
    results = dict(run_ranks(worker, [(r, args, port) for r in range(args.world_size)],
                             timeout_s=3600))
    ordered = [results[r] for r in range(args.world_size)]
    if args.compile:
        report_compile(args, ordered)
    else:
        (report if args.param_dtype == "fp32" else report_mixed_precision)(args, ordered)


if __name__ == "__main__":
    main()
