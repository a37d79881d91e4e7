"""Measure the cost model's inputs on this cluster (paper §2.4 profiler; docs/design.md contract 1).

What is measured, per rank, with the real model, its dtype and a microbatch of the training
sequence length (synthetic token ids / pixels of the right shape, ``synthetic_microbatch``):

- ``fwd_s[m]``: one unit's forward without autograd (the engine's forward pass), m = 1..M.
- ``bwd_s[m]``: the engine's backward of one unit is a recompute (forward WITH autograd) plus
  the backward; ``bwd_s[m]`` is that measured time minus the forward time of the same repeat
  (median over repeats), so the cost model's
  ``F + B`` per microbatch equals what the engine's backward really costs (the recompute that
  keeps activations is slower than the no-grad forward; the difference lands in ``bwd_s``).
  Median of ``repeats`` runs after ``warmup`` runs, the microbatch sizes interleaved in
  rounds; the medians are then fitted non-decreasing in m (``_non_decreasing``: a larger
  microbatch cannot really be faster, so a dip is load noise on a shared machine). A backward
  median that is not positive or below a tenth of the forward is re-measured, then warned about
  ([Note: implausible backward times]).
- ``compute_memory_bytes[m]`` / ``head_memory_bytes[m]``: activation memory of ONE microbatch in
  flight, without the engine's own buffers (gathered units, full gradients, the root,
  collective buffers, the boundary stash), which the planner prices from the model profile
  (planner/memory.py): the peak of a unit's recompute + backward, and of the head's loss +
  backward beside the last unit's kept graph, each measured with the unit's and the root's
  gradients already allocated (``_compute_memory``). CUDA: the caching allocator's peak over each region; CPU: the peak of
  live tensors allocated in it (``live_memory.LiveTensorBytes``, operator granularity).
- ``kept_graph_bytes[m]``: what ONE microbatch's forward graph of a unit holds from its forward
  to its backward when the engine keeps graphs (``activation_checkpointing=False``): the bytes
  still allocated after a forward with autograd, the saved tensors plus the output
  (``_kept_graph_memory``; CUDA ``memory_allocated``, CPU the live tensors left).
- ``ModelProfile.param_bytes`` / ``boundary_bytes_per_sample``: the parameters' element size
  and the bytes of one sample's embedding output (the boundary tensor the engine stashes).
- ``allgather_s`` / ``reducescatter_s``: one unit with EVEN shards over the whole world through
  the engine's own collectives; the slowest rank's median (every rank plans with the same
  numbers). ``uneven_factor`` u: the same unit split by the most skewed state ratios the
  memory caps allow (``planner.state.skewed_state_ratios``), timed the same way, divided by
  the even time (docs/planner.md "The uneven factor u").

``profile_cluster`` runs all of it on every rank (collective when the world size is > 1),
uses the on-disk cache (``profiles.cache``) when it can, and returns the same
``ClusterProfile`` on every rank. ``check_profile_matches`` refuses a profile of another model
or device.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from hf_cephalo.engine.compile import (CompileFailure, CompileOptions, CompiledUnits,
                                       graph_count, plural, record_compile, remote_failure)
from hf_cephalo.engine.flat_param import (ParamLeaves, collect_params, install_param_views,
                                          move_shared_params, param_infos)
from hf_cephalo.models.base import AutocastStagedModel, StagedModel
from hf_cephalo.planner.state import skewed_state_ratios
from hf_cephalo.profiles.cache import (ProfileCache, comm_key, device_key, model_description,
                                       model_fingerprint)
from hf_cephalo.profiler.emulate import EmulatedStagedModel, EmulationConfig, emulated_device_name
from hf_cephalo.profiler.live_memory import LiveTensorBytes
from hf_cephalo.profiles.precision import PRECISIONS, Precision
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile
from hf_cephalo.units import GIB

__all__ = ["MeasureConfig", "synthetic_microbatch", "build_model_from_config", "model_profile",
           "local_device_name",
           "device_capacity_bytes", "local_world_size", "measure_device", "measure_comm", "profile_cluster",
           "check_profile_matches", "check_profile_precision", "sequence_length_of", "max_positions",
           "precision_tag", "PRECISIONS",
           "boundary_bytes_per_sample", "machine_layout"]

MakeMicrobatch = Callable[[int], Mapping[str, torch.Tensor]]


_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


QUIET_INTERVAL_S = 15.0
"""Seconds between two progress lines of a non-verbose profile (rank 0 only)."""


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
        return _AUTOCAST.get(self.param_dtype)

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


# ---- model and device facts -----------------------------------------------------------------
def _unique_params(modules) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for mod in modules:
        for p in mod.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def model_dtype(staged: StagedModel) -> torch.dtype:
    return next(iter(staged.units()[0].parameters())).dtype


def model_profile(staged: StagedModel, name: str | None = None,
                  boundary_bytes_per_sample: float = 0.0,
                  precision: Precision | None = None) -> ModelProfile:
    """ModelProfile of a staged model: units, parameters per unit / outside units, state bytes.

    ``state_bytes_per_param`` = 4 × element size (parameter, gradient and Adam's two moments in
    the parameter dtype: 16 for fp32, paper §2.4); ``param_bytes`` = the element size; ``gathered_param_bytes`` / ``reduce_bytes`` from ``precision`` (None: not cast);
    ``boundary_bytes_per_sample`` as given (``boundary_bytes_per_sample`` measures it). A model
    with frozen parameters (PEFT) records its trainable elements, in all and per unit (layer,
    embedding, head), and the frozen parameters' element size (a bf16 base: 2). The
    root is split as the engine splits it (engine.py ``_build_units``): ``params_embed`` =
    the parameters of ``embed_modules()`` (a tied weight once), ``params_head`` = those of
    ``head_modules()`` not already there, ``head_ties_embedding`` when the head uses one of
    the embedding's. Raises ValueError if units differ in size.
    """
    units = staged.units()
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    if len(set(sizes)) != 1:
        groups = {}
        for i, n in enumerate(sizes):
            groups.setdefault(n, []).append(i)
        which = "; ".join(f"layers {v[0]}-{v[-1]}" if len(v) > 1 and v == list(
            range(v[0], v[-1] + 1)) else f"layers {v}" for v in groups.values())
        raise ValueError(
            f"the layers of {type(staged.model).__name__} differ in size ({which}: "
            f"{sorted(groups)} elements; e.g. dense and mixture-of-experts layers); the "
            "planner's cost and memory models price identical units (docs/design.md contract "
            "1), so it cannot profile and plan this model: give a plan of your own "
            "(--cephalo_plan_file, or plan=Plan.from_ratios(b_i, m_i, r_i)) and leave "
            "--cephalo_adaptive off (the engine itself shards layers of different sizes)")
    unit_ids = {id(p) for u in units for p in u.parameters()}
    embed = {id(p): p.numel() for p in _unique_params(staged.embed_modules())
             if id(p) not in unit_ids}
    head = {id(p): p.numel() for p in _unique_params(staged.head_modules())
            if id(p) not in unit_ids}
    tied = any(k in embed for k in head)
    head_only = sum(n for k, n in head.items() if k not in embed)
    model = staged.model
    if name is None:
        cfg = getattr(model, "config", None)
        name = str(getattr(cfg, "name_or_path", "") or type(model).__name__)
    # a PEFT model as it will train: only its trainable parameters (the adapter) carry state;
    # they are in the training dtype, a frozen base may be stored in its own (bf16)
    params = list(_unique_params([*units, *staged.embed_modules(), *staged.head_modules()]))
    trained = [p for p in params if p.requires_grad]
    elem = trained[0].element_size() if trained else \
        torch.empty((), dtype=model_dtype(staged)).element_size()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    lora = trainable != sum(p.numel() for p in params)
    per_unit = sum(p.numel() for p in units[0].parameters() if p.requires_grad)
    root = {id(p): p for p in _unique_params([*staged.embed_modules(), *staged.head_modules()])}
    t_embed = sum(root[k].numel() for k in embed if root[k].requires_grad)
    t_head = sum(root[k].numel() for k in head if k not in embed and root[k].requires_grad)
    frozen = [p for p in params if not p.requires_grad]
    frozen_elem = frozen[0].element_size() if frozen else elem
    return ModelProfile(name=name, num_units=len(units), params_per_unit=sizes[0],
                        params_other=sum(embed.values()) + head_only,
                        params_embed=sum(embed.values()), params_head=head_only,
                        head_ties_embedding=tied, state_bytes_per_param=4.0 * elem,
                        param_bytes=elem, boundary_bytes_per_sample=boundary_bytes_per_sample,
                        trainable_params=trainable if lora else None,
                        trainable_per_unit=per_unit if lora else None,
                        trainable_embed=t_embed if lora else None,
                        trainable_head=t_head if lora else None,
                        frozen_bytes_per_param=frozen_elem,
                        gathered_param_bytes=None if precision is None or precision.param == "fp32"
                        else precision.param_bytes,
                        reduce_bytes=None if precision is None or precision.reduce == "fp32"
                        else precision.reduce_bytes)


def boundary_bytes_per_sample(staged: StagedModel, make_microbatch: Callable[[int], Any],
                              device: torch.device | str,
                              dtype: torch.dtype | None = None) -> float:
    """Bytes of one sample's embedding output: the boundary tensor the engine stashes per sample
    and unit boundary (sequence length x hidden size x element size). ``dtype``: the gathered
    parameters' dtype when cast (the embedding then outputs it), else the output's own."""
    mb = {k: v.to(device) for k, v in make_microbatch(1).items()}
    with torch.no_grad():
        hidden, _ = staged.embed(mb)
    size = hidden.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size()
    return float(hidden.numel() * size)


def machine_layout(group: dist.ProcessGroup | None = None) -> tuple[list[int], list[float]]:
    """(machine index per rank, RAM bytes per machine): ranks with one hostname share a machine.

    One ``all_gather_object`` (a collective on every rank of ``group``) when a process group
    with world size > 1 exists.
    """
    import socket

    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 16 * GIB
    _, world_size = _world(group)
    entries = _all_gather_objects((socket.gethostname(), ram), group, world_size)
    hosts = list(dict.fromkeys(h for h, _ in entries))
    rams = {h: r for h, r in entries}
    return [hosts.index(h) for h, _ in entries], [rams[h] for h in hosts]


def local_device_name(device: torch.device | str) -> str:
    """``torch.cuda.get_device_name`` for CUDA, else the device type (e.g. ``"cpu"``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def device_capacity_bytes(device: torch.device | str, local_world_size: int = 1) -> float:
    """Memory capacity C_i of one rank in bytes.

    CUDA: the device's total memory (device properties). CPU: physical RAM divided by
    ``local_world_size``, the number of ranks on this host, which share the RAM (16 GiB if the
    RAM cannot be read). Raises ValueError if ``local_world_size`` < 1.
    """
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) \
            or local_world_size < 1:
        raise ValueError(f"local_world_size = {local_world_size!r}: need an integer >= 1")
    device = torch.device(device)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 16 * GIB
    return ram / local_world_size


