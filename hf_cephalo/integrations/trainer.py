"""CephaloTrainer: the Hugging Face Trainer driving the Cephalo engine (docs/design.md contract 6).

Swap ``Trainer`` for ``CephaloTrainer`` and ``TrainingArguments`` for
``CephaloTrainingArguments``; launch with ``accelerate launch --config_file
accelerate_configs/cephalo_cpu.yaml train.py`` (or ``cephalo.yaml`` on GPUs).

What changes against stock Trainer (everything else — LR scheduler, logging, report_to,
callbacks — is the Trainer's own):

- **Plan** (``replan.resolve_plan_for_model``): the plan file, else the exact optimizer
  over the profile file, else over a profile measured at start (cached on disk; emulated
  devices included); profile.json and plan.json are saved in output_dir. The per-rank plan
  table is printed by rank 0 at start, predicted vs measured step time and memory at the end.
- **Engine**: the model's parameters are sharded by the plan's r_i (``CephaloEngine``), unit
  by unit: stock Trainer does not move the model to the device first
  (``CephaloTrainingArguments.place_model_on_device`` is False); a meta-device model reads its
  shards from its checkpoint (``hf_cephalo.from_pretrained_sharded``) or is initialized per
  unit with ``args.seed``; an in-memory model starts from rank 0's weights. The Accelerator
  does not wrap it in DDP (``CephaloAccelerator.attach_engine``).
- **Data**: each rank's DataLoader uses ``WeightedBatchSampler`` (rank i gets exactly b_i samples
  per step, same permutation on every rank, every sample once per epoch) and is not prepared by
  Accelerate; a batch is the rank's list of microbatches of m_i samples.
- **Step**: one Trainer step = one ``engine.train_step`` over this rank's microbatches = one
  optimizer step (``gradient_accumulation_steps`` must be 1; the engine accumulates over l_i
  microbatches itself). The loss is the GLOBAL item mean of the step (tokens with label != -100
  after the causal shift, or samples), identical on every rank; a partial last global batch is
  divided by the items it really holds. The engine computes losses as sums and normalizes them
  itself, so models whose forward ignores ``num_items_in_batch`` (ViT, BERT) are normalized the
  same way.
- **Clipping**: the global L2 norm over all ranks' shards (``engine.clip_grad_norm_``).
- **Optimizer**: built by the Trainer's optimizer class/kwargs over this rank's 1-D shards;
  weight decay by parameter name as stock (per-element mask, ``weight_decay.py``).
- **Loss**: label smoothing, ``compute_loss_func`` and ``compute_loss`` overrides run in the
  engine's head phase per microbatch with the global item count (``user_loss.py``).
- **Support matrix**: every ``TrainingArguments`` field and hook works as stock, is not
  applicable, or is refused at construction (``support.py``, docs/trainer_support.md).
- **The user's model**: hollow while sharded; calling it raises naming ``save_model``;
  ``unshard_model()`` restores full weights (``sharded_model.py``).
- **Evaluation**: through the engine; rank-weighted unshuffled split of the eval set, every
  prediction gathered exactly once in dataset order.
- **Saving**: ``save_model`` (collective) streams the model one unit at a time into the
  files ``save_pretrained`` writes (sharded safetensors above ``cephalo_max_shard_size``, the
  model's own keys, tied weights once); rank 0 never holds the whole model.
- **Checkpoints** (``save_steps``): written atomically (staging directory renamed after a
  completeness marker); each rank writes its parameter and optimizer shards with their layout,
  so ``resume_from_checkpoint`` works onto any plan and world size (docs/checkpoints.md). The
  full model goes in only with ``cephalo_save_full_model``; ``hf-cephalo export`` writes it
  from any checkpoint. ``save_only_model`` checkpoints hold the ``save_model`` files only, as
  stock (a resume restores the weights, not the optimizer). A checkpoint is marked complete
  only if it holds every file its settings promise (``checkpoint_contents.py``).
- **Best model** (``load_best_model_at_end``): stock tracking; at train end the best
  checkpoint's weights are read into the shards (``_load_best_model``).
- **Elastic** (``hf_cephalo.integrations.elastic``, README "Elastic training"): checkpoints also
  hold ``plan.json`` and ``cephalo_run.json``; a resume onto another world re-plans with the
  same global batch size (another B or model: ValueError), logs old and new plan side by side
  and the time lost (steps redone, restart seconds) into ``cephalo_restarts.jsonl``.
"""

from __future__ import annotations

import copy
import atexit
import datetime
import itertools
import logging
import os
import sys
import time
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

from hf_cephalo.engine import CephaloEngine, CompileOptions
from hf_cephalo.engine.rank_precision import check_scalable_optimizer, rank_precision
from hf_cephalo.integrations.accelerate import CephaloAccelerator, CephaloPlugin
from hf_cephalo.integrations.adaptive import AdaptiveCallback, SlowdownScheduleCallback
from hf_cephalo.integrations.auto_plan import (PlanAccuracyCallback, job_rank_precisions,
                                               wrap_staged)
from hf_cephalo.integrations.elastic import ElasticCallback
from hf_cephalo.integrations.jit_checkpoint import replace_jit_checkpoint_callback
from hf_cephalo.integrations.preflight import check_before_planning, check_script
from hf_cephalo.integrations.replan import resolve_elastic_plan
from hf_cephalo.runtime.data import LoaderOptions, weighted_loader
from hf_cephalo.runtime.sampler import SplitSchedule
from hf_cephalo.integrations.sharded_model import guard_sharded_model, restore_full_model
from hf_cephalo.integrations.support import HOOK_SUPPORT
from hf_cephalo.integrations.training_args import CephaloTrainingArguments
from hf_cephalo.integrations.user_loss import UserLossStagedModel
from hf_cephalo.integrations.weight_decay import ShardWeightDecay, decay_rule, shard_decay_masks
from hf_cephalo.models.registry import supported_model_classes
from hf_cephalo.planner import Plan
from hf_cephalo.planner.types import activation_checkpointing_mode
from hf_cephalo.profiles.types import ClusterProfile

__all__ = ["CephaloTrainer", "format_plan_table", "format_loss_trend"]

logger = logging.getLogger(__name__)


def format_plan_table(plan: Plan, checkpointing_reason: str = "") -> str:
    """The plan as a text table: one row per rank (batch, microbatch, microbatches, state %);
    the header says the global batch size, whether the state is uneven, the activation
    checkpointing mode (``on``: recompute in backward; ``off``: forward graphs kept; with
    ``checkpointing_reason``, why ``--cephalo_activation_checkpointing auto`` chose it, as
    ``[auto: ...]``) and the predicted iteration time."""
    # full device names: emulated ones differ only after the base name ("cpu [emulated 2x ...]")
    width = max([12] + [len(r.device) for r in plan.ranks])
    mode = activation_checkpointing_mode(plan.activation_checkpointing, checkpointing_reason)
    rows = [f"Cephalo plan: global batch size {plan.global_batch_size}, uneven state "
            f"{plan.uneven_state}, activation checkpointing {mode}, predicted iteration "
            f"{'-' if plan.predicted_iteration_s is None else f'{plan.predicted_iteration_s:.3f} s'}",
            f"{'rank':>4} {'device':<{width}} {'b_i':>5} {'m_i':>5} {'l_i':>5} {'r_i %':>7}"]
    per_rank = plan.rank_precisions is not None  # precision per rank: one more column
    if per_rank:
        rows[-1] += "  precision"
    for r in plan.ranks:
        rows.append(f"{r.rank:>4} {r.device:<{width}} {r.batch_size:>5} {r.microbatch_size:>5} "
                    f"{r.num_microbatches:>5} {100 * r.state_ratio:>7.2f}"
                    + (f"  {r.precision}" if per_rank else ""))
    return "\n".join(rows)


