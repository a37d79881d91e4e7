"""``CephaloAccelerator.prepare`` for a custom loop: the job from the Accelerator, the session,
and the loop's model, optimizer and loaders (docs/accelerate.md "Your own training loop").

[Note: the global batch of a custom loop]
B = the training loader's ``batch_size`` x world size x ``gradient_accumulation_steps`` (with
``split_batches``: ``batch_size`` x ``gradient_accumulation_steps``), what the optimizer sees
per step under stock DDP; ``CephaloPlugin(global_batch_size=...)`` or a plan file fixes it
instead (required for elastic resumes onto another world). Each batch of the prepared training
loader is this rank's share of ONE global batch: with ``gradient_accumulation_steps = k`` the k
per-process batches stock would draw are one batch here (the engine accumulates their
microbatches in one layered pass), ``accumulate()`` syncs every batch, ``backward`` does not
divide by k, and the loader has 1/k as many batches; the LR scheduler steps once per
unprepared-loader batch a global batch replaces (``scheduler_steps``: stock's ``num_processes``,
or 1 under ``split_batches``, at stock's B), so the schedule a script computed from its
unprepared loader keeps its length.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, RandomSampler

from hf_cephalo.integrations.loop.loop import CephaloDataLoader, CephaloModel, CephaloOptimizer, LoopState

__all__ = ["prepare_loop", "job_from_accelerator", "gather_rows", "holds_only_tensors",
           "check_clip_parameters", "checkpoint_dir", "resume_dir"]

logger = logging.getLogger(__name__)

def check_loop_setup(accelerator, args) -> None:
    """Refusals of a custom loop's setup, on every rank before any collective (ValueError):
    a second model, an optimizer or loader prepared before the model, DeepSpeed / FSDP / fp8
    beside Cephalo, dispatched batches, then in one message every Accelerator setting and
    DataLoader argument the loop would drop (``loop_support.accelerator_problems`` /
    ``loader_problems``: a batch sampler, a sampler the engine would replace, an evaluation
    loader that shuffles, drops its last batch or reads a stream, ...)."""
    from accelerate.utils import DistributedType

    models = [a for a in args if isinstance(a, nn.Module) and not isinstance(a, CephaloModel)]
    if len(models) > 1 or (models and accelerator.cephalo_loop is not None):
        raise ValueError("CephaloAccelerator trains ONE model: prepare() got a second one (a "
                         "teacher or reference model?); keep it outside prepare() (it runs as "
                         "an ordinary module), or train each model in its own run")
    # a loader / optimizer prepared BEFORE the model went through stock prepare (the engine did
    # not exist): a loader the plan never splits, an optimizer over the unsharded parameters
    early = [type(o).__name__ for o in [*accelerator._dataloaders, *accelerator._optimizers]
             if not isinstance(o, (CephaloDataLoader, CephaloOptimizer))]
    if accelerator.cephalo_loop is None and models and early:
        raise ValueError(f"prepare() got the model after {', '.join(early)}: those were prepared "
                         "as stock Accelerate prepares them (not split by the plan's b_i, not "
                         "re-pointed at the shards); prepare the model first, or in the same "
                         "call as its optimizer and loaders")
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP,
                                        DistributedType.MEGATRON_LM):
        raise ValueError(f"CephaloAccelerator with distributed_type "
                         f"{accelerator.distributed_type}: Cephalo is the sharding engine; use "
                         "accelerate_configs/cephalo.yaml (or cephalo_cpu.yaml) without a "
                         "DeepSpeed / FSDP plugin")
    if accelerator.mixed_precision not in ("no", "bf16", "fp16"):
        raise ValueError(f"mixed_precision={accelerator.mixed_precision!r}: Cephalo trains in "
                         "fp32, bf16 or fp16 (per rank: CephaloPlugin(precision=...))")
    if getattr(accelerator.dataloader_config, "dispatch_batches", None):
        raise ValueError("DataLoaderConfiguration(dispatch_batches=True): each rank reads its "
                         "own rows of every global batch; drop dispatch_batches")
    from hf_cephalo.integrations.loop.support import accelerator_problems, loader_problems

    problems = accelerator_problems(accelerator)
    training = not accelerator.cephalo_loaders  # the first loader prepared trains
    for loader in (a for a in args if isinstance(a, DataLoader)):
        problems += loader_problems(loader, training)
        training = False
    if problems:
        raise ValueError(problems[0] if len(problems) == 1 else
                         f"CephaloAccelerator.prepare refuses {len(problems)} settings:\n" +
                         "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1)))


def _broadcast_seed(accelerator) -> int:
    """The training order's seed, as stock's ``SeedableRandomSampler`` takes it at prepare:
    ``DataLoaderConfiguration(data_seed=...)``, else torch's initial seed
    (``accelerate.utils.set_seed``); rank 0's value, broadcast."""
    from accelerate.utils import broadcast_object_list

    data_seed = getattr(accelerator.dataloader_config, "data_seed", None)
    seed = [int(data_seed if data_seed is not None else torch.initial_seed()) % (2 ** 63)]
    if accelerator.num_processes > 1:
        broadcast_object_list(seed, from_process=0)
    return seed[0]