def local_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks on this host: ``$LOCAL_WORLD_SIZE`` (set by torchrun / accelerate launch), else
    the number of ranks whose hostname equals this rank's (one ``all_gather_object``, a
    collective on every rank of ``group``); 1 without a process group.

    Raises ValueError for a ``LOCAL_WORLD_SIZE`` that is not a positive integer.
    """
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is not None:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE={env!r}: need a positive integer (the number of "
                             "ranks on this host), or unset it")
        return value
    _, world_size = _world(group)
    if world_size == 1:
        return 1
    import socket

    host = socket.gethostname()
    return sum(h == host for h in _all_gather_objects(host, group, world_size))


def max_positions(model: torch.nn.Module) -> int | None:
    """Longest sequence (tokens) the model's position embeddings cover: its config's
    ``max_position_embeddings`` or ``n_positions``; None when the config names neither."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def synthetic_microbatch(model: torch.nn.Module, m: int, sequence_length: int,
                         device: torch.device | str = "cpu",
                         seed: int = 0) -> dict[str, torch.Tensor]:
    """A microbatch of m samples shaped like the training data, built from the model's config.

    Text models: ``input_ids`` / ``labels`` (m, S) int64 (causal LM: labels = inputs; sequence
    classification: labels (m,)), ``attention_mask`` (m, S) of ones. Vision models
    (``main_input_name == "pixel_values"``): ``pixel_values`` (m, C, H, W) and ``labels`` (m,).

    Raises ValueError for a model without a config describing its inputs.
    """
    cfg = getattr(model, "config", None)
    g = torch.Generator().manual_seed(seed)
    cls = type(model).__name__
    classify = cls.endswith("ForSequenceClassification") or cls.endswith("ForImageClassification")
    num_labels = max(int(getattr(cfg, "num_labels", 2) or 2), 1)
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        size = getattr(cfg, "image_size", None)
        channels = getattr(cfg, "num_channels", 3)
        if size is None:
            raise ValueError(f"{cls}: config has no image_size; pass make_microbatch to profile it")
        mb = {"pixel_values": torch.randn(m, channels, size, size, generator=g),
              "labels": torch.randint(0, num_labels, (m,), generator=g)}
    else:
        vocab = getattr(cfg, "vocab_size", None)
        if vocab is None:
            raise ValueError(f"{cls}: no config.vocab_size to build synthetic token ids; pass "
                             "make_microbatch to profile this model")
        limit = max_positions(model)
        if limit is not None and sequence_length > limit:
            raise ValueError(f"sequence_length {sequence_length} exceeds the model's "
                             f"{limit} positions; profile with a shorter sequence length")
        ids = torch.randint(0, vocab, (m, sequence_length), generator=g)
        labels = torch.randint(0, num_labels, (m,), generator=g) if classify else ids.clone()
        mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
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


