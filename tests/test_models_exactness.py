"""Staged forward / loss of every adapter equals the Hugging Face model's own (issue 4, item 2).

Reference: ``model(**batch)`` on the full batch in eval mode (dropout off) after
``prepare_for_training()`` (use_cache off, the training semantics: with a cache HF skips packed-
sequence detection). Staged runs split the batch into microbatches of DIFFERENT sizes, so each
microbatch builds its own masks and rotary cos/sin.
"""

from __future__ import annotations

import pytest
import torch

from hf_cephalo.models import stage_model
from tests.models_fixtures import (BUILDERS, CAUSAL, build, make_batch, split, staged_logits)

CASES = {"plain": {}, "right_padding": {"padding": True}, "packed": {"packed": True}}
SPLITS = ([5], [2, 3], [4, 1], [1, 1, 3])
ARCHS = [*BUILDERS, "qwen2_sliding"]


def _build(arch: str) -> torch.nn.Module:
    if arch == "qwen2_sliding":  # layer 0 full attention, layer 1 a sliding window of 4 tokens
        return build("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    return build(arch)


def _batch_arch(arch: str) -> str:
    return "qwen2" if arch == "qwen2_sliding" else arch


@pytest.mark.parametrize("arch", ARCHS)
def test_staged_logits_and_loss_equal_model(arch):
    model = _build(arch)
    staged = stage_model(model)
    staged.prepare_for_training()
    cases = {"plain": {}} if arch == "vit" else CASES
    for case, kw in cases.items():
        batch = make_batch(_batch_arch(arch), 5, seed=1, **kw)
        with torch.no_grad():
            ref = model(**batch)
            for sizes in SPLITS:
                microbatches = split(batch, sizes)
                logits = torch.cat([staged_logits(staged, mb) for mb in microbatches])
                torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-5,
                                           msg=lambda m: f"{arch}/{case}/{sizes}: {m}")
                loss_sum, num_items = 0.0, 0
                for mb in microbatches:
                    hidden, ctx = staged.embed(mb)
                    for i in range(staged.num_units):
                        hidden = staged.run_unit(i, hidden, ctx)
                    out = staged.head_loss(hidden, mb, ctx)
                    assert out.num_items == staged.count_items(mb)
                    both = staged.head_loss_and_logits(hidden, mb, ctx)  # evaluation's one pass
                    assert both.loss.num_items == out.num_items
                    assert torch.equal(both.loss.loss_sum, out.loss_sum)
                    assert torch.equal(both.logits, staged.head_logits(hidden, mb, ctx))
                    loss_sum += out.loss_sum.item()
                    num_items += out.num_items
                torch.testing.assert_close(torch.tensor(loss_sum / num_items), ref.loss.detach(),
                                           rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{arch}/{case}/{sizes} loss: {m}")


@pytest.mark.parametrize("arch", CAUSAL)
def test_count_items_is_shifted_non_ignored_labels(arch):
    staged = stage_model(build(arch))
    batch = make_batch(arch, 3, padding=True)
    labels = batch["labels"]
    expected = int((labels[:, 1:] != -100).sum())  # position t predicts label t+1
    assert staged.count_items(batch) == expected
    assert expected < labels.numel() - labels.shape[0]  # the batch really has ignored labels


def test_classification_items_are_samples_and_ignore_minus_100():
    staged = stage_model(build("bert"))
    batch = make_batch("bert", 4)
    assert staged.count_items(batch) == 4
    batch["labels"][1] = -100
    assert staged.count_items(batch) == 3
    with torch.no_grad():
        ref = staged.model(**batch).loss
        hidden, ctx = staged.embed(batch)
        for i in range(staged.num_units):
            hidden = staged.run_unit(i, hidden, ctx)
        out = staged.head_loss(hidden, batch, ctx)
    torch.testing.assert_close(out.loss_sum / out.num_items, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("problem", ["regression", "multi_label_classification"])
def test_bert_other_problem_types(problem):
    num_labels = 1 if problem == "regression" else 3
    model = build("bert", num_labels=num_labels, problem_type=problem)
    staged = stage_model(model)
    batch = make_batch("bert", 4)
    g = torch.Generator().manual_seed(3)
    batch["labels"] = (torch.randn(4, generator=g) if num_labels == 1
                       else torch.randint(0, 2, (4, 3), generator=g).float())
    with torch.no_grad():
        ref = model(**batch).loss
        hidden, ctx = staged.embed(batch)
        for i in range(staged.num_units):
            hidden = staged.run_unit(i, hidden, ctx)
        out = staged.head_loss(hidden, batch, ctx)
    assert out.num_items == staged.count_items(batch) == batch["labels"].numel()
    torch.testing.assert_close(out.loss_sum / out.num_items, ref, rtol=1e-5, atol=1e-6)


def test_packed_rows_equal_separate_sequences():
    """The packed case really is block-diagonal: the second packed sequence's logits equal
    those of that sequence run alone (positions restart at 0)."""
    model = build("llama")
    staged = stage_model(model)
    staged.prepare_for_training()
    batch = make_batch("llama", 1, packed=True)
    cut = int((batch["position_ids"][0] == 0).nonzero()[1])
    with torch.no_grad():
        packed = staged_logits(staged, {"input_ids": batch["input_ids"],
                                        "position_ids": batch["position_ids"]})
        alone = staged_logits(staged, {"input_ids": batch["input_ids"][:, cut:]})
        unpacked = staged_logits(staged, {"input_ids": batch["input_ids"]})
    torch.testing.assert_close(packed[:, cut:], alone, rtol=0, atol=1e-5)
    assert (unpacked[:, cut:] - alone).abs().max() > 1e-3  # without position_ids it differs


DROPOUT = {"llama": {"attention_dropout": 0.1}, "gpt2": {}, "bert": {},
           "vit": {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1},
           "gpt_neox": {"hidden_dropout": 0.1, "attention_dropout": 0.1}}


@pytest.mark.parametrize("arch", list(DROPOUT))
def test_training_mode_dropout_sites_match(arch):
    """In training mode, one microbatch consumes the RNG in the same order as the model's own
    forward (embedding dropout, each layer, head dropout), so with the same seed the outputs
    are identical: every dropout sits where the model has it."""
    model = build(arch, **DROPOUT[arch]).train()
    staged = stage_model(model)
    staged.prepare_for_training()
    batch = make_batch(arch, 3, seed=9, padding=arch != "vit")
    with torch.no_grad():
        torch.manual_seed(0)
        ref = model(**batch).logits
        torch.manual_seed(0)
        got = staged_logits(staged, batch)
        torch.manual_seed(1)
        other = model(**batch).logits
    assert (other - ref).abs().max() > 1e-4  # dropout is really active
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
