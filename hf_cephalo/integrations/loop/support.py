"""The custom loop's support matrices: every ``torch.utils.data.DataLoader`` argument a user
can set on a loader passed to ``CephaloAccelerator.prepare``, every ``Accelerator.__init__``
argument, every ``DataLoaderConfiguration`` and ``ProjectConfiguration`` field, classified.

The same contract as ``support.py`` ([Note: no silent no-op] there): each argument works as
stock (the prepared loop honours it), runs stock code nothing of ours changes, has no meaning
here, or has values refused at ``prepare`` (``loader_problems`` / ``accelerator_problems``:
ValueError on every rank, before any collective, naming the argument and what to do).
``tests/test_loop_support.py`` fails when the installed torch or accelerate adds an argument
these tables do not classify, and checks that docs/accelerate.md holds the rendered tables
(``render_markdown``, ``render_accelerator_markdown``).
"""

from __future__ import annotations

from typing import Any

from hf_cephalo.integrations.shared import Support, markdown_table
from hf_cephalo.integrations.shared import inherited as _inherited
from hf_cephalo.integrations.shared import not_applicable as _not_applicable
from hf_cephalo.integrations.shared import refused as _refused
from hf_cephalo.integrations.shared import stock as _stock

__all__ = ["LOADER_FIELD_SUPPORT", "ACCELERATOR_FIELD_SUPPORT", "DATALOADER_CONFIG_SUPPORT",
           "PROJECT_CONFIG_SUPPORT", "loader_problems", "unclassified_loader_fields",
           "unclassified_accelerator_fields", "unclassified_dataloader_config_fields",
           "unclassified_project_config_fields", "accelerator_problems", "render_markdown",
           "render_accelerator_markdown"]

_T = "tests/test_accelerate_loop.py::"
_REORDER = ("for an order of your own (weighted, curriculum, length-grouped), reorder or repeat "
            "the dataset itself (torch.utils.data.Subset(dataset, indices)) and pass "
            "shuffle=False")

LOADER_FIELD_SUPPORT: dict[str, Support] = {
    "dataset": _stock("map-style (any length) or a stream (an IterableDataset: B consecutive "
                      "rows per step, read in order by every rank; training loaders only)",
                      _T + "test_streamed_training_set"),
    "batch_size": _stock("the first (training) loader's batch_size x world size x "
                         "gradient_accumulation_steps is the global batch B unless a plan file "
                         "or global_batch_size sets B, cut by the plan's b_i; a scheduler steps "
                         "B / (batch_size x gradient_accumulation_steps) times per optimizer "
                         "step; None (a batch_sampler) is refused",
                         _T + "test_loop_equals_full_batch_reference"),
    "shuffle": _stock("training: stock's order under DataLoaderConfiguration("
                      "use_seedable_sampler=True), a permutation per epoch seeded by data_seed "
                      "(else torch's initial seed at prepare) + epoch, the same on every rank "
                      "and world size (see use_seedable_sampler for the default False); "
                      "evaluation: refused (rows are evaluated and gathered in dataset order)",
                      _T + "test_loop_equals_full_batch_reference"),
    "sampler": _refused("the engine draws each global batch's rows itself; only shuffle's "
                        "RandomSampler (without replacement or num_samples; ordered as "
                        "shuffle=True) and SequentialSampler are accepted; " + _REORDER),
    "batch_sampler": _refused("the plan, not a batch sampler, decides each rank's rows; pass "
                              "batch_size= and shuffle=; " + _REORDER),
    "num_workers": _inherited("passed to the runtime's read-ahead torch DataLoader (its "
                              "workers seeded per rank as stock Trainer seeds them)"),
    "collate_fn": _stock("called on this rank's rows of each global batch (padded to the "
                         "global batch's widest row, so padding does not depend on the plan); "
                         "per-row metadata lists are cut with the rows",
                         _T + "test_gather_for_metrics_every_row_once_in_order"),
    "pin_memory": _inherited("the collated batches are pinned by torch (CUDA)"),
    "drop_last": _stock("training: a last partial global batch is dropped (else split by the "
                        "b_i proportions); evaluation: refused (every row is evaluated once)",
                        "tests/test_sampler.py::test_pure_function_of_epoch_and_seed"),
    "timeout": _refused("the runtime's read-ahead workers wait without a timeout (a failing "
                        "worker fails the step on every rank instead): leave it 0"),
    "worker_init_fn": _refused("the runtime seeds its read-ahead workers itself, per rank, as "
                               "stock Trainer does (transformers' seed_worker: Python, NumPy, "
                               "torch); per-worker setup belongs in the dataset "
                               "(torch.utils.data.get_worker_info()): leave it None"),
    "multiprocessing_context": _inherited("the read-ahead torch DataLoader's workers' start "
                                          "method"),
    "generator": _stock("each epoch's iteration draws the workers' base seed from it, as "
                        "stock; it does not choose the order (stock's seedable sampler reseeds "
                        "it with data_seed, else torch's initial seed, + epoch: shuffle)",
                        _T + "test_save_on_two_ranks_resume_on_three"),
    "prefetch_factor": _inherited("the read-ahead torch DataLoader's per-worker prefetch"),
    "persistent_workers": _inherited("the read-ahead torch DataLoader keeps its workers "
                                     "between epochs"),
    "pin_memory_device": _refused("deprecated by torch; pinning follows the device the "
                                  "engine trains on: leave it unset"),
    "in_order": _refused("in_order=False lets workers hand batches out of order, but each "
                         "step's rows must arrive as that step's: leave it True"),
}
"""Every ``DataLoader.__init__`` argument: how a loader prepared by a custom loop honours it
(the first loader prepared trains; later ones evaluate: they keep ``dataset``, ``batch_size``,
``collate_fn`` and the worker settings, and refuse ``shuffle`` and ``drop_last``)."""


