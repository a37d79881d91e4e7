"""The generic path's task heads (issue 47): image classification, token classification, masked
LM and question answering staged exactly, as are the seq2seq and speech mappings' classes with
an encoder-decoder adapter; every other class of those mappings refused with one clear error,
never a raw exception.

The full sweep over transformers' mappings is ``benchmarks/model_coverage.py --tasks all``
(minutes; its table is docs/supported_models.md, and it exits 1 on any WRONG or CRASH row). CI
checks a representative subset of each mapping with the same independent comparison (5 rows
cut into microbatches of 2 and 3; staged loss and every gradient against the model's own,
fp32, rtol 1e-5 / atol 1e-6), the classes that used to crash with a raw AttributeError, and
that the generated page agrees.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import transformers

from benchmarks.model_coverage import DOCS, check, classes, compare
from hf_cephalo.models import stage_model
from hf_cephalo.models.registry import UnsupportedModelError

EXACT = {
    "image-classification": ["Dinov2ForImageClassification", "DeiTForImageClassification",
                             "ConvNextForImageClassification"],
    # XLNet: its transformer holds mask_emb beside the layers (the head side owns it alone);
    # ALBERT: repeated layer calls (models/generic_repeats.py)
    "token-classification": ["BertForTokenClassification", "DebertaV2ForTokenClassification",
                             "XLNetForTokenClassification", "AlbertForTokenClassification"],
    # LUKE: its 500k-entity vocabulary shrunk (models/shrink.py), entity inputs left out
    # NeoMME: a head width whose partial rotary part is a multiple of 4 (models/shrink.py)
    "masked-lm": ["BertForMaskedLM", "ModernBertForMaskedLM", "RobertaForMaskedLM",
                  "LukeForMaskedLM", "NeoMMEForMaskedLM"],
    "question-answering": ["RobertaForQuestionAnswering", "XLMRobertaForQuestionAnswering",
                           "MvpForQuestionAnswering",  # MVP's units, a new H
                           "XLNetForQuestionAnsweringSimple",  # ...Simple: the span head
                           "T5ForQuestionAnswering",  # on the decoder (models/seq2seq_heads.py)
                           # its rows hold 3 separators (generic_heads.QA_SEPARATORS)
                           "LongformerForQuestionAnswering"],
    # LongT5's local attention (seq2seq_t5_kin.py); BART's kin (models/seq2seq_kin.py): FSMT's
    # sequence-first layers, MVP's layer calls, PEGASUS-X's global tokens joined into the
    # boundary; Moonshine's raw-audio front end
    # T5Gemma's and T5Gemma 2's Gemma stacks (models/seq2seq_gemma.py; T5Gemma 2 on text)
    "seq2seq-lm": ["LongT5ForConditionalGeneration", "FSMTForConditionalGeneration",
                   "MvpForConditionalGeneration", "PegasusXForConditionalGeneration",
                   "T5GemmaForConditionalGeneration", "T5Gemma2ForConditionalGeneration"],
    # Pop2Piano: T5 on the features its extractor gives (models/seq2seq_t5_kin.py)
    "speech-seq2seq": ["MoonshineForConditionalGeneration", "Pop2PianoForConditionalGeneration"],
}
EXACT["token-classification"].append("T5ForTokenClassification")  # layer 0's bias, handed on
# document models, on the boxes / HTML paths their forward takes (models/document_inputs.py):
# MarkupLM's per-depth xpath embedding lists are no layer stacks; LayoutLMv3's box embeddings
# are sixths of its width (shrink.BOX_EMBEDDINGS) and its relative-position tables are read,
# never called; Bros requires boxes and derives even sinusoid widths from its width
EXACT["token-classification"] += ["MarkupLMForTokenClassification",
                                  "LayoutLMv3ForTokenClassification", "BrosForTokenClassification"]
EXACT["question-answering"] += ["MarkupLMForQuestionAnswering", "LayoutLMv3ForQuestionAnswering"]
REFUSED = {  # class -> what its refusal says
    "PoolFormerForImageClassification": "layer stacks",  # stages are bare lists: no stage
    # reshapes each stage's tokens into an image-shaped map before the next stage
    "PvtV2ForImageClassification": "changes the hidden states between its layers",
    "MobileNetV2ForImageClassification": "BatchNorm layers",  # per-microbatch statistics
    "ResNetForImageClassification": "BatchNorm layers",
    "EfficientNetForImageClassification": "BatchNorm layers",  # its depth_coefficient shrunk
    "DeiTForImageClassificationWithTeacher": "this head is none of those",
    "M2M100ForConditionalGeneration": "has layer drop 0.05",  # its default config's
    "CohereAsrForConditionalGeneration": "encoder-decoder model",  # Whisper: an adapter
    "SwitchTransformersForConditionalGeneration": "router z-loss",  # whole-batch MoE losses
    # a span head now, refused for its layers: parallel lists of attentions and ffns (its
    # lists of norms beside them are lists of leaf modules, no layer stacks)
    "XLMForQuestionAnsweringSimple": "has 2 layer stacks",
    # its ids are Unicode code points (no vocab_size): the check's batch builds, and its
    # forward runs three stacks (characters, downsampled deep stack, characters again)
    "CanineForQuestionAnswering": "has 3 layer stacks",
    # its axial position widths now split the tiny width (models/shrink.py); its layers run
    # inside its reversible _ReversibleFunction (models/forward_refusals.py)
    "ReformerForQuestionAnswering": "inside the custom autograd function _ReversibleFunction",
    # d_latents shrunk (models/shrink.py); its decoder queries max_position_embeddings
    # positions whatever the row length (models/forward_refusals.py)
    "PerceiverForMaskedLM": "its head predicts a fixed number of positions",
    # each layer returns its layout stream beside its hidden states, and the next reads both
    "LiltForQuestionAnswering": "carry a second stream of hidden states (layer 1 takes "
                                "layout_inputs",
}


def _types(mapping: str) -> dict[str, str]:
    return {name: t for t, name in classes(seq_cls=False, mapping=mapping)}


def test_subset_of_each_mapping_is_exact_and_docs_agree():
    rows = [check(_types(mapping)[name], name, mapping)
            for mapping, names in EXACT.items() for name in names]
    bad = [(r.name, r.status, r.detail) for r in rows if r.status != "exact"]
    assert not bad, bad
    docs = Path(DOCS).read_text()
    version = re.search(r"transformers (\S+) and torch", docs).group(1)
    if version != transformers.__version__:
        pytest.skip(f"docs/supported_models.md was generated with transformers {version}")
    for mapping, names in EXACT.items():
        assert f"## {mapping} (" in docs, mapping
        for name in names:
            if f"`{name}`" in docs:  # a partial sweep's page lists the classes it reached
                assert re.search(rf"\| `{name}` \| exact \|", docs), name
    for summary in re.findall(r"of those \d+ are exact .*", docs)[1:]:  # the task sections
        assert summary.endswith("0 wrong, 0 crash."), summary


def test_gemma_encoder_decoders_and_pop2piano_off_the_sweeps_batch():
    """What the sweep's batch leaves out, each against the model's own loss and gradients
    (``compare``): T5Gemma (models/seq2seq_gemma.py) without ``attention_mask`` (each stack's
    default mask from its pad tokens, the cross-attention unmasked, as its forward does) and
    with per-row ``position_ids`` / ``decoder_position_ids`` and a ``decoder_attention_mask``;
    T5Gemma 2 with its end-of-image token among the tokens (its own embedding); Pop2Piano on
    ``input_ids`` (the sweep feeds it features). T5Gemma 2's ``pixel_values`` are refused
    when counting items (text only: its vision tower is never run)."""
    from hf_cephalo.models.generic import TextOnlyInputError
    from hf_cephalo.models.shrink import tiny_config
    from tests.zoo_fixtures import build_zoo, seq2seq_batch

    batch = seq2seq_batch(5, seed=3, name="t5gemma")
    mask = batch.pop("attention_mask")
    assert compare(build_zoo("t5gemma"), batch) is None
    batch.update(attention_mask=mask, decoder_attention_mask=(batch["labels"] != -100).long(),
                 position_ids=torch.arange(9).repeat(5, 1) + torch.arange(5)[:, None],
                 decoder_position_ids=torch.arange(6).repeat(5, 1) + 2)
    batch["decoder_attention_mask"][:, 0] = 1
    assert compare(build_zoo("t5gemma"), batch) is None

    config = tiny_config(transformers.T5Gemma2Config(eoi_token_index=5))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.T5Gemma2ForConditionalGeneration(config).eval()
    with torch.no_grad():  # an end-of-image embedding apart from the token's row
        model.model.encoder.text_model.embed_tokens.eoi_embedding.normal_()
    ids = torch.randint(6, 40, (5, 8))
    ids[:, 3] = 5
    labels = ids[:, :6].clone()
    labels[3:, 4:] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    assert compare(model, batch) is None
    with pytest.raises(TextOnlyInputError, match="text-only.*pixel_values"):
        stage_model(model).count_items({**batch, "pixel_values": torch.zeros(5, 3, 8, 8)})

    config = tiny_config(transformers.Pop2PianoConfig(decoder_start_token_id=0))
    config._attn_implementation = "eager"
    model = transformers.Pop2PianoForConditionalGeneration(config).eval()
    assert compare(model, seq2seq_batch(5, seed=4)) is None


def test_encoder_decoder_classifier_pools_at_eos():
    """BART's sequence classifier (models/seq2seq_heads.py) is exact on rows that end with the
    eos token it pools at; a microbatch with a row without one is refused with stock's words
    when counting items, before a step's first collective."""
    row = check("bart", "BartForSequenceClassification")
    assert row.status == "exact", (row.status, row.detail)
    config = transformers.T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                   num_heads=2, decoder_start_token_id=0, num_labels=3)
    staged = stage_model(transformers.T5ForSequenceClassification(config))
    ids = torch.tensor([[5, 6, 1], [7, 1, 8]])  # eos_token_id 1
    assert staged.count_items({"input_ids": ids, "labels": torch.tensor([0, 2])}) == 2
    with pytest.raises(ValueError, match="Each example must contain at least one <eos>"):
        staged.count_items({"input_ids": ids[:, :1], "labels": torch.tensor([0, 2])})


