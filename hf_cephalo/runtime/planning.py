"""How a plan is (re)made: at start, at an elastic restart, and live (docs/design.md contract 7).

One mechanism makes every plan of a job (inputs: a profile, the world, the global batch size B
and the memory fraction; output: a ``Plan``; deterministic, so every rank holding the same
inputs computes the same plan). Every function takes the ``Job`` (``job.py``), never a front
end's settings object. ``resolve_plan``: at start and after an elastic restart (a plan file, or
a profile and ``planner.optimize``, for the world the (re)start got, with the SAME B).
``replan_live``: for the adaptive controller (refit, re-optimize with r_i fixed, decide:
[Note: one decision on every rank] in ``adaptive.py``). The profiler's inputs from the job live
here too (``wrap_staged``, ``measure_config``, device names, ``job_rank_precisions``). Steps in
full: docs/adaptive.md, "runtime/planning.py".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hf_cephalo.environment import env_flag, env_int
from hf_cephalo.models.base import StagedModel
from hf_cephalo.planner import InfeasiblePlanError, Plan, optimize, predict
from hf_cephalo.planner.optimize import optimize_auto_checkpointing
from hf_cephalo.planner.rows import per_sample_cluster
from hf_cephalo.planner.types import activation_checkpointing_setting
from hf_cephalo.profiler.emulate import (EmulatedOutOfMemoryError, EmulatedStagedModel,
                                         apply_memory_cap, check_plan_memory,
                                         emulated_device_name)
from hf_cephalo.profiler.hardware import preserved_rng
from hf_cephalo.profiler.model_facts import profiling_stand_in
from hf_cephalo.profiler.measure import (MeasureConfig, check_profile_matches,
                                         check_profile_precision, local_device_name,
                                         measure_comm, model_dtype, model_profile,
                                         profile_cluster, sequence_length_of)
from hf_cephalo.profiles.cache import model_description, model_fingerprint
from hf_cephalo.profiles.precision import rank_precisions_tag
from hf_cephalo.profiles.types import ClusterProfile, format_bytes
from hf_cephalo.runtime.elastic import latest_checkpoint, read_checkpoint_record
from hf_cephalo.runtime.job import Job
from hf_cephalo.units import GIB

__all__ = ["ResolvedPlan", "resolve_plan", "select_world_devices", "cluster_with_measured_u",
           "check_state_fits_caps", "replan_live", "adopt_checkpoint_split",
           "adopt_checkpoint_state", "resume_banner", "wrap_staged", "measure_config",
           "job_rank_precisions", "warn_idle_ranks", "check_plan_for_job"]

logger = logging.getLogger(__name__)
DEFAULT_SEQUENCE_LENGTH = 128


class ResolvedPlan(NamedTuple):
    """The job's plan and the cluster profile it was made from (None for a plan file)."""

    plan: Plan
    cluster: ClusterProfile | None
    # why --cephalo_activation_checkpointing auto chose the plan's setting ("" otherwise):
    # printed after the plan's mode as "[auto: ...]" (optimize_auto_checkpointing)
    checkpointing_reason: str = ""


def resolve_plan(job: Job, staged: StagedModel, train_dataset: Any = None) -> ResolvedPlan:
    """Plan file > profile file > profile this cluster; then optimize, save, check caps.

    Collective when profiling or checking a profile file with world size > 1 (every rank calls
    it, from the runtime's session). Every rank ends with the same plan or the same error.

    Raises:
        ValueError: a profile of another model or device, a plan that does not fit the world
            size or the global batch size, ``InfeasiblePlanError`` when no plan fits (after a
            restart onto a smaller world: naming the devices the last checkpoint ran on that
            this world lacks), ``EmulatedOutOfMemoryError`` when a plan exceeds an emulated
            memory cap.
    """
    try:
        with preserved_rng(job.device):  # profiling must not move a seeded run's dropout
            return _resolve_plan(job, staged, train_dataset)
    except InfeasiblePlanError as exc:
        # Every rank solved the same problem, so every rank is here: the gather is matched.
        names = _gather_names(_local_name(job), job.world_size)
        raise InfeasiblePlanError(f"{exc}{_missing_devices(job.output_dir, names)}",
                                  exc.constraint) from exc


