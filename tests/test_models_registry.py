"""Adapter lookup, structure checks, clear errors and training preparation (issue 4, items 1, 6)."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_cephalo.models import adapter_for, register_adapter, stage_model, supported_model_classes
from hf_cephalo.models.generic import (GenericCausalLM, GenericEncoderClassifier,
                                       GenericSequenceClassifier)
from hf_cephalo.models.gpt2 import GPT2SequenceClassifierStagedModel, GPT2StagedModel
from hf_cephalo.models.gpt_neox import GPTNeoXStagedModel
from tests.models_fixtures import BUILDERS, SEQ_CLS_BUILDERS, build, make_batch

EXPECTED = {"llama": GenericCausalLM, "mistral": GenericCausalLM, "qwen2": GenericCausalLM,
            "gpt2": GPT2StagedModel, "gpt_neox": GPTNeoXStagedModel, "vit": GenericEncoderClassifier,
            "bert": GenericEncoderClassifier, "llama_cls": GenericSequenceClassifier,
            "mistral_cls": GenericSequenceClassifier,
            "qwen2_cls": GenericSequenceClassifier,
            "gpt2_cls": GPT2SequenceClassifierStagedModel}
ALL_ARCHS = [*BUILDERS, *SEQ_CLS_BUILDERS]


def test_hand_written_adapters_are_only_where_the_generic_path_is_not_used():
    """Llama, Mistral, Qwen2, BERT and ViT run on the generic path (models/generic.py); the
    registry keeps the hand-written adapters of GPT-2 and GPT-NeoX, and those of the
    encoder-decoders T5, BART, mBART, Marian, Pegasus, Whisper, BART's kin, Speech2Text,
    Moonshine, T5Gemma and T5Gemma 2 (models/seq2seq.py, models/seq2seq_families.py,
    models/seq2seq_kin.py, models/whisper.py, models/speech_seq2seq.py,
    models/seq2seq_gemma.py: two stacks, which the generic path does not stage), of T5's kin
    (Pop2Piano among them) and the encoder-decoders' task heads (models/seq2seq_t5_kin.py,
    models/seq2seq_heads.py; T5's token classifier: its layer 0 hands the later layers their
    position bias, which the generic path does not see)."""
    assert set(supported_model_classes()) == {
        "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPTNeoXForCausalLM",
        "T5ForConditionalGeneration", "BartForConditionalGeneration",
        "WhisperForConditionalGeneration", "MBartForConditionalGeneration", "MarianMTModel",
        "PegasusForConditionalGeneration",
        # BART's kin (models/seq2seq_kin.py)
        "BlenderbotForConditionalGeneration", "BlenderbotSmallForConditionalGeneration",
        "PLBartForConditionalGeneration", "MvpForConditionalGeneration",
        "M2M100ForConditionalGeneration", "FSMTForConditionalGeneration",
        "BigBirdPegasusForConditionalGeneration", "LEDForConditionalGeneration",
        "PegasusXForConditionalGeneration",
        # speech (models/speech_seq2seq.py)
        "Speech2TextForConditionalGeneration", "MoonshineForConditionalGeneration",
        # Gemma's encoder-decoders (models/seq2seq_gemma.py)
        "T5GemmaForConditionalGeneration", "T5Gemma2ForConditionalGeneration",
    } | T5_KIN_AND_HEADS


T5_KIN_AND_HEADS = {
    "MT5ForConditionalGeneration", "UMT5ForConditionalGeneration",
    "LongT5ForConditionalGeneration", "Pop2PianoForConditionalGeneration",
    "T5ForTokenClassification", "MT5ForTokenClassification",
    *(f"{family}For{task}" for family in ("T5", "MT5", "UMT5", "Bart", "MBart", "Mvp")
      for task in ("QuestionAnswering", "SequenceClassification")),
    "LEDForQuestionAnswering",
    *(f"{family}For{task}" for family in ("T5Gemma", "T5Gemma2")
      for task in ("TokenClassification", "SequenceClassification"))}


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_structure_covers_parameters_exactly(arch):
    model = build(arch)
    staged = stage_model(model)
    assert type(staged) is EXPECTED[arch]
    assert staged.num_units == 2 and staged.model is model
    root = [p for m in staged.root_modules() for p in m.parameters()]
    units = [p for u in staged.units() for p in u.parameters()]
    ids = {id(p) for p in root} | {id(p) for p in units}
    assert ids == {id(p) for p in model.parameters()}
    assert len({id(p) for p in root} & {id(p) for p in units}) == 0
    unique = {id(p): p for p in root + units}.values()
    assert sum(p.numel() for p in unique) == model.num_parameters()
    numels = [sum(p.numel() for p in u.parameters()) for u in staged.units()]
    assert len(set(numels)) == 1  # identical units


def test_class_without_adapter_trains_generically_and_non_models_are_refused():
    """OPT has no hand-written adapter: the generic path stages it (its word_embed_proj_dim
    ties to the hidden width, so the tiny copy shrinks it too)."""
    model = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
        word_embed_proj_dim=16))
    assert type(stage_model(model)) is GenericCausalLM
    with pytest.raises(ValueError, match="no staged-model adapter for Linear") as info:
        stage_model(torch.nn.Linear(2, 2))
    assert "docs/adding_a_model.md" in str(info.value)


def test_staging_leaves_the_global_rng_and_the_log_as_it_found_them(monkeypatch):
    """The self-check seeds its tiny copy; staging must not reseed the user's RNG (it did: a
    custom loop's shuffled loader took its order from torch.initial_seed(), which the first
    staging of a class set to 0, and dropout masks followed the check's draws), nor a CUDA
    device's generators (torch.manual_seed reseeds them too, and fork_rng(devices=[]) restores
    the CPU's only). Nor does it
    read the config's deprecated aliases (each read logs transformers' deprecation warning in
    the user's run: `torch_dtype` / `use_return_dict` on every rank)."""
    reads, cuda_seeds = [], []
    for alias in ("torch_dtype", "use_return_dict"):
        monkeypatch.setattr(transformers.PretrainedConfig, alias,
                            property(lambda self, a=alias: reads.append(a)))
    config = transformers.BertConfig(vocab_size=61, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32, num_labels=3)
    torch.manual_seed(42)
    model = transformers.BertForSequenceClassification(config)
    state = torch.get_rng_state()
    monkeypatch.setattr(torch.cuda, "manual_seed_all", cuda_seeds.append)  # a GPU's generators
    stage_model(model)  # a config no other test stages: the check runs here, uncached
    assert torch.initial_seed() == 42 and torch.equal(torch.get_rng_state(), state)
    assert cuda_seeds == [] and reads == [], (cuda_seeds, reads)


