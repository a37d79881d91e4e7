"""``Session``: one training job on this rank, the runtime every front end drives.

A front end (``CephaloTrainer``, a prepared ``CephaloAccelerator`` loop, the TRL trainers)
builds a ``Job`` from its own settings, makes a ``Session`` over the model, and then only
adapts: it feeds the session's loaders to its loop, steps the session's optimizer, and calls
the step hooks. What the session owns, in the order a run meets it:

1. **Plan** (``planning.resolve_plan``): the plan given, else the plan file, else the exact
   optimizer over a profile (file, cache or measured at start). Rank 0 prints the plan table.
2. **Engine** (``CephaloEngine``) over the model, in the job's precision (or each rank's), with
   the emulation wrapper and the front end's head loss; the model object is guarded while
   hollow ([Note: the user's model while sharded] in ``sharded_model.py``).
3. **Loaders** (``train_loader`` / ``eval_loader``): this rank's b_i rows of the same global
   batches; the live split (``split_schedule``) belongs to the session.
4. **Optimizer** over the shards (``optim.py``) and the loss scaler (``scaler``).
5. **Step hooks** (``train_begin``, ``step_begin``, ``step_end``, ``train_end``): the one step
   timer, the emulated slowdown schedule, the adaptive controller, the accuracy report and the
   elastic progress file.
6. **Checkpoints** (``save_checkpoint``, ``resume``: composed once in ``checkpointing.py``;
   each front end adds only its own files) and **re-layout** (``relayout_state``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch import nn

from hf_cephalo.engine import CephaloEngine, relayout_state
from hf_cephalo.engine.export import streamed_save_problem
from hf_cephalo.engine.rank_precision import check_scalable_optimizer, rank_precision
from hf_cephalo.launch_check import check_this_launch
from hf_cephalo.models.base import StagedModel
from hf_cephalo.planner import Plan
from hf_cephalo.planner.adapt import refit_cluster
from hf_cephalo.profiler.emulate import find_emulated
from hf_cephalo.profiles.types import ClusterProfile
from hf_cephalo.runtime import checkpointing
from hf_cephalo.runtime.adaptive import AdaptiveController
from hf_cephalo.runtime.checkpoint_contents import CheckpointContents
from hf_cephalo.runtime.data import LoaderOptions, weighted_loader
from hf_cephalo.runtime.elastic import ElasticProgress
from hf_cephalo.runtime.job import Job
from hf_cephalo.runtime.planning import (check_plan_for_job, job_rank_precisions, resolve_plan,
                                         wrap_staged)
from hf_cephalo.runtime.process import ensure_process_group, register_exit_teardown
from hf_cephalo.runtime.report import (AccuracyReport, StepTimer, format_plan_table,
                                      format_scoring_line)
from hf_cephalo.runtime.sampler import SplitSchedule
from hf_cephalo.runtime.sharded_model import guard_sharded_model
from hf_cephalo.runtime.streaming import is_stream, stream_loader

__all__ = ["Session", "relayout_onto_plan", "plan_layout"]

logger = logging.getLogger(__name__)


def plan_layout(engine: CephaloEngine, plan: Plan) -> list[list[int]]:
    """``plan``'s shard layout for this engine's units (``Plan.unit_layout``), after checking
    the plan is for this world and model.

    Raises:
        TypeError: ``plan`` is not a ``Plan``.
        ValueError: a plan for another world size or (``plan.model``) another model.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"relayout needs a hf_cephalo.planner.Plan, got {type(plan).__name__}")
    if plan.world_size != engine.world_size:
        raise ValueError(f"relayout_state: the new plan is for world size {plan.world_size} but "
                         f"the engine runs on {engine.world_size} ranks; re-plan for these ranks "
                         "(a change of world size is an elastic restart from a checkpoint)")
    if plan.model is not None:
        mine = dict(num_units=engine.num_units,
                    params_per_unit=max((u.numel for u in engine.units), default=0),
                    params_other=engine.root.embed.numel + engine.root.head.numel)
        theirs = {k: plan.model.get(k) for k in mine}
        if mine != theirs:
            raise ValueError(f"relayout_state: the new plan was made for model "
                             f"{plan.model.get('name')!r} {theirs} but the engine's model has "
                             f"{mine}; re-plan for this model")
    return [[int(n) for n in row] for row in plan.unit_layout(engine.unit_numels())]


