"""Automatic planning at start and the predicted-vs-measured report (docs/design.md contract 6).

``CephaloTrainer`` without a plan calls ``resolve_plan_for_model``:

1. profile: ``cephalo_profile_file`` if given (refused if it was measured for another model,
   dtype or device: ``measure.check_profile_matches``), else ``profile_cluster`` on every rank
   (collective; per-rank device profiles come from the on-disk cache when present, so a second
   start skips the measurement);
2. plan: the exact optimizer (``planner.optimize``) for the global batch size and memory
   fraction of the arguments; an uneven plan's own layout is then timed and the plan made once
   more if its uneven factor u differs from the profile's ([Note: measuring u after planning]);
3. rank 0 saves ``profile.json`` and ``plan.json`` in ``output_dir``;
4. emulated memory caps (``cephalo_emulate_memory_cap_bytes``) are applied (CUDA allocator
   fraction) and checked (every device: r_i·S + M_i(m_i) <= C_i, else
   ``EmulatedOutOfMemoryError`` on every rank before training starts).

Emulated slowdown (``cephalo_emulate_slowdown``) wraps the staged model in
``EmulatedStagedModel`` for both the profiler and the engine (``wrap_staged``), so an emulated
cluster goes through the same profile -> plan -> train path as a real one.

``PlanAccuracyCallback`` warns after the first steps when the measured step time is off the
prediction by more than 15% (naming the term of the cost model that is off), and prints, at the
end of training, each rank's predicted vs measured unit compute time per step, step time and
memory (the paper's model-accuracy check, §4).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hf_cephalo.integrations.preflight import warn_idle_ranks
from hf_cephalo.models import stage_model
from hf_cephalo.models.base import StagedModel
from hf_cephalo.planner import InfeasiblePlanError, Plan, optimize, predict
from hf_cephalo.planner import cost, memory
from hf_cephalo.profiler.emulate import (EmulatedStagedModel, EmulationConfig, apply_memory_cap,
                                         EmulatedOutOfMemoryError, check_plan_memory,
                                         emulated_device_name)
from hf_cephalo.profiler.measure import (MeasureConfig, check_profile_matches, local_device_name,
                                         measure_comm, check_profile_precision,
                                         model_dtype, model_profile, profile_cluster,
                                         sequence_length_of)
from hf_cephalo.profiler.cache import model_description, model_fingerprint
from hf_cephalo.profiler.precision import Precision
from hf_cephalo.profiler.types import ClusterProfile
from hf_cephalo.units import GIB

__all__ = ["ResolvedPlan", "resolve_plan_for_model", "wrap_staged", "PlanAccuracyCallback",
           "format_accuracy_table", "check_state_fits_caps", "diagnose_step_time"]

logger = logging.getLogger(__name__)
DEFAULT_SEQUENCE_LENGTH = 128


class ResolvedPlan(NamedTuple):
    """The job's plan and the cluster profile it was made from (None for a plan file)."""

    plan: Plan
    cluster: ClusterProfile | None


def _emulation(args, world_size: int) -> EmulationConfig | None:
    emulation = EmulationConfig.from_training_args(args)
    if emulation is not None:
        emulation.check_world_size(world_size)
    return emulation


def wrap_staged(staged: StagedModel, args, world_size: int) -> StagedModel:
    """``staged`` wrapped in ``EmulatedStagedModel`` with this rank's slowdown when emulating
    (or, on CPU, with slowdown 1 to time compute for ``PlanAccuracyCallback``); else unchanged."""
    emulation = _emulation(args, world_size)
    device = torch.device(args.device)
    slowdown = 1.0 if emulation is None else emulation.slowdown_of(args.process_index)
    if slowdown == 1.0 and device.type == "cuda":
        return staged  # timing would synchronize the device and cost the real run its overlap
    return EmulatedStagedModel(staged, slowdown, device)


def _local_name(args, emulation: EmulationConfig | None) -> str:
    rank = args.process_index
    return emulated_device_name(local_device_name(args.device),
                                1.0 if emulation is None else emulation.slowdown_of(rank),
                                None if emulation is None else emulation.cap_of(rank))


