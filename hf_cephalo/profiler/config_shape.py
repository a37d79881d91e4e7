"""A transformers config -> the model's own facts for spec-sheet planning (``ConfigShape``).

``hf-cephalo plan / simulate --model`` take, besides the hand-written table shapes, any
transformers config: a local folder holding ``config.json`` (or the file), a Hub id already in
the local Hub cache (nothing is downloaded), or a ``model_type`` (e.g. ``qwen3``) built from
transformers' defaults; ``--model-override KEY=VALUE`` changes fields of any of them
(``resolve_model_config``). ``config_shape`` builds the model on the meta device (no memory,
no weights), stages it as the runtime does (``models.stage_model``: the layers the engine
shards, proven on a tiny copy first) and reads what the planner needs from it: the
``ModelProfile`` the runtime plans with (``model_facts.model_profile``), and per layer the
matmul elements one token runs through (routed experts by the router's top-k share) and the
keys one query attends to (``layer_types``: a sliding-window layer sees its window).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

import torch

from hf_cephalo.profiler.model_facts import model_profile
from hf_cephalo.profiles.config_shape import ConfigShape

__all__ = ["parse_overrides", "resolve_model_config", "config_shape", "DEFAULT_SEQ_LEN"]

DEFAULT_SEQ_LEN = 512
"""Tokens per sample a config model is priced at without ``--sequence-length`` (as the table
shapes: the paper's §4 setting)."""

_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERT_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k")
_FORMS = ("a folder holding config.json (or the file), a Hub id in the local Hub cache "
          "(e.g. Qwen/Qwen3-0.6B; nothing is downloaded), a transformers model_type (e.g. "
          "qwen3, with --model-override hidden_size=1024 ...)")


def parse_overrides(items: Sequence[str] | None) -> dict[str, Any]:
    """``["hidden_size=1024", "tie_word_embeddings=false"]`` -> a dict; each value read as
    JSON (numbers, true / false, null, lists), else as text. ValueError for an item without
    ``=``."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--model-override {item!r}: give KEY=VALUE, e.g. "
                             "--model-override num_hidden_layers=28")
        try:
            out[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[key.strip()] = text
    return out


def resolve_model_config(model: str, overrides: dict[str, Any] | None = None,
                         table_shapes: Sequence[str] = (), flag: str = "--model"):
    """(config, source) of ``--model``: a folder or config.json file, a model_type, or a Hub id
    in the local cache, built with ``overrides`` among its fields (so fields derived from them,
    such as ``layer_types`` from ``num_hidden_layers``, follow); a key the config does not have
    is refused (a typo would otherwise price the defaults). ``table_shapes``: names the error
    lists too; ``flag``: the option the messages name.

    Raises:
        ValueError: none of the forms matches, the file is not a config, an unknown key, or
            fields transformers refuses together.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if os.path.exists(model):
        file = os.path.join(model, "config.json") if os.path.isdir(model) else model
        data, source = _config_data(file, model, flag), os.path.abspath(model)
    elif model in CONFIG_MAPPING:
        data, source = {"model_type": model}, f"model_type {model}"
    elif re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", model):  # org/name
        data, source = _config_data(_cached_config_file(model, flag), model, flag), \
            f"Hub cache {model}"
    elif os.sep in model or model.startswith("."):
        raise ValueError(f"{flag} {model!r} does not exist; give a folder holding a "
                         "config.json (or the file)")
    else:
        raise ValueError(f"unknown model {model!r}: {flag} takes {_FORMS}"
                         + (f", or a table shape (known: {sorted(table_shapes)})"
                            if table_shapes else ""))
    return _build_config(data, overrides or {}, model, flag), source


def _cached_config_file(model: str, flag: str) -> str:
    from transformers.utils import cached_file

    try:
        path = cached_file(model, "config.json", local_files_only=True)
    except (OSError, ValueError) as e:
        path, reason = None, type(e).__name__
    else:
        reason = "no config.json"
    if path is None:
        raise ValueError(f"{flag} {model!r} is not in the local Hub cache ({reason}; nothing is "
                         f"downloaded): fetch its config first (e.g. `hf download {model} "
                         "config.json`), or give a folder holding its config.json")
    return path


def _config_data(file: str, model: str, flag: str) -> dict[str, Any]:
    if not os.path.isfile(file):
        raise ValueError(f"{flag} {model!r}: the folder holds no config.json; give a folder "
                         "save_pretrained wrote, or the config.json itself")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {file!r} is not valid JSON ({e}); give a transformers "
                         "config.json") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{flag} {file!r} has no 'model_type'; give a transformers config.json "
                         "(the one save_pretrained writes beside the weights)")
    return data


