"""CephaloTrainer: the Hugging Face Trainer driving the Cephalo engine (docs/design.md contract 6).

Swap ``Trainer`` for ``CephaloTrainer`` and ``TrainingArguments`` for
``CephaloTrainingArguments``; launch with ``accelerate launch --config_file
accelerate_configs/cephalo_cpu.yaml train.py`` (or ``cephalo.yaml`` on GPUs).

What changes against stock Trainer (everything else — LR scheduler, logging, report_to,
callbacks — is the Trainer's own):

- **Plan** (``auto_plan.resolve_plan_for_model``): the plan file, else the exact optimizer
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
  from any checkpoint.
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
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

from hf_cephalo.engine import CephaloEngine, CompileOptions
from hf_cephalo.integrations.accelerate import CephaloAccelerator, CephaloPlugin
from hf_cephalo.integrations.auto_plan import PlanAccuracyCallback, wrap_staged
from hf_cephalo.integrations.elastic import ElasticCallback, resolve_elastic_plan
from hf_cephalo.integrations.preflight import check_before_planning
from hf_cephalo.integrations.sampler import MicrobatchCollator, WeightedBatchSampler
from hf_cephalo.integrations.sharded_model import guard_sharded_model, restore_full_model
from hf_cephalo.integrations.support import HOOK_SUPPORT, check_training_args
from hf_cephalo.integrations.training_args import CephaloTrainingArguments
from hf_cephalo.integrations.user_loss import UserLossStagedModel
from hf_cephalo.integrations.weight_decay import ShardWeightDecay, decay_rule, shard_decay_masks
from hf_cephalo.models.registry import supported_model_classes
from hf_cephalo.planner import Plan

__all__ = ["CephaloTrainer", "format_plan_table", "format_loss_trend"]

logger = logging.getLogger(__name__)


def format_plan_table(plan: Plan) -> str:
    """The plan as a text table: one row per rank (batch, microbatch, microbatches, state %)."""
    # full device names: emulated ones differ only after the base name ("cpu [emulated 2x ...]")
    width = max([12] + [len(r.device) for r in plan.ranks])
    rows = [f"Cephalo plan: global batch size {plan.global_batch_size}, uneven state "
            f"{plan.uneven_state}, predicted iteration "
            f"{'-' if plan.predicted_iteration_s is None else f'{plan.predicted_iteration_s:.3f} s'}",
            f"{'rank':>4} {'device':<{width}} {'b_i':>5} {'m_i':>5} {'l_i':>5} {'r_i %':>7}"]
    for r in plan.ranks:
        rows.append(f"{r.rank:>4} {r.device:<{width}} {r.batch_size:>5} {r.microbatch_size:>5} "
                    f"{r.num_microbatches:>5} {100 * r.state_ratio:>7.2f}")
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


class _EpochDataLoader(DataLoader):
    """DataLoader whose ``set_epoch`` reaches its ``WeightedBatchSampler`` (Trainer calls it)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


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
        **kwargs: every other ``Trainer`` argument (train/eval datasets, data_collator,
            processing_class, compute_metrics, callbacks, preprocess_logits_for_metrics...).

    Raises:
        TypeError: ``args`` is not ``CephaloTrainingArguments``.
        ValueError: no model (``model_init`` is not supported), a plan that does not fit the
            job, an unsupported model class, an iterable dataset, a ``TrainingArguments`` value
            or hook the engine would not honour (``support.py``, docs/trainer_support.md) —
            before any profiling or collective.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 args: CephaloTrainingArguments | None = None, *, plan: Plan | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(args, CephaloTrainingArguments):
            raise TypeError(f"CephaloTrainer needs CephaloTrainingArguments, got "
                            f"{type(args).__name__}: build args=CephaloTrainingArguments(...) "
                            "(every TrainingArguments field plus the cephalo_* settings)")
        if model is None:
            raise ValueError("CephaloTrainer needs a model: pass model=... (model_init is not "
                             "supported: build the model yourself)")
        check_training_args(args)  # [Note: no silent no-op] in support.py
        compile_options = _compile_options(args)  # a bad backend / mode: ValueError here
        self._check_hooks(model, kwargs)
        _engine_checkpointing_replaces_model_checkpointing(args)
        world_size = args.world_size  # sets up the process group (accelerate launch / torchrun)
        # [Note: fail fast] in preflight.py: no profile, plan or collective before these checks
        staged = check_before_planning(args, world_size, model, plan=plan,
                                       train_dataset=kwargs.get("train_dataset"),
                                       eval_dataset=kwargs.get("eval_dataset"))
        self.cluster_profile = None  # the profile an automatic plan was made from
        if plan is None:  # plan file > profile file > profile this cluster (auto_plan.py)
            plan, self.cluster_profile = resolve_elastic_plan(args, world_size, model,
                                                              kwargs.get("train_dataset"))
        self.plan = plan
        if self._uses_user_loss(args, kwargs):  # the Trainer's loss as the engine's head loss
            staged = UserLossStagedModel(staged, self.compute_loss)
        staged = wrap_staged(staged, args, world_size)  # emulated slowdown / compute timing
        # args.place_model_on_device is False (CephaloTrainingArguments): stock Trainer must not
        # move the whole model to the device; the engine moves only this rank's shards.
        super().__init__(model=model, args=args, **kwargs)
        self._decay_names = set(self.get_decay_parameter_names(model))  # before sharding
        self._full_numel = sum(p.numel() for p in model.parameters())
        _ensure_process_group(args.device)
        _register_exit_teardown()  # ends the process group cleanly if the script does not
        # The engine builds unit by unit: a meta model reads its checkpoint slices
        # (``model.cephalo_checkpoint``, from ``from_pretrained_sharded``) or is initialized per
        # unit with ``args.seed``; an in-memory model takes rank 0's values.
        precision = args.engine_precision()
        self.engine = CephaloEngine(staged, self.plan.state_ratios, device=args.device,
                                    offload_activations=args.cephalo_offload_activations,
                                    autocast_dtype=precision.autocast_dtype,
                                    param_dtype=precision.param_dtype,
                                    reduce_dtype=precision.reduce_dtype,
                                    root_resident=self.plan.root_resident, init_seed=args.seed,
                                    compile=compile_options)
        self.accelerator.attach_engine(self.engine, model)
        self._attach_grad_scaler()
        guard_sharded_model(model, self._full_numel)  # [Note: the user's model while sharded]
        self.add_callback(PlanAccuracyCallback(self))  # predicted vs measured at train end
        self.elastic = ElasticCallback(self)  # progress, and the report of a resume
        self.add_callback(self.elastic)
        if self.is_world_process_zero():
            print(format_plan_table(self.plan), flush=True)
            if self.cluster_profile is not None:
                from hf_cephalo.planner.simulate import extrapolation_note

                note = extrapolation_note(self.plan, self.cluster_profile)
                if note:
                    print(note, flush=True)

    # ---- what stock features the engine path honours (support.py) ----------------------------
    def _check_hooks(self, model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        """ValueError for a hook CephaloTrainer would bypass (``HOOK_SUPPORT``), before any
        collective."""
        def refuse(name: str) -> None:
            raise ValueError(f"{name} is not supported by CephaloTrainer: "
                             f"{HOOK_SUPPORT[name].note} (docs/trainer_support.md)")

        if kwargs.get("model_init") is not None:
            refuse("model_init")
        if any(x is not None for x in kwargs.get("optimizers") or ()):
            refuse("optimizers")
        if type(self)._get_train_sampler is not Trainer._get_train_sampler:
            refuse("_get_train_sampler (override)")
        registered = next((c for c in type(model).__mro__ if c.__name__ in supported_model_classes()),
                          None)
        if registered is not None and type(model).forward is not registered.forward:
            refuse("model forward (override)")

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
        if not self.args.fp16:
            return
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
                         microbatch_size: int) -> _EpochDataLoader:
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
        sampler = WeightedBatchSampler(len(dataset), self.plan.batch_sizes, self.args.process_index,
                                       seed=seed, shuffle=shuffle and strategy == "random",
                                       drop_last=shuffle and self.args.dataloader_drop_last,
                                       lengths=lengths)
        workers = self.args.dataloader_num_workers
        extra = {} if workers == 0 else dict(
            persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
            multiprocessing_context=self.args.dataloader_multiprocessing_context)
        return _EpochDataLoader(dataset, batch_sampler=sampler,
                                collate_fn=MicrobatchCollator(collator, microbatch_size),
                                num_workers=workers, pin_memory=self.args.dataloader_pin_memory,
                                **extra)

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
        return self._weighted_loader(eval_dataset, "evaluation", shuffle=False,
                                     microbatch_size=self.args.per_device_eval_batch_size)

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return self.get_eval_dataloader(test_dataset)

    def get_total_train_batch_size(self, args) -> int:
        """The plan's global batch size B (Trainer's speed metrics and logs use it)."""
        return self.plan.global_batch_size

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        # A batch is a list of microbatch dicts; the engine counts items itself (all-reduce).
        return list(itertools.islice(epoch_iterator, num_batches)), None

    # ---- training step -------------------------------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: list[dict[str, torch.Tensor]],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """One optimizer step's forward/backward: ``engine.train_step`` over this rank's microbatches.

        Returns the global item-mean loss of the step (identical on every rank).
        """
        model.train()
        self.engine.zero_grad()  # gradient_accumulation_steps == 1: every step starts fresh
        microbatches = self._prepare_input(list(inputs))
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
                self.optimizer.register_step_pre_hook(
                    ShardWeightDecay(params, masks, weight_decay, rule))
        return self.optimizer

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
        """
        if prediction_loss_only is None:
            prediction_loss_only = self.args.prediction_loss_only
        self.model.eval()
        loss_sum, num_items, local = 0.0, 0, []
        for indices, microbatches in zip(dataloader.batch_sampler, dataloader):
            microbatches = self._prepare_input(microbatches)
            out = self.engine.evaluate(microbatches, return_logits=not prediction_loss_only,
                                       process_logits=self._microbatch_predictions)
            if out.num_items:
                loss_sum += out.loss * out.num_items
                num_items += out.num_items
            if not prediction_loss_only:
                local += self._local_predictions(indices, microbatches, out.logits)
        metrics: dict[str, Any] = {}
        if num_items:
            metrics["loss"] = loss_sum / num_items
        predictions = label_ids = None
        num_samples = dataloader.batch_sampler.dataset_length
        if not prediction_loss_only:
            predictions, label_ids = self._gather_predictions(local, dataloader.batch_sampler.dataset_length)
            if self.compute_metrics is not None and label_ids is not None:
                metrics.update(self.compute_metrics(EvalPrediction(predictions=predictions,
                                                                   label_ids=label_ids)))
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

    def _local_predictions(self, indices: list[int], microbatches,
                           predictions: list[torch.Tensor]):
        """(dataset index, prediction row, label row) per sample; CPU tensors."""
        rows = []
        position = 0
        for mb, mb_predictions in zip(microbatches, predictions):
            labels = mb.get("labels")
            for j in range(mb_predictions.shape[0]):
                rows.append((indices[position], mb_predictions[j],
                             None if labels is None else labels[j].detach().cpu()))
                position += 1
        return rows

    def _gather_predictions(self, local, dataset_length: int):
        from accelerate.utils import gather_object

        rows = gather_object(local) if self.args.world_size > 1 else local
        rows.sort(key=lambda row: row[0])
        if [row[0] for row in rows] != list(range(dataset_length)):
            raise RuntimeError(f"evaluation gathered {len(rows)} predictions for {dataset_length} "
                               "samples (internal error: each sample must appear exactly once)")
        if not rows:
            return None, None
        predictions = _stack_padded([row[1] for row in rows], -100)
        labels = None if rows[0][2] is None else _stack_padded([row[2] for row in rows], -100)
        return predictions, labels

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

        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with atomic_checkpoint_dir(output_dir, self.engine.group) as staging:
            if self.args.cephalo_save_full_model:
                self.save_model(staging, _internal_call=True)
            elif self.args.should_save:
                self._save_side_files(staging)
            if self.args.should_save:
                self._save_run_record(staging)
                _save_adapter_config(self.model, staging)
            if not self.args.save_only_model:
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
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best):
                self.state.best_model_checkpoint = best
        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint,
                               use_mtime=True)

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
                raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir!r} holds "
                                 "no complete checkpoint-N; start without it")
        if not resume_from_checkpoint:
            return resume_from_checkpoint
        old_plan, record = read_checkpoint_record(resume_from_checkpoint)
        model = self.engine.staged.model
        check_resume(resume_from_checkpoint, record, self.plan, run_fingerprint(model),
                     type(model).__name__, self.args.cephalo_global_batch_size is not None
                     or self.args.cephalo_plan_file is not None)
        suffix = str(resume_from_checkpoint).rstrip("/").rsplit("-", 1)[-1]
        step = record.global_step if record is not None else int(suffix) if suffix.isdigit() else 0
        self.elastic.arm(resume_from_checkpoint, step, old_plan,
                         None if record is None else record.world_size)
        return resume_from_checkpoint

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
        from hf_cephalo.engine.checkpoint import errors_on_every_rank, load_sharded

        with errors_on_every_rank(self.engine.group):  # a bad shard on one rank stops all ranks
            load_sharded(self.engine, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Optimizer state re-laid for this plan (exact values) and the scheduler's position.

        Reads only safetensors, JSON and ``torch.load(weights_only=True)``.
        """
        if checkpoint is None:
            return
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


def _engine_checkpointing_replaces_model_checkpointing(args) -> None:
    """``gradient_checkpointing`` / ``activation_checkpointing``: the engine recomputes every
    unit in backward, which IS activation checkpointing. Stock ``Trainer.train()`` would switch
    the model's own checkpointing on as well (each layer's forward then runs three times per
    microbatch instead of two), so the flags are logged and cleared on ``args``."""
    if args.activation_checkpointing or args.gradient_checkpointing:
        logger.warning("gradient_checkpointing/activation_checkpointing: the Cephalo engine "
                       "already recomputes every layer in backward (per-unit activation "
                       "checkpointing); the model's own checkpointing is not switched on in "
                       "addition")
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