def format_loss_trend(losses: Sequence[float]) -> str:
    """One line on the logged training losses (the per-logging-step item means, as logged).

    ``"first 5.1234 -> last 3.2100 (went down; 6 logged values)"``; with fewer than two values the
    trend cannot be told and the line says so instead of calling it a failure.

    Raises:
        ValueError: ``losses`` is empty.
    """
    if not losses:
        raise ValueError("format_loss_trend needs at least one logged loss")
    if len(losses) < 2:
        return (f"{losses[0]:.4f} (too few logged values to tell a trend: 1 logged value; "
                "log more often with --logging_steps)")
    trend = "went down" if losses[-1] < losses[0] else "DID NOT go down"
    return f"first {losses[0]:.4f} -> last {losses[-1]:.4f} ({trend}; {len(losses)} logged values)"


def _stack_padded(rows: list[torch.Tensor], pad_value: float) -> np.ndarray:
    """Stack per-sample tensors of possibly different shapes, padding to the largest.

    bfloat16 (logits under ``--bf16`` autocast) becomes float32: numpy has no bfloat16 (stock
    Trainer's ``nested_numpify`` does the same)."""
    shape = [max(sizes) for sizes in zip(*(r.shape for r in rows))]
    dtype = torch.float32 if rows[0].dtype == torch.bfloat16 else rows[0].dtype
    out = torch.full((len(rows), *shape), pad_value, dtype=dtype)
    for i, r in enumerate(rows):
        out[(i, *(slice(0, s) for s in r.shape))] = r
    return out.numpy()


class _PredictionRow(NamedTuple):
    """One evaluated sample on its way to the gather: its dataset index, its prediction row,
    its label rows (one per ``label_names`` key), and with ``include_for_metrics`` its main
    input row and its evaluation microbatch's mean loss."""

    index: int
    prediction: torch.Tensor
    labels: tuple[torch.Tensor | None, ...]
    inputs: torch.Tensor | None
    loss: float | None


class _GatheredPredictions(NamedTuple):
    """What ``evaluation_loop`` hands ``compute_metrics``, every sample once in dataset order."""

    predictions: np.ndarray | None
    label_ids: np.ndarray | tuple[np.ndarray, ...] | None
    inputs: np.ndarray | None
    losses: np.ndarray | None


def _compile_options(args) -> CompileOptions | None:
    """``--torch_compile`` / ``--torch_compile_backend`` / ``--torch_compile_mode`` as the
    engine's per-unit compile (docs/engine.md "Compile"); None when off. TrainingArguments
    fills in the backend ("inductor" on CPU / CUDA) when only torch_compile is set."""
    if not args.torch_compile:
        return None
    return CompileOptions(backend=args.torch_compile_backend or "inductor",
                          mode=args.torch_compile_mode)