def _tiny(config_cls, **kw):
    defaults = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32)
    return config_cls(**{**defaults, **kw})


def _opt_config():
    return transformers.OPTConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                  num_attention_heads=2, word_embed_proj_dim=16)


def _refusal(model) -> ValueError:
    with pytest.raises(ValueError) as info:
        stage_model(model)
    assert "docs/adding_a_model.md" in str(info.value), str(info.value)
    return info.value


def test_unsupported_messages_fit_the_class():
    """Every refusal points to docs/adding_a_model.md, with advice for its class (issue 33,
    item 5; issues 36, 47): a head the generic path does not stage (multiple choice, next
    sentence prediction, double heads) is told to write an adapter for it, over the existing
    body where its architecture has a hand-written one (never to load another class, which
    trains another head and loss); a bare base model is told which heads of its architecture
    hf_cephalo trains."""
    choice = _refusal(transformers.BertForMultipleChoice(_tiny(transformers.BertConfig)))
    text = str(choice)
    assert "(a multiple choice head)" in text and "load the model as" not in text
    assert "causal-LM, sequence-classification, image-classification, token-classification, " \
        "masked-LM and question-answering heads" in text and "Body" not in text
    assert "register_adapter(BertForMultipleChoice, YourAdapter)" in text
    assert choice.alternatives == []

    double = str(_refusal(transformers.GPT2DoubleHeadsModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=50))))
    assert "load the model as" not in double and "a head of another kind" in double
    assert "hf_cephalo.models.gpt2.GPT2DecoderBody" in double
    nsp = str(_refusal(transformers.BertForNextSentencePrediction(_tiny(transformers.BertConfig))))
    assert "(a next sentence prediction head)" in nsp

    base = _refusal(transformers.LlamaModel(_tiny(transformers.LlamaConfig)))
    assert "base model without a head" in str(base)
    assert ("Load the model as LlamaForCausalLM or LlamaForSequenceClassification or "
            "LlamaForTokenClassification or LlamaForQuestionAnswering") in str(base)
    assert base.alternatives == ["LlamaForCausalLM", "LlamaForSequenceClassification",
                                 "LlamaForTokenClassification", "LlamaForQuestionAnswering"]
    vit = _refusal(transformers.ViTModel(transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4)))
    assert vit.alternatives == ["ViTForImageClassification"]

    class MyChooser(transformers.BertForMultipleChoice):  # a user subclass
        pass

    assert "(a multiple choice head)" in str(_refusal(MyChooser(_tiny(transformers.BertConfig))))
    _refusal(torch.nn.Linear(2, 2))