def _measure_config(args, global_batch_size: int, train_dataset) -> MeasureConfig:
    max_m = int(os.environ.get("HF_CEPHALO_PROFILE_MAX_MICROBATCH_SIZE", "8"))
    seq = sequence_length_of(train_dataset, DEFAULT_SEQUENCE_LENGTH) if train_dataset is not None \
        else DEFAULT_SEQUENCE_LENGTH
    # Quiet by default: rank 0 prints a line every QUIET_INTERVAL_S and a summary;
    # HF_CEPHALO_VERBOSE=1 or DEBUG logging on hf_cephalo: every rank, every second.
    verbose = (os.environ.get("HF_CEPHALO_VERBOSE", "0").strip().lower() in ("1", "true", "yes")
               or logging.getLogger("hf_cephalo").isEnabledFor(logging.DEBUG))
    return MeasureConfig(max_microbatch_size=max(1, min(max_m, global_batch_size)),
                         sequence_length=seq, precision=_precision(args), verbose=verbose,
                         param_dtype=_job_precision(args).param,
                         reduce_dtype=_job_precision(args).reduce,
                         compile_backend=args.torch_compile_backend if args.torch_compile
                         else None,
                         compile_mode=args.torch_compile_mode if args.torch_compile else None)


def _gather_names(name: str, world_size: int) -> list[str]:
    if world_size == 1:
        return [name]
    names: list[Any] = [None] * world_size
    dist.all_gather_object(names, name)
    return names


def resolve_plan_for_model(args, world_size: int, model: torch.nn.Module,
                           train_dataset: Any = None) -> ResolvedPlan:
    """Plan file > profile file > profile this cluster; then optimize, save, check caps.

    Collective when profiling or checking a profile file with world size > 1 (every rank calls
    it, from ``CephaloTrainer.__init__``). Every rank ends with the same plan or the same error.

    Raises:
        ValueError: unsupported model (before any collective), a profile of another model or
            device, a plan that does not fit the world size or the global batch size,
            ``InfeasiblePlanError`` when no plan fits, ``EmulatedOutOfMemoryError`` when a plan
            exceeds an emulated memory cap.
    """
    staged = stage_model(model)  # unsupported class: ValueError before any collective
    emulation = _emulation(args, world_size)
    cap = None if emulation is None else emulation.cap_of(args.process_index)
    if cap is not None:
        how = apply_memory_cap(cap, args.device)
        if args.process_index == 0:  # every rank's cap in one line (rank 1's is often the point)
            from hf_cephalo.profiler.types import format_bytes

            logger.info("emulated memory caps: %s; on rank 0 %s", ", ".join(
                f"rank {i} {format_bytes(c)}" for i, c in enumerate(emulation.memory_cap_bytes)),
                how)
    caps = [None] * world_size if emulation is None or emulation.memory_cap_bytes is None \
        else list(emulation.memory_cap_bytes)
    if args.cephalo_plan_file is not None:
        plan = Plan.load(args.cephalo_plan_file)
        plan.validate_for(world_size, model_profile(staged),
                          precision=_job_precision_tag(args, staged),
                          plan_file=args.cephalo_plan_file)
        args.resolve_global_batch_size(world_size, plan.global_batch_size)
        check_state_fits_caps(plan, model_profile(staged).state_bytes, caps)
        if all(r.predicted_memory_bytes is not None for r in plan.ranks):
            check_plan_memory([r.predicted_memory_bytes for r in plan.ranks], caps)
        if args.process_index == 0:
            warn_idle_ranks(plan.global_batch_size, world_size)
        return ResolvedPlan(plan, None)
    B = args.resolve_global_batch_size(world_size)
    _refuse_meta_profiling(model, args)
    cluster = _cluster(args, world_size, staged, emulation, train_dataset, B)
    try:
        plan = optimize(cluster, B, args.cephalo_memory_fraction)
    except InfeasiblePlanError as e:
        raise InfeasiblePlanError(f"{e}{_infeasible_remedy(args, B, e.constraint)}",
                                  e.constraint) from None
    plan, cluster = replan_with_measured_u(plan, cluster, staged, args, B)
    plan.validate_for(world_size, cluster.model, precision=_job_precision_tag(args, staged))
    check_plan_memory([p.memory_bytes for p in predict(plan, cluster).ranks], caps)
    if args.process_index == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        cluster.save(os.path.join(args.output_dir, "profile.json"))
        plan.save(os.path.join(args.output_dir, "plan.json"))
        print(f"[hf-cephalo] profile and plan saved to {args.output_dir}/profile.json, plan.json",
              flush=True)
    return ResolvedPlan(plan, cluster)