class CephaloTrainer(Trainer):
    """``Trainer`` that trains through ``CephaloEngine`` with a per-rank weighted batch split.

    Args:
        model: a ``PreTrainedModel`` with a registered adapter (``hf_cephalo.models``).
        args: ``CephaloTrainingArguments``.
        plan: a ``Plan`` to use instead of ``args``' plan/profile file.
        cluster_profile: with ``plan``, the ``ClusterProfile`` it was made from (live
            re-balancing refits it; without it ``--cephalo_adaptive batch`` is off with a
            warning). Ignored without ``plan``.
        **kwargs: every other ``Trainer`` argument (train/eval datasets, data_collator,
            processing_class, compute_metrics, callbacks, preprocess_logits_for_metrics...).

    Raises:
        TypeError: ``args`` is not ``CephaloTrainingArguments``.
        ValueError: ``RefusedSettings`` listing, in ONE message, every refused setting of
            the script: no model (``model_init`` is not supported), an unsupported model class,
            an iterable dataset, a ``TrainingArguments`` value or hook the engine would not
            honour (``support.py``, docs/trainer_support.md); later, a plan that does not fit
            the job — all before any profiling or collective.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 args: CephaloTrainingArguments | None = None, *, plan: Plan | None = None,
                 cluster_profile: ClusterProfile | None = None, **kwargs: Any) -> None:
        if not isinstance(args, CephaloTrainingArguments):
            raise TypeError(f"CephaloTrainer needs CephaloTrainingArguments, got "
                            f"{type(args).__name__}: build args=CephaloTrainingArguments(...) "
                            "(every TrainingArguments field plus the cephalo_* settings)")
        # [Note: no silent no-op] and [Note: one refusal message] in support.py: every refused
        # setting of the script (arguments, hooks, datasets, model) in one ValueError, before
        # the process group exists
        staged = check_script(args, model, self._hook_problems(model, kwargs),
                              train_dataset=kwargs.get("train_dataset"),
                              eval_dataset=kwargs.get("eval_dataset"))
        compile_options = _compile_options(args)  # a bad backend / mode: ValueError here
        _engine_checkpointing_replaces_model_checkpointing(args, plan)
        world_size = args.world_size  # sets up the process group (accelerate launch / torchrun)
        # [Note: fail fast] in preflight.py: no profile, plan or collective before these checks
        staged = check_before_planning(args, world_size, model, plan=plan,
                                       train_dataset=kwargs.get("train_dataset"),
                                       eval_dataset=kwargs.get("eval_dataset"), staged=staged)
        self.cluster_profile = cluster_profile if plan is not None else None  # plan's profile
        self._resumed_weights_only = False  # resumed from a save_only_model checkpoint
        checkpointing_reason = ""  # why auto chose the plan's activation checkpointing
        if plan is None:  # plan file > profile file > profile this cluster (replan.py)
            resolved = resolve_elastic_plan(args, world_size, model, kwargs.get("train_dataset"))
            plan, self.cluster_profile = resolved.plan, resolved.cluster
            checkpointing_reason = resolved.checkpointing_reason
        self.plan = plan
        # --cephalo_precision: each rank's precision, checked on every rank alike before the
        # engine's first collective (docs/engine.md "Precision per rank")
        self.rank_precisions = job_rank_precisions(args, world_size, plan)
        if self._uses_user_loss(args, kwargs):  # the Trainer's loss as the engine's head loss
            staged = UserLossStagedModel(staged, self.compute_loss)
        staged = wrap_staged(staged, args, world_size)  # emulated slowdown / compute timing
        # args.place_model_on_device is False (CephaloTrainingArguments): stock Trainer must not
        # move the whole model to the device; the engine moves only this rank's shards.
        super().__init__(model=model, args=args, **kwargs)
        self._decay_names = set(self.get_decay_parameter_names(model))  # before sharding
        self._full_numel = sum(p.numel() for p in model.parameters())
        # stock floating_point_ops' parameter count, read while the model still holds its weights
        self._flops_numel = (model.num_parameters(exclude_embeddings=True)
                             if hasattr(model, "num_parameters") else 0)
        _ensure_process_group(args.device)
        _register_exit_teardown()  # ends the process group cleanly if the script does not
        # The engine builds unit by unit: a meta model reads its checkpoint slices
        # (``model.cephalo_checkpoint``, from ``from_pretrained_sharded``) or is initialized per
        # unit with ``args.seed``; an in-memory model takes rank 0's values.
        precision = args.engine_precision() if self.rank_precisions is None else \
            rank_precision(self.rank_precisions, args.process_index)
        self.engine = CephaloEngine(staged, self.plan.state_ratios, device=args.device,
                                    offload_activations=args.cephalo_offload_activations,
                                    autocast_dtype=precision.autocast_dtype,
                                    param_dtype=precision.param_dtype,
                                    reduce_dtype=precision.reduce_dtype,
                                    root_resident=self.plan.root_resident, init_seed=args.seed,
                                    activation_checkpointing=self.plan.activation_checkpointing,
                                    compile=compile_options)
        self.accelerator.attach_engine(self.engine, model)
        self._attach_grad_scaler()
        guard_sharded_model(model, self._full_numel)  # [Note: the user's model while sharded]
        self.add_callback(PlanAccuracyCallback(self))  # predicted vs measured at train end
        replace_jit_checkpoint_callback(self)  # [Note: JIT checkpoint agreed by all ranks]
        self.split_schedule: SplitSchedule | None = None  # the training loader's (b_i, m_i)
        self._add_adaptive_callbacks(args, world_size)
        self.elastic = ElasticCallback(self)  # progress, and the report of a resume
        self.add_callback(self.elastic)
        if self.is_world_process_zero():
            print(format_plan_table(self.plan, checkpointing_reason), flush=True)
            if self.cluster_profile is not None:
                from hf_cephalo.planner.simulate import extrapolation_note

                note = extrapolation_note(self.plan, self.cluster_profile)
                if note:
                    print(note, flush=True)

    # ---- live re-balancing (adaptive.py, docs/adaptive.md) ----------------------------------
    def _add_adaptive_callbacks(self, args, world_size: int) -> None:
        """The emulated slowdown schedule and ``AdaptiveCallback`` (``--cephalo_adaptive
        batch`` or ``state``) where they apply; a warning, once, where adaptation cannot run."""
        from hf_cephalo.profiler.emulate import EmulationConfig

        emulation = EmulationConfig.from_training_args(args)
        if emulation is not None and emulation.schedule is not None:
            self.add_callback(SlowdownScheduleCallback(self, emulation.schedule))
        self.adaptive_callback = None
        why_not = None
        if args.cephalo_adaptive == "off" or world_size == 1:
            return
        if self.cluster_profile is None:
            why_not = ("the plan was given without the profile it was made from (give "
                       "--cephalo_profile_file with --cephalo_plan_file, or cluster_profile= "
                       "with plan=) so there is nothing to refit")
        elif args.dataloader_num_workers > 0:
            why_not = (f"--dataloader_num_workers {args.dataloader_num_workers}: worker processes "
                       "draw batches ahead with the start split; use 0 workers to re-balance")
        if why_not is not None:
            if self.is_world_process_zero():
                logger.warning("--cephalo_adaptive %s is off for this run: %s; set "
                               "--cephalo_adaptive off to silence this", args.cephalo_adaptive,
                               why_not)
            return
        caps = None if emulation is None or emulation.memory_cap_bytes is None \
            else [float(c) for c in emulation.memory_cap_bytes]
        self.adaptive_callback = AdaptiveCallback(
            self, interval=args.cephalo_adaptive_interval,
            threshold=args.cephalo_adaptive_threshold,
            hysteresis_steps=args.cephalo_adaptive_hysteresis_steps, caps_bytes=caps,
            mode=args.cephalo_adaptive)
        self.add_callback(self.adaptive_callback)

    # ---- what stock features the engine path honours (support.py) ----------------------------
    def _hook_problems(self, model: torch.nn.Module | None, kwargs: dict[str, Any]) -> list[str]:
        """One message per Trainer argument or hook CephaloTrainer would bypass
        (``HOOK_SUPPORT``); raised with every other refusal by ``check_script``."""
        def refused(name: str) -> str:
            return f"{name} is not supported by CephaloTrainer: {HOOK_SUPPORT[name].note}"

        problems = []
        if kwargs.get("model_init") is not None:
            problems.append(refused("model_init"))
        if any(x is not None for x in kwargs.get("optimizers") or ()):
            problems.append(refused("optimizers"))
        if type(self)._get_train_sampler is not Trainer._get_train_sampler:
            problems.append(refused("_get_train_sampler (override)"))
        registered = next((c for c in type(model).__mro__ if c.__name__ in supported_model_classes()),
                          None)
        if registered is not None and type(model).forward is not registered.forward:
            problems.append(refused("model forward (override)"))
        return problems

    def _uses_user_loss(self, args, kwargs: dict[str, Any]) -> bool:
        """A loss other than the adapter's: label smoothing, ``compute_loss_func`` or a
        ``compute_loss`` override (``user_loss.py``)."""
        return (args.label_smoothing_factor != 0 or kwargs.get("compute_loss_func") is not None
                or type(self).compute_loss is not CephaloTrainer.compute_loss)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """Stock ``Trainer.compute_loss`` as the engine's head loss (``user_loss.py``).

        ``model`` is an ``EngineOutputs`` stand-in whose call returns this microbatch's outputs;
        ``num_items_in_batch`` is the GLOBAL item count. Same precedence as stock:
        ``compute_loss_func``, else the label smoother, else the model's own loss. No DDP
        rescaling (stock multiplies by the number of processes because DDP averages; the
        engine sums). Override it like stock (call ``model(**inputs)`` once); for exactness a
        user loss must be a sum over items divided by ``num_items_in_batch``.
        """
        if (self.label_smoother is not None or self.compute_loss_func is not None) and "labels" in inputs:
            labels = inputs.pop("labels")
        else:
            labels = None
        outputs = model(**inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif labels is not None:
            loss = self.label_smoother(outputs, labels, shift_labels=getattr(model, "_causal", False),
                                       num_items_in_batch=num_items_in_batch)
        else:
            loss = outputs["loss"]
        return (loss, outputs) if return_outputs else loss

    # ---- accelerator ---------------------------------------------------------------------
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        accelerator_args = super()._build_accelerator_args(**kwargs)
        self._cephalo_accelerator_args = accelerator_args
        return accelerator_args

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Same arguments, plus Cephalo's plugin; the Accelerator state is shared (a singleton).
        self.accelerator = CephaloAccelerator(**self._cephalo_accelerator_args,
                                              cephalo_plugin=CephaloPlugin.from_training_args(self.args))
        self.gather_function = self.accelerator.gather_for_metrics

    def _attach_grad_scaler(self) -> None:
        """--fp16: the engine's ``ShardedGradScaler`` becomes ``accelerator.scaler``.

        Stock Trainer + Accelerate then use it unchanged: ``accelerator.prepare(optimizer)``
        hands it to ``AcceleratedOptimizer`` (``scaler.step`` + ``update``; a skipped step sets
        ``optimizer_step_was_skipped``, so the LR scheduler does not step), ``_save_scaler`` /
        ``_load_scaler`` write and read ``scaler.pt`` in checkpoints (a scalar: any plan).
        Accelerate would build a plain ``GradScaler`` on CUDA (found-inf not agreed across
        ranks) and none on CPU; ``native_amp`` makes ``accelerator.unscale_gradients`` work."""
        self._scaler_unscaled = False
        if not (self.args.fp16 or "fp16" in (self.rank_precisions or ())):
            return  # per rank: EVERY rank uses the job's scaler once one rank is fp16
        self.accelerator.scaler = self.engine.make_grad_scaler()
        self.accelerator.native_amp = True

    def _unscale_once(self) -> None:
        """Unscale the shard gradients before clipping / the norm (once per step)."""
        scaler = self.accelerator.scaler
        if scaler is not None and not self._scaler_unscaled:
            scaler.unscale_(_unwrap_optimizer(self.optimizer))  # all-reduces found-inf
            self._scaler_unscaled = True

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Stock ``log``, plus ``loss_scale`` (the fp16 scaler's current scale) on training
        logs with --fp16."""
        if self.accelerator.scaler is not None and "loss" in logs:
            logs = {**logs, "loss_scale": float(self.accelerator.scaler.get_scale())}
        super().log(logs, start_time)

    # ---- data ----------------------------------------------------------------------------
    def _weighted_loader(self, dataset, description: str, *, shuffle: bool,
                         microbatch_size: int) -> DataLoader:
        if not hasattr(dataset, "__len__"):
            raise ValueError(f"{description}: CephaloTrainer needs a dataset with a length (an "
                             "iterable dataset cannot be split by per-rank batch sizes): "
                             "materialize it first, e.g. datasets.Dataset.from_generator")
        collator = self.data_collator
        strategy = str(getattr(self.args.train_sampling_strategy, "value",
                               self.args.train_sampling_strategy))
        # lengths from the dataset as given: column pruning drops the length column
        lengths = self._sample_lengths(dataset) if shuffle and strategy == "group_by_length" else None
        import datasets

        if isinstance(dataset, datasets.Dataset) and dataset.format.get("type") != "custom":
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            # A dataset with a transform (e.g. an "image" column turned into pixel_values by
            # with_transform) keeps its raw columns; unused keys are dropped per sample after the
            # transform, so the image column survives the pruning.
            collator = self._get_collator_with_removed_columns(collator, description=description)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        # Training: the split can change live ([Note: switching the split live] in sampler.py).
        schedule = SplitSchedule(self.plan.batch_sizes, self.plan.microbatch_sizes) \
            if shuffle else None
        if shuffle:
            self.split_schedule = schedule
        options = LoaderOptions(
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
            multiprocessing_context=self.args.dataloader_multiprocessing_context)
        return weighted_loader(dataset, collator, batch_sizes=self.plan.batch_sizes,
                               rank=self.args.process_index, microbatch_size=microbatch_size,
                               seed=seed, shuffle=shuffle and strategy == "random",
                               drop_last=shuffle and self.args.dataloader_drop_last,
                               lengths=lengths, schedule=schedule,
                               collate=self.args.cephalo_collate, options=options,
                               sample_seed=self.args.seed, description=description)

    def _sample_lengths(self, dataset) -> list[int]:
        """Per-sample lengths for group_by_length, as stock: the ``length_column_name`` column,
        else the length of each sample's first model input (``input_ids`` by default).

        Raises ValueError when neither exists."""
        import datasets

        column = self.args.length_column_name
        if isinstance(dataset, datasets.Dataset) and column in dataset.column_names:
            return [int(n) for n in dataset[column]]
        name = (self.processing_class.model_input_names[0] if self.processing_class is not None
                and hasattr(self.processing_class, "model_input_names") else "input_ids")
        first = dataset[0]
        if not hasattr(first, "keys") or name not in first:
            raise ValueError(f"train_sampling_strategy='group_by_length' needs a {column!r} column "
                             f"or samples with {name!r} (length_column_name / the processor's "
                             "first input): set --length_column_name to a column of per-sample "
                             "lengths, or use --train_sampling_strategy random")
        return [len(dataset[i][name]) for i in range(len(dataset))]

    def get_train_dataloader(self) -> DataLoader:
        """This rank's loader: b_i samples per step as microbatches of m_i (not Accelerate-prepared)."""
        if self.train_dataset is None:
            raise ValueError("CephaloTrainer: training requires a train_dataset; pass "
                             "CephaloTrainer(..., train_dataset=...)")
        rank_plan = self.plan.ranks[self.args.process_index]
        return self._weighted_loader(self.train_dataset, "training", shuffle=True,
                                     microbatch_size=max(rank_plan.microbatch_size, 1))

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """Unshuffled rank-weighted split of the eval set in microbatches of per_device_eval_batch_size."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("CephaloTrainer: evaluation requires an eval_dataset; pass "
                             "CephaloTrainer(..., eval_dataset=...) or evaluate(eval_dataset)")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        if self.args.dataloader_drop_last:
            eval_dataset = self._stock_drop_last_eval(eval_dataset)
        return self._weighted_loader(eval_dataset, "evaluation", shuffle=False,
                                     microbatch_size=self.args.per_device_eval_batch_size)

    def _stock_drop_last_eval(self, dataset):
        """``dataloader_drop_last`` in evaluation, as stock: W processes take turns reading
        whole batches of ``per_device_eval_batch_size`` b in dataset order and an incomplete last
        round is dropped (Accelerate's ``BatchSamplerShard``), so stock evaluates the first
        floor(N / (W b)) W b samples; so does this (W = world size)."""
        import datasets

        round_size = self.args.world_size * self.args.per_device_eval_batch_size
        keep = len(dataset) // round_size * round_size
        if keep == len(dataset):
            return dataset
        if isinstance(dataset, datasets.Dataset):
            return dataset.select(range(keep))
        return torch.utils.data.Subset(dataset, range(keep))

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return self.get_eval_dataloader(test_dataset)

    def get_total_train_batch_size(self, args) -> int:
        """The plan's global batch size B (Trainer's speed metrics and logs use it)."""
        return self.plan.global_batch_size

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        # A batch is a list of microbatch dicts; the engine counts items itself (all-reduce).
        return list(itertools.islice(epoch_iterator, num_batches)), None

    def _track_num_input_tokens(self, inputs: list[dict[str, torch.Tensor]]) -> None:
        """``include_num_input_tokens_seen``: stock's count over this rank's microbatches, summed
        over ranks with ONE gather per step (every rank calls it, also with b_i = 0), so
        ``state.num_input_tokens_seen`` is the global batch's count, as stock DDP gathers it.

        True / "all": elements of the main input (``model.main_input_name``) of every
        microbatch; "non_padding": the attention mask's sum, else the tokens unequal to the
        processor's ``pad_token_id``, else all (stock's fallbacks and warnings).
        """
        mode = self.args.include_num_input_tokens_seen
        if mode == "no":
            return
        name = getattr(self.model, "main_input_name", "input_ids")
        if any(name not in mb for mb in inputs):
            return super()._track_num_input_tokens({})  # stock's warning, no count
        count = sum(int(_input_token_count(mb, name, mode, self.processing_class))
                    for mb in inputs)
        count = torch.as_tensor(count, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(count).sum().item()

    def floating_point_ops(self, inputs: list[dict[str, torch.Tensor]]) -> int:
        """Stock's estimate over this rank's microbatches: 6 x main-input elements x the
        model's non-embedding parameters (``PreTrainedModel.floating_point_ops``, Kaplan et al.
        2020), counted before sharding; stock ``store_flos`` sums it over ranks."""
        name = getattr(self.model, "main_input_name", "input_ids")
        return sum(6 * mb[name].numel() * self._flops_numel for mb in inputs if name in mb)

    # ---- training step -------------------------------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: list[dict[str, torch.Tensor]],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """One optimizer step's forward/backward: ``engine.train_step`` over this rank's microbatches.

        Returns the global item-mean loss of the step (identical on every rank).
        """
        model.train()
        self.engine.zero_grad()  # gradient_accumulation_steps == 1: every step starts fresh
        microbatches = self._prepare_input(list(inputs))
        self.last_step_num_samples = sum(_num_samples(mb) for mb in microbatches)
        self._scaler_unscaled = False
        out = self.engine.train_step(microbatches, loss_scale=self.accelerator.scaler)
        return torch.tensor(out.loss, dtype=torch.float32, device=self.args.device)

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        self._unscale_once()  # as accelerator.clip_grad_norm_ does
        return self.engine.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None):
        if grad_norm is None:
            self._unscale_once()
            grad_norm = self.engine.clip_grad_norm_(float("inf"))  # global norm, no clipping
        return grad_norm

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer class and kwargs (``optimizer_cls_and_kwargs`` if given,
        else from ``optim``) over this rank's flat 1-D shards, one parameter group.

        ``weight_decay`` is applied as stock: only to ``get_decay_parameter_names`` (biases and
        norms exempt), per element of each shard by a step pre-hook (``weight_decay.py``).
        Raises ValueError for an optimizer that needs the model itself, or ``weight_decay > 0``
        with an optimizer whose decay rule is unknown.
        """
        if self.optimizer is None:
            if self.optimizer_cls_and_kwargs is not None:
                optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
            else:
                optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
            if "model" in optimizer_kwargs:
                raise ValueError(f"optimizer {optimizer_cls.__name__} needs the model itself, which "
                                 "the engine holds as flat shards: use an element-wise optimizer "
                                 "such as --optim adamw_torch or sgd")
            params, weight_decay = self.engine.parameters(), self.args.weight_decay
            rule = decay_rule(optimizer_cls, optimizer_kwargs) if weight_decay else None
            self.optimizer = optimizer_cls([{"params": params, "weight_decay": 0.0}],
                                           **optimizer_kwargs)
            if rule is not None:
                masks = shard_decay_masks(self.engine.shard_metadata(), self.engine.rank,
                                          self._decay_names)
                self._shard_weight_decay = ShardWeightDecay(params, masks, weight_decay, rule)
                self.optimizer.register_step_pre_hook(self._shard_weight_decay)
        if self.rank_precisions is not None:  # fp16 ranks: the scaler must unscale it
            check_scalable_optimizer(self.optimizer, self.rank_precisions,
                                     [r.device for r in self.plan.ranks])
        return self.optimizer

    def _relayout_state(self, new_plan: Plan) -> None:
        """Collective, at a step boundary (after the optimizer step and ``zero_grad``, e.g. from a
        callback's ``on_step_end``): re-lay the training state onto ``new_plan``'s r_i in memory
        and make ``new_plan`` the current plan (``self.plan`` and ``engine.plan``).

        The engine's parameter shards, a persisting gradient and the optimizer state (AdamW
        ``exp_avg`` / ``exp_avg_sq`` / ``step``, inside Accelerate's ``AcceleratedOptimizer``)
        move between ranks by collectives, no files (``hf_cephalo.engine.relayout``; equal bit
        for bit to saving a checkpoint and resuming it onto ``new_plan``). The optimizer, its
        param groups and the LR scheduler stay the same objects; the per-element weight-decay
        masks (``weight_decay.py``) are rebuilt for the new shards. The fp16 loss scaler holds
        only its scale and growth tracker, the same on every rank, so nothing of it moves.
        A change of b_i / m_i / l_i takes effect where the batch sampler reads ``self.plan``.

        Raises (before any collective): ValueError for a plan of another world size, model or
        precision; RuntimeError mid-step; the other errors of ``relayout_state``.
        """
        from hf_cephalo.engine.relayout import relayout_state
        from hf_cephalo.integrations.auto_plan import _job_precision

        if self.rank_precisions is not None:  # --cephalo_precision: the ranks keep theirs
            if new_plan.rank_precisions not in (None, list(self.rank_precisions)):
                raise ValueError(f"_relayout_state: the new plan computes in "
                                 f"{new_plan.rank_precisions} per rank, this run in "
                                 f"{list(self.rank_precisions)}; re-plan with these precisions")
        else:  # the engine's dtype: the model's placeholders no longer carry it
            job = _job_precision(self.args).tag(str(self.engine.dtype).removeprefix("torch."))
            if new_plan.precision not in (None, job):
                raise ValueError(f"_relayout_state: the new plan was made for precision "
                                 f"{new_plan.precision!r}, this run trains in {job!r}; re-plan "
                                 "for this run's precision")
        optimizer = None if self.optimizer is None else _unwrap_optimizer(self.optimizer)
        relayout_state(self.engine, optimizer, new_plan)
        decay = getattr(self, "_shard_weight_decay", None)
        if decay is not None:
            decay.set_masks(self.engine.parameters(),
                            shard_decay_masks(self.engine.shard_metadata(), self.engine.rank,
                                              self._decay_names))
        self.plan = new_plan

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Stock ``Trainer.train``; ``resume_from_checkpoint`` (a path, or True for the last
        complete ``checkpoint-N`` in ``output_dir``) loads the sharded state re-laid for this
        plan and world size (see ``_load_from_checkpoint``). The strings ``"true"`` / ``"false"``
        (what ``--resume_from_checkpoint`` gives a script) mean True / no resume unless a
        directory of that name exists, so scripts can pass ``args.resume_from_checkpoint`` as is.

        Raises:
            CheckpointError: the checkpoint is missing, incomplete, corrupt or of another model.
            ValueError: True but ``output_dir`` holds no checkpoint.
        """
        if isinstance(resume_from_checkpoint, str) and not os.path.isdir(resume_from_checkpoint):
            flag = resume_from_checkpoint.strip().lower()
            if flag in ("true", "false"):
                resume_from_checkpoint = flag == "true" or None
        resume_from_checkpoint = self._prepare_elastic_resume(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    # ---- evaluation ----------------------------------------------------------------------
    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Layered forward through the engine; loss = global item mean over the whole eval set.

        Predictions (after ``preprocess_logits_for_metrics``) and labels of every sample are
        gathered exactly once, in dataset order, padded with -100 where lengths differ. The
        head runs once per microbatch; predictions move to the CPU microbatch by microbatch,
        and with ``prediction_loss_only`` no logits are kept at all.

        As stock ``prediction_step``: the labels are the ``label_names`` keys (a tuple of arrays
        for several), and the loss is reported only when every microbatch holds all of them.
        ``include_for_metrics``: "inputs" adds each sample's main input (padded with -100),
        "loss" each sample's evaluation-microbatch mean loss, to the ``EvalPrediction``.
        """
        if prediction_loss_only is None:
            prediction_loss_only = self.args.prediction_loss_only
        self.model.eval()
        loss_sum, num_items, local, has_labels = 0.0, 0, [], bool(self.label_names)
        for indices, microbatches in zip(dataloader.batch_sampler.local_batches(), dataloader):
            microbatches = self._prepare_input(microbatches)
            out = self.engine.evaluate(microbatches, return_logits=not prediction_loss_only,
                                       process_logits=self._microbatch_predictions)
            if out.num_items:
                loss_sum += out.loss * out.num_items
                num_items += out.num_items
            has_labels = has_labels and all(mb.get(k) is not None for mb in microbatches
                                            for k in self.label_names)
            if not prediction_loss_only:
                local += self._local_predictions(indices, microbatches, out)
        metrics: dict[str, Any] = {}
        if num_items and has_labels:
            metrics["loss"] = loss_sum / num_items
        predictions = label_ids = None
        num_samples = dataloader.batch_sampler.dataset_length
        if not prediction_loss_only:
            gathered = self._gather_predictions(local, num_samples, has_labels)
            predictions, label_ids = gathered.predictions, gathered.label_ids
            if self.compute_metrics is not None and label_ids is not None:
                extra = {"inputs": gathered.inputs, "losses": gathered.losses}
                metrics.update(self.compute_metrics(EvalPrediction(predictions=predictions,
                                                                   label_ids=label_ids, **extra)))
        metrics = denumpify_detensorize(metrics)
        metrics = {k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}": v
                   for k, v in metrics.items()}
        return EvalLoopOutput(predictions=predictions, label_ids=label_ids, metrics=metrics,
                              num_samples=num_samples)

    def _microbatch_predictions(self, logits: torch.Tensor, microbatch) -> torch.Tensor:
        """One microbatch's predictions on the CPU: ``preprocess_logits_for_metrics`` (on the
        device, as stock Trainer applies it) of its logits. The engine calls this right after
        the microbatch's head, so no device logits outlive their microbatch."""
        if self.preprocess_logits_for_metrics is not None:
            logits = self.preprocess_logits_for_metrics(logits, microbatch.get("labels"))
        return logits.detach().cpu()

    def _local_predictions(self, indices: list[int], microbatches, out) -> list[_PredictionRow]:
        """One ``_PredictionRow`` per sample of this rank (CPU tensors): labels = one row per
        ``label_names`` key; the main input and the microbatch's loss only when
        ``include_for_metrics`` asks for them."""
        wanted = self.args.include_for_metrics
        name = getattr(self.model, "main_input_name", "input_ids")
        rows = []
        position = 0
        for k, (mb, mb_predictions) in enumerate(zip(microbatches, out.logits)):
            for j in range(mb_predictions.shape[0]):
                labels = tuple(None if mb.get(key) is None else mb[key][j].detach().cpu()
                               for key in self.label_names)
                rows.append(_PredictionRow(
                    indices[position], mb_predictions[j], labels,
                    mb[name][j].detach().cpu() if "inputs" in wanted and name in mb else None,
                    out.microbatch_losses[k] if "loss" in wanted else None))
                position += 1
        return rows

    def _gather_predictions(self, local: list[_PredictionRow], dataset_length: int,
                            has_labels: bool) -> _GatheredPredictions:
        """Every rank's rows in dataset order, stacked as stock's evaluation loop concatenates
        them (padded with -100): predictions (N, ...), label_ids (N, ...) or a tuple of them
        (one per ``label_names`` key; None without labels), inputs (N, S) and losses (N,)."""
        from accelerate.utils import gather_object

        rows = gather_object(local) if self.args.world_size > 1 else local
        rows.sort(key=lambda row: row.index)
        if [row.index for row in rows] != list(range(dataset_length)):
            raise RuntimeError(f"evaluation gathered {len(rows)} predictions for {dataset_length} "
                               "samples (internal error: each sample must appear exactly once)")
        if not rows:
            return _GatheredPredictions(None, None, None, None)
        predictions = _stack_padded([row.prediction for row in rows], -100)
        labels = None
        if has_labels:
            labels = tuple(_stack_padded([row.labels[k] for row in rows], -100)
                           for k in range(len(self.label_names)))
            labels = labels[0] if len(labels) == 1 else labels
        inputs = None if rows[0].inputs is None else _stack_padded([r.inputs for r in rows], -100)
        losses = None if rows[0].loss is None or not has_labels else \
            np.array([row.loss for row in rows], dtype=np.float32)
        return _GatheredPredictions(predictions, labels, inputs, losses)

    # ---- the user's model ------------------------------------------------------------------
    def unshard_model(self) -> torch.nn.Module:
        """Collective (call on every rank): put full copies of the current weights into the
        model object passed to ``CephaloTrainer`` (``trainer.model``) on every rank, so that
        ``model(**batch)`` and ``model.save_pretrained(dir)`` work again; returns it.

        Costs the whole model's parameters on every rank (bytes = 4 x numel in fp32). The
        engine keeps its shards: a later ``train()`` / ``evaluate()`` re-shards the model (see
        [Note: the user's model while sharded] in ``sharded_model.py``). To save without
        gathering on every rank use ``trainer.save_model(dir)`` (rank 0 writes).
        """
        restore_full_model(self.engine)
        return self.model

    # ---- saving --------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective (call on every rank): write a ``from_pretrained`` model directory.

        The engine streams the weights one unit at a time into the files ``save_pretrained``
        writes (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` + index above
        ``cephalo_max_shard_size``; tied weights once; config and generation config;
        ``hf_cephalo.engine.export.save_pretrained_streamed``): rank 0 holds one output file
        plus one unit, never the whole model. Rank 0 also writes the processing class
        (tokenizer) and ``training_args.bin``, as stock ``Trainer._save`` does.

        A LoRA ``PeftModel`` saves its adapter only, as stock Trainer does:
        ``adapter_model.safetensors`` + ``adapter_config.json`` in PEFT's key names, loadable
        with ``PeftModel.from_pretrained(base, dir)``; only the adapter tensors are gathered
        (``integrations/peft_save.py``).
        """
        from hf_cephalo.engine.export import save_pretrained_streamed
        from hf_cephalo.integrations.peft_save import save_peft_adapter
        from hf_cephalo.models.peft_lora import is_peft_model

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if is_peft_model(self.model):
            save_peft_adapter(self.engine, self.model, output_dir)
        else:
            save_pretrained_streamed(self.engine, output_dir,
                                     max_shard_size=self.args.cephalo_max_shard_size)
        if self.args.should_save:
            self._save_side_files(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_side_files(self, output_dir: str) -> None:
        """Rank 0: the processing class (tokenizer / processor) and ``training_args.bin``, as
        stock ``Trainer._save`` writes them next to the weights."""
        from transformers.trainer import TRAINING_ARGS_NAME

        os.makedirs(output_dir, exist_ok=True)
        processor = self.processing_class
        if processor is None:
            processor = getattr(self.data_collator, "tokenizer", None)
        if processor is not None:
            processor.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    # ---- checkpoints (docs/checkpoints.md) ---------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial=None) -> None:
        """Collective: the stock checkpoint contents, written atomically.

        Everything (the sharded engine state, scheduler, RNG, ``trainer_state.json``, the
        tokenizer and ``training_args.bin``; the full model only with
        ``cephalo_save_full_model``; a LoRA PeftModel's ``adapter_config.json``) goes into a hidden ``.tmp-checkpoint-N`` that is renamed to
        ``checkpoint-N`` after the completeness marker (``hf_cephalo.engine.checkpoint``
        [Note: atomic checkpoints]); a run killed mid-save leaves no ``checkpoint-N``.
        ``hf-cephalo export checkpoint-N --out DIR`` writes the full model from it on demand.
        """
        import os

        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        from hf_cephalo.engine.checkpoint import atomic_checkpoint_dir
        from hf_cephalo.integrations.checkpoint_contents import check_contents

        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._set_best_model_checkpoint(run_dir, output_dir)  # before trainer_state.json, as stock
        contents = self._checkpoint_contents()
        # [Note: a checkpoint holds what its settings promise] in checkpoint_contents.py
        with atomic_checkpoint_dir(output_dir, self.engine.group, check=lambda staging:
                                   check_contents(staging, contents, when="save")) as staging:
            if contents.has_model_files:  # save_only_model (as stock) or cephalo_save_full_model
                self.save_model(staging, _internal_call=True)
            elif self.args.should_save:
                self._save_side_files(staging)
            if self.args.should_save:
                self._save_run_record(staging)
                _save_adapter_config(self.model, staging)
                contents.write(staging)
            if contents.has_shards:  # not save_only_model: parameters + optimizer, as stock
                self._save_optimizer_and_scheduler(staging)
                self._save_scaler(staging)
                self._save_rng_state(staging)
            if self.args.should_save:
                for cb in self.callback_handler.callbacks + [self.control]:
                    if isinstance(cb, ExportableState):
                        name, cb_state = cb.__class__.__name__, cb.state()
                        if isinstance(self.state.stateful_callbacks[name], list):
                            self.state.stateful_callbacks[name].append(cb_state)
                        else:
                            self.state.stateful_callbacks[name] = cb_state
                self.state.save_to_json(os.path.join(staging, "trainer_state.json"))
        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint,
                               use_mtime=True)

    def _set_best_model_checkpoint(self, run_dir: str, output_dir: str) -> None:
        """Stock's ``state.best_model_checkpoint`` update, made before the checkpoint's
        ``trainer_state.json`` is written (stock writes the weights first, so a new best is
        already on disk then; here ``output_dir`` appears only at the atomic rename, after the
        state file, so it counts as existing)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if best == output_dir or os.path.exists(best):
                self.state.best_model_checkpoint = best
    def _checkpoint_contents(self):
        """What this run's checkpoints hold, by its save settings (``CheckpointContents``)."""
        from hf_cephalo.integrations.checkpoint_contents import CheckpointContents
        from hf_cephalo.models.peft_lora import is_peft_model

        return CheckpointContents(save_only_model=bool(self.args.save_only_model),
                                  save_full_model=bool(self.args.cephalo_save_full_model),
                                  peft=is_peft_model(self.model),
                                  scaler=self.accelerator.scaler is not None,
                                  scheduler=self.lr_scheduler is not None,
                                  world_size=self.engine.world_size)

    def _load_weights(self, checkpoint: str, contents) -> None:
        """This rank's shards of ``checkpoint``'s weights into the engine, on any plan (no
        collective): from the sharded state when the checkpoint has it (exact), else from the
        ``save_model`` files (``save_only_model``; read slice by slice as
        ``from_pretrained_sharded`` does; a LoRA PeftModel's adapter into the trainable shards,
        the frozen base kept, as ``PeftModel.from_pretrained``)."""
        from hf_cephalo.engine.checkpoint import load_sharded
        from hf_cephalo.engine.loading import load_weights_into_engine
        from hf_cephalo.integrations.peft_save import load_peft_adapter

        if contents is None or contents.has_shards:
            load_sharded(self.engine, checkpoint)
        elif contents.peft:
            load_peft_adapter(self.engine, self.model, checkpoint)
        else:
            load_weights_into_engine(self.engine, checkpoint)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights into the engine's shards
        (any plan; each rank reads only its slices), so ``save_model``, ``evaluate`` and
        ``unshard_model`` after training see them. Weights only, as stock (the optimizer keeps
        the last step's state).

        Raises:
            CheckpointError: (every rank) the best checkpoint lacks a weight file its settings
                promised (names it and the setting), or a file is corrupt.
        """
        from hf_cephalo.engine.checkpoint import errors_on_every_rank
        from hf_cephalo.integrations.checkpoint_contents import check_contents

        path = self.state.best_model_checkpoint
        logger.info(f"Loading best model from {path} (score: {self.state.best_metric}).")
        with errors_on_every_rank(self.engine.group, what=f"load the best model from {path}"):
            contents = check_contents(path, when="load the best model", weights_only=True)
            self._load_weights(path, contents)

    # ---- elastic (hf_cephalo.integrations.elastic) ------------------------------------------
    def _save_run_record(self, output_dir: str) -> None:
        """Rank 0: the plan and ``RunRecord`` the checkpoint was trained with (for elastic
        resumes: B, model, world)."""
        from hf_cephalo.integrations.elastic import (RunRecord, run_fingerprint,
                                                     write_checkpoint_record)

        record = RunRecord(global_batch_size=self.plan.global_batch_size,
                           model_fingerprint=run_fingerprint(self.engine.staged.model),
                           model_class=type(self.engine.staged.model).__name__,
                           world_size=self.plan.world_size,
                           device_names=[r.device for r in self.plan.ranks],
                           global_step=self.state.global_step, saved_time_s=time.time())
        write_checkpoint_record(output_dir, self.plan, record)

    def _prepare_elastic_resume(self, resume_from_checkpoint):
        """The checkpoint to resume from (True: the newest complete one), checked against this
        run (same model, same global batch size: ``elastic.check_resume``) and reported on the
        first step (``ElasticCallback``). Every rank reads the same files and raises the same
        ValueError, before the checkpoint's state is read."""
        from hf_cephalo.integrations.elastic import (check_resume, latest_checkpoint,
                                                     read_checkpoint_record, run_fingerprint)

        if resume_from_checkpoint is True:
            resume_from_checkpoint = latest_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                from hf_cephalo.engine.checkpoint import newest_complete_checkpoint

                incomplete = newest_complete_checkpoint(self.args.output_dir).skipped
                found = (f" (only incomplete ones, without the completeness marker: "
                         f"{', '.join(incomplete)})" if incomplete else "")
                raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir!r} holds "
                                 f"no complete checkpoint-N{found}; start without it")
        if not resume_from_checkpoint:
            return resume_from_checkpoint
        old_plan, record = read_checkpoint_record(resume_from_checkpoint)
        model = self.engine.staged.model
        check_resume(resume_from_checkpoint, record, self.plan, run_fingerprint(model),
                     type(model).__name__, self.args.cephalo_global_batch_size is not None
                     or self.args.cephalo_plan_file is not None)
        if self.adaptive_callback is not None:  # continue from the last live switch (same world)
            self._adopt_checkpoint_plan(old_plan)
        suffix = str(resume_from_checkpoint).rstrip("/").rsplit("-", 1)[-1]
        step = record.global_step if record is not None else int(suffix) if suffix.isdigit() else 0
        self.elastic.arm(resume_from_checkpoint, step, old_plan,
                         None if record is None else record.world_size)
        return resume_from_checkpoint

    def _adopt_checkpoint_plan(self, checkpoint_plan: Plan | None) -> None:
        """Continue a resumed adaptive run from the plan its checkpoint ran on (same world,
        devices and B; ``replan.adopt_checkpoint_split`` / ``adopt_checkpoint_state``).

        ``--cephalo_adaptive state``: when the checkpoint's r_i differ from the engine's (a live
        re-layout happened before it was saved), the engine's state is re-laid onto them in
        memory here, before the checkpoint is read (collective; the optimizer holds no state
        yet, so only the freshly initialized parameter shards move), and loading then fills the
        checkpoint's shards onto the checkpoint's own layout. Every rank reads the same files,
        so every rank takes the same branch."""
        from hf_cephalo.integrations.replan import (adopt_checkpoint_split,
                                                    adopt_checkpoint_state, resume_banner)

        start = self.plan
        new = None
        if self.adaptive_callback.mode == "state":
            new = adopt_checkpoint_state(self.plan, checkpoint_plan, self.cluster_profile)
            if new is not None:
                self._relayout_state(new)  # sets self.plan
        if new is None:
            self.plan = adopt_checkpoint_split(self.plan, checkpoint_plan, self.cluster_profile)
        if self.plan is not start and self.is_world_process_zero():
            # the plan printed at start is not the one that runs: say so, and keep plan.json
            # beside the outputs in step with it
            print(f"[hf-cephalo] {resume_banner(self.plan, checkpoint_plan, new is not None)}:\n"
                  + format_plan_table(self.plan), flush=True)
            self.plan.save(os.path.join(self.args.output_dir, "plan.json"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank writes its parameter and optimizer shards with the layout
        (``hf_cephalo.engine.checkpoint.save_sharded``); rank 0 also ``scheduler.pt``."""
        import os

        from hf_cephalo.engine.checkpoint import save_sharded

        save_sharded(self.engine, output_dir, _unwrap_optimizer(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Load the sharded parameters and buffers, re-laid for this plan / world size.

        Raises ``hf_cephalo.engine.checkpoint.CheckpointError`` (a ValueError naming the file)
        for an incomplete, corrupt or other-model checkpoint — before training starts.
        """
        from hf_cephalo.engine.checkpoint import errors_on_every_rank
        from hf_cephalo.integrations.checkpoint_contents import check_contents

        with errors_on_every_rank(self.engine.group):  # a bad shard on one rank stops all ranks
            contents = check_contents(resume_from_checkpoint)
            self._load_weights(resume_from_checkpoint, contents)
        self._resumed_weights_only = contents is not None and contents.save_only_model
        if self._resumed_weights_only and self.is_world_process_zero():  # said once
            logger.warning(f"{resume_from_checkpoint} was saved with save_only_model=True: it "
                           "holds the model weights and trainer state but no optimizer, LR "
                           "scheduler, scaler or RNG state; resuming as stock Trainer does, with "
                           "those restarted fresh (the LR schedule starts again from step 0)")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Optimizer state re-laid for this plan (exact values) and the scheduler's position.

        Reads only safetensors, JSON and ``torch.load(weights_only=True)``.
        """
        if checkpoint is None or self._resumed_weights_only:
            return  # save_only_model: stock finds no optimizer.pt / scheduler.pt and skips both
        import os

        from hf_cephalo.engine.checkpoint import (DAMAGED, CheckpointError, errors_on_every_rank,
                                                  load_sharded_optimizer)

        path = os.path.join(checkpoint, "scheduler.pt")
        with errors_on_every_rank(self.engine.group):
            load_sharded_optimizer(self.engine, _unwrap_optimizer(self.optimizer), checkpoint)
            if self.lr_scheduler is not None:
                if not os.path.isfile(path):
                    raise CheckpointError(f"{path}: missing (the LR scheduler's position); "
                                          f"{DAMAGED}")
                self.lr_scheduler.load_state_dict(torch.load(path, map_location="cpu",
                                                             weights_only=True))


def _input_token_count(microbatch, name: str, mode, processing_class):
    """One microbatch's token count for ``include_num_input_tokens_seen`` (as stock
    ``Trainer._track_num_input_tokens`` counts one batch)."""
    if mode == "non_padding":
        if "attention_mask" in microbatch:
            return microbatch["attention_mask"].sum()
        pad = getattr(processing_class, "pad_token_id", None)
        if pad is not None:
            return (microbatch[name] != pad).sum()
        logger.warning("Could not determine method to count non-padding tokens, falling back "
                       "to counting all tokens.")
    return microbatch[name].numel()


def _save_adapter_config(model: torch.nn.Module, directory: str) -> None:
    """A LoRA ``PeftModel``'s ``adapter_config.json`` into a checkpoint: ``hf-cephalo export
    --merge-lora`` needs its rank, alpha and targets (``integrations/peft_merge.py``)."""
    from hf_cephalo.models.peft_lora import is_peft_model

    if not is_peft_model(model):
        return
    name = model.active_adapter
    config = copy.deepcopy(model.peft_config[name])
    config.inference_mode = True  # as PeftModel.save_pretrained records it
    config.save_pretrained(directory)


def _num_samples(microbatch) -> int:
    """Samples in one collated microbatch: the first dimension of its first tensor."""
    values = microbatch.values() if hasattr(microbatch, "values") else [microbatch]
    return next((int(v.shape[0]) for v in values if torch.is_tensor(v) and v.dim() > 0), 0)


def _engine_checkpointing_replaces_model_checkpointing(args, plan: Plan | None = None) -> None:
    """``gradient_checkpointing`` / ``activation_checkpointing``: the engine recomputes every
    unit in backward, which IS activation checkpointing. Stock ``Trainer.train()`` would switch
    the model's own checkpointing on as well (each layer's forward then runs three times per
    microbatch instead of two), so the flags are logged and cleared on ``args``.

    The user asked for checkpointing, so a plan without it is refused (before any collective):
    ``--cephalo_activation_checkpointing false``, or a plan (``plan`` / ``--cephalo_plan_file``)
    that records it off; with ``auto`` the trainer plans with checkpointing on.

    Raises:
        ValueError: the flag with ``--cephalo_activation_checkpointing false`` or such a plan.
    """
    asked = args.activation_checkpointing or args.gradient_checkpointing
    if asked and args.cephalo_activation_checkpointing == "false":
        raise ValueError(
            "--gradient_checkpointing (or --activation_checkpointing) asks for activation "
            "checkpointing but --cephalo_activation_checkpointing is 'false' (keep every forward "
            "graph, no recompute): drop one of them ('true' or 'auto' with the stock flag plans "
            "with checkpointing; the engine's own checkpointing replaces the model's)")
    if asked and plan is None and args.cephalo_plan_file is not None:
        plan = Plan.load(args.cephalo_plan_file)
    if asked and plan is not None and not plan.activation_checkpointing:
        source = "plan" if args.cephalo_plan_file is None else \
            f"plan file {args.cephalo_plan_file!r}"
        raise ValueError(
            "--gradient_checkpointing (or --activation_checkpointing) asks for activation "
            f"checkpointing but the {source} was made without it (activation_checkpointing "
            "false: forward graphs kept): drop the flag, or re-plan with `hf-cephalo plan "
            "--activation-checkpointing true`")
    # said once per job: every rank runs this with the same flags (RANK: the launcher's, set
    # before the process group exists), so the other ranks would repeat both lines
    say = logger.warning if os.environ.get("RANK", "0") == "0" else logger.debug
    if asked and args.cephalo_activation_checkpointing == "auto":
        say("--gradient_checkpointing with --cephalo_activation_checkpointing auto: "
            "planning with activation checkpointing on, as the flag asks")
        args.cephalo_activation_checkpointing = "true"
    if asked:
        say("gradient_checkpointing/activation_checkpointing: the Cephalo engine already "
            "recomputes every layer in backward (per-unit activation checkpointing); the "
            "model's own checkpointing is not switched on in addition")
        args.activation_checkpointing = False
        args.gradient_checkpointing = False


