"""``from_pretrained_sharded``: a checkpoint's model on the meta device, read shard by shard later.

Reads like ``from_pretrained`` and returns the same model class, but builds it on the meta
device (no memory for weights) and attaches the resolved safetensors files as
``model.cephalo_checkpoint``. ``CephaloEngine`` (and so ``CephaloTrainer``) then reads on each
rank only the element ranges of its shards (``hf_cephalo.engine.loading``)::

    model = hf_cephalo.from_pretrained_sharded("meta-llama/Llama-3.2-1B")   # meta device
    trainer = CephaloTrainer(model=model, args=args, ...)                    # reads r_i of it

A model from its config alone also starts on the meta device and is initialized unit by unit
with the model's own ``_init_weights``, seeded by ``TrainingArguments.seed``::

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hf_cephalo.engine.checkpoint_files import resolve_checkpoint
from hf_cephalo.engine.loading import check_checkpoint

__all__ = ["from_pretrained_sharded"]

_HUB_KEYS = ("revision", "cache_dir", "token", "local_files_only", "subfolder")


def from_pretrained_sharded(pretrained_model_name_or_path: str | os.PathLike, *,
                            model_class: Any = None, dtype: torch.dtype = torch.float32,
                            config: Any = None, key_mapping: dict[str, str] | None = None,
                            **kwargs: Any):
    """The checkpoint's model on the meta device, its safetensors files attached.

    Args:
        pretrained_model_name_or_path: a local folder or a Hub id, resolved through the
            Hugging Face cache as ``from_pretrained`` does (``HF_HUB_OFFLINE=1`` works with a
            cached copy); ``model.safetensors`` or ``model.safetensors.index.json`` + shards.
        model_class: an Auto class or a model class (default ``AutoModelForCausalLM``).
        dtype: the parameters' dtype (default float32: the engine trains fp32 master weights);
            each slice is converted while it is read.
        config: a config to use instead of the checkpoint's.
        key_mapping: extra checkpoint key renames (regex -> replacement), as
            ``from_pretrained``'s ``key_mapping``. The model's own renames, legacy names and the
            base-model prefix are applied as ``from_pretrained`` applies them
            (``hf_cephalo.engine.checkpoint_keys``), when the engine reads the checkpoint.
        **kwargs: ``revision``, ``cache_dir``, ``token``, ``local_files_only``, ``subfolder``
            (hub options) and config overrides (e.g. ``num_labels=3``: a head whose shape then
            differs from the checkpoint's is refused here).
    Returns:
        The model, every parameter and buffer on the meta device, with
        ``model.cephalo_checkpoint`` (a ``CheckpointFiles``).
    Raises (before any collective or profiling; ``engine.loading.check_checkpoint``):
        ValueError: no safetensors checkpoint found (``resolve_checkpoint``); a parameter
            missing from it or stored with another shape; a truncated or corrupt file; no
            ``model_class`` for a checkpoint that has no causal LM (it names the argument).
        NotImplementedError: a tensor transformers converts other than by stacking experts
            (per-expert tensors merged into a fused parameter are read range by range).
    """
    import transformers

    hub = {k: kwargs.pop(k) for k in _HUB_KEYS if k in kwargs}
    files = resolve_checkpoint(pretrained_model_name_or_path, **hub)
    files.key_mapping = dict(key_mapping) if key_mapping else None
    if config is None:
        config = transformers.AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub,
                                                         **kwargs)
    cls = model_class if model_class is not None else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        if hasattr(cls, "from_config"):  # an Auto class
            try:
                model = cls.from_config(config, dtype=dtype)
            except ValueError as exc:
                if model_class is not None:
                    raise
                raise ValueError(_not_causal(config)) from exc
        else:
            model = cls._from_config(config, dtype=dtype)
    check_checkpoint(model, files)  # refusals now, before a trainer profiles or plans
    model.cephalo_checkpoint = files
    return model


def _not_causal(config: Any) -> str:
    """The refusal of a checkpoint that AutoModelForCausalLM, the default, cannot build."""
    architectures = getattr(config, "architectures", None) or []
    named = ", ".join(architectures) or "no architectures"
    example = architectures[0] if architectures else "<ItsClass>"
    return (f"from_pretrained_sharded builds AutoModelForCausalLM unless model_class= is given, "
            f"and a {config.model_type!r} checkpoint ({named}) has no causal LM; pass the "
            f"class to train, e.g. model_class=transformers.{example}")


_LOADING_ONLY_KEYS = ("quantization_config", "load_in_8bit", "load_in_4bit", "use_kernels",
                      "tp_plan", "tp_size", "device_mesh", "max_memory", "offload_folder",
                      "offload_state_dict", "offload_buffers", "gguf_file", "variant",
                      "use_safetensors", "adapter_name", "adapter_kwargs", "weights_only")
"""``from_pretrained`` options that are not config fields and that a meta-device start, each
rank reading its shards of the safetensors files, cannot honour (a value of None / False is
no request and passes)."""


def load_named_model(name: str, model_init_kwargs: dict[str, Any] | None, *, door: str,
                     trust_remote_code: bool = False, whole: bool = False):
    """A model given BY NAME to a TRL door, loaded as stock TRL loads it
    (``trl.trainer.utils.create_model_from_path``: ``AutoModelForCausalLM`` with
    ``model_init_kwargs``, dtype float32 unless given), but with ``from_pretrained_sharded``:
    on the meta device, each rank later reading only its shards, so no rank holds the whole
    model.

    Args:
        name: a Hub id or a local folder.
        model_init_kwargs: the config's ``model_init_kwargs``: the hub options (``revision``,
            ``cache_dir``, ``token``, ``local_files_only``, ``subfolder``),
            ``trust_remote_code``, ``attn_implementation``; ``dtype`` float32, or "auto" for a
            checkpoint stored in float32; ``device_map`` None / "auto" and
            ``low_cpu_mem_usage`` (the engine's placement supersedes them); any other key is a
            config override, as ``from_pretrained`` treats it (``use_cache=False``).
        door: the trainer's name, for the messages.
        whole: load the whole model on every rank (``from_pretrained``), as stock does: for a
            ``peft_config`` the trainer applies itself, whose new adapter weights no checkpoint
            holds (PEFT initializes them from the random stream of a whole model); the engine
            shards it afterwards.

    Raises ValueError (before any collective) for a value the engine cannot honour: a dtype
    other than float32 (the engine keeps fp32 master weights; use ``bf16=True`` or per-rank
    precision for lower-precision compute), a hand device map, or a loading option of
    ``_LOADING_ONLY_KEYS`` (quantization, kernels, tensor parallelism, offloading, ...).
    """
    import transformers

    kwargs = dict(model_init_kwargs or {})
    loading = sorted(k for k in _LOADING_ONLY_KEYS if kwargs.pop(k, None) not in (None, False))
    if loading:
        raise ValueError(f"{door}(model={name!r}) with model_init_kwargs {loading}: the engine "
                         "loads the model shard by shard on the meta device and cannot honour "
                         "them; load the model yourself and pass the object, or drop them")
    dtype = asked = kwargs.pop("dtype", "float32")
    if dtype == "auto":  # the checkpoint's own dtype: fine where that is float32
        hub = {k: kwargs[k] for k in (*_HUB_KEYS, "trust_remote_code") if k in kwargs}
        stored = getattr(transformers.AutoConfig.from_pretrained(name, **hub), "dtype", None)
        dtype = "float32" if stored in (None, "float32", torch.float32) else stored
    if dtype not in (None, "float32", torch.float32):
        stored = "" if asked == dtype else f" (the checkpoint's {dtype})"
        raise ValueError(f"{door}(model={name!r}) with model_init_kwargs dtype={asked!r}"
                         f"{stored}: the engine trains fp32 master weights; drop dtype (float32) and use "
                         "bf16=True for bf16 compute (or per-rank precision: docs/guide.md)")
    if kwargs.pop("device_map", None) not in (None, "auto"):
        raise ValueError(f"{door}(model={name!r}): a device_map other than None / 'auto' places "
                         "layers by hand; the engine places every rank's shards itself")
    kwargs.pop("low_cpu_mem_usage", None)
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    attn = kwargs.pop("attn_implementation", None)
    if whole:
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32,
                                                                  **kwargs)
    else:
        model = from_pretrained_sharded(name, **kwargs)  # the rest: hub options, overrides
    if attn is not None:
        model.set_attn_implementation(attn)
    return model