def test_head_kind_from_class_names():
    from hf_cephalo.models.registry import _words, head_kind

    assert head_kind("LlamaForSequenceClassification") == "SequenceClassification"
    assert head_kind("GPT2LMHeadModel") == head_kind("OPTForCausalLM") == "CausalLM"
    assert head_kind("BertModel") is None and head_kind("Formula") is None
    # XLNet's, XLM's and Flaubert's plain span head (their ...ForQuestionAnswering is the
    # beam-search head, another kind)
    assert head_kind("XLNetForQuestionAnsweringSimple") == "QuestionAnswering"
    assert [_words(k) for k in ("SequenceClassification", "CausalLM", "MaskedLM")] == \
        ["sequence classification", "causal LM", "masked LM"]


def test_subclass_finds_base_adapter_and_register_adapter_overrides():
    class MyGPT2(transformers.GPT2LMHeadModel):
        pass

    model = MyGPT2(build("gpt2").config)
    assert adapter_for(model) is GPT2StagedModel

    class MyAdapter(GPT2StagedModel):
        pass

    register_adapter(MyGPT2, MyAdapter)
    try:
        assert type(stage_model(model)) is MyAdapter
        assert type(stage_model(build("gpt2"))) is GPT2StagedModel
    finally:
        from hf_cephalo.models import registry
        registry._ADAPTERS.pop("MyGPT2")
    # a registered adapter wins over the generic path for a class the generic path stages
    register_adapter(transformers.LlamaForCausalLM, MyAdapter)
    try:
        assert adapter_for(build("llama")) is MyAdapter
    finally:
        registry._ADAPTERS.pop("LlamaForCausalLM")
    with pytest.raises(TypeError, match="StagedModel subclass"):
        register_adapter("X", object)


def test_extra_module_is_rejected():
    model = build("gpt2")
    model.value_head = torch.nn.Linear(64, 1)
    with pytest.raises(ValueError, match="value_head.weight.*adding_a_model.md"):
        stage_model(model)


def test_bert_without_pooler_is_rejected():
    model = build("bert")
    model.bert.pooler = None
    with pytest.raises(ValueError, match="pooler"):
        stage_model(model)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_prepare_for_training_forces_use_cache_off(arch):
    model = build(arch)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = True
    stage_model(model).prepare_for_training()
    assert getattr(model.config, "use_cache", False) is False


@pytest.mark.parametrize("arch,key", [("llama", "input_ids"), ("llama", "labels"),
                                      ("gpt2", "labels"), ("vit", "pixel_values"),
                                      ("vit", "labels"), ("bert", "labels")])
def test_missing_key_is_a_clear_error(arch, key):
    staged = stage_model(build(arch))
    batch = make_batch(arch, 2)
    del batch[key]
    if key == "labels":
        # unlabeled data scores no items (predict without labels, as stock Trainer); the loss
        # itself needs the labels and names the missing key
        assert staged.count_items(batch) == 0
        with torch.no_grad():
            hidden, ctx = staged.embed(batch)
            for i in range(len(staged.units())):
                hidden = staged.run_unit(i, hidden, ctx)
            with pytest.raises(ValueError, match=f"no '{key}'.*keys present"):
                staged.head_loss(hidden, batch, ctx)
    else:
        with pytest.raises(ValueError, match=f"no '{key}'.*keys present"):
            staged.embed(batch)