def _infeasible_remedy(args, global_batch_size: int, constraint: str) -> str:
    """The flags that relax an infeasible plan's binding constraint
    (``InfeasiblePlanError.constraint``), or "" where its message already says what to do.
    More devices: ``elastic.resolve_elastic_plan`` adds which ones."""
    if constraint not in ("device", "aggregate", "state"):
        return ""
    ways = [f"a smaller --cephalo_global_batch_size (now {global_batch_size})"] \
        if constraint == "aggregate" else []
    ways.append(f"a --cephalo_memory_fraction closer to 1 (now {args.cephalo_memory_fraction})")
    ways.append(f"less memory per GPU ({'' if args.bf16 or args.fp16 else '--bf16, '}a LoRA "
                "adapter, shorter sequences)")
    if args.cephalo_emulate_memory_cap_bytes is not None:
        ways.append("larger --cephalo_emulate_memory_cap_bytes")
    return "; to fit: " + ", ".join(ways[:-1]) + ", or " + ways[-1]


def _refuse_meta_profiling(model: torch.nn.Module, args) -> None:
    """Profiling at start runs the model's own modules, which a meta-device model (sharded
    loading, ``from_pretrained_sharded``) does not have yet: ValueError naming the fix, raised
    on every rank before any collective."""
    if args.cephalo_profile_file is None and any(p.is_meta for p in model.parameters()):
        raise ValueError("the model is on the meta device (sharded loading), so it cannot be "
                         "profiled at start: give --cephalo_plan_file or --cephalo_profile_file "
                         "(hf-cephalo profile --model-config <config.json> measures one "
                         "from the config alone)")


# [Note: measuring u after planning]
# The uneven factor u prices uneven plans, but which layout is uneven depends on the plan, which
# depends on u. The profile times u on the most skewed layout the memory caps allow (an upper
# bound on any plan's skew: planner.state.skewed_state_ratios). After planning, an uneven plan's
# own layout is timed on the real process group; if its u differs from the profile's by more
# than U_REPLAN_TOLERANCE the plan is made once more with it. Once: the new plan's ratios may
# differ again, but only through a u already measured for a real plan, not an assumed one.
U_REPLAN_TOLERANCE = 0.05


def replan_with_measured_u(plan: Plan, cluster: ClusterProfile, staged: StagedModel, args,
                           global_batch_size: int) -> tuple[Plan, ClusterProfile]:
    """(plan, cluster) after re-planning once with u measured for ``plan``'s own layout.

    Collective on every rank (all ranks hold the same plan) when the plan is uneven, the world
    size is > 1 and the profile carries a measured u; otherwise returns its inputs unchanged.
    """
    if not plan.uneven_state or cluster.world_size == 1 or cluster.comm.uneven_factor is None \
            or not (dist.is_available() and dist.is_initialized()):
        return plan, cluster
    measured = measure_comm(staged, device=args.device, group=None,
                            state_ratios=plan.state_ratios).uneven_factor
    old = cluster.comm.uneven_factor
    if abs(measured - old) <= U_REPLAN_TOLERANCE * old:
        return plan, cluster
    logger.info("uneven factor of the plan's layout %.3f differs from the profile's %.3f: "
                "re-planning once", measured, old)
    comm = dataclasses.replace(cluster.comm, uneven_factor=measured,
                               uneven_state_ratios=list(plan.state_ratios))
    cluster = dataclasses.replace(cluster, comm=comm)
    return optimize(cluster, global_batch_size, plan.memory_fraction,
                    root_resident=plan.root_resident), cluster


