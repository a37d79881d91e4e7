"""The custom loop's DataLoader matrix (``integrations/loop/support.py``, issue 37): every
DataLoader argument of the installed torch is classified, every "works as stock" entry names
an existing test, docs/accelerate.md holds the rendered table, and each refused value is one
clear message from ``loader_problems`` (no process group needed: ``CephaloAccelerator.prepare``
raises it on every rank before any collective; tests/test_accelerate_loop.py checks that on 2
and 3 ranks)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, WeightedRandomSampler

from hf_cephalo.integrations.loop.support import (LOADER_FIELD_SUPPORT, loader_problems,
                                                  render_markdown, unclassified_loader_fields)
from hf_cephalo.integrations.trainer.support import Status
from tests.test_trainer_support import ROOT, _test_names


def test_every_dataloader_argument_is_classified():
    assert unclassified_loader_fields() == [], (
        "classify the new DataLoader arguments in hf_cephalo/integrations/loop/support.py")


def test_stock_entries_name_existing_tests():
    for name, support in LOADER_FIELD_SUPPORT.items():
        assert support.note, name
        if support.status is Status.STOCK:
            path, _, func = support.test.partition("::")
            assert func in _test_names(path), f"{name}: {support.test} does not exist"


def test_docs_hold_the_rendered_table():
    with open(os.path.join(ROOT, "docs", "accelerate.md")) as f:
        assert render_markdown() in f.read(), (
            "regenerate the DataLoader table of docs/accelerate.md: python -c \"from "
            "hf_cephalo.integrations.loop.support import render_markdown as r; print(r())\"")


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


def test_accelerator_settings_the_loop_would_drop_are_refused():
    from accelerate.utils import (AutocastKwargs, DataLoaderConfiguration, ProjectConfiguration,
                                  TorchDynamoPlugin)

    from hf_cephalo.integrations.loop.support import accelerator_problems

    assert accelerator_problems(_accelerator()) == []
    cases = [
        (dict(device_placement=False), r"device_placement=False\): the engine places"),
        (dict(dataloader_config=DataLoaderConfiguration(data_seed=3)),
         r"data_seed=3\).*DataLoader\(generator="),
        (dict(kwargs_handlers=[AutocastKwargs(cache_enabled=True)]),
         r"AutocastKwargs\(\{'cache_enabled': True\}\).*CephaloPlugin\(precision"),
        (dict(dynamo_plugin=TorchDynamoPlugin(backend="eager", fullgraph=True)),
         r"TorchDynamoPlugin\(fullgraph=True\): .*backend and mode only"),
        (dict(project_config=ProjectConfiguration(project_dir="/tmp", total_limit=2)),
         r"total_limit=2\): save_state does not rotate"),
        (dict(rng_types=["torch", "generator"]), r"rng_types=\['torch', 'generator'\]"),
    ]
    for kwargs, needle in cases:
        problems = accelerator_problems(_accelerator(**kwargs))
        assert len(problems) == 1 and re.search(needle, problems[0]), (kwargs, problems)
    _accelerator()  # leave a plain state behind