_S = "tests/test_loop_support.py::"
_SHARDING = ("Cephalo is the sharding engine: drop the plugin (accelerate_configs/cephalo.yaml or "
             "cephalo_cpu.yaml)")
_PARALLEL = ("tensor, context or sequence parallelism is not combined with Cephalo's sharding: "
             "drop it")

ACCELERATOR_FIELD_SUPPORT: dict[str, Support] = {
    "device_placement": _refused("False: the engine places every shard and microbatch on the "
                                 "device itself; leave device_placement at True"),
    "split_batches": _inherited("ignored by Accelerate itself since 1.0 (kept in its signature, "
                                "read nowhere): set DataLoaderConfiguration(split_batches=True)"),
    "mixed_precision": _stock("'no' / 'bf16' / 'fp16' (else ACCELERATE_MIXED_PRECISION) is the "
                              "engine's compute precision on every rank unless "
                              "CephaloPlugin(precision=...) sets one per rank; fp16 scales the "
                              "loss with the engine's sharded scaler; 'fp8' is refused",
                              _T + "test_trainer_and_loop_give_the_same_losses"),
    "gradient_accumulation_steps": _stock(
        "folded into the global batch: each prepared training batch is one global batch (of "
        "batch_size x world size x k rows unless a plan file or global_batch_size sets B) and "
        "ends an optimizer step ([Note: the global batch of a custom loop])",
        _T + "test_loop_equals_full_batch_reference"),
    "cpu": _stock("Accelerate's CPU state (gloo, the real world size); the engine trains on "
                  "the CPU; set automatically where CUDA is absent ([Note: CPU workers under "
                  "accelerate launch])", "tests/test_accelerate_launch.py::"
                  "test_single_machine_cpu_config"),
    "dataloader_config": _inherited("stored by stock; each field: the DataLoaderConfiguration "
                                    "table"),
    "deepspeed_plugin": _refused(_SHARDING),
    "fsdp_plugin": _refused(_SHARDING),
    "torch_tp_plugin": _refused(_PARALLEL),
    "megatron_lm_plugin": _refused(_SHARDING),
    "rng_types": _refused("any value but stock's default ['generator'] (accepted): the "
                          "engine's loaders draw each epoch's permutation from a seed that is "
                          "the same on every rank and do not synchronize other generators at "
                          "each epoch; leave rng_types unset"),
    "log_with": _inherited("trackers: init_trackers, log and end_training are stock's"),
    "project_dir": _inherited("stock stores it as ProjectConfiguration(project_dir=...): see "
                              "that table"),
    "project_config": _inherited("stored by stock; each field: the ProjectConfiguration table"),
    "gradient_accumulation_plugin": _stock(
        "num_steps as gradient_accumulation_steps (stock builds this plugin from it); every "
        "prepared batch ends an optimizer step, so adjust_scheduler and sync_each_batch change "
        "nothing (no batch skips its sync); sync_with_dataloader=False is refused (an epoch's "
        "last batch always ends its step): leave it True",
        _T + "test_loop_equals_full_batch_reference"),
    "step_scheduler_with_optimizer": _inherited("read by Accelerate's prepare_scheduler; False "
                                                "steps the scheduler at every call, in stock's "
                                                "AcceleratedScheduler code"),
    "kwargs_handlers": _stock(
        "GradScalerKwargs: the engine's sharded loss scaler (fp16); InitProcessGroupKwargs, "
        "ProfileKwargs: stock's process group and profiler; DistributedDataParallelKwargs: no "
        "DDP wrapper (one reduce-scatter per unit), so its bucket, buffer and unused-parameter "
        "settings have no effect, and a comm_hook / comm_wrapper is refused; AutocastKwargs "
        "with a field set: refused (the engine's own autocast; precision per rank: "
        "CephaloPlugin(precision=...)); fp8 recipe handlers: refused with fp8",
        _T + "test_refusals_on_every_rank"),
    "dynamo_backend": _stock("each layer unit is compiled with this backend (and "
                             "ACCELERATE_DYNAMO_MODE), as the Trainer door's torch_compile "
                             "(tests/test_compile_trainer.py)",
                             _S + "test_job_follows_the_accelerator_settings"),
    "dynamo_plugin": _stock("backend and mode as dynamo_backend; with a backend, fullgraph, "
                            "dynamic, options, use_regional_compilation and disable=True are "
                            "refused (the engine compiles each unit with backend and mode "
                            "only; to train uncompiled leave the backend at 'no')",
                            _S + "test_job_follows_the_accelerator_settings"),
    "deepspeed_plugins": _refused(_SHARDING),
    "parallelism_config": _refused(_PARALLEL),
}
"""Every ``Accelerator.__init__`` argument (Accelerate 1.10.1 up to the installed one): how a
``CephaloAccelerator`` running a custom loop honours it. Refused values raise ValueError at
``prepare``, on every rank before any collective (``check_loop_setup``: DeepSpeed / FSDP /
Megatron, fp8, ``dispatch_batches``; ``accelerator_problems``: the rest)."""

