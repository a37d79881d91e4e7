"""Tiny models of the decoder classes people fine-tune in 2026, each with the features that make
its forward differ from Llama's set to NON-default values (multipliers, softcaps, sliding
windows, QK norms, partial rotary, no-RoPE layers, MoE routing with the router loss on), so a
generic path that skipped one of them would not match the model's own loss.

Written out by hand per class (not shrunk by ``models/self_check.py``), so the tests that use
them do not depend on the code they check. 2 layers, hidden 64, 4 heads (2 KV heads), head dim
16, vocabulary ``VOCAB``; ``make_batch`` of ``tests/models_fixtures.py`` feeds them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import transformers

from tests.models_fixtures import PAD, VOCAB

BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
            pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.3)


def _cfg(config_cls: type, **kw: Any) -> Any:
    return config_cls(**{**BASE, **kw})


ZOO: dict[str, tuple[str, Callable[[], Any]]] = {
    # name: (model class in transformers, config factory)
    "qwen3": ("Qwen3ForCausalLM", lambda: _cfg(transformers.Qwen3Config, head_dim=16)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", lambda: _cfg(
        transformers.Qwen3MoeConfig, head_dim=16, num_experts=4, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[], **MOE)),
    "qwen3_moe_no_router_loss": ("Qwen3MoeForCausalLM", lambda: _cfg(
        transformers.Qwen3MoeConfig, head_dim=16, num_experts=4, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[], **{**MOE, "output_router_logits": False})),
    "gemma3": ("Gemma3ForCausalLM", lambda: _cfg(
        transformers.Gemma3TextConfig, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=20,
        final_logit_softcapping=3.0, attn_logit_softcapping=4.0)),
    "gpt_oss": ("GptOssForCausalLM", lambda: _cfg(
        transformers.GptOssConfig, head_dim=16, num_local_experts=4, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], **MOE)),
    "phi3": ("Phi3ForCausalLM", lambda: _cfg(transformers.Phi3Config,
                                              partial_rotary_factor=0.5)),
    "granite": ("GraniteForCausalLM", lambda: _cfg(
        transformers.GraniteConfig, embedding_multiplier=3.0, logits_scaling=2.0,
        residual_multiplier=0.5, attention_multiplier=0.3)),
    "olmo2": ("Olmo2ForCausalLM", lambda: _cfg(transformers.Olmo2Config)),
    "smollm3": ("SmolLM3ForCausalLM", lambda: _cfg(transformers.SmolLM3Config,
                                                    no_rope_layers=[1, 0])),
    "qwen3_cls": ("Qwen3ForSequenceClassification", lambda: _cfg(
        transformers.Qwen3Config, head_dim=16, num_labels=3)),
}
"""The zoo. ``qwen3_cls`` pools the last non-pad token (batches with left padding)."""

EXTRA: dict[str, tuple[str, Callable[[], Any]]] = {
    "glm5": ("GlmMoeDsaForCausalLM", lambda: _cfg(
        transformers.GlmMoeDsaConfig, num_key_value_heads=4, head_dim=8, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        index_head_dim=16, index_n_heads=2, index_topk=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
        topk_group=1)),
    "gemma3_vlm": ("Gemma3ForConditionalGeneration", lambda: transformers.Gemma3Config(
        text_config={**BASE, "head_dim": 16, "final_logit_softcapping": 3.0,
                     "query_pre_attn_scalar": 20, "sliding_window": 4,
                     "layer_types": ["sliding_attention", "full_attention"]},
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4)),
    "gemma4": ("Gemma4ForConditionalGeneration", lambda: transformers.Gemma4Config(
        text_config={**BASE, "head_dim": 16, "global_head_dim": 32, "sliding_window": 4,
                     "hidden_size_per_layer_input": 0, "final_logit_softcapping": 3.0,
                     "layer_types": ["sliding_attention", "full_attention"]},
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=2))),
    "bart_causal": ("BartForCausalLM", lambda: transformers.BartConfig(
        vocab_size=VOCAB, d_model=64, decoder_layers=2, decoder_attention_heads=4,
        decoder_ffn_dim=128, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=128,
        max_position_embeddings=64, scale_embedding=True, dropout=0.0, pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)),
}
"""Models apart from ZOO, so the tests over the whole zoo do not pay for them: with parameters
their forward never gives a gradient (GLM-5's DSA indexer picks the top-``index_topk`` keys: its
weights get none; a vision-language class on text never calls its vision tower), and Gemma 4 as
its 31B / 26B checkpoints are (no per-layer inputs; full-attention layers wider than the
sliding ones, so its layers differ in size); ``BartForCausalLM``, whose own loss scores each
position against its label as given (no shift: its caller shifts)."""


SIDE_INPUTS: dict[str, tuple[str, Callable[[], Any]]] = {
    "gemma3n": ("Gemma3nForCausalLM", lambda: _cfg(
        transformers.Gemma3nTextConfig, head_dim=16, intermediate_size=[128, 96],
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, laurel_rank=8,
        altup_num_inputs=3, num_kv_shared_layers=0, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.95, 0.0], final_logit_softcapping=3.0)),
    "gemma4_e": ("Gemma4ForCausalLM", lambda: _cfg(
        transformers.Gemma4TextConfig, head_dim=16, global_head_dim=32, sliding_window=4,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=0, final_logit_softcapping=3.0, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2)),
    "gemma3n_kv": ("Gemma3nForCausalLM", lambda: _cfg(
        transformers.Gemma3nTextConfig, head_dim=16, intermediate_size=[128, 96, 128, 96],
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, laurel_rank=8,
        altup_num_inputs=3, num_kv_shared_layers=2, sliding_window=4, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], final_logit_softcapping=3.0)),
    "gemma4_e_kv": ("Gemma4ForCausalLM", lambda: _cfg(
        transformers.Gemma4TextConfig, head_dim=16, global_head_dim=32, sliding_window=4,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2, final_logit_softcapping=3.0, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2)),
    "mpnet_tokens": ("MPNetForTokenClassification", lambda: transformers.MPNetConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=80, num_labels=3, pad_token_id=PAD,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}
"""Models with side inputs (docs/engine.md, "Side inputs"): per-layer inputs computed from the
embedding side's weights before the layers and read by every layer (Gemma 3n text, Gemma 4 as
its E2B / E4B checkpoints are), without and with KV sharing (``..._kv``: layers 2 and 3 read
the keys / values layers 0 and 1 stored, side inputs those store units make, their gradient
carried back through them: models/kv_sharing.py); and one side input that
EVERY layer reads, its gradient summed over the layers: MPNet's relative position bias, computed
from the encoder's ``relative_attention_bias`` weights before the first layer. Gemma 4 E (4
layers, [s, f, s, f]) and MPNet (3 layers) have more layers than the self-check's tiny copy (2),
so the side inputs of the layers the copy does not have are found too (by index, only the
copy's were carried: the others' gradients were dropped)."""


SEQ2SEQ: dict[str, tuple[str, Callable[[], Any]]] = {
    "t5": ("T5ForConditionalGeneration", lambda: transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=True,
        pad_token_id=PAD, eos_token_id=1, decoder_start_token_id=PAD)),
    "bart": ("BartForConditionalGeneration", lambda: transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, scale_embedding=True, pad_token_id=PAD, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)),
    "whisper": ("WhisperForConditionalGeneration", lambda: transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=3,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=12, max_target_positions=16, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, apply_spec_augment=False,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        begin_suppress_tokens=None, suppress_tokens=None)),
    "led": ("LEDForConditionalGeneration", lambda: transformers.LEDConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64, attention_window=[4, 4], dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=2)),
    "pegasus_x": ("PegasusXForConditionalGeneration", lambda: transformers.PegasusXConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, num_global_tokens=4, block_size=4,
        stagger_local_blocks=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=PAD, eos_token_id=1, decoder_start_token_id=PAD)),
    "t5gemma": ("T5GemmaForConditionalGeneration", lambda: transformers.T5GemmaConfig(
        encoder=_t5gemma_stack(3), decoder=_t5gemma_stack(2), vocab_size=VOCAB)),
}
"""Encoder-decoders (docs/engine.md, "Side inputs"; models/seq2seq.py): every decoder layer's
cross-attention reads the encoder's output, a side input the first decoder unit makes; T5's
relative position bias, made by each stack's layer 0, is read by every layer of its stack. The
encoder and decoder have different depths (T5 3 / 2, BART 2 / 3), T5 its tied head scaled by
d_model^-0.5 and the gated FFN, BART scaled embeddings; Whisper (speech-to-text, the encoder's
input random log-mel features, its output made by the encoder's final norm in the first
decoder unit: models/whisper.py); two of BART's kin whose encoder boundary is not the input's
tokens (models/seq2seq_kin.py): LED's Longformer encoder on the input padded to its window (9
tokens -> 12) with the output cut back in the first decoder unit, and PEGASUS-X's, whose
boundary joins its 4 global tokens to the tokens padded to its block size; T5Gemma's Gemma
stacks (models/seq2seq_gemma.py: 3 / 2 layers, sliding-window layers of window 4 beside full
ones, attention and final logit soft-capping, each stack's masks by layer type and rotary
positions made before the layers). ``seq2seq_batch`` feeds them."""


def _t5gemma_stack(layers: int) -> dict[str, Any]:
    """One T5Gemma stack's config: sliding-window (window 4) and full layers in turn,
    grouped-query attention, non-default soft-capping."""
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                layer_types=(["sliding_attention", "full_attention"] * 2)[:layers],
                final_logit_softcapping=3.0, attn_logit_softcapping=4.0,
                pad_token_id=PAD, bos_token_id=1, eos_token_id=2)


def seq2seq_batch(size: int, seed: int, name: str = "t5") -> dict[str, torch.Tensor]:
    """A ``DataCollatorForSeq2Seq``-style batch: ``input_ids`` (size, 9) right-padded with PAD
    and their ``attention_mask``, ``labels`` (size, 6) of another length, padded with -100. For
    ``"whisper"``: ``input_features`` (size, 8 mel bins, 24 frames) of random values instead of
    the token ids (what ``WhisperFeatureExtractor`` pads every clip to)."""
    g = torch.Generator().manual_seed(seed)
    if name == "whisper":
        labels = torch.randint(3, VOCAB, (size, 6), generator=g)
        for row in range(size):
            labels[row, int(torch.randint(2, 7, (), generator=g)):] = -100
        return {"input_features": torch.randn(size, 8, 24, generator=g), "labels": labels}
    ids = torch.randint(3, VOCAB, (size, 9), generator=g)
    labels = torch.randint(3, VOCAB, (size, 6), generator=g)
    mask = torch.ones_like(ids)
    for row in range(size):
        keep = int(torch.randint(3, 10, (), generator=g))
        ids[row, keep:], mask[row, keep:] = PAD, 0
        labels[row, int(torch.randint(2, 7, (), generator=g)):] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


IMAGE_SIZE = 32
IMAGES: dict[str, tuple[str, Callable[[], Any]]] = {
    "convnext": ("ConvNextForImageClassification", lambda: transformers.ConvNextConfig(
        num_stages=4, depths=[1, 3, 2, 1], hidden_sizes=[8, 16, 24, 32], patch_size=4,
        image_size=IMAGE_SIZE, num_labels=3, layer_scale_init_value=0.5)),
    "swinv2": ("Swinv2ForImageClassification", lambda: transformers.Swinv2Config(
        image_size=IMAGE_SIZE, patch_size=4, embed_dim=16, depths=[1, 2], num_heads=[2, 2],
        window_size=4, num_labels=3)),
    "siglip2": ("Siglip2ForImageClassification", lambda: transformers.Siglip2Config(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_patches=16, patch_size=4),
        num_labels=3)),
}
"""Hierarchical image backbones: each stage one unit (its downsampling and blocks), units of
different sizes, the hidden states (m, 8, 8, 8) -> (m, 16, 4, 4) -> (m, 24, 2, 2) -> (m, 32,
1, 1) between them. ConvNeXt's stage 1 holds 3 blocks where the self-check's tiny copy holds 2
(the shrink cuts each stage to at most 2 blocks), so the staging on this model is not the
copy's; its layer scale is 0.5, not 1e-6, so every block's weights move the loss. Swin V2's
stages return their output dimensions, which its encoder turns into the next stage's
input_dimensions (the stubs return them from a fake-tensor run of the stages:
models/generic_outputs.py), hidden states (m, 64, 16) -> (m, 16, 32). SigLIP 2 takes its
images as patch sequences of variable grids (NaFlex: ``pixel_values`` (m, 16, 48),
``spatial_shapes``, ``pixel_attention_mask``), its position embeddings resized per image from
a parameter the forward reads without calling its module (``generic.ParameterReads``)."""


def image_zoo_batch(size: int, seed: int, name: str = "convnext") -> dict[str, torch.Tensor]:
    """``size`` random images of the ``IMAGES`` model ``name`` and class labels in [0, 3):
    (size, 3, IMAGE_SIZE, IMAGE_SIZE) pixels, or SigLIP 2's patch sequences of three grid
    sizes (``generic_heads.patch_batch``, as the self-check builds them)."""
    g = torch.Generator().manual_seed(seed)
    if name == "siglip2":
        from hf_cephalo.models.generic_heads import patch_batch

        batch = patch_batch(IMAGES[name][1]().vision_config, size, g)
    else:
        batch = {"pixel_values": torch.randn(size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)}
    return {**batch, "labels": torch.randint(0, 3, (size,), generator=g)}


def build_zoo(name: str, seed: int = 0) -> torch.nn.Module:
    """The tiny ``name`` model in eval mode (dropout off), fp32, deterministic init."""
    class_name, config = {**ZOO, **EXTRA, **SIDE_INPUTS, **IMAGES, **SEQ2SEQ}[name]
    torch.manual_seed(seed)
    cfg = config()
    cfg._attn_implementation = "eager"
    return getattr(transformers, class_name)(cfg).eval()


def zoo_batch_arch(name: str) -> str:
    """The ``make_batch`` arch whose batch layout fits ``name``: causal LM rows with labels, or
    one class label per row for the classifier."""
    return "qwen2_cls" if name.endswith("_cls") else "llama"
