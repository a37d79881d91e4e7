"""CUDA paths of the engine (side streams, pinned-memory offload), one GPU.

Skipped without CUDA. Run by scripts/gpu_check.sh. Each worker runs under the gloo harness and
builds a one-rank NCCL group for the engine, so the NCCL collectives on the all-gather stream,
the offload stream and their events are all exercised.

``test_cuda_streams_parity_with_delays`` reruns the parity cases with every side-stream
operation and every unit's compute started late (``torch.cuda._sleep``): a delay only postpones
work on one stream, so results cannot change when the streams are ordered correctly, while a
missing ``wait_event`` / ``wait_stream`` or a block the caching allocator hands out again while
another stream still uses it reads stale or overwritten data and breaks parity.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from hf_cephalo.engine import CephaloEngine, EnginePrecision
from hf_cephalo.models.toy import ToyConfig, ToyLM, ToyStaged
from tests.dist_utils import run_ranks
from tests.test_engine_semantics import mbs_of

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RTOL, ATOL = 1e-5, 1e-6
SPIN_CYCLES = 2_000_000  # GPU clock cycles (about 1 ms) each injected delay spins

# microbatch sizes, activation checkpointing, offload to pinned memory, reduce-scatter fallback
PARITY_CASES = (
    ([8], True, True, False),
    ([4, 4], True, True, True),    # all-reduce fallback: in place on the gradient buffer
    ([1] * 8, True, True, False),
    ([3, 5], False, True, False),  # kept graphs: storage freed and refilled across reshard
    ([2, 6], True, False, False),  # boundary tensors kept on the device
)


def _batch(n, seq, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, seq), generator=gen)
    labels = ids.clone()
    labels[::3, seq // 2:] = -100
    return ids, labels


def _nccl_setup():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device, dist.new_group(backend="nccl")


def _spin(stream=None):
    if stream is None:
        torch.cuda._sleep(SPIN_CYCLES)
        return
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN_CYCLES)


def _inject_side_stream_delays():
    """Start every all-gather, reduce-scatter, offload copy and reload late on its own stream
    (patches the classes of this worker process only)."""
    from hf_cephalo.engine import offload

    def delay_before(cls, name, stream_of):
        original = getattr(cls, name)

        def delayed(self, *args, **kwargs):
            stream = stream_of(self)
            if stream is not None:
                _spin(stream)
            return original(self, *args, **kwargs)

        setattr(cls, name, delayed)

    delay_before(offload.CudaStreams, "all_gather", lambda s: s.all_gather_stream)
    delay_before(offload.CudaStreams, "reduce_scatter", lambda s: s.all_gather_stream)
    delay_before(offload.ActivationStash, "start_offload",
                 lambda s: s.streams.offload_stream if s.offload else None)
    delay_before(offload.ActivationStash, "_issue_reload", lambda s: s.streams.offload_stream)


class _SlowComputeStaged(ToyStaged):
    """Every unit call (forward, recompute) and head starts late on the compute stream, so a
    side stream that does not wait for the compute stream reads tensors before they exist."""

    def run_unit(self, index, hidden, ctx):
        _spin()
        return super().run_unit(index, hidden, ctx)

    def head_loss(self, hidden, microbatch, ctx):
        _spin()
        return super().head_loss(hidden, microbatch, ctx)


def cuda_parity_worker(rank, world, delays=False):
    device, group = _nccl_setup()
    if delays:
        _inject_side_stream_delays()
    staged_cls = _SlowComputeStaged if delays else ToyStaged
    cfg = ToyConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=3, max_seq_len=16,
                    tie_embeddings=True, frozen_norm=True)
    for micro, checkpointing, offload, fallback in PARITY_CASES:
        case = f"{micro} ckpt={checkpointing} offload={offload} fallback={fallback}"
        torch.manual_seed(0)
        model = ToyLM(cfg).to(device)
        ref = copy.deepcopy(model)
        engine = CephaloEngine(staged_cls(model), process_group=group, device=device,
                               offload_activations=offload, reduce_scatter_fallback=fallback,
                               activation_checkpointing=checkpointing)
        assert engine.streams is not None and engine.offload_activations == offload
        opt = torch.optim.AdamW(engine.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for step in range(3):
            ids, labels = _batch(8, 16, cfg.vocab_size, seed=step)
            ids, labels = ids.to(device), labels.to(device)
            engine.stats.reset()
            out = engine.train_step(mbs_of(ids, labels, micro))
            if offload:
                assert engine.stats.peak_stash_host_bytes > 0, case
                # only a boundary gradient read right after it is written stays on the device:
                # at most one microbatch's (m, seq, hidden) fp32 tensor at a time
                one_mb = max(micro) * ids.shape[1] * cfg.hidden_size * 4
                assert 0 < engine.stats.peak_stash_device_bytes <= one_mb, case
            else:
                assert engine.stats.peak_stash_host_bytes == 0, case
                assert engine.stats.peak_stash_device_bytes > 0, case
            # host waits for the compute stream per step ([Note: host waits for the compute
            # stream]): per microbatch boundary with offload, else once per unit and pass
            L = cfg.num_layers
            expected_syncs = (2 * L + 3) * len(micro) if offload else 2 * L
            assert engine.stats.host_syncs == expected_syncs, (case, engine.stats.host_syncs)
            opt.step()
            if delays:
                _spin()  # the next step's all-gathers must wait for the optimizer's writes
            engine.zero_grad()
            ref_opt.zero_grad()
            loss, _ = ref(ids, labels)
            loss.backward()
            ref_opt.step()
            torch.testing.assert_close(out.loss, loss.item(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{case} step {step}: {m}")
        full = engine.full_state_dict()
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(full[key], value.cpu(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{case} {key}: {m}")
        ids, labels = _batch(8, 16, cfg.vocab_size, seed=99)
        ids, labels = ids.to(device), labels.to(device)
        engine.stats.reset()
        evaluated = engine.evaluate(mbs_of(ids, labels, micro))
        assert engine.stats.host_syncs == cfg.num_layers, (case, engine.stats.host_syncs)
        with torch.no_grad():
            ref_loss, ref_logits = ref(ids, labels)
        # other microbatch shapes than the reference's: GEMMs may sum in another order
        torch.testing.assert_close(evaluated.loss, float(ref_loss), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{case} evaluate loss: {m}")
        torch.testing.assert_close(torch.cat(evaluated.logits), ref_logits, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{case} evaluate logits: {m}")
    return True


def cuda_dropout_worker(rank, world):
    """One microbatch: the engine consumes the CUDA RNG in the order of a plain forward, so with
    the same seed its gradient equals the reference's only if the recompute replays the
    forward's dropout masks (CUDA RNG state saved and restored around each recompute)."""
    device, group = _nccl_setup()
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=3, max_seq_len=8,
                    dropout=0.3)
    ids, labels = _batch(3, 8, cfg.vocab_size, seed=10)
    ids, labels = ids.to(device), labels.to(device)
    torch.manual_seed(0)
    model = ToyLM(cfg).to(device)
    ref = copy.deepcopy(model)
    engine = CephaloEngine(ToyStaged(model), process_group=group, device=device)
    torch.manual_seed(123)
    engine.train_step([{"input_ids": ids, "labels": labels}])
    torch.manual_seed(123)
    loss, _ = ref(ids, labels)
    loss.backward()
    got = {}
    for meta, param in zip(engine.shard_metadata(), engine.parameters()):  # one rank: full shard
        flat = param.grad if param.grad is not None else torch.zeros_like(param)
        for info in meta.params:
            if info.requires_grad:
                got[info.fqn] = flat[info.offset:info.offset + info.numel].view(info.shape)
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"dropout replay {name}: {m}")
    return True


