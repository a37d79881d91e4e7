"""Pricing generation: the rows each rank decodes (g_i) and the decode mode (contract 9).

[Note: the decode cost model]
Decoding one token for g rows reads every weight once and each row's KV cache once, and does
2 x params FLOPs per row: memory-bandwidth-bound at small g, unlike training, which is
compute-bound. So the best split of a generation batch, g_i, differs from the training split
b_i. Per rank, one decode step of the whole model (every unit, the head) costs

    t_i(g) = a_i + c_i * g        (g >= 1; seconds)

with ``a_i`` the weights' read time (and the per-step host overhead) and ``c_i`` a row's KV
read + its FLOPs. ``DecodeProfile`` holds (a_i, c_i), measured (``from_timings``: two decode
timings at different g) or from a spec sheet (``from_spec``: bytes over memory bandwidth and
FLOPs over peak, each at an efficiency). A generation round of T new tokens then takes:

- gather once (each rank decodes alone, after one all-gather of every unit):
  ``max_i [T * t_i(g_i)] + W_ag`` (a rank with g_i = 0 decodes nothing);
- layered sharded decode (lock-step, [Note: two decode modes] in engine/generation.py):
  ``T * (max_i t_i(max(g_i, 1)) + L * u_ag + r_ar)`` — every rank steps until the last ends, a
  rank with no rows on a one-token stand-in row, plus per step one all-gather per layer unit
  (``u_ag``) and the lock-step all-reduce (``r_ar``).

Both are a max of per-rank costs increasing in g_i, so the split minimizing it is found
exactly by handing out rows one at a time to the rank whose cost grows least (for min-max of
non-decreasing separable costs the greedy increment is optimal: an exchange argument, as in
scheduling identical jobs on uniform machines), subject to each rank's row cap from memory.
Memory per rank (bytes beyond its training state, ``decode_memory`` below): gather once,
the full weights + g_i rows x (prompt + completion) tokens of KV cache; sharded, the root and
two layer units + the same KV cache. Every rank holds its mode's weights, rows or not (the
all-gathers are collective: one mode for every rank, as the engine runs it). A mode is
feasible when every rank holds its weights and the caps admit all rows; the
plan takes the faster feasible mode; with neither feasible it raises, naming the rank.
Pure Python (no torch), like the rest of the planner.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

__all__ = ["DecodeProfile", "DecodeModel", "GenerationPlan", "plan_generation", "spec_decode",
           "price_generation",
           "RLStepPrediction", "forward_pass_s", "price_rl_step",
           "InfeasibleGenerationError"]


class InfeasibleGenerationError(ValueError):
    """No decode mode fits the generation batch in the ranks' memory."""


@dataclass(frozen=True)
class DecodeProfile:
    """One rank's decode cost: ``step_s(g) = fixed_s + per_row_s * g`` seconds per decode step
    of the whole model at g >= 1 rows ([Note: the decode cost model]).

    name: the device. memory_budget_bytes: what generation may add on this rank beyond its
    training state (None: unlimited).
    """

    name: str
    fixed_s: float
    per_row_s: float
    memory_budget_bytes: float | None = None

    def __post_init__(self) -> None:
        for field in ("fixed_s", "per_row_s"):
            value = getattr(self, field)
            if not value >= 0:
                raise ValueError(f"decode profile {self.name!r}: {field} must be >= 0 seconds, "
                                 f"got {value!r}")

    def step_s(self, rows: int) -> float:
        """Seconds of one decode step with ``rows`` rows (0 rows: 0 s)."""
        return self.fixed_s + self.per_row_s * rows if rows > 0 else 0.0

    @classmethod
    def from_timings(cls, name: str, rows: Sequence[int], step_s: Sequence[float],
                     memory_budget_bytes: float | None = None) -> "DecodeProfile":
        """The least-squares line through measured (rows, seconds per step) pairs (at least
        two distinct row counts; a negative slope, from timing noise, is clamped to 0).

        Raises ValueError for fewer than two distinct row counts."""
        pairs = list(zip([int(r) for r in rows], [float(s) for s in step_s]))
        if len({r for r, _ in pairs}) < 2:
            raise ValueError(f"decode profile {name!r}: needs timings at two or more row "
                             f"counts, got rows {list(rows)}")
        n = len(pairs)
        mean_r = sum(r for r, _ in pairs) / n
        mean_s = sum(s for _, s in pairs) / n
        var = sum((r - mean_r) ** 2 for r, _ in pairs)
        slope = max(0.0, sum((r - mean_r) * (s - mean_s) for r, s in pairs) / var)
        return cls(name, max(0.0, mean_s - slope * mean_r), slope, memory_budget_bytes)

    @classmethod
    def from_spec(cls, name: str, *, weight_bytes: float, kv_bytes_per_token: float,
                  context_tokens: float, flops_per_token: float, bandwidth_gbs: float,
                  peak_tflops: float, efficiency: float = 0.5,
                  memory_budget_bytes: float | None = None) -> "DecodeProfile":
        """What-if profile from a spec sheet: ``fixed_s`` = the weights' bytes over the
        memory bandwidth, ``per_row_s`` = a row's KV cache at ``context_tokens`` over the
        bandwidth plus its FLOPs (2 x params per token) over the peak, each at
        ``efficiency`` of the data sheet (an estimate until measured)."""
        bw = bandwidth_gbs * 1e9 * efficiency
        flops = peak_tflops * 1e12 * efficiency
        return cls(name, weight_bytes / bw,
                   kv_bytes_per_token * context_tokens / bw + flops_per_token / flops,
                   memory_budget_bytes)