def _refuse_per_rank_precision_with_profile_file(job: Job) -> None:
    if job.settings.precision is not None and job.settings.plan_file is None \
            and job.settings.profile_file is not None:
        raise NotImplementedError(
            f"--cephalo_precision {job.settings.precision} with cephalo_profile_file: a profile "
            "file holds every rank measured in one precision, so it cannot price each rank at "
            "its own. Leave cephalo_profile_file unset (the trainer then profiles each rank in "
            "its precision at start), or make a plan with `hf-cephalo plan --cluster "
            "CLUSTER.yaml --model SHAPE --precision auto --out plan.json` and pass "
            "--cephalo_plan_file plan.json")


def _memory_caps(job: Job) -> list[int | None]:
    """Each rank's emulated memory cap (None: none); this rank's is applied to its device."""
    emulation = job.emulation
    cap = None if emulation is None else emulation.cap_of(job.rank)
    if cap is not None:
        how = apply_memory_cap(cap, job.device)
        if job.rank == 0:  # every rank's cap in one line (rank 1's is often the point)
            logger.info("emulated memory caps: %s; on rank 0 %s", ", ".join(
                f"rank {i} {format_bytes(c)}" for i, c in enumerate(emulation.memory_cap_bytes)),
                how)
    return [None] * job.world_size if emulation is None or emulation.memory_cap_bytes is None \
        else list(emulation.memory_cap_bytes)


def _plan_from_file(job: Job, staged: StagedModel, train_dataset: Any,
                    caps: list[int | None]) -> ResolvedPlan:
    """The plan file's plan, checked against this job (world, model, precision, batch,
    checkpointing, memory caps)."""
    plan = job.file_plan if job.file_plan is not None else Plan.load(job.settings.plan_file)
    plan.validate_for(job.world_size, model_profile(staged),
                      precision=_precision_tag(job, staged), plan_file=job.settings.plan_file)
    _check_plan_batch(job, plan)
    check_plan_file_checkpointing(plan, job)
    check_state_fits_caps(plan, model_profile(staged).state_bytes, caps)
    if all(r.predicted_memory_bytes is not None for r in plan.ranks):
        check_plan_memory([r.predicted_memory_bytes for r in plan.ranks], caps)
    if job.rank == 0:
        warn_idle_ranks(plan.global_batch_size, job.world_size)
    # Live re-balancing starts from the plan file and needs a profile to refit.
    cluster = _cluster(job, staged, train_dataset, plan.global_batch_size) \
        if job.settings.profile_file is not None and job.settings.adaptive == "batch" \
        and job.world_size > 1 else None
    return ResolvedPlan(plan, cluster)


def _resolve_plan(job: Job, staged: StagedModel, train_dataset: Any) -> ResolvedPlan:
    world_size = job.world_size
    _refuse_per_rank_precision_with_profile_file(job)
    caps = _memory_caps(job)
    if job.settings.plan_file is not None:
        return _plan_from_file(job, staged, train_dataset, caps)
    B = job.global_batch_size
    if job.is_main:
        warn_idle_ranks(B, world_size)
    profiled = _profiled(staged, job)
    measured = _cluster(job, profiled, train_dataset, B)  # per sequence row, as measured
    # a door whose sample is several rows (a preference pair): priced per sample, k rows each
    cluster = per_sample_cluster(measured, job.rows_per_sample)
    plan, reason = _optimize_at_start(job, staged, cluster, B)
    remeasured = cluster_with_measured_u(plan, cluster, profiled, job)
    if remeasured is not None:  # once, the same way (auto re-decides checkpointing), with its u
        cluster = remeasured
        plan, reason = _optimize_at_start(job, staged, cluster, B)
    plan.validate_for(world_size, cluster.model, precision=_precision_tag(job, staged))
    check_plan_memory([p.memory_bytes for p in predict(plan, cluster).ranks], caps)
    if job.rank == 0 and job.output_dir is not None:
        os.makedirs(job.output_dir, exist_ok=True)
        # per row (reusable by any door), with the u measured for the plan
        dataclasses.replace(measured, comm=cluster.comm).save(
            os.path.join(job.output_dir, "profile.json"))
        plan.save(os.path.join(job.output_dir, "plan.json"))
        print(f"[hf-cephalo] profile and plan saved to {job.output_dir}/profile.json, plan.json",
              flush=True)
    return ResolvedPlan(plan, cluster, reason)