# ---- one device ---------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _FlatViews:
    """Unit 0's parameters as the engine gathers them: per-parameter leaves aliasing one flat
    buffer, their gradients accumulated into one flat gradient.

    Uses the engine's own ``collect_params`` / ``ParamLeaves`` / ``install_param_views`` ([Note:
    parameter views while unsharded] in ``engine/flat_param.py``): before each call the module
    entries point at the leaves (frozen parameters: views of the detached rest), and once
    ``prepare_grad`` ran, backward adds into the flat gradient in place (in the master dtype;
    with a cast, through the leaves' hooks as [Note: low-precision gathered parameters]).
    ``restore`` puts the original parameters back.
    """

    def __init__(self, unit: torch.nn.Module | None = None, collected=None,
                 dtype: torch.dtype | None = None):
        params, uses = collected if collected is not None else \
            collect_params("unit 0", [unit], {})
        self.infos = param_infos("unit", params, {})
        self.uses = [uses[id(p)] for p in params]
        self.originals = [(entries, p) for entries, p in zip(self.uses, params)]
        with torch.no_grad():  # two parts, each in its dtype ([Note: two parts per unit])
            parts = [torch.cat([p.detach().reshape(-1) for p in params
                                if p.requires_grad == trainable]) if any(
                p.requires_grad == trainable for p in params) else torch.zeros(0)
                for trainable in (True, False)]
            if dtype is not None:  # the engine casts the parts stored in the master dtype for
                # the all-gather; a low-precision frozen base is gathered as stored
                master = parts[0].dtype if parts[0].numel() else torch.float32
                parts = [t.to(dtype) if t.dtype == master else t for t in parts]
        self.cast = dtype is not None
        self.master_dtype = params[0].dtype if params and params[0].requires_grad else \
            torch.float32  # trainable first (collect_params)
        self.flat = parts[0]
        self.leaves = ParamLeaves(self.infos, parts[0], requires_grad=True)
        self.frozen = parts[1]

    @property
    def dtype(self) -> torch.dtype:
        """The gathered trainable part's dtype."""
        return self.flat.dtype

    def install(self) -> None:
        install_param_views(self.infos, self.uses, self.leaves.leaves, self.frozen)

    def prepare_grad(self) -> None:
        """The unit's flat (Nt,) gradient, zero-filled in the master dtype, as the engine's
        ``FlatParamUnit.prepare_grad`` before a unit's first backward."""
        if self.leaves.requires_grad and self.leaves.grad is None:
            self.leaves.accumulate_into(torch.zeros(self.flat.numel(), dtype=self.master_dtype,
                                                    device=self.flat.device))

    @staticmethod
    def head_phase(staged: StagedModel, dtype: torch.dtype | None = None) -> list["_FlatViews"]:
        """Views of the units the engine's head phase gathers: the head unit, and the embedding
        unit when the head uses one of its weights (grouped as engine.py ``_build_units``)."""
        embed = collect_params("embed", list(staged.embed_modules()), {})
        head = collect_params("head", list(staged.head_modules()), {})
        embed, head, tied = move_shared_params(embed, head)
        return [_FlatViews(collected=head, dtype=dtype)] + \
            ([_FlatViews(collected=embed, dtype=dtype)] if tied else [])

    def restore(self) -> None:
        for entries, p in self.originals:
            for module, attr in entries:
                module._parameters[attr] = p
        self.release_grad()

    def release_grad(self) -> None:
        """Drop the flat gradient and the leaves' own gradients."""
        for leaf in self.leaves.leaves:
            leaf.grad = None  # the timing rounds' and memory regions' sums, unchecked
        self.leaves.release_grad()


def _unit_backward(staged: StagedModel, hidden: torch.Tensor, ctx: Any,
                   grad: torch.Tensor) -> torch.Tensor:
    """Recompute (forward with autograd) + backward of unit 0, as the engine's backward does."""
    x = hidden.detach().requires_grad_(True)
    with torch.enable_grad():
        y = staged.run_unit(0, x, ctx)
    torch.autograd.backward(y, grad)
    return y.detach()


def _head_backward(staged: StagedModel, hidden: torch.Tensor, mb, ctx: Any) -> None:
    h = hidden.detach().requires_grad_(True)
    with torch.enable_grad():
        out = staged.head_loss(h, mb, ctx)
    torch.autograd.backward(out.loss_sum)