def check_state_fits_caps(plan: Plan, state_bytes: float, caps: list[float | None]) -> None:
    """Raise ``EmulatedOutOfMemoryError`` if a rank's training-state shard exceeds its emulated cap.

    The lower bound of a rank's memory that every plan has, predicted memory or not: its share
    r_i of the training state, r_i × S bytes (S = parameters, gradients and Adam moments, paper
    §2.4 M_state = 16·|P| in fp32; ``ModelProfile.state_bytes``). A hand-made plan file carries no
    ``predicted_memory_bytes``, so without this bound an emulated cap would not be enforced.
    Every rank evaluates the same lists, so every rank raises the same error before any
    collective.

    Args:
        plan: the job's plan (r_i per rank).
        state_bytes: S, bytes of the whole training state.
        caps: per rank, emulated capacity in bytes, or None (not emulated).
    """
    over = [(r.rank, r.state_ratio, r.state_ratio * state_bytes, cap)
            for r, cap in zip(plan.ranks, caps)
            if cap is not None and r.state_ratio * state_bytes > cap]
    if over:
        detail = "; ".join(
            f"rank {rank} holds {100 * ratio:.2f}% of the training state = {need:.0f} bytes "
            f"({need / GIB:.3f} GiB, r_i x S with S = {state_bytes:.0f} bytes) but its emulated cap "
            f"is {cap:.0f} bytes ({cap / GIB:.3f} GiB)" for rank, ratio, need, cap in over)
        raise EmulatedOutOfMemoryError(
            f"emulated out of memory: {detail}, before counting activations. Give these ranks a "
            "smaller state share r_i (re-plan, e.g. drop cephalo_plan_file so the trainer plans "
            "for the caps) or raise cephalo_emulate_memory_cap_bytes")


def _precision(args) -> str:
    """The profiler's precision name of the job's compute dtype (--bf16 / --fp16 / fp32)."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _job_precision(args) -> Precision:
    """The job's compute / gathered-parameter / reduce dtypes (``engine_precision()``)."""
    names = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    p = args.engine_precision()
    return Precision(_precision(args), names[p.param_dtype], names[p.reduce_dtype])


def _job_precision_tag(args, staged: StagedModel) -> str:
    """The job's [Note: precision tags] string, what its profile and plan must record."""
    return _job_precision(args).tag(str(model_dtype(staged)).replace("torch.", ""))


def _cluster(args, world_size, staged, emulation, train_dataset, B) -> ClusterProfile:
    """The given profile file (checked against this job) or a fresh/cached measurement."""
    if args.cephalo_profile_file is None:
        config = _measure_config(args, B, train_dataset)
        return profile_cluster(staged, config, device=args.device, emulation=emulation)
    from hf_cephalo.integrations.elastic import select_world_devices  # a pool for any world

    cluster = ClusterProfile.load(args.cephalo_profile_file)
    check_profile_precision(cluster, _job_precision_tag(args, staged),  # before any collective
                            f"cephalo_profile_file {args.cephalo_profile_file!r}")
    names = _gather_names(_local_name(args, emulation), world_size)
    cluster = select_world_devices(cluster, names, f"cephalo_profile_file {args.cephalo_profile_file!r}")
    check_profile_matches(cluster, model_profile(staged), names,
                          source=f"cephalo_profile_file {args.cephalo_profile_file!r}",
                          dtype=_job_precision_tag(args, staged),
                          fingerprint=model_fingerprint(staged.model),
                          description=model_description(staged.model),
                          sequence_length=None if train_dataset is None else
                          sequence_length_of(train_dataset, None))
    return cluster


# ---- predicted vs measured --------------------------------------------------------------------
def _predicted_unit_compute_s(plan: Plan, cluster: ClusterProfile, rank: int) -> float:
    """num_units · (l·F + l·(F + B)) of one rank, seconds per step (compute only, no comm)."""
    r, d = plan.ranks[rank], cluster.devices[rank]
    f, b = cost.rank_compute_s(d, r.batch_size, r.microbatch_size)
    return cluster.model.num_units * float(2 * f + b)


