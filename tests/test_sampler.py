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


def test_global_batch_collation_cuts_per_row_metadata():
    """Ids and texts a collator passes through belong to their rows: each rank and microbatch
    gets its own rows' entries (issue 37: every rank got the whole global batch's list), in
    global order when concatenated over ranks; a field that is not one entry per sample stays
    whole; the container type is kept."""
    from transformers import BatchEncoding

    def collate(samples):
        return BatchEncoding({"x": torch.tensor([s["i"] for s in samples]),
                              "idx": [s["i"] for s in samples],
                              "text": tuple(f"row {s['i']}" for s in samples),
                              "task": ["lm"]})

    samples = [{"i": i} for i in range(7)]
    sizes = [2, 0, 5]
    got = {}
    for rank in range(3):
        got[rank] = GlobalBatchCollator(collate, sizes, rank, 2)(samples)
    assert got[1] == []
    ids = [i for rank in (0, 2) for mb in got[rank] for i in mb["idx"]]
    assert ids == list(range(7))
    for rank in (0, 2):
        for mb in got[rank]:
            assert isinstance(mb, BatchEncoding)
            assert mb["idx"] == mb["x"].tolist()
            assert list(mb["text"]) == [f"row {i}" for i in mb["idx"]]
            assert isinstance(mb["text"], tuple)
            assert mb["task"] == ["lm"]  # one entry for 7 samples: not per row, kept
    assert [len(mb["idx"]) for mb in got[2]] == [2, 2, 1]


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


def test_step_indices_carry_the_step_and_travel_to_workers():
    """The sampler's lists are StepIndices: equal to plain lists, with the step, the rows'
    position in the global batch and the split in force when drawn; pickled with them."""
    import pickle

    from hf_cephalo.runtime.sampler import SplitSchedule, StepIndices

    schedule = SplitSchedule([2, 3], [1, 3])
    sampler = WeightedBatchSampler(12, [2, 3], 1, seed=4, schedule=schedule)
    sampler.set_epoch(2)
    steps = list(sampler)
    reference = global_batches(12, 5, epoch=2, seed=4)
    assert [list(s) for s in steps] == [b[split_counts(len(b), [2, 3])[0]:] for b in reference]
    assert [(s.epoch, s.step, s.start) for s in steps] == [(2, 6, 2), (2, 7, 2), (2, 8, 1)]
    assert steps[0].batch_sizes == [2, 3] and steps[0].microbatch_sizes == [1, 3]
    back = pickle.loads(pickle.dumps(steps[2]))
    assert isinstance(back, StepIndices) and back.same_step(steps[2]) and back == [*steps[2]]
    whole = sampler.whole_step(steps[1])
    assert whole == reference[1] and whole.whole and whole.start == 0
    assert not whole.same_step(steps[1])
    moved = StepIndices(steps[0], epoch=2, step=6, start=2, batch_sizes=[2, 3],
                        microbatch_sizes=[1, 1])
    assert moved == steps[0] and not moved.same_step(steps[0])  # another m_i: another step
    assert list(sampler.iter_steps(2, 7)) == steps[1:]  # from a global step on (read-ahead)


def test_samples_are_read_under_their_own_seed(monkeypatch):
    """read_sample(k, epoch) draws the same on every call and leaves the process's
    generators as they were; another sample or epoch draws differently. A CUDA device's
    generators are not touched (torch.manual_seed reseeded them on every read, and only the
    CPU's state was given back: on a GPU, dropout then followed the last sample read)."""
    import numpy as np

    from hf_cephalo.runtime.sample_reads import preserved_rng, read_sample, sample_seed

    class Noisy:
        def __getitem__(self, i):
            return (random.random(), float(np.random.rand()), float(torch.rand(())))

    cuda_seeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", cuda_seeds.append)  # a GPU's generators
    states = random.getstate(), torch.random.get_rng_state()
    a = read_sample(Noisy(), 3, seed=1, epoch=0)
    assert a == read_sample(Noisy(), 3, seed=1, epoch=0)
    assert random.getstate() == states[0] and torch.equal(torch.random.get_rng_state(), states[1])
    assert a != read_sample(Noisy(), 4, seed=1, epoch=0) != read_sample(Noisy(), 3, seed=1, epoch=1)
    assert len({sample_seed(s, e, k) for s in range(3) for e in range(3) for k in range(3)}) == 27
    with preserved_rng(5):
        first = torch.rand(())
    with preserved_rng(5):
        assert torch.equal(torch.rand(()), first)
    assert cuda_seeds == []


