"""Weighted batch sampler: exact per-rank counts, disjoint cover of the dataset, equal step counts."""

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader

from hf_cephalo.runtime.sampler import (
    GlobalBatchCollator,
    MicrobatchCollator,
    WeightedBatchSampler,
    global_batches,
    packs_without_padding,
    split_counts,
    split_microbatches,
)


def _all_ranks(length, sizes, **kw):
    return [WeightedBatchSampler(length, sizes, r, **kw) for r in range(len(sizes))]


def _check_epoch(length, sizes, epoch=0, seed=0, shuffle=True, drop_last=False):
    samplers = _all_ranks(length, sizes, seed=seed, shuffle=shuffle, drop_last=drop_last)
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    num_steps = {len(steps) for steps in per_rank}
    assert num_steps == {len(samplers[0])}, (length, sizes, num_steps)  # same steps -> no hang
    global_b = sum(sizes)
    seen = []
    for step in range(len(samplers[0])):
        lists = [per_rank[r][step] for r in range(len(sizes))]
        step_total = sum(len(x) for x in lists)
        last = step == len(samplers[0]) - 1
        if not last or length % global_b == 0 or drop_last:
            assert [len(x) for x in lists] == list(sizes)  # exactly b_i in every full step
        else:
            assert step_total == length % global_b
            for x, b in zip(lists, sizes):
                assert len(x) <= b and (b > 0 or len(x) == 0)
        seen.extend(itertools.chain.from_iterable(lists))
    expected = length - (length % global_b if drop_last else 0)
    assert len(seen) == expected and len(set(seen)) == expected  # no duplicates
    assert set(seen) <= set(range(length))
    return per_rank


def test_issue_example_37_samples_ratios_02_03_05():
    per_rank = _check_epoch(37, [2, 3, 5])
    assert [len(steps) for steps in per_rank] == [4, 4, 4]
    # last global batch: 7 samples split 0.2/0.3/0.5 -> 1.4/2.1/3.5 -> 1/2/4 (largest remainder)
    assert [len(steps[-1]) for steps in per_rank] == [1, 2, 4]


def test_property_many_sizes():
    rng = random.Random(0)
    for _ in range(300):
        world = rng.randint(1, 6)
        sizes = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(world)]
        if sum(sizes) == 0:
            sizes[rng.randrange(world)] = 1
        length = rng.randint(0, 60)
        _check_epoch(length, sizes, epoch=rng.randint(0, 3), seed=rng.randint(0, 9),
                     shuffle=rng.random() < 0.8, drop_last=rng.random() < 0.3)


def test_split_counts_properties():
    for sizes in [[1], [2, 3, 5], [0, 4, 0, 1], [7, 7], [1, 1, 1], [3, 0, 0]]:
        global_b = sum(sizes)
        for n in range(global_b + 1):
            counts = split_counts(n, sizes)
            assert sum(counts) == n
            for c, b in zip(counts, sizes):
                assert 0 <= c <= b and (b > 0 or c == 0)
                # proportional: within one sample of the exact share
                assert abs(c - n * b / global_b) < 1
        assert split_counts(global_b, sizes) == sizes
    assert split_counts(1, [1, 1, 1]) == [1, 0, 0]  # ties go to the lower rank
    assert split_counts(7, [2, 3, 5]) == [1, 2, 4]


def test_pure_function_of_epoch_and_seed():
    a = WeightedBatchSampler(50, [3, 5], 1, seed=7)
    b = WeightedBatchSampler(50, [3, 5], 1, seed=7)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)  # new permutation per epoch
    b.set_epoch(1)
    assert list(a) == list(b)
    c = WeightedBatchSampler(50, [3, 5], 1, seed=8)
    c.set_epoch(1)
    assert list(c) != list(a)
    unshuffled = WeightedBatchSampler(10, [1, 3], 0, shuffle=False)
    assert list(unshuffled) == [[0], [4], [8]]
    assert global_batches(5, 2, shuffle=False) == [[0, 1], [2, 3], [4]]
    assert global_batches(5, 2, shuffle=False, drop_last=True) == [[0, 1], [2, 3]]


