"""Cephalo's place inside Accelerate: CephaloDistributedType, CephaloPlugin, CephaloAccelerator.

Accelerate's own distributed type stays MULTI_GPU / MULTI_CPU and Cephalo registers beside it;
CPU workers are started as MULTI_GPU and built with ``cpu=True``; Cephalo's per-rank loaders are
not re-sharded. The Notes below say why; docs/accelerate.md, "How Cephalo fits into Accelerate
(and why)".
"""

# [Note: why Cephalo does not extend Accelerate's DistributedType]
# Stock ``accelerate launch`` validates its YAML config in the launcher process and rejects
# unknown keys and unknown ``distributed_type`` values, and Accelerate's gather / reduce /
# broadcast dispatch on ``AcceleratorState.distributed_type``: a new member written there turns
# them into silent no-ops. So Accelerate's own type stays MULTI_GPU (CUDA, NCCL) or MULTI_CPU
# (gloo), and Cephalo registers itself beside it: ``CephaloDistributedType.CEPHALO`` carried by
# a ``CephaloPlugin`` on the ``CephaloAccelerator`` (docs/design.md contract 6). Cephalo's
# settings come from ``CephaloTrainingArguments`` or ``HF_CEPHALO_*`` environment variables,
# never from the YAML.
#
# [Note: CPU workers under accelerate launch]
# On a machine without CUDA, stock ``accelerate launch`` with ``distributed_type: MULTI_CPU``
# starts one process (it expects mpirun), and ``use_cpu: true`` in the YAML is not passed to the
# workers. Cephalo's CPU config therefore says MULTI_GPU with ``num_processes`` N (torchrun
# starts N workers), and each worker builds its state with ``cpu=True``: Accelerate then
# reports MULTI_CPU, gloo and the real number of processes. Without ``cpu=True`` the workers
# would see an initialized process group while Accelerate reports DistributedType.NO and one
# process. ``CephaloAccelerator`` and ``CephaloTrainingArguments`` set ``cpu=True``
# automatically when CUDA is absent (a script's ``cpu=False`` included: Accelerate's own
# examples pass ``cpu=args.cpu``).
#
# [Note: Accelerate must not re-shard the weighted sampler]
# ``Accelerator.prepare`` wraps a DataLoader so that each process reads 1/world_size of its
# batches; Cephalo's per-rank DataLoader already yields only this rank's b_i samples (see
# ``sampler.WeightedBatchSampler``). ``CephaloAccelerator.prepare_data_loader`` returns such a
# loader unchanged (no re-sharding, no device placement: the engine moves microbatches itself).

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

import torch
from accelerate import Accelerator

from hf_cephalo.runtime import (ACTIVATION_OFFLOAD_CHOICES, ADAPTIVE_CHOICES,  # noqa: F401
                                ENV_PREFIX, CephaloSettings, WeightedBatchSampler,
                                current_head_call)

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
    """An ``Accelerator`` that trains through the Cephalo runtime.

    Takes every ``Accelerator`` argument plus ``cephalo_plugin`` (default: ``CephaloPlugin()``,
    i.e. from ``HF_CEPHALO_*``). ``cpu`` is True when CUDA is absent, also where a script passes
    ``cpu=False`` (see [Note: CPU workers under accelerate launch]). ``distributed_type`` / ``num_processes`` remain
    Accelerate's (MULTI_GPU or MULTI_CPU, real world size), so gather, reduce, broadcast and RNG
    synchronization work as usual; ``cephalo_distributed_type`` is CEPHALO.

    Two doors use it: ``CephaloTrainer`` (which attaches its own session: ``attach_session``) and
    a custom loop, where ``prepare(model, optimizer, train_dataloader, ...)`` plans, shards the
    model and returns the loop's objects ([Note: a custom loop on the layered engine] in
    ``loop.py``; docs/accelerate.md "Your own training loop").

    Raises ValueError (on every rank, before any collective) if the plugin's per-rank lists do
    not match the number of processes.
    """

    def __init__(self, *args: Any, cephalo_plugin: CephaloPlugin | None = None, **kwargs: Any) -> None:
        if not kwargs.get("cpu") and not torch.cuda.is_available():
            # also for an explicit cpu=False (Accelerate's examples pass cpu=args.cpu): without
            # CUDA the device is the CPU either way, and only cpu=True gives the workers the
            # real world size ([Note: CPU workers under accelerate launch])
            kwargs["cpu"] = True
        super().__init__(*args, **kwargs)
        from hf_cephalo.launch_check import check_this_launch

        check_this_launch(self.num_processes)  # one CPU process where several were asked for
        self.cephalo_plugin = cephalo_plugin if cephalo_plugin is not None else CephaloPlugin()
        self.cephalo_plugin.check_world_size(self.num_processes)
        self.cephalo_trainer_session: Any = None  # CephaloTrainer's (attach_session)
        self.cephalo_loop = None  # a custom loop's LoopState once prepare() saw the model
        self.cephalo_loaders: list = []  # the loop's prepared loaders (training first)

    def attach_session(self, session: Any, model: torch.nn.Module | None = None) -> None:
        """Register the runtime ``Session`` whose engine owns the model's parameters (set by
        CephaloTrainer).

        Afterwards ``prepare_model`` returns that model (the engine's staged model, or ``model``:
        the object the user passed, e.g. a LoRA ``PeftModel`` around it) unchanged: the engine
        already shards and synchronizes it, and a DistributedDataParallel wrapper would
        all-reduce again (or refuse a model whose parameters are all frozen while sharded).
        """
        self.cephalo_trainer_session = session
        self.cephalo_model = model

    @property
    def cephalo_distributed_type(self) -> CephaloDistributedType:
        """Cephalo's distributed type (``self.distributed_type`` is Accelerate's own)."""
        return self.cephalo_plugin.distributed_type

    @property
    def cephalo_session(self):
        """The runtime session of a prepared custom loop (None before ``prepare``)."""
        return None if self.cephalo_loop is None else self.cephalo_loop.session

    # ---- the Trainer door --------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        """Return the engine's model unchanged (see ``attach_session``); others as ``Accelerator``
        does."""
        if self.cephalo_trainer_session is not None and (
                model is self.cephalo_trainer_session.staged.model or
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

    # ---- the custom-loop door -------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """Stock ``prepare`` for the Trainer door; for a custom loop (a model among ``args``, or
        a loop already prepared): the model planned and sharded (``CephaloModel``), an optimizer
        re-pointed at the shards (``CephaloOptimizer``), DataLoaders as this rank's rows of the
        same global batches (``CephaloDataLoader``: the first one is the training loader), LR
        schedulers as stock. Objects come back in the order given.

        Raises (every rank alike, before any collective unless noted): see
        ``loop_prepare.check_loop_setup`` (a second model, an optimizer over other tensors, an
        unsupported model, Accelerate features the engine replaces, a missing global batch
        size); a plan that does not fit (after profiling, on every rank)."""
        from hf_cephalo.integrations.loop.prepare import prepare_loop

        if self.cephalo_trainer_session is not None or (
                self.cephalo_loop is None and not any(isinstance(a, torch.nn.Module) for a in args)):
            return super().prepare(*args, device_placement=device_placement)
        return prepare_loop(self, args)

    def backward(self, loss, **kwargs):
        """The layered backward of the step's ``model(**batch)`` (custom loops): ``loss`` is
        read by ``CephaloPlugin.loss_reduction`` ([Note: a custom loop on the layered engine]);
        fp16 scales it. Not divided by ``gradient_accumulation_steps``: each batch of a
        prepared loader is a whole global batch (see ``loop_prepare``)."""
        if self.cephalo_loop is None:
            return super().backward(loss, **kwargs)
        if kwargs:
            raise TypeError(f"accelerator.backward({', '.join(kwargs)}=...): the layered backward "
                            "runs its own autograd calls; drop the keyword arguments")
        self.cephalo_loop.backward(loss, reduction=self.cephalo_plugin.loss_reduction,
                                   scaler=self.scaler)

    def _do_sync(self):
        """Custom loops: every batch of the prepared loader is a whole global batch (any
        ``gradient_accumulation_steps`` is folded into it at prepare), so every step syncs."""
        if self.cephalo_loop is None:
            return super()._do_sync()
        self.gradient_state._set_sync_gradients(True)

    def no_sync(self, model):
        if self.cephalo_loop is None:
            return super().no_sync(model)
        raise RuntimeError("accelerator.no_sync: the layered engine reduce-scatters each unit "
                           "once per step and accumulates every microbatch of the global batch "
                           "itself; there is nothing to skip. Drop no_sync (set "
                           "gradient_accumulation_steps on the Accelerator instead)")

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Custom loops: the gradients unscaled (fp16), then clipped by the GLOBAL L2 norm over
        every rank's shards (``engine.clip_grad_norm_``); returns that norm. ``parameters``
        must be the prepared model's (all of them)."""
        if self.cephalo_loop is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        from hf_cephalo.integrations.loop.prepare import check_clip_parameters

        check_clip_parameters(self, parameters, norm_type)
        self.unscale_gradients()
        return self.cephalo_loop.session.clip_grad_norm(float(max_norm))

    # ---- inside the engine's head: [Note: collectives inside the engine's head] -------------
    @property
    def num_processes(self) -> int:
        """1 while a user loss runs inside the engine's head (its loss is this microbatch's
        share of the GLOBAL loss: no DDP mean to undo); else Accelerate's."""
        if current_head_call() is not None:
            return 1
        return super().num_processes

    def reduce(self, tensor, reduction="sum", scale=1.0):
        """Inside the engine's head: ``reduction="sum"`` deferred to the step's exchange
        (``head_calls.py``), any other refused; else Accelerate's."""
        call = current_head_call()
        if call is None:
            return super().reduce(tensor, reduction=reduction, scale=scale)
        if reduction != "sum":
            call.refuse(f"accelerator.reduce(reduction={reduction!r}) (only 'sum' has one "
                        "meaning over microbatches)")
        return call.gather(tensor, "reduce") * scale

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        """Inside the engine's head: unchanged (one process pads nothing); else Accelerate's."""
        if current_head_call() is not None:
            return tensor
        return super().pad_across_processes(tensor, dim=dim, pad_index=pad_index,
                                            pad_first=pad_first)

    def gather(self, tensor):
        """Custom loops: tensors whose first dimension differs by rank (this rank's rows) are
        concatenated in rank order; see ``loop_prepare.gather_rows``. Inside the engine's
        head: deferred to the step's exchange (``head_calls.py``)."""
        call = current_head_call()
        if call is not None:
            return call.gather(tensor, "gather")
        if self.cephalo_loop is None:
            return super().gather(tensor)
        from hf_cephalo.integrations.loop.prepare import gather_rows

        return gather_rows(self, tensor)

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """Custom loops: every evaluation row exactly once, in dataset order (the loaders never
        pad or duplicate samples, so nothing is dropped); objects by ``gather_object``. Inside
        the engine's head: deferred to the step's exchange (``head_calls.py``)."""
        call = current_head_call()
        if call is not None:
            if use_gather_object:
                call.refuse("accelerator.gather_for_metrics(use_gather_object=True)")
            return call.gather(input_data, "gather")
        if self.cephalo_loop is None:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        from accelerate.utils import gather_object

        from hf_cephalo.integrations.loop.prepare import gather_rows, holds_only_tensors

        if use_gather_object or not holds_only_tensors(input_data):
            return gather_object(input_data)
        return gather_rows(self, input_data)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """A prepared loader's next iteration from batch ``num_batches`` of the epoch in
        progress (the skipped samples are not read)."""
        from hf_cephalo.integrations.loop.loop import CephaloDataLoader

        if isinstance(dataloader, CephaloDataLoader):
            return dataloader.skipping(num_batches)
        return super().skip_first_batches(dataloader, num_batches)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        from hf_cephalo.integrations.loop.loop import CephaloModel

        if isinstance(model, CephaloModel):
            return model._module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                    keep_torch_compile=keep_torch_compile)

    def get_state_dict(self, model, unwrap=True):
        """Collective (every rank): the prepared model's full state dict on the main process
        (CPU tensors, ``model.state_dict()``'s keys), ``{}`` elsewhere, as Accelerate's FSDP
        full state dict. Holds the whole model on rank 0; ``save_model`` streams instead."""
        from hf_cephalo.integrations.loop.loop import CephaloModel

        if not isinstance(model, CephaloModel):
            return super().get_state_dict(model, unwrap=unwrap)
        state = model._session.full_state_dict()
        return {} if state is None else state

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        """Collective (every rank): a ``from_pretrained`` folder of the prepared model,
        streamed one unit at a time (rank 0 writes; a LoRA PeftModel: its adapter)."""
        from hf_cephalo.integrations.loop.loop import CephaloModel

        if not isinstance(model, CephaloModel):
            return super().save_model(model, save_directory, max_shard_size=max_shard_size,
                                      safe_serialization=safe_serialization)
        if not safe_serialization:
            raise ValueError("save_model(safe_serialization=False): the streamed save writes "
                             "safetensors only; drop the argument")
        model._session.save_model_files(str(save_directory), max_shard_size)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs):
        """Custom loops: the sharded training state, schedulers, RNG, scaler, registered
        objects and loader positions, written atomically (``state.py``); resumable onto
        another plan and world size. Returns the folder, as stock."""
        if self.cephalo_loop is None:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        from hf_cephalo.integrations.loop.prepare import checkpoint_dir
        from hf_cephalo.integrations.loop.state import save_loop_state

        return save_loop_state(self, checkpoint_dir(self, output_dir))

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs):
        """Custom loops: restore a ``save_state`` folder onto this plan and world size
        (``state.py``); ``input_dir`` None with automatic checkpoint naming: the newest
        complete one."""
        if self.cephalo_loop is None:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        from hf_cephalo.integrations.loop.prepare import resume_dir
        from hf_cephalo.integrations.loop.state import load_loop_state

        load_loop_state(self, resume_dir(self, input_dir))

    def end_training(self):
        """Stock (trackers ended, the process group destroyed), after a custom loop's session
        dropped an open step and ended its training: the predicted-vs-measured table (rank 0)
        and the profile cache's write-back, as the Trainer door does at the end of ``train()``
        (collective: every rank calls it, as stock's ``destroy_process_group`` needs too)."""
        if self.cephalo_loop is not None:
            self.cephalo_loop.end_open_step("end_training")
            self.cephalo_loop.finish()
        return super().end_training()