def _peak_bytes(device: torch.device, run: Callable[[], None]) -> float:
    """Peak bytes allocated while ``run()`` runs, beyond what was allocated before it.

    CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``). CPU: the peak of
    live tensors allocated inside (``live_memory.LiveTensorBytes``); that counter is a torch
    dispatch mode, which compiled code cannot run under, so compiled units run eagerly here
    (``torch.compiler.set_stance("force_eager")``): on the CPU a compiled profile's memory is
    the eager units' activation memory (the compiled one is not measured), its times are the
    compiled units'.
    """
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        _sync(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    with torch.compiler.set_stance("force_eager"), LiveTensorBytes() as live:
        run()
    return float(live.peak_bytes)


def _compute_memory(staged: StagedModel, views: _FlatViews, hidden, mb, ctx, grad,
                    device) -> tuple[float, float]:
    """(unit, head) activation memory of one microbatch in flight, bytes (module docstring).

    The persistent buffers the planner prices itself (planner/memory.py) are allocated before
    the measured regions, as after the engine's first microbatch: the unit's and the head
    phase's flat gradients exist (backward adds into them), the input and its boundary
    gradient are stashed. The unit and the head phase's units are gathered as in the engine
    (per-parameter leaves whose gradients backward adds in place into the flat gradient: what
    a backward allocates for them is each parameter's own gradient until its add; flat_param.py
    [Note: parameter views while unsharded]). Two regions: the unit's recompute + backward,
    and the head's loss + backward beside the last unit's kept forward graph (the schedule
    keeps it through the head phase).
    """
    head_views = _FlatViews.head_phase(staged, views.dtype if views.cast else None)
    views.release_grad()  # the timing rounds' sum: allocated anew below, as after a gather
    for v in [views, *head_views]:
        v.prepare_grad()

    def unit_pass() -> None:
        views.install()
        _unit_backward(staged, hidden, ctx, grad)

    def head_pass() -> None:
        for v in [views, *head_views]:
            v.install()
        x = hidden.detach().requires_grad_(True)
        with torch.enable_grad():
            y = staged.run_unit(0, x, ctx)  # the kept graph, alive during the head
        _head_backward(staged, y, mb, ctx)

    try:
        return _peak_bytes(device, unit_pass), _peak_bytes(device, head_pass)
    finally:
        for v in head_views:
            v.restore()
        views.release_grad()


def _kept_graph_memory(staged: StagedModel, views: _FlatViews, hidden, ctx, device) -> float:
    """K(m): bytes one microbatch's forward graph of unit 0 keeps alive until its backward.

    The engine without activation checkpointing (engine/schedule.py ``_forward_kept``) runs
    each unit's forward with autograd on the stashed input and keeps ``(input, output)`` until
    the unit's backward. What that costs is what is still allocated after the forward: the
    tensors autograd saved plus the output (the next unit's input). The input was allocated
    before (it is the previous unit's output, or the embedding's) and the parameters are views
    of the gathered buffer, whose storage the engine frees at reshard ([Note: kept graphs
    across reshard] in flat_param.py), so neither is counted. CUDA: ``memory_allocated``
    after minus before; CPU: the live tensors left (``live_memory.LiveTensorBytes``; compiled
    units run eagerly there, as in ``_peak_bytes``).
    """
    x = hidden.detach().requires_grad_(True)
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        views.install()
        with torch.enable_grad():
            y = staged.run_unit(0, x, ctx)
        _sync(device)
        kept = float(torch.cuda.memory_allocated(device) - base)
    else:
        with torch.compiler.set_stance("force_eager"), LiveTensorBytes() as live:
            views.install()
            with torch.enable_grad():
                y = staged.run_unit(0, x, ctx)
            live.reset_peak()  # drops what the forward freed: what is left is kept
            kept = float(live.current_bytes)
    del y  # frees the graph
    return kept


# [Note: implausible backward times]
# ``bwd_s[m]`` is (recompute + backward) - forward of the same repeat. The backward of a unit
# costs about two forwards in FLOPs (and the recompute that keeps activations is slower than the
# no-grad forward), so a median below MIN_BWD_TO_FWD x the forward, or not positive at all, is a
# load spike in the forwards on a shared machine, not a real time. Such microbatch sizes are
# re-measured (every rank re-measures when any rank must, keeping the lockstep barriers
# matched) up to MAX_REMEASURES times; a size still implausible then is warned about (rank, m,
# the times) and its backward set to MIN_BWD_TO_FWD x the forward, never silently clamped.
MIN_BWD_TO_FWD = 0.1
MAX_REMEASURES = 2


def _implausible(fwd: float, bwd: float) -> bool:
    return not (bwd > 0.0 and bwd >= MIN_BWD_TO_FWD * fwd)


def _measure_times(staged, config: MeasureConfig, inputs, views: _FlatViews, device, rank: int,
                   name: str, before_each, any_rank) -> tuple[dict[int, float], dict[int, float]]:
    """Per-m median forward and backward seconds, re-measuring implausible backward times.

    See [Note: implausible backward times]. Returns ``(fwd, bwd)`` dicts keyed by m.
    """
    ms = config.microbatch_sizes
    fwd: dict[int, float] = {}
    bwd: dict[int, float] = {}
    bad = list(ms)
    for attempt in range(1 + MAX_REMEASURES):
        f_times: dict[int, list[float]] = {m: [] for m in ms}
        fb_times: dict[int, list[float]] = {m: [] for m in ms}
        _time_rounds(staged, config, inputs, views, device, rank, name, before_each,
                     f_times, fb_times)
        for m in bad:
            # bwd per repeat = (recompute + backward) - forward of the SAME repeat, so a load
            # spike in one forward does not cancel the backward of another repeat.
            fwd[m] = statistics.median(f_times[m])
            bwd[m] = statistics.median([fb - f for f, fb in zip(f_times[m], fb_times[m])])
        bad = [m for m in ms if _implausible(fwd[m], bwd[m])]
        again = bool(bad) if any_rank is None else any_rank(bool(bad))
        if not again or attempt == MAX_REMEASURES:
            break
        if bad and config.prints(rank):
            print(f"[hf-cephalo profile] rank {rank} ({name}): implausible backward time for "
                  f"microbatch sizes {bad}; re-measuring", flush=True)
    if bad:
        detail = "; ".join(f"m={m}: fwd {fwd[m] * 1e3:.4f} ms, bwd {bwd[m] * 1e3:.4f} ms"
                           for m in bad)
        message = (f"rank {rank} ({name}): backward time still implausible after "
                   f"{MAX_REMEASURES} re-measurements ({detail}); backward must be positive "
                   f"and at least {MIN_BWD_TO_FWD} x the forward. Using {MIN_BWD_TO_FWD} x the "
                   "forward for these sizes; the machine is probably overloaded: re-profile "
                   "on an idle machine (delete the profile cache entry) for accurate plans")
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        print(f"[hf-cephalo profile] WARNING {message}", flush=True)
        for m in bad:
            bwd[m] = MIN_BWD_TO_FWD * fwd[m]
    return fwd, bwd


def _non_decreasing(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators) of per-m medians.

    A larger microbatch cannot take less time than a smaller one on the same unit; where the
    medians say so it is measurement noise (a shared machine), which would otherwise bend the
    cost model's interpolation. Values that already increase are returned unchanged.
    """
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out: list[float] = []
    for total, count in blocks:
        out += [total / count] * int(count)
    return out


def _time_rounds(staged, config: MeasureConfig, inputs, views: _FlatViews, device, rank: int,
                 name: str, before_each, f_times, fb_times) -> None:
    """``warmup + repeats`` rounds over every m; appends per-repeat times (seconds)."""
    ms = config.microbatch_sizes
    rounds = config.warmup + config.repeats
    work_done, total_work = 0, rounds * sum(ms)
    t_start = last_print = time.perf_counter()
    for k in range(rounds):
        for m in ms:
            _, hidden, ctx, grad = inputs[m]
            if before_each is not None:
                before_each()
            _sync(device)
            t0 = time.perf_counter()
            views.install()  # the engine's use_params before every call
            with torch.no_grad():
                staged.run_unit(0, hidden, ctx)
            _sync(device)
            t1 = time.perf_counter()
            views.install()
            _unit_backward(staged, hidden, ctx, grad)  # accumulates like layered GA
            _sync(device)
            t2 = time.perf_counter()
            if k >= config.warmup:
                f_times[m].append(t1 - t0)
                fb_times[m].append(t2 - t1)
            work_done += m
            now = time.perf_counter()
            interval_s = 1.0 if config.verbose else QUIET_INTERVAL_S
            if config.prints(rank) and now - last_print > interval_s and work_done < total_work:
                last_print = now
                left = (now - t_start) / work_done * (total_work - work_done)
                detail = (f"microbatch size {m}/{ms[-1]}: fwd {(t1 - t0) * 1e3:.2f} ms, "
                          f"recompute + bwd {(t2 - t1) * 1e3:.2f} ms; " if config.verbose else "")
                print(f"[hf-cephalo profile] rank {rank} ({name}): round {k + 1}/{rounds}, "
                      f"{detail}about {left:.0f} s left", flush=True)


COMPILE_STOPS = ("Every rank stops while profiling the compiled units for the plan (the "
                 "trainer profiles when no plan file is given)")
"""What a ``CompileFailure`` raised by the profiler says the ranks do next."""


def _compile_unit(staged, config: MeasureConfig, inputs, views: _FlatViews, device, rank: int,
                  name: str, rank_codes: Callable[[int], list[int]] | None) -> None:
    """[Note: compiling before timing] With compile on, the unit's graphs are compiled before
    the timed rounds: one untimed forward and recompute + backward, as ``_time_rounds`` runs
    them, at the smallest and the largest microbatch size (the static graph and the
    dynamic-shape one every other size reuses: [Note: compiled units] in engine/compile.py).
    So a unit that cannot compile fails here, on every rank (the ranks exchange the outcome,
    ``rank_codes``, before the first lockstep barrier), with the engine's wording
    (``CompileFailure``: unit, backend, the root cause, ``--torch_compile False``), never as
    dynamo's raw error in the middle of the timing; and the progress estimate of the rounds
    leaves the compile time out. Rank 0 prints the compile time and graphs, and
    ``record_compile`` keeps them for the engine's compile line (whose probe then finds the
    graphs compiled)."""
    options = CompileOptions(backend=config.compile_backend, mode=config.compile_mode)
    unit_name = f"unit 0 ({type(staged.units()[0]).__name__})"
    ms = config.microbatch_sizes
    failure, before, t0 = None, graph_count(), time.perf_counter()
    try:
        for m in dict.fromkeys([ms[0], ms[-1]]):
            _, hidden, ctx, grad = inputs[m]
            views.install()
            with torch.no_grad():
                staged.run_unit(0, hidden, ctx)
            views.install()
            _unit_backward(staged, hidden, ctx, grad)
        _sync(device)
    except Exception as exc:  # any compiler error: reported on every rank, never swallowed
        failure = CompileFailure(0, unit_name, options, [rank], exc, stops=COMPILE_STOPS)
    seconds, graphs = time.perf_counter() - t0, graph_count() - before
    code = 0 if failure is None else 1
    codes = rank_codes(code) if rank_codes is not None else [code]
    if failure is not None:
        raise failure.on_ranks(codes)
    remote = remote_failure(codes, options, rank, [unit_name],
                            stops="while profiling the compiled units for the plan")
    if remote is not None:
        raise remote
    record_compile(options, "while profiling", graphs, seconds)
    if config.prints(rank):
        print(f"[hf-cephalo profile] rank {rank} ({name}): torch.compile (backend "
              f"{options.backend}, mode {options.mode}) of the timed unit: "
              f"{plural(graphs, 'graph')} compiled in {seconds:.1f} s (before the timed rounds "
              f"and their time estimate)", flush=True)


# ---- step terms outside the units (planner/cost.py [Note: step terms]) -----------------------
def _embed_backward(staged: StagedModel, mb, grad: torch.Tensor) -> None:
    """The engine's embedding backward: recompute the embedding with autograd, backward."""
    with torch.enable_grad():
        hidden, _ = staged.embed(mb)
    if hidden.requires_grad:
        torch.autograd.backward(hidden, grad)