def cuda_bf16_worker(rank, world):
    """EnginePrecision(compute=bfloat16) on CUDA with the reference's shapes (one microbatch, offload on):
    loss and gradients equal single-process bf16-autocast training, and differ from fp32's."""
    device, group = _nccl_setup()
    cfg = ToyConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=3, max_seq_len=16)
    ids, labels = _batch(8, 16, cfg.vocab_size, seed=5)
    ids, labels = ids.to(device), labels.to(device)
    torch.manual_seed(0)
    model = ToyLM(cfg).to(device)
    grads = {}
    for name, amp in (("fp32", False), ("bf16", True)):
        ref = copy.deepcopy(model)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss, _ = ref(ids, labels)
        loss.backward()
        grads[name] = (loss.item(), {n: p.grad for n, p in ref.named_parameters()
                                     if p.grad is not None})
    engine = CephaloEngine(ToyStaged(copy.deepcopy(model)), process_group=group, device=device,
                           precision=EnginePrecision(torch.bfloat16))
    out = engine.train_step([{"input_ids": ids, "labels": labels}])
    torch.testing.assert_close(out.loss, grads["bf16"][0], rtol=RTOL, atol=ATOL)
    flat_grads = {}
    for meta, param in zip(engine.shard_metadata(), engine.parameters()):  # one rank: all
        for info in meta.params:
            if info.requires_grad:
                flat_grads[info.fqn] = param.grad[info.offset:info.offset + info.numel].view(
                    info.shape)
    differs = 0.0
    for name, grad in grads["bf16"][1].items():
        torch.testing.assert_close(flat_grads[name], grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"bf16 {name}: {m}")
        differs = max(differs, float((grad - grads["fp32"][1][name]).abs().max()))
    assert differs > 1e-5, differs  # autocast really ran
    return True