def planned_checkpointing(job, model: Any = None) -> bool | None:
    """``--cephalo_activation_checkpointing`` as ``optimize``'s argument: True, False or None
    (auto, the default: plan both, keep the faster feasible one). With auto, a ``model``
    whose Hugging Face gradient checkpointing is on (``model.gradient_checkpointing_enable()``
    before the door's prepare / trainer) asks for checkpointing: True, as the trainer's
    ``--gradient_checkpointing`` does (the engine's recompute replaces the model's own,
    which ``prepare_for_training`` switches off). Raises ValueError for such a model beside an
    explicit 'false' (the two ask for opposite things, as 'false' with
    ``--gradient_checkpointing`` does)."""
    setting = activation_checkpointing_setting(job.settings.activation_checkpointing)
    checkpointing = model is not None and model_checkpointing(model)
    if setting is False and checkpointing:
        raise ValueError(
            "the model's gradient checkpointing is on (gradient_checkpointing_enable() was "
            "called) but --cephalo_activation_checkpointing / HF_CEPHALO_ACTIVATION_CHECKPOINTING "
            "is 'false' (keep every forward graph): they ask for opposite things. Call "
            "model.gradient_checkpointing_disable(), or set it to 'auto' or 'true'")
    if setting is None and checkpointing:
        return True
    return setting


def model_checkpointing(model: Any) -> bool:
    """Whether a module of ``model`` has Hugging Face gradient checkpointing switched on
    (``gradient_checkpointing is True``, what ``gradient_checkpointing_enable`` sets)."""
    modules = model.modules() if hasattr(model, "modules") else []
    return any(getattr(m, "gradient_checkpointing", False) is True for m in modules)


def check_plan_file_checkpointing(plan: Plan, job: Job) -> None:
    """A plan file records its own activation checkpointing; an explicit
    ``--cephalo_activation_checkpointing`` that contradicts it ('false' beside a plan made with
    it, 'true' beside one made without) is refused (ValueError) rather than ignored. Unset
    (the default) and 'auto' take the plan's choice."""
    given = job.activation_checkpointing_given
    word = job.settings.activation_checkpointing
    if word == "auto" or not given or (word == "true") == plan.activation_checkpointing:
        return
    made = "with" if plan.activation_checkpointing else "without"
    raise ValueError(f"--cephalo_activation_checkpointing {word} but the plan file "
                     f"{job.settings.plan_file!r} was made {made} activation checkpointing "
                     f"(activation_checkpointing {str(plan.activation_checkpointing).lower()}): "
                     f"re-plan with `hf-cephalo plan --activation-checkpointing {word}` (or "
                     "auto), or drop the flag (the plan file decides)")


def _infeasible_remedy(job: Job, global_batch_size: int, constraint: str) -> str:
    """The flags that relax an infeasible plan's binding constraint
    (``InfeasiblePlanError.constraint``), or "" where its message already says what to do.
    More devices: ``resolve_elastic_plan`` adds which ones."""
    if constraint not in ("device", "aggregate", "state", "batch"):
        return ""
    if constraint == "device" and job.rows_per_sample > 1:
        return _pair_remedy(job)
    ways = ["--cephalo_activation_checkpointing true or auto (recompute in backward instead "
            "of keeping every forward graph)"] \
        if planned_checkpointing(job) is False else []
    if constraint in ("aggregate", "batch"):
        ways.append(f"a smaller --cephalo_global_batch_size (now {global_batch_size})")
    ways.append(f"a --cephalo_memory_fraction closer to 1 (now {job.settings.memory_fraction})")
    ways.append(f"less memory per GPU ({'' if job.precision.compute != 'fp32' else '--bf16, '}a LoRA "
                "adapter, shorter sequences)")
    if job.settings.emulate_memory_cap_bytes is not None:
        ways.append("larger --cephalo_emulate_memory_cap_bytes")
    return "; to fit: " + ", ".join(ways[:-1]) + ", or " + ways[-1]


