"""Planning inputs and the predicted-vs-measured report (docs/design.md contract 6).

How a plan is made (at start, at an elastic restart, live) is ``replan.py``; this module holds
what it reads from the job: the emulation settings (``cephalo_emulate_*``), the profiler's
configuration (``_measure_config``), each rank's device name, the job's precision tag, and the
check of the plan against what the run measures.

Emulated slowdown (``cephalo_emulate_slowdown``) wraps the staged model in
``EmulatedStagedModel`` for both the profiler and the engine (``wrap_staged``), so an emulated
cluster goes through the same profile -> plan -> train path as a real one.

``PlanAccuracyCallback`` warns after the first steps when the measured step time is off the
prediction by more than 15% (naming the term of the cost model that is off), and prints, at the
end of training, each rank's predicted vs measured unit compute time per step, step time and
memory (the paper's model-accuracy check, §4).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hf_cephalo.models.base import StagedModel
from hf_cephalo.planner import Plan, predict
from hf_cephalo.planner.predict import (MeasuredStep, measured_speeds, predicted_unit_compute_s,
                                        refit_to_measured)
from hf_cephalo.planner import memory
from hf_cephalo.profiler.emulate import (EmulatedStagedModel, EmulationConfig,
                                         emulated_device_name)
from hf_cephalo.profiler.measure import (MeasureConfig, local_device_name, model_dtype,
                                         sequence_length_of)
from hf_cephalo.profiler.cache import write_back_measured
from hf_cephalo.profiler.precision import Precision
from hf_cephalo.units import GIB

__all__ = ["wrap_staged", "PlanAccuracyCallback", "format_accuracy_table", "diagnose_step_time"]

logger = logging.getLogger(__name__)
DEFAULT_SEQUENCE_LENGTH = 128


def _emulation(args, world_size: int) -> EmulationConfig | None:
    emulation = EmulationConfig.from_training_args(args)
    if emulation is not None:
        emulation.check_world_size(world_size)
    return emulation


def wrap_staged(staged: StagedModel, args, world_size: int) -> StagedModel:
    """``staged`` wrapped in ``EmulatedStagedModel`` with this rank's slowdown when emulating
    (or, on CPU, with slowdown 1 to time compute for ``PlanAccuracyCallback``; on CUDA when live
    re-balancing or a slowdown schedule needs the compute timed); else unchanged."""
    emulation = _emulation(args, world_size)
    device = torch.device(args.device)
    slowdown = 1.0 if emulation is None else emulation.slowdown_of(args.process_index)
    timed = getattr(args, "cephalo_adaptive", "off") != "off" and world_size > 1 or (
        emulation is not None and emulation.schedule is not None)
    if slowdown == 1.0 and device.type == "cuda" and not timed:
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


def _precision(args) -> str:
    """The profiler's precision name of the job's compute dtype (--bf16 / --fp16 / fp32)."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _job_precision(args) -> Precision:
    """The job's compute / gathered-parameter / reduce dtypes (``engine_precision()``)."""
    names = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    p = args.engine_precision()
    return Precision(_precision(args), names[p.param_dtype], names[p.reduce_dtype])


def _job_precision_tag(args, staged: StagedModel) -> str | None:
    """The job's [Note: precision tags] string, what its profile and plan must record; None
    with --cephalo_precision (``job_rank_precisions`` checks the plan's precisions instead)."""
    if getattr(args, "cephalo_precision", None) is not None:
        return None
    return _job_precision(args).tag(str(model_dtype(staged)).replace("torch.", ""))