def test_refusals_name_the_class_and_the_reason():
    """Refused before anything runs, one UnsupportedModelError (a ValueError) naming the class:
    hierarchical backbones whose stages the generic path does not run as one stack, a head of
    another kind, encoder-decoders (seq2seq, speech, their classifiers)."""
    types = {}
    for mapping in ("image-classification", "seq2seq-lm", "speech-seq2seq",
                    "question-answering", "masked-lm"):
        types.update({n: (t, mapping) for n, t in _types(mapping).items()})
    for name, reason in REFUSED.items():
        model_type, mapping = types[name]
        row = check(model_type, name, mapping)
        assert row.status == "refused" and reason in row.detail, (name, row.status, row.detail)


def test_former_crashes_get_a_staging_or_a_refusal():
    """``stage_model(Dinov2ForImageClassification(cfg))`` raised a raw ``AttributeError: ...
    has no attribute 'vocab_size'`` on every rank; so did 21 other image classifiers and a
    token classifier. Built from their default configs (meta device: no weights), they stage or
    get UnsupportedModelError; a convolutional classifier without an image size in its config
    is checked on 64 x 64 images."""
    from transformers.models.auto import configuration_auto

    small = {"dinov2": dict(image_size=56)}  # 16 patches, not 37 x 37: the check's cost
    for model_type, name in (("dinov2", "Dinov2ForImageClassification"),
                             ("resnet", "ResNetForImageClassification"),
                             ("levit", "LevitForImageClassificationWithTeacher")):
        config = configuration_auto.CONFIG_MAPPING[model_type](**small.get(model_type, {}))
        with torch.device("meta"):
            model = getattr(transformers, name)(config)
        try:
            staged = stage_model(model)
        except UnsupportedModelError as exc:
            assert str(exc).startswith(f"hf_cephalo cannot train {name}"), exc
        else:
            assert staged.num_units > 1, name