def _pair_remedy(job: Job) -> str:
    """What to do when not even one sample of several rows (a preference pair) fits any rank."""
    ways = ["a shorter max_length in the trainer's config (DPO truncates each sequence to "
            "it, the reward trainer drops longer pairs)", "a GPU with more memory"]
    if planned_checkpointing(job) is False:
        ways.append("--cephalo_activation_checkpointing true or auto")
    if job.precision.compute == "fp32":
        ways.append("--bf16")
    ways += ["a LoRA adapter", f"a --cephalo_memory_fraction closer to 1 (now "
             f"{job.settings.memory_fraction})"]
    if job.settings.emulate_memory_cap_bytes is not None:
        ways.append("larger --cephalo_emulate_memory_cap_bytes")
    return (f"; one sample of this trainer is a preference pair: its chosen and rejected rows "
            f"({job.rows_per_sample} rows at the global batch's padded width) must share one "
            "microbatch on one rank, so the smallest unit of work is those "
            f"{job.rows_per_sample} rows; to fit: " + ", ".join(ways[:-1]) + ", or " + ways[-1])


def _profiled(staged: StagedModel, job: Job) -> StagedModel:
    """What profiling at start runs: ``staged`` itself, or for a meta-device model (sharded
    loading, e.g. a TRL door given a model by name) a copy whose embedding, head and one
    layer of each size are materialized with the model's own initialization
    (``model_facts.profiling_stand_in``): timing needs their shapes, not the checkpoint's
    values, and each rank holds those modules for it."""
    if job.settings.profile_file is None and any(p.is_meta for p in staged.model.parameters()):
        return profiling_stand_in(staged)
    return staged


# [Note: measuring u after planning]
# The uneven factor u prices uneven plans, but which layout is uneven depends on the plan, which
# depends on u. The profile times u on the most skewed layout the memory caps allow (an upper
# bound on any plan's skew: planner.state.skewed_state_ratios). After planning, an uneven plan's
# own layout is timed on the real process group; if its u differs from the profile's by more
# than U_REPLAN_TOLERANCE the plan is made once more with it. Once: the new plan's ratios may
# differ again, but only through a u already measured for a real plan, not an assumed one.
U_REPLAN_TOLERANCE = 0.05


def _optimize_at_start(job: Job, staged: StagedModel, cluster: ClusterProfile,
                       global_batch_size: int) -> tuple[Plan, str]:
    """The start's plan for ``cluster`` and why its activation checkpointing setting was chosen
    ('' where the user set it): the exact optimizer with the job's checkpointing setting (auto
    prices both and keeps the faster, ``optimize_auto_checkpointing``), an RL door's
    forward-only scoring passes priced with the training step. Raises InfeasiblePlanError with
    the job's remedy appended."""
    try:
        checkpointing = planned_checkpointing(job, getattr(staged, "model", None))
        if checkpointing is None:  # auto: keep why, for the plan's line
            return optimize_auto_checkpointing(cluster, global_batch_size,
                                               job.settings.memory_fraction,
                                               scoring_passes=job.scoring_passes)
        plan = optimize(cluster, global_batch_size, job.settings.memory_fraction,
                        activation_checkpointing=checkpointing,
                        scoring_passes=job.scoring_passes)
    except InfeasiblePlanError as e:
        raise InfeasiblePlanError(f"{e}{_infeasible_remedy(job, global_batch_size, e.constraint)}",
                                  e.constraint) from None
    asked_by_model = checkpointing and activation_checkpointing_setting(
        job.settings.activation_checkpointing) is None
    return plan, "the model's gradient checkpointing is on" if asked_by_model else ""


def cluster_with_measured_u(plan: Plan, cluster: ClusterProfile, staged: StagedModel,
                            job: Job) -> ClusterProfile | None:
    """``cluster`` with the uneven factor u measured for ``plan``'s own layout, to plan again
    with, where it differs from the profile's by more than ``U_REPLAN_TOLERANCE``; None where it
    does not, or where nothing is measured.

    Collective on every rank (all ranks hold the same plan) when the plan is uneven, the world
    size is > 1 and the profile carries a measured u. The caller re-plans with the same
    optimizer call as before (so ``profile.json``, saved with this u, re-plans to the plan the
    job runs: with checkpointing auto the re-plan decides it again, as the first plan did).
    """
    if not plan.uneven_state or cluster.world_size == 1 or cluster.comm.uneven_factor is None \
            or not (dist.is_available() and dist.is_initialized()):
        return None
    measured = measure_comm(staged, device=job.device, group=None,
                            state_ratios=plan.state_ratios).uneven_factor
    old = cluster.comm.uneven_factor
    if abs(measured - old) <= U_REPLAN_TOLERANCE * old:
        return None
    logger.info("uneven factor of the plan's layout %.3f differs from the profile's %.3f: "
                "re-planning once", measured, old)
    comm = dataclasses.replace(cluster.comm, uneven_factor=measured,
                               uneven_state_ratios=list(plan.state_ratios))
    return dataclasses.replace(cluster, comm=comm)


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


