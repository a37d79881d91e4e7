"""The tiny copy's config: a model's own config with only its sizes shrunk (the self-check's
``tiny_config``, [Note: the self-check] in ``models/self_check.py``).

Layers, widths, heads, experts, vocabulary and sparse-attention token counts are cut, the
fields tied to them kept tied; every flag, multiplier, scale, softcap and layer pattern is
kept; where the config class validates its sizes, a size it accepts is chosen
(``SHRINK_VARIANTS``)."""

from __future__ import annotations

import copy
import inspect
import json
import warnings
from typing import Any

import torch

TINY_VOCAB = 96
TINY_MAX_NUMEL = 50_000_000  # a tiny copy above this is a config the shrink missed
_SIZES = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 24,
          "shared_expert_intermediate_size": 24, "ffn_hidden_size": 48, "n_inner": 48,
          "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
          "v_head_dim": 8, "d_model": 32, "n_embd": 32, "embedding_size": 32,
          "hidden_size_per_layer_input": 8}
_SIZES["d_latents"] = 32  # Perceiver's latents' width (its layers run on the latents)
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
_STACKS = ("encoder", "decoder", "cross")
"""Stacks with their own ``<stack>_num_key_value_heads`` (Moonshine's encoder, Dia's
cross-attention): shrunk by the same rule as the model's key / value heads, so they never
exceed their stack's query heads, which the shrink sets to 4."""
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOPK = ("num_experts_per_tok", "moe_topk", "top_k")
_SPARSE_TOKENS = ("index_topk", "_num_local_tokens", "_num_sink_tokens")
"""Token counts of sparse attention (the keys a DSA / index layer picks, its local and sink
tokens): shrunk below the check's rows, like the sliding window, so the sparse path (and any
state it hands a later layer, as Kolibri 1.1's reindexers read an earlier layer's key pool)
runs in the check; at their defaults (2048 keys) a 9-token row never reaches it."""
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id",
              "decoder_start_token_id")


# config properties transformers keeps as deprecated aliases: reading one logs a deprecation
# warning in the user's run, and neither is a per-layer list
_DEPRECATED_PROPERTIES = frozenset({"torch_dtype", "use_return_dict"})


def _per_layer_lists(cfg: Any, L: int) -> list:
    """The config's per-layer lists: its fields of length ``L`` and the lists its class derives
    per layer from the start (a ``layers_block_type`` property read from an attention period /
    offset or a cyclic ``block_types``: fewer layers give a prefix of it; a list counted from
    the last layer, e.g. which layers store keys / values for shared ones, is not a pattern
    the first layers must show)."""
    out = [v for v in vars(cfg).values() if isinstance(v, (list, tuple)) and len(v) == L]
    if L < 2:
        return out
    fewer = copy.copy(cfg)
    _set(fewer, "num_hidden_layers", L - 1)
    for name in dir(type(cfg)):
        if isinstance(getattr(type(cfg), name, None), property) and name not in vars(cfg) \
                and name not in _DEPRECATED_PROPERTIES:
            value = _get(cfg, name)
            if isinstance(value, (list, tuple)) and len(value) == L \
                    and list(_get(fewer, name) or ()) == list(value[:L - 1]):
                out.append(value)
    return out