def test_guide_example_runs_and_matches_the_model(tmp_path):
    """The adapter written in docs/adding_a_model.md works as printed."""
    import pathlib
    import re

    from hf_cephalo.models import registry
    from tests.models_fixtures import staged_logits

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "adding_a_model.md"
    code = re.search(r"```python\n(.*?)```", guide.read_text(), re.S).group(1)

    class MyDecoderForCausalLM(transformers.LlamaForCausalLM):
        pass

    namespace: dict = {}
    try:
        exec(compile(code, str(guide), "exec"), namespace)
        model = MyDecoderForCausalLM(build("llama").config).eval()
        staged = stage_model(model)
        assert type(staged).__name__ == "MyDecoderStagedModel"
        staged.prepare_for_training()
        batch = make_batch("llama", 3, padding=True)
        with torch.no_grad():
            torch.testing.assert_close(staged_logits(staged, batch), model(**batch).logits,
                                       rtol=0, atol=1e-5)
    finally:
        registry._ADAPTERS.pop("MyDecoderForCausalLM", None)


def test_old_transformers_is_a_clear_error():
    from hf_cephalo.models.registry import check_transformers_version

    check_transformers_version(transformers.__version__)
    check_transformers_version("5.0.0")
    with pytest.raises(ValueError, match=r"transformers>=5.0 \(found 4.46.0\)"):
        check_transformers_version("4.46.0")


def test_layers_of_different_sizes_are_priced_per_layer():
    """DeepSeek-V3-style dense first layers then MoE layers: the generic path stages them (the
    engine shards units of any size) and the model profile records each layer's elements, the
    largest as params_per_unit, so the memory model's units are the engine's; the profiler
    measures another layer through a view whose unit 0 is that layer with its own layer
    arguments ([Note: layers of different sizes])."""
    from hf_cephalo.planner.memory import model_layout_numels
    from hf_cephalo.profiler.model_facts import ProfiledUnit, largest_unit
    from hf_cephalo.profiler.measure import model_profile

    staged = stage_model(_deepseek())
    sizes = [sum(p.numel() for p in u.parameters()) for u in staged.units()]
    assert len(set(sizes)) == 2 and sizes[0] != max(sizes)
    profile = model_profile(staged)
    assert profile.unit_params == sizes and profile.params_per_unit == max(sizes)
    assert profile.num_params == sum(p.numel() for p in staged.model.parameters())
    assert model_layout_numels(profile)[:3] == sizes
    assert _round_trips(profile)
    index = largest_unit(staged)
    assert sizes[index] == max(sizes) and index == sizes.index(max(sizes))
    view = ProfiledUnit(staged, index)
    assert view.units() == [staged.units()[index]]
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4,
                                                                                    dtype=torch.long)}
    with torch.no_grad():
        hidden, ctx = staged.embed(batch)
        torch.testing.assert_close(view.run_unit(0, hidden, ctx),
                                   staged.run_unit(index, hidden, ctx), rtol=0, atol=0)