def _cluster(job: Job, staged: StagedModel, train_dataset, B: int) -> ClusterProfile:
    """The given profile file (checked against this job) or a fresh/cached measurement."""
    world_size, emulation = job.world_size, job.emulation
    if job.settings.profile_file is None:
        config = measure_config(job, B, train_dataset)
        precisions = _start_rank_precisions(job)
        if precisions is None:
            return profile_cluster(staged, config, device=job.device, emulation=emulation)
        # precision per rank: each rank measures its device in its own precision, gathered
        # in fp32 when the ranks differ (docs/engine.md "Precision per rank")
        mine = precisions[job.rank]
        uniform = len(set(precisions)) == 1
        config = dataclasses.replace(config, precision=mine,
                                     param_dtype=mine if uniform else "fp32", reduce_dtype="fp32")
        cluster = profile_cluster(staged, config, device=job.device, emulation=emulation)
        cluster.extra.update(dtype=rank_precisions_tag(precisions, cluster.extra["dtype"]
                                                       .split("+")[0]),
                             rank_precisions=list(precisions))
        return cluster
    cluster = ClusterProfile.load(job.settings.profile_file)
    check_profile_precision(cluster, _precision_tag(job, staged),  # before any collective
                            f"cephalo_profile_file {job.settings.profile_file!r}")
    names = _gather_names(_local_name(job), world_size)
    cluster = select_world_devices(cluster, names, f"cephalo_profile_file {job.settings.profile_file!r}")
    check_profile_matches(cluster, model_profile(staged), names,
                          source=f"cephalo_profile_file {job.settings.profile_file!r}",
                          dtype=_precision_tag(job, staged),
                          fingerprint=model_fingerprint(staged.model),
                          description=model_description(staged.model),
                          sequence_length=None if train_dataset is None else
                          sequence_length_of(train_dataset, None))
    return cluster


# ---- elastic restarts -------------------------------------------------------------------------
def select_world_devices(cluster: ClusterProfile, names: list[str], source: str) -> ClusterProfile:
    """``cluster`` for a world whose ranks have device ``names`` (rank order).

    A profile file is a pool of device profiles: when the world differs from the file's ranks,
    each rank takes the profile of its device name. The collective profile (one unit, even
    shards) is kept; ring collectives move about the same bytes per rank at any world size.

    Raises:
        ValueError: a rank's device is not in the file (names it and the fix).
    """
    if [d.name for d in cluster.devices] == list(names):
        return cluster
    pool = {d.name: d for d in cluster.devices}
    unknown = sorted({n for n in names if n not in pool})
    if unknown:
        raise ValueError(
            f"{source} holds no profile for device(s) {unknown} of this world {list(names)} (it "
            f"knows {sorted(pool)}); profile them (`hf-cephalo profile` on those machines) and "
            "add them to the file, or leave cephalo_profile_file unset so the trainer measures "
            "at start (devices in the profile cache are not measured again)")
    devices = [dataclasses.replace(pool[n]) for n in names]
    logger.info("%s: %d ranks in the file, %d in this world; device profiles picked by name",
                source, cluster.world_size, len(names))
    return dataclasses.replace(cluster, devices=devices)


def _missing_devices(output_dir: str | None, names: list[str]) -> str:
    """The devices the last checkpoint's plan ran on that the world ``names`` lacks."""
    checkpoint = None if output_dir is None else latest_checkpoint(output_dir)
    plan = None if checkpoint is None else read_checkpoint_record(checkpoint)[0]
    if plan is None:
        return (f". This world ({len(names)} ranks: {names}) cannot hold the job: add devices "
                "with more memory")
    world_size = len(names)
    before = collections.Counter(r.device for r in plan.ranks)
    missing = before - collections.Counter(names)
    need = ", ".join(f"{k} x{v}" for k, v in sorted(missing.items())) or "none by name"
    caps = {r.device: r.memory_capacity_bytes for r in plan.ranks}
    detail = ", ".join(f"{k} ({format_bytes(caps[k])})" if caps.get(k) else k for k in missing)
    return (f". This world has {world_size} ranks; {checkpoint} ran on {plan.world_size} "
            f"({', '.join(r.device for r in plan.ranks)}). Devices missing against that plan: "
            f"{need}{' — ' + detail if detail else ''}; bring such GPUs back (or others with "
            "at least that memory) and the job resumes there")