def test_global_width_check_on_collators():
    """check_global_width says which collators padding to the widest row can be reproduced
    per rank (None) and why not for the others, in one process."""
    from hf_cephalo.runtime.global_width import check_global_width

    rows = [{"ids": list(range(1, 2 + (5 * i) % 7))} for i in range(9)]
    assert check_global_width(_left_pad, rows, [2, 0, 3, 4]) is None

    def plus_rows(samples):  # width grows with the number of rows
        width = max(len(s["ids"]) for s in samples) + len(samples)
        return {"x": torch.tensor([s["ids"] + [0] * (width - len(s["ids"])) for s in samples])}

    def noisy(samples):  # draws per batch: rows depend on the batch
        out = _left_pad(samples)
        out["noise"] = torch.rand(len(samples))
        return out

    def packs(samples):
        return {"x": torch.tensor([[t for s in samples for t in s["ids"]]])}

    assert "are not the widest rows'" in check_global_width(plus_rows, rows, [4, 5])
    assert "differ from the same rows" in check_global_width(noisy, rows, [4, 5])
    assert "first dimension is not the samples" in check_global_width(packs, rows, [4, 5])
    state = torch.random.get_rng_state()
    check_global_width(noisy, rows, [4, 5])
    assert torch.equal(state, torch.random.get_rng_state())  # a random collator is not advanced


def test_weighted_loader_without_a_process_group():
    """One rank: global_width is the whole batch (nothing to exchange; no process group
    needed); several ranks without torch.distributed: a clear error naming the fix."""
    from hf_cephalo.runtime.data import weighted_loader

    data = [{"ids": list(range(1, 2 + i % 4))} for i in range(7)]
    kwargs = dict(rank=0, microbatch_size=2, seed=0, shuffle=False)
    one = weighted_loader(data, _left_pad, batch_sizes=[3], **kwargs)
    steps = list(one)
    full = [_left_pad(data[0:3]), _left_pad(data[3:6]), _left_pad(data[6:7])]
    assert [torch.cat([mb["input_ids"] for mb in s]).tolist() for s in steps] == \
        [f["input_ids"].tolist() for f in full]
    assert one.dataset.mode.value == "global_batch" and len(one.dataset) == 7
    with pytest.raises(ValueError, match="torch.distributed, which is not initialized"):
        weighted_loader(data, _left_pad, batch_sizes=[3, 4], **kwargs)
    with pytest.raises(ValueError, match="collate = 'whole'"):
        weighted_loader(data, _left_pad, batch_sizes=[3], collate="whole", **kwargs)
    micro = weighted_loader(data, _left_pad, batch_sizes=[2, 5], collate="microbatch", **kwargs)
    assert [len(s) for s in micro] == [1]  # one step (B = 7): rank 0 has 2 rows, m = 2


def test_read_ahead_seeds_workers_per_rank_and_exchange_alone():
    """The read-ahead loader's workers are seeded as stock Trainer seeds them (per rank), from
    a generator of its own; one process's exchange gathers from itself and fails alone."""
    from transformers.trainer_utils import seed_worker

    from hf_cephalo.runtime.exchange import LoaderStepError, StepExchange
    from hf_cephalo.runtime.sample_reads import ReadAhead, SeededReads

    sampler = WeightedBatchSampler(10, [2, 3], 1)
    ahead = ReadAhead(SeededReads(list(range(10)), 0), sampler, list, whole=False,
                      loader_kwargs=dict(num_workers=2))
    init = ahead._loader.worker_init_fn
    assert init.func is seed_worker and init.keywords == {"num_workers": 2, "rank": 1}
    assert ahead._loader.generator is not None  # not the process's global generator
    inline = ReadAhead(SeededReads(list(range(10)), 0), sampler, list, whole=True,
                       loader_kwargs=dict(num_workers=0))
    first = next(iter(sampler))
    assert inline.get(first) == sampler.whole_step(first)  # the whole batch's rows, read here
    alone = StepExchange()
    assert (alone.world_size, alone.rank, alone.device.type) == (1, 0, "cpu")
    assert alone.gather([3, 4]) == [[3, 4]]
    alone.agree(None, "data, step 0")
    with pytest.raises(LoaderStepError, match="data, step 0 failed on rank 0: OSError: gone"):
        alone.agree(OSError("gone"), "data, step 0")