@dataclass(frozen=True)
class DecodeModel:
    """What a generation round moves, for the whole model, in the gathered dtype.

    weight_bytes: every unit gathered (gather once). root_bytes, unit_bytes, num_units: the
    embedding + head units, the largest layer unit, the layer count (sharded decode).
    kv_bytes_per_token: one row's KV cache per token, every layer. allgather_s_per_unit: one
    layer unit's all-gather; allreduce_s: the lock-step all-reduce; gather_all_s: the
    all-gather of every unit once.
    """

    weight_bytes: float
    root_bytes: float
    unit_bytes: float
    num_units: int
    kv_bytes_per_token: float
    allgather_s_per_unit: float = 0.0
    allreduce_s: float = 0.0
    gather_all_s: float = 0.0

    def decode_memory(self, mode: str, rows: int, tokens: int) -> float:
        """Bytes a rank adds decoding ``rows`` rows of up to ``tokens`` tokens in ``mode``."""
        weights = self.weight_bytes if mode == "gather_once" else \
            self.root_bytes + 2 * self.unit_bytes
        return weights + self.kv_bytes_per_token * tokens * rows


@dataclass(frozen=True)
class GenerationPlan:
    """The planner's answer: ``rows[i]`` = g_i rows rank i decodes, ``mode`` for every rank,
    ``predicted_s`` for the round (seconds) and ``rank_s`` each rank's decode time."""

    rows: list[int]
    mode: str
    predicted_s: float
    rank_s: list[float]