# ---- live ------------------------------------------------------------------------------------
def replan_live(cluster: ClusterProfile, plan: Plan, rows, *, step: int,
                last_switch_step: int | None, threshold: float, hysteresis_steps: int,
                previous_scales=None, caps_bytes=None, streak: int = 0, mode: str = "batch",
                measured_step_s=None):
    """The live decision on the start profile ``cluster`` and the running ``plan`` with the
    exchanged measurement ``rows`` (one per rank): ``planner.adapt.decide_batch_switch``
    (``mode="batch"``, a ``SwitchDecision``) or ``decide_state_switch`` (``mode="state"``, a
    ``StateDecision``). Pure and identical on every rank ([Note: one decision on every rank] in
    adaptive.py)."""
    from hf_cephalo.planner.adapt import decide_batch_switch, decide_state_switch

    decide = decide_state_switch if mode == "state" else decide_batch_switch
    return decide(cluster, plan, rows, step=step, last_switch_step=last_switch_step,
                  threshold=threshold, hysteresis_steps=hysteresis_steps,
                  previous_scales=previous_scales, caps_bytes=caps_bytes, streak=streak,
                  measured_step_s=measured_step_s)


def adopt_checkpoint_split(plan: Plan, checkpoint_plan: Plan | None,
                           cluster: ClusterProfile | None) -> Plan:
    """The running ``plan`` with the (b_i, m_i, l_i) a checkpoint ran on, so a resume continues
    from the last live switch; ``plan`` itself when the checkpoint ran on another world or
    global batch size (an elastic re-plan holds then) or its split does not fit this plan's
    memory. r_i stay ``plan``'s (the engine is built with them; the state is re-laid on load)."""
    if checkpoint_plan is None or checkpoint_plan.world_size != plan.world_size or \
            checkpoint_plan.global_batch_size != plan.global_batch_size or \
            [r.device for r in checkpoint_plan.ranks] != [r.device for r in plan.ranks]:
        return plan
    ranks = [dataclasses.replace(r, batch_size=c.batch_size, microbatch_size=c.microbatch_size,
                                 num_microbatches=c.num_microbatches)
             for r, c in zip(plan.ranks, checkpoint_plan.ranks)]
    new = dataclasses.replace(plan, ranks=ranks)
    if cluster is not None:
        pred = predict(new, cluster)
        if not pred.fits:
            return plan
        for r, p in zip(new.ranks, pred.ranks):
            r.predicted_memory_bytes = p.memory_bytes
        new.predicted_iteration_s = pred.iteration_s
    return new


def resume_banner(plan: Plan, checkpoint_plan: Plan | None, whole: bool) -> str:
    """The line printed above the plan a resume continues on (``CephaloTrainer``), true to
    what was adopted: the checkpoint's whole plan (``whole``: ``adopt_checkpoint_state``), or
    its split (b_i, m_i, l_i) on the running plan's r_i (``adopt_checkpoint_split``); a
    running activation checkpointing other than the checkpoint's is said, with both."""
    if whole:
        return ("resume continues on the plan its checkpoint ran on (the live re-balancing "
                "before it)")
    text = ("resume continues on the split (b_i, m_i, l_i) its checkpoint ran on (the live "
            "re-balancing before it), with this run's state ratios r_i")
    if checkpoint_plan is not None and \
            checkpoint_plan.activation_checkpointing != plan.activation_checkpointing:
        on_off = {True: "on", False: "off"}
        text += (f" and this run's activation checkpointing "
                 f"{on_off[plan.activation_checkpointing]} (the checkpoint ran with it "
                 f"{on_off[checkpoint_plan.activation_checkpointing]})")
    return text