def test_a_parameter_beside_the_layers_is_the_roots_alone():
    """XLNet's ``transformer`` holds ``mask_emb`` itself and contains the layers: the root
    gets its own entries only (``OwnParameters``), so every unit owns its parameters (it was
    refused with "unit 0 shares parameters with the root unit"); what the engine writes into
    them lands in the model. Its sequence classifier is exact like its token and span heads."""
    from hf_cephalo.models.hf_common import OwnParameters

    row = check("xlnet", "XLNetForSequenceClassification")
    assert row.status == "exact", (row.status, row.detail)
    config = transformers.XLNetConfig(vocab_size=40, d_model=16, n_layer=2, n_head=2,
                                      d_inner=32, num_labels=3)
    model = transformers.XLNetForTokenClassification(config)
    staged = stage_model(model)
    names = {id(p): n for n, p in model.named_parameters()}
    root = {names[id(p)] for m in staged.root_modules() for p in m.parameters()}
    assert "transformer.mask_emb" in root and not any(".layer." in n for n in root), root
    own = next(m for m in staged.head_modules() if isinstance(m, OwnParameters))
    assert [n for n, _ in own.named_parameters()] == ["mask_emb"]
    own._parameters["mask_emb"] = torch.zeros(0)  # as the engine's placeholders
    assert model.transformer.mask_emb.shape == (0,)