# ---- predicted vs measured --------------------------------------------------------------------
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
    lines.append("unit compute: forward + recompute (with activation checkpointing) + backward "
                 "of all units on this rank; "
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
                f"{rest_measured:.3f} s, predicted {max(rest_predicted, 0.0):.3f} s (embedding "
                "and head compute, optimizer step, the root's collectives and all-reduces, "
                "all-gather / reduce-scatter not hidden behind compute, ranks waiting for each "
                "other: planner/cost.py [Note: step terms]; a profile without these terms "
                "prices them at 0: re-profile with this version, and the next run starts from "
                "what this one measured, written back to the profile cache at train end)")
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
        self.root_s: list[float] = []  # embedding + head compute per step (timer)
        self.written_back: list[str] = []  # profile cache entries refit at train end (rank 0)
        self.rows: list[dict[str, Any]] = []
        self.early_rows: list[dict[str, Any]] = []
        self.early_warning: str | None = None

    def _timer(self):
        # the EmulatedStagedModel's ComputeTimer, also through the --bf16 autocast wrapper
        # (which delegates attributes); None when the adapter is not emulated
        return getattr(self.trainer.engine.staged, "timer", None)

    def on_train_begin(self, args, state, control, **kwargs):
        self.step_s, self.compute_s, self.early_rows, self.early_warning = [], [], [], None
        self.root_s = []
        if torch.device(args.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)

    def on_step_begin(self, args, state, control, **kwargs):
        timer = self._timer()
        self._t0 = time.perf_counter()
        self._c0 = None if timer is None else timer.unit_s
        self._r0 = None if timer is None else timer.compute_s - timer.unit_s

    def on_step_end(self, args, state, control, **kwargs):
        self.step_s.append(time.perf_counter() - self._t0)
        timer = self._timer()
        if timer is not None and self._c0 is not None:
            self.compute_s.append(timer.unit_s - self._c0)
            self.root_s.append(timer.compute_s - timer.unit_s - self._r0)
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
        compute = float(memory.rank_memory_bytes(
            cluster, args.process_index, r.microbatch_size, r.batch_size,
            root_resident=plan.root_resident,
            activation_checkpointing=plan.activation_checkpointing))
        return state + compute

    def _gather(self, args) -> list[dict[str, Any]]:
        """Every rank's row (collective): medians over the steps after the first."""
        plan, cluster = self.trainer.plan, self.trainer.cluster_profile
        rank = args.process_index
        steps = self.step_s[1:] or self.step_s
        comp = self.compute_s[1:] or self.compute_s
        root = self.root_s[1:] or self.root_s
        pred = predict(plan, cluster).ranks[rank] if cluster is not None else None
        row = dict(rank=rank, b=plan.ranks[rank].batch_size, m=plan.ranks[rank].microbatch_size,
                   step_s=statistics.median(steps) if steps else None,
                   compute_s=statistics.median(comp) if comp else None,
                   root_s=statistics.median(root) if root else None,
                   pred_compute_s=None if cluster is None else
                   predicted_unit_compute_s(plan, cluster, rank),
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
        self._write_back(args)

    def _write_back(self, args) -> None:
        """The profile refit to this run's measurements (``refit_to_measured``), written by
        rank 0 over the profile cache entries it came from, so the next run plans from them;
        nothing for a plan or profile file, or a run too short to time a step after the
        first. Collective (a barrier after the write: a trainer made next in the same
        processes reads the new entries on every rank)."""
        cluster, plan = self.trainer.cluster_profile, self.trainer.plan
        if cluster is None or len(self.step_s) < 2 or "profile_cache" not in cluster.extra \
                or args.cephalo_profile_file is not None:  # a file records its cache too
            return
        if args.process_index == 0:
            measured = [MeasuredStep(r["step_s"], r["compute_s"], r.get("root_s"))
                        for r in self.rows]
            refit = refit_to_measured(plan, cluster, measured)
            # [Note: the cache does not learn load] (profiler/cache.py): a loaded run is kept out
            done = write_back_measured(cluster.extra, refit.devices,
                                       measured_speeds(plan, cluster, measured),
                                       steps=len(self.step_s) - 1)
            self.written_back = [str(p) for p in done.written]
            logger.info("%s", done.line)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


def _gather_rows(row, world_size):
    rows: list[Any] = [None] * world_size
    dist.all_gather_object(rows, row)
    return rows


# ---- precision per rank (docs/engine.md "Precision per rank") ---------------------------------
def _device_facts(args, world_size: int) -> tuple[list[str], list[tuple[int, int] | None]]:
    """Every rank's (device name, CUDA capability or None), by one all-gather."""
    device = torch.device(args.device)
    mine = (local_device_name(device),
            tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None)
    facts: list[Any] = [mine]
    if world_size > 1:
        facts = [None] * world_size
        dist.all_gather_object(facts, mine)
    return [f[0] for f in facts], [f[1] for f in facts]


def _start_rank_precisions(args, world_size: int) -> list[str] | None:
    """--cephalo_precision resolved for profiling at start (None without it): the list, or
    each device's fastest for ``auto``; the same on every rank, or the same ValueError."""
    from hf_cephalo.engine.rank_precision import resolve_rank_precisions
    from hf_cephalo.profiler.precision import parse_rank_precisions

    value = getattr(args, "cephalo_precision", None)
    if value is None:
        return None
    parse_rank_precisions(value, world_size)  # wrong length: before the all-gather
    names, caps = _device_facts(args, world_size)
    return resolve_rank_precisions(value, world_size, names, caps)


def job_rank_precisions(args, world_size: int, plan: Plan) -> list[str] | None:
    """Each rank's precision under ``--cephalo_precision`` (None without it), the same list on
    every rank, or the same ValueError on every rank before the engine's first collective.

    A list of the wrong length is refused before anything is exchanged; then one all-gather of
    every rank's (device name, CUDA capability) lets every rank check every rank's device. A
    plan that records per-rank precisions (``hf-cephalo plan --precision``) decides them: an
    explicit list must equal it, ``auto`` takes it (the planner's auto may choose one precision
    for all where mixing would double the all-gather bytes). A plan without them uses the list,
    or each device's fastest precision for ``auto``; one made for another one-precision job
    (its ``precision`` tag) is refused.
    """
    from hf_cephalo.engine.rank_precision import resolve_rank_precisions
    from hf_cephalo.profiler.precision import parse_rank_precisions, rank_precisions_tag

    value = getattr(args, "cephalo_precision", None)
    if value is None:
        return None
    wanted = parse_rank_precisions(value, world_size)  # wrong length: before any collective
    recorded = plan.rank_precisions
    if wanted is not None and recorded is not None and wanted != recorded:
        raise ValueError(f"--cephalo_precision {value} but the plan records {recorded} (one per "
                         "rank): give the plan's list or 'auto', or re-plan with `hf-cephalo "
                         f"plan --precision {value}`")
    names, caps = _device_facts(args, world_size)
    out = resolve_rank_precisions(recorded or value, world_size, names, caps)
    if recorded is None and plan.precision not in (None, rank_precisions_tag(out)):
        raise ValueError(f"the plan was made for precision {plan.precision!r}, not for the "
                         f"per-rank precisions {out}: re-plan with `hf-cephalo plan --precision "
                         f"{','.join(out)}` or drop --cephalo_precision")
    return out
