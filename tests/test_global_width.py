"""Each rank reads only its rows, padded to the global batch's width (issue 32).

One run_ranks call on 4 gloo ranks runs every sub-case, on the 4-rank world and, at the same
time, on the 2-rank groups {0, 1} and {2, 3} (the loader's ``group``), and returns what the test
functions check. ``weighted_loader(collate="global_width")`` must give, for every collator users
run (transformers' padding, language-modeling and seq2seq collators, ``default_data_collator``,
TRL's language-modeling collator, a plain left-padding function; right and left padding,
``pad_to_multiple_of``), every step's rows of this rank exactly as the whole global batch
collated at once (the single-process reference, read with ``read_sample``), and exactly as
today's ``collate="global_batch"``; with uneven plans, a rank without rows, a partial last
batch, a live switch of the split, a resumed loader and DataLoader workers. Reads are counted
in ``__getitem__``: b_i own rows per step, plus the first step's global batch once (the
collator check) and at most one extra row per padded axis and step. Training through the
engine (SGD, fp32) gives the losses and final weights of the single-process full batch and of
``global_batch``, for several plans; a random augmentation gives the same under two plans and
across a live switch. Collators it cannot reproduce fall back to ``global_batch`` (logged
once); bad collators, rank-dependent datasets and a rank that fails alone raise the same
ValueError on every rank, and nothing hangs.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from tests.dist_utils import run_ranks, test_timeout
from tests.models_fixtures import VOCAB, build

RTOL, ATOL = 1e-5, 1e-6
# seconds of the 4-rank job, measured on 2 cores under load: [Note: test time budgets]
JOB_S = 150.0
pytestmark = test_timeout(JOB_S)
N, SEED, SAMPLE_SEED, LR, STEPS = 23, 3, 11, 0.1, 2
PLANS = {4: [([1, 3, 0, 4], [1, 2, 1, 3]), ([5, 1, 1, 1], [2, 1, 1, 1])],
         2: [([1, 3], [1, 2]), ([3, 1], [2, 1]), ([0, 4], [1, 4])]}
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
              "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)}


# ---- data and collators ------------------------------------------------------------------
def _tokenizer(side: str, **special):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", padding_side=side, **special)


def _ids(g: torch.Generator, lo: int = 2, hi: int = 13) -> list[int]:
    return torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (), generator=g)),),
                         generator=g).tolist()


def _rows(kind: str) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(N):
        ids = _ids(g)
        if kind == "classify":
            rows.append({"input_ids": ids, "label": int(torch.randint(0, 3, (), generator=g))})
        elif kind == "seq2seq":  # labels of their own lengths: two padded axes
            rows.append({"input_ids": ids, "labels": _ids(g, 1, 9)})
        elif kind == "causal_seq2seq":  # prompt tokens not scored, labels as long as the input
            cut = int(torch.randint(0, len(ids), (), generator=g))
            rows.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
        elif kind == "fixed":
            ids = torch.randint(1, VOCAB, (8,), generator=g).tolist()
            rows.append({"input_ids": ids, "labels": ids})
        else:
            rows.append({"input_ids": ids})
    return rows


def left_pad(samples):
    """A plain pad-to-longest function, left padding, no attention mask (GPT-2 then numbers
    positions from the first column)."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.tensor([[0] * (width - len(s["input_ids"])) + s["input_ids"] for s in samples])
    return {"input_ids": ids, "labels": ids.masked_fill(ids == 0, -100)}


def bucket_pad(samples):
    """Pads to the longest row plus the number of rows: not the widest row's width."""
    width = max(len(s["input_ids"]) for s in samples) + len(samples)
    ids = torch.tensor([s["input_ids"] + [0] * (width - len(s["input_ids"])) for s in samples])
    return {"input_ids": ids}