def _say_training_order(accelerator, train: DataLoader | None) -> None:
    """A shuffled training loader without ``use_seedable_sampler=True``: say once that the
    order is the seedable sampler's (stock's default order cannot be kept: docs/accelerate.md,
    the DataLoaderConfiguration table)."""
    if train is None or not isinstance(train.sampler, RandomSampler) or \
            accelerator.dataloader_config.use_seedable_sampler or not accelerator.is_main_process:
        return
    logger.warning("the training loader is read in stock Accelerate's order under "
                   "DataLoaderConfiguration(use_seedable_sampler=True): a permutation of "
                   "data_seed (else torch's initial seed) + epoch, the same on every world size "
                   "and across resumes. Stock's default order (use_seedable_sampler=False) is "
                   "drawn from the global RNG or a generator each epoch and changes with the "
                   "world size, so it is not kept; pass "
                   "Accelerator(dataloader_config=DataLoaderConfiguration("
                   "use_seedable_sampler=True)) to silence this")


def job_from_accelerator(accelerator, train_loader: DataLoader | None, seed: int):
    """The runtime's ``Job`` of a custom loop ([Note: the global batch of a custom loop]).

    Raises ValueError: no training loader and no global batch size (or plan file) to plan
    for; the plugin's global batch size disagrees with the plan file's."""
    from accelerate.utils import DynamoBackend

    from hf_cephalo.runtime import (CompileOptions, Job, JobPrecision, LoaderOptions, Plan,
                                    resolve_global_batch_size)

    settings = accelerator.cephalo_plugin
    plan = Plan.load(settings.plan_file) if settings.plan_file is not None else None
    if train_loader is None and settings.global_batch_size is None and plan is None:
        raise ValueError("prepare(model) without a training DataLoader: give the training "
                         "loader in the same prepare() call (its batch size sets the global "
                         "batch), or CephaloPlugin(global_batch_size=...) / a plan file")
    ga = accelerator.gradient_accumulation_steps
    per_process = 0 if train_loader is None else train_loader.batch_size
    stock = per_process * ga * (1 if accelerator.split_batches else accelerator.num_processes)
    global_batch_size, given = resolve_global_batch_size(
        settings, stock, plan, f"the plan {settings.plan_file!r}")
    dynamo = accelerator.state.dynamo_plugin
    compile_options = None if dynamo.backend == DynamoBackend.NO else \
        CompileOptions(backend=dynamo.backend.value.lower(), mode=dynamo.mode)
    loader = LoaderOptions() if train_loader is None else LoaderOptions(
        num_workers=train_loader.num_workers, pin_memory=train_loader.pin_memory,
        persistent_workers=train_loader.persistent_workers,
        prefetch_factor=train_loader.prefetch_factor,
        multiprocessing_context=train_loader.multiprocessing_context)
    compute = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}[accelerator.mixed_precision]
    return Job(settings=settings, world_size=accelerator.num_processes,
               rank=accelerator.process_index, device=accelerator.device,
               output_dir=accelerator.project_dir, seed=seed, data_seed=seed,
               global_batch_size=global_batch_size, global_batch_size_given=given,
               precision=JobPrecision.resolve(compute, settings), compile=compile_options,
               loader=loader, activation_checkpointing_given=settings.was_given(
                   "activation_checkpointing"), file_plan=plan)


def _output_class(staged):
    """The output type the model's own forward returns, called as ``cls(loss=, logits=)``: a
    causal LM's, a token head's, a masked LM's, a question-answering model's (its stacked
    logits (m, S, 2) split into ``start_logits`` / ``end_logits``), else a classifier's."""
    from transformers import modeling_outputs as outputs

    from hf_cephalo.runtime import is_causal_lm

    if is_causal_lm(staged):
        return outputs.CausalLMOutputWithPast
    split = tuple(getattr(staged, "prediction_outputs", None) or ())
    if split:
        return functools.partial(_split_output, outputs.QuestionAnsweringModelOutput, split)
    kind = type(staged.model).__name__.rpartition("For")[2]
    return {"MaskedLM": outputs.MaskedLMOutput,
            "TokenClassification": outputs.TokenClassifierOutput}.get(
        kind, outputs.SequenceClassifierOutput)


