"""The custom loop's DataLoader support matrix: every ``torch.utils.data.DataLoader`` argument a
user can set on a loader passed to ``CephaloAccelerator.prepare``, classified.

The same contract as ``support.py`` ([Note: no silent no-op] there): each argument works as
stock (the prepared loader honours it), has no meaning here, or has values refused at
``prepare`` (``loader_problems``: ValueError on every rank, before any collective, naming the
argument and what to do). ``tests/test_loop_support.py`` fails when the installed torch adds
a DataLoader argument this table does not classify, and checks that docs/accelerate.md holds
the rendered table (``render_markdown``).
"""

from __future__ import annotations

from typing import Any

from hf_cephalo.integrations.trainer.support import Support, markdown_table
from hf_cephalo.integrations.trainer.support import inherited as _inherited
from hf_cephalo.integrations.trainer.support import refused as _refused
from hf_cephalo.integrations.trainer.support import stock as _stock

__all__ = ["LOADER_FIELD_SUPPORT", "loader_problems", "unclassified_loader_fields",
           "accelerator_problems", "render_markdown"]

_T = "tests/test_accelerate_loop.py::"
_REORDER = ("for an order of your own (weighted, curriculum, length-grouped), reorder or repeat "
            "the dataset itself (torch.utils.data.Subset(dataset, indices)) and pass "
            "shuffle=False")

LOADER_FIELD_SUPPORT: dict[str, Support] = {
    "dataset": _stock("map-style (any length) or a stream (an IterableDataset: B consecutive "
                      "rows per step, read in order by every rank; training loaders only)",
                      _T + "test_streamed_training_set"),
    "batch_size": _stock("the first (training) loader's batch_size x world size x "
                         "gradient_accumulation_steps is the global batch B, cut by the plan's "
                         "b_i; None (a batch_sampler) is refused",
                         _T + "test_loop_equals_full_batch_reference"),
    "shuffle": _stock("training: a permutation of the dataset per epoch, seeded by the "
                      "loader's generator (else torch's initial seed) + epoch, the same on "
                      "every rank; evaluation: refused (rows are evaluated and gathered in "
                      "dataset order)", _T + "test_loop_equals_full_batch_reference"),
    "sampler": _refused("the engine draws each global batch's rows itself; only shuffle's "
                        "RandomSampler (without replacement or num_samples; its own generator "
                        "seeds the permutation where the loader has none) and "
                        "SequentialSampler are accepted; " + _REORDER),
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
    "generator": _stock("its initial seed (rank 0's, broadcast) seeds the epoch permutations; "
                        "each epoch's iteration draws worker seeds from it, as stock",
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


def loader_problems(loader: Any, training: bool) -> list[str]:
    """Why ``loader`` cannot be prepared as given (empty: it can): the refused arguments of
    ``LOADER_FIELD_SUPPORT`` with non-default values, a sampler the engine would replace, and
    an evaluation loader's ``shuffle`` / ``drop_last``. Needs no process group."""
    from torch.utils.data import RandomSampler, SequentialSampler

    from hf_cephalo.runtime.streaming import is_stream

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


def accelerator_problems(accelerator: Any) -> list[str]:
    """``Accelerator`` settings a custom loop on the engine would otherwise drop without a
    word (empty: none), each with what to do. Read from the constructed accelerator, so every
    rank answers the same; needs no collective. (DeepSpeed / FSDP / Megatron, fp8 and
    ``dispatch_batches`` are refused by ``loop_prepare.check_loop_setup`` itself;
    ``GradScalerKwargs`` are honoured: the engine's sharded loss scaler takes them.)"""
    problems = []
    if accelerator.device_placement is False:
        problems.append("Accelerator(device_placement=False): the engine places every shard "
                        "and microbatch on the device itself; leave device_placement at True")
    if getattr(accelerator, "parallelism_config", None) is not None:
        problems.append("Accelerator(parallelism_config=... / torch_tp_plugin=...): tensor, "
                        "context or sequence parallelism is not combined with Cephalo's "
                        "sharding; drop it")
    dynamo = accelerator.state.dynamo_plugin
    extra = {k: getattr(dynamo, k) for k in ("fullgraph", "dynamic", "options",
                                             "use_regional_compilation")
             if getattr(dynamo, k, None) not in (None, False)}
    if str(getattr(dynamo.backend, "value", dynamo.backend)).upper() != "NO" and extra:
        problems.append(f"TorchDynamoPlugin({', '.join(f'{k}={v!r}' for k, v in extra.items())}): "
                        "the engine compiles each layer unit with the backend and mode only "
                        "(regional by construction); drop these fields")
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
    rng = list(getattr(accelerator, "rng_types", None) or ["generator"])
    if rng != ["generator"]:
        problems.append(f"Accelerator(rng_types={rng}): the engine's loaders draw each epoch's "
                        "permutation from a seed that is the same on every rank and do not "
                        "synchronize other generators at each epoch; leave rng_types unset")
    seed = getattr(accelerator.dataloader_config, "data_seed", None)
    if seed is not None:
        problems.append(f"DataLoaderConfiguration(data_seed={seed}): the training loader's "
                        "permutation is seeded by its generator (DataLoader(generator="
                        "torch.Generator().manual_seed(seed))) or torch's initial seed; "
                        "seed the generator instead")
    return problems


def unclassified_loader_fields() -> list[str]:
    """``DataLoader.__init__`` arguments of the installed torch that the table misses."""
    import inspect

    from torch.utils.data import DataLoader

    names = [n for n in inspect.signature(DataLoader.__init__).parameters if n != "self"]
    return [n for n in names if n not in LOADER_FIELD_SUPPORT]


def render_markdown() -> str:
    """The DataLoader table of docs/accelerate.md."""
    return "\n".join(markdown_table("DataLoader arguments (custom loops)",
                                    LOADER_FIELD_SUPPORT, 3))