class Misbehaves:
    """Pads to the longest row, but a batch of several rows two columns more on ``bad_rank``
    once ``bad`` is set."""

    def __init__(self, bad_rank: int) -> None:
        self.bad_rank, self.bad = bad_rank, False

    def __call__(self, samples):
        import torch.distributed as dist

        # a batch, not a row alone: the rows' widths stay right, the batch's width does not
        bad = self.bad and dist.get_rank() == self.bad_rank and len(samples) > 1
        extra = 2 if bad else 0
        width = max(len(s["input_ids"]) for s in samples) + extra
        return {"input_ids": torch.tensor([s["input_ids"] + [0] * (width - len(s["input_ids"]))
                                           for s in samples])}


def _collator(case: str):
    import transformers
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling as TrlLM

    t = transformers
    return {
        "hf_padding_right": lambda: t.DataCollatorWithPadding(_tokenizer("right")),
        "hf_padding_left_x8": lambda: t.DataCollatorWithPadding(_tokenizer("left"),
                                                                pad_to_multiple_of=8),
        "hf_lm_right": lambda: t.DataCollatorForLanguageModeling(_tokenizer("right"), mlm=False),
        "hf_lm_left_x4": lambda: t.DataCollatorForLanguageModeling(
            _tokenizer("left"), mlm=False, pad_to_multiple_of=4),
        "hf_seq2seq_right_x2": lambda: t.DataCollatorForSeq2Seq(_tokenizer("right"),
                                                                pad_to_multiple_of=2),
        "hf_seq2seq_left": lambda: t.DataCollatorForSeq2Seq(_tokenizer("left")),
        "hf_default": lambda: t.default_data_collator,
        "trl_lm_x8": lambda: TrlLM(pad_token_id=0, return_position_ids=True, pad_to_multiple_of=8),
        "plain_left": lambda: left_pad,
        # cannot be reproduced per rank: whole-batch collation, said once
        "hf_mlm": lambda: t.DataCollatorForLanguageModeling(_tokenizer("right", mask_token="t96"),
                                                            mlm=True,
                                                            mlm_probability=0.3),
        "bucket": lambda: bucket_pad,
    }[case]()


DATA = {"hf_padding_right": "classify", "hf_padding_left_x8": "classify",
        "hf_seq2seq_right_x2": "seq2seq", "hf_seq2seq_left": "seq2seq", "hf_default": "fixed",
        "trl_lm_x8": "causal_seq2seq"}
EXACT = ["hf_padding_right", "hf_padding_left_x8", "hf_lm_right", "hf_lm_left_x4",
         "hf_seq2seq_right_x2", "hf_seq2seq_left", "hf_default", "trl_lm_x8", "plain_left"]
FALLBACK = ["hf_mlm", "bucket"]
TRAIN = {  # case: (arch, data kind, collator case)
    "llama_lm_right": ("llama", "lm", "hf_lm_right"),
    "llama_lm_left_x4": ("llama", "lm", "hf_lm_left_x4"),
    "bert_padding_right": ("bert", "classify", "hf_padding_right"),
    "bert_padding_left_x8": ("bert", "classify", "hf_padding_left_x8"),
    "llama_seq2seq_left": ("llama", "causal_seq2seq", "hf_seq2seq_left"),
    "llama_default": ("llama", "fixed", "hf_default"),
    "llama_trl_x8": ("llama", "causal_seq2seq", "trl_lm_x8"),
    "gpt2_plain_left": ("gpt2", "lm", "plain_left"),
}


class Counted(torch.utils.data.Dataset):
    """A list of rows whose ``__getitem__`` counts the reads (this process only)."""

    def __init__(self, rows) -> None:
        self.rows, self.reads = rows, 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        self.reads += 1
        return self.rows[index]