def _split_output(cls, names: tuple[str, ...], loss, logits):
    """``cls(loss=loss, name_j=logits[..., j])``: a head whose logits stack several outputs."""
    return cls(loss=loss, **{name: logits[..., j] for j, name in enumerate(names)})


def prepare_loop(accelerator, args: tuple) -> tuple:
    """The custom loop's prepare (see ``CephaloAccelerator.prepare``)."""
    from hf_cephalo.runtime import Session, parameter_names, stage_model

    check_loop_setup(accelerator, args)
    results = list(args)
    model_index = next((i for i, a in enumerate(args) if isinstance(a, nn.Module)
                        and not isinstance(a, CephaloModel)), None)
    loaders = [a for a in args if isinstance(a, DataLoader)]
    if model_index is not None:
        model = args[model_index]
        staged = stage_model(model, seq2seq=True)  # unsupported: ValueError before any collective
        train = loaders[0] if loaders else None
        name_of = parameter_names(model)  # before the engine
        _check_optimizers(args, name_of)  # before the session's first collective
        job = job_from_accelerator(accelerator, train, seed=0)
        if train is not None and any(isinstance(a, LRScheduler) for a in args):
            # a fractional count is refused here, before any collective (and at the
            # scheduler's own prepare when it comes in a later call)
            _scheduler_steps(job.global_batch_size, train, accelerator)
        seed = _broadcast_seed(accelerator)  # the first collective
        job = dataclasses.replace(job, seed=seed, data_seed=seed)
        session = Session(job, staged, model=model,
                          train_dataset=None if train is None else train.dataset)
        accelerator.cephalo_loop = LoopState(session, _output_class(staged))
        accelerator._cephalo_name_of = name_of
        if accelerator.scaler_handler is not None:
            # GradScalerKwargs(init_scale=..., growth_interval=...): the engine's scaler takes them
            session.set_scaler_options(**accelerator.scaler_handler.to_kwargs())
        if session.scaler is not None:  # fp16: the engine's sharded scaler for every rank
            accelerator.scaler, accelerator.native_amp = session.scaler, True
        results[model_index] = CephaloModel(session, accelerator.cephalo_loop)
        accelerator._models.append(results[model_index])
        _say_gradient_accumulation(accelerator, job)
    loop = accelerator.cephalo_loop
    for i, obj in enumerate(args):
        if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, CephaloOptimizer):
            loop.session.repoint_optimizer(obj, accelerator._cephalo_name_of,
                                           "accelerator.prepare(optimizer)")
            loop.session.set_optimizer(obj)
            results[i] = CephaloOptimizer(obj, loop, scaler=accelerator.scaler)
            accelerator._optimizers.append(results[i])
        elif isinstance(obj, DataLoader):
            results[i] = _prepare_loader(accelerator, obj)
    for i, obj in enumerate(results):
        if isinstance(obj, LRScheduler):
            results[i] = _prepare_scheduler(accelerator, obj)
    return results[0] if len(results) == 1 else tuple(results)


def scheduler_steps(global_batch_size: int, train_loader: DataLoader | None,
                    accelerator) -> int | None:
    """How many times a prepared scheduler steps per optimizer step ([Note: the LR schedule
    across world sizes] in ``loop.py``): the number of the unprepared training loader's
    batches one global batch replaces, B / (batch_size x gradient_accumulation_steps). At
    stock's global batch that is stock's count (``num_processes``; 1 with ``split_batches``),
    and it does not change with the world size. Without a training loader: stock's count.
    None when B is not a whole number of loader batches."""
    stock = 1 if accelerator.split_batches else accelerator.num_processes
    if train_loader is None or not train_loader.batch_size:
        return stock
    per_step = train_loader.batch_size * accelerator.gradient_accumulation_steps
    return global_batch_size // per_step if global_batch_size % per_step == 0 else None