def test_layers_of_each_size_are_profiled_and_combined(monkeypatch):
    """measure_device runs one layer of each size, each with its own layer arguments, and
    records the layers' mean times and kept graphs (each size weighted by its count) and the
    largest activation memory ([Note: layers of different sizes])."""
    from hf_cephalo.profiler import compute
    from hf_cephalo.profiler.inputs import MeasureConfig
    from hf_cephalo.profiler.model_facts import unit_groups

    staged = stage_model(_deepseek(layers=4))  # one dense layer, then three MoE layers
    assert unit_groups(staged) == [(0, 1), (1, 3)]
    ran: list[int] = []
    handles = [layer.register_forward_hook(lambda *_, i=i: ran.append(i))
               for i, layer in enumerate(staged.units())]
    config = MeasureConfig(max_microbatch_size=2, sequence_length=8, warmup=0, repeats=1,
                           progress=False)
    try:
        compute.measure_device(staged, config, device="cpu", name="cpu", capacity_bytes=1e9)
    finally:
        for h in handles:
            h.remove()
    assert set(ran) == {0, 1}, ran  # one layer of each size, never the others
    fake = {0: ([1.0, 2.0], [3.0, 4.0], [10.0, 20.0], [11.0, 21.0], [5.0, 6.0]),
            1: ([5.0, 6.0], [7.0, 8.0], [30.0, 5.0], [31.0, 6.0], [9.0, 10.0])}

    def measured(one, *args):  # each group's numbers, told apart by the unit it runs
        return fake[0 if one.units()[0] is staged.units()[0] else 1]

    monkeypatch.setattr(compute, "_measure_unit", measured)
    profile = compute.measure_device(staged, config, device="cpu", name="cpu",
                                     capacity_bytes=1e9)
    assert profile.fwd_s == [0.25 * 1 + 0.75 * 5, 0.25 * 2 + 0.75 * 6]
    assert profile.bwd_s == [0.25 * 3 + 0.75 * 7, 0.25 * 4 + 0.75 * 8]
    assert profile.kept_graph_bytes == [0.25 * 5 + 0.75 * 9, 0.25 * 6 + 0.75 * 10]
    assert profile.compute_memory_bytes == [30.0, 20.0]
    assert profile.head_memory_bytes == [31.0, 21.0]


def _deepseek(layers: int = 3):
    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, head_dim=4, max_position_embeddings=64,
        pad_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg)


def _round_trips(profile) -> bool:
    from hf_cephalo.profiles.types import ModelProfile

    return ModelProfile.from_json(profile.to_json()) == profile


def test_heads_whose_base_model_is_themselves_are_not_called_base_models():
    """transformers answers ``base_model`` with the model itself when the prefix attribute is
    missing: Llama4ForCausalLM (prefix 'language_model', body at .model) was refused as "a
    base model without a head" and told to load itself; T5ForConditionalGeneration was told to
    load a classifier (another head); it now has an adapter (models/seq2seq.py), which the
    doors refuse for now, as has its question-answering head (models/seq2seq_heads.py), and an
    encoder-decoder without one (Switch Transformers) is refused as one, with its reason. A
    compiled model is told to pass the model itself."""
    from hf_cephalo.models.registry import UnsupportedModelError

    cfg = transformers.Llama4TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, intermediate_size_mlp=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_local_experts=2, max_position_embeddings=64, pad_token_id=0)
    cfg._attn_implementation = "eager"
    try:
        stage_model(transformers.Llama4ForCausalLM(cfg))  # the self-check decides
    except ValueError as exc:
        assert "base model without a head" not in str(exc), exc
    from hf_cephalo.runtime import stage_model as door_stage_model

    t5_cfg = transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=1,
                                   num_heads=4, decoder_start_token_id=0)
    t5 = transformers.T5ForConditionalGeneration(t5_cfg)
    assert type(stage_model(t5)).__name__ == "T5StagedModel"
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder: "
                                         "hf_cephalo's engine trains it exactly"):
        door_stage_model(t5)
    assert type(stage_model(transformers.T5ForQuestionAnswering(t5_cfg))).__name__ == \
        "T5QuestionAnsweringStagedModel"  # an adapter since (models/seq2seq_heads.py)
    with pytest.raises(UnsupportedModelError, match="it is an encoder-decoder model") as info:
        stage_model(transformers.SwitchTransformersForConditionalGeneration(
            transformers.SwitchTransformersConfig(
                vocab_size=96, d_model=32, d_kv=8, d_ff=48, expert_capacity=4, num_layers=2,
                num_sparse_encoder_layers=1, num_decoder_layers=2,
                num_sparse_decoder_layers=1, num_heads=4, num_experts=2)))
    assert "router z-loss" in str(info.value)
    with pytest.raises(UnsupportedModelError, match="torch.compile'd model .*pass the model"):
        stage_model(torch.compile(build("llama")))