def format_accuracy_table(rows: list[dict[str, Any]], predicted_iteration_s: float | None) -> str:
    """Text table of ``PlanAccuracyCallback`` rows (one per rank)."""
    head = (f"{'rank':>4} {'b_i':>4} {'m_i':>4} {'unit compute s/step pred':>25} {'measured':>9} "
            f"{'step s pred':>12} {'measured':>9} {'memory GiB pred':>16} {'measured':>9}")
    lines = ["Cephalo cost model accuracy (predicted vs measured, median over steps after the "
             "first)",
             head]
    for r in rows:
        def fmt(v, scale=1.0, width=9):
            return f"{'-':>{width}}" if v is None else f"{v / scale:>{width}.4f}"
        lines.append(f"{r['rank']:>4} {r['b']:>4} {r['m']:>4} "
                     f"{fmt(r['pred_compute_s'], width=25)} {fmt(r['compute_s'])} "
                     f"{fmt(predicted_iteration_s, width=12)} {fmt(r['step_s'])} "
                     f"{fmt(r['pred_memory_bytes'], GIB, 16)} {fmt(r['memory_bytes'], GIB)}")
    lines.append("unit compute: forward + recompute + backward of all units on this rank; "
                 "memory on CPU is accounted (state tensors + the memory model's buffers and "
                 "profiled activations), on CUDA the allocator peak")
    return "\n".join(lines)


STEP_TIME_TOLERANCE = 0.15  # relative gap between predicted and measured step time that warns


def diagnose_step_time(rows: list[dict[str, Any]], predicted_iteration_s: float | None,
                       tolerance: float = STEP_TIME_TOLERANCE) -> str | None:
    """A warning when the measured step time is off the prediction by more than ``tolerance``
    (relative), naming the term of the cost model that is off most; None when within it.

    Measured step = the slowest rank's median step seconds (``rows[i]["step_s"]``, steps after
    the first). Terms: compute = the measured vs predicted unit compute (forward + recompute +
    backward, seconds per step) of the rank with the most measured compute; the rest of the
    step (measured step - that compute vs predicted iteration - predicted compute) is the
    collectives (all-gather / reduce-scatter not hidden behind compute), the embedding and head,
    and waiting for slower ranks. Without compute timings (CUDA without emulation) the term is
    not named.
    """
    steps = [r["step_s"] for r in rows if r.get("step_s")]
    if not predicted_iteration_s or not steps:
        return None
    measured = max(steps)
    gap = measured / predicted_iteration_s - 1.0
    if abs(gap) <= tolerance:
        return None
    head = (f"measured step time {measured:.3f} s (slowest rank, median after the first step) "
            f"is {measured / predicted_iteration_s:.2f}x the predicted {predicted_iteration_s:.3f} s")
    timed = [r for r in rows if r.get("compute_s") is not None
             and r.get("pred_compute_s") is not None and r.get("b")]
    if not timed:
        return head + "; no compute timings on this device to tell which term is off"
    slow = max(timed, key=lambda r: r["compute_s"])
    compute_gap = slow["compute_s"] - slow["pred_compute_s"]
    rest_measured = measured - slow["compute_s"]
    rest_predicted = predicted_iteration_s - slow["pred_compute_s"]
    if abs(compute_gap) >= abs(rest_measured - rest_predicted):
        term = (f"compute: rank {slow['rank']}'s unit forward/backward took "
                f"{slow['compute_s']:.3f} s per step, predicted {slow['pred_compute_s']:.3f} s "
                "(re-profile under the same load and sequence length)")
    else:
        term = (f"collectives and waiting: the step outside unit compute took "
                f"{rest_measured:.3f} s, predicted {max(rest_predicted, 0.0):.3f} s (all-gather / "
                "reduce-scatter not hidden behind compute, embedding and head, ranks waiting "
                "for each other; the model leaves out the embedding, head and optimizer step, "
                "small next to the units only for large models: re-profile on the real "
                "interconnect, hf-cephalo profile, if the collectives are the gap)")
    return f"{head}; the term off most is {term}"