def _scheduler_steps(global_batch_size: int, train_loader, accelerator) -> int:
    """``scheduler_steps``, or ValueError naming the numbers and the fixes."""
    steps = scheduler_steps(global_batch_size, train_loader, accelerator)
    if steps is not None:
        return steps
    bs, ga = train_loader.batch_size, accelerator.gradient_accumulation_steps
    fits = [d for d in range(1, global_batch_size + 1) if global_batch_size % (d * ga) == 0]
    other = (f"or a loader batch_size with batch_size x {ga} dividing {global_batch_size} "
             f"({', '.join(map(str, fits[:6]))}{', ...' if len(fits) > 6 else ''})" if fits else
             f"(no loader batch_size can do: gradient_accumulation_steps {ga} does not divide "
             f"{global_batch_size})")
    raise ValueError(
        f"global batch size {global_batch_size} is not a whole number of the training loader's "
        f"batches (batch_size {bs} x gradient_accumulation_steps {ga} = {bs * ga} samples): the "
        "prepared scheduler steps once per loader batch a global batch replaces (stock "
        "Accelerate: num_processes times per optimizer step), so a schedule sized from the "
        "loader keeps its length, and here that count is not whole. Make the global batch size "
        f"(the plan file's, or CephaloPlugin(global_batch_size=...)) a multiple of {bs * ga}, "
        f"{other}")


def _prepare_scheduler(accelerator, scheduler):
    """Accelerate's ``prepare_scheduler`` (its optimizer matching, ``step_with_optimizer``,
    ``split_batches``), as a ``CephaloScheduler`` stepped ``scheduler_steps`` times per
    optimizer step until a checkpoint says otherwise ([Note: the LR schedule across world
    sizes] in ``loop.py``).

    Raises ValueError: the global batch is not a whole number of training-loader batches."""
    from hf_cephalo.integrations.loop.loop import CephaloScheduler

    loop = getattr(accelerator, "cephalo_loop", None)
    if loop is None:  # no model prepared yet: no global batch, stock's count
        steps = scheduler_steps(0, None, accelerator)
    else:  # the training loader came with the model or in an earlier call (else stock's count)
        train = accelerator.cephalo_loaders[0] if accelerator.cephalo_loaders else None
        steps = _scheduler_steps(loop.session.job.global_batch_size, train, accelerator)
    stock = accelerator.prepare_scheduler(scheduler)
    ours = CephaloScheduler(
        stock.scheduler, stock.optimizers, step_with_optimizer=stock.step_with_optimizer,
        split_batches=stock.split_batches, steps_per_optimizer_step=steps)
    accelerator._schedulers[accelerator._schedulers.index(stock)] = ours
    return ours


def _check_optimizers(args: tuple, name_of: dict[int, str]) -> None:
    """Refuse an optimizer prepared with the model that cannot be re-pointed at its shards
    (``runtime.optim.repoint_problems``), on every rank alike, before any collective."""
    from hf_cephalo.runtime import repoint_problems

    for obj in args:
        if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, CephaloOptimizer):
            problems = repoint_problems(obj, name_of, "accelerator.prepare(optimizer)")
            if problems:
                raise ValueError(problems[0])


def _say_gradient_accumulation(accelerator, job) -> None:
    ga = accelerator.gradient_accumulation_steps
    if ga > 1 and job.is_main:
        logger.warning("gradient_accumulation_steps=%d: each batch of the prepared training "
                       "loader is one global batch of %d samples (the engine accumulates its "
                       "microbatches in one layered pass), so the loop body runs once per "
                       "optimizer step and the loader has 1/%d as many batches (docs/"
                       "accelerate.md, [Note: the global batch of a custom loop])", ga,
                       job.global_batch_size, ga)


def _prepare_loader(accelerator, loader: DataLoader) -> CephaloDataLoader:
    """The training loader (the first one prepared) or an evaluation loader, over the same
    dataset and collator (see ``CephaloDataLoader``)."""
    session = accelerator.cephalo_loop.session
    training = not accelerator.cephalo_loaders
    collate = loader.collate_fn
    if training:
        _say_training_order(accelerator, loader)
        inner = session.train_loader(loader.dataset, collate,
                                     shuffle=isinstance(loader.sampler, RandomSampler),
                                     drop_last=loader.drop_last, whole_batches=True)
    else:
        inner = session.eval_loader(loader.dataset, collate, microbatch_size=None,
                                    options=_options_of(loader))
    # as stock Accelerate's prepared loader keeps the user's generator: each epoch's iter()
    # draws the loader's base seed from it, not from the global RNG (which a resume restores
    # with load_state just before that iter(): dropout after a resume as in the run it resumes)
    inner.generator = loader.generator
    empty = _EmptyBatch(loader.dataset, collate)
    prepared = CephaloDataLoader(inner, accelerator.cephalo_loop, training=training,
                                 empty_batch=empty, microbatch_size=loader.batch_size,
                                 batch_size=loader.batch_size, device=accelerator.device,
                                 dataset=loader.dataset)
    accelerator.cephalo_loaders.append(prepared)
    accelerator._dataloaders.append(prepared)
    return prepared