def test_question_answering_refuses_positions_outside_the_microbatch():
    """Stock ignores an answer position past the sequence and divides the start and end losses
    by separate counts that depend on the padding: refused when counting items (before a step's
    first collective), with the fix."""
    config = transformers.RobertaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=32,
                                        max_position_embeddings=40, pad_token_id=0)
    staged = stage_model(transformers.RobertaForQuestionAnswering(config))
    ids = torch.randint(2, 40, (2, 6))
    inside = {"input_ids": ids, "start_positions": torch.tensor([0, 5]),
              "end_positions": torch.tensor([2, 5])}
    assert staged.count_items(inside) == 2
    with pytest.raises(ValueError, match=r"answer positions \[6\] lie outside the microbatch's "
                                         r"6 tokens.*position 0"):
        staged.count_items({**inside, "end_positions": torch.tensor([2, 6])})


def test_token_heads_answer_empty_logits_of_their_shape():
    """A rank without rows answers logits of zero rows shaped as the model's (a custom loss's
    replay, the custom loop): (0, S, num_labels) for a token classifier, (0, S, vocab) for a
    masked LM, (0, S, 2) for question answering, (0, T, vocab) for T5 (T the decoder's)."""
    from hf_cephalo.models.hf_common import empty_logits

    text = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=32, max_position_embeddings=40, pad_token_id=0)
    ids = torch.zeros(0, 7, dtype=torch.long)
    for cls, width in ((transformers.BertForTokenClassification, 4),
                       (transformers.BertForMaskedLM, 40),
                       (transformers.BertForQuestionAnswering, 2)):  # start and end: 2 labels
        staged = stage_model(cls(transformers.BertConfig(num_labels=width if width < 40 else 2,
                                                         **text)))
        assert tuple(empty_logits(staged, {"input_ids": ids}).shape) == (0, 7, width), \
            cls.__name__
    # an encoder-decoder LM: (0, T, vocab), T its decoder's positions (the labels' width)
    from tests.zoo_fixtures import build_zoo

    for inputs in ({"input_ids": ids, "labels": torch.zeros(0, 5, dtype=torch.long)},
                   {"input_ids": ids, "decoder_input_ids": torch.zeros(0, 5, dtype=torch.long)}):
        assert tuple(empty_logits(stage_model(build_zoo("t5")), inputs).shape) == (0, 5, 97)