def test_split_microbatches():
    for b in range(0, 13):
        for m in range(1, 6):
            chunks = split_microbatches(list(range(b)), m)
            assert [x for c in chunks for x in c] == list(range(b))
            assert len(chunks) == -(-b // m)
            assert all(len(c) == m for c in chunks[:-1])
            assert all(1 <= len(c) <= m for c in chunks)
    assert split_microbatches(range(6), 2) == [[0, 1], [2, 3], [4, 5]]  # b = l*m -> exactly l


def test_dataloader_microbatch_collation_and_empty_last_step():
    data = [{"x": torch.tensor([float(i)])} for i in range(7)]

    def collate(samples):
        return torch.stack([s["x"] for s in samples])

    # 7 samples, sizes [4, 1, 1]: last partial batch of 1 -> ranks 1 and 2 get nothing
    loaders = [DataLoader(data, batch_sampler=WeightedBatchSampler(7, [4, 1, 1], r, shuffle=False),
                          collate_fn=MicrobatchCollator(collate, 2)) for r in range(3)]
    steps = [list(dl) for dl in loaders]
    assert [len(s) for s in steps] == [2, 2, 2]
    assert [mb.flatten().tolist() for mb in steps[0][0]] == [[0.0, 1.0], [2.0, 3.0]]
    assert [mb.flatten().tolist() for mb in steps[0][1]] == [[6.0]]
    assert steps[1][1] == [] and steps[2][1] == []


def _left_pad(samples):
    """Left-pads to the longest sample given (as a tokenizer with padding_side='left')."""
    from transformers import BatchEncoding

    width = max(len(s["ids"]) for s in samples)
    ids = torch.tensor([[0] * (width - len(s["ids"])) + s["ids"] for s in samples])
    return BatchEncoding({"input_ids": ids, "attention_mask": (ids != 0).long(), "tag": "kept"})


def test_global_batch_collation_pads_as_the_full_batch():
    """Every rank's microbatch rows are the rows of the whole global batch collated at once,
    for any plan (partial last batch and empty ranks included); per-microbatch collation pads
    differently (the plan-dependent padding it replaces)."""
    data = [{"ids": list(range(1, 2 + (7 * i) % 5))} for i in range(11)]
    for sizes, micro in (([1, 3], [1, 2]), ([3, 1], [3, 1]), ([2, 0, 2], [1, 1, 2])):
        full_batches = [_left_pad([data[i] for i in batch])
                        for batch in global_batches(len(data), sum(sizes), shuffle=False)]
        steps = []
        for rank, m in enumerate(micro):
            if sizes[rank] == 0:
                continue
            sampler = WeightedBatchSampler(len(data), sizes, rank, shuffle=False,
                                           yield_global_batch=True)
            loader = DataLoader(data, batch_sampler=sampler,
                                collate_fn=GlobalBatchCollator(_left_pad, sizes, rank, m))
            local = sampler.local_batches()
            for step, microbatches in enumerate(loader):
                assert sum(len(mb["input_ids"]) for mb in microbatches) == len(local[step])
                assert all(len(mb["input_ids"]) <= m for mb in microbatches)
                assert all(type(mb).__name__ == "BatchEncoding" and mb["tag"] == "kept"
                           for mb in microbatches)
                steps.append((step, microbatches))
        for step, full in enumerate(full_batches):
            rows = torch.cat([mb["input_ids"] for s, mbs in steps if s == step for mb in mbs])
            assert torch.equal(rows, full["input_ids"]), (sizes, step)
    per_micro = list(DataLoader(data, batch_sampler=WeightedBatchSampler(11, [1, 3], 0,
                                                                         shuffle=False),
                                collate_fn=MicrobatchCollator(_left_pad, 1)))
    assert per_micro[0][0]["input_ids"].shape[1] < full_batches[0]["input_ids"].shape[1]


def test_packing_collator_pads_nothing():
    """DataCollatorWithFlattening (with position_ids; also inside the Trainer's column-removing
    wrapper) is recognized as padding-free; its one packed row cannot be cut into samples."""
    import logging

    from transformers import DataCollatorWithFlattening
    from transformers.trainer_utils import RemoveColumnsCollator

    flatten = DataCollatorWithFlattening()
    assert packs_without_padding(flatten)
    assert packs_without_padding(RemoveColumnsCollator(flatten, ["input_ids"],
                                                       logging.getLogger(__name__)))
    assert not packs_without_padding(DataCollatorWithFlattening(return_position_ids=False))
    assert not packs_without_padding(_left_pad)
    with pytest.raises(ValueError, match="--cephalo_collate microbatch"):
        GlobalBatchCollator(flatten, [1, 3], 0, 1)([{"input_ids": [1, 2, 3]}] * 4)


def test_global_batch_collation_refuses_unsplittable_tensors():
    collate = GlobalBatchCollator(lambda s: {"x": torch.zeros(len(s)), "n": torch.tensor(3.0)},
                                  [2, 2], 1, 1)
    with pytest.raises(ValueError, match=r"shape \(\) for 4 samples.*--cephalo_collate microbatch"):
        collate([{}] * 4)
    with pytest.raises(ValueError, match="rank = 2"):
        GlobalBatchCollator(list, [1, 1], 2, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dataset_length=10, batch_sizes=[], rank=0), "empty"),
    (dict(dataset_length=10, batch_sizes=[0, 0], rank=0), "sum to 0"),
    (dict(dataset_length=10, batch_sizes=[2, -1], rank=0), r"batch_sizes\[1\] = -1"),
    (dict(dataset_length=10, batch_sizes=[2, 1.5], rank=0), r"batch_sizes\[1\] = 1.5"),
    (dict(dataset_length=-1, batch_sizes=[2], rank=0), "dataset_length = -1"),
    (dict(dataset_length=10, batch_sizes=[2, 2], rank=2), "rank = 2"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WeightedBatchSampler(**kwargs)


def test_bad_input_helpers():
    with pytest.raises(ValueError, match="num_samples = 11"):
        split_counts(11, [5, 5])
    with pytest.raises(ValueError, match="microbatch_size = 0"):
        split_microbatches([1, 2], 0)
    with pytest.raises(ValueError, match="microbatch_size = 0"):
        MicrobatchCollator(list, 0)


def test_live_switch_keeps_the_global_batches():
    """[Note: switching the split live]: a switch of (b_i, m_i) from step k on splits the SAME
    global batches (those of a run without the switch), over epoch boundaries too, and the
    collator cuts each step into the m_i of that step."""
    from hf_cephalo.runtime.sampler import MicrobatchCollator, SplitSchedule

    n, sizes, new = 45, [6, 4], [3, 7]  # B = 10: 5 steps per epoch (last one partial)
    schedule = SplitSchedule(sizes, [3, 2])
    samplers = [WeightedBatchSampler(n, sizes, r, seed=3, schedule=schedule) for r in range(2)]
    collators = [MicrobatchCollator(list, 1, schedule, rank=r) for r in range(2)]
    for epoch in range(3):
        reference = global_batches(n, 10, epoch=epoch, seed=3)
        iters = []
        for s in samplers:
            s.set_epoch(epoch)
            iters.append(iter(s))
        for k, batch in enumerate(reference):
            step = epoch * 5 + k
            if step == 7:  # the step boundary after step 6: from step 7 on
                schedule.switch(7, new, [1, 7])
            parts = []
            for r in range(2):
                part = next(iters[r])
                micro = collators[r](part)
                want_m = ([3, 2] if step < 7 else [1, 7])[r]
                assert all(len(mb) <= want_m for mb in micro) and sum(micro, []) == part
                parts.append(part)
            assert parts[0] + parts[1] == batch
            if len(batch) == 10:
                assert [len(p) for p in parts] == (sizes if step < 7 else new)
    with pytest.raises(ValueError, match="global batch size"):
        schedule.switch(20, [3, 3], [1, 1])
    with pytest.raises(ValueError, match="before the last one"):
        schedule.switch(3, [5, 5], [1, 1])
