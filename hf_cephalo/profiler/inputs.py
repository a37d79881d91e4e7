"""What the profiler measures with: ``MeasureConfig`` and the training-shaped inputs.

``MeasureConfig`` (microbatch sizes 1..M, sequence length, repeats, precision, compile) and
the profile's precision tag (``precision_tag``); ``synthetic_microbatch`` builds a microbatch
of the training shape from the model's config (``max_positions`` bounds its sequence length),
``sequence_length_of`` reads the training sequence length off a dataset, and
``build_model_from_config`` builds a model with random weights from a local config for
``hf-cephalo profile``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from hf_cephalo.engine.rank_precision import DTYPES
from hf_cephalo.models.document_inputs import with_document_inputs
from hf_cephalo.models.generic_heads import (CLASSIFIER_TASKS, QUESTION_ANSWERING,
                                             TOKEN_CLASSIFICATION, task_of)
from hf_cephalo.profiles.precision import PRECISIONS, Precision

__all__ = ["MeasureConfig", "MakeMicrobatch", "precision_tag",
           "synthetic_microbatch", "max_positions", "build_model_from_config",
           "sequence_length_of"]

MakeMicrobatch = Callable[[int], Mapping[str, torch.Tensor]]


def precision_tag(param_dtype: str, precision: str, gather: str = "fp32",
                  reduce: str = "fp32") -> str:
    """What a profile records as its dtype ([Note: precision tags] in ``precision.py``): the
    parameters' (master) dtype name, plus the autocast compute dtype, the gathered-parameter
    and the reduce-scatter dtype when they are cast (e.g. ``"float32+autocast-bf16"``,
    ``"float32+autocast-bf16+gather-bf16"``)."""
    return Precision(precision, gather, reduce).check().tag(param_dtype)


@dataclass(kw_only=True)
class MeasureConfig:
    """How to profile.

    Attributes:
        max_microbatch_size: M; microbatch sizes 1..M are profiled (samples).
        sequence_length: tokens per sample of the synthetic text microbatches (ignored for
            vision models, whose image size comes from the config).
        warmup: untimed runs per microbatch size.
        repeats: timed runs per microbatch size (the median is kept).
        comm_repeats: timed runs of each collective (the median is kept).
        progress: print progress lines. By default rank 0 alone prints, at most one line per
            ``QUIET_INTERVAL_S`` seconds (time left) and one summary line when done: a few
            lines per start, not one per rank per second.
        verbose: every rank prints, once a second, with the times of each microbatch size
            (``hf-cephalo profile --verbose``, ``HF_CEPHALO_VERBOSE=1``).
        precision: "fp32", or "bf16" / "fp16" to time the forward calls under that autocast
            like the engine's ``autocast_dtype`` (``TrainingArguments(bf16=True)`` /
            ``fp16=True``).
        param_dtype: "fp32" (the master weights are gathered), or the compute dtype: the
            unit's flat views are cast to it, as the engine's gathered units with
            ``param_dtype`` (engine/flat_param.py [Note: low-precision gathered parameters]),
            so times and activation memory are those of the gathered low-precision unit.
        reduce_dtype: "fp32" or ``param_dtype``; recorded in the profile's precision tag and
            ``ModelProfile.reduce_bytes`` (the collectives are timed in the master dtype and
            scaled by the planner, ``cost.unit_comm``).
        compile_backend / compile_mode: None (eager), or the ``torch.compile`` backend and mode
            the engine will compile its units with (``CephaloEngine(compile=...)``): the units
            run compiled while timed (the warm-up rounds absorb the compilation) and eager again
            afterwards, so the plan prices what will run; part of the profile cache key.
    """

    max_microbatch_size: int = 8
    sequence_length: int = 128
    warmup: int = 1
    repeats: int = 3
    comm_repeats: int = 5
    progress: bool = True
    verbose: bool = False
    precision: str = "fp32"
    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    compile_backend: str | None = None
    compile_mode: str | None = None

    @property
    def precision_spec(self) -> Precision:
        """Compute / gathered-parameter / reduce dtypes of this profile."""
        return Precision(self.precision, self.param_dtype, self.reduce_dtype)

    @property
    def gather_dtype(self) -> torch.dtype | None:
        """The dtype the unit's views are cast to, None when not cast."""
        return DTYPES.get(self.param_dtype)

    def prints(self, rank: int) -> bool:
        """Whether ``rank`` prints progress lines under this config."""
        return self.progress and (self.verbose or rank == 0)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"MeasureConfig.precision = {self.precision!r}: need one of "
                             f"{PRECISIONS}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in ("fp32", self.precision):
                raise ValueError(f"MeasureConfig.{name} = {value!r}: need 'fp32' or the compute "
                                 f"precision {self.precision!r}")
        if self.reduce_dtype != "fp32" and self.param_dtype == "fp32":
            raise ValueError(f"MeasureConfig.reduce_dtype = {self.reduce_dtype!r} is lower than "
                             "param_dtype 'fp32': use reduce_dtype 'fp32'")
        for name, minimum in (("max_microbatch_size", 1), ("sequence_length", 1), ("warmup", 0),
                              ("repeats", 1), ("comm_repeats", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"MeasureConfig.{name} = {value!r}: need an integer >= {minimum}")

    @property
    def microbatch_sizes(self) -> list[int]:
        return list(range(1, self.max_microbatch_size + 1))


def max_positions(model: torch.nn.Module) -> int | None:
    """Longest sequence (tokens) the model's position embeddings cover: its config's
    ``max_position_embeddings`` or ``n_positions``; None when the config names neither."""
    cfg = _text_config(model)
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def _text_config(model: torch.nn.Module):
    """The config that describes the model's text inputs: its text config where it has one (a
    vision-language ``...ForConditionalGeneration`` keeps ``vocab_size`` there), else its own."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else None
    return text if text is not None else cfg


def synthetic_microbatch(model: torch.nn.Module, m: int, sequence_length: int,
                         device: torch.device | str = "cpu",
                         seed: int = 0) -> dict[str, torch.Tensor]:
    """A microbatch of m samples shaped like the training data, built from the model's config.

    Text models: ``input_ids`` (m, S) int64 and ``attention_mask`` (m, S) of ones, with the
    targets of the model's task (``generic_heads.task_of``): causal and masked LM ``labels`` =
    the inputs (m, S); sequence classification ``labels`` (m,) and token classification
    ``labels`` (m, S), both in [0, num_labels); question answering ``start_positions`` /
    ``end_positions`` (m,) in [0, S); a document model's boxes or HTML paths where its forward
    takes them (``bbox`` (m, S, 4), ``xpath_tags_seq`` / ``xpath_subs_seq``:
    ``models.document_inputs``). Vision models (``main_input_name == "pixel_values"``):
    ``pixel_values`` (m, C, H, W) and ``labels`` (m,).

    Raises ValueError for a model without a config describing its inputs.
    """
    cfg = getattr(model, "config", None)
    g = torch.Generator().manual_seed(seed)
    cls = type(model).__name__
    task = task_of(type(model))
    classify = task in CLASSIFIER_TASKS or cls.endswith(("ForSequenceClassification",
                                                         "ForImageClassification"))
    num_labels = max(int(getattr(cfg, "num_labels", 2) or 2), 1)
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        size = getattr(cfg, "image_size", None)
        channels = getattr(cfg, "num_channels", 3)
        if size is None:
            raise ValueError(f"{cls}: its config has no image_size to build images for "
                             "profiling; give a plan (--cephalo_plan_file) or a profile "
                             "(--cephalo_profile_file)")
        mb = {"pixel_values": torch.randn(m, channels, size, size, generator=g),
              "labels": torch.randint(0, num_labels, (m,), generator=g)}
    else:
        vocab = getattr(_text_config(model), "vocab_size", None)
        if vocab is None:
            raise ValueError(f"{cls}: its config has no vocab_size to build token ids for "
                             "profiling; give a plan (--cephalo_plan_file, or "
                             "plan=Plan.from_ratios(b_i, m_i, r_i)) or a profile "
                             "(--cephalo_profile_file)")
        limit = max_positions(model)
        if limit is not None and sequence_length > limit:
            raise ValueError(f"sequence_length {sequence_length} exceeds the model's "
                             f"{limit} positions; profile with a shorter sequence length")
        ids = torch.randint(0, vocab, (m, sequence_length), generator=g)
        mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if task == QUESTION_ANSWERING:
            mb.update(start_positions=torch.randint(0, sequence_length, (m,), generator=g),
                      end_positions=torch.randint(0, sequence_length, (m,), generator=g))
        elif classify or task == TOKEN_CLASSIFICATION:
            shape = (m, sequence_length) if task == TOKEN_CLASSIFICATION else (m,)
            mb["labels"] = torch.randint(0, num_labels, shape, generator=g)
        else:
            mb["labels"] = ids.clone()
        mb = with_document_inputs(type(model), cfg, mb, seed)  # boxes, HTML paths: Bros needs them
    return {k: v.to(device) for k, v in mb.items()}


def build_model_from_config(config_path: str, model_class: str | None = None,
                            dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A model with random weights from a local Hugging Face config (file or directory).

    ``model_class`` (e.g. ``"LlamaForCausalLM"``) defaults to the config's first
    ``architectures`` entry, else ``AutoModelForCausalLM``. Nothing is downloaded: the path
    must exist locally.

    Raises:
        ValueError: the path does not exist, or no usable model class is named.
    """
    import transformers

    if not os.path.exists(config_path):
        raise ValueError(f"model config {config_path!r} does not exist; give a config.json file "
                         "or a directory holding one")
    if os.path.isdir(config_path):
        config = transformers.AutoConfig.from_pretrained(config_path)
    else:
        import json

        with open(config_path) as f:
            data = json.load(f)
        if "model_type" not in data:
            raise ValueError(f"{config_path!r} has no 'model_type'; give a Hugging Face "
                             "config.json (the one save_pretrained writes beside the weights)")
        config = transformers.AutoConfig.for_model(**data)
    name = model_class or (config.architectures or [None])[0]
    if name is None:  # a bare config: assume a causal language model
        try:
            return transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        except ValueError as e:
            raise ValueError(f"{config_path!r} names no architecture and is not a causal LM; pass "
                             f"--model-class (e.g. ViTForImageClassification): {e}") from None
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"model class {name!r} not found in transformers; pass --model-class "
                         "(e.g. LlamaForCausalLM)")
    return cls(config).to(dtype)


def sequence_length_of(dataset: Any, default: int, max_samples: int = 16) -> int:
    """Longest ``input_ids`` among the first ``max_samples`` samples of ``dataset``, else
    ``default`` (datasets without ``input_ids``, e.g. images, or without a length). A
    ``datasets.IterableDataset`` (re-iterable by design) is read for its first rows; another
    stream is not (reading it might consume it)."""
    try:
        rows = _first_rows_of_stream(dataset, max_samples)
        if rows is None:
            n = min(len(dataset), max_samples)
            rows = [dataset[i] for i in range(n)]
        lengths = [len(row["input_ids"]) for row in rows]
    except (TypeError, KeyError, IndexError, AttributeError):
        return default
    return max(lengths) if lengths else default


def _first_rows_of_stream(dataset: Any, n: int) -> list[Any] | None:
    """The first ``n`` rows of a ``datasets.IterableDataset`` (None for anything else)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency
        return None
    if not isinstance(dataset, datasets.IterableDataset):
        return None
    return list(dataset.take(n))