def test_custom_loop_outputs_are_the_models_own_types():
    """The custom-loop door answers ``model(**batch)`` with the output type of the model's own
    forward: a question-answering model's ``start_logits`` / ``end_logits`` (the staged head's
    stacked logits split), a token classifier's and a masked LM's logits."""
    from transformers import modeling_outputs as outputs

    from hf_cephalo.integrations.loop.prepare import _output_class

    text = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=32, max_position_embeddings=40, pad_token_id=0)
    logits = torch.randn(3, 7, 2)
    qa = _output_class(stage_model(transformers.BertForQuestionAnswering(
        transformers.BertConfig(**text))))(loss=torch.zeros(()), logits=logits)
    assert isinstance(qa, outputs.QuestionAnsweringModelOutput)
    assert torch.equal(qa.start_logits, logits[..., 0]) and torch.equal(qa.end_logits,
                                                                        logits[..., 1])
    for cls, kind in ((transformers.BertForTokenClassification, outputs.TokenClassifierOutput),
                      (transformers.BertForMaskedLM, outputs.MaskedLMOutput)):
        assert _output_class(stage_model(cls(transformers.BertConfig(**text)))) is kind


def test_an_embedding_width_apart_from_the_model_width_stays_apart():
    """ELECTRA (embedding_size 128, hidden_size 256) projects its embeddings with a module that
    exists only when the widths differ; the tiny copy shrank both to 32 and lost it, so every
    default-config ELECTRA head was refused as "built unlike its config". The shrink keeps them
    apart and the heads stage (meta device: no weights)."""
    from hf_cephalo.models.shrink import tiny_config

    tiny = tiny_config(transformers.ElectraConfig())
    assert tiny.embedding_size != tiny.hidden_size
    for cls in (transformers.ElectraForMaskedLM, transformers.ElectraForTokenClassification):
        with torch.device("meta"):
            model = cls(transformers.ElectraConfig())
        assert stage_model(model).num_units == 12, cls.__name__


def _own_and_staged(model, staged, batch):
    """(the model's own loss and gradients, the staged ones: embed, every unit, head_loss)."""
    model.zero_grad(set_to_none=True)
    own = model(**batch).loss
    own.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hidden, ctx = staged.embed(batch)
    for i in range(staged.num_units):
        hidden = staged.run_unit(i, hidden, ctx)
    out = staged.head_loss(hidden, batch, ctx)
    loss = out.loss_sum / out.num_items
    loss.backward()
    return (own, grads), (loss, {n: p.grad for n, p in model.named_parameters()})


def test_hierarchical_backbone_stages_are_units_of_the_model_not_of_its_copy():
    """ConvNeXt nests each stage's block list in one list of stages: each stage (its
    downsampling and blocks) is one unit. The self-check's tiny copy has at most 2 blocks a
    stage; models of 3 stages (4, 1, 3 blocks) and 4 stages (1, 3, 2, 1) stage with their OWN
    stages, one after the other in one process (the proofs are cached per config), and their
    staged loss and gradients equal their own. The default ConvNeXt, Swin and Hiera stage with
    their own 4 stages (their copies' stages are shallower; a real stage was refused as built
    unlike them). The
    profiler refuses them: it would run each unit on the embedding's output, whose shape the
    stages change."""
    from hf_cephalo.profiler.model_facts import refuse_reshaping_units

    g = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(3, 3, 32, 32, generator=g),
             "labels": torch.tensor([0, 2, 1])}
    for depths, widths in (([4, 1, 3], [8, 16, 24]), ([1, 3, 2, 1], [8, 16, 24, 32])):
        torch.manual_seed(0)
        model = transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
            num_stages=len(depths), depths=depths, hidden_sizes=widths, image_size=32,
            num_labels=3, layer_scale_init_value=0.5))
        staged = stage_model(model)
        assert staged.layout.layers == "convnext.encoder.stages", depths
        assert staged.units() == list(model.convnext.encoder.stages), depths
        assert [len(u.layers) for u in staged.units()] == depths
        (own, own_grads), (loss, grads) = _own_and_staged(model, staged, batch)
        torch.testing.assert_close(loss, own, rtol=1e-5, atol=1e-6)
        for name, grad in own_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{depths} {name}: {m}")
        assert staged.hidden_shape_changes()
        with pytest.raises(ValueError, match="hidden state changes shape between its units.*plan"):
            refuse_reshaping_units(staged)
    for name in ("ConvNext", "Swin", "Hiera"):  # default configs: stages of up to 16 blocks
        config = getattr(transformers, f"{name}Config")()
        with torch.device("meta"):
            model = getattr(transformers, f"{name}ForImageClassification")(config)
        assert stage_model(model).num_units == len(config.depths), name
    with torch.device("meta"):  # a stage deeper than the copy's, built unlike it: refused
        model = transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
            num_stages=3, depths=[4, 1, 3], hidden_sizes=[8, 16, 24], image_size=32))
    model.convnext.encoder.stages[0].layers[3] = torch.nn.Identity()
    with pytest.raises(UnsupportedModelError, match="its layer 0 is built unlike"):
        stage_model(model)