def _caps(ranks, model, mode, tokens, total) -> list[int] | None:
    """Rows each rank's memory holds in ``mode``; None when some rank cannot hold the mode's
    weights at all (every rank gathers them, rows or not)."""
    caps = []
    for r in ranks:
        if r.memory_budget_bytes is None:
            caps.append(total)
            continue
        free = r.memory_budget_bytes - model.decode_memory(mode, 0, 0)
        if free < 0:
            return None
        per_row = model.kv_bytes_per_token * tokens
        caps.append(total if per_row == 0 else min(total, int(free // per_row)))
    return caps


def _greedy(costs, caps, total) -> list[int] | None:
    """Rows per rank minimizing max_i costs[i](g_i) for non-decreasing costs, g_i <= caps[i]
    (the greedy increment, [Note: the decode cost model]); None when the caps are short."""
    if sum(caps) < total:
        return None
    rows = [0] * len(costs)
    heap = [(costs[i](1), i) for i in range(len(costs)) if caps[i] >= 1]
    heapq.heapify(heap)
    for _ in range(total):
        _, i = heapq.heappop(heap)
        rows[i] += 1
        if rows[i] < caps[i]:
            heapq.heappush(heap, (costs[i](rows[i] + 1), i))
    return rows


def plan_generation(ranks: Sequence[DecodeProfile], model: DecodeModel, rows: int,
                    prompt_tokens: int, new_tokens: int,
                    modes: Sequence[str] = ("gather_once", "sharded")) -> GenerationPlan:
    """The split g_i of ``rows`` generation rows and the decode mode with the least predicted
    time ([Note: the decode cost model]).

    Raises:
        ValueError: ``rows`` < 1 or ``new_tokens`` < 1.
        InfeasibleGenerationError: no mode of ``modes`` fits every row in the ranks' memory
            (names the mode's row caps and what to do).
    """
    if rows < 1 or new_tokens < 1:
        raise ValueError(f"plan_generation: rows ({rows}) and new_tokens ({new_tokens}) must "
                         "be >= 1")
    tokens = prompt_tokens + new_tokens
    best, why = None, []
    for mode in modes:
        caps = _caps(ranks, model, mode, tokens, rows)
        if caps is None:
            why.append(f"{mode}: a rank cannot hold its weights")
            continue
        if mode == "gather_once":
            costs = [lambda g, r=r: new_tokens * r.step_s(g) for r in ranks]
        else:
            costs = [lambda g, r=r: r.step_s(max(g, 1)) for r in ranks]
        split = _greedy(costs, caps, rows)
        if split is None:
            why.append(f"{mode}: at most {caps} rows per rank")
            continue
        priced = price_generation(ranks, model, split, new_tokens, mode)
        if best is None or priced.predicted_s < best.predicted_s:
            best = priced
    if best is None:
        raise InfeasibleGenerationError(
            f"no decode mode fits {rows} rows of {tokens} tokens in the ranks' memory ("
            + "; ".join(why) + "): generate fewer rows per step (steps_per_generation, "
            "per_device_train_batch_size) or shorter completions (max_completion_length)")
    return best


def price_generation(ranks: Sequence[DecodeProfile], model: DecodeModel, split: Sequence[int],
                     new_tokens: int, mode: str) -> GenerationPlan:
    """The predicted round of a GIVEN split g_i (``split``, rank order) in ``mode``
    (``gather_once`` or ``sharded``), [Note: the decode cost model]: gather once
    ``max_i T t_i(g_i) + W_ag``; sharded ``T (max_i t_i(max(g_i, 1)) + L u_ag + r_ar)``. No
    memory check (``plan_generation`` applies the caps). Seconds.

    Raises ValueError for a split of another length than ``ranks``, a negative count or an
    unknown mode."""
    split = [int(g) for g in split]
    if len(split) != len(ranks) or min(split, default=0) < 0:
        raise ValueError(f"price_generation: split {split} needs {len(ranks)} counts >= 0")
    if mode == "gather_once":
        rank_s = [new_tokens * r.step_s(g) for r, g in zip(ranks, split)]
        return GenerationPlan(split, mode, max(rank_s) + model.gather_all_s, rank_s)
    if mode != "sharded":
        raise ValueError(f"price_generation: mode {mode!r}: give gather_once or sharded")
    step = max(r.step_s(max(g, 1)) for r, g in zip(ranks, split))
    comm = model.num_units * model.allgather_s_per_unit + model.allreduce_s
    rank_s = [new_tokens * (step + comm)] * len(ranks)
    return GenerationPlan(split, mode, rank_s[0], rank_s)


_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def spec_decode(gpu, shape, *, precision: str = "bf16", context_tokens: int = 1024,
                efficiency: float = 0.5, memory_budget_bytes: float | None = None
                ) -> tuple[DecodeProfile, DecodeModel]:
    """What-if decode profile of ``gpu`` (a ``GPUSpec`` or its name) for ``shape`` (a
    spec-sheet ``ModelShape``): the weights in ``precision`` read once per step over the data
    sheet's memory bandwidth, each row's KV cache at ``context_tokens`` tokens and its
    2 x params FLOPs per token over the peak, both at ``efficiency`` (an ESTIMATE until
    measured); and the ``DecodeModel`` of the shape (collective times 0: add the cluster's).

    Raises:
        ValueError: a GPU without a bandwidth figure, or without ``precision``'s peak.
    """
    from hf_cephalo.profiles.specs import get_gpu_spec

    spec = gpu if not isinstance(gpu, str) else get_gpu_spec(gpu)
    if spec.memory_bandwidth_gbs is None:
        raise ValueError(f"{spec.name}: no memory bandwidth in its spec sheet; measure its "
                         "decode speed instead (runtime.generation_plan)")
    peak = spec.tflops(precision)
    if peak is None:
        raise ValueError(f"{spec.name} lists no {precision} peak; plan in another precision")
    element = _BYTES[precision]
    head_dim = shape.hidden // shape.heads
    kv = 2 * shape.num_layers * (shape.kv_heads or shape.heads) * head_dim * element
    weights = shape.num_params * element
    profile = DecodeProfile.from_spec(
        spec.name, weight_bytes=weights, kv_bytes_per_token=kv, context_tokens=context_tokens,
        flops_per_token=2.0 * shape.num_params, bandwidth_gbs=spec.memory_bandwidth_gbs,
        peak_tflops=peak, efficiency=efficiency, memory_budget_bytes=memory_budget_bytes)
    model = DecodeModel(weight_bytes=weights,
                        root_bytes=shape.params_other * element,
                        unit_bytes=shape.params_per_layer * element,
                        num_units=shape.num_layers, kv_bytes_per_token=kv)
    return profile, model


@dataclass(frozen=True)
class RLStepPrediction:
    """Predicted seconds of one on-policy RL step's phases (GRPO / RLOO): ``generation_s``
    (the round, ``GenerationPlan.predicted_s``, divided over the steps it feeds),
    ``logprob_s`` (forward-only layered passes over the batch: old policy and reference),
    ``training_s`` (the training step of ``planner.predict``) and ``total_s``, their sum."""

    generation_s: float
    logprob_s: float
    training_s: float

    @property
    def total_s(self) -> float:
        return self.generation_s + self.logprob_s + self.training_s


def forward_pass_s(plan, cluster) -> float:
    """One forward-only layered pass of ``plan``'s batch (old-policy or reference
    log-probabilities), seconds: ``L · max_i cost.forward_unit_time_s(Σ_j F_i(m_j))`` — per
    unit the slowest rank's forwards of its microbatches (a smaller last one at its own size)
    with the next unit's all-gather (overlapped where the profile says collectives overlap
    compute; times u on an uneven plan, as the training step prices it), over every unit;
    the root's compute and the head are not counted (an underestimate for large
    vocabularies). The optimizer minimizes the training step plus k of these
    (``optimize(..., scoring_passes=k)``, docs/planner.md "Scoring passes in the objective").
    Raises nothing for a plan of ``cluster``'s world size."""
    from hf_cephalo.planner import cost

    comm = cost.unit_comm(cluster)
    per_unit = [float(cost.forward_unit_time_s(
        cost.rank_compute_s(device, rank_plan.batch_size,
                            max(rank_plan.microbatch_size, 1)).fwd_s, comm, plan.uneven_state))
        for rank_plan, device in zip(plan.ranks, cluster.devices)]
    return cluster.model.num_units * max(per_unit, default=0.0)


def price_rl_step(plan, cluster, generation: GenerationPlan, *, logprob_passes: float,
                  steps_per_generation: int = 1) -> RLStepPrediction:
    """The predicted phases of one RL optimizer step, seconds: the generation round shared by
    ``steps_per_generation`` steps, ``logprob_passes`` forward-only passes per step
    (``forward_pass_s`` each; per generation round 1 for the reference with ``beta`` != 0 and
    1 for the old policy when GRPO's ``num_iterations`` > 1 or always in RLOO, over the steps
    the round feeds, plus GRPO's entropy-threshold pass: the doors' ``Job.scoring_passes``,
    which their start plan minimizes with the training step), and the training step
    (``planner.predict``). Raises nothing for a plan of ``cluster``."""
    from hf_cephalo.planner.predict import predict

    return RLStepPrediction(generation.predicted_s / max(steps_per_generation, 1),
                            logprob_passes * forward_pass_s(plan, cluster),
                            predict(plan, cluster).iteration_s)