DATALOADER_CONFIG_SUPPORT: dict[str, Support] = {
    "split_batches": _stock("batch_size is the batch of all processes together: B = batch_size "
                            "x gradient_accumulation_steps (unless a plan file or "
                            "global_batch_size sets B), and schedulers step once per optimizer "
                            "step at that B, as stock (B / (batch_size x "
                            "gradient_accumulation_steps) times in general)",
                            _S + "test_job_follows_the_accelerator_settings"),
    "dispatch_batches": _refused("True: each rank reads its own rows of every global batch (a "
                                 "stream is read in order by every rank); drop dispatch_batches "
                                 "(None, stock's default, is accepted)"),
    "even_batches": _not_applicable(
        "the engine never pads or repeats rows: a last partial global batch is split by the "
        "plan's b_i (training; dropped with drop_last=True) and evaluation yields every row "
        "once; unlike stock's even_batches=True, no rows from the start fill a short last batch"),
    "use_seedable_sampler": _stock(
        "True: stock's order (a permutation of data_seed, else torch's initial seed, + epoch). "
        "False, stock's default: the same order, and prepare warns once, because stock's "
        "False order (drawn each epoch from the global RNG on one process, from a generator "
        "seeded once at prepare on several) changes with the world size and is not repeated by "
        "a resume; pass True to silence it and to compare with a stock run",
        _S + "test_training_order_is_stock_seedable_samplers"),
    "data_seed": _stock("seeds the training order (use_seedable_sampler's seed), rank 0's "
                        "value, with either use_seedable_sampler (stock reads it only with "
                        "True)", _S + "test_training_order_is_stock_seedable_samplers"),
    "non_blocking": _not_applicable("the engine copies each microbatch to the device itself"),
    "use_stateful_dataloader": _stock(
        "load_state restores the training loader's position: its next iteration continues the "
        "saved epoch after the batches done (without it: from the epoch's start, and "
        "skip_first_batches skips the batches done, as stock)",
        _S + "test_load_state_restores_loader_positions"),
}
"""Every ``accelerate.DataLoaderConfiguration`` field: how a custom loop honours it."""