def test_the_page_reads_back_into_its_rows():
    """``--recheck-docs`` rewrites a few classes' rows from the page's own: the page read back
    (``page_rows``) renders to itself, every task section's rows included. Its seq2seq rows
    list T5 and BART as exact (their exactness itself: tests/test_generic_engine_parity.py)."""
    from benchmarks.model_coverage import page_rows, render

    text = Path(DOCS).read_text()
    rows = page_rows(text)
    assert {r.mapping for r in rows} == {"image-classification", "token-classification",
                                         "masked-lm", "question-answering", "seq2seq-lm",
                                         "speech-seq2seq"}
    assert render(rows, text) == text
    seq2seq = {r.name: r.status for r in rows if r.mapping == "seq2seq-lm"}
    assert seq2seq["T5ForConditionalGeneration"] == seq2seq["BartForConditionalGeneration"] \
        == "exact", seq2seq


# small configs of the classes the generic path stages since the layer outputs, patchified and
# token-id images and the float64 pixels (models/generic_outputs.py, generic_heads.image_batch,
# self_check.float64_batch): images of 32 pixels, 2 stages, so the check takes seconds
_SMALL_IMAGE_CONFIGS = {
    "Swinv2ForImageClassification": ("swinv2", dict(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4)),
    "DonutSwinForImageClassification": ("donut-swin", dict(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4)),
    "FocalNetForImageClassification": ("focalnet", dict(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], focal_levels=[2, 2],
        focal_windows=[3, 3])),
    "Siglip2ForImageClassification": ("siglip2", dict(vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_patches=16, patch_size=4), text_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        vocab_size=64))),
    "ImageGPTForImageClassification": ("imagegpt", dict(
        vocab_size=17, n_positions=64, n_embd=16, n_layer=2, n_head=2)),
    "BitForImageClassification": ("bit", dict(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4)),
}


@pytest.mark.parametrize("name", sorted(_SMALL_IMAGE_CONFIGS))
def test_hierarchical_patchified_and_token_image_classifiers_are_exact(name):
    """Swin V2, Donut-Swin and FocalNet (stages returning their output dimensions), SigLIP 2
    (patch sequences with a padding mask and grids), ImageGPT (images as color-cluster ids) and
    BiT (fp32 rounding, equal in float64): ``stage_model`` proves a tiny copy exact, and the
    sweep's independent comparison (5 rows as microbatches of 2 and 3) agrees."""
    from transformers.models.auto import configuration_auto

    from benchmarks.model_coverage import compare
    from hf_cephalo.models.generic_heads import image_batch

    model_type, fields = _SMALL_IMAGE_CONFIGS[name]
    config = configuration_auto.CONFIG_MAPPING[model_type](**fields, num_labels=3)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, name)(config).float().eval()
    staged = stage_model(model)
    assert staged.num_units >= 2, name
    cls = type(model)
    batch = image_batch(config, rows=5, main_input=cls.main_input_name)
    problem = compare(model, batch)
    assert problem is None or problem.startswith("rounding: "), (name, problem)


