"""The plan's predicted memory vs the engine's measured peak (issue 18 item 2, on CPU).

Measured: the training state the engine really holds (its local shards, 4 B per element, plus
what the optimizer holds: the shard gradient 4 B, allocated before the step as after
``zero_grad(set_to_none=False)``, and Adam's two moments 8 B per trainable element) plus the peak
of live tensors allocated during ``train_step`` (``profiler.live_memory.LiveTensorBytes``: every
gathered unit, gradient, collective buffer, stashed activation and activation the step
allocates). Predicted: r_i·S + ``planner.memory.rank_memory_bytes`` with the plan's own layout,
from a profile of the same model measured on this CPU. The engine's split root (default), tied
and untied, and ``root_resident=True``; fp32, and bf16 autocast with bf16 gathered parameters
(``param_dtype``, reduce fp32 or bf16; the profile measured in that precision, the memory model
pricing gathered units and all-gathers at 2 B, gradients at 4 B, reduce-scatters at e_r).
LoRA (``LORA_PLANS``): the demo Llama wrapped with peft ``get_peft_model(LoraConfig(r=4,
target_modules=["q_proj", "v_proj"]))``, its base fp32 or stored in bf16 (fp32 adapters): the
memory model prices gradients and reduce-scatters at the Nt trainable elements per unit and
the gathered frozen part at its own element size.
Without activation checkpointing (``NOAC_PLANS``: the engine's ``activation_checkpointing=False``
keeps every (unit, microbatch) forward graph until backward): the memory model adds the kept
graphs, K(m) each from the profile's ``kept_graph_bytes`` (planner/memory.py [Note: memory
without activation checkpointing]); l = 1 and l > 1, a smaller last microbatch, tied, idle.
That engine frees a kept unit's gathered buffer with ``untyped_storage().resize_(0)``; the
live-tensor counter reads such a storage at its current size (it read it at its allocated
size before, which put these cases 1-3 MiB, up to 8 %, above the engine's real peak).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers

from hf_cephalo.engine.engine import CephaloEngine
from hf_cephalo.engine.precision import EnginePrecision
from hf_cephalo.engine.rank_precision import DTYPES
from hf_cephalo.models import stage_model
from hf_cephalo.models.base import AutocastStagedModel
from hf_cephalo.planner import Plan, memory
from hf_cephalo.planner.predict import plan_layout
from hf_cephalo.profiler.live_memory import LiveTensorBytes
from hf_cephalo.profiler.measure import (MeasureConfig, boundary_bytes_per_sample,
                                         measure_device, model_profile, synthetic_microbatch)
from hf_cephalo.profiler.model_facts import side_bytes_per_sample
from hf_cephalo.profiles.types import ClusterProfile, CommProfile
from tests.dist_utils import run_ranks

SEQ = 64
# (name, batch sizes, microbatch sizes, state ratios, tied, root_resident[, precision]);
# precision: "fp32" (default), "bf16" (bf16 autocast + param_dtype bf16, reduce fp32) or
# "bf16+rs" (reduce_dtype bf16 too)
PLANS = [
    ("demo hand-made (scripts/demo.sh DEMO_PLAN=handmade)", [6, 10], [3, 5], [0.6, 0.4],
     False, False),
    # what the planner gives for the demo's emulated cluster (rank 0 2x slower, rank 1 capped at
    # 25 MB) from a CPU profile of this model: b (6, 10), m (6, 5), r (1, 0)
    ("demo auto plan", [6, 10], [6, 5], [1.0, 0.0], False, False),
    ("3-rank uneven", [4, 6, 2], [2, 3, 1], [0.5, 0.3, 0.2], False, False),
    ("3-rank even", [4, 4, 4], [2, 2, 2], [1 / 3, 1 / 3, 1 / 3], False, False),
    ("3-rank idle rank", [6, 0, 4], [3, 0, 1], [0.2, 0.5, 0.3], False, False),
    ("tied, 3-rank uneven", [4, 6, 2], [2, 3, 1], [0.5, 0.3, 0.2], True, False),
    ("tied, m = 1 (embedding backward binds)", [3, 2], [1, 1], [0.5, 0.5], True, False),
    ("tied, idle rank", [0, 5], [0, 5], [0.7, 0.3], True, False),
    ("root_resident, 3-rank uneven", [4, 6, 2], [2, 3, 1], [0.5, 0.3, 0.2], False, True),
    ("root_resident tied, idle rank", [6, 0], [2, 0], [0.4, 0.6], True, True),
    ("bf16 params, demo auto plan", [6, 10], [6, 5], [1.0, 0.0], False, False, "bf16"),
    ("bf16 params, 3-rank uneven", [4, 6, 2], [2, 3, 1], [0.5, 0.3, 0.2], False, False, "bf16"),
    ("bf16 params, tied, 3-rank uneven", [4, 6, 2], [2, 3, 1], [0.5, 0.3, 0.2], True, False,
     "bf16"),
    ("bf16 params + reduce, 3-rank idle rank", [6, 0, 4], [3, 0, 1], [0.2, 0.5, 0.3], False,
     False, "bf16+rs"),
    ("bf16 params + reduce, tied, m = 1", [3, 2], [1, 1], [0.5, 0.5], True, False, "bf16+rs"),
    ("bf16 params, root_resident, 3-rank uneven", [4, 6, 2], [2, 3, 1], [0.5, 0.3, 0.2], False,
     True, "bf16"),
]
# LoRA: (name, batch sizes, microbatch sizes, state ratios, frozen base dtype)
LORA_PLANS = [
    ("LoRA fp32 base, 3-rank uneven", [4, 6, 2], [2, 3, 1], [0.5, 0.3, 0.2], torch.float32),
    ("LoRA fp32 base, 2-rank, zero-state rank", [6, 10], [6, 5], [1.0, 0.0], torch.float32),
    ("LoRA bf16 base, 3-rank uneven", [4, 6, 2], [2, 3, 1], [0.5, 0.3, 0.2], torch.bfloat16),
    ("LoRA bf16 base, 3-rank idle rank", [6, 0, 4], [3, 0, 1], [0.2, 0.5, 0.3], torch.bfloat16),
]
# Without activation checkpointing: (name, batch sizes, microbatch sizes, state ratios, tied)
NOAC_PLANS = [
    ("no checkpointing, l = 1", [6, 10], [6, 10], [0.5, 0.5], False),
    ("no checkpointing, l > 1, 3-rank uneven", [4, 6, 2], [2, 3, 1], [0.5, 0.3, 0.2], False),
    ("no checkpointing, smaller last microbatch", [5, 7], [2, 3], [0.6, 0.4], False),
    ("no checkpointing, tied, idle rank", [6, 0, 4], [3, 0, 1], [0.2, 0.5, 0.3], True),
    ("no checkpointing, tied, m = 1", [6, 4], [3, 1], [0.5, 0.5], True),
]
# MeasureConfig / engine precision arguments of each precision
_PRECISION = {"fp32": ("fp32", "fp32", "fp32"), "bf16": ("bf16", "bf16", "fp32"),
              "bf16+rs": ("bf16", "bf16", "bf16")}
# a name fragment: run only those cases (a quick look by hand); unset: all
# A model with side inputs (Gemma 3n's per-layer inputs, kept per microbatch from the
# embedding's forward to its backward with their summed gradients: memory.side_input_bytes,
# 2·s·b); fp32, untied, the engine's split root.
SIDE_PLANS = [
    ("Gemma 3n side inputs, 2-rank uneven", [4, 8], [2, 3], [0.6, 0.4]),
    ("Gemma 3n side inputs, 3-rank, idle rank", [6, 0, 4], [3, 0, 2], [0.2, 0.5, 0.3]),
]
GEMMA3N = "gemma3n"
ONLY = os.environ.get("HF_CEPHALO_TEST_PLAN_MEMORY_ONLY")


def _demo_model(tied: bool) -> transformers.LlamaForCausalLM:
    """scripts/demo.sh's model: Llama, hidden 128, 4 layers, 4 heads, FFN 512, vocab 2048."""
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=512,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=4, max_position_embeddings=SEQ,
                                   tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _lora_model(base_dtype: torch.dtype):
    """The demo model (untied) as peft's LoRA trains it: r=4 on q_proj / v_proj, the base in
    ``base_dtype`` (fp32 adapters either way)."""
    from peft import LoraConfig, get_peft_model

    base = _demo_model(False).to(base_dtype)
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj"],
                                           task_type="CAUSAL_LM")).train()