def relayout_onto_plan(engine: CephaloEngine, optimizer, plan: Plan) -> None:
    """Collective: ``engine.relayout_state`` onto ``plan``'s r_i (its layout and root
    residency); see ``plan_layout`` for the checks made first."""
    relayout_state(engine, optimizer, plan_layout(engine, plan), root_resident=plan.root_resident)


class Session:
    """One training job on this rank (see the module note).

    Args:
        job: the job description (``job.Job``).
        staged: the model's adapter (``models.stage_model``), possibly wrapped by the front end
            (a Trainer's ``compute_loss`` as the head loss); the session adds the emulation
            wrapper.
        model: the model object the user gave the front end (default ``staged.model``; a LoRA
            ``PeftModel`` wraps the adapter's model): guarded while sharded, saved as an
            adapter when it is a ``PeftModel``.
        plan: a ``Plan`` to use instead of the settings' plan / profile file.
        cluster_profile: with ``plan``, the ``ClusterProfile`` it was made from (live
            re-balancing refits it; ignored without ``plan``).
        train_dataset: the training dataset (its sequence length prices the profile).
        plan_staged: the adapter the planner profiles (default ``staged``; a front end whose
            ``staged`` wraps a user loss passes the plain adapter).

    Raises:
        ValueError: a plan for another world or global batch size, a plan that does not fit
            (``InfeasiblePlanError``, ``EmulatedOutOfMemoryError``), per-rank precision errors —
            on every rank alike, before the engine's first collective.
    """

    def __init__(self, job: Job, staged: StagedModel, *, model: nn.Module | None = None,
                 plan: Plan | None = None, cluster_profile: ClusterProfile | None = None,
                 train_dataset: Any = None, plan_staged: StagedModel | None = None) -> None:
        self.job = job
        # the object the front end was given (a LoRA PeftModel around the adapter's base model)
        self.model: nn.Module = staged.model if model is None else model
        self.checkpointing_reason = ""  # why activation checkpointing auto chose the plan's
        # one CPU process where several were asked for (stock accelerate launch on CPU)
        check_this_launch(job.world_size, None if plan is None else plan.world_size)
        _warn_if_unsaveable(self.model)
        if plan is not None:
            check_plan_for_job(job, plan)
            self.cluster_profile = cluster_profile
        else:  # plan file > profile file > profile this cluster (planning.py)
            resolved = resolve_plan(job, plan_staged or staged, train_dataset)
            plan, self.cluster_profile = resolved.plan, resolved.cluster
            self.checkpointing_reason = resolved.checkpointing_reason
        self.plan = plan
        staged.check_microbatch_sizes(plan.microbatch_sizes)  # every rank alike
        self.live_cluster: ClusterProfile | None = None  # the refit profile after a switch
        self.last_switch_step: int | None = None
        # per-rank precision: checked on every rank alike before the engine's first collective
        self.rank_precisions = job_rank_precisions(job, plan)
        self.full_numel = sum(p.numel() for p in self.model.parameters())
        # after planning: every refusal of the plan comes before a 1-rank group exists
        ensure_process_group(job.device)
        register_exit_teardown()  # ends the process group cleanly if the script does not
        self.engine = self._build_engine(wrap_staged(staged, job))
        self.scaler = self._make_scaler()
        guard_sharded_model(self.model, self.full_numel)
        self.optimizer: torch.optim.Optimizer | None = None  # set by the front end
        self.split_schedule = SplitSchedule(plan.batch_sizes, plan.microbatch_sizes)
        self.timer = StepTimer(self.engine.staged)
        self.report = AccuracyReport(self)
        self.progress = ElasticProgress(job.output_dir, job.rank, job.world_size)
        self.controller = self._make_controller()
        self.switch_listeners: list[Callable[[dict[str, Any]], None]] = []
        self.global_step = 0  # optimizer steps done (step_end's count)
        self._print_plan()

    # ---- construction ---------------------------------------------------------------------
    def _build_engine(self, staged: StagedModel) -> CephaloEngine:
        """The engine builds unit by unit: a meta model reads its checkpoint slices
        (``model.cephalo_checkpoint``, from ``from_pretrained_sharded``) or is initialized per
        unit with the job's seed; an in-memory model takes rank 0's values."""
        job, plan = self.job, self.plan
        precision = job.precision.engine() if self.rank_precisions is None else \
            rank_precision(self.rank_precisions, job.rank).engine
        return CephaloEngine(staged, plan.state_ratios, device=job.device,
                             offload_activations=job.settings.offload_activations,
                             precision=precision,
                             root_resident=plan.root_resident, init_seed=job.seed,
                             activation_checkpointing=plan.activation_checkpointing,
                             compile=job.compile)

    def forward_only_engine(self, staged: StagedModel) -> CephaloEngine:
        """A second engine over ``staged`` (a frozen model beside the trained one, e.g. DPO's
        reference model), sharded by the plan's state ratios r_i like the trained model and
        built the same way (precision, placement, activation checkpointing), for
        ``evaluate`` passes only: it holds no gradients and no optimizer. Collective: every rank
        builds it, in the same order. Its parameters are frozen here (``requires_grad``
        False). Not priced by the planner, and not re-laid out by a live switch (its shards
        keep the start plan's r_i)."""
        for p in staged.model.parameters():
            p.requires_grad_(False)
        return self._build_engine(wrap_staged(staged, self.job))

    def _make_scaler(self, **options):
        """fp16 anywhere (the job's precision, or one rank's): the engine's sharded loss scaler,
        used by every rank (found-inf agreed across ranks, every rank skips the same step);
        ``options``: ``GradScaler``'s (``init_scale``, ``growth_interval``, ...)."""
        if self.job.precision.compute == "fp16" or "fp16" in (self.rank_precisions or ()):
            return self.engine.make_grad_scaler(**options)
        return None

    def set_scaler_options(self, **options) -> None:
        """Rebuild the loss scaler (fp16; none otherwise) with ``GradScaler`` options, before
        training (Accelerate's ``GradScalerKwargs`` in a custom loop)."""
        self.scaler = self._make_scaler(**options)

    def _make_controller(self) -> AdaptiveController | None:
        """The live re-balancing controller where it applies; a warning, once, where it cannot
        run (no profile to refit). DataLoader workers read ahead inside the runtime's loader,
        which re-reads a step drawn before a switch ([Note: switching the split live])."""
        job = self.job
        if job.settings.adaptive == "off" or job.world_size == 1:
            return None
        if self.cluster_profile is None:
            if job.is_main:  # named for every door: a flag, a CephaloPlugin field, a variable
                logger.warning(
                    "live re-balancing (adaptive=%s) is off for this run: the plan was given "
                    "without the profile it was made from, so there is nothing to refit; give "
                    "profile_file with plan_file, or set adaptive to off to silence this (as "
                    "--cephalo_<setting>, CephaloPlugin(<setting>=...) or HF_CEPHALO_<SETTING>)",
                    job.settings.adaptive)
            return None
        emulation = job.emulation
        caps = None if emulation is None or emulation.memory_cap_bytes is None \
            else [float(c) for c in emulation.memory_cap_bytes]
        s = job.settings
        return AdaptiveController(self, interval=s.adaptive_interval,
                                  threshold=s.adaptive_threshold,
                                  hysteresis_steps=s.adaptive_hysteresis_steps, caps_bytes=caps,
                                  mode=s.adaptive)

    def _print_plan(self) -> None:
        if not self.job.is_main:
            return
        print(format_plan_table(self.plan, self.checkpointing_reason,
                                self.job.global_batch_origin), flush=True)
        if self.cluster_profile is not None:
            from hf_cephalo.planner.simulate import extrapolation_note

            if self.job.scoring_passes:
                print(format_scoring_line(self.plan, self.cluster_profile,
                                          self.job.scoring_passes), flush=True)

            note = extrapolation_note(self.plan, self.cluster_profile)
            if note:
                print(note, flush=True)

    # ---- loaders ------------------------------------------------------------------------------
    def train_loader(self, dataset, collate_fn, *, shuffle: bool = True, drop_last: bool = False,
                     lengths: Sequence[int] | None = None, whole_batches: bool = False):
        """This rank's training loader: b_i rows of every global batch in microbatches of m_i
        (``whole_batches``: as one batch, for a front end that cuts them itself), following
        the live split (``split_schedule``); ``shuffle`` False: dataset order; ``lengths``:
        group-by-length order (``runtime/data.py``). A stream (``streaming.is_stream``) is
        read in order by every rank, each keeping its rows (``runtime/streaming.py``; shuffle
        and lengths do not apply, as stock Trainer uses no sampler for one)."""
        rank_plan = self.plan.ranks[self.job.rank]
        if is_stream(dataset):
            return self._stream_loader(dataset, collate_fn, drop_last=drop_last,
                                       whole_batches=whole_batches)
        return weighted_loader(dataset, collate_fn, batch_sizes=self.plan.batch_sizes,
                               rank=self.job.rank,
                               microbatch_size=None if whole_batches else
                               max(rank_plan.microbatch_size, 1),
                               seed=self.job.data_seed, shuffle=shuffle, drop_last=drop_last,
                               lengths=lengths, schedule=self.split_schedule,
                               collate=self.job.settings.collate, options=self.job.loader,
                               sample_seed=self.job.seed, group=self.engine.group,
                               description="training")

    def _stream_loader(self, dataset, collate_fn, *, drop_last: bool, whole_batches: bool):
        """``train_loader`` over a stream; DataLoader workers are not used (rank 0 says so)."""
        if self.job.loader.num_workers > 0 and self.job.is_main:
            logger.warning("--dataloader_num_workers %d: a streamed dataset is read in the main "
                           "process (every rank reads the whole stream in order; workers would "
                           "each read a part of it)", self.job.loader.num_workers)
        rank_plan = self.plan.ranks[self.job.rank]
        return stream_loader(dataset, collate_fn, batch_sizes=self.plan.batch_sizes,
                             rank=self.job.rank,
                             microbatch_size=None if whole_batches else
                             max(rank_plan.microbatch_size, 1),
                             drop_last=drop_last, schedule=self.split_schedule,
                             collate=self.job.settings.collate,
                             pin_memory=self.job.loader.pin_memory)

    def eval_loader(self, dataset, collate_fn, *, microbatch_size: int | None,
                    options: LoaderOptions | None = None):
        """This rank's evaluation loader: an unshuffled split of the dataset by the plan's b_i
        proportions (a faster rank evaluates more), in microbatches of ``microbatch_size``
        (None: each step's rows as one batch)."""
        return weighted_loader(dataset, collate_fn, batch_sizes=self.plan.batch_sizes,
                               rank=self.job.rank, microbatch_size=microbatch_size,
                               seed=self.job.data_seed, shuffle=False,
                               collate=self.job.settings.collate,
                               options=options or self.job.loader, sample_seed=self.job.seed,
                               group=self.engine.group, description="evaluation")

    # ---- optimizer ------------------------------------------------------------------------------
    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Adopt the front end's optimizer over the shards (``optim.py``); fp16 ranks: the
        scaler must be able to drive it. One over the per-parameter shards (built, re-pointed
        or assigned by the user, e.g. ``trainer.optimizer = AdamW(...)``: every door adopts its
        optimizer here) skips the parameters a step did not reach, as stock ([Note: parameters
        without a gradient])."""
        inner = getattr(optimizer, "optimizer", optimizer)
        if self.rank_precisions is not None:
            check_scalable_optimizer(inner, self.rank_precisions,
                                     [r.device for r in self.plan.ranks])
        shards = self.engine.param_shards
        own = {id(p) for p in shards.params}
        if any(id(p) in own for group in inner.param_groups for p in group["params"]):
            shards.hold_untouched(inner)
        self.optimizer = inner
        return optimizer

    # ---- step hooks -------------------------------------------------------------------------------
    def train_begin(self) -> None:
        self.report.train_begin()

    def step_begin(self, global_step: int) -> None:
        """Before optimizer step ``global_step`` + 1 (0-based ``global_step`` steps done): the
        resume report (once), the emulated slowdown schedule's factor, the step timer."""
        self.progress.step_begin(self.plan)
        schedule = None if self.job.emulation is None else self.job.emulation.schedule
        if schedule is not None:
            emulated = find_emulated(self.engine.staged)
            if emulated is not None:
                emulated.slowdown = schedule.factors_at(global_step)[self.job.rank]
        self.timer.begin()

    def step_end(self, global_step: int, num_samples: int | None, *, epoch: float | None = None,
                 is_last_step: bool = False) -> dict[str, Any] | None:
        """After optimizer step ``global_step`` (1-based count of steps done): time it, report
        early accuracy, let the controller exchange / decide / switch (the next batch the
        loader draws follows a switch), record progress. Collective on the steps the report
        and the controller exchange (the same steps on every rank). Returns the switch record,
        if the plan changed."""
        self.global_step = global_step
        step = self.timer.end(num_samples, self.plan.ranks[self.job.rank].batch_size)
        self.report.step_end(is_last_step)
        record = None
        if self.controller is not None:
            record = self.controller.step_end(step, global_step, epoch, is_last_step)
        self.progress.step_end(global_step)
        return record

    def train_end(self) -> None:
        self.report.train_end()

    # ---- plan changes -------------------------------------------------------------------------
    def switch_plan(self, new: Plan, global_step: int, *, relayout: bool = False,
                    scales: Sequence[float] | None = None) -> None:
        """A live switch at the step boundary after ``global_step``: re-lay r_i first when
        ``relayout`` (collective), then split the next global batches by the new b_i / m_i.
        ``scales``: the measured unit-compute scales the decision refit the profile with."""
        if relayout:
            self.relayout_state(new)
        self.plan = new
        self.split_schedule.switch(global_step, new.batch_sizes, new.microbatch_sizes)
        self.last_switch_step = global_step
        if scales is not None and self.cluster_profile is not None:
            self.live_cluster = refit_cluster(self.cluster_profile, scales)
        self.report.plan_switched()
        for listener in self.switch_listeners:
            listener({"step": global_step, "plan": new})

    # ---- the step calls a door makes (the engine stays behind the session) -----------------
    @property
    def staged(self) -> StagedModel:
        """The staged model the engine runs (possibly wrapped: a user loss, head calls)."""
        return self.engine.staged

    @property
    def group(self):
        """The job's process group."""
        return self.engine.group

    def zero_grad(self) -> None:
        """Drop the shards' gradients (one engine step per optimizer step)."""
        self.engine.zero_grad()

    def train_step(self, microbatches: Sequence[Any], loss_scale: Any = None):
        """Collective: forward + backward of one optimizer step over this rank's microbatches
        (``CephaloEngine.train_step``: the gradient of the global item-mean loss, added to the
        shards' ``.grad``; raises ValueError on every rank for a step with no items)."""
        return self.engine.train_step(microbatches, loss_scale=loss_scale)

    def forward_step(self, microbatches: Sequence[Any]):
        """Collective: the forward half of a step whose loss the caller computes; returns the
        open step ``backward_step`` or ``discard_step`` takes (``CephaloEngine.forward_step``)."""
        return self.engine.forward_step(microbatches)

    def backward_step(self, open_step, loss) -> bool:
        """Collective: the backward half of ``open_step`` for ``loss``."""
        return self.engine.backward_step(open_step, loss)

    def discard_step(self, open_step, why: str) -> None:
        """Drop ``open_step`` without a backward (``why`` names the reason in later errors)."""
        self.engine.discard_step(open_step, why)

    def evaluate(self, microbatches: Sequence[Any], **kwargs):
        """Collective: the layered forward without gradients (``CephaloEngine.evaluate``)."""
        return self.engine.evaluate(microbatches, **kwargs)

    def generate(self, prompt_ids, rows, params, round_: int, *, mode: str = "auto",
                 pad_to_multiple_of: int | None = None, generation_split=None,
                 generation_config=None):
        """Collective: decode this rank's prompts on the sharded weights, sampling keyed by
        each prompt's global row, optionally on other ranks (``generation_split``), with the
        logits processors of ``generation_config`` (``resolve_generation``)
        (``runtime.generation.session_generate``; returns ``GenerateOutput``)."""
        from hf_cephalo.runtime.generation import session_generate

        return session_generate(self, prompt_ids, rows, params, round_, mode=mode,
                                pad_to_multiple_of=pad_to_multiple_of,
                                generation_split=generation_split,
                                generation_config=generation_config)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Collective: the global L2 norm of the gradients, clipped to ``max_norm`` (``inf``:
        the norm only)."""
        return self.engine.clip_grad_norm_(float(max_norm))

    def named_shards(self):
        """(name, shard) of this rank's per-parameter shards, the model's parameter names."""
        return self.engine.param_shards.named_parameters()

    def shard_params(self) -> list:
        """This rank's per-parameter shards (what an optimizer over the model steps)."""
        return self.engine.param_shards.params

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's state dict on rank 0 (CPU), None elsewhere."""
        return self.engine.full_state_dict()

    def restore_full_model(self) -> None:
        """Collective: full copies of the current weights into the user's model object on
        every rank (``sharded_model.restore_full_model``)."""
        from hf_cephalo.runtime.sharded_model import restore_full_model

        restore_full_model(self.engine)

    def build_optimizer(self, optimizer_cls: type, optimizer_kwargs, groups):
        """``optimizer_cls`` over this rank's shards in ``groups`` (``optim.shard_optimizer``)."""
        from hf_cephalo.runtime.optim import shard_optimizer

        return shard_optimizer(self.engine, optimizer_cls, optimizer_kwargs, groups)

    def repoint_optimizer(self, optimizer, name_of, what: str) -> None:
        """An optimizer built over the model's parameters, re-pointed in place at their shards
        (``optim.repoint_optimizer``; ValueError naming ``what`` for a parameter it lacks)."""
        from hf_cephalo.runtime.optim import repoint_optimizer

        repoint_optimizer(optimizer, self.engine, name_of, what)

    def any_rank(self, flag: bool) -> bool:
        """Collective (every rank): whether ``flag`` is true on some rank of the job."""
        from hf_cephalo.runtime.collectives import any_rank

        return any_rank(flag, self.engine.group, self.job.device)

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective (every rank): every rank's rows of ``tensor``, in rank order along dim 0
        (``runtime.collectives.gather_rows``; ValueError for disagreeing trailing dims)."""
        from hf_cephalo.runtime.collectives import gather_rows

        return gather_rows(tensor, self.engine.group)

    # ---- checkpoints (checkpointing.py: each step composed there once) -----------------------
    def save_checkpoint(self, directory: str, *, optimizer, global_step: int,
                        contents: CheckpointContents, add_files: Callable[[str], None],
                        model_files: Callable[[str], None] | None = None) -> None:
        """Collective (every rank): this run's checkpoint at ``global_step`` into
        ``directory``, written atomically: the engine's part (the ``save_model`` files where
        ``contents`` promises them, through ``model_files(staging)`` when given; the shards of
        the weights and ``optimizer``, the plan and run record, ``cephalo_contents.json``), then
        the front end's own files through ``add_files(staging)``
        (``checkpointing.save_checkpoint``)."""
        checkpointing.save_checkpoint(self, directory, optimizer=optimizer,
                                      global_step=global_step, contents=contents,
                                      add_files=add_files, model_files=model_files)

    def resume(self, checkpoint: str, *, global_step: int | None = None) -> checkpointing.Resume:
        """Start resuming from ``checkpoint``: checked against this run (another model or
        global batch size: ValueError on every rank, before any state is read), the plan it
        ran on adopted, the resume reported at the first step; the returned ``Resume`` loads
        the weights, then the optimizer state and scheduler (``checkpointing.Resume``)."""
        return checkpointing.Resume(self, checkpoint, global_step=global_step)

    def load_checkpoint_weights(self, checkpoint: str, *, when: str,
                                weights_only: bool = False) -> CheckpointContents | None:
        """This rank's shards of ``checkpoint``'s weights after checking its promised files
        (``when`` names the action in their messages; ``checkpointing.load_checkpoint_weights``),
        e.g. the best checkpoint's at the end of training."""
        return checkpointing.load_checkpoint_weights(self, checkpoint, when=when,
                                                     weights_only=weights_only)

    def save_model_files(self, directory: str, max_shard_size) -> None:
        """Collective (every rank): a ``from_pretrained`` folder of the current weights,
        streamed unit by unit (a LoRA ``PeftModel``: its adapter;
        ``checkpointing.save_model_files``)."""
        checkpointing.save_model_files(self, directory, max_shard_size)

    def relayout_state(self, new_plan: Plan) -> None:
        """Collective, at a step boundary: re-lay the training state onto ``new_plan``'s r_i in
        memory and make it the current plan (``engine/relayout.py``; the optimizer, its param
        groups and LR scheduler stay the same objects).

        Raises (before any collective): ValueError for a plan of another world size, model or
        precision; RuntimeError mid-step; the other errors of ``relayout_state``.
        """
        if self.rank_precisions is not None:  # per-rank precision: the ranks keep theirs
            if new_plan.rank_precisions not in (None, list(self.rank_precisions)):
                raise ValueError(f"relayout_state: the new plan computes in "
                                 f"{new_plan.rank_precisions} per rank, this run in "
                                 f"{list(self.rank_precisions)}; re-plan with these precisions")
        else:  # the engine's dtype: the model's placeholders no longer carry it
            job = self.job.precision.tag(str(self.engine.dtype).removeprefix("torch."))
            if new_plan.precision not in (None, job):
                raise ValueError(f"relayout_state: the new plan was made for precision "
                                 f"{new_plan.precision!r}, this run trains in {job!r}; re-plan "
                                 "for this run's precision")
        relayout_onto_plan(self.engine, self.optimizer, new_plan)
        self.plan = new_plan


def _warn_if_unsaveable(model: nn.Module) -> None:
    """Say before planning that the full-model save will refuse ``model`` (a conversion of its
    ``save_pretrained`` layout other than stacked experts), so the user learns it before the
    run, not after it; training and the sharded checkpoints are not affected."""
    problem = streamed_save_problem(model)
    if problem is not None:
        import warnings

        warnings.warn(f"save_model, cephalo_save_full_model and hf-cephalo export will refuse "
                      f"this model: {problem}. Training and the sharded checkpoints "
                      "(checkpoint-N, save_state) are not affected", stacklevel=3)