def adopt_checkpoint_state(plan: Plan, checkpoint_plan: Plan | None,
                           cluster: ClusterProfile | None) -> Plan | None:
    """``--cephalo_adaptive state`` on resume: the checkpoint's whole plan (b_i, m_i, l_i AND r_i)
    when a live re-layout moved r_i before the checkpoint was written, so the caller re-lays the
    engine onto it (``Session.relayout_state``) and the run continues exactly where it
    left off; None when the split alone is to be adopted (``adopt_checkpoint_split``): the
    checkpoint ran on another world, devices or global batch size, on the running r_i, with
    another root residency, activation checkpointing or precision, or its plan does not fit
    the profile's memory."""
    if checkpoint_plan is None or checkpoint_plan.world_size != plan.world_size or \
            checkpoint_plan.global_batch_size != plan.global_batch_size or \
            [r.device for r in checkpoint_plan.ranks] != [r.device for r in plan.ranks] or \
            checkpoint_plan.root_resident != plan.root_resident or \
            checkpoint_plan.activation_checkpointing != plan.activation_checkpointing or \
            checkpoint_plan.precision != plan.precision or \
            checkpoint_plan.rank_precisions != plan.rank_precisions or \
            checkpoint_plan.state_ratios == plan.state_ratios:
        return None
    if cluster is not None and not predict(checkpoint_plan, cluster).fits:
        return None
    return checkpoint_plan


# ---- the plan against the job ------------------------------------------------------------------
def _check_plan_batch(job: Job, plan: Plan) -> None:
    """The plan's B is the job's (``job.resolve_global_batch_size`` read the plan file when it
    made the job; a plan file rewritten since, or a ``Plan`` the front end was handed, may
    differ)."""
    if plan.global_batch_size != job.global_batch_size:
        raise ValueError(f"the plan has global_batch_size = {plan.global_batch_size} but the job "
                         f"trains global batches of {job.global_batch_size} samples "
                         "(--cephalo_global_batch_size or the per-device batch size x world "
                         "size): re-plan with the batch size you want or drop the flag")


def check_plan_for_job(job: Job, plan: Plan) -> None:
    """A plan handed to the front end (``plan=``): its world size and global batch size are the
    job's (ValueError otherwise, before any collective); rank 0 warns about idle ranks."""
    plan.validate_for(job.world_size)
    _check_plan_batch(job, plan)
    if job.is_main:
        warn_idle_ranks(plan.global_batch_size, job.world_size)


def warn_idle_ranks(global_batch_size: int, world_size: int) -> bool:
    """Warn (once, on rank 0's logger) when B < world size: some ranks get b_i = 0.

    Such ranks still hold training state and take part in every collective, but compute
    nothing. Returns True when the warning was given.
    """
    if global_batch_size >= world_size:
        return False
    logger.warning("global batch size %d < world size %d: at least %d rank(s) get no samples "
                   "(b_i = 0) and only hold training state; raise --cephalo_global_batch_size to "
                   ">= %d to use every rank", global_batch_size, world_size,
                   world_size - global_batch_size, world_size)
    return True


# ---- the profiler's inputs from the job -----------------------------------------------------------
def wrap_staged(staged: StagedModel, job: Job) -> StagedModel:
    """``staged`` wrapped in ``EmulatedStagedModel`` with this rank's slowdown when emulating
    (or, on CPU, with slowdown 1 to time compute for the accuracy report; on CUDA when live
    re-balancing or a slowdown schedule needs the compute timed); else unchanged."""
    emulation = job.emulation
    slowdown = 1.0 if emulation is None else emulation.slowdown_of(job.rank)
    timed = job.settings.adaptive != "off" and job.world_size > 1 or (
        emulation is not None and emulation.schedule is not None)
    if slowdown == 1.0 and job.device.type == "cuda" and not timed:
        return staged  # timing would synchronize the device and cost the real run its overlap
    return EmulatedStagedModel(staged, slowdown, job.device)


def _local_name(job: Job) -> str:
    emulation = job.emulation
    return emulated_device_name(local_device_name(job.device),
                                1.0 if emulation is None else emulation.slowdown_of(job.rank),
                                None if emulation is None else emulation.cap_of(job.rank))