def test_a_layer_appended_after_construction_is_refused_when_staging():
    """Caught by stage_model (no process group), not at the first forward, where a rank
    without rows would never look (issue 36: the fresh-install check found it)."""
    import copy

    model = build("llama")
    model.model.layers.append(copy.deepcopy(model.model.layers[0]))
    with pytest.raises(ValueError, match=r"holds 3 layers in model.layers but its config says "
                                         r"num_hidden_layers = 2"):
        stage_model(model)


def test_bart_kin_refuse_what_they_cannot_stage_exactly():
    """Built on the meta device (no weights, no forward), each refused with the fix: MVP's
    prompt tuning (prompt modules every layer reads), BigBird-Pegasus's block-sparse attention
    (not staged yet); NLLB-MoE (routing over the whole batch). M2M100's default layer drop:
    tests/test_models_heads.py."""
    from transformers import BigBirdPegasusConfig, MvpConfig, NllbMoeConfig

    from hf_cephalo.models import UnsupportedModelError

    small = dict(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                 decoder_ffn_dim=16)
    cases = [(transformers.MvpForConditionalGeneration, MvpConfig(use_prompt=True, **small),
              "use_prompt=True.*config.use_prompt = False"),
             (transformers.BigBirdPegasusForConditionalGeneration, BigBirdPegasusConfig(**small),
              "block_sparse.*set_attention_type\\('original_full'\\).*704 tokens"),
             (transformers.NllbMoeForConditionalGeneration, NllbMoeConfig(**small),
              "its MoE layers route over the whole batch")]
    for cls, config, reason in cases:
        with torch.device("meta"):
            model = cls(config)
        with pytest.raises(UnsupportedModelError, match=f"{cls.__name__}.*: .*{reason}"):
            stage_model(model)


def test_bigbird_block_sparse_refused_with_the_fix_full_attention_staged():
    """BigBird's default block-sparse attention: refused with its cause and the fix, before the
    self-check runs (it was refused as "built unlike" its tiny copy, whose forward switched to
    full attention on the check's short batch). With full attention the self-check proves it
    exact (each head of every mapping it is in is staged)."""
    from transformers import BigBirdConfig

    from hf_cephalo.models import UnsupportedModelError

    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=64)
    heads = (transformers.BigBirdForMaskedLM, transformers.BigBirdForQuestionAnswering)
    for cls in heads:
        with torch.device("meta"):
            model = cls(BigBirdConfig(**small))
        with pytest.raises(UnsupportedModelError, match=(
                f"{cls.__name__} has attention_type='block_sparse'.*"
                r"704 tokens.*model.base_model.set_attention_type\('original_full'\) "
                r"before handing it over. Nothing was run.$")):
            stage_model(model)
    model = transformers.BigBirdForMaskedLM(BigBirdConfig(**small))
    model.base_model.set_attention_type("original_full")
    assert stage_model(model).model is model


def test_seq2seq_adapters_refuse_layer_drop_and_a_batch_without_targets():
    """BART's layer drop skips layers at random in training, which no staged schedule replays:
    refused when staging. A microbatch with neither ``labels`` nor ``decoder_input_ids`` has no
    decoder input: a ValueError naming the keys, before any unit runs. ``compile`` is refused
    before any collective (its probe runs each unit alone on the embedding's output)."""
    from tests.zoo_fixtures import SEQ2SEQ, build_zoo, seq2seq_batch

    config = SEQ2SEQ["bart"][1]()
    config.decoder_layerdrop = 0.1
    with pytest.raises(ValueError, match="layer drop 0.1 .*decoder_layerdrop = 0"):
        stage_model(transformers.BartForConditionalGeneration(config))
    staged = stage_model(build_zoo("t5"))
    batch = seq2seq_batch(2, seed=0)
    del batch["labels"]
    with pytest.raises(ValueError, match="neither 'labels' nor 'decoder_input_ids'"):
        staged.embed(batch)
    assert staged.count_items(batch) == 0
    from hf_cephalo.engine import CephaloEngine, CompileOptions
    with pytest.raises(ValueError, match=r"units \[0, 3\] of T5ForConditionalGeneration make "
                                         "side inputs .* without compile"):
        CephaloEngine(staged, [1.0], compile=CompileOptions(backend="eager"))