def _measure_root(staged, config: MeasureConfig, inputs, device,
                  before_each) -> tuple[list[float], list[float]]:
    """Per profiled m, the median (embed_s, head_s) of one microbatch: the embedding's forward
    plus its recompute + backward, and the head's loss forward + backward (the engine's root
    phases, [Note: layered schedule] in engine/schedule.py), seconds. Rounds over every m
    like the unit's, lockstep with ``before_each``."""
    ms = config.microbatch_sizes
    embed: dict[int, list[float]] = {m: [] for m in ms}
    head: dict[int, list[float]] = {m: [] for m in ms}
    for k in range(config.warmup + config.repeats):
        for m in ms:
            mb, hidden, ctx, grad = inputs[m]
            if before_each is not None:
                before_each()
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                staged.embed(mb)
            _sync(device)
            t1 = time.perf_counter()
            _head_backward(staged, hidden, mb, ctx)
            _sync(device)
            t2 = time.perf_counter()
            _embed_backward(staged, mb, grad)
            _sync(device)
            t3 = time.perf_counter()
            if k >= config.warmup:
                embed[m].append((t1 - t0) + (t3 - t2))
                head[m].append(t2 - t1)
    return (_non_decreasing([statistics.median(embed[m]) for m in ms]),
            _non_decreasing([statistics.median(head[m]) for m in ms]))


