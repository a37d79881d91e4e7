"""The Trainer support matrix: every ``TrainingArguments`` field and Trainer hook, classified.

One table (``FIELD_SUPPORT``, ``HOOK_SUPPORT``) is the single source for three things: the
refusals ``CephaloTrainer`` raises at construction (``check_training_args``), the test that
every field of the installed ``TrainingArguments`` is classified
(tests/test_trainer_support.py), and the table in docs/trainer_support.md
(``render_markdown``; the test checks the page is up to date).

[Note: no silent no-op]
CephaloTrainer replaces the Trainer's model call, data loading, loss, step and saving with the
engine's (docs/design.md contract 6). A stock feature that lives on one of those paths would be
accepted and then do nothing. So every field is one of:

- ``STOCK``: works as with stock ``Trainer``; ``test`` names the test comparing it with stock.
- ``INHERITED``: handled by stock Trainer code the engine does not replace (logging,
  scheduling, callbacks, checkpoint rotation, hub); the note says which.
- ``NOT_APPLICABLE``: has no meaning for the engine (the note says why); every value is
  accepted and has no effect, as documented.
- ``REFUSED``: a non-default value raises ValueError at construction, before any profiling or
  collective, naming the field and what to do instead (all refusals of a script in one
  message: [Note: one refusal message]).
A ``STOCK`` / ``INHERITED`` field may still refuse some values (``refuse_if``), e.g.
``train_sampling_strategy="batch_rebalance"``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

from hf_cephalo.integrations.shared import (Status, Support, inherited, markdown_table,
                                           not_applicable, refused, stock)

__all__ = ["Status", "Support", "FIELD_SUPPORT", "HOOK_SUPPORT", "RefusedSettings",
           "check_training_args", "training_args_problems", "unclassified_fields",
           "markdown_table", "render_markdown", "stock", "inherited", "not_applicable",
           "refused"]


def _is_unset(value: Any) -> bool:
    """The stock defaults after ``TrainingArguments.__post_init__``: None/False/''/[]/{}/0."""
    if isinstance(value, enum.Enum):
        value = value.value
    return value is None or value is False or value == "" or value == [] or value == {} \
        or value == "no"


def _not_default(default: Any) -> Callable[[Any], bool]:
    def refuse(value: Any) -> bool:
        if isinstance(value, enum.Enum):
            value = value.value
        if _is_unset(default):
            return not _is_unset(value)
        return value != default
    return refuse


def _accelerator_config_refused(value: Any) -> bool:
    """split_batches / dispatch_batches / even_batches=False act on Accelerate-prepared loaders,
    which CephaloTrainer does not use."""
    if value is None:
        return False
    get = value.get if isinstance(value, dict) else (lambda k, d=None: getattr(value, k, d))
    return bool(get("split_batches", False)) or get("dispatch_batches", None) is not None \
        or get("even_batches", True) is False


_T = "tests/test_trainer.py::"
_L = "tests/test_trainer_launch.py::"
_P = "tests/test_trainer_parity.py::"
_C = "tests/test_checkpoint_trainer.py"
_R = "tests/test_trainer_lifted_refusals.py::"
_K = "tests/test_checkpoint_settings.py::"
_LOOP = "the stock training loop reads it; the engine only replaces the step itself"
_EVAL = "stock evaluate()/predict() schedule; the loop body runs through the engine"
_HUB = "stock hub upload code; CephaloTrainer.save_model writes the files it uploads"

_GC_KWARGS_NOTE = (
    "{'use_reentrant': False} (stock's default, what the engine's per-unit recompute is) and "
    "every_n_layers=1 / offload=False / preserve_rng_state=True are accepted; "
    "use_reentrant=True is refused: reentrant checkpointing gives no gradient to a layer whose "
    "inputs do not require grad (frozen embeddings, LoRA without enable_input_require_grads), "
    "the engine's recompute does, so results would differ from stock; other values "
    "(every_n_layers > 1, offload=True, preserve_rng_state=False, other keys) change what the "
    "engine always does: drop them (activation offload: --cephalo_activation_offload)")


def _checkpointing_kwargs_refused(value: Any) -> bool:
    """Anything but the non-reentrant, every-layer, no-offload checkpointing the engine does."""
    if value is None:
        return False
    if not isinstance(value, dict):
        return True
    accepted = {"use_reentrant": False, "every_n_layers": 1, "offload": False,
                "preserve_rng_state": True}  # dropout replayed in recompute (docs/engine.md)
    return any(key not in accepted or v != accepted[key] for key, v in value.items())


FIELD_SUPPORT: dict[str, Support] = {
    # ---- run length, optimizer, schedule ----
    "output_dir": stock("checkpoints and saved models go there", _T + "test_matches_full_batch_reference"),
    "per_device_train_batch_size": stock(
        "without a plan or cephalo_global_batch_size, B = per_device_train_batch_size x world "
        "size x gradient_accumulation_steps (the stock global batch, named in the plan line); "
        "with a plan each rank's b_i comes from the plan",
        _P + "test_matches_stock_trainer"),
    "num_train_epochs": stock("stock loop", _T + "test_matches_full_batch_reference"),
    "max_steps": stock("stock loop", _P + "test_matches_stock_trainer"),
    "learning_rate": stock("stock optimizer kwargs", _P + "test_matches_stock_trainer"),
    "lr_scheduler_type": stock("stock scheduler over the shard optimizer",
                               _T + "test_matches_full_batch_reference"),
    "lr_scheduler_kwargs": inherited("stock create_scheduler"),
    "warmup_steps": inherited("stock create_scheduler"),
    "optim": Support(
        status=Status.STOCK, test=_P + "test_matches_stock_trainer",
        note="the stock optimizer class and kwargs over this rank's per-parameter shards (one 1-D "
             "shard per parameter, stock's parameter groups); optimizers that need the model "
             "itself or matrix-shaped state (LOMO, GaLore, APOLLO, Adafactor) are refused: use an "
             "element-wise optimizer such as adamw_torch or sgd",
        refuse_if=lambda v: any(k in str(getattr(v, "value", v)) for k in ("lomo", "galore", "apollo"))),
    "optim_args": inherited("parsed by stock get_optimizer_cls_and_kwargs"),
    "weight_decay": stock(
        "stock's decay / no-decay parameter groups (get_decay_parameter_names) over the "
        "per-parameter shards, so every optimizer applies its own decay rule as stock",
        _P + "test_weight_decay_as_stock"),
    "adam_beta1": inherited("stock optimizer kwargs"),
    "adam_beta2": inherited("stock optimizer kwargs"),
    "adam_epsilon": inherited("stock optimizer kwargs"),
    "optim_target_modules": refused(
        "GaLore/APOLLO pick modules of the full model, which the engine holds as flat shards; "
        "drop optim_target_modules and use an element-wise optimizer"),
    "gradient_accumulation_steps": stock(
        "the global batch is per_device_train_batch_size x world size x "
        "gradient_accumulation_steps (plan line); one optimizer step = one engine step over "
        "it (the engine accumulates each rank's l_i microbatches); the stock loop still counts "
        "k batches per step (the loader yields each step's share, then k - 1 empty stand-ins), "
        "so steps per epoch, max_steps, epoch fractions, logging and resume skipping are "
        "stock's; the logged loss is the step's global item mean (stock's with "
        "num_items_in_batch). With dataloader_drop_last the whole short last global batch is "
        "dropped (stock keeps its full per-device batches; warned)",
        _R + "test_gradient_accumulation_as_stock"),
    "average_tokens_across_devices": Support(
        status=Status.STOCK, test=_P + "test_matches_stock_trainer",
        note="the engine always divides by the global item count (stock True); False (per-rank "
             "means averaged) is refused: drop the flag",
        refuse_if=lambda v: v is False),
    "max_grad_norm": stock("global L2 norm over all ranks' shards", _P + "test_matches_stock_trainer"),
    "label_smoothing_factor": stock(
        "stock LabelSmoother in the engine's head loss, normalized by the global item count",
        _P + "test_label_smoothing_as_stock"),
    # ---- precision / compute ----
    "bf16": stock("bf16 autocast, fp32 master weights", _T + "test_bf16_trains_under_autocast"),
    "fp16": stock("fp16 autocast with PyTorch's ShardedGradScaler (found-inf agreed across "
                  "ranks, unscaled before clipping, saved in checkpoints, loss_scale logged; "
                  "fused optimizers such as the default adamw_torch_fused included); "
                  "fp16 gathered parameters unless --cephalo_param_dtype says otherwise",
                  "tests/test_trainer_fp16.py::test_fp16_trainer_scaler_logged_saved_resumed"),
    "bf16_full_eval": refused("evaluation runs in the training precision: drop the flag"),
    "fp16_full_eval": refused("evaluation runs in the training precision: drop the flag"),
    "tf32": inherited("a torch backend switch set by TrainingArguments itself"),
    "activation_checkpointing": stock(
        "the engine recomputes every unit in backward: that is the checkpointing; the model's "
        "own checkpointing is never switched on in addition (logged). Refused beside "
        "--cephalo_activation_checkpointing false or a plan made without checkpointing (the "
        "flag asks for it); with --cephalo_activation_checkpointing auto (the default) the "
        "trainer plans with checkpointing on",
        _P + "test_gradient_checkpointing_recomputes_once"),
    "gradient_checkpointing": stock(
        "alias of activation_checkpointing (same handling)",
        _P + "test_gradient_checkpointing_recomputes_once"),
    "activation_checkpointing_kwargs": Support(
        status=Status.STOCK, test=_L + "test_two_process_fields_as_stock_ddp",
        note=_GC_KWARGS_NOTE, refuse_if=_checkpointing_kwargs_refused),
    "gradient_checkpointing_kwargs": Support(
        status=Status.STOCK, test=_L + "test_two_process_fields_as_stock_ddp",
        note="alias of activation_checkpointing_kwargs (same handling)",
        refuse_if=_checkpointing_kwargs_refused),
    "torch_compile": stock(
        "each decoder layer (engine unit) is compiled: forward, recompute and backward; "
        "identical layers share graphs; the profiler times the compiled units; a unit that "
        "fails to compile stops every rank before the first all-gather (docs/engine.md "
        "\"Compile\"); trajectory equal to eager's to fp32 rounding. The compiled layers are "
        "installed only while the engine runs them, so the model object is eager after "
        "training and after trainer.unshard_model(), as stock leaves it (stock compiles a "
        "wrapper)",
        "tests/test_compile_trainer.py::test_compiled_trainer_equals_eager"),
    "torch_compile_backend": stock(
        "the backend of the per-unit compile (default inductor); an unknown one is refused "
        "at construction",
        "tests/test_compile.py::test_bad_backend_or_mode_refused_without_process_group"),
    "torch_compile_mode": stock(
        "the inductor mode of the per-unit compile", "tests/test_compile.py::"
        "test_bad_backend_or_mode_refused_without_process_group"),
    "use_liger_kernel": refused("Liger patches the model's forward and loss, which the engine "
                                "bypasses: drop use_liger_kernel"),
    "liger_kernel_config": refused("see use_liger_kernel: drop the flag"),
    "use_cache": not_applicable(
        "training never uses a KV cache; the adapters force config.use_cache=False"),
    "neftune_noise_alpha": refused("NEFTune's embedding hook is not validated with the engine's "
                                   "embedding recompute: drop neftune_noise_alpha"),
    "torch_empty_cache_steps": refused("the engine's step does not call the stock cache "
                                       "emptying; it releases each unit's buffers itself: drop "
                                       "the flag"),
    "auto_find_batch_size": refused(
        "the plan fixes every rank's batch and microbatch size; a smaller microbatch needs a "
        "new plan (lower --cephalo_memory_fraction or hf-cephalo plan), not a retry: drop "
        "auto_find_batch_size"),
    # ---- logging ----
    "logging_strategy": inherited(_LOOP),
    "logging_steps": inherited(_LOOP),
    "logging_first_step": inherited(_LOOP),
    "log_on_each_node": inherited(_LOOP),
    "logging_nan_inf_filter": inherited(_LOOP),
    "include_num_input_tokens_seen": stock(
        "True / 'all': the main input's elements of every microbatch (padding included, as "
        "stock counts each process's padded batch); 'non_padding': the attention mask's sum "
        "(else tokens != the processor's pad_token_id); summed over ranks in one gather per "
        "step, as stock DDP; logged as num_input_tokens_seen",
        _L + "test_two_process_fields_as_stock_ddp"),
    "log_level": inherited("stock logging setup"),
    "log_level_replica": inherited("stock logging setup"),
    "disable_tqdm": inherited("stock progress bar"),
    "report_to": inherited("stock reporting callbacks"),
    "run_name": inherited("stock reporting callbacks"),
    "project": inherited("stock reporting callbacks"),
    "trackio_space_id": inherited("stock reporting callbacks"),
    "trackio_bucket_id": inherited("stock reporting callbacks"),
    "trackio_static_space_id": inherited("stock reporting callbacks"),
    # ---- evaluation ----
    "eval_strategy": inherited(_EVAL),
    "eval_steps": inherited(_EVAL),
    "eval_delay": inherited(_EVAL),
    "per_device_eval_batch_size": stock(
        "the evaluation microbatch size of every rank; eval_loss is the item (token) mean over "
        "the whole eval set, stock's with one process and batches of equal item counts (stock "
        "averages per-batch means, so its eval_loss changes with this size and, through "
        "padded duplicate samples, with the number of processes)",
        _T + "test_matches_full_batch_reference"),
    "prediction_loss_only": stock("no logits kept", _T + "test_prediction_loss_only_keeps_no_logits"),
    "eval_on_start": inherited(_EVAL),
    "eval_do_concat_batches": refused("predictions are always gathered into one array in "
                                      "dataset order: drop eval_do_concat_batches=False",
                                      refuse_if=lambda v: v is False),
    "eval_use_gather_object": not_applicable("predictions are always gathered as objects (rows of "
                                             "different ranks' lengths)"),
    "eval_accumulation_steps": not_applicable(
        "predictions leave the device microbatch by microbatch already"),
    "include_for_metrics": stock(
        "'inputs': the main input of every sample, gathered in dataset order (padded with "
        "-100); 'loss': each sample gets the mean loss of its evaluation microbatch (stock: of "
        "its evaluation batch, so equal to stock when per_device_eval_batch_size = 1)",
        _L + "test_two_process_fields_as_stock_ddp"),
    "batch_eval_metrics": refused("metrics are computed once over the gathered predictions: "
                                  "drop batch_eval_metrics"),
    # ---- saving ----
    "save_only_model": stock(
        "checkpoints hold what stock's do: the save_model files (streamed; from_pretrained loads "
        "them; a LoRA PeftModel: the adapter) and no optimizer, scheduler, scaler or RNG state; "
        "resuming from one restores the weights (any plan) and the trainer state and restarts "
        "the optimizer and LR schedule, as stock (LoRA: the adapter into the trainable shards)",
        _K + "test_checkpoint_content_matrix"),
    "save_strategy": inherited("stock loop decides when; CephaloTrainer saves"),
    "save_steps": inherited("stock loop decides when; CephaloTrainer saves"),
    "save_on_each_node": refused("only global rank 0 receives the gathered weights: drop "
                                 "save_on_each_node (use a shared file system)"),
    "save_total_limit": inherited("stock rotate_checkpoints in CephaloTrainer._save_checkpoint"),
    "enable_jit_checkpoint": stock(
        "on SIGTERM (after stock's 3 s grace) every rank saves checkpoint-N at the SAME step, "
        "agreed by a one-element all-reduce at each step end, then stops; the checkpoint is "
        "atomic and resumable onto any plan (jit_checkpoint.py)",
        _L + "test_sigterm_saves_resumable_checkpoint"),
    "push_to_hub": inherited(_HUB),
    "hub_token": inherited(_HUB),
    "hub_private_repo": inherited(_HUB),
    "hub_model_id": inherited(_HUB),
    "hub_strategy": inherited(_HUB),
    "hub_always_push": inherited(_HUB),
    "hub_revision": inherited(_HUB),
    "load_best_model_at_end": stock(
        "at train end the best checkpoint's weights are read into the engine's shards (any "
        "plan, each rank its slices), so save_model, evaluate and unshard_model see them; "
        "save_total_limit keeps the best checkpoint, as stock; without a matching eval "
        "strategy: stock's own ValueError",
        _K + "test_load_best_model_at_end_equals_run_stopped_at_best_step"),
    "metric_for_best_model": stock("stock best-checkpoint tracking",
                                   _K + "test_load_best_model_at_end_equals_run_stopped_at_best_step"),
    "greater_is_better": stock("stock best-checkpoint tracking",
                               _K + "test_load_best_model_at_end_equals_run_stopped_at_best_step"),
    "ignore_data_skip": inherited("stock resume data skipping over the weighted loader"),
    "restore_callback_states_from_checkpoint": inherited("stock callback state"),
    # ---- reproducibility / data ----
    "full_determinism": inherited("stock seeding"),
    "seed": stock("seeds the weighted sampler's permutation (same on every rank)",
                  _T + "test_matches_full_batch_reference"),
    "data_seed": inherited("seeds the weighted sampler's permutation instead of seed"),
    "use_cpu": inherited("set automatically without CUDA (MULTI_CPU over gloo)"),
    "accelerator_config": Support(
        status=Status.NOT_APPLICABLE,
        note="CephaloTrainer's loaders are not prepared by Accelerate; split_batches, "
             "dispatch_batches and even_batches=False are refused (the plan splits batches)",
        refuse_if=_accelerator_config_refused),
    "parallelism_config": refused("tensor/context/sequence parallelism is not combined with "
                                  "Cephalo's sharding: drop parallelism_config"),
    "dataloader_drop_last": stock(
        "training: drops the last partial GLOBAL batch; evaluation: keeps the first "
        "floor(N / (world size x per_device_eval_batch_size)) x that many samples, as stock's "
        "sharded evaluation loader does on the same number of processes",
        _L + "test_two_process_fields_as_stock_ddp"),
    "dataloader_num_workers": inherited(
        "workers read this rank's rows ahead inside the weighted loader (its collation and the "
        "per-step width exchange run in the main process); a step read ahead before a live "
        "switch of the split is read again (docs/data.md)"),
    "dataloader_pin_memory": inherited("passed to the weighted DataLoader"),
    "dataloader_persistent_workers": inherited("passed to the weighted DataLoader"),
    "dataloader_prefetch_factor": inherited("passed to the weighted DataLoader"),
    "dataloader_multiprocessing_context": inherited("passed to the weighted DataLoader"),
    "dataloader_in_order": not_applicable(
        "an Accelerate dispatch option; the loaders are not prepared"),
    "remove_unused_columns": inherited("stock column pruning before the weighted loader"),
    "label_names": Support(
        status=Status.STOCK, test=_L + "test_two_process_fields_as_stock_ddp",
        note="the keys evaluation returns as label_ids (a tuple for several names) and keeps "
             "through column pruning; eval loss only when every one is present, as stock; the "
             "training loss still reads 'labels', as the model's forward does. An empty list is "
             "refused: stock then returns the model's loss inside the predictions ((loss, "
             "logits) tuples), which the engine does not reproduce: name the label keys",
        refuse_if=lambda v: v == []),
    "train_sampling_strategy": Support(
        status=Status.STOCK, test=_P + "test_sampling_strategies_as_stock",
        note="random / sequential / group_by_length orders of the GLOBAL batches, split by b_i "
             "(group_by_length: stock's get_length_grouped_indices over a permutation seeded "
             "seed + epoch; stock's LengthGroupedSampler draws it from the global torch RNG, so "
             "its exact order differs, the grouping rule is the same); batch_rebalance is refused (it balances per-rank token counts itself, against the "
             "plan's b_i): use group_by_length",
        refuse_if=lambda v: getattr(v, "value", v) not in ("random", "sequential",
                                                           "group_by_length")),
    "length_column_name": stock("lengths for group_by_length",
                                _P + "test_sampling_strategies_as_stock"),
    # ---- distributed ----
    "ddp_find_unused_parameters": not_applicable(
        "no DDP: the engine reduce-scatters every unit itself"),
    "ddp_bucket_cap_mb": not_applicable("no DDP: one reduce-scatter per unit"),
    "ddp_broadcast_buffers": not_applicable(
        "no DDP; buffers are identical on every rank from the start"),
    "ddp_static_graph": not_applicable("no DDP"),
    "ddp_backend": inherited("the process group backend (gloo / nccl) Accelerate creates"),
    "ddp_timeout": inherited("the process group timeout"),
    "fsdp": refused("Cephalo is the sharding engine: drop fsdp"),
    "fsdp_config": refused("Cephalo is the sharding engine: drop fsdp_config"),
    "deepspeed": refused("Cephalo is the sharding engine: drop deepspeed"),
    "debug": refused("underflow/overflow debugging hooks the model's forward, which the engine "
                     "bypasses: drop debug"),
    "skip_memory_metrics": inherited("stock memory tracker"),
    "do_train": not_applicable("not used by Trainer (scripts read it)"),
    "do_eval": not_applicable("not used by Trainer (scripts read it)"),
    "do_predict": not_applicable("not used by Trainer (scripts read it)"),
    "resume_from_checkpoint": not_applicable("not used by Trainer (scripts pass it to train(); "
                                             f"resuming onto any plan is tested in {_C})"),
    "local_rank": inherited("set by the launcher"),
}
"""``TrainingArguments`` field -> support (see [Note: no silent no-op])."""

HOOK_SUPPORT: dict[str, Support] = {
    "compute_loss_func": stock(
        "called per microbatch as compute_loss_func(outputs, labels, num_items_in_batch) with "
        "outputs.logits and the GLOBAL item count; exact when the loss is a sum over items "
        "divided by num_items_in_batch", _P + "test_compute_loss_func_as_stock"),
    "compute_loss (override)": stock(
        "called per microbatch with a stand-in model that returns the engine's outputs "
        "(logits; loss when labels are passed) and num_items_in_batch = the global count; an "
        "override that calls the model more than once or with other inputs raises ValueError",
        _P + "test_compute_loss_override_as_stock"),
    "model forward (override)": refused(
        "the engine computes the loss itself from the logits (the generic path runs the "
        "transformers class's forward with its layers staged, an adapter runs the layers "
        "directly), so a subclass's own forward (e.g. a custom loss) would be bypassed: move "
        "the loss into compute_loss_func"),
    "compute_metrics": stock("over the gathered predictions", _T + "test_matches_full_batch_reference"),
    "preprocess_logits_for_metrics": stock("per microbatch on the device",
                                           _T + "test_matches_full_batch_reference"),
    "callbacks": inherited("stock callback handler"),
    "data_collator": stock(
        "called on this rank's rows of each global batch, padded to the whole global batch's "
        "width (one small exchange per step), so every row is padded as in one process with "
        "the whole batch, whatever the plan; a collator that cannot be reproduced that way "
        "(checked on the first step) is called once per global batch instead, said once; "
        "--cephalo_collate microbatch pads per microbatch (less padding; the loss then depends "
        "on the plan with left padding or without position_ids); docs/data.md",
        "tests/test_padding.py::test_default_collation_equals_stock_trainer"),
    "optimizers": stock(
        "an optimizer built over the model's parameters before the trainer is re-pointed in "
        "place at this rank's per-parameter shards (same object, class, param groups by "
        "parameter name, hyperparameters), so a scheduler built on it (or stock's, for "
        "(optimizer, None)) stays bound; refused before any collective: a class that cannot "
        "step 1-D shards (LBFGS, Adafactor, ...), an optimizer that already stepped, one over "
        "another model's tensors, a scheduler bound to another optimizer or without one",
        _R + "test_optimizers_as_stock"),
    "optimizer_cls_and_kwargs": stock("the class and kwargs over the shards",
                                      _P + "test_matches_stock_trainer"),
    "_get_train_sampler (override)": refused(
        "the plan's weighted sampler decides which rank gets which sample: use "
        "train_sampling_strategy, or override get_train_dataloader"),
    "model_init": refused("pass the model itself"),
    "train_dataset (IterableDataset)": stock(
        "a stream (torch IterableDataset, datasets streaming=True): every rank reads the same "
        "stream in order and keeps its rows of each global batch of B consecutive rows "
        "(runtime/streaming.py); max_steps is required as stock (unless it has a length); "
        "set_epoch reaches the dataset; a resume reads and skips the consumed global batches; "
        "read in the main process (dataloader_num_workers is not used for it, warned)",
        _R + "test_streamed_dataset_as_stock"),
    "eval_dataset (IterableDataset)": refused(
        "evaluation splits a dataset with a length by the plan's b_i and gathers it in order: "
        "materialize the part you evaluate on (datasets.Dataset.from_generator)"),
}
"""Trainer constructor argument / overridable method -> support."""


def unclassified_fields(field_names) -> list[str]:
    """Names in ``field_names`` missing from ``FIELD_SUPPORT`` (a newer transformers)."""
    return [name for name in field_names if name not in FIELD_SUPPORT]


def _refused_value(support: Support, value: Any, default: Any) -> bool:
    if support.refuse_if is not None:
        return support.refuse_if(value)
    return support.status is Status.REFUSED and _not_default(default)(value)


DOCS = "docs/trainer_support.md"


class RefusedSettings(ValueError):
    """Every setting of a script that CephaloTrainer refuses, in ONE error.

    [Note: one refusal message]
    A stock script usually differs from what CephaloTrainer runs in more than one place (e.g.
    ``gradient_accumulation_steps=2`` and ``load_best_model_at_end=True``). Each launch costs
    tens of seconds before the first refusal, so ``CephaloTrainer.__init__`` collects the
    refusals of the ``TrainingArguments`` fields (``training_args_problems``), the Trainer
    arguments and hooks, the datasets and the model class, and raises them together, before
    any process group, profile or collective exists (preflight.py, ``check_script``).

    ``problems``: one line per refused setting, each naming it, its value and what to do;
    ``who``: the trainer refusing them; ``docs``: the page classifying them. One problem reads
    as before: ``"<problem> (docs/trainer_support.md)"``; several are
    numbered, one per line, under a header giving their count.
    """

    def __init__(self, problems: list[str], *, who: str = "CephaloTrainer",
                 docs: str = DOCS) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = f"{self.problems[0]} ({docs})"
        else:
            message = (f"{who} refuses {len(self.problems)} settings of this script; "
                       f"change all of them ({docs}):\n"
                       + "\n".join(f"  {i}. {p}" for i, p in enumerate(self.problems, 1)))
        super().__init__(message)


def training_args_problems(args) -> list[str]:
    """One message per field whose value CephaloTrainer would not honour (empty: none).

    Fields of a newer transformers that the table does not know are refused when set to a
    non-default value (unknown: they might be ignored). Where ``args`` gives a field its own,
    more specific message (``CephaloTrainingArguments.refused_settings``, e.g. the global batch
    size that replaces ``gradient_accumulation_steps``), that message is used. cephalo_* fields
    are validated by ``CephaloTrainingArguments`` itself.
    """
    from transformers import TrainingArguments

    own = args.refused_settings() if hasattr(args, "refused_settings") else {}
    problems = []
    # a TRL config adds its own fields and their table (``cephalo_field_support``, integrations/trl/support.py)
    table = {**FIELD_SUPPORT, **(args.cephalo_field_support()
                                 if hasattr(args, "cephalo_field_support") else {})}
    config_fields = [f for f in dataclasses.fields(
        type(args) if dataclasses.is_dataclass(args) else TrainingArguments)
        if not f.name.startswith("cephalo_")]
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else
                (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
                for f in config_fields}
    for f in config_fields:
        value = getattr(args, f.name, None)
        default = defaults[f.name]
        support = table.get(f.name)
        if f.name in own:
            problems.append(own[f.name])
        elif support is None:
            if _not_default(default)(value):
                problems.append(f"--{f.name} = {value!r}: this TrainingArguments field is new to "
                                f"hf_cephalo and not yet classified; leave it at its default "
                                f"{default!r}")
        elif support.implies is not None and _refused_value(
                table[support.implies], getattr(args, support.implies, None),
                defaults[support.implies]):
            continue  # the implied field is reported (TrainingArguments set it, or the user)
        elif _refused_value(support, value, default):
            problems.append(f"--{f.name} = {value!r} is not supported by Cephalo: "
                            f"{support.note}")
    return problems


def check_training_args(args) -> None:
    """Raise ``RefusedSettings`` (a ValueError) naming every field whose value CephaloTrainer
    would not honour (``training_args_problems``); runs before any profiling or collective."""
    problems = training_args_problems(args)
    if problems:
        raise RefusedSettings(problems)


def render_markdown() -> str:
    """The tables of docs/trainer_support.md (fields, then hooks)."""
    return "\n".join(markdown_table("TrainingArguments fields", FIELD_SUPPORT)
                     + markdown_table("Trainer hooks and constructor arguments", HOOK_SUPPORT))