def _gemma3n_model() -> transformers.Gemma3nForCausalLM:
    """The demo model's sizes as a Gemma 3n text model, no KV sharing, per-layer inputs of 256
    per token and layer: s = 4 layers x 256 x SEQ x 4 B = 256 KiB a sample (8x the hidden
    state's bytes; Gemma 3n E2B's are 4.4x), so a rank's side inputs and their gradient sums
    (2·s·b: 4 MiB at b = 8) are about a tenth of its peak. At 512 per token and layer the
    prediction falls 9% under the measured peak: the embedding's intermediates of the side
    inputs (their projection and norm in E's backward) are not priced (memory.py
    ``embed_activation_bytes``)."""
    cfg = transformers.Gemma3nTextConfig(
        vocab_size=2048, vocab_size_per_layer_input=256, hidden_size=128,
        hidden_size_per_layer_input=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, laurel_rank=16,
        num_kv_shared_layers=0, sliding_window=16, max_position_embeddings=SEQ,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * 4, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Gemma3nForCausalLM(cfg)


def _build(tied: bool, lora: torch.dtype | str | None):
    """The demo Llama; with ``lora`` a dtype, it wrapped in LoRA; ``GEMMA3N``: _gemma3n_model."""
    if lora == GEMMA3N:
        return stage_model(_gemma3n_model())
    return stage_model(_demo_model(tied) if lora is None else _lora_model(lora))


def _profile(world_size: int, tied: bool, precision: str,
             lora: torch.dtype | None = None) -> ClusterProfile:
    staged = _build(tied, lora)
    compute, param, reduce = _PRECISION[precision]
    config = MeasureConfig(max_microbatch_size=6, sequence_length=SEQ, warmup=0, repeats=1,
                           progress=False, precision=compute, param_dtype=param,
                           reduce_dtype=reduce)
    timed = staged if compute == "fp32" else AutocastStagedModel(staged, "cpu", DTYPES[compute])
    dev = measure_device(timed, config, device="cpu", name="cpu", capacity_bytes=1e12)
    a = boundary_bytes_per_sample(staged, lambda m: synthetic_microbatch(staged.model, m, SEQ),
                                  "cpu", config.gather_dtype)
    s = side_bytes_per_sample(staged, lambda m: synthetic_microbatch(staged.model, m, SEQ),
                              "cpu")
    return ClusterProfile(model=model_profile(staged, "demo", a, config.precision_spec,
                                              side_bytes_per_sample=s),
                          devices=[dev] * world_size,
                          comm=CommProfile(allgather_s=0.0, reducescatter_s=0.0))


def _measured_bytes(rank, plan: Plan, group, tied: bool, precision: str,
                    lora: torch.dtype | None = None) -> float:
    staged = _build(tied, lora)
    compute, param, reduce = (DTYPES[d] for d in _PRECISION[precision])
    engine = CephaloEngine(staged, state_ratios=plan.state_ratios, process_group=group,
                           root_resident=plan.root_resident,
                           precision=EnginePrecision(compute, param, reduce),
                           activation_checkpointing=plan.activation_checkpointing)
    r = plan.ranks[rank]
    mb = synthetic_microbatch(staged.model, r.batch_size, SEQ, seed=rank) if r.batch_size else {}
    mbs = [{k: v[j:j + r.microbatch_size] for k, v in mb.items()}
           for j in range(0, r.batch_size, max(r.microbatch_size, 1))]
    for p in engine.parameters():  # the shard gradients exist, as in the state S prices
        p.grad = torch.zeros_like(p)
    with LiveTensorBytes() as live:
        engine.train_step(mbs)
    state = 0
    for unit in engine.units + engine.root.both():
        state += sum(part.local.numel() * part.element_size for part in unit.parts)  # shards
        state += 12 * unit.local_trainable_numel  # its gradient + Adam's two moments (fp32)
    # [gloo lag] gloo's worker thread drops a finished collective's tensors only after the
    # waiter has woken (ProcessGroupGloo's run loop resets its work-in-progress slot after
    # the work completes), so a unit's gathered buffer can outlive ``wait()`` + ``reshard()``
    # by the time that thread needs to get a core. A busy rank computes between the wait and
    # the reshard; an idle rank issues the next all-gather microseconds later, and on a loaded
    # machine its peak then holds one gathered unit more than the engine keeps (seen: a LoRA
    # bf16 idle rank measured 3.09 MiB, predicted 2.60, the 0.5 MiB of one bf16 layer).
    lag = max(sum(part.numel * torch.empty(0, dtype=unit.gather_dtype(part)).element_size()
                  for part in unit.parts) for unit in engine.units + engine.root.both())
    return float(state + live.peak_bytes), float(lag)


def _worker(rank, world_size):
    torch.set_num_threads(1)
    out, profiles = [], {}
    cases = [(name, bs, ms, ratios, tied, resident, prec[0] if prec else "fp32", None, True)
             for name, bs, ms, ratios, tied, resident, *prec in PLANS]
    cases += [(name, bs, ms, ratios, False, False, "fp32", base, True)
              for name, bs, ms, ratios, base in LORA_PLANS]
    cases += [(name, bs, ms, ratios, tied, False, "fp32", None, False)
              for name, bs, ms, ratios, tied in NOAC_PLANS]
    cases += [(name, bs, ms, ratios, False, False, "fp32", GEMMA3N, True)
              for name, bs, ms, ratios in SIDE_PLANS]
    cases = [c for c in cases if ONLY is None or ONLY in c[0]]
    for name, bs, ms, ratios, tied, resident, precision, lora, ac in cases:
        n = len(bs)
        group = dist.new_group(list(range(n)))  # every rank creates every group
        if rank >= n:
            continue
        plan = Plan.from_ratios(bs, ms, ratios, root_resident=resident,
                                activation_checkpointing=ac)
        key = (n, tied, precision, lora)
        if key not in profiles:
            profiles[key] = _profile(n, tied, precision, lora)
        cluster = profiles[key]
        r = plan.ranks[rank]
        predicted = r.state_ratio * cluster.model.state_bytes + float(memory.rank_memory_bytes(
            cluster, rank, r.microbatch_size, r.batch_size, root_resident=resident,
            layout=plan_layout(plan, cluster), activation_checkpointing=ac))
        measured, lag = _measured_bytes(rank, plan, group, tied, precision, lora)
        if lora == GEMMA3N:  # the side-input term's share, for the report
            side = float(memory.side_input_bytes(cluster.model, r.batch_size))
            name = f"{name} (side inputs s·b = {side / 2**20:.2f} MiB)"
        out.append((name, rank, measured, predicted, lag if r.batch_size == 0 else 0.0))
    return out


def test_predicted_memory_matches_the_engines_peak_within_10_percent():
    rows = [row for per_rank in run_ranks(_worker, 3, timeout_s=900) for row in per_rank]
    assert ONLY is not None or \
        len(rows) == sum(len(p[1]) for p in PLANS + LORA_PLANS + NOAC_PLANS + SIDE_PLANS)
    report = [f"{name} rank {rank}: measured {measured / 2**20:.2f} MiB, predicted "
              f"{predicted / 2**20:.2f} MiB ({predicted / measured - 1:+.1%})"
              for name, rank, measured, predicted, _ in rows]
    print("\n".join(report))
    for (name, rank, measured, predicted, lag), line in zip(rows, report):
        # an idle rank may also hold one gathered unit that gloo has not released yet ([gloo
        # lag] in _measured_bytes): the prediction must be within 10% of the peak without it
        # or with it, never further
        assert min(abs(predicted / (measured - k) - 1) for k in {0.0, lag}) <= 0.10, \
            f"{line}; an idle rank's allowance for gloo's release lag: {lag / 2**20:.2f} MiB"