def cuda_fp16_scaler_worker(rank, world):
    """fp16 autocast + ``engine.make_grad_scaler()`` (ShardedGradScaler) on CUDA, the CUDA mirror
    of tests/test_mixed_precision.py's CPU fp16 test: 20 steps of one microbatch with an
    overflow injected at step 5 (``OverflowStaged``); the loss-scale sequence and the skipped
    steps equal single-process ``torch.amp.GradScaler("cuda")`` training of the same model under
    fp16 autocast, and step 5 is skipped. Both param dtypes: fp32 gathers (the reference is plain
    autocast) and fp16 gathered parameters (the engine's casts; parameters then are compared
    only through the scale sequence, as the fp16 rounding of the gathered copy differs from
    autocast's per-op casts)."""
    from tests.test_mixed_precision import OverflowStaged

    device, group = _nccl_setup()
    cfg = ToyConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=3, max_seq_len=16)
    torch.manual_seed(0)
    model = ToyLM(cfg).to(device)
    batches = [tuple(t.to(device) for t in _batch(4, 16, cfg.vocab_size, seed=100 + s))
               for s in range(20)]

    def mb_of(step):
        ids, labels = batches[step]
        mb = {"input_ids": ids, "labels": labels}
        return {**mb, "overflow": torch.ones((), device=device)} if step == 5 else mb

    def run(scaler, one_step):
        scales, skipped = [], []
        for step in range(20):
            before = scaler.get_scale()
            one_step(step)
            scaler.update()
            scales.append(scaler.get_scale())
            if scales[-1] < before:
                skipped.append(step)
        return scales, skipped

    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12, growth_interval=3)
    ref_staged = OverflowStaged(ref)

    def ref_step(step):
        ref_opt.zero_grad(set_to_none=True)
        mb = mb_of(step)
        with torch.autocast("cuda", dtype=torch.float16):
            hidden, ctx = ref_staged.embed(mb)
            for i in range(cfg.num_layers):
                hidden = ref_staged.run_unit(i, hidden, ctx)
            out = ref_staged.head_loss(hidden, mb, ctx)
        ref_scaler.scale(out.loss_sum / out.num_items).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_scaler.step(ref_opt)
    expected = run(ref_scaler, ref_step)
    assert 5 in expected[1], expected
    results = {}
    for param_dtype in (None, torch.float16):
        engine = CephaloEngine(OverflowStaged(copy.deepcopy(model)), process_group=group,
                               device=device,
                               precision=EnginePrecision(torch.float16, param_dtype))
        opt = torch.optim.AdamW(engine.parameters(), lr=1e-3)
        scaler = engine.make_grad_scaler(init_scale=2.0 ** 12, growth_interval=3)

        def step_fn(step):
            engine.zero_grad()
            engine.train_step([mb_of(step)], loss_scale=scaler)
            scaler.unscale_(opt)
            engine.clip_grad_norm_(1.0)
            scaler.step(opt)
        got = run(scaler, step_fn)
        assert got == expected, (param_dtype, got, expected)
        results[str(param_dtype)] = got[1]
    return results