class Augmented(torch.utils.data.Dataset):
    """16x16 "images" with a random flip (random), noise (torch) and brightness (numpy)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(9)
        self.images = torch.rand(N, 3, 16, 16, generator=g)
        self.labels = torch.randint(0, 5, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        x = self.images[i]
        if random.random() < 0.5:
            x = x.flip(-1)
        x = x * float(np.random.uniform(0.8, 1.2)) + 0.1 * torch.randn(x.shape)
        return {"pixel_values": x, "labels": self.labels[i]}


class RankDependent(torch.utils.data.Dataset):
    """Rows of 5 tokens, 7 when rank ``rank`` reads them: sizes differ across ranks' reads."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        import torch.distributed as dist

        return {"input_ids": [1 + i % 7] * (7 if dist.get_rank() == self.rank else 5)}


class FailsOn(torch.utils.data.Dataset):
    """Rows of ``_rows("lm")``; rank ``rank`` cannot read any row from step ``step`` on."""

    def __init__(self, rank: int, step: int, steps: list) -> None:
        self.rows, self.rank, self.step, self.steps = _rows("lm"), rank, step, steps

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        import torch.distributed as dist

        if dist.get_rank() == self.rank and len(self.steps) >= self.step:
            raise OSError(f"cannot read row {i}")
        return self.rows[i]


# ---- the loader, on every rank ---------------------------------------------------------
def _loader(data, collator, group, rank, sizes, micro, collate, schedule=None, **kw):
    from hf_cephalo.runtime.data import weighted_loader

    return weighted_loader(data, collator, batch_sizes=sizes, rank=rank,
                           microbatch_size=micro[rank], seed=SEED, shuffle=kw.pop("shuffle", True),
                           schedule=schedule, collate=collate, sample_seed=SAMPLE_SEED,
                           group=group, **kw)


def _iterate(loader, epoch: int = 1, switch=None, steps=None) -> list:
    """All steps of ``epoch`` (``switch``: (at step k, sizes, micro) recorded after step k-1)."""
    loader.set_epoch(epoch)
    out = []
    for k, microbatches in enumerate(loader):
        out.append(microbatches)
        if switch is not None and k + 1 == switch[0]:
            schedule = loader.batch_sampler.schedule
            schedule.switch(epoch * len(loader) + k + 1, switch[1], switch[2])
        if steps is not None and len(out) == steps:
            break
    return out


def _reference(data, collator, loader, rank: int, epoch: int = 1) -> list:
    """This rank's microbatches cut out of each global batch collated at once (one process,
    whole batch, every row read with ``read_sample``)."""
    from hf_cephalo.runtime.sample_reads import read_sample
    from hf_cephalo.runtime.sampler import cut_rows

    sampler, out = loader.batch_sampler, []
    for indices in sampler.iter_steps(epoch, rank=rank):
        whole = sampler.whole_step(indices)
        full = collator([read_sample(data, i, seed=SAMPLE_SEED, epoch=epoch) for i in whole])
        m = loader.dataset.microbatch_size if indices.microbatch_sizes is None \
            else max(indices.microbatch_sizes[rank], 1)
        out.append([cut_rows(full, indices.start + lo, indices.start + min(lo + m, len(indices)),
                             len(whole)) for lo in range(0, len(indices), m)])
    return out


def _same(a, b) -> bool:
    from hf_cephalo.runtime.global_width import _same as same

    return len(a) == len(b) and all(len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
                                    for x, y in zip(a, b))