def _measure_bookkeeping(device: torch.device, repeats: int) -> float:
    """The engine's host bookkeeping per unit and microbatch outside the unit's compute:
    capturing the RNG state before the forward and replaying it around the recompute
    (engine/schedule.py ``RngState``), median seconds."""
    from hf_cephalo.engine.schedule import RngState

    times = []
    for _ in range(max(5, 4 * repeats)):
        t0 = time.perf_counter()
        state = RngState(device)
        fork = state.replay()
        fork.__exit__(None, None, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure_optimizer(staged: StagedModel, device: torch.device, repeats: int) -> float:
    """Seconds per parameter element of the optimizer step plus the engine's gradient-norm
    clipping (``CephaloEngine.clip_grad_norm_``) on two unit-sized flat shards: AdamW, fused
    where the device supports it (the Trainer's default ``adamw_torch_fused``)."""
    numel = sum(p.numel() for p in staged.units()[0].parameters() if p.requires_grad) or \
        sum(p.numel() for p in staged.units()[0].parameters())
    dtype = model_dtype(staged)
    params = [torch.zeros(numel, dtype=dtype, device=device, requires_grad=True) for _ in range(2)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    try:
        opt = torch.optim.AdamW(params, lr=1e-6, fused=True)
        opt.step()
    except (RuntimeError, TypeError):  # no fused kernel for this device / dtype
        opt = torch.optim.AdamW(params, lr=1e-6)
        opt.step()
    times = []
    for _ in range(max(3, repeats)):
        _sync(device)
        t0 = time.perf_counter()
        sq = torch.zeros(1, dtype=torch.float64, device=device)
        for p in params:
            sq += p.grad.double().pow(2).sum()
        coef = torch.clamp(1.0 / (sq.sqrt() + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / (2 * numel)


def measure_device(staged: StagedModel, config: MeasureConfig, *, device: torch.device | str,
                   name: str, capacity_bytes: float, rank: int = 0,
                   make_microbatch: MakeMicrobatch | None = None,
                   before_each: Callable[[], None] | None = None,
                   any_rank: Callable[[bool], bool] | None = None,
                   rank_codes: Callable[[int], list[int]] | None = None) -> DeviceProfile:
    """Profile one unit on this rank for m = 1..M (no collectives unless ``before_each`` has).

    Args:
        staged: the staged model (an ``EmulatedStagedModel`` measures the emulated device);
            its root modules and first unit are moved to ``device`` (the other units are
            never run, so they stay where they are).
        config: what to profile. device: the compute device. name: recorded device name.
        capacity_bytes: C_i recorded in the profile. rank: used in progress lines.
        make_microbatch: ``m -> microbatch`` override of ``synthetic_microbatch``.
        before_each: called before each timed (round, m) item, outside the timed region
            (``profile_cluster`` passes a barrier: [Note: lockstep profiling]).
        any_rank: ``flag -> True iff flag is True on any rank`` (a collective); decides
            whether every rank re-measures, so lockstep barriers stay matched. None: this
            rank alone ([Note: implausible backward times]).
        rank_codes: ``code -> every rank's code`` (a collective; None: this rank alone); with
            ``config.compile_backend`` set, the ranks exchange whether the unit compiled before
            the first timed item ([Note: compiling before timing]).
    Returns:
        A ``DeviceProfile``; the model's gradients are left as None.
    Raises:
        CompileFailure (engine/compile.py): with ``config.compile_backend`` set, the unit
            failed to compile on this rank; RuntimeError: it failed on another rank.
    """
    device = torch.device(device)
    model = staged.model
    for module in [*staged.root_modules(), staged.units()[0]]:
        module.to(device)  # only what is run: never the whole model on the device
    was_training = model.training
    model.train()
    params = list(model.parameters())
    make = make_microbatch or (
        lambda m: synthetic_microbatch(model, m, config.sequence_length, device))
    ms = config.microbatch_sizes
    try:
        inputs = {}
        for m in ms:
            mb = {k: v.to(device) for k, v in make(m).items()}
            with torch.no_grad():
                hidden, ctx = staged.embed(mb)
            if config.gather_dtype is not None:  # a low-precision embedding's output
                hidden = hidden.to(config.gather_dtype)
            inputs[m] = (mb, hidden, ctx, torch.randn_like(hidden))
        # Rounds over all m (not all repeats of one m at a time), so load changes on a shared
        # machine spread over every microbatch size instead of bending the curve.
        views = _FlatViews(staged.units()[0], dtype=config.gather_dtype)
        views.prepare_grad()  # backward adds into the unit's flat gradient, as in the engine
        try:
            if config.compile_backend is not None:
                _compile_unit(staged, config, inputs, views, device, rank, name, rank_codes)
            fwd_med, bwd_med = _measure_times(staged, config, inputs, views, device, rank, name,
                                              before_each, any_rank)
            unit_head = [_compute_memory(staged, views, inputs[m][1], inputs[m][0],
                                         inputs[m][2], inputs[m][3], device) for m in ms]
            kept = [_kept_graph_memory(staged, views, inputs[m][1], inputs[m][2], device)
                    for m in ms]
        finally:
            views.restore()
        embed_s, head_s = _measure_root(staged, config, inputs, device, before_each)
        bookkeeping_s = _measure_bookkeeping(device, config.repeats)
        optimizer_s = _measure_optimizer(staged, device, config.repeats)
        fwd = _non_decreasing([fwd_med[m] for m in ms])
        bwd = _non_decreasing([bwd_med[m] for m in ms])
        mem, head_mem = [u for u, _ in unit_head], [h for _, h in unit_head]
        if config.prints(rank):
            print(f"[hf-cephalo profile] rank {rank} ({name}): done; m={ms[-1]}: fwd "
                  f"{fwd[-1] * 1e3:.2f} ms, bwd {bwd[-1] * 1e3:.2f} ms, compute memory "
                  f"{mem[-1] / GIB:.3f} GiB per unit", flush=True)
    finally:
        for p in params:
            p.grad = None
        model.train(was_training)
    return DeviceProfile(name=name, memory_capacity_bytes=capacity_bytes, microbatch_sizes=ms,
                         fwd_s=fwd, bwd_s=bwd, compute_memory_bytes=mem,
                         head_memory_bytes=head_mem, embed_s=embed_s, head_s=head_s,
                         kept_graph_bytes=kept,
                         microbatch_overhead_s=bookkeeping_s,
                         optimizer_s_per_param=optimizer_s)


# ---- collectives --------------------------------------------------------------------------------
def _time_unit_collectives(numel_per_rank: Sequence[int], dtype, device, group, repeats: int,
                           use_all_reduce: bool) -> tuple[float, float]:
    """Median (all-gather s, reduce-scatter s) of one unit whose shards are ``numel_per_rank``,
    through the engine's own collectives (collective on every rank).

    The one call site of the engine's collective API in the profiler: the variable-size
    collectives the engine runs (``all_gather_shards`` / ``reduce_scatter_shards``, the
    single-tensor fast path when the shards are equal), with these shard sizes.
    """
    from hf_cephalo.engine import collectives as C
    from hf_cephalo.engine.stats import CollectiveStats

    rank = dist.get_rank(group)
    sizes = [int(n) for n in numel_per_rank]
    shard = torch.ones(sizes[rank], dtype=dtype, device=device)  # 1D, this rank's shard
    stats = CollectiveStats()
    ag, rs = [], []
    for k in range(1 + repeats):
        dist.barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        full = C.all_gather_shards(shard, sizes, rank, group, stats, async_op=False).output
        _sync(device)
        t1 = time.perf_counter()
        dist.barrier(group)
        _sync(device)
        t2 = time.perf_counter()
        C.reduce_scatter_shards(full, sizes, rank, group, stats, async_op=False,
                                use_all_reduce=use_all_reduce)
        _sync(device)
        t3 = time.perf_counter()
        if k:
            ag.append(t1 - t0)
            rs.append(t3 - t2)
    return statistics.median(ag), statistics.median(rs)


def measure_comm(staged: StagedModel, *, device: torch.device | str, repeats: int = 5,
                 group: dist.ProcessGroup | None = None,
                 state_ratios: Sequence[float] | None = None) -> CommProfile:
    """One unit's all-gather and reduce-scatter (collective on every rank), and u.

    AG and RS: EVEN shards. ``state_ratios`` (e.g. ``planner.state.skewed_state_ratios``): the
    same unit split by those ratios (``integer_targets``, as a ratio-split unit of the plan's
    layout) is timed too, and ``uneven_factor`` u = (AG + RS uneven) / (AG + RS even), clamped
    at 1 (an uneven layout is never priced cheaper than even: below 1 is timing noise). Uses the
    engine's collectives (``_time_unit_collectives``), the reduce-scatter fallback included
    where the backend lacks reduce-scatter. Slowest rank's medians, identical on every rank.
    Without a process group or with world size 1: zeros and no u.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return CommProfile(allgather_s=0.0, reducescatter_s=0.0)
    from hf_cephalo.engine import collectives as C
    from hf_cephalo.planner.state import integer_targets

    device = torch.device(device)
    n = dist.get_world_size(group)
    numel = sum(p.numel() for p in staged.units()[0].parameters())
    dtype, fallback = model_dtype(staged), not C.reduce_scatter_supported(group)
    even = integer_targets([1.0 / n] * n, numel)
    times = list(_time_unit_collectives(even, dtype, device, group, repeats, fallback))
    times += _time_root_collectives(staged, n, dtype, device, group, repeats, fallback)
    if state_ratios is not None:
        row = integer_targets(state_ratios, numel)
        times += _time_unit_collectives(row, dtype, device, group, repeats, fallback)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    ag, rs = float(t[0]), float(t[1])
    # gloo's copies and reductions run on the host cores the CPU ranks compute on
    root = dict(root_allgather_s=float(t[2]), root_reducescatter_s=float(t[3]),
                allreduce_s=float(t[4]), collective_wait_s=float(t[5]),
                overlaps_compute=device.type == "cuda")
    if state_ratios is None:
        return CommProfile(allgather_s=ag, reducescatter_s=rs, **root)
    u = max(1.0, float(t[6] + t[7]) / max(ag + rs, 1e-12))
    return CommProfile(allgather_s=ag, reducescatter_s=rs, uneven_factor=u,
                       uneven_state_ratios=[float(r) for r in state_ratios], **root)


def _time_root_collectives(staged: StagedModel, world_size: int, dtype, device, group,
                           repeats: int, use_all_reduce: bool) -> list[float]:
    """[root all-gathers s, root reduce-scatters s, one 8-byte all-reduce s] of one step as the
    engine's split root issues them ([Note: layered schedule] in engine/schedule.py): the
    embedding unit E gathered twice and the head unit H once, H's and E's gradients
    reduce-scattered once each; a tied head gathers E a third time and reduce-scatters its
    head-use gradient too. Even shards, this rank's medians (collective on every rank)."""
    from hf_cephalo.engine import collectives as C
    from hf_cephalo.engine.stats import CollectiveStats
    from hf_cephalo.planner.state import integer_targets

    model = model_profile(staged)
    n_embed, n_head, tied = model.root_split()
    ag_e, rs_e = _time_unit_collectives(integer_targets([1.0 / world_size] * world_size,
                                                        max(n_embed, world_size)),
                                        dtype, device, group, repeats, use_all_reduce)
    ag_h, rs_h = _time_unit_collectives(integer_targets([1.0 / world_size] * world_size,
                                                        max(n_head, world_size)),
                                        dtype, device, group, repeats, use_all_reduce)
    stats, times = CollectiveStats(), []
    for k in range(1 + repeats):
        t = torch.ones(1, dtype=torch.int64, device=device)
        dist.barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        C.all_reduce_sum(t, group, stats)
        _sync(device)
        if k:
            times.append(time.perf_counter() - t0)
    gathers_e, reduces_e = (3, 2) if tied else (2, 1)
    allreduce_s = statistics.median(times)
    return [gathers_e * ag_e + ag_h, reduces_e * rs_e + rs_h, allreduce_s,
            _time_rendezvous(device, group, repeats, allreduce_s)]


def _time_rendezvous(device, group, repeats: int, allreduce_s: float) -> float:
    """``CommProfile.collective_wait_s``: an 8-byte all-reduce reached from compute (the same
    ~1 ms of matrix products on every rank, no barrier) minus the same all-reduce reached
    from a barrier, seconds, at least 0. The rank that arrives last sets the pace, so the
    smallest of the ranks' medians is taken (a MIN all-reduce; collective on every rank)."""
    from hf_cephalo.engine import collectives as C
    from hf_cephalo.engine.stats import CollectiveStats

    a = torch.randn(192, 192, device=device)
    stats, waits = CollectiveStats(), []
    dist.barrier(group)
    for k in range(1 + 4 * repeats):
        for _ in range(4):
            a = torch.tanh(a @ a)
        _sync(device)
        t0 = time.perf_counter()
        C.all_reduce_sum(torch.ones(1, dtype=torch.int64, device=device), group, stats)
        _sync(device)
        if k:
            waits.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(waits)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return max(0.0, float(t) - allreduce_s)


# ---- the whole cluster --------------------------------------------------------------------------
def _world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_gather_objects(obj: Any, group, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def profile_cluster(staged: StagedModel, config: MeasureConfig | None = None, *,
                    device: torch.device | str = "cpu", emulation: EmulationConfig | None = None,
                    cache: ProfileCache | None | bool = True,
                    group: dist.ProcessGroup | None = None,
                    make_microbatch: MakeMicrobatch | None = None,
                    model_name: str | None = None) -> ClusterProfile:
    """Profile every rank and the collectives; the same ``ClusterProfile`` on every rank.

    Collective when a process group with world size > 1 is initialized (every rank must call
    it); plain single-process use needs no process group.

    Args:
        staged: the model (a plain adapter; emulation wraps it here if ``emulation`` slows
            this rank).
        config: what to profile (default ``MeasureConfig()``).
        device: this rank's compute device.
        emulation: per-rank emulated slowdown / memory capacity (recorded in device names and
            capacities, see ``profiler.emulate``). Without an emulated capacity a CPU rank's
            capacity is the host's RAM divided by the ranks on the host
            (``local_world_size``, ``device_capacity_bytes``).
        cache: True (default directory), a ``ProfileCache``, or False/None (always measure).
        make_microbatch: ``m -> microbatch`` override of ``synthetic_microbatch``.
    Raises:
        ValueError: bad config or emulation lists that do not match the world size.
    """
    config = config or MeasureConfig()
    compiled = None
    if config.compile_backend is not None:  # time the units the engine will run
        compiled = CompiledUnits(staged.units(), CompileOptions(backend=config.compile_backend,
                                                                mode=config.compile_mode))
    # the units run compiled while measured only: the model is left as it came (eager)
    with compiled.active(strict=False) if compiled is not None else contextlib.nullcontext():
        return _profile_cluster(staged, config, device=device, emulation=emulation, cache=cache,
                                group=group, make_microbatch=make_microbatch,
                                model_name=model_name)


def _profile_cluster(staged: StagedModel, config: MeasureConfig, *, device, emulation, cache,
                     group, make_microbatch, model_name) -> ClusterProfile:
    """``profile_cluster`` with the units as they are to be timed."""
    device = torch.device(device)
    rank, world_size = _world(group)
    if emulation is not None:
        emulation.check_world_size(world_size)
    slowdown = 1.0 if emulation is None else emulation.slowdown_of(rank)
    cap = None if emulation is None else emulation.cap_of(rank)
    base = staged.inner if isinstance(staged, EmulatedStagedModel) else staged
    timed = AutocastStagedModel(base, torch.device(device).type, _AUTOCAST[config.precision]) \
        if config.precision != "fp32" else base
    measured = EmulatedStagedModel(timed, slowdown, device) if slowdown != 1.0 else timed
    name = emulated_device_name(local_device_name(device), slowdown, cap)
    # Every rank calls it (it may be a collective), capped or not.
    local = local_world_size(group)
    capacity = float(cap) if cap is not None else device_capacity_bytes(device, local)
    dtype = precision_tag(str(model_dtype(base)).replace("torch.", ""), config.precision,
                          config.param_dtype, config.reduce_dtype)
    fingerprint = model_fingerprint(base.model)
    store = ProfileCache() if cache is True else (cache or None)
    # The capacity does not change timings: the key names the (emulated) speed only.
    timing_name = emulated_device_name(local_device_name(device), slowdown, None)
    if config.compile_backend is not None:  # compiled units time differently
        timing_name += f" compiled-{config.compile_backend}-{config.compile_mode or 'default'}"
    key = device_key(fingerprint, timing_name, dtype, config.sequence_length,
                     config.microbatch_sizes)
    dev = store.get_device(key) if store is not None else None
    if _all_ranks(dev is not None, device, group, world_size):
        dev.name, dev.memory_capacity_bytes = name, capacity
        if config.prints(rank):
            print(f"[hf-cephalo profile] rank {rank} ({name}): cached profile "
                  f"{store.root}/{key}.json", flush=True)
    else:
        # [Note: lockstep profiling] Every rank measures, in lockstep (a barrier before each
        # timed item), even where its own cache entry exists: ranks share the machine's cores
        # and memory bandwidth as they will in training, where a fast rank waits for the slow
        # one at every collective. Without it a fast rank would finish early and the slow rank
        # would be profiled alone, faster than it will train.
        barrier = (lambda: dist.barrier(group)) if world_size > 1 else None
        any_rank = (lambda flag: not _all_ranks(not flag, device, group, world_size)) \
            if world_size > 1 else None
        rank_codes = (lambda code: _rank_codes(code, device, group, world_size)) \
            if world_size > 1 else None
        dev = measure_device(measured, config, device=device, name=name, capacity_bytes=capacity,
                             rank=rank, make_microbatch=make_microbatch, before_each=barrier,
                             any_rank=any_rank, rank_codes=rank_codes)
        if store is not None:
            store.put_device(key, dev)
    gathered = _all_gather_objects({"device": dev.to_json(), "key": key}, group, world_size)
    devices = [DeviceProfile.from_json(g["device"]) for g in gathered]
    model = model_profile(base, model_name, boundary_bytes_per_sample(
        base, make_microbatch or (lambda m: synthetic_microbatch(
            base.model, m, config.sequence_length, device)), device, config.gather_dtype),
        precision=config.precision_spec)
    ratios = skewed_state_ratios(model.state_bytes, [d.memory_capacity_bytes for d in devices])
    comm = _cluster_comm(base, store, fingerprint, dtype, [d.name for d in devices], device,
                         config, group, world_size, ratios)
    machines, host_ram = machine_layout(group)
    return ClusterProfile(
        model=model, devices=devices, comm=comm, source="measured",
        offload_activations=device.type == "cuda", machine_of_rank=machines,
        host_memory_bytes=host_ram,
        extra={"model_fingerprint": fingerprint, "model_class": type(base.model).__name__,
               "model_description": model_description(base.model),
               "dtype": dtype, "sequence_length": config.sequence_length,
               "emulated": emulation is not None,
               # where the measured step terms go back at train end (cache.write_back_measured)
               **({"profile_cache": {"root": str(store.root),
                                     "device_keys": [g["key"] for g in gathered]}}
                  if store is not None else {})})


def _all_ranks(flag: bool, device, group, world_size: int) -> bool:
    """True iff ``flag`` is True on every rank (one int32 MIN all-reduce when world size > 1)."""
    if world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)  # int32: gloo and NCCL reduce it
    return bool(t.item())


def _rank_codes(code: int, device, group, world_size: int) -> list[int]:
    """Every rank's ``code`` (one int64 SUM all-reduce of a one-hot row), in rank order."""
    t = torch.zeros(world_size, dtype=torch.int64, device=device)
    t[dist.get_rank(group)] = int(code)
    dist.all_reduce(t, group=group)
    return [int(c) for c in t.tolist()]


def _cluster_comm(staged, store, fingerprint, dtype, names, device, config, group,
                  world_size, state_ratios=None) -> CommProfile:
    """Cached comm profile if EVERY rank has it with a measured u (one all-reduce decides),
    else measure (even shards and the ``state_ratios`` layout)."""
    if world_size == 1:
        return CommProfile(allgather_s=0.0, reducescatter_s=0.0)
    backend = str(dist.get_backend(group))
    key = comm_key(fingerprint, dtype, names, backend)
    cached = store.get_comm(key) if store is not None else None
    usable = cached is not None and cached.uneven_factor is not None
    if _all_ranks(usable, device, group, world_size):
        times = torch.tensor([cached.allgather_s, cached.reducescatter_s, cached.uneven_factor,
                              cached.root_allgather_s, cached.root_reducescatter_s,
                              cached.allreduce_s, cached.collective_wait_s],
                             dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        return CommProfile(allgather_s=float(times[0]), reducescatter_s=float(times[1]),
                           uneven_factor=float(times[2]),
                           uneven_state_ratios=cached.uneven_state_ratios,
                           root_allgather_s=float(times[3]),
                           root_reducescatter_s=float(times[4]), allreduce_s=float(times[5]),
                           collective_wait_s=float(times[6]),
                           overlaps_compute=cached.overlaps_compute)
    comm = measure_comm(staged, device=device, repeats=config.comm_repeats, group=group,
                        state_ratios=state_ratios)
    if store is not None:
        store.put_comm(key, comm)
    return comm


# ---- refusing foreign profiles ----------------------------------------------------------------
def check_profile_precision(cluster: ClusterProfile, dtype: str | None,
                            source: str = "the profile") -> None:
    """Refuse a profile measured in another precision than the job's (no collective).

    ``dtype``: the job's [Note: precision tags] string (None: not checked); a profile that
    records none (spec-sheet estimates, old files) is not checked. Raises ValueError naming
    both tags and the ``hf-cephalo profile`` flags that measure the job's precision.
    """
    recorded = cluster.extra.get("dtype")
    if dtype is None or recorded in (None, dtype):
        return
    _, p = Precision.parse(dtype)
    raise ValueError(
        f"{source} was measured in {recorded} but this job computes in {dtype} (master dtype "
        "+ autocast under --bf16 / --fp16 + gathered-parameter / reduce-scatter dtypes, "
        "cephalo_param_dtype / cephalo_reduce_dtype); re-profile in this job's precision "
        f"(`hf-cephalo profile --precision {p.compute} --param-dtype {p.param} --reduce-dtype "
        f"{p.reduce}`, or leave cephalo_profile_file unset so the trainer profiles at start), "
        "train in the profile's precision, or give a plan file")


def _same_device(profiled: str, local: str) -> bool:
    """Same name (case-insensitive), or one contains the other ("A10G" vs "NVIDIA A10G") when
    neither is emulated (an emulated device never matches the real one)."""
    a, b = profiled.strip().lower(), local.strip().lower()
    if a == b:
        return True
    return "[emulated" not in a + b and (a in b or b in a)


def _description_diff(theirs: Any, mine: Mapping[str, Any] | None, limit: int = 12) -> list[str]:
    """``"field: profile X, this job Y"`` for each differing model class / config field."""
    if not isinstance(theirs, Mapping) or mine is None:
        return []
    out = []
    if theirs.get("class") != mine.get("class"):
        out.append(f"model class: profile {theirs.get('class')}, this job {mine.get('class')}")
    a, b = theirs.get("desc") or {}, mine.get("desc") or {}
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            out.append(f"{k}: profile {a.get(k, '(absent)')}, this job {b.get(k, '(absent)')}")
    if len(out) > limit:
        out = out[:limit] + [f"... {len(out) - limit} more fields"]
    return out


def check_profile_matches(cluster: ClusterProfile, model: ModelProfile, device_names: Sequence[str],
                          *, source: str = "the profile", dtype: str | None = None,
                          fingerprint: str | None = None,
                          description: Mapping[str, Any] | None = None,
                          sequence_length: int | None = None) -> None:
    """Refuse a profile measured for another model, dtype, sequence length or other devices.

    Args:
        cluster: the given or cached profile.
        model: this job's ``ModelProfile`` (``model_profile(staged)``).
        device_names: this job's device name per rank (rank order, emulation included).
        source: how to name the profile in messages (e.g. the file path).
        dtype / fingerprint: this job's parameter dtype and ``model_fingerprint``; checked
            when the profile records them (measured profiles do).
        description: this job's ``cache.model_description``; with it a fingerprint mismatch
            names the differing model class and config fields (profiles record theirs).
        sequence_length: tokens per sample this job trains with; refused when the profile
            recorded another one (compute times and activation memory scale with it).
    Raises:
        ValueError: world size, model shape, model fingerprint, dtype, sequence length or a
            rank's device name differ; the message says what differs and how to re-profile.
    """
    redo = ("re-profile this cluster (`hf-cephalo profile`, or leave cephalo_profile_file unset so "
            "the trainer profiles at start) or give a plan file")
    if cluster.world_size != len(device_names):
        raise ValueError(f"{source} describes {cluster.world_size} ranks but the job has world "
                         f"size {len(device_names)}; {redo}")
    mine = {k: getattr(cluster.model, k) for k in ("num_units", "params_per_unit", "params_other")}
    theirs = {k: getattr(model, k) for k in mine}
    if mine != theirs:
        raise ValueError(f"{source} was measured for model {cluster.model.name!r} {mine} but this "
                         f"job's model {model.name!r} has {theirs}; {redo}")
    recorded = cluster.extra.get("model_fingerprint")
    if fingerprint is not None and recorded not in (None, fingerprint):
        differs = _description_diff(cluster.extra.get("model_description"), description)
        if dtype is not None and cluster.extra.get("dtype") not in (None, dtype):
            differs.append(f"dtype: profile {cluster.extra['dtype']}, this job {dtype}")
        what = "; ".join(differs) if differs else (
            "the profile does not record its configuration fields (an older profile)")
        raise ValueError(f"{source} was measured for another model configuration ({what}; "
                         f"fingerprint {recorded} vs this model's {fingerprint}); {redo}")
    check_profile_precision(cluster, dtype, source)
    seq = cluster.extra.get("sequence_length")
    if sequence_length is not None and seq is not None and int(seq) != int(sequence_length):
        raise ValueError(
            f"{source} was measured at sequence length {seq} but this job trains at sequence "
            f"length {sequence_length} (compute time and activation memory scale with it); "
            f"re-profile at {sequence_length} (`hf-cephalo profile --sequence-length "
            f"{sequence_length}`, or leave cephalo_profile_file unset so the trainer profiles, "
            "measuring anew or reading the cache, whose entries are keyed by sequence length) "
            "or pass a profile measured at this sequence length")
    bad = [(i, d.name, local) for i, (d, local) in enumerate(zip(cluster.devices, device_names))
           if not _same_device(d.name, local)]
    if bad:
        detail = "; ".join(f"rank {i}: profiled {p!r}, this job {l!r}" for i, p, l in bad)
        raise ValueError(f"{source} was measured on other devices ({detail}); {redo}")