def test_siglip2_position_table_is_gathered_with_the_embeddings():
    """SigLIP 2's embeddings read ``position_embedding.weight`` and resize it without calling
    the embedding module: the module belongs to the embedding side all the same (``trace_layout``
    sees the read, ``generic.ParameterReads``), else the engine never gathers it there and the
    first step fails on the empty placeholder. A text tower of another depth than the vision
    tower's is no "layer added after construction": the count is the vision config's."""
    from transformers.models.auto import configuration_auto

    _, fields = _SMALL_IMAGE_CONFIGS["Siglip2ForImageClassification"]
    fields = {"vision_config": {**fields["vision_config"], "num_hidden_layers": 3},
              "text_config": {**fields["text_config"], "num_hidden_layers": 1}}
    config = configuration_auto.CONFIG_MAPPING["siglip2"](**fields, num_labels=3)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    staged = stage_model(transformers.Siglip2ForImageClassification(config).eval())
    assert "vision_model.embeddings.position_embedding" in staged.layout.embed, staged.layout


def test_layers_called_several_times_in_a_row_stage_one_unit_each():
    """ALBERT shares each of its num_hidden_groups layer groups across num_hidden_layers /
    groups consecutive layers ([Note: repeated layer calls]): a unit per group, run once per
    call, equal to the model's own loss and gradients at call counts the self-check's tiny
    copy (2 groups called twice, or 1 group twice) does not have; one group per layer stays
    one call per unit. A forward that calls its layers out of runs ([0, 1, 0]) is refused."""
    from hf_cephalo.models.generic import StructureError, trace_layout
    from hf_cephalo.models.generic_repeats import runs_in_order

    assert runs_in_order([0, 0, 1, 1, 1], 2) and not runs_in_order([0, 1, 0], 2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 60, (3, 7), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    for groups, layers, calls in ((2, 6, [3, 3]), (1, 5, [5]), (3, 3, None)):
        cfg = transformers.AlbertConfig(
            vocab_size=60, embedding_size=16, hidden_size=32, num_attention_heads=2,
            intermediate_size=48, num_hidden_groups=groups, num_hidden_layers=layers,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        torch.manual_seed(1)
        model = transformers.AlbertForMaskedLM(cfg)
        staged = stage_model(model)
        assert staged.num_units == groups and staged.layout.repeats == (calls is not None)
        _, ctx = staged.embed(batch)
        assert [len(c) for c in ctx.extra["repeat_calls"]] == calls if calls else \
            "repeat_calls" not in ctx.extra
        (own, own_grads), (loss, grads) = _own_and_staged(model, staged, batch)
        torch.testing.assert_close(loss, own, rtol=1e-5, atol=1e-6)
        for name, grad in own_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    encoder = model.albert.encoder

    def out_of_runs(hidden_states, attention_mask=None, **kwargs):
        hidden_states = encoder.embedding_hidden_mapping_in(hidden_states)
        for i in (0, 1, 0):
            hidden_states = encoder.albert_layer_groups[i](hidden_states, attention_mask)
        return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=hidden_states)

    encoder.forward = out_of_runs
    with pytest.raises(StructureError, match=r"order \[0, 1, 0\], not each once"):
        trace_layout(model, batch, "albert.encoder.albert_layer_groups")


def test_gemma_encoder_decoder_classifiers_pool_and_score_as_the_model_does():
    """T5Gemma's and T5Gemma 2's token and sequence classifiers on their encoder-decoder
    adapters (models/seq2seq_heads.py), on RIGHT-padded rows of different lengths (the
    sweep's classifier batch is left-padded, where every row pools its last position): the
    sequence classifiers pool where each model's own rule says (T5Gemma: the last non-pad
    input token + 1, for the decoder's right shift; T5Gemma 2: the decoder input's last
    non-pad token), equal to ``compare``'s loss and every gradient (microbatches of 2 and 3
    rows). A T5Gemma classifier built with is_encoder_decoder=False is refused with the
    reason."""
    from hf_cephalo.models.shrink import tiny_config

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 40, (5, 9), generator=g)
    mask = torch.ones_like(ids)
    for row, keep in enumerate((9, 4, 7, 2, 6)):
        ids[row, keep:], mask[row, keep:] = 0, 0
    tags = torch.randint(0, 3, (5, 9), generator=g).masked_fill(mask == 0, -100)
    for family in ("T5Gemma", "T5Gemma2"):
        config = tiny_config(getattr(transformers, f"{family}Config")(num_labels=3))
        config.pad_token_id = 0
        config._attn_implementation = "eager"
        for head, labels in (("TokenClassification", tags),
                             ("SequenceClassification", torch.tensor([0, 2, 1, 1, 0]))):
            torch.manual_seed(0)
            model = getattr(transformers, f"{family}For{head}")(copy.deepcopy(config)).eval()
            batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
            assert compare(model, batch) is None, (family, head)
        if family == "T5Gemma":  # T5Gemma 2's classifiers are always encoder-decoders
            with pytest.raises(UnsupportedModelError, match="is_encoder_decoder=False"):
                stage_model(transformers.T5GemmaForTokenClassification(
                    copy.deepcopy(config), is_encoder_decoder=False))