class PlanAccuracyCallback(TrainerCallback):
    """Times each training step; checks predicted vs measured step time once after the first
    steps and prints the per-rank table at train end.

    Collective (one ``all_gather_object`` each, on every rank at the same step): after
    ``CHECK_AFTER_STEPS`` steps past the first one (the first step pays one-time costs and is
    not counted), rank 0 logs ``diagnose_step_time``'s warning when the step time is off by more
    than 15%, so a long job learns early that its plan rests on a wrong model; it is skipped when
    that step is the last one (the train-end check covers it). At ``on_train_end`` the table and
    the same check over all steps, whose warning is logged only when the early one was not. Results are kept in ``self.early_rows`` and ``self.rows``
    (rank order, same on every rank).
    """

    CHECK_AFTER_STEPS = 5
    """Steps after the first one before the early step-time check (median of these steps)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.step_s: list[float] = []
        self.compute_s: list[float] = []
        self.rows: list[dict[str, Any]] = []
        self.early_rows: list[dict[str, Any]] = []
        self.early_warning: str | None = None

    def _timer(self):
        # the EmulatedStagedModel's ComputeTimer, also through the --bf16 autocast wrapper
        # (which delegates attributes); None when the adapter is not emulated
        return getattr(self.trainer.engine.staged, "timer", None)

    def on_train_begin(self, args, state, control, **kwargs):
        self.step_s, self.compute_s, self.early_rows, self.early_warning = [], [], [], None
        if torch.device(args.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)

    def on_step_begin(self, args, state, control, **kwargs):
        timer = self._timer()
        self._t0 = time.perf_counter()
        self._c0 = None if timer is None else timer.unit_s

    def on_step_end(self, args, state, control, **kwargs):
        self.step_s.append(time.perf_counter() - self._t0)
        timer = self._timer()
        if timer is not None and self._c0 is not None:
            self.compute_s.append(timer.unit_s - self._c0)
        if (len(self.step_s) == self.CHECK_AFTER_STEPS + 1
                and not (state.max_steps and state.global_step >= state.max_steps)):
            self.early_rows = self._gather(args)
            if args.process_index == 0:
                self.early_warning = diagnose_step_time(self.early_rows,
                                                        self.trainer.plan.predicted_iteration_s)
                if self.early_warning:
                    logger.warning("after %d steps: %s", len(self.step_s), self.early_warning)

    def _measured_memory_bytes(self, args) -> float | None:
        device = torch.device(args.device)
        if device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(device))
        cluster, plan = self.trainer.cluster_profile, self.trainer.plan
        # Accounted: each shard's parameter and gradient, plus the optimizer's state tensors.
        state = 0
        opt = self.trainer.optimizer
        for p in self.trainer.engine.parameters():
            state += 2 * p.numel() * p.element_size()
            if opt is not None:
                state += sum(v.numel() * v.element_size() for v in opt.state.get(p, {}).values()
                             if torch.is_tensor(v) and v.dim() > 0)
        if cluster is None:
            return float(state)
        r = plan.ranks[args.process_index]
        compute = float(memory.rank_memory_bytes(cluster, args.process_index, r.microbatch_size,
                                                 r.batch_size, root_resident=plan.root_resident))
        return state + compute

    def _gather(self, args) -> list[dict[str, Any]]:
        """Every rank's row (collective): medians over the steps after the first."""
        plan, cluster = self.trainer.plan, self.trainer.cluster_profile
        rank = args.process_index
        steps = self.step_s[1:] or self.step_s
        comp = self.compute_s[1:] or self.compute_s
        pred = predict(plan, cluster).ranks[rank] if cluster is not None else None
        row = dict(rank=rank, b=plan.ranks[rank].batch_size, m=plan.ranks[rank].microbatch_size,
                   step_s=statistics.median(steps) if steps else None,
                   compute_s=statistics.median(comp) if comp else None,
                   pred_compute_s=None if cluster is None else
                   _predicted_unit_compute_s(plan, cluster, rank),
                   pred_memory_bytes=None if pred is None else pred.memory_bytes,
                   memory_bytes=self._measured_memory_bytes(args))
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return [row] if world == 1 else _gather_rows(row, world)

    def on_train_end(self, args, state, control, **kwargs):
        plan = self.trainer.plan
        self.rows = self._gather(args)
        if args.process_index == 0:
            print(format_accuracy_table(self.rows, plan.predicted_iteration_s), flush=True)
            warning = diagnose_step_time(self.rows, plan.predicted_iteration_s)
            if warning and not self.early_warning:  # said once; the table shows the numbers
                logger.warning(warning)


def _gather_rows(row, world_size):
    rows: list[Any] = [None] * world_size
    dist.all_gather_object(rows, row)
    return rows
