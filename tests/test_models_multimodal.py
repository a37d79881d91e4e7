"""Text-only fine-tuning of a vision-language model's language model on the generic path.

``AutoModelForCausalLM`` returns ``Gemma3ForConditionalGeneration`` for Gemma 3 4B+: its own
forward on text runs the language model's layer stack only (the vision tower and projector
are never called), returns logits over the vocabulary and the shifted next-token loss. The
generic path stages it where the self-check proves that on a tiny copy; a microbatch with
image inputs is refused (the staging is proven for text only); a class whose text forward
is a causal LM the path cannot stage exactly is refused with its class, the reason and what
to do.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from hf_cephalo.models import stage_model
from hf_cephalo.models.generic import GenericCausalLM, TextOnlyInputError
from hf_cephalo.models.registry import UnsupportedModelError
from tests.models_fixtures import grads, split, staged_backward


def _gemma3_vlm() -> transformers.Gemma3ForConditionalGeneration:
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=96, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, sliding_window=4, final_logit_softcapping=3.0,
                         query_pre_attn_scalar=8),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4)
    config.text_config.layer_types = ["sliding_attention", "full_attention"]
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():  # norm weights off their initial value, so a skipped norm shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
    return model


def _text_batch(rows: int = 5, seq: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 88, (rows, seq), generator=g)
    lengths = torch.tensor([10, 6, 9, 4, 10])[:rows]
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_gemma3_vlm_text_only_is_staged_and_exact():
    """The language model's stack is picked by what the text forward runs; the never-called
    vision tower and projector sit on the head side and get no gradient, as in the model's
    own backward; staged loss and every gradient over two microbatches equal the model's."""
    model = _gemma3_vlm()
    staged = stage_model(model)
    assert type(staged) is GenericCausalLM
    assert staged.layout.layers == "model.language_model.layers" and staged.num_units == 2
    assert set(staged.layout.unused) == {"model.vision_tower", "model.multi_modal_projector"}
    head = {id(p) for m in staged.head_modules() for p in m.parameters()}
    assert all(id(p) in head for p in model.model.vision_tower.parameters())
    staged.prepare_for_training()

    batch = _text_batch()
    model.zero_grad(set_to_none=True)
    ref_loss = model(**batch).loss
    ref_loss.backward()
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    microbatches = split(batch, [3, 2])
    num_items = sum(staged.count_items(mb) for mb in microbatches)
    loss = staged_backward(staged, microbatches, num_items)
    got = grads(model)

    torch.testing.assert_close(torch.tensor(loss), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert ref.keys() == got.keys()
    trained = 0
    for name, r in ref.items():
        g = got[name]
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            assert r is None and g is None, name  # not called on text: not trained
            continue
        assert r is not None and g is not None, name
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        trained += 1
    assert trained == sum(1 for n in ref if n.startswith(("model.language_model.", "lm_head.")))


def test_image_inputs_are_refused_before_anything_runs():
    """pixel_values (or any forward input the self-check did not run, token_type_ids here)
    is refused with a clear message, already when the engine counts items (before a step's
    first collective); text keys and position_ids pass."""
    staged = stage_model(_gemma3_vlm())
    batch = _text_batch(rows=2)
    batch["position_ids"] = torch.arange(10).expand(2, 10)
    assert staged.count_items(batch) > 0
    image = dict(batch, pixel_values=torch.zeros(2, 3, 28, 28))
    for call in (staged.count_items, staged.embed):
        with pytest.raises(TextOnlyInputError, match=r"Gemma3ForConditionalGeneration is staged "
                                                     r"for text-only fine-tuning") as info:
            call(image)
        text = str(info.value)
        assert "pixel_values" in text and "model.vision_tower" in text
        assert "Drop that key" in text
    with pytest.raises(ValueError, match="carries token_type_ids"):
        staged.count_items(dict(batch, token_type_ids=torch.zeros_like(batch["input_ids"])))


def test_a_causal_lm_the_path_cannot_stage_is_refused_with_class_reason_and_remedy(monkeypatch):
    """Gemma4ForConditionalGeneration's text forward is a causal LM's; with KV sharing
    (num_kv_shared_layers > 0) it stages, its store layers making the keys / values the later
    layers reuse (models/kv_sharing.py; once refused here, as its per-layer inputs were). Where
    the staging cannot take the sharing (no attribute marks the store layers: the check's
    finding patched away) it is refused by name, reason and what to do, not told that its head
    is none hf_cephalo trains."""
    from hf_cephalo.models import kv_sharing, self_check
    from hf_cephalo.models.shrink import tiny_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = tiny_config(transformers.Gemma4Config(text_config=dict(num_kv_shared_layers=10)))
        model = transformers.Gemma4ForConditionalGeneration(config)
    staged = stage_model(model)
    assert staged.layout.kv is not None and staged.layout.side
    assert any(staged.produces_side_inputs(i) for i in range(staged.num_units))
    monkeypatch.setattr(kv_sharing, "_markers", lambda layers, stores: [])
    monkeypatch.setattr(self_check, "_CACHE", {})
    with pytest.raises(UnsupportedModelError) as info:
        stage_model(model)
    text = str(info.value)
    assert text.startswith("hf_cephalo cannot train Gemma4ForConditionalGeneration exactly: its "
                           "own forward on text")
    assert "no boolean attribute of the layers marks the storing ones" in text
    assert "register_adapter(Gemma4ForConditionalGeneration" in text
    assert "docs/adding_a_model.md" in text and "Nothing was run" in text
    assert "Gemma4ForCausalLM is no way around" in text and "none of those" not in text


def test_profiling_input_of_a_vision_language_class():
    """Profiling at start builds token ids from the TEXT config's vocabulary (a vision-language
    class keeps ``vocab_size`` there): a Gemma 3 VLM with no plan used to fail here, before
    training, asking for a ``make_microbatch`` no door takes."""
    from hf_cephalo.profiler.inputs import synthetic_microbatch

    model = _gemma3_vlm()
    mb = synthetic_microbatch(model, 3, 8)
    vocab = model.config.get_text_config().vocab_size
    assert mb["input_ids"].shape == (3, 8) and int(mb["input_ids"].max()) < vocab
    with torch.no_grad():  # the model's own forward takes it (text only)
        assert model(**mb).loss is not None


def _one_rank_refused(rank: int, world: int, _root: str) -> str:
    from hf_cephalo.engine import CephaloEngine

    engine = CephaloEngine(stage_model(_gemma3_vlm()), [0.5, 0.5])
    batch = _text_batch(2)
    if rank == 0:  # only this rank's batch carries images
        batch["pixel_values"] = torch.zeros(2, 3, 28, 28)
    try:
        engine.train_step([batch])
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def test_a_microbatch_refused_on_one_rank_is_refused_on_every_rank(tmp_path):
    """Only rank 0's microbatch carries pixel_values: rank 0 raises its TextOnlyInputError,
    rank 1 a ValueError naming rank 0, both at the step's first all-reduce (before, rank 1 went
    on into the all-gathers rank 0 never reached and died of a closed connection)."""
    from tests.dist_utils import budget_s, run_ranks

    first, second = run_ranks(_one_rank_refused, 2, str(tmp_path), timeout_s=budget_s(20))
    assert first.startswith("TextOnlyInputError") and "pixel_values" in first, first
    assert second.startswith("ValueError") and "rank(s) [0]" in second, second