PROJECT_CONFIG_SUPPORT: dict[str, Support] = {
    "project_dir": _stock("the engine's plan, profile, progress and report files go there "
                          "(none without it, as stock writes nothing); automatic checkpoints "
                          "go under its checkpoints/", _T + "test_without_project_dir_nothing_"
                          "is_written"),
    "logging_dir": _inherited("the trackers' folder (stock)"),
    "automatic_checkpoint_naming": _stock(
        "save_state() writes project_dir/checkpoints/checkpoint_<iteration> and counts up; "
        "load_state() reads the newest complete one. An output_dir given to save_state is "
        "used as given (stock ignores it under automatic naming)",
        _S + "test_automatic_checkpoint_names"),
    "total_limit": _refused("save_state does not rotate Cephalo checkpoints: drop total_limit "
                            "and remove old checkpoint folders yourself"),
    "iteration": _stock("the number of the next automatic checkpoint folder, as stock",
                        _S + "test_automatic_checkpoint_names"),
    "save_on_each_node": _refused("the checkpoint is one folder on a file system every rank "
                                  "shares (each rank writes its shards, rank 0 the rest): use a "
                                  "shared file system and leave save_on_each_node False"),
}
"""Every ``accelerate.utils.ProjectConfiguration`` field: how a custom loop honours it."""


def loader_problems(loader: Any, training: bool) -> list[str]:
    """Why ``loader`` cannot be prepared as given (empty: it can): the refused arguments of
    ``LOADER_FIELD_SUPPORT`` with non-default values, a sampler the engine would replace, and
    an evaluation loader's ``shuffle`` / ``drop_last``. Needs no process group."""
    from torch.utils.data import RandomSampler, SequentialSampler

    from hf_cephalo.runtime import is_stream

    problems = []
    if loader.batch_size is None:
        given = "" if loader.batch_sampler is None else \
            f" (batch_sampler={type(loader.batch_sampler).__name__})"
        problems.append(
            "a prepared DataLoader needs a batch_size: the global batch is batch_size x world "
            "size rows, cut by the plan's b_i, so the plan, not a batch sampler, decides each "
            f"rank's rows; got batch_size=None{given} over {type(loader.dataset).__name__}. "
            "Pass batch_size= and shuffle= instead; " + _REORDER)
    if loader.timeout:
        problems.append(f"DataLoader(timeout={loader.timeout}): "
                        + LOADER_FIELD_SUPPORT["timeout"].note)
    if loader.worker_init_fn is not None:
        problems.append("DataLoader(worker_init_fn=...): "
                        + LOADER_FIELD_SUPPORT["worker_init_fn"].note)
    if getattr(loader, "pin_memory_device", ""):
        problems.append(f"DataLoader(pin_memory_device={loader.pin_memory_device!r}): "
                        + LOADER_FIELD_SUPPORT["pin_memory_device"].note)
    if getattr(loader, "in_order", True) is False:
        problems.append("DataLoader(in_order=False): " + LOADER_FIELD_SUPPORT["in_order"].note)
    if is_stream(loader.dataset):
        if not training:
            problems.append(
                f"an evaluation DataLoader over a stream ({type(loader.dataset).__name__}): "
                "evaluation splits a dataset with a length by the plan's b_i and gathers it in "
                "order; materialize the part you evaluate on (datasets.Dataset.from_generator, "
                "or list(stream))")
        return problems
    sampler = loader.sampler
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            problems.append(
                f"DataLoader(sampler=RandomSampler(replacement={sampler.replacement}, "
                f"num_samples={sampler._num_samples})): the engine shuffles each epoch as a "
                "permutation of the whole dataset (shuffle=True); " + _REORDER)
        elif not training:
            problems.append("an evaluation DataLoader with shuffle=True: evaluation reads the "
                            "dataset in order, split by the plan's b_i, and gather_for_metrics "
                            "returns rows in dataset order; pass shuffle=False")
    elif type(sampler) is not SequentialSampler and loader.batch_size is not None:
        problems.append(
            f"DataLoader(sampler={type(sampler).__name__}(...)): the engine draws each global "
            "batch's rows itself (shuffle=True: a permutation per epoch, seeded as Accelerate "
            "seeds it; shuffle=False: dataset order) and splits them by the plan's b_i, so a "
            "sampler would be replaced; " + _REORDER)
    if not training and loader.drop_last:
        problems.append("an evaluation DataLoader with drop_last=True: evaluation runs every "
                        "row once (split by the plan's b_i, no partial batch to drop); pass "
                        "drop_last=False")
    return problems


