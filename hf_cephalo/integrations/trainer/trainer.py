"""CephaloTrainer: the Hugging Face ``Trainer`` on the Cephalo runtime (docs/design.md contract 8).

Swap ``Trainer`` for ``CephaloTrainer`` and ``TrainingArguments`` for
``CephaloTrainingArguments``; launch with ``accelerate launch --config_file
accelerate_configs/cephalo_cpu.yaml train.py`` (or ``cephalo.yaml`` on GPUs).

``CephaloTrainerMixin`` is the one mechanism that puts a ``Trainer`` subclass on the runtime
(``CephaloTrainer`` = the mixin + ``Trainer``; the TRL trainers and a user's own subclass are
made the same way). It settles the script's refusals first (``preflight.check_script``: every
refused setting in one message, before any collective), lets the subclass and stock
``Trainer.__init__`` run (so the planner sees the datasets as the subclass prepared them), then
builds the job (``job_from_training_args``) and the ``runtime.Session``: plan, engine, loaders,
optimizer over the shards, loss scaler, step hooks. What the Trainer does differently from stock
is then only where it must run through the engine: the step (``training_step`` is one
``engine.train_step`` over this rank's microbatches = one optimizer step; the loss is the GLOBAL
item mean; gradient accumulation: ``accumulation.py``), the loaders
(``data.py``: rank i gets exactly b_i samples of each global batch, also of a stream),
a given optimizer re-pointed at the shards, clipping by the global norm, evaluation
(``evaluation.py``), saving and checkpoints (``checkpoint.py``). Every
``TrainingArguments`` field and hook is classified in ``support.py`` (docs/trainer_support.md).
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Callable

import torch
from transformers import Trainer, TrainerCallback

from hf_cephalo.integrations.loop.accelerator import CephaloAccelerator, CephaloPlugin
from hf_cephalo.integrations.trainer.jit_checkpoint import replace_jit_checkpoint_callback
from hf_cephalo.console import format_loss_trend  # noqa: F401 (exported: the examples use it)
from hf_cephalo.integrations.trainer.preflight import (check_script,
                                               engine_checkpointing_replaces_model_checkpointing,
                                               optimizer_problems)
from hf_cephalo.integrations.trainer.support import HOOK_SUPPORT
from hf_cephalo.integrations.trainer.accumulation import AccumulationStep
from hf_cephalo.integrations.shared import trainer_class_problems
from hf_cephalo.integrations.trainer.checkpoint import EngineCheckpointMixin, unwrap_optimizer
from hf_cephalo.integrations.trainer.data import TrainerDataMixin
from hf_cephalo.integrations.trainer.evaluation import EngineEvaluationMixin
from hf_cephalo.integrations.trainer.training_args import CephaloArguments, job_from_training_args
from hf_cephalo.runtime import (ClusterProfile, CompileOptions, HeadCalls, ItemCountStagedModel,
                                Plan, Session, UserLossStagedModel, decay_groups, engine_names,
                                is_causal_lm, label_count, packs_without_padding,
                                parameter_names, seq2seq_user_loss_items, stock_count_shifts,
                                stock_item_count, stock_smoother_shift, supported_model_classes)
from hf_cephalo.runtime import format_plan_table  # noqa: F401 (exported)

__all__ = ["CephaloTrainer", "CephaloTrainerMixin", "format_plan_table", "format_loss_trend"]

logger = logging.getLogger(__name__)


def _compile_options(args) -> CompileOptions | None:
    """``--torch_compile`` / ``--torch_compile_backend`` / ``--torch_compile_mode`` as the
    engine's per-unit compile (docs/engine.md "Compile"); None when off. TrainingArguments
    fills in the backend ("inductor" on CPU / CUDA) when only torch_compile is set."""
    if not args.torch_compile:
        return None
    return CompileOptions(backend=args.torch_compile_backend or "inductor",
                          mode=args.torch_compile_mode)


class _SessionCallback(TrainerCallback):
    """The stock loop's hooks as the runtime session's step hooks (the one step timer, the
    slowdown schedule, the adaptive controller, the accuracy report, elastic progress); a live
    switch is also recorded in ``state.log_history``."""

    def __init__(self, trainer: "CephaloTrainerMixin") -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.session.train_begin()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.session.step_begin(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        last = bool(state.max_steps) and state.global_step >= state.max_steps
        record = self.trainer.session.step_end(
            state.global_step, getattr(self.trainer, "last_step_num_samples", None),
            epoch=state.epoch, is_last_step=last)
        if record is not None:
            state.log_history.append({"cephalo_replan": record, "step": state.global_step})

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.session.train_end()


class CephaloTrainerMixin(TrainerDataMixin, EngineEvaluationMixin, EngineCheckpointMixin):
    """Puts a ``Trainer`` subclass on the Cephalo runtime (see the module note).

    Args:
        model: a ``PreTrainedModel`` with a registered adapter (``hf_cephalo.models``).
        args: ``CephaloTrainingArguments`` (or a config with the ``cephalo_*`` fields).
        plan: a ``Plan`` to use instead of ``args``' plan/profile file.
        cluster_profile: with ``plan``, the ``ClusterProfile`` it was made from (live
            re-balancing refits it; without it ``--cephalo_adaptive batch`` is off with a
            warning). Ignored without ``plan``.
        **kwargs: every other argument of the Trainer subclass (train/eval datasets,
            data_collator, processing_class, compute_metrics, callbacks...).

    Raises:
        TypeError: ``args`` has no ``cephalo_*`` settings.
        ValueError: ``RefusedSettings`` listing, in ONE message, every refused setting of
            the script (``preflight.check_script``: the model, the datasets, ``optimizers``,
            ``TrainingArguments`` values and hooks: ``support.py``, docs/trainer_support.md);
            later, a plan that does not fit the job — all before any profiling or collective.
    """

    def __init__(self, model: torch.nn.Module | None = None, args=None, *,
                 plan: Plan | None = None, cluster_profile: ClusterProfile | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(args, CephaloArguments):
            raise TypeError(f"{type(self).__name__} needs CephaloTrainingArguments, got "
                            f"{type(args).__name__}: build args=CephaloTrainingArguments(...) "
                            "(every TrainingArguments field plus the cephalo_* settings)")
        if isinstance(model, str):  # a TRL door loads a name as stock TRL does; else refused
            model = self._load_named_model(model, args,
                                           whole=kwargs.get("peft_config") is not None)
        # [Note: no silent no-op] and [Note: one refusal message] in support.py: every refused
        # setting of the script (arguments, hooks, datasets, model) in one ValueError, before
        # the process group exists
        staged = check_script(args, model, self._hook_problems(model, kwargs),
                              train_dataset=kwargs.get("train_dataset"),
                              eval_dataset=kwargs.get("eval_dataset"),
                              model_refused=_overrides_forward(model))
        name_of = parameter_names(model)  # a user's optimizer's, before the engine replaces them
        compile_options = _compile_options(args)  # a bad backend / mode: ValueError here
        file_plan = Plan.load(args.cephalo_plan_file) \
            if plan is None and args.cephalo_plan_file is not None else None  # read once
        engine_checkpointing_replaces_model_checkpointing(args, plan or file_plan)
        user_loss = self._uses_user_loss(args, kwargs)
        # args.place_model_on_device is False (CephaloTrainingArguments): stock Trainer must not
        # move the whole model to the device; the engine moves only this rank's shards.
        # The subclass's __init__ runs here: a TRL trainer tokenizes / packs its datasets and
        # may wrap the model (a PEFT config), so the plan below sees what it prepared.
        super().__init__(model=model, args=args, **kwargs)
        if self.model is not model or self._restage_after_init(staged):
            # the subclass wrapped the model (e.g. get_peft_model), or changed what staging
            # reads (TRL's SFTTrainer sets the config's output_router_logits)
            model = self.model
            staged = check_script(args, model, [])
        # before sharding; as the engine names them (a PeftModel's carry a prefix it has not)
        self._decay_names = engine_names(model, self.get_decay_parameter_names(model))
        # stock floating_point_ops' parameter count, read while the model still holds its weights
        self._flops_numel = (model.num_parameters(exclude_embeddings=True)
                             if hasattr(model, "num_parameters") else 0)
        job = job_from_training_args(args, args.world_size, plan=plan, file_plan=file_plan,
                                     compile=compile_options,
                                     rows_per_sample=self._rows_per_sample(),
                                     scoring_passes=self._scoring_passes())
        self._head_calls: HeadCalls | None = None
        engine_staged = self._engine_staged(staged)
        if user_loss:  # [Note: collectives inside the engine's head] in head_calls.py
            engine_staged = UserLossStagedModel(engine_staged, self.compute_loss,
                                                variants=self._engine_call_variants(),
                                                count_items=self._user_loss_items(staged),
                                                global_loss_apart=self._global_loss_apart)
            self._head_calls = engine_staged.head_calls = HeadCalls(
                self, engine_staged.replay, None, job.device)
        elif stock_item_count(model, staged) is not None:  # [Note: stock's item count ...]
            engine_staged = ItemCountStagedModel(engine_staged, stock_item_count(model, staged))
        self.session = Session(job, engine_staged, model=model, plan=plan,
                               cluster_profile=cluster_profile,
                               train_dataset=self._planning_dataset(), plan_staged=staged)
        if self._head_calls is not None:
            self._head_calls.group = self.session.group
        self.accelerator.attach_session(self.session, model)
        if self.optimizer is not None:  # optimizers=(optimizer, scheduler): checked above
            self.session.repoint_optimizer(self.optimizer, name_of, "optimizers")
            self.session.set_optimizer(self.optimizer)  # the scheduler: the same object
        if self.session.scaler is not None:  # fp16: the engine's sharded scaler, [Note] below
            self.accelerator.scaler = self.session.scaler
            self.accelerator.native_amp = True
        self._scaler_unscaled = False
        self.add_callback(_SessionCallback(self))
        replace_jit_checkpoint_callback(self)  # [Note: JIT checkpoint agreed by all ranks]

    # [Note: the job's scaler] --fp16 (or an fp16 rank): the engine's ShardedGradScaler is
    # ``accelerator.scaler``, so stock Trainer + Accelerate use it unchanged: the prepared
    # optimizer calls ``scaler.step`` + ``update`` (a skipped step sets
    # ``optimizer_step_was_skipped``: the LR scheduler does not step) and checkpoints hold
    # ``scaler.pt`` (a scalar: any plan). Accelerate's own CUDA GradScaler would not agree the
    # found-inf flag across ranks.

    # ---- the session's state, as the Trainer exposes it ------------------------------------
    @property
    def engine(self):
        return self.session.engine

    @property
    def plan(self) -> Plan:
        """The plan in force (live re-balancing may switch it)."""
        return self.session.plan

    @property
    def cluster_profile(self) -> ClusterProfile | None:
        return self.session.cluster_profile

    @property
    def split_schedule(self):
        return self.session.split_schedule

    @property
    def rank_precisions(self) -> list[str] | None:
        return self.session.rank_precisions

    # ---- what stock features the engine path honours (support.py) ----------------------------
    def _hook_problems(self, model: torch.nn.Module | None, kwargs: dict[str, Any]) -> list[str]:
        """One message per Trainer argument or hook the engine path would bypass
        (``HOOK_SUPPORT``); raised with every other refusal by ``check_script``."""
        def refused(name: str) -> str:
            return f"{name} is not supported by CephaloTrainer: {HOOK_SUPPORT[name].note}"

        problems = []
        if kwargs.get("model_init") is not None:
            problems.append(refused("model_init"))
        problems += optimizer_problems(model, kwargs.get("optimizers"))
        if type(self)._get_train_sampler is not Trainer._get_train_sampler:
            problems.append(refused("_get_train_sampler (override)"))
        if _overrides_forward(model):
            problems.append(refused("model forward (override)"))
        problems += trainer_class_problems(type(self))  # TRL trainers the engine cannot run
        return problems

    def _uses_user_loss(self, args, kwargs: dict[str, Any]) -> bool:
        """A loss other than the adapter's: label smoothing, ``compute_loss_func``, a
        ``compute_loss`` override, or the Trainer subclass's own ``compute_loss`` (a TRL
        trainer's) (``user_loss.py``)."""
        return (args.label_smoothing_factor != 0 or kwargs.get("compute_loss_func") is not None
                or type(self).compute_loss is not CephaloTrainerMixin.compute_loss
                or _base_compute_loss(type(self)) is not None)

    def _user_loss_items(self, staged) -> Callable[[dict], int] | None:
        """The items N a user loss on a causal LM gets as ``num_items_in_batch``
        (docs/trainer_support.md, "Losses"): ``shift_labels`` where the batch has them, else the
        labels != -100 counted as stock counts them for the model's ``loss_type`` ([Note:
        stock's item count follows the loss type] in runtime/stock_items.py: after the causal
        shift for a causal-LM loss type, whatever the model's own loss does, e.g.
        ``BartForCausalLM``'s unshifted one); for the label smoother, the labels it scores,
        unshifted where stock's smoother does not shift (``stock_smoother_shift``: a class
        outside transformers' causal-LM mapping). None (the model's own count): a classifier,
        or a loss whose count stock takes as the model does."""
        if self.compute_loss_func is not None or self.label_smoother is not None:
            seq2seq = seq2seq_user_loss_items(staged)  # an encoder-decoder: decoder ids needed
            if seq2seq is not None:
                return seq2seq
        if not is_causal_lm(staged):
            return None
        if self.compute_loss_func is not None:  # stock's count for its loss type
            return label_count(stock_count_shifts(self.model))
        if self.label_smoother is not None:
            return label_count(stock_smoother_shift(staged.model))
        if type(self)._engine_staged is not CephaloTrainerMixin._engine_staged:
            return None  # a sample is not one row (DPO's pairs): the door counts its items
        return stock_item_count(self.model, staged)  # the model's own loss, or TRL SFT's

    _global_loss_apart = False
    """Whether this trainer's own ``compute_loss`` leaves a model's global-batch term (the MoE
    router loss) to the engine (``UserLossStagedModel``'s ``global_loss_apart``): a TRL door
    that knows its loss's router term. A user's ``compute_loss`` cannot: such a model is refused."""

    def _restage_after_init(self, staged) -> bool:
        """Whether the subclass's ``__init__`` changed the model's config in a way staging
        reads, so it is staged again. Default: no."""
        return False

    def _engine_call_variants(self) -> dict[str, Any]:
        """Keyword -> ``user_loss.CallVariant``: model calls the loss's stand-in model answers
        from the engine's head in another way than with the logits (a TRL trainer: its fused
        LM head, ``integrations/trl/fused.py``). Default: none."""
        return {}

    def _load_named_model(self, name: str, args, whole: bool = False) -> Any:
        """A model given by name: stock ``Trainer`` takes a model object, so the name is kept
        and refused by ``check_script``; the TRL doors load it (``TRLModelByName``; ``whole``
        with a ``peft_config``)."""
        return name

    def _planning_dataset(self):
        """The dataset whose rows price the profile (their ``input_ids`` length): the training
        set (a generating TRL door: rows of its prompt + completion length)."""
        return self.train_dataset

    def _engine_staged(self, staged):
        """The adapter the engine runs (the user loss wraps it): ``staged`` (a TRL trainer whose
        sample is not one row counts its items otherwise: ``integrations/trl/dpo.py``)."""
        return staged

    def _rows_per_sample(self) -> int:
        """The sequence rows one sample is in the engine's training microbatch, for the
        planner's pricing (``Job.rows_per_sample``): 1; a TRL door whose sample is a
        preference pair (both rows in one microbatch) says 2."""
        return 1

    def _scoring_passes(self) -> float:
        """Forward-only passes over the plan's split per optimizer step, for the start plan's
        pricing (``Job.scoring_passes``): 0; the generating TRL doors count their
        log-probability passes (``integrations/trl/rollout_door.py``)."""
        return 0.0

    def _engine_microbatches(self, microbatches: list) -> list:
        """This rank's collated microbatches as the engine runs them: as collated (a TRL
        trainer whose sample is two rows unfolds them here: ``integrations/trl/dpo.py``)."""
        return microbatches

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """Stock ``Trainer.compute_loss`` as the engine's head loss (``user_loss.py``), or the
        Trainer subclass's own ``compute_loss`` (a TRL trainer's) when it has one.

        ``model`` is an ``EngineOutputs`` stand-in whose call returns this microbatch's outputs;
        ``num_items_in_batch`` is the GLOBAL item count. Same precedence as stock:
        ``compute_loss_func``, else the label smoother, else the model's own loss. No DDP
        rescaling (stock multiplies by the number of processes because DDP averages; the
        engine sums; inside the head ``accelerator.num_processes`` is 1, so a subclass's stock
        rescaling is a no-op). Override it like stock (call ``model(**inputs)`` once); for
        exactness a user loss must be a sum over items divided by ``num_items_in_batch``.
        """
        if _base_compute_loss(type(self)) is not None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        if (self.label_smoother is not None or self.compute_loss_func is not None) and "labels" in inputs:
            labels = inputs.pop("labels")
        else:
            labels = None
        outputs = model(**inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif labels is not None:
            loss = self.label_smoother(outputs, labels,
                                       shift_labels=getattr(model, "cephalo_smoother_shift", False),
                                       num_items_in_batch=num_items_in_batch)
        else:
            loss = outputs["loss"]
        return (loss, outputs) if return_outputs else loss

    # ---- accelerator -----------------------------------------------------------------------
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

    def _unscale_once(self) -> None:
        """Unscale the shard gradients before clipping / the norm (once per step)."""
        scaler = self.accelerator.scaler
        if scaler is not None and not self._scaler_unscaled:
            scaler.unscale_(unwrap_optimizer(self.optimizer))  # all-reduces found-inf
            self._scaler_unscaled = True

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Stock ``log``, plus ``loss_scale`` (the fp16 scaler's current scale) on training
        logs with --fp16."""
        if self.accelerator.scaler is not None and "loss" in logs:
            logs = {**logs, "loss_scale": float(self.accelerator.scaler.get_scale())}
        super().log(logs, start_time)

    def get_total_train_batch_size(self, args) -> int:
        """The plan's global batch size B (Trainer's speed metrics and logs use it)."""
        return self.plan.global_batch_size

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        # A batch: a list of microbatch dicts, or a stand-in; the engine counts items itself.
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
        if mode == "no" or isinstance(inputs, AccumulationStep):  # a stand-in holds no tokens
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
        if isinstance(inputs, AccumulationStep):  # [Note: the stock loop's k batches]
            return torch.zeros((), dtype=torch.float32, device=self.args.device)
        model.train()
        self.session.zero_grad()  # one engine step per optimizer step: every step starts fresh
        microbatches = self._prepare_input(list(inputs))
        # a packing collator's row holds several samples: their number is not in the batch
        self.last_step_num_samples = None if packs_without_padding(self.data_collator) else \
            sum(_num_samples(mb) for mb in microbatches)
        microbatches = self._engine_microbatches(microbatches)
        self._scaler_unscaled = False
        if self._head_calls is None:
            out = self.session.train_step(microbatches, loss_scale=self.accelerator.scaler)
        else:  # [Note: collectives inside the engine's head] in head_calls.py
            with self._head_calls.step(microbatches):
                out = self.session.train_step(microbatches, loss_scale=self.accelerator.scaler)
            self._head_calls.finish(out.num_items)
        return torch.tensor(out.loss, dtype=torch.float32, device=self.args.device)

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        self._unscale_once()  # as accelerator.clip_grad_norm_ does
        return self.session.clip_grad_norm(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None):
        if grad_norm is None:
            self._unscale_once()
            grad_norm = self.session.clip_grad_norm(float("inf"))  # global norm, no clipping
        return grad_norm

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer class and kwargs (``optimizer_cls_and_kwargs`` if given,
        else from ``optim``) over this rank's per-parameter shards, in stock's two groups:
        ``get_decay_parameter_names`` with ``weight_decay``, the rest (biases, norms) with 0
        (``runtime/optim.py``).

        Raises ValueError for an optimizer that needs the model itself or cannot step 1-D
        shards (LBFGS, Adafactor, GaLore, ...).
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
            names = [name for name, _ in self.session.named_shards()]
            groups = decay_groups(names, self._decay_names, self.args.weight_decay)
            self.optimizer = self.session.build_optimizer(optimizer_cls, optimizer_kwargs, groups)
        self.session.set_optimizer(self.optimizer)
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
        resume_from_checkpoint = self._prepare_resume(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    # ---- the user's model ------------------------------------------------------------------
    def generate(self, input_ids=None, attention_mask=None, **kwargs) -> torch.Tensor:
        """Collective (every rank, same number of calls): ``model.generate`` on the sharded
        weights with keyed sampling (docs/generation.md); (B, P + T) prompts then completions
        (an encoder-decoder: (B, 1 + T) decoder tokens, the start token then the completion).
        Keywords as the prepared loop model's ``generate``
        (``runtime.generation.generate_tensor``): ``max_new_tokens``, ``do_sample``,
        ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``eos_token_id``, ``pad_token_id``,
        ``rows``, ``round_`` (default: ``state.global_step``), ``seed`` (default
        ``args.seed``), ``mode``. Raises TypeError for other keywords or without
        ``input_ids``, ValueError for an encoder-decoder whose encoder reads features
        (Whisper: the prompts are token ids)."""
        from hf_cephalo.runtime import generate_tensor

        kwargs.setdefault("round_", self.state.global_step)
        return generate_tensor(self.session, input_ids, attention_mask, **kwargs)

    def unshard_model(self) -> torch.nn.Module:
        """Collective (call on every rank): put full copies of the current weights into the
        model object passed to ``CephaloTrainer`` (``trainer.model``) on every rank, so that
        ``model(**batch)`` and ``model.save_pretrained(dir)`` work again; returns it.

        Costs the whole model's parameters on every rank (bytes = 4 x numel in fp32). The
        engine keeps its shards: a later ``train()`` / ``evaluate()`` re-shards the model (see
        [Note: the user's model while sharded] in ``sharded_model.py``). To save without
        gathering on every rank use ``trainer.save_model(dir)`` (rank 0 writes).
        """
        self.session.restore_full_model()
        return self.model


class CephaloTrainer(CephaloTrainerMixin, Trainer):
    """``Trainer`` that trains through the Cephalo runtime with a per-rank weighted batch split
    (see ``CephaloTrainerMixin`` for the arguments and errors)."""


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


def _base_compute_loss(cls: type) -> Any:
    """The ``compute_loss`` of the Trainer class the mixin is put on (a TRL trainer's, a user
    Trainer subclass's), None when that is stock ``Trainer.compute_loss``."""
    mro = cls.__mro__
    below = mro[mro.index(CephaloTrainerMixin) + 1:] if CephaloTrainerMixin in mro else ()
    owner = next((c for c in below if "compute_loss" in vars(c)), Trainer)
    return None if owner is Trainer else vars(owner)["compute_loss"]


def _num_samples(microbatch) -> int:
    """Samples in one collated microbatch: the first dimension of its first tensor."""
    values = microbatch.values() if hasattr(microbatch, "values") else [microbatch]
    return next((int(v.shape[0]) for v in values if torch.is_tensor(v) and v.dim() > 0), 0)


def _overrides_forward(model: torch.nn.Module | None) -> bool:
    """Whether ``model``'s class overrides ``forward`` below the class the engine stages it by:
    the nearest class with a hand-written adapter, else the nearest transformers class (the
    generic path). Such a forward (e.g. a custom loss) would be bypassed."""
    if model is None or isinstance(model, str):
        return False
    registered = next((c for c in type(model).__mro__ if c.__name__ in supported_model_classes()),
                      None) or next((c for c in type(model).__mro__
                                     if c.__module__.startswith("transformers.")
                                     and "forward" in vars(c)), None)
    return registered is not None and type(model).forward is not registered.forward