def measure_config(job: Job, global_batch_size: int, train_dataset) -> MeasureConfig:
    """What the profiler measures at start for this job: microbatch sizes 1..min(8, B)
    (``HF_CEPHALO_PROFILE_MAX_MICROBATCH_SIZE``), the dataset's sequence length (128 without
    one), the job's precision and compile options."""
    max_m = env_int("HF_CEPHALO_PROFILE_MAX_MICROBATCH_SIZE", 8)
    seq = sequence_length_of(train_dataset, DEFAULT_SEQUENCE_LENGTH) if train_dataset is not None \
        else DEFAULT_SEQUENCE_LENGTH
    # Quiet by default: rank 0 prints a line every QUIET_INTERVAL_S and a summary;
    # HF_CEPHALO_VERBOSE=1 or DEBUG logging on hf_cephalo: every rank, every second.
    verbose = (env_flag("HF_CEPHALO_VERBOSE") or logging.getLogger("hf_cephalo").isEnabledFor(logging.DEBUG))
    precision = job.precision
    return MeasureConfig(max_microbatch_size=max(1, min(max_m, global_batch_size)),
                         sequence_length=seq, precision=precision.compute, verbose=verbose,
                         param_dtype=precision.param, reduce_dtype=precision.reduce,
                         compile_backend=None if job.compile is None else job.compile.backend,
                         compile_mode=None if job.compile is None else job.compile.mode)


def _gather_names(name: str, world_size: int) -> list[str]:
    if world_size == 1:
        return [name]
    names: list[Any] = [None] * world_size
    dist.all_gather_object(names, name)
    return names


def _precision_tag(job: Job, staged: StagedModel) -> str | None:
    """The job's [Note: precision tags] string, what its profile and plan must record; None
    with per-rank precision (``job_rank_precisions`` checks the plan's precisions instead)."""
    return job.precision.tag(str(model_dtype(staged)).replace("torch.", ""))


# ---- precision per rank (docs/engine.md "Precision per rank") ---------------------------------
def _device_facts(job: Job) -> tuple[list[str], list[tuple[int, int] | None]]:
    """Every rank's (device name, CUDA capability or None), by one all-gather."""
    device = job.device
    mine = (local_device_name(device),
            tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None)
    facts: list[Any] = [mine]
    if job.world_size > 1:
        facts = [None] * job.world_size
        dist.all_gather_object(facts, mine)
    return [f[0] for f in facts], [f[1] for f in facts]


def _start_rank_precisions(job: Job) -> list[str] | None:
    """The per-rank precision setting resolved for profiling at start (None without it): the
    list, or each device's fastest for ``auto``; the same on every rank, or the same
    ValueError."""
    from hf_cephalo.engine.rank_precision import resolve_rank_precisions
    from hf_cephalo.profiles.precision import parse_rank_precisions

    value = job.precision.per_rank
    if value is None:
        return None
    parse_rank_precisions(value, job.world_size)  # wrong length: before the all-gather
    names, caps = _device_facts(job)
    return resolve_rank_precisions(value, job.world_size, names, caps)


def job_rank_precisions(job: Job, plan: Plan) -> list[str] | None:
    """Each rank's precision under the per-rank precision setting (None without it), the same
    list on every rank, or the same ValueError on every rank before the engine's first
    collective.

    A list of the wrong length is refused before anything is exchanged; then one all-gather of
    every rank's (device name, CUDA capability) lets every rank check every rank's device. A
    plan that records per-rank precisions (``hf-cephalo plan --precision``) decides them: an
    explicit list must equal it, ``auto`` takes it (the planner's auto may choose one precision
    for all where mixing would double the all-gather bytes). A plan without them uses the list,
    or each device's fastest precision for ``auto``; one made for another one-precision job
    (its ``precision`` tag) is refused.
    """
    from hf_cephalo.engine.rank_precision import resolve_rank_precisions
    from hf_cephalo.profiles.precision import parse_rank_precisions

    value = job.precision.per_rank
    if value is None:
        return None
    wanted = parse_rank_precisions(value, job.world_size)  # wrong length: before any collective
    recorded = plan.rank_precisions
    if wanted is not None and recorded is not None and wanted != recorded:
        raise ValueError(f"--cephalo_precision {value} but the plan records {recorded} (one per "
                         "rank): give the plan's list or 'auto', or re-plan with `hf-cephalo "
                         f"plan --precision {value}`")
    names, caps = _device_facts(job)
    out = resolve_rank_precisions(recorded or value, job.world_size, names, caps)
    if recorded is None and plan.precision not in (None, rank_precisions_tag(out)):
        raise ValueError(f"the plan was made for precision {plan.precision!r}, not for the "
                         f"per-rank precisions {out}: re-plan with `hf-cephalo plan --precision "
                         f"{','.join(out)}` or drop --cephalo_precision")
    return out
