"""Decoder sequence classifiers equal stock in one process (issue 33, item 5).

``LlamaForSequenceClassification``, ``MistralForSequenceClassification``,
``Qwen2ForSequenceClassification`` and ``GPT2ForSequenceClassification``: the staged logits, loss
and gradients equal ``model(**batch)`` (transformers 5.24, eval mode, after
``prepare_for_training()``) on batches with no, right and left padding, split into microbatches
of different sizes; every ``problem_type`` (single-label with -100, regression, multi-label);
the pooled position is each row's last non-pad token; ``pad_token_id=None`` follows stock (one
row pools the last position, more rows are refused). The engine on 2 and 3 ranks:
tests/test_models_seqcls_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from hf_cephalo.models import stage_model
from hf_cephalo.models.hf_common import LastTokenClassifierStagedModel
from tests.models_fixtures import (PAD, PROBLEMS, SEQ, SEQ_CLS_BUILDERS, build, grads, make_batch,
                                   split, staged_backward, staged_logits, with_problem)

ARCHS = list(SEQ_CLS_BUILDERS)
PADDINGS = (False, "right", "left")
SPLITS = ([5], [2, 3], [1, 1, 3])
# problem type -> paddings: every padding for single-label; the other losses (same pooling) with
# one each. Each padding catches another wrong pooler: position -1 fails right padding, "number of
# attended tokens - 1" fails left padding.
PADDINGS_OF = {"single_label_classification": PADDINGS, "regression": ("right",),
               "multi_label_classification": ("left",)}
RTOL, ATOL = 1e-5, 1e-6


def _staged_loss(staged, microbatches) -> tuple[float, int]:
    loss_sum, num_items = 0.0, 0
    for mb in microbatches:
        hidden, ctx = staged.embed(mb)
        for i in range(staged.num_units):
            hidden = staged.run_unit(i, hidden, ctx)
        out = staged.head_loss(hidden, mb, ctx)
        both = staged.head_loss_and_logits(hidden, mb, ctx)  # evaluation's one head pass
        assert out.num_items == both.loss.num_items == staged.count_items(mb)
        assert torch.equal(both.loss.loss_sum, out.loss_sum)
        loss_sum += float(out.loss_sum)
        num_items += out.num_items
    return loss_sum, num_items


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_loss_equal_stock(arch):
    for problem, overrides in PROBLEMS.items():
        model = build(arch, **overrides)
        staged = stage_model(model)
        assert isinstance(staged, LastTokenClassifierStagedModel)
        staged.prepare_for_training()
        for padding in PADDINGS_OF[problem]:
            batch = with_problem(make_batch(arch, 5, seed=1, padding=padding), problem)
            what = f"{arch}/{problem}/padding={padding}"
            with torch.no_grad():
                ref = model(**batch)
                assert model.config.problem_type == problem  # stock resolved the same type
                for sizes in SPLITS:
                    mbs = split(batch, sizes)
                    logits = torch.cat([staged_logits(staged, mb) for mb in mbs])
                    torch.testing.assert_close(logits, ref.logits, rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"{what}/{sizes} logits: {m}")
                    loss_sum, num_items = _staged_loss(staged, mbs)
                    expected_items = 4 if problem == "single_label_classification" \
                        else batch["labels"].numel()
                    assert num_items == expected_items, what
                    torch.testing.assert_close(torch.tensor(loss_sum / num_items),
                                               ref.loss.detach(), rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"{what}/{sizes} loss: {m}")


@pytest.mark.parametrize("arch", ARCHS)
def test_grads_equal_stock(arch):
    """Layered backward (detached unit inputs, recompute, loss_sum / N per microbatch) gives the
    full-batch gradient of ``model(**batch).loss``, left and right padding."""
    for padding in ("right", "left"):
        model = build(arch)
        batch = make_batch(arch, 5, seed=2, padding=padding)
        model(**batch).loss.backward()
        ref = grads(model)
        model.zero_grad(set_to_none=True)
        staged = stage_model(model)
        staged.prepare_for_training()
        staged_backward(staged, split(batch, [3, 2]), staged.count_items(batch))
        got = grads(model)
        assert set(got) == set(ref)
        assert all(g is not None and g.abs().sum() > 0 for g in got.values())
        for name, value in ref.items():
            torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{arch}/{padding}: {name}: {m}")


@pytest.mark.parametrize("arch", ["llama_cls", "gpt2_cls"])
def test_pooled_position_is_the_last_non_pad_token(arch):
    """Each row's logits are the score of its rightmost non-pad token (transformers'
    rule, ``input_ids != pad_token_id``, not the attention mask): right padding, left padding,
    a pad token inside the row, a row of pads only (position 0); and position -1 differs, so
    the pooling really moved."""
    model = build(arch)
    staged = stage_model(model)
    ids = torch.randint(1, 97, (4, SEQ), generator=torch.Generator().manual_seed(5))
    ids[0, 7:] = PAD                   # right padding: last non-pad at 6
    ids[1, :4] = PAD                   # left padding: last non-pad at SEQ - 1
    ids[2, 3] = PAD                    # a pad inside the row ...
    ids[2, 9:] = PAD                   # ... and at its end: last non-pad at 8
    ids[3, :] = PAD                    # only pads: argmax of zeros = position 0
    batch = {"input_ids": ids, "attention_mask": (ids != PAD).long()}
    batch["attention_mask"][3, 0] = 1  # one attended position keeps the row's softmax finite
    with torch.no_grad():
        hidden, ctx = staged.embed(batch)
        for i in range(staged.num_units):
            hidden = staged.run_unit(i, hidden, ctx)
        scores = []  # the score layer's output on every position, (4, SEQ, NUM_LABELS)
        handle = model.score.register_forward_hook(lambda m, a, out: scores.append(out))
        pooled = staged.head_logits(hidden, batch, ctx)
        handle.remove()
        every = scores[0]
        ref = model(**batch).logits
    expected = every[torch.arange(4), torch.tensor([6, SEQ - 1, 8, 0])]
    torch.testing.assert_close(pooled, expected, rtol=0, atol=0)
    torch.testing.assert_close(pooled, ref, rtol=RTOL, atol=ATOL)
    assert (every[0, -1] - pooled[0]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["llama_cls", "gpt2_cls"])
def test_pad_token_none_as_stock(arch):
    """``pad_token_id=None``: a one-row microbatch pools its last position (as stock's batch of
    one); a microbatch of two rows is refused as stock refuses a batch of two, by ValueError
    naming the setting, already in ``count_items`` (before the engine's first collective)."""
    model = build(arch, pad_token_id=None)
    staged = stage_model(model)
    batch = make_batch(arch, 2, seed=3)
    one = {k: v[:1] for k, v in batch.items()}
    with torch.no_grad():
        torch.testing.assert_close(staged_logits(staged, one), model(**one).logits,
                                   rtol=RTOL, atol=ATOL)
        assert staged.count_items(one) == 1
        with pytest.raises(ValueError, match="Cannot handle batch sizes > 1"):
            model(**batch)
        with pytest.raises(ValueError, match=r"pad_token_id is None.*microbatch of 2 rows.*"
                                             r"set model.config.pad_token_id"):
            staged.count_items(batch)
        hidden, ctx = staged.embed(batch)
        with pytest.raises(ValueError, match="pad_token_id is None"):
            staged.head_logits(hidden, batch, ctx)
    # a plan whose m_i exceed 1 on ANY rank is refused by every rank from the plan alone (the
    # session checks it before the first collective), not only by the ranks that hold such
    # microbatches (which would leave the others waiting in the step's all-reduce)
    staged.check_microbatch_sizes([1, 0, 1])
    with pytest.raises(ValueError, match="pad_token_id is None.*microbatch of 2 rows"):
        staged.check_microbatch_sizes([1, 2, 0])
    stage_model(build(arch)).check_microbatch_sizes([4, 2])  # with a pad token: any size


def test_items_are_samples_without_minus_100():
    staged = stage_model(build("qwen2_cls"))
    batch = make_batch("qwen2_cls", 4, padding="left")
    assert staged.count_items(batch) == 4
    batch["labels"][2] = -100
    assert staged.count_items(batch) == 3
    del batch["labels"]
    assert staged.count_items(batch) == 0  # predict on unlabeled data


def test_structure_reuses_the_decoder_body():
    """The GPT-2 classifier's units and embedding are the causal LM adapter's (one body); only
    the head modules differ: ln_f + score, no lm_head. The generic classifiers' head ends with
    the model's own score."""
    from hf_cephalo.models.gpt2 import GPT2DecoderBody

    for arch in ("llama_cls", "mistral_cls", "qwen2_cls", "gpt2_cls"):
        model = build(arch)
        staged = stage_model(model)
        assert staged.head_modules()[-1] is model.score
        assert "lm_head" not in dict(model.named_modules())
    staged = stage_model(build("gpt2_cls"))
    assert isinstance(staged, GPT2DecoderBody)
    for name in ("units", "embed_modules", "embed", "run_unit"):
        assert getattr(type(staged), name) is getattr(GPT2DecoderBody, name), name