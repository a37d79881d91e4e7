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
from dataclasses import dataclass, fields
from typing import Any

import torch
from accelerate import Accelerator

from hf_cephalo.runtime.sampler import WeightedBatchSampler
from hf_cephalo.runtime.settings import (ACTIVATION_OFFLOAD_CHOICES, ADAPTIVE_CHOICES,  # noqa: F401
                                         ENV_PREFIX, CephaloSettings, env_name)

__all__ = ["CephaloDistributedType", "CephaloPlugin", "CephaloAccelerator", "ENV_PREFIX",
           "ACTIVATION_OFFLOAD_CHOICES", "ADAPTIVE_CHOICES"]


class CephaloDistributedType(str, enum.Enum):
    """Cephalo's distributed type, kept beside (not inside) Accelerate's ``DistributedType``."""

    CEPHALO = "CEPHALO"


@dataclass(kw_only=True)
class CephaloPlugin(CephaloSettings):
    """Cephalo's settings (``runtime.settings.CephaloSettings``: every field, its default, its
    ``HF_CEPHALO_*`` environment fallback and its validation), carried on
    ``CephaloAccelerator.cephalo_plugin``, plus Cephalo's own distributed type."""

    distributed_type: CephaloDistributedType = CephaloDistributedType.CEPHALO
    """Cephalo's own distributed type (Accelerate's stays MULTI_GPU / MULTI_CPU)."""

    @classmethod
    def from_training_args(cls, args: Any) -> CephaloPlugin:
        """The plugin of a ``CephaloTrainingArguments`` (its cephalo_* fields, already resolved)."""
        return cls(**{f.name: getattr(args, "cephalo_" + f.name) for f in fields(CephaloSettings)})


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