def cuda_memory_worker(rank, world):
    """Peak device memory of a step does not grow with the number of microbatches at a fixed
    microbatch size once boundary activations are offloaded (paper §3.3)."""
    device, group = _nccl_setup()
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
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        engine.train_step(mbs)
        torch.cuda.synchronize(device)
        peaks[num_mb] = torch.cuda.max_memory_allocated(device) - base
    # inputs on the device grow with l (tiny); everything else must not
    assert peaks[8] <= 1.15 * peaks[1], peaks
    return peaks


def cuda_compile_worker(rank, world):
    """torch.compile per unit on CUDA (inductor / Triton): compiled vs eager engine after 3
    AdamW steps with a last microbatch of another size and offload on (rtol 1e-4 / atol 1e-5:
    fused kernels reorder fp32 reductions), no recompile after the first step; with dropout,
    the recompute replays the forward's masks (CUDA RNG) under compile: same gradient as a
    plain forward + backward of the compiled model with the same seed."""
    from hf_cephalo.engine import CompileOptions
    device, group = _nccl_setup()
    cfg = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=8)
    runs = {}
    for name, options in (("eager", None), ("compiled", CompileOptions())):
        torch.manual_seed(0)
        engine = CephaloEngine(ToyStaged(ToyLM(cfg).to(device)), process_group=group,
                               device=device, compile=options)
        opt = torch.optim.AdamW(engine.parameters(), lr=1e-2, weight_decay=0.1)
        losses, reports = [], []
        for step in range(3):
            ids, labels = _batch(5, 8, cfg.vocab_size, seed=step)
            losses.append(engine.train_step(mbs_of(ids.to(device), labels.to(device),
                                                   [2, 2, 1])).loss)
            opt.step()
            engine.zero_grad()
            reports.append(engine.compile_report())
        runs[name] = (losses, engine.full_state_dict(), reports)
    torch.testing.assert_close(runs["compiled"][0], runs["eager"][0], rtol=1e-4, atol=1e-5)
    for key, value in runs["eager"][1].items():
        torch.testing.assert_close(runs["compiled"][1][key], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"compiled vs eager {key}: {m}")
    reports = runs["compiled"][2]
    assert reports[0].recompiles == reports[-1].recompiles, reports
    dropout = ToyConfig(vocab_size=32, hidden_size=16, num_heads=2, num_layers=3,
                        max_seq_len=8, dropout=0.3)
    grads = {}
    for checkpointing in (True, False):  # recompute vs kept graphs: same masks needed
        torch.manual_seed(0)
        engine = CephaloEngine(ToyStaged(ToyLM(dropout).to(device)), process_group=group,
                               device=device, compile=CompileOptions(),
                               activation_checkpointing=checkpointing)
        ids, labels = _batch(3, 8, dropout.vocab_size, seed=10)
        torch.manual_seed(123)
        engine.train_step(mbs_of(ids.to(device), labels.to(device), [2, 1]))
        grads[checkpointing] = [p.grad.clone() for p in engine.parameters()]
    for got, expected in zip(grads[True], grads[False]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    return True


@requires_cuda
def test_cuda_compile_per_unit():
    assert run_ranks(cuda_compile_worker, 1, timeout_s=400) == [True]


@requires_cuda
def test_cuda_streams_offload_parity():
    assert run_ranks(cuda_parity_worker, 1, timeout_s=300) == [True]


@requires_cuda
def test_cuda_streams_parity_with_delays():
    assert run_ranks(cuda_parity_worker, 1, True, timeout_s=300) == [True]


@requires_cuda
def test_cuda_dropout_replay():
    assert run_ranks(cuda_dropout_worker, 1, timeout_s=300) == [True]


@requires_cuda
def test_cuda_bf16_autocast():
    assert run_ranks(cuda_bf16_worker, 1, timeout_s=300) == [True]


@requires_cuda
def test_cuda_fp16_sharded_scaler():
    assert all(run_ranks(cuda_fp16_scaler_worker, 1, timeout_s=300))


@requires_cuda
def test_cuda_peak_memory_flat_in_microbatches():
    run_ranks(cuda_memory_worker, 1, timeout_s=300)