def _options_of(loader: DataLoader):
    from hf_cephalo.runtime import LoaderOptions

    return LoaderOptions(num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                         persistent_workers=loader.persistent_workers,
                         prefetch_factor=loader.prefetch_factor,
                         multiprocessing_context=loader.multiprocessing_context)


class _EmptyBatch:
    """The batch of a rank with no rows in a step: the keys and trailing shapes of a collated
    sample, with 0 rows (tensors and per-row fields, ``sampler.cut_rows``). The sample is
    collated once (the dataset's first); each call returns a NEW batch object, so a loop that
    edits its batch (``batch.pop("idx")``) finds the same batch at the next idle step."""

    def __init__(self, dataset, collate) -> None:
        self.dataset, self.collate, self._one = dataset, collate, None

    def __call__(self):
        from hf_cephalo.runtime import cut_rows

        if self._one is None:
            from hf_cephalo.runtime import is_stream

            first = next(iter(self.dataset)) if is_stream(self.dataset) else self.dataset[0]
            self._one = self.collate([first])  # the collator's own type (BatchEncoding...)
        return cut_rows(self._one, 0, 0, 1, strict=False)


# ---- collectives over this rank's rows ---------------------------------------------------------
def holds_only_tensors(data: Any) -> bool:
    """Whether ``data`` holds tensors only, so ``gather_rows`` gathers it; else
    ``gather_object``. The answer must be the same on every rank (each then issues the same
    collectives): an empty list or tuple counts as objects, because per-row metadata (a list
    cut to this rank's rows: ``sampler.cut_rows``) is empty exactly on a rank without rows,
    while a list of tensors has the same length on every rank."""
    if torch.is_tensor(data):
        return True
    if isinstance(data, (list, tuple)):
        return bool(data) and all(holds_only_tensors(d) for d in data)
    if isinstance(data, dict):
        return all(holds_only_tensors(d) for d in data.values())
    return False


def gather_rows(accelerator, data: Any) -> Any:
    """Every rank's rows of each tensor in ``data`` (tensors, or lists / tuples / dicts of
    them), concatenated in rank order along dim 0: the global batch in order, each row once.

    Two all-gathers per tensor (shapes, then the tensor padded to the largest); a 0-d tensor is
    gathered as one row per rank. Raises ValueError when ranks holding rows disagree on the
    other dimensions (pad them first: ``accelerator.pad_across_processes``)."""
    from accelerate.utils import recursively_apply

    return recursively_apply(accelerator.cephalo_loop.session.gather_rows, data)


def check_clip_parameters(accelerator, parameters, norm_type) -> None:
    """``clip_grad_norm_`` clips every shard by the global norm: the parameters must be the
    prepared model's (all of them), the norm L2 (ValueError otherwise)."""
    if float(norm_type) != 2.0:
        raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): the engine clips by the global "
                         "L2 norm over every rank's shards; use norm_type=2")
    shards = accelerator.cephalo_loop.session.shard_params()
    given = {id(p) for p in (parameters if not torch.is_tensor(parameters) else [parameters])}
    if given != {id(p) for p in shards}:
        raise ValueError("clip_grad_norm_: pass the prepared model's parameters "
                         "(model.parameters()); clipping a subset of a sharded model's "
                         "parameters is not supported")


def checkpoint_dir(accelerator, output_dir: str | None) -> str:
    """``save_state``'s folder as stock decides it (automatic naming under ``project_dir``)."""
    config = accelerator.project_configuration
    if output_dir is not None:
        return str(output_dir)
    if not config.automatic_checkpoint_naming:
        raise ValueError("save_state() needs output_dir (or ProjectConfiguration("
                         "automatic_checkpoint_naming=True) with a project_dir)")
    folder = os.path.join(accelerator.project_dir, "checkpoints",
                          f"checkpoint_{accelerator.save_iteration}")
    config.iteration += 1
    return folder


def resume_dir(accelerator, input_dir: str | None) -> str:
    """``load_state``'s folder: ``input_dir``, else the newest complete automatic checkpoint."""
    if input_dir is not None:
        return str(input_dir)
    from hf_cephalo.runtime import is_complete

    root = os.path.join(accelerator.project_dir or ".", "checkpoints")
    found = sorted((d for d in os.listdir(root) if d.startswith("checkpoint_")
                    and is_complete(os.path.join(root, d))),
                   key=lambda d: int(d.rsplit("_", 1)[-1])) if os.path.isdir(root) else []
    if not found:
        raise ValueError(f"load_state(): no complete checkpoint_<i> under {root}; pass input_dir")
    return os.path.join(root, found[-1])