def _group_of_two(rank: int, groups):
    return groups[rank // 2], rank % 2


def _loader_cases(rank: int, groups) -> dict:
    """Exactness and reads for every collator and plan, on 4 ranks and on two 2-rank groups."""
    from hf_cephalo.runtime.sampler import SplitSchedule

    out = {}
    for world, group, r in ((4, None, rank), (2, *_group_of_two(rank, groups))):
        for p, (sizes, micro) in enumerate(PLANS[world]):
            for case in EXACT + FALLBACK:
                rows = _rows(DATA.get(case, "lm"))
                collator, data, old_data = _collator(case), Counted(rows), Counted(rows)
                switch = (1, list(reversed(sizes)), list(reversed(micro))) if p == 0 else None
                torch.manual_seed(0)  # a random collator draws the same in both runs
                got_loader = _loader(data, collator, group, r, sizes, micro, "global_width",
                                     SplitSchedule(sizes, micro))
                got = _iterate(got_loader, switch=switch)
                torch.manual_seed(0)
                old_loader = _loader(old_data, collator, group, r, sizes, micro, "global_batch",
                                     SplitSchedule(sizes, micro))
                old = _iterate(old_loader, switch=switch)
                source = got_loader.dataset
                own = sum(len(x) for x in got_loader.batch_sampler.iter_steps(1, rank=r))
                out[(world, p, case, r)] = dict(
                    mode=source.mode.value, equal_old=_same(got, old),
                    equal_ref=case in FALLBACK or _same(got, _reference(rows, collator,
                                                                        got_loader, r)),
                    reads=data.reads, own=own, steps=len(got), B=sum(sizes),
                    extra=None if source._width is None else source._width.extra_reads,
                    old_reads=old_data.reads)
    return out


def _engine_run(arch, kind, case, group, rank, sizes, micro, collate, switch=None,
                data=None) -> dict:
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models import stage_model
    from hf_cephalo.runtime.sampler import SplitSchedule

    import torch.distributed as dist

    world = len(sizes)
    model = build(arch, **NO_DROPOUT.get(arch, {}))
    engine = CephaloEngine(stage_model(model), [1 / world] * world, process_group=group)
    optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
    data = data if data is not None else _rows(kind)
    loader = _loader(data, _collator(case) if case else _default(), group, rank, sizes, micro,
                     collate, SplitSchedule(sizes, micro))
    losses = []
    for microbatches in _iterate(loader, switch=switch, steps=STEPS):
        losses.append(engine.train_step(microbatches).loss)
        optimizer.step()
        engine.zero_grad()
    state = engine.full_state_dict()
    dist.barrier(group)
    return dict(losses=losses, state=None if state is None else
                {k: v.numpy() for k, v in state.items()}, mode=loader.dataset.mode.value)


def _default():
    from transformers import default_data_collator

    return default_data_collator


def _training_cases(rank: int, groups) -> dict:
    out = {}
    for world, group, r in ((4, None, rank), (2, *_group_of_two(rank, groups))):
        for p, (sizes, micro) in enumerate(PLANS[world][:2]):
            for name, (arch, kind, case) in TRAIN.items():
                collates = ("global_width", "global_batch") if p == 0 else ("global_width",)
                if p == 0 and name == "gpt2_plain_left":  # control: padding matters here
                    collates += ("microbatch",)
                for collate in collates:
                    result = _engine_run(arch, kind, case, group, r, sizes, micro, collate)
                    if r == 0:
                        out[(world, p, name, collate, rank // world)] = result
        # random augmentation: two plans, and the first plan switched to the second after step 1
        (a, ma), (b, mb) = PLANS[world][:2]
        for label, sizes, micro, switch in (("a", a, ma, None), ("b", b, mb, None),
                                            ("a_to_b", a, ma, (1, b, mb))):
            result = _engine_run("vit", None, None, group, r, sizes, micro, "global_width",
                                 switch=switch, data=Augmented())
            if r == 0:
                out[(world, "augment", label, rank // world)] = result
    return out


def _fault_cases(rank: int) -> dict:
    """Each must raise the same ValueError on every rank (and the group stays usable)."""
    import torch.distributed as dist

    from hf_cephalo.runtime.exchange import LoaderStepError

    sizes, micro, out = [2, 3, 1, 2], [1, 2, 1, 1], {}
    misbehaves = Misbehaves(bad_rank=1)
    steps: list = []
    cases = {
        "collator_width": (Counted(_rows("lm")), misbehaves),
        "rank_dependent_item": (RankDependent(rank=2), _collator("hf_lm_right")),
        "one_rank_fails": (FailsOn(rank=2, step=1, steps=steps), _collator("hf_lm_right")),
        "one_rank_fails_first_step": (FailsOn(rank=3, step=0, steps=steps),
                                      _collator("hf_lm_right")),
    }
    for name, (data, collator) in cases.items():
        misbehaves.bad = False
        steps.clear()
        loader = _loader(data, collator, None, rank, sizes, micro, "global_width")
        try:
            for _ in loader:
                steps.append(1)
                misbehaves.bad = True
            out[name] = ("no error", len(steps))
        except LoaderStepError as e:
            out[name] = (str(e), len(steps))
        dist.barrier()
    try:  # a group that is not the split's ranks: refused at construction
        _loader(Counted(_rows("lm")), left_pad, None, rank % 2, [2, 2], [1, 1], "global_width")
    except ValueError as e:
        out["wrong_group"] = str(e)
    return out


def _resume_and_eval_cases(rank: int, groups) -> dict:
    """A loader rebuilt as stock Trainer's resume rebuilds it gives the remaining steps; an
    unshuffled (evaluation) loader with a rank that never has rows."""
    from accelerate.data_loader import SkipBatchSampler
    from torch.utils.data import DataLoader

    out = {}
    rows, collator = _rows("lm"), _collator("hf_lm_left_x4")
    for sizes, micro in (([1, 3, 0, 4], [1, 2, 1, 3]), ([2, 0, 3, 1], [1, 1, 2, 1])):
        full = _iterate(_loader(Counted(rows), collator, None, rank, sizes, micro,
                                "global_width"))
        fresh = _loader(Counted(rows), collator, None, rank, sizes, micro, "global_width")
        fresh.set_epoch(1)  # as accelerate.skip_first_batches rebuilds it, before any step
        rebuilt = DataLoader(fresh.dataset, batch_sampler=SkipBatchSampler(fresh.batch_sampler, 2),
                             collate_fn=fresh.collate_fn, num_workers=fresh.num_workers)
        out[("resume", tuple(sizes))] = _same(list(rebuilt), full[2:])
        evaluation = _loader(Counted(rows), collator, None, rank, sizes, micro, "global_width",
                             shuffle=False)
        out[("eval", tuple(sizes))] = _same(_iterate(evaluation, epoch=0),
                                            _reference(rows, collator, evaluation, rank, epoch=0))
    return out


def _worker_cases(rank: int, groups) -> dict:
    """DataLoader workers read ahead (persistent), with a live switch (a stale prefetch)."""
    import multiprocessing

    from hf_cephalo.runtime.data import LoaderOptions
    from hf_cephalo.runtime.sampler import SplitSchedule

    # run_ranks' processes are daemons, which multiprocessing forbids to have children
    multiprocessing.current_process()._config["daemon"] = False
    group, r = _group_of_two(rank, groups)
    if rank >= 2:  # one 2-rank group is enough (worker start-up is slow on 2 cores)
        return {}
    sizes, micro = [1, 3], [1, 2]
    rows, collator = _rows("seq2seq"), _collator("hf_seq2seq_right_x2")
    loader = _loader(rows, collator, group, r, sizes, micro, "global_width",
                     SplitSchedule(sizes, micro), options=LoaderOptions(
                         num_workers=2, persistent_workers=True))
    got = _iterate(loader, switch=(2, [3, 1], [3, 1]))
    return {"workers": _same(got, _reference(rows, collator, loader, r)),
            "workers_mode": loader.dataset.mode.value,
            "stale_steps": loader.dataset._ahead.stale_steps}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    warnings = _Warnings()
    logging.getLogger("hf_cephalo.runtime.data").addHandler(warnings)
    out = {"loader": _loader_cases(rank, groups), "faults": _fault_cases(rank),
           "resume_eval": _resume_and_eval_cases(rank, groups),
           "training": _training_cases(rank, groups), "workers": _worker_cases(rank, groups)}
    out["warnings"] = warnings.messages
    return out


@pytest.fixture(scope="module")
def job():
    return run_ranks(_job, 4, timeout_s=JOB_S * 6)


def _merged(job, key: str) -> dict:
    return {k: v for result in job for k, v in result[key].items()}


def test_rows_equal_the_whole_batch_collation(job):
    """Every collator users run, every plan (a rank without rows, a partial last batch, a live
    switch, 4 ranks and two 2-rank groups): each rank's microbatches are its rows of the whole
    global batch collated at once, and today's whole-batch collation's."""
    results = _merged(job, "loader")
    assert len(results) == (2 * 4 + 3 * 2) * len(EXACT + FALLBACK)
    for (world, plan, case, rank), got in results.items():
        if case in EXACT:
            assert got["mode"] == "global_width", (world, plan, case, rank)
            assert got["equal_ref"] and got["equal_old"], (world, plan, case, rank)


def test_each_rank_reads_its_own_rows(job):
    """Counted in ``__getitem__``: the own rows (b_i per full step), the first step's global
    batch once (the collator check), and at most one extra row per padded axis and step
    (seq2seq pads two axes); today's whole-batch collation reads all B rows every step."""
    for (world, plan, case, rank), got in _merged(job, "loader").items():
        assert got["old_reads"] == N, (world, plan, case, rank)  # B per step = the epoch
        if case in EXACT:
            axes = 2 if "seq2seq" in case else 1
            assert got["reads"] == got["B"] + got["own"] + got["extra"], (case, got)
            assert got["extra"] <= axes * got["steps"], (case, got)
            if case == "hf_default":  # one width: never an extra row
                assert got["extra"] == 0


def test_collators_it_cannot_reproduce_fall_back_once(job):
    """Random masking and a width that is not the widest row's: the whole-batch collation
    (equal to collate='global_batch'), said once per collator by rank 0 of the ranks that
    split the batch (the 4-rank world's and the second 2-rank group's)."""
    for (world, plan, case, rank), got in _merged(job, "loader").items():
        if case in FALLBACK:
            assert got["mode"] == "global_batch" and got["equal_old"], (case, got)
            assert got["reads"] == got["B"] + N  # the check, then every row of every step
    assert not job[1]["warnings"] and not job[3]["warnings"]  # rank 0 of each group says it
    for said in (job[0]["warnings"], job[2]["warnings"]):
        assert len(said) == 2, said  # once per collator, for all its loaders
        assert any("DataCollatorForLanguageModeling" in m and "random masks" in m for m in said)
        assert any("bucket_pad" in m and "not the widest rows'" in m for m in said)


def _close(got, ref) -> bool:
    return torch.allclose(torch.tensor(got, dtype=torch.float64),
                          torch.tensor(ref, dtype=torch.float64), rtol=RTOL, atol=ATOL)


def _train_reference(arch: str, data, collator, batch_size: int) -> dict:
    """One process, each global batch collated at once, the plain HF forward/backward."""
    from hf_cephalo.runtime.sample_reads import read_sample
    from hf_cephalo.runtime.sampler import global_batches

    model = build(arch, **NO_DROPOUT.get(arch, {})).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    extra = {"use_cache": False} if arch in ("llama", "gpt2") else {}
    losses = []
    for batch in global_batches(len(data), batch_size, epoch=1, seed=SEED)[:STEPS]:
        rows = collator([read_sample(data, i, seed=SAMPLE_SEED, epoch=1) for i in batch])
        optimizer.zero_grad()
        loss = model(**rows, **extra).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return dict(losses=losses, state=model.state_dict())


def _check_training(got: dict, ref: dict, what) -> None:
    assert _close(got["losses"], ref["losses"]), (what, got["losses"], ref["losses"])
    assert set(got["state"]) == set(ref["state"]), what
    for key, value in ref["state"].items():
        torch.testing.assert_close(torch.from_numpy(got["state"][key]), value, rtol=RTOL,
                                   atol=ATOL, msg=lambda m, key=key: f"{what} {key}: {m}")


def test_training_equals_the_full_batch(job):
    """Losses and final weights of the engine fed by global_width (two plans on 4 ranks and on
    two 2-rank groups) equal the single-process full batch, and global_batch's; per-microbatch
    collation of left-padded GPT-2 without position ids does not (the data is padding-sensitive)."""
    results = _merged(job, "training")
    for name, (arch, kind, case) in TRAIN.items():
        refs = {}
        runs = {k: v for k, v in results.items() if k[1] != "augment" and k[2] == name}
        control = {k: runs.pop(k) for k in list(runs) if k[3] == "microbatch"}
        assert len(runs) == 3 + 2 * 3, (name, list(runs))  # the 4-rank world, two groups
        for (world, plan, _, collate, group), got in control.items():
            ref = _train_reference(arch, _rows(kind), _collator(case), sum(PLANS[world][plan][0]))
            assert not _close(got["losses"], ref["losses"]), (world, group, got["losses"])
        assert len(control) == (3 if name == "gpt2_plain_left" else 0)
        for (world, plan, _, collate, group), got in runs.items():
            assert got["mode"] == collate, (name, collate)
            batch_size = sum(PLANS[world][plan][0])
            if batch_size not in refs:
                refs[batch_size] = _train_reference(arch, _rows(kind), _collator(case),
                                                    batch_size)
            _check_training(got, refs[batch_size], (world, plan, name, collate, group))


def test_random_augmentation_does_not_depend_on_the_plan(job):
    """A random flip / noise / brightness per sample: plan a, plan b and a switched from a to
    b after the first step train identically (the reference reads each row under its seed)."""
    results = _merged(job, "training")
    for world in (4, 2):
        ref = _train_reference("vit", Augmented(), _default(), sum(PLANS[world][0][0]))
        for label in ("a", "b", "a_to_b"):
            for group in range(4 // world):
                _check_training(results[(world, "augment", label, group)], ref,
                                (world, label, group))


def test_faults_raise_the_same_error_on_every_rank(job):
    """A collator whose batch is wider than the global width on one rank, a dataset whose
    row sizes depend on the reading rank, a rank that cannot read (from the second step, and
    in the first step's collator check): the same ValueError on every rank, naming the
    collator, the index or the failing rank; no hang, and the group stays usable."""
    faults = [result["faults"] for result in job]
    for name in ("collator_width", "rank_dependent_item", "one_rank_fails",
                 "one_rank_fails_first_step"):
        messages = {f[name] for f in faults}
        assert len(messages) == 1, (name, messages)  # identical on every rank, same step
        (message, steps), = messages
        if name == "collator_width":
            assert steps == 1 and "failed on rank 1" in message and \
                "data collator Misbehaves returned input_ids[1] of width" in message, message
        elif name == "rank_dependent_item":
            assert steps == 0 and "dataset item" in message and "width 5" in message, message
        elif name == "one_rank_fails":
            assert steps == 1 and "failed on rank 2: OSError: cannot read row" in message
        else:
            assert steps == 0 and "checking the collator" in message and \
                "failed on rank 3: OSError" in message, message
    assert all("the split has 2 ranks" in f["wrong_group"] for f in faults)


def test_resumed_and_evaluation_loaders(job):
    """A loader rebuilt as stock Trainer's resume rebuilds it (skip_first_batches) gives the
    remaining steps; an unshuffled loader with a rank that never has rows is exact."""
    for result in job:
        assert all(result["resume_eval"].values()), result["resume_eval"]


def test_dataloader_workers_read_ahead(job):
    """Two persistent workers per rank read ahead; a live switch makes a prefetched step stale
    (read again in the main process): still exact."""
    for result in job[:2]:
        assert result["workers"] == {"workers": True, "workers_mode": "global_width",
                                     "stale_steps": 1}