def _build_config(data: dict[str, Any], overrides: dict[str, Any], model: str, flag: str):
    """The config of ``data`` with ``overrides``: each key where the config class has it, else
    in its text config (a multimodal model's ``text_config``)."""
    import transformers

    data = dict(data)
    default = transformers.AutoConfig.for_model(data["model_type"])
    text_key = next((k for k in ("text_config",) if hasattr(default, k)), None)
    for key, value in overrides.items():
        if hasattr(default, key):
            data[key] = value
        elif text_key and hasattr(default.get_text_config(), key):
            data[text_key] = {**(data.get(text_key) or {}), key: value}
        else:
            raise ValueError(f"--model-override {key}={value!r}: the {data['model_type']} "
                             f"config of {model!r} has no field {key!r} (fields such as "
                             "num_hidden_layers, hidden_size, intermediate_size, "
                             "num_attention_heads, vocab_size)")
    try:
        return transformers.AutoConfig.for_model(**data)
    except Exception as e:  # noqa: BLE001 - transformers' validators raise several types
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"{flag} {model!r}: transformers refuses this config (model_type "
                         f"{data['model_type']!r}: {first.strip()})") from None


def config_shape(config, *, name: str, seq_len: int = DEFAULT_SEQ_LEN,
                 source: str = "") -> ConfigShape:
    """The ``ConfigShape`` of the model ``config`` builds (on the meta device), staged as the
    runtime stages it, priced at ``seq_len`` tokens per sample.

    Raises:
        ValueError: transformers cannot build the config's class, hf_cephalo cannot stage it
            (the refusal names why), or ``seq_len`` exceeds the model's positions.
    """
    from hf_cephalo.models import stage_model

    text = config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(f"--sequence-length {seq_len} exceeds the {limit} positions of {name} "
                         f"(max_position_embeddings); give --sequence-length {limit} or less")
    staged = stage_model(_meta_model(config, name))
    units = staged.units()
    experts = _first_int(text, _EXPERT_COUNT)
    top_k = _first_int(text, _EXPERT_TOP_K) if experts else 0
    matmul, kinds = zip(*(_unit_matmul(u, experts, top_k) for u in units))
    attention = _attention_kinds(text, len(units))
    window = getattr(text, "sliding_window", None) or seq_len
    spans = tuple(min(seq_len, window) if k == "sliding_attention" else seq_len
                  for k in attention)
    heads = int(text.num_attention_heads)
    hidden = int(text.hidden_size)
    return ConfigShape(
        name=name, profile=model_profile(staged, name=name), hidden=hidden, heads=heads,
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        vocab=int(text.vocab_size), seq_len=int(seq_len), unit_matmul_params=tuple(matmul),
        unit_attention_span=spans,
        layer_kinds=tuple(a + ("+moe" if moe else "") for a, moe in zip(attention, kinds)),
        num_experts=experts, experts_per_token=top_k, source=source)


def _meta_model(config, name: str) -> torch.nn.Module:
    """The config's class (its first ``architectures`` entry, else transformers' causal LM for
    its model_type) built on the meta device in fp32."""
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    try:
        with torch.device("meta"):
            if cls is None:
                return transformers.AutoModelForCausalLM.from_config(config).float()
            return cls(config).float()
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"cannot build {arch or 'a causal LM'} from the config of {name} "
                         f"({type(e).__name__}: {first}); hf_cephalo prices the causal-LM and "
                         "sequence-classification models of transformers") from None


def _first_int(config, names: Sequence[str]) -> int:
    for n in names:
        value = getattr(config, n, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _unit_matmul(unit: torch.nn.Module, experts: int, top_k: int) -> tuple[int, bool]:
    """(weight-matrix elements one token runs through in ``unit``, whether it routes to
    experts): a parameter under a module named ``experts`` counts top_k / experts of its
    elements (the router picks top_k of them per token); biases, norms and other 1-D
    parameters are not matmuls."""
    total, routed = 0.0, False
    for name, p in unit.named_parameters():
        parts = name.split(".")
        if p.dim() < 2 or parts[-1].endswith("bias"):
            continue
        if experts and "experts" in parts[:-1]:
            total += p.numel() * top_k / experts
            routed = True
        else:
            total += p.numel()
    return round(total), routed


def _attention_kinds(text, num_layers: int) -> list[str]:
    """Per layer its attention kind: the config's ``layer_types`` where it has them, else
    ``sliding_attention`` for a model whose every layer uses its ``sliding_window``."""
    kinds = getattr(text, "layer_types", None)
    if kinds is not None and len(kinds) == num_layers:
        return [str(k) for k in kinds]
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * num_layers