def test_document_models_get_their_inputs_and_widths():
    """Document models (models/document_inputs.py): the check's boxes are ordered corners,
    zero on padding, integer where the config embeds coordinates by value (LayoutLMv3) and
    page-normalized floats otherwise (Bros); MarkupLM's xpath ids stay inside its tables and
    are the pad ids on padding. The shrink keeps the splits of the width these models make
    (LiLT's sixths, LayoutLMv3's 4 coordinate + 2 shape widths, Bros's even sinusoid widths).
    A staged LayoutLMv3 (its vision tower unused on text) takes microbatches with ``bbox`` and
    refuses ``pixel_values``, before any collective."""
    from hf_cephalo.models.document_inputs import with_document_inputs
    from hf_cephalo.models.generic import TextOnlyInputError
    from hf_cephalo.models.shrink import tiny_config

    ids = torch.randint(4, 90, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    v3 = tiny_config(transformers.LayoutLMv3Config())
    assert v3.hidden_size == 4 * v3.coordinate_size + 2 * v3.shape_size
    assert tiny_config(transformers.LiltConfig()).hidden_size % 6 == 0
    bros = tiny_config(transformers.BrosConfig())
    assert bros.dim_bbox_sinusoid_emb_1d % 2 == 0 and bros.dim_bbox_sinusoid_emb_1d > 0
    for cls, cfg, dtype in ((transformers.LayoutLMv3ForTokenClassification, v3, torch.int64),
                            (transformers.BrosForTokenClassification, bros, torch.float32)):
        box = with_document_inputs(cls, cfg, batch)["bbox"]
        assert box.shape == (3, 7, 4) and box.dtype == dtype
        assert (box[..., 2] >= box[..., 0]).all() and (box[..., 3] >= box[..., 1]).all()
        assert (box[1, 4:] == 0).all() and box.max() <= 1000 and box.min() >= 0
    markup = tiny_config(transformers.MarkupLMConfig())
    tags = with_document_inputs(transformers.MarkupLMForTokenClassification, markup,
                                batch)["xpath_tags_seq"]
    assert tags.shape == (3, 7, markup.max_depth)
    assert (tags[1, 4:] == markup.tag_pad_id).all()
    assert tags.max() < markup.max_xpath_tag_unit_embeddings
    assert with_document_inputs(transformers.BertForTokenClassification,
                                tiny_config(transformers.BertConfig()), batch) is batch

    torch.manual_seed(0)
    staged = stage_model(transformers.LayoutLMv3ForTokenClassification(v3))
    mb = with_document_inputs(type(staged.model), v3, {
        **batch, "labels": (ids % 2).masked_fill(mask == 0, -100)})
    assert staged.count_items(mb) == int(mask.sum())
    with pytest.raises(TextOnlyInputError, match="pixel_values"):
        staged.count_items({**mb, "pixel_values": torch.zeros(3, 3, 224, 224)})