def _unwrap_optimizer(optimizer):
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (or itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def _ensure_process_group(device: torch.device) -> None:
    """A 1-rank group for plain ``python train.py`` runs (the engine needs a process group)."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


EXIT_BARRIER_TIMEOUT_S = 120.0  # seconds the exit barrier waits for the other ranks (gloo)
_exit_teardown_registered = False


def _register_exit_teardown() -> None:
    """Register (once per process) ``_teardown_process_group_at_exit`` with ``atexit``."""
    global _exit_teardown_registered
    if not _exit_teardown_registered:
        atexit.register(_teardown_process_group_at_exit)
        _exit_teardown_registered = True


def _teardown_process_group_at_exit() -> None:
    """Barrier, then ``destroy_process_group``, when a script ends without
    ``accelerator.end_training()``.

    Without it the process groups live into interpreter finalization. A gloo worker thread
    (``ProcessGroupGloo::runLoop``) that releases a finished work object (e.g. an all-gather)
    drops its tensors' Python objects and takes the GIL; once ``Py_FinalizeEx`` has begun, taking
    the GIL ends the thread with ``pthread_exit``, whose forced unwind through the C++ destructor
    calls ``std::terminate``: ``terminate called without an active exception``, exit code -6
    (seen in a core dump of rank 1). Destroying the groups here, before finalization, joins those
    threads. The barrier lets no rank tear down while another still sends; on gloo it is a
    ``monitored_barrier`` bounded by ``EXIT_BARRIER_TIMEOUT_S`` seconds. A
    process ending with an uncaught exception skips the barrier (the other ranks may be inside a
    collective it would never match) and leaves the group to the launcher, as before.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return  # the script called end_training() / destroy_process_group() itself
    if getattr(sys, "last_value", None) is not None:
        return  # uncaught exception: do not start a collective that may never complete
    try:
        if dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=EXIT_BARRIER_TIMEOUT_S))
            else:
                dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - at exit, report and let the process end
        print(f"hf_cephalo: could not end the process group cleanly at exit: {exc}",
              file=sys.stderr, flush=True)