def _dynamo_problems(dynamo: Any) -> list[str]:
    """A ``TorchDynamoPlugin`` with a backend and fields the engine's per-unit compile does not
    take (``accelerator_problems``)."""
    if str(getattr(dynamo.backend, "value", dynamo.backend)).upper() == "NO":
        return []
    problems = []
    extra = {k: getattr(dynamo, k) for k in ("fullgraph", "dynamic", "options",
                                             "use_regional_compilation")
             if getattr(dynamo, k, None) not in (None, False)}
    if extra:
        problems.append(f"TorchDynamoPlugin({', '.join(f'{k}={v!r}' for k, v in extra.items())}): "
                        "the engine compiles each layer unit with the backend and mode only "
                        "(regional by construction); drop these fields")
    if getattr(dynamo, "disable", False):
        problems.append("TorchDynamoPlugin(disable=True) with a backend: the engine compiles "
                        "each layer unit whenever a backend is set; to train uncompiled, leave "
                        "the backend at 'no' (no dynamo_backend, no ACCELERATE_DYNAMO_BACKEND)")
    return problems


def accelerator_problems(accelerator: Any) -> list[str]:
    """``Accelerator`` settings a custom loop on the engine would otherwise drop without a
    word (empty: none), each with what to do. Read from the constructed accelerator, so every
    rank answers the same; needs no collective. (DeepSpeed / FSDP / Megatron, fp8 and
    ``dispatch_batches`` are refused by ``loop_prepare.check_loop_setup`` itself;
    ``GradScalerKwargs`` are honoured: the engine's sharded loss scaler takes them. Every
    argument: ``ACCELERATOR_FIELD_SUPPORT`` and the tables after it.)"""
    import os

    problems = []
    for env, name in (("ACCELERATE_USE_DEEPSPEED", "deepspeed_plugin"),
                      ("ACCELERATE_USE_FSDP", "fsdp_plugin"),
                      ("ACCELERATE_USE_MEGATRON_LM", "megatron_lm_plugin")):
        # Accelerate sets these for a given plugin (or a launch config) and then ignores the
        # plugin where it runs on the CPU: refused on every device, as on CUDA
        if os.environ.get(env, "false").lower() == "true":
            problems.append(f"Accelerator({name}=...) / {env}=true: "
                            + ACCELERATOR_FIELD_SUPPORT[name].note)
    if accelerator.device_placement is False:
        problems.append("Accelerator(device_placement=False): the engine places every shard "
                        "and microbatch on the device itself; leave device_placement at True")
    if getattr(accelerator, "parallelism_config", None) is not None:
        problems.append("Accelerator(parallelism_config=... / torch_tp_plugin=...): tensor, "
                        "context or sequence parallelism is not combined with Cephalo's "
                        "sharding; drop it")
    problems += _dynamo_problems(accelerator.state.dynamo_plugin)
    ddp = getattr(accelerator, "ddp_handler", None)
    hooks = {k: getattr(ddp, k, None) for k in ("comm_hook", "comm_wrapper")}
    hooks = {k: str(getattr(v, "value", v)) for k, v in hooks.items()
             if str(getattr(v, "value", v)).lower() not in ("none", "no")}
    if hooks:
        given = ", ".join(f"{k}={v!r}" for k, v in hooks.items())
        problems.append(f"DistributedDataParallelKwargs({given}): the engine has no DDP "
                        "wrapper to hook (it reduce-scatters each unit's gradients in the "
                        "training precision); drop the hook")
    if getattr(accelerator.gradient_state, "sync_with_dataloader", True) is False:
        problems.append("GradientAccumulationPlugin(sync_with_dataloader=False): each batch of "
                        "a prepared training loader is one whole global batch, so an epoch's "
                        "last batch always ends its optimizer step; leave sync_with_dataloader "
                        "True")
    autocast = getattr(accelerator, "autocast_handler", None)
    if autocast is not None and autocast.to_kwargs():
        problems.append(f"AutocastKwargs({autocast.to_kwargs()}): the engine runs its own "
                        "autocast per rank (precision per rank: CephaloPlugin(precision=...)); "
                        "drop the handler")
    limit = getattr(accelerator.project_configuration, "total_limit", None)
    if limit is not None:
        problems.append(f"ProjectConfiguration(total_limit={limit}): save_state does not "
                        "rotate Cephalo checkpoints; drop total_limit and remove old "
                        "checkpoint folders yourself")
    if getattr(accelerator.project_configuration, "save_on_each_node", False):
        problems.append("ProjectConfiguration(save_on_each_node=True): "
                        + PROJECT_CONFIG_SUPPORT["save_on_each_node"].note)
    rng = list(getattr(accelerator, "rng_types", None) or ["generator"])
    if rng != ["generator"]:
        problems.append(f"Accelerator(rng_types={rng}): the engine's loaders draw each epoch's "
                        "permutation from a seed that is the same on every rank and do not "
                        "synchronize other generators at each epoch; leave rng_types unset")
    return problems


