"""Cephalo's place inside Accelerate: CephaloDistributedType, CephaloPlugin, CephaloAccelerator.

[Note: why Cephalo does not extend Accelerate's DistributedType]
Stock ``accelerate launch`` validates its YAML config in the launcher process and rejects unknown
keys and unknown ``distributed_type`` values, and Accelerate's gather / reduce / broadcast
dispatch on ``AcceleratorState.distributed_type``: a new member written there turns them into
silent no-ops. So Accelerate's own type stays MULTI_GPU (CUDA, NCCL) or MULTI_CPU (gloo), and
Cephalo registers itself beside it: ``CephaloDistributedType.CEPHALO`` carried by a
``CephaloPlugin`` on the ``CephaloAccelerator`` (docs/design.md contract 6). Cephalo's settings come from
``CephaloTrainingArguments`` or ``HF_CEPHALO_*`` environment variables, never from the YAML.

[Note: CPU workers under accelerate launch]
On a machine without CUDA, stock ``accelerate launch`` with ``distributed_type: MULTI_CPU``
starts one process (it expects mpirun), and ``use_cpu: true`` in the YAML is not passed to the
workers. Cephalo's CPU config therefore says MULTI_GPU with ``num_processes`` N (torchrun starts
N workers), and each worker builds its state with ``cpu=True``: Accelerate then reports
MULTI_CPU, gloo and the real number of processes. Without ``cpu=True`` the workers would see an
initialized process group while Accelerate reports DistributedType.NO and one process.
``CephaloAccelerator`` and ``CephaloTrainingArguments`` set ``cpu=True`` automatically when CUDA
is absent.

[Note: Accelerate must not re-shard the weighted sampler]
``Accelerator.prepare`` wraps a DataLoader so that each process reads 1/world_size of its
batches; Cephalo's per-rank DataLoader already yields only this rank's b_i samples (see
``sampler.WeightedBatchSampler``). ``CephaloAccelerator.prepare_data_loader`` returns such a
loader unchanged (no re-sharding, no device placement: the engine moves microbatches itself).
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, fields
from typing import Any

import torch
from accelerate import Accelerator

from hf_cephalo.runtime.sampler import WeightedBatchSampler
from hf_cephalo.planner.types import (ACTIVATION_CHECKPOINTING_CHOICES,
                                      parse_activation_checkpointing)

__all__ = ["CephaloDistributedType", "CephaloPlugin", "CephaloAccelerator", "ENV_PREFIX",
           "ACTIVATION_OFFLOAD_CHOICES", "ADAPTIVE_CHOICES"]

ENV_PREFIX = "HF_CEPHALO_"
ACTIVATION_OFFLOAD_CHOICES = ("on", "off", "auto")
ADAPTIVE_CHOICES = ("off", "batch", "state")


class CephaloDistributedType(str, enum.Enum):
    """Cephalo's distributed type, kept beside (not inside) Accelerate's ``DistributedType``."""

    CEPHALO = "CEPHALO"


def env_name(name: str) -> str:
    """Environment variable of a setting: ``memory_fraction`` -> ``HF_CEPHALO_MEMORY_FRACTION``."""
    return ENV_PREFIX + name.removeprefix("cephalo_").upper()


def _parse_list(value: Any, cast: type, name: str) -> list:
    """'1,2.5', '1 2.5', [1, 2.5] or ['1,2.5'] (command-line tokens) -> list of ``cast`` (float
    or int; '8e9' is a whole number of bytes); ValueError naming the setting ``name``, its
    value, flag and environment variable."""
    what = f"{name} = {value!r}"
    where = f"--cephalo_{name} or env {env_name(name)}"
    parts = [value] if isinstance(value, str) else list(value)
    items = [x for part in parts
             for x in (part.replace(",", " ").split() if isinstance(part, str) else [part])]
    try:
        numbers = [float(x) for x in items]
    except (TypeError, ValueError):
        example = "'8e9,4e9'" if cast is int else "'1,2.5'"
        raise ValueError(f"{what} is not a list of numbers ({where}: use e.g. {example})") from None
    if cast is int:
        if any(not math.isfinite(x) or x != int(x) for x in numbers):
            raise ValueError(f"{what}: entries must be whole numbers ({where}: use e.g. "
                             "'8e9,4e9')")
        return [int(x) for x in numbers]
    return numbers


PARAM_DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")
COLLATE_CHOICES = ("global_batch", "microbatch")
REDUCE_DTYPE_CHOICES = ("fp32", "bf16", "fp16")


@dataclass(kw_only=True)
class CephaloPlugin:
    """Cephalo's settings, carried on ``CephaloAccelerator.cephalo_plugin``.

    Every field left None falls back to the environment variable ``HF_CEPHALO_<NAME>`` (e.g.
    ``HF_CEPHALO_PLAN_FILE``), then to its default. Values are normalized in ``__post_init__``
    (strings from the environment become numbers/lists).

    Raises ValueError naming the field, its ``--cephalo_*`` flag, its environment variable and
    the value, for: a missing plan/profile file, a global batch size < 1, a memory fraction
    outside (0, 1], an unknown activation offload mode, activation checkpointing choice or
    collate scope, a slowdown factor < 1
    or not finite, a memory cap < 1 byte, or emulation lists of different lengths.
    """

    plan_file: str | None = None
    """Plan JSON (``hf-cephalo plan --out``); None: plan at start from ``profile_file``."""
    profile_file: str | None = None
    """Cluster profile JSON; None with no plan: profile this cluster at start."""
    global_batch_size: int | None = None
    """Global batch size B (samples per optimizer step, all ranks); None: the plan's value."""
    memory_fraction: float | None = None
    """Fraction c in (0, 1] of each device's memory capacity (bytes) the plan may use; default 0.8."""
    activation_offload: str | None = None
    """'on', 'off' or 'auto' (on for CUDA, off on CPU); default 'auto'."""
    emulate_slowdown: list[float] | None = None
    """Per-rank compute slowdown factors (dimensionless, >= 1), rank order; None: no emulation."""
    emulate_memory_cap_bytes: list[int] | None = None
    """Per-rank emulated memory capacity (bytes, > 0), rank order; None: real capacity."""
    emulate_slowdown_schedule: str | None = None
    """Per-rank slowdown factors changing with the step, ``"0:1,1;10:1,3"``
    (``profiler.emulate.SlowdownSchedule``); None: no drift."""
    adaptive: str | None = None
    """Live re-balancing: 'off', 'batch' (default: b_i / m_i / l_i, nothing moves) or 'state'
    (also r_i)."""
    adaptive_threshold: float | None = None
    """Relative predicted step-time gain a switch needs, in (0, 1); default 0.05."""
    adaptive_interval: int | None = None
    """Steps between two exchanges of the measurements (>= 1); default 5."""
    adaptive_hysteresis_steps: int | None = None
    """Steps between two switches at least (>= 0); default 20."""
    save_full_model: bool | None = None
    """Also write the full model (``save_model``'s sharded safetensors) into every Trainer
    checkpoint; default False (``hf-cephalo export`` writes it from a checkpoint on demand)."""
    max_shard_size: str | None = None
    """Largest weight file ``save_model`` writes, as ``save_pretrained``'s ``max_shard_size``:
    bytes or e.g. '5GB' (TB/GB/MB/KB, powers of 1000); default '50GB'."""
    param_dtype: str | None = None
    """dtype of the gathered (all-gathered) parameters: 'auto' (default: the compute dtype of
    --bf16 / --fp16, fp32 without them), 'bf16', 'fp16' or 'fp32' (gather the fp32 master)."""
    reduce_dtype: str | None = None
    """dtype of the gradient reduce-scatter: 'fp32' (default) or the param dtype."""
    precision: str | None = None
    """Precision per rank (docs/engine.md "Precision per rank"): 'auto' or one of fp32 / bf16 /
    fp16 per rank, rank order ('bf16,bf16,fp16,fp32'); None (default): the job's one precision
    (--bf16 / --fp16 / fp32). Not with --bf16 / --fp16."""
    activation_checkpointing: str | None = None
    """When the trainer plans (no plan file): 'true' (default: the engine recomputes each unit's
    forward in backward), 'false' (keep every forward graph: faster, more activation memory;
    the plan fails when that does not fit) or 'auto' (plan both, keep the faster one that fits;
    docs/planner.md). A plan file decides it itself."""
    collate: str | None = None
    """Where the data collator runs: 'global_batch' (default: once per global batch, then split
    into ranks and microbatches; padding as one process with the whole batch) or 'microbatch'
    (per microbatch: less padding, padding then depends on the plan). See [Note: padding
    independent of the plan] in ``runtime/sampler.py``."""
    distributed_type: CephaloDistributedType = CephaloDistributedType.CEPHALO
    """Cephalo's own distributed type (Accelerate's stays MULTI_GPU / MULTI_CPU)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "distributed_type" and getattr(self, f.name) is None:
                value = os.environ.get(env_name(f.name), "").strip()
                if value:
                    setattr(self, f.name, value)
        if self.memory_fraction is None:
            self.memory_fraction = 0.8
        if self.activation_offload is None:
            self.activation_offload = "auto"
        if self.save_full_model is None:
            self.save_full_model = False
        if self.max_shard_size is None:
            self.max_shard_size = "50GB"
        if self.param_dtype is None:
            self.param_dtype = "auto"
        if self.reduce_dtype is None:
            self.reduce_dtype = "fp32"
        if self.collate is None:
            self.collate = "global_batch"
        if self.activation_checkpointing is None:
            self.activation_checkpointing = "true"
        if self.adaptive is None:
            self.adaptive = "batch"
        if self.adaptive_threshold is None:
            self.adaptive_threshold = 0.05
        if self.adaptive_interval is None:
            self.adaptive_interval = 5
        if self.adaptive_hysteresis_steps is None:
            self.adaptive_hysteresis_steps = 20
        self._validate()

    def _bad(self, name: str, requirement: str) -> ValueError:
        return ValueError(f"{name} = {getattr(self, name)!r} (--cephalo_{name} or env "
                          f"{env_name(name)}): {requirement}")

    def _validate(self) -> None:
        commands = {"plan_file": "`hf-cephalo plan --profile PROFILE -B N --out FILE` (or "
                                 "--cluster CLUSTER.yaml --model MODEL for a spec-sheet estimate)",
                    "profile_file": "`hf-cephalo profile --model-config MODEL_DIR --out FILE` "
                                    "(under the launcher, one process per rank)"}
        for name, command in commands.items():
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise self._bad(name, f"no such file; write one with {command} or leave it unset")
        if self.global_batch_size is not None:
            try:
                value = float(self.global_batch_size)
            except (TypeError, ValueError):
                value = math.nan
            if not (math.isfinite(value) and value == int(value) and value >= 1):
                raise self._bad("global_batch_size", "must be an integer >= 1 (samples)")
            self.global_batch_size = int(value)
        try:
            fraction = float(self.memory_fraction)
        except (TypeError, ValueError):
            fraction = math.nan
        if not 0.0 < fraction <= 1.0:
            raise self._bad("memory_fraction", "must be a number in (0, 1]")
        self.memory_fraction = fraction
        if str(self.activation_offload).lower() not in ACTIVATION_OFFLOAD_CHOICES:
            raise self._bad("activation_offload", f"must be one of {ACTIVATION_OFFLOAD_CHOICES}")
        self.activation_offload = str(self.activation_offload).lower()
        self._validate_saving()
        self._validate_emulation()
        if self.precision is not None:
            names = str(self.precision).replace(",", " ").split()
            if names != ["auto"] and (not names or any(n not in ("fp32", "bf16", "fp16")
                                                       for n in names)):
                raise self._bad("precision", "must be 'auto' or one of fp32 / bf16 / fp16 per "
                                             "rank in rank order, e.g. 'bf16,bf16,fp16,fp32'")
            self.precision = ",".join(names)
        self._validate_adaptive()
        for name, choices in (("param_dtype", PARAM_DTYPE_CHOICES),
                              ("reduce_dtype", REDUCE_DTYPE_CHOICES),
                              ("collate", COLLATE_CHOICES)):
            value = str(getattr(self, name)).strip().lower()
            if value not in choices:
                raise self._bad(name, f"must be one of {choices}")
            setattr(self, name, value)
        try:  # the one parser of the choice, as the CLI's (any case: "True" as HF flags)
            self.activation_checkpointing = parse_activation_checkpointing(
                self.activation_checkpointing)
        except ValueError:
            raise self._bad("activation_checkpointing",
                            f"must be one of {ACTIVATION_CHECKPOINTING_CHOICES} (any case)") \
                from None

    def _validate_saving(self) -> None:
        from hf_cephalo.engine.export import parse_max_shard_size

        flag = self.save_full_model
        if isinstance(flag, str):
            words = {"1": True, "true": True, "yes": True, "on": True,
                     "0": False, "false": False, "no": False, "off": False}
            if flag.strip().lower() not in words:
                raise self._bad("save_full_model", "must be true or false (1/0, yes/no, on/off)")
            flag = words[flag.strip().lower()]
        if not isinstance(flag, bool):
            raise self._bad("save_full_model", "must be true or false")
        self.save_full_model = flag
        size = self.max_shard_size
        if isinstance(size, str) and size.strip().isdigit():
            size = int(size.strip())
        try:
            parse_max_shard_size(size)
        except ValueError as e:
            raise self._bad("max_shard_size", f"{e}") from None
        self.max_shard_size = size

    def _validate_emulation(self) -> None:
        if self.emulate_slowdown is not None:
            self.emulate_slowdown = _parse_list(self.emulate_slowdown, float, "emulate_slowdown")
            if not self.emulate_slowdown or not all(1.0 <= x < math.inf for x in self.emulate_slowdown):
                raise self._bad("emulate_slowdown", "need one finite factor >= 1 per rank (a device "
                                                    "cannot be emulated faster than it is)")
        if self.emulate_memory_cap_bytes is not None:
            self.emulate_memory_cap_bytes = _parse_list(self.emulate_memory_cap_bytes, int,
                                                        "emulate_memory_cap_bytes")
            if not self.emulate_memory_cap_bytes or min(self.emulate_memory_cap_bytes) < 1:
                raise self._bad("emulate_memory_cap_bytes", "need one capacity >= 1 (bytes) per rank")
        if (self.emulate_slowdown is not None and self.emulate_memory_cap_bytes is not None
                and len(self.emulate_slowdown) != len(self.emulate_memory_cap_bytes)):
            raise ValueError(f"emulate_slowdown has {len(self.emulate_slowdown)} entries but "
                             f"emulate_memory_cap_bytes has {len(self.emulate_memory_cap_bytes)}; "
                             "give one value per rank in both (--cephalo_emulate_slowdown, "
                             "--cephalo_emulate_memory_cap_bytes)")

    def _validate_adaptive(self) -> None:
        mode = str(self.adaptive).strip().lower()
        if mode not in ADAPTIVE_CHOICES:
            raise self._bad("adaptive", f"must be one of {ADAPTIVE_CHOICES}")
        self.adaptive = mode
        try:
            threshold = float(self.adaptive_threshold)
        except (TypeError, ValueError):
            threshold = math.nan
        if not 0.0 < threshold < 1.0:
            raise self._bad("adaptive_threshold", "must be a number in (0, 1) (the relative "
                            "predicted step-time gain a switch needs; 0.05 = 5%)")
        self.adaptive_threshold = threshold
        for name, low, what in (("adaptive_interval", 1, "steps between exchanges"),
                                ("adaptive_hysteresis_steps", 0, "steps between switches")):
            try:
                value = float(getattr(self, name))
            except (TypeError, ValueError):
                value = math.nan
            if not (math.isfinite(value) and value == int(value) and value >= low):
                raise self._bad(name, f"must be an integer >= {low} ({what})")
            setattr(self, name, int(value))
        if self.emulate_slowdown_schedule is not None:
            from hf_cephalo.profiler.emulate import SlowdownSchedule

            if self.emulate_slowdown is not None:
                raise ValueError("--cephalo_emulate_slowdown and "
                                 "--cephalo_emulate_slowdown_schedule are both set: give the "
                                 "schedule alone (its step-0 entry is the start)")
            self.emulate_slowdown_schedule = str(self.emulate_slowdown_schedule)
            SlowdownSchedule.parse(self.emulate_slowdown_schedule)  # ValueError naming the flag

    @property
    def offload_activations(self) -> bool | None:
        """``activation_offload`` as the engine's argument: True, False, or None (auto)."""
        return {"on": True, "off": False, "auto": None}[self.activation_offload]

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError if a per-rank emulation list does not have ``world_size`` entries.

        Call once the world size is known, before any collective.
        """
        for name in ("emulate_slowdown", "emulate_memory_cap_bytes"):
            values = getattr(self, name)
            if values is not None and len(values) != world_size:
                raise self._bad(name, f"has {len(values)} entries but the world size is "
                                      f"{world_size}; give one value per rank in rank order")
        if self.emulate_slowdown_schedule is not None:
            from hf_cephalo.profiler.emulate import SlowdownSchedule

            SlowdownSchedule.parse(self.emulate_slowdown_schedule).check_world_size(world_size)

    @classmethod
    def from_training_args(cls, args: Any) -> CephaloPlugin:
        """The plugin of a ``CephaloTrainingArguments`` (its cephalo_* fields, already resolved)."""
        return cls(**{f.name: getattr(args, "cephalo_" + f.name)
                      for f in fields(cls) if f.name != "distributed_type"})


class CephaloAccelerator(Accelerator):
    """An ``Accelerator`` that carries a ``CephaloPlugin`` and leaves Cephalo's loaders alone.

    Takes every ``Accelerator`` argument plus ``cephalo_plugin`` (default: ``CephaloPlugin()``,
    i.e. from ``HF_CEPHALO_*``). ``cpu`` defaults to True when CUDA is absent (see
    [Note: CPU workers under accelerate launch]). ``distributed_type`` / ``num_processes`` remain
    Accelerate's (MULTI_GPU or MULTI_CPU, real world size), so gather, reduce, broadcast and RNG
    synchronization work as usual; ``cephalo_distributed_type`` is CEPHALO.

    Raises ValueError (on every rank, before any collective) if the plugin's per-rank lists do
    not match the number of processes.
    """

    def __init__(self, *args: Any, cephalo_plugin: CephaloPlugin | None = None, **kwargs: Any) -> None:
        if "cpu" not in kwargs and not torch.cuda.is_available():
            kwargs["cpu"] = True
        super().__init__(*args, **kwargs)
        self.cephalo_plugin = cephalo_plugin if cephalo_plugin is not None else CephaloPlugin()
        self.cephalo_plugin.check_world_size(self.num_processes)
        self.cephalo_engine: Any = None

    def attach_engine(self, engine: Any, model: torch.nn.Module | None = None) -> None:
        """Register the ``CephaloEngine`` that owns the model's parameters (set by CephaloTrainer).

        Afterwards ``prepare_model`` returns that model (the engine's staged model, or ``model``:
        the object the user passed, e.g. a LoRA ``PeftModel`` around it) unchanged: the engine
        already shards and synchronizes it, and a DistributedDataParallel wrapper would
        all-reduce again (or refuse a model whose parameters are all frozen while sharded).
        """
        self.cephalo_engine = engine
        self.cephalo_model = model

    @property
    def cephalo_distributed_type(self) -> CephaloDistributedType:
        """Cephalo's distributed type (``self.distributed_type`` is Accelerate's own)."""
        return self.cephalo_plugin.distributed_type

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        """Return the engine's model unchanged (see ``attach_engine``); others as ``Accelerator`` does."""
        if self.cephalo_engine is not None and (
                model is self.cephalo_engine.staged.model or
                model is getattr(self, "cephalo_model", None)):
            return model
        return super().prepare_model(model, device_placement=device_placement,
                                     evaluation_mode=evaluation_mode)

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement=None,
                            slice_fn_for_dispatch=None):
        """Return a loader over a ``WeightedBatchSampler`` unchanged; others as ``Accelerator`` does.

        See [Note: Accelerate must not re-shard the weighted sampler].
        """
        if isinstance(getattr(data_loader, "batch_sampler", None), WeightedBatchSampler):
            return data_loader
        return super().prepare_data_loader(data_loader, device_placement=device_placement,
                                           slice_fn_for_dispatch=slice_fn_for_dispatch)
