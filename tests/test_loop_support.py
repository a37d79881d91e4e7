"""The custom loop's support matrices (``integrations/loop/support.py``, issue 37): every
DataLoader argument of the installed torch and every ``Accelerator.__init__`` argument,
``DataLoaderConfiguration`` and ``ProjectConfiguration`` field of the installed accelerate is
classified, every "works as stock" entry names an existing test, docs/accelerate.md holds the
rendered tables, and each refused value is one clear message from ``loader_problems`` /
``accelerator_problems`` (no process group needed: ``CephaloAccelerator.prepare`` raises it on
every rank before any collective; tests/test_accelerate_loop.py checks that on 2 and 3
ranks)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, WeightedRandomSampler

from hf_cephalo.integrations.loop import support
from hf_cephalo.integrations.loop.support import (LOADER_FIELD_SUPPORT, loader_problems,
                                                  unclassified_loader_fields)
from tests.test_trainer_support import ROOT, assert_entries_explained


def test_every_dataloader_argument_is_classified():
    assert unclassified_loader_fields() == [], (
        "classify the new DataLoader arguments in hf_cephalo/integrations/loop/support.py")


def test_every_accelerator_argument_and_config_field_is_classified():
    """Fails when the installed accelerate has an argument or field the tables miss (an entry
    for one an older supported accelerate lacks is harmless)."""
    where = "classify them in hf_cephalo/integrations/loop/support.py"
    assert support.unclassified_accelerator_fields() == [], f"Accelerator.__init__: {where}"
    assert support.unclassified_dataloader_config_fields() == [], \
        f"DataLoaderConfiguration: {where}"
    assert support.unclassified_project_config_fields() == [], f"ProjectConfiguration: {where}"


TABLES = {"DataLoader": LOADER_FIELD_SUPPORT, "Accelerator": support.ACCELERATOR_FIELD_SUPPORT,
          "DataLoaderConfiguration": support.DATALOADER_CONFIG_SUPPORT,
          "ProjectConfiguration": support.PROJECT_CONFIG_SUPPORT}


@pytest.mark.parametrize("table", list(TABLES))
def test_stock_entries_name_existing_tests(table):
    assert_entries_explained(TABLES[table], table)


def test_docs_hold_the_rendered_tables():
    with open(os.path.join(ROOT, "docs", "accelerate.md")) as f:
        text = f.read()
    for render in ("render_markdown", "render_accelerator_markdown"):
        assert getattr(support, render)() in text, (
            "regenerate the tables of docs/accelerate.md: python -c \"from "
            f"hf_cephalo.integrations.loop.support import {render} as r; print(r())\"")


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


DATA = list(range(8))


@pytest.mark.parametrize("kwargs, training, needle", [
    (dict(batch_size=2, timeout=5), True, r"timeout=5\): .*leave it 0"),
    (dict(batch_size=2, worker_init_fn=print), True, r"worker_init_fn=\.\.\.\): .*seed_worker"),
    (dict(batch_size=2, in_order=False), True, r"in_order=False\): .*leave it True"),
    (dict(batch_size=2, pin_memory_device="cuda"), True, r"pin_memory_device='cuda'"),
    (dict(batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8)), True,
     r"sampler=WeightedRandomSampler\(\.\.\.\)\).*Subset\(dataset, indices\)"),
    (dict(batch_size=2, sampler=RandomSampler(DATA, num_samples=4)), True,
     r"num_samples=4\)\).*permutation of the whole dataset"),
    (dict(batch_sampler=[[0, 1], [2, 3]]), True, r"batch_size=None \(batch_sampler=list\)"),
    (dict(batch_size=2, shuffle=True), False, r"evaluation DataLoader with shuffle=True"),
    (dict(batch_size=2, drop_last=True), False, r"evaluation DataLoader with drop_last=True"),
])
def test_refused_values_name_the_argument_and_the_fix(kwargs, training, needle):
    problems = loader_problems(DataLoader(DATA, **kwargs), training)
    assert len(problems) == 1, problems
    assert re.search(needle, problems[0]), problems[0]


def test_accepted_loaders():
    ok = [(DataLoader(DATA, batch_size=2, shuffle=True, drop_last=True, num_workers=0,
                      generator=torch.Generator().manual_seed(1)), True),
          (DataLoader(DATA, batch_size=2), False),
          (DataLoader(_Stream(), batch_size=2), True)]
    for loader, training in ok:
        assert loader_problems(loader, training) == []
    assert "over a stream" in loader_problems(DataLoader(_Stream(), batch_size=2), False)[0]


def _accelerator(**kwargs):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


def test_training_order_is_stock_seedable_samplers(caplog):
    """A shuffled training loader is read in stock Accelerate's order under
    use_seedable_sampler=True (``runtime.sampler.global_batches`` of data_seed, else torch's
    initial seed, + epoch), whatever the loader's generator says; with stock's default (False)
    prepare says so once, naming the setting."""
    import logging
    from types import SimpleNamespace

    from accelerate.utils import DataLoaderConfiguration

    from hf_cephalo.integrations.loop.prepare import _broadcast_seed, _say_training_order
    from hf_cephalo.runtime.sampler import global_batches

    for data_seed in (None, 11):
        torch.manual_seed(42)  # the script's set_seed
        config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=data_seed)
        stock = _accelerator(dataloader_config=config)
        loader = DataLoader(list(range(24)), batch_size=4, shuffle=True,
                            generator=torch.Generator().manual_seed(7))
        prepared = stock.prepare(loader)
        ours = SimpleNamespace(dataloader_config=config, num_processes=1)
        seed = _broadcast_seed(ours)
        assert seed == (42 if data_seed is None else 11)
        for epoch in range(3):
            assert [b.tolist() for b in prepared] == global_batches(24, 4, epoch=epoch, seed=seed)
    said = []
    for seedable, shuffle in ((False, True), (True, True), (False, False)):
        ours = SimpleNamespace(is_main_process=True, dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=seedable))
        caplog.clear()
        with caplog.at_level(logging.WARNING, "hf_cephalo.integrations.loop.prepare"):
            _say_training_order(ours, DataLoader(DATA, batch_size=2, shuffle=shuffle))
        said.append(caplog.text)
    assert "use_seedable_sampler=True)) to silence this" in said[0] and said[1:] == ["", ""]
    _accelerator()


def test_accelerator_settings_the_loop_would_drop_are_refused(monkeypatch):
    from accelerate.utils import (AutocastKwargs, DataLoaderConfiguration,
                                  DistributedDataParallelKwargs, FullyShardedDataParallelPlugin,
                                  GradientAccumulationPlugin, ProjectConfiguration,
                                  TorchDynamoPlugin)

    from hf_cephalo.integrations.loop.support import accelerator_problems

    assert accelerator_problems(_accelerator()) == []
    assert accelerator_problems(_accelerator(dataloader_config=DataLoaderConfiguration(
        data_seed=3, use_seedable_sampler=True))) == []  # the training order's seed
    cases = [
        (dict(device_placement=False), r"device_placement=False\): the engine places"),
        (dict(kwargs_handlers=[AutocastKwargs(cache_enabled=True)]),
         r"AutocastKwargs\(\{'cache_enabled': True\}\).*CephaloPlugin\(precision"),
        (dict(dynamo_plugin=TorchDynamoPlugin(backend="eager", fullgraph=True)),
         r"TorchDynamoPlugin\(fullgraph=True\): .*backend and mode only"),
        (dict(project_config=ProjectConfiguration(project_dir="/tmp", total_limit=2)),
         r"total_limit=2\): save_state does not rotate"),
        (dict(rng_types=["torch", "generator"]), r"rng_types=\['torch', 'generator'\]"),
        # accepted and silently dropped before these refusals (issue 37's support matrix)
        (dict(dynamo_plugin=TorchDynamoPlugin(backend="eager", disable=True)),
         r"disable=True\) with a backend: .*leave the backend at 'no'"),
        (dict(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="fp16")]),
         r"DistributedDataParallelKwargs\(comm_hook='fp16'\): .*drop the hook"),
        (dict(gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=2, sync_with_dataloader=False)),
         r"sync_with_dataloader=False\): .*leave sync_with_dataloader True"),
        (dict(project_config=ProjectConfiguration(project_dir="/tmp", save_on_each_node=True)),
         r"save_on_each_node=True\): .*shared file system"),
    ]
    for kwargs, needle in cases:
        problems = accelerator_problems(_accelerator(**kwargs))
        assert len(problems) == 1 and re.search(needle, problems[0]), (kwargs, problems)
    # without CUDA Accelerate runs on the CPU and ignores an FSDP / DeepSpeed plugin; refused
    # all the same (on CUDA check_loop_setup refuses its distributed type)
    assert accelerator_problems(_accelerator(dynamo_plugin=TorchDynamoPlugin(
        backend="no", disable=True))) == []
    for env in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM"):
        monkeypatch.setenv(env, "false")
    problems = accelerator_problems(_accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()))
    assert len(problems) == 1 and re.search(r"fsdp_plugin=\.\.\.\) / ACCELERATE_USE_FSDP=true: "
                                            r"Cephalo is the sharding engine", problems[0])
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    _accelerator()  # leave a plain state behind


def test_job_follows_the_accelerator_settings():
    """``job_from_accelerator`` (no process group): the global batch is batch_size x world x
    gradient_accumulation_steps, without the world under ``split_batches``; the dynamo backend
    and mode become the per-unit compile options; a scheduler steps world-size times per
    optimizer step at stock's global batch, once under ``split_batches``, and in general once
    per loader batch the global batch replaces; a fractional count is refused."""
    from types import SimpleNamespace

    from accelerate.utils import DataLoaderConfiguration, TorchDynamoPlugin

    from hf_cephalo.integrations.loop.accelerator import CephaloPlugin
    from hf_cephalo.integrations.loop.prepare import (_prepare_scheduler, _scheduler_steps,
                                                      job_from_accelerator, scheduler_steps)

    def job(split, backend="no"):
        acc = SimpleNamespace(
            cephalo_plugin=CephaloPlugin(adaptive="off"), gradient_accumulation_steps=2,
            split_batches=split, num_processes=3, process_index=0, device=torch.device("cpu"),
            project_dir=None, mixed_precision="no",
            state=SimpleNamespace(dynamo_plugin=TorchDynamoPlugin(backend=backend,
                                                                  mode="max-autotune")))
        return job_from_accelerator(acc, DataLoader(DATA, batch_size=2), seed=0)

    assert job(False).global_batch_size == 2 * 3 * 2 and job(False).compile is None
    assert job(True).global_batch_size == 2 * 2
    compiled = job(False, backend="inductor").compile
    assert (compiled.backend, compiled.mode) == ("inductor", "max-autotune")
    for split, steps in ((False, 3), (True, 1)):
        stock = _accelerator(dataloader_config=DataLoaderConfiguration(split_batches=split))
        acc = SimpleNamespace(prepare_scheduler=stock.prepare_scheduler,
                              _schedulers=stock._schedulers, num_processes=3,
                              split_batches=split)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step)
        assert _prepare_scheduler(acc, scheduler).steps_per_optimizer_step == steps
    # the count is the loader batches one global batch replaces: stock's at stock's B, 1 for a
    # B of one loader batch x GA (one process's schedule), the same on any world size
    loader = DataLoader(DATA, batch_size=2)
    for split, world, batch, steps in ((False, 3, 12, 3), (True, 3, 4, 1), (False, 3, 4, 1),
                                       (False, 2, 16, 4), (False, 5, 4, 1), (False, 3, 6, None)):
        acc = SimpleNamespace(split_batches=split, num_processes=world,
                              gradient_accumulation_steps=2)
        assert scheduler_steps(batch, loader, acc) == steps, (split, world, batch)
    assert scheduler_steps(6, None, acc) == 3  # no training loader: stock's count
    with pytest.raises(ValueError, match=r"global batch size 6 is not a whole number of the "
                       r"training loader's batches \(batch_size 2 x gradient_accumulation_steps "
                       r"2 = 4 samples\).*a multiple of 4, or a loader batch_size with batch_size "
                       r"x 2 dividing 6 \(1, 3\)"):
        _scheduler_steps(6, loader, acc)
    with pytest.raises(ValueError, match=r"no loader batch_size can do: "
                       r"gradient_accumulation_steps 2 does not divide 15"):
        _scheduler_steps(15, loader, acc)
    # the model prepared first, the loader and scheduler later: the count still comes from the
    # training loader (it once fell back to num_processes there)
    for batch_size, steps in ((16, 1), (8, 2), (6, None)):
        stock = _accelerator()
        acc = SimpleNamespace(
            prepare_scheduler=stock.prepare_scheduler, _schedulers=stock._schedulers,
            num_processes=2, split_batches=False, gradient_accumulation_steps=1,
            cephalo_loop=SimpleNamespace(session=SimpleNamespace(
                job=SimpleNamespace(global_batch_size=16))),
            cephalo_loaders=[SimpleNamespace(batch_size=batch_size)])
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step)
        if steps is None:
            with pytest.raises(ValueError, match="global batch size 16 is not a whole number"):
                _prepare_scheduler(acc, scheduler)
        else:
            assert _prepare_scheduler(acc, scheduler).steps_per_optimizer_step == steps
    _accelerator()


@pytest.mark.parametrize("stateful", [False, True])
def test_load_state_restores_loader_positions(tmp_path, stateful):
    """The saved loaders' epoch is restored; the position only with use_stateful_dataloader
    (without it the next iteration starts the epoch and skip_first_batches skips, as stock)."""
    import json
    from types import SimpleNamespace

    from accelerate.utils import DataLoaderConfiguration

    from hf_cephalo.integrations.loop.state import LOADERS_NAME, _restore_loaders

    (tmp_path / LOADERS_NAME).write_text(json.dumps([{"epoch": 2, "position": 3},
                                                     {"epoch": 0, "position": 0}]))
    loaders = [SimpleNamespace(epoch=0, _skip_next=0), SimpleNamespace(epoch=0, _skip_next=0)]
    acc = SimpleNamespace(cephalo_loaders=loaders, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=stateful) if stateful else DataLoaderConfiguration())
    _restore_loaders(acc, str(tmp_path))
    assert [(l.epoch, l._skip_next) for l in loaders] == [(2, 3 if stateful else 0), (0, 0)]


def test_automatic_checkpoint_names(tmp_path):
    """As stock: project_dir/checkpoints/checkpoint_<iteration>, counted up from
    ``iteration``; load_state() without a folder takes the newest complete one."""
    from accelerate.utils import ProjectConfiguration

    from hf_cephalo.engine.checkpoint.atomic import FILES
    from hf_cephalo.integrations.loop.prepare import checkpoint_dir, resume_dir

    acc = _accelerator(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, iteration=4))
    root = tmp_path / "checkpoints"
    assert checkpoint_dir(acc, None) == str(root / "checkpoint_4")
    assert checkpoint_dir(acc, None) == str(root / "checkpoint_5")
    assert acc.save_iteration == 6
    for i, complete in ((4, True), (5, True), (10, False)):
        (root / f"checkpoint_{i}").mkdir(parents=True)
        if complete:
            (root / f"checkpoint_{i}" / FILES.COMPLETE).write_text("")
    assert resume_dir(acc, None) == str(root / "checkpoint_5")
    _accelerator()