def unclassified_loader_fields() -> list[str]:
    """``DataLoader.__init__`` arguments of the installed torch that the table misses."""
    import inspect

    from torch.utils.data import DataLoader

    names = [n for n in inspect.signature(DataLoader.__init__).parameters if n != "self"]
    return [n for n in names if n not in LOADER_FIELD_SUPPORT]


def _unclassified(names, table: dict[str, Support]) -> list[str]:
    return [n for n in names if n != "self" and n not in table]


def unclassified_accelerator_fields() -> list[str]:
    """``Accelerator.__init__`` arguments of the installed accelerate that the table misses."""
    import inspect

    from accelerate import Accelerator

    return _unclassified(inspect.signature(Accelerator.__init__).parameters,
                         ACCELERATOR_FIELD_SUPPORT)


def unclassified_dataloader_config_fields() -> list[str]:
    """``DataLoaderConfiguration`` fields of the installed accelerate that the table misses."""
    import dataclasses

    from accelerate import DataLoaderConfiguration

    return _unclassified([f.name for f in dataclasses.fields(DataLoaderConfiguration)],
                         DATALOADER_CONFIG_SUPPORT)


def unclassified_project_config_fields() -> list[str]:
    """``ProjectConfiguration`` fields of the installed accelerate that the table misses."""
    import dataclasses

    from accelerate.utils import ProjectConfiguration

    return _unclassified([f.name for f in dataclasses.fields(ProjectConfiguration)],
                         PROJECT_CONFIG_SUPPORT)


def render_markdown() -> str:
    """The DataLoader table of docs/accelerate.md."""
    return "\n".join(markdown_table("DataLoader arguments (custom loops)",
                                    LOADER_FIELD_SUPPORT, 3))


def render_accelerator_markdown() -> str:
    """The Accelerator, DataLoaderConfiguration and ProjectConfiguration tables of
    docs/accelerate.md."""
    return "\n".join(markdown_table("Accelerator arguments (custom loops)",
                                    ACCELERATOR_FIELD_SUPPORT, 3)
                     + markdown_table("DataLoaderConfiguration fields (custom loops)",
                                      DATALOADER_CONFIG_SUPPORT, 3)
                     + markdown_table("ProjectConfiguration fields (custom loops)",
                                      PROJECT_CONFIG_SUPPORT, 3))