def _num_layers_needed(cfg: Any, L: int) -> int:
    """Fewest layers that keep every per-layer pattern of the config (each distinct entry of a
    per-layer list, stored or derived, the first MoE layer after dense ones), at least 2."""
    need = 2
    for value in _per_layer_lists(cfg, L):
        if L > 0:
            seen: list = []
            for i, v in enumerate(value):
                key = json.dumps(v, sort_keys=True, default=str)
                if key not in seen:
                    seen.append(key)
                    need = max(need, i + 1)
    for key in ("first_k_dense_replace", "decoder_sparse_step", "moe_layer_freq"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            need = max(need, v + 1)
    for key in ("mlp_only_layers",):
        v = getattr(cfg, key, None)
        if v:
            need = max(need, min(max(v) + 2, L))
    if (int_field(cfg, "num_kv_shared_layers") or 0) > 0:
        need += 1  # the last layers reuse an earlier layer's keys / values: keep one that does
    return min(L, need)


def _shared_kv_layers(cfg: Any, L: int, n: int) -> int | None:
    """``num_kv_shared_layers`` (the last layers, which reuse the keys / values of the last
    earlier layer of their type) for ``n`` of ``L`` layers: as many as fit after the layers
    that keep the per-layer patterns, at least one."""
    k = int_field(cfg, "num_kv_shared_layers")
    if not k or n >= L:
        return None
    return max(1, min(k, n - (_num_layers_needed(cfg, L) - 1)))


def _is_width(key: str) -> bool:
    return ("dim" in key or "size" in key or key.startswith("n_")) and not any(
        w in key for w in ("position", "vocab", "window", "layer", "head", "expert", "chunk",
                           "group", "block", "batch", "image"))


def _get(cfg: Any, key: str) -> Any:
    """``cfg.key``, or None where reading it raises (a per-layer attribute read globally)."""
    try:
        return getattr(cfg, key, None)
    except Exception:  # noqa: BLE001 - a per-layer attribute: the stored global value
        return vars(cfg).get(key)


def _set(cfg: Any, key: str, value: Any) -> None:
    """``cfg.key = value``, except where the class makes ``key`` a read-only property (derived
    from other fields, which the shrink sets); a per-layer attribute's global value is stored
    as the config stores it."""
    prop = getattr(type(cfg), key, None)
    if isinstance(prop, property) and prop.fset is None:
        return
    try:
        setattr(cfg, key, value)
    except Exception:  # noqa: BLE001
        vars(cfg)[key] = value


def int_field(cfg: Any, key: str) -> int | None:
    """``cfg.key`` when it is an int (not a bool), else None."""
    v = _get(cfg, key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _cap(cfg: Any, keys: tuple[str, ...], limit: int) -> None:
    """Each integer field of ``keys`` above ``limit`` set to ``limit``."""
    for key in keys:
        value = int_field(cfg, key)
        if value is not None and value > limit:
            _set(cfg, key, limit)


def _ssm_splits(cfg: Any) -> list[tuple[str, str, Any, int]]:
    """(heads field, head-width field, expand, heads) of each state-space mixer whose inner width,
    expand × the model width, the config splits into heads × head width (Mamba-2 style):
    the shrink keeps that split, or the mixer's reshape into heads fails."""
    hidden = next((int_field(cfg, k) for k in ("hidden_size", "d_model") if int_field(cfg, k)), None)
    ints = {k: v for k, v in vars(cfg).items() if isinstance(v, int) and not isinstance(v, bool)}
    out = []
    for e_key, expand in vars(cfg).items():
        if "expand" not in e_key or isinstance(expand, bool) or \
                not isinstance(expand, (int, float)) or hidden is None:
            continue
        for h_key, h in ints.items():
            for d_key, d in ints.items():
                if "heads" in h_key and ("head_dim" in d_key or "d_head" in d_key
                                         or "headdim" in d_key) and h * d == expand * hidden:
                    out.append((h_key, d_key, expand, h))
    return out


def _keep_ssm_splits(cfg: Any, splits: list, groups: dict[str, int]) -> None:
    """Each split of ``_ssm_splits`` made again at the tiny width: 4 heads (fewer where the
    inner width has fewer), head width = expand × width / heads; a group count (B / C shared
    by a group of heads) dividing the heads, below them where it was."""
    hidden = next((int_field(cfg, k) for k in ("hidden_size", "d_model") if int_field(cfg, k)), None)
    for h_key, d_key, expand, heads_before in splits:
        inner = int(expand * hidden)
        heads = max(h for h in (4, 2, 1) if inner % h == 0)
        _set(cfg, h_key, heads)
        _set(cfg, d_key, inner // heads)
        for g_key, g in groups.items():
            if heads_before % g == 0:
                shared = g < heads_before  # heads shared a group: keep them sharing one
                _set(cfg, g_key, max(x for x in range(1, heads + 1) if heads % x == 0
                                     and x <= g and (x < heads or not shared or heads == 1)))


_MODEL_WIDTHS = ("hidden_size", "d_model", "n_embd")


def _model_widths(cfg: Any) -> dict[int, int]:
    """{a model width of ``cfg`` (hidden_size, d_model, n_embd): its tiny size}."""
    return {_get(cfg, k): _SIZES[k] for k in _MODEL_WIDTHS if int_field(cfg, k) is not None}


def _shrink_heads(cfg: Any, group_heads: bool) -> None:
    """Query heads to 4 (every stack's: an encoder-decoder's ``decoder_attention_heads`` equal
    to its ``num_attention_heads``, Whisper's), key / value heads to 4, 2 or 1 by their ratio;
    ``group_heads``: ``_keep_group_heads``."""
    heads = next((int_field(cfg, k) for k in _HEADS if int_field(cfg, k) is not None), None)
    kv = next((int_field(cfg, k) for k in _KV_HEADS if int_field(cfg, k) is not None), None)
    stacks = {s: (int_field(cfg, f"{s}_num_attention_heads"),
                  int_field(cfg, f"{s}_num_key_value_heads")) for s in _STACKS}
    for key in _HEADS:
        if int_field(cfg, key) is not None:
            _set(cfg, key, 4)
    for key, value in list(vars(cfg).items()):
        if key.endswith("_attention_heads") and value == heads and not isinstance(value, bool):
            _set(cfg, key, 4)
    for key in _KV_HEADS:
        v = int_field(cfg, key)
        if v is not None:
            _set(cfg, key, 4 if heads is None or v >= heads else 2 if v > 1 else 1)
    for stack, (h, v) in stacks.items():  # one not aliased to the fields above (not shrunk)
        if v is not None and int_field(cfg, f"{stack}_num_key_value_heads") == v:
            _set(cfg, f"{stack}_num_key_value_heads", 4 if h is None or v >= h else
                 2 if v > 1 else 1)
    if group_heads:
        _keep_group_heads(cfg, heads, kv)


def _shrink_text(cfg: Any, head_width: int = 8, group_heads: bool = False,
                 tree_widths: dict[int, int] | None = None) -> None:
    splits = _ssm_splits(cfg)
    groups = {k: v for k, v in vars(cfg).items() if isinstance(v, int) and not isinstance(v, bool)
              and v > 0 and (k.endswith("n_groups") or k.endswith("ngroups"))}
    widths = {**(tree_widths or {}), **_model_widths(cfg)}
    for key, value in list(vars(cfg).items()):
        # a width tied to the model width (OPT's word_embed_proj_dim) stays tied to it, and so
        # does one tied to another part's model width (BLT's local hidden_size_global: its
        # global transformer's hidden_size)
        if isinstance(value, int) and not isinstance(value, bool) and value in widths \
                and key not in _SIZES and _is_width(key):
            _set(cfg, key, widths[value])
    _shrink_width_parts(cfg, widths)
    L = int_field(cfg, "num_hidden_layers")
    if L is not None:
        n = _num_layers_needed(cfg, L)
        shared = _shared_kv_layers(cfg, L, n)
        if shared is not None:
            _set(cfg, "num_kv_shared_layers", shared)
        for key, value in list(vars(cfg).items()):
            if isinstance(value, (list, tuple)) and len(value) == L and key != "architectures":
                _set(cfg, key, type(value)(value[:n]))
        _set(cfg, "num_hidden_layers", n)
        for key, value in list(vars(cfg).items()):  # encoder_layers / decoder_layers alike
            if key.endswith("_layers") and value == L and not isinstance(value, bool):
                _set(cfg, key, n)
        if _get(cfg, "mlp_only_layers"):
            cfg.mlp_only_layers = [i for i in cfg.mlp_only_layers if i < n]
        _shrink_layer_groups(cfg, L, n)
    _shrink_stage_depths(cfg)
    _shrink_depth_coefficient(cfg)
    _shrink_heads(cfg, group_heads)
    # a per-head width that is the sum of two the shrink sets (MLA's qk_head_dim = nope + rope)
    parts = {k: int_field(cfg, k) for k in _SIZES if "head_dim" in k and int_field(cfg, k) is not None}
    sums = [(key, a, b) for key, value in vars(cfg).items() if "head_dim" in key
            and key not in _SIZES and isinstance(value, int) and not isinstance(value, bool)
            for a in parts for b in parts if a < b and parts[a] + parts[b] == value]
    head_dim, rope_dim = int_field(cfg, "head_dim"), int_field(cfg, "qk_rope_head_dim")
    if head_dim is not None:  # MLA (DeepSeek) ties head_dim to the rotary part's width
        _set(cfg, "head_dim", _SIZES["qk_rope_head_dim"] if head_dim == rope_dim else head_width)
    for key, size in _SIZES.items():
        if (int_field(cfg, key) or 0) > 0:  # 0 switches the part off (Gemma 4's per-layer inputs)
            _set(cfg, key, size)
        value = _get(cfg, key)
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            # one width per layer (Gemma 3n's intermediate_size): each shrunk, 0 stays off
            _set(cfg, key, type(value)(size if v > 0 else 0 for v in value))
    for key, a, b in sums:
        _set(cfg, key, _SIZES[a] + _SIZES[b])
    _cap(cfg, ("rotary_dim", "rotary_emb_dim"), 4)  # a rotary width no wider than a tiny head
    _cap(cfg, _EXPERTS, 4)
    _cap(cfg, _TOPK, 2)
    _cap(cfg, ("n_group", "topk_group"), 1)
    if int_field(cfg, "sliding_window") is not None:
        cfg.sliding_window = 4  # shorter than the check's rows, so the sliding mask shows
    _shrink_attention_window(cfg)
    _cap(cfg, [k for k in vars(cfg) if k in _SPARSE_TOKENS or k.endswith(_SPARSE_TOKENS)], 2)
    _keep_ssm_splits(cfg, splits, groups)
    if int_field(cfg, "vocab_size") is not None:
        _shrink_vocab(cfg)


def _shrink_width_parts(cfg: Any, widths: dict[int, int]) -> None:
    """A model width split into parts (a list of widths summing to it: Reformer's
    ``axial_pos_embds_dim``, its axial position embedding's parts, concatenated to the model
    width) split the same way at the tiny width (``widths``: {model width: tiny width}): each
    part scaled, at least 1, the last taking what rounding leaves, so they still sum to it."""
    for key, value in list(vars(cfg).items()):
        if not (isinstance(value, (list, tuple)) and len(value) > 1 and _is_width(key)
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
                and sum(value) in widths):
            continue
        tiny = widths[sum(value)]
        if tiny < len(value):
            continue
        parts = [max(1, v * tiny // sum(value)) for v in value[:-1]]
        if sum(parts) < tiny:
            _set(cfg, key, type(value)(parts + [tiny - sum(parts)]))


def _shrink_attention_window(cfg: Any) -> None:
    """Longformer's and LED's ``attention_window`` (512 by default; an int or one per layer) to
    4: shorter than the check's rows, so the sliding-window attention shows (at 512 every row
    fits one window), and the forward pads each row to a multiple of 4, not of 512 (the
    check's cost: 19 s for LongformerForQuestionAnswering at 512)."""
    window = _get(cfg, "attention_window")
    if isinstance(window, int) and not isinstance(window, bool) and window > 4:
        _set(cfg, "attention_window", 4)
    elif isinstance(window, (list, tuple)) and window and all(
            isinstance(w, int) and w > 4 for w in window):
        _set(cfg, "attention_window", type(window)(4 for _ in window))


def _shrink_layer_groups(cfg: Any, L: int, n: int) -> None:
    """ALBERT's ``num_hidden_groups`` layer groups, each called for L / groups consecutive
    layers: fewer layers than groups in the copy would skip groups (ALBERT picks group
    int(i / (L / groups)) for layer i), and a copy of as many layers as groups would call each
    once where the model repeats them ([Note: repeated layer calls] in
    models/generic_repeats.py). One group per layer stays so (n groups); else at most 2 groups,
    each called twice."""
    groups = int_field(cfg, "num_hidden_groups")
    if groups is None:
        return
    if groups >= L:
        _set(cfg, "num_hidden_groups", n)
        return
    groups = min(groups, 2)
    _set(cfg, "num_hidden_groups", groups)
    _set(cfg, "num_hidden_layers", 2 * groups)


STAGE_DEPTHS = ("depths",)
"""Per-stage block counts of a hierarchical backbone (ConvNeXt's, Swin's ``depths``)."""


def _shrink_stage_depths(cfg: Any) -> None:
    """Each stage's block count cut to at most 2 (a stage's first block, which may differ,
    and one like the rest), the number of stages and every per-stage list (widths, heads,
    strides) kept, so the tiny copy has the model's stages and each downsampling; a count of
    0 stays 0. A per-block list of each stage (TextNet's kernel sizes and strides: one list
    per stage, as long as its depth) keeps its first blocks' entries, so it stays as long."""
    for key in STAGE_DEPTHS:
        depths = _get(cfg, key)
        if not (isinstance(depths, (list, tuple)) and depths and all(
                isinstance(v, int) and not isinstance(v, bool) for v in depths)):
            continue
        cut = [min(v, 2) for v in depths]
        for name, value in list(vars(cfg).items()):
            if name != key and isinstance(value, (list, tuple)) and len(value) == len(depths) \
                    and all(isinstance(v, (list, tuple)) and len(v) == d
                            for v, d in zip(value, depths)) and cut != list(depths):
                _set(cfg, name, type(value)(type(v)(v[:n]) for v, n in zip(value, cut)))
        _set(cfg, key, type(depths)(cut))


def _shrink_depth_coefficient(cfg: Any) -> None:
    """A compound-scaled network's depth multiplier (EfficientNet's ``depth_coefficient``:
    stage i repeats its block ``ceil(depth_coefficient * num_block_repeats[i])`` times) cut so
    no stage repeats its block more than twice, as ``_shrink_stage_depths`` cuts ``depths``;
    the per-stage lists and widths kept."""
    coef, repeats = _get(cfg, "depth_coefficient"), _get(cfg, "num_block_repeats")
    if isinstance(coef, (int, float)) and not isinstance(coef, bool) and coef > 0 and \
            isinstance(repeats, (list, tuple)) and repeats and \
            all(isinstance(r, int) and r > 0 for r in repeats):
        _set(cfg, "depth_coefficient", min(float(coef), 2 / max(repeats)))


def _keep_group_heads(cfg: Any, heads: int | None, kv: int | None) -> None:
    """A head count equal to the query heads per key / value head (``heads // kv``, e.g.
    Kolibri 1.1's index_num_heads: the leading query heads of key head 0 that score keys,
    at most that many) stays equal to it at the shrunk head counts. Only where the ratio
    tells it apart (1 < ratio < heads): with one key head the ratio is the head count."""
    if not heads or not kv or heads % kv or not 1 < heads // kv < heads:
        return
    tiny_heads = next((int_field(cfg, k) for k in _HEADS if int_field(cfg, k) is not None), None)
    tiny_kv = next((int_field(cfg, k) for k in _KV_HEADS if int_field(cfg, k) is not None), None)
    if not tiny_heads or not tiny_kv:
        return
    for key, value in list(vars(cfg).items()):
        if "heads" in key and key not in _HEADS + _KV_HEADS and value == heads // kv \
                and isinstance(value, int) and not isinstance(value, bool):
            _set(cfg, key, tiny_heads // tiny_kv)


def _shrink_vocab(cfg: Any) -> None:
    """Vocabulary to TINY_VOCAB; special token ids mapped into it, equal ids kept equal."""
    ids: dict[int, int] = {}
    for key in _TOKEN_IDS:
        v = getattr(cfg, key, None)
        vals = v if isinstance(v, list) else [v]
        for x in vals:
            if isinstance(x, int) and x >= TINY_VOCAB and x not in ids:
                ids[x] = TINY_VOCAB - 1 - len(ids)
    for key in _TOKEN_IDS:
        v = getattr(cfg, key, None)
        if isinstance(v, list):
            setattr(cfg, key, [ids.get(x, x) for x in v])
        elif isinstance(v, int):
            setattr(cfg, key, ids.get(v, v))
    vocab = cfg.vocab_size
    for key, value in list(vars(cfg).items()):
        # per-layer input vocabularies (Gemma 3n / 4), and a vocabulary of the same size as
        # the model's (Marian's decoder_vocab_size: its logits' width), and a vocabulary of
        # hashed ids (BLT's encoder_hash_byte_group_vocab: ids are taken modulo its size)
        if isinstance(value, int) and value > TINY_VOCAB and (
                key.startswith("vocab_size") or key.endswith("_vocab")
                or (key.endswith("vocab_size") and value == vocab)):
            _set(cfg, key, TINY_VOCAB)
    _shrink_larger_vocabs(cfg, vocab)
    cfg.vocab_size = TINY_VOCAB


def _shrink_larger_vocabs(cfg: Any, vocab: int) -> None:
    """Each further vocabulary (a ``*_vocab_size`` field) larger than the model's own
    ``vocab``, to TINY_VOCAB: a table of ids of another kind (LUKE's 500k entities, read only
    when the batch holds entity ids) would otherwise keep the tiny copy at full size; a
    smaller one (RoCBert's shape and pronunciation ids, a codebook) is left as it is."""
    for key, value in list(vars(cfg).items()):
        if key.endswith("_vocab_size") and isinstance(value, int) \
                and not isinstance(value, bool) and value > max(vocab, TINY_VOCAB):
            _set(cfg, key, TINY_VOCAB)


def tiny_config(config: Any) -> Any:
    """A copy of ``config`` with sizes shrunk (layers to the fewest that keep each per-layer
    pattern, widths, heads, experts, vocabulary, sliding window) and no cache, as it trains;
    every other field kept."""
    cfg = copy.deepcopy(config)
    subs = _configs(cfg)  # the model's own and every sub-config (text, vision, encoder...)
    tree_widths = {w: t for sub in subs for w, t in _model_widths(sub).items()}
    befores = {id(sub): dict(vars(sub)) for sub in subs}
    for sub in subs:
        _shrink_valid(sub, tree_widths)
        _keep_embedding_apart(sub, befores[id(sub)])
    for sub in subs:
        _derive_into_parts(sub, befores)
        if _get(sub, "use_cache") is True:
            # training runs without a cache (prepare_for_training turns it off; the staged
            # forwards pass use_cache=False), so the model's own loss is compared as it trains:
            # a cache only keeps state for the next call (a hybrid stack without attention
            # layers cannot even build one; a recurrent block would keep its states)
            _set(sub, "use_cache", False)
    _widen_splits(config, cfg)
    impl = getattr(config, "_attn_implementation", None)
    cfg._attn_implementation = impl if impl in ("eager", "sdpa") else None  # auto: sdpa or eager
    return cfg


def _keep_embedding_apart(cfg: Any, before: dict) -> None:
    """An embedding width the config keeps apart from the model width (ELECTRA's and ALBERT's
    ``embedding_size``, projected to ``hidden_size`` by a module that exists only then) stays
    apart: shrunk to half the tiny model width, so the tiny copy has the projection too."""
    emb, hidden = before.get("embedding_size"), before.get("hidden_size")
    if isinstance(emb, int) and isinstance(hidden, int) and emb != hidden \
            and int_field(cfg, "embedding_size") == int_field(cfg, "hidden_size"):
        _set(cfg, "embedding_size", _SIZES["hidden_size"] // 2)


SHRINK_VARIANTS = ({}, {"group_heads": True}, {"head_width": 16},
                   {"head_width": 16, "group_heads": True})
"""The shrinks ``tiny_config`` tries on each config, in order (arguments of ``_shrink_text``):
the first that the config class's own validation accepts (``validate_architecture``), else
the first. Kolibri 1.1 rounds keys and values in blocks of 16 (head_dim a multiple of 16) and
scores keys with at most the query heads of one key head (index_num_heads)."""


def _shrink_valid(cfg: Any, tree_widths: dict[int, int] | None = None) -> None:
    """``cfg`` shrunk in place (``_shrink_text``, then ``_derive_again``) by the first of
    ``SHRINK_VARIANTS`` its class validates, else by the first: a config whose class states a
    constraint on its sizes that the usual shrink breaks is shrunk to sizes that meet it, where
    a variant does; every other config gets the usual shrink."""
    nested = {id(v): v for v in vars(cfg).values() if hasattr(v, "to_json_string")}
    original = copy.deepcopy(vars(cfg), dict(nested))  # sub-configs stay the same objects
    for variant in SHRINK_VARIANTS + (SHRINK_VARIANTS[0],):
        vars(cfg).clear()
        vars(cfg).update(copy.deepcopy(original, dict(nested)))
        before = dict(vars(cfg))
        _shrink_text(cfg, tree_widths=tree_widths, **variant)
        _derive_again(cfg, before)
        if _valid(cfg):
            return


def _valid(cfg: Any) -> bool:
    """Whether the config class's own architecture validation accepts ``cfg`` (True where it
    has none) and the class builds again from its fields (``_rebuilds``)."""
    validate = getattr(cfg, "validate_architecture", None)
    if validate is None:
        return _rebuilds(cfg)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate()
    except Exception:  # noqa: BLE001 - any rejection
        return False
    return _rebuilds(cfg)


def _rebuilds(cfg: Any) -> bool:
    """Whether the config class builds again from ``cfg``'s declared fields, i.e. accepts its
    sizes where it checks them on loading rather than in ``validate_architecture`` (NeoMME's
    rotated head widths, a multiple of 4: a head of 8 with partial_rotary_factor 0.25 rotates
    2). True for a config without declared fields (nothing to rebuild)."""
    try:
        if _declared_fields(cfg) is None:
            return True
    except Exception:  # noqa: BLE001 - no signature to read: no rebuild
        return False
    return _rebuilt(cfg) is not None


def _declared_fields(cfg: Any) -> Any:
    """The signature parameters of the config class's constructor, None where it declares no
    fields (``**kwargs`` only: nothing tells fields from derived ones)."""
    params = inspect.signature(type(cfg).__init__).parameters
    if sum(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()) < 2:
        return None
    return params


def _rebuilt(cfg: Any) -> tuple[Any, Any] | None:
    """(the config class built again from ``cfg``'s declared fields, those fields' signature
    parameters), so what the class derives from them can be read; None for a config without
    declared fields (``_declared_fields``) or one that does not rebuild (it keeps its shrunk
    fields)."""
    try:
        params = _declared_fields(cfg)
        if params is None:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return type(cfg)(**{k: v for k, v in cfg.to_dict().items() if k in params}), params
    except Exception:  # noqa: BLE001 - a config that does not rebuild keeps its shrunk fields
        return None


def _derive_again(cfg: Any, before: dict) -> None:
    """Fields the config class derives from its sizes (not arguments of its constructor: a
    Zamba-2 attention width = 2 × the model width, its hybrid layer ids from the layer types)
    and that the shrink left as they were, derived again from the shrunk sizes, as the class
    derives them on loading a config of those sizes."""
    rebuilt = _rebuilt(cfg)
    if rebuilt is None:
        return
    again, params = rebuilt
    _take_derived(cfg, again, before, skip=params)


def _take_derived(cfg: Any, again: Any, before: dict, skip=()) -> None:
    """Each field of ``cfg`` the shrink left as it was (its value in ``before``) that ``again``
    (the config class built from the shrunk fields) derives otherwise, set to the derived
    value; private fields, sub-configs and the names in ``skip`` left alone."""
    for key, value in list(vars(cfg).items()):
        if key.startswith("_") or key in skip or key not in vars(again) \
                or hasattr(value, "to_json_string"):
            continue
        derived = vars(again)[key]
        if key in before and before[key] == value and derived != value:
            _set(cfg, key, derived)


def _derive_into_parts(cfg: Any, befores: dict[int, dict]) -> None:
    """Fields a config class derives into its sub-configs from the sizes of the tree (BLT's
    global_config.encoder_cross_output_size: the encoder's width × cross_attn_k, None where
    that is the global width) and that the shrink left as they were, derived again from the
    shrunk tree, as the class derives them on loading it (``befores``: each config's fields
    before the shrink, by id)."""
    if not any(hasattr(v, "to_json_string") for v in vars(cfg).values()):
        return
    rebuilt = _rebuilt(cfg)
    if rebuilt is None:
        return
    again = rebuilt[0]
    for name, sub in vars(cfg).items():
        part = vars(again).get(name)
        if hasattr(sub, "to_json_string") and hasattr(part, "to_json_string"):
            _take_derived(sub, part, befores.get(id(sub), {}))


def _configs(cfg: Any) -> list[Any]:
    """``cfg`` and every config nested in it (a multi-part model's text / vision / encoder /
    patcher configs), each once."""
    out, todo, seen = [], [cfg], set()
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        out.append(c)
        todo.extend(v for v in vars(c).values() if hasattr(v, "to_json_string")
                    and hasattr(v, "model_type"))
    return out


def tiny_numel(cls: type, cfg: Any) -> int:
    """Parameters of ``cls(cfg)``, counted on the meta device (nothing allocated)."""
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return sum(p.numel() for p in cls(cfg).parameters())


TINY_WIDTHS = (32, 48, 64, 96)
"""Model widths (``hidden_size``) a tiny copy may take, in order: the first at which every
width the model splits off it stays whole (``_split_broken``); 32 for nearly every config."""
BOX_EMBEDDINGS = 6
"""A config that embeds 2-D box coordinates by value (``max_2d_position_embeddings``) and whose
model width is a multiple of 6 splits that width among six box embeddings concatenated (x0, y0,
x1, y1, height, width: LiLT's ``hidden_size // 6`` each, LayoutLMv3's 4 × ``coordinate_size`` +
2 × ``shape_size``, each a sixth of the width), which only the modeling code states."""


def _embeds_boxes(before: Any) -> bool:
    width = int_field(before, "hidden_size")
    return int_field(before, "max_2d_position_embeddings") is not None and width is not None \
        and width % BOX_EMBEDDINGS == 0


def _widened_fields(before: Any, sub: Any, width: int) -> dict[str, int]:
    """The fields of the tiny ``sub`` (of config ``before``) that change at model width
    ``width``: those the shrink tied to the model width, and the box embeddings' widths (a
    sixth of it, ``BOX_EMBEDDINGS``) of a config that embeds boxes."""
    tiny, full = int_field(sub, "hidden_size"), int_field(before, "hidden_size")
    out = {k: width for k, v in vars(sub).items() if v == tiny and not isinstance(v, bool)
           and vars(before).get(k) == full}
    if _embeds_boxes(before):
        out.update({k: width // BOX_EMBEDDINGS for k, v in vars(sub).items()
                    if _is_width(k) and isinstance(v, int) and not isinstance(v, bool)
                    and vars(before).get(k) == v and v * BOX_EMBEDDINGS == full})
    return out


def _split_broken(before: Any, sub: Any, fields: dict[str, int]) -> bool:
    """Whether the tiny ``sub`` with ``fields`` set breaks a split of the model width that
    ``before`` (the full config) keeps: a box embedding's width no sixth of it
    (``BOX_EMBEDDINGS``), or a width the config class derives from it (Bros's
    ``dim_bbox_sinusoid_emb_1d`` = width / 4 / dim_bbox, halved for sines and cosines) odd or
    0 where the full config's is even."""
    trial = copy.copy(sub)  # its own field dict: setting a field leaves ``sub`` as it is
    for key, value in fields.items():
        _set(trial, key, value)
    width = int_field(trial, "hidden_size")
    if _embeds_boxes(before) and (width % BOX_EMBEDDINGS or any(
            _is_width(k) and v * BOX_EMBEDDINGS == int_field(before, "hidden_size")
            and (int_field(trial, k) or 0) * BOX_EMBEDDINGS != width
            for k, v in vars(before).items() if isinstance(v, int) and not isinstance(v, bool))):
        return True
    rebuilt = _rebuilt(trial)
    if rebuilt is None:
        return False
    again, params = rebuilt
    derived = {k: (v, int_field(before, k)) for k, v in vars(again).items()
               if k not in params and not k.startswith("_") and _is_width(k)
               and isinstance(v, int) and not isinstance(v, bool)}
    return any(full and full % 2 == 0 and (tiny % 2 or tiny == 0)
               for tiny, full in derived.values())


def _widen_splits(config: Any, cfg: Any) -> None:
    """Each config in the tiny ``cfg`` (of the full ``config``) whose model width breaks a split
    of it (``_split_broken``) set to the first of ``TINY_WIDTHS`` that keeps them, the fields
    the class derives from it derived again; left at 32 where none does."""
    for before, sub in zip(_configs(config), _configs(cfg)):
        if int_field(before, "hidden_size") is None or int_field(sub, "hidden_size") is None \
                or not _split_broken(before, sub, {}):
            continue
        for width in TINY_WIDTHS[1:]:
            fields = _widened_fields(before, sub, width)
            if not _split_broken(before, sub, fields):
                kept = dict(vars(sub))
                for key, value in fields.items():
                    _set(sub, key, value)
                _derive_again(sub, kept)
                break
