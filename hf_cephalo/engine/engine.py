"""CephaloEngine: uneven flat-parameter sharding + layered gradient accumulation.

Usage (every rank, inside an initialized process group)::

    engine = CephaloEngine(staged, state_ratios=[0.75, 0.25])
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    for microbatches in loader:               # this rank's l_i microbatches (maybe none)
        out = engine.train_step(microbatches)  # out.loss: global item-mean loss
        engine.clip_grad_norm_(1.0)
        opt.step(); engine.zero_grad()

See docs/design.md contract 4 and [Note: layered schedule] in ``schedule.py``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..models.base import (AutocastStagedModel, StagedModel, global_num_items_scope,
                          refuse_global_loss)
from ..planner.state import layout_unit_shards  # pure planning code (numpy), no torch.distributed
from . import collectives as C
from . import evaluation, generation, state_dicts
from .compile import (CompileFailure, CompileOptions, CompileStats, CompiledUnits,
                      compile_line, graph_count, probe_compile, remote_failure, running,
                      timed_probe)
from .flat_param import (FlatParamUnit, LiveTracker, UnitShardMeta, collect_params,
                         move_shared_params, param_infos)
from .loading import (CheckpointLike, StartKind, choose_source, param_shapes_beside_meta_buffers,
                      place_buffers)
from .evaluation import EvalOutput
from .offload import ActivationStash, CudaStreams
from .param_shards import ParamShards
from .precision import EnginePrecision
from .schedule import LayeredStep, RootUnits
from .state_dicts import FullUnit
from .stats import CollectiveStats

if TYPE_CHECKING:
    from .grad_scaler import CephaloGradScaler


class StepOutput(NamedTuple):
    """Result of ``train_step``.

    loss: global item-mean loss (sum over all ranks' items / global item count), same on all ranks.
    num_items: global item count N; local_loss_sum / local_num_items: this rank's share.
    """

    loss: float
    num_items: int
    local_loss_sum: float
    local_num_items: int


class OpenStep:
    """A training step between ``forward_step`` and ``backward_step``: ``logits`` and
    ``loss_sums`` per microbatch of this rank (with autograd graphs), ``local_items`` /
    ``global_items`` (the items the adapter counts: tokens with a label after the causal
    shift, or samples; the global count all-reduced)."""

    def __init__(self, step, stash, logits, loss_sums, local_items: int, global_items: int):
        self.step, self.stash = step, stash
        self.logits, self.loss_sums = logits, loss_sums
        self.local_items, self.global_items = local_items, global_items


def _check_ratios(state_ratios, world_size: int) -> list[float]:
    if state_ratios is None:
        return [1.0 / world_size] * world_size
    ratios = [float(r) for r in state_ratios]
    if len(ratios) != world_size:
        raise ValueError(f"state_ratios has {len(ratios)} entries {ratios} but the world size is "
                         f"{world_size}: give one training-state ratio per rank")
    if any(not math.isfinite(r) or r < 0 for r in ratios) or abs(sum(ratios) - 1.0) > 1e-6:
        raise ValueError(f"state_ratios {ratios} must be finite, non-negative and sum to 1 "
                         f"(sum is {sum(ratios)})")
    return ratios


def _check_fp32_master(compute: torch.dtype | None, model: nn.Module) -> None:
    """Autocast (``compute`` not None) needs fp32 parameters (master weights); ValueError names
    the fix."""
    if compute is None:
        return
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if dtypes != ["torch.float32"]:
        raise ValueError(f"autocast_dtype={compute} needs fp32 parameters (master weights), "
                         f"the model has {dtypes}: load it in float32 (model.float())")


def _scale_fn(loss_scale) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``train_step``'s ``loss_scale`` as a function of the loss (None: no scaling)."""
    if loss_scale is None:
        return None
    if hasattr(loss_scale, "scale"):
        return loss_scale.scale
    return lambda loss: loss * loss_scale


def _layout(ratios: list[float], unit_numels: list[int]) -> list[list[int]]:
    """Per-unit per-rank element counts from the planner (units in the engine's order)."""
    return [list(map(int, row)) for row in layout_unit_shards(ratios, unit_numels)]


def _check_layout(layout: list[list[int]], names: list[str], numels: list[int],
                  world_size: int) -> None:
    """Every row: world-size non-negative ints summing to the unit's numel (else ValueError).

    The one check of a shard layout: ``FlatParamUnit`` trusts the row it is given."""
    if len(layout) != len(names):
        raise ValueError(f"shard_layout has {len(layout)} rows but the engine has {len(names)} "
                         f"units: {len(names) - 2} layers, then the embedding and the head unit "
                         "(one row each, in that order)")
    for name, row, numel in zip(names, layout, numels):
        if len(row) != world_size or any(n < 0 for n in row) or sum(row) != numel:
            raise ValueError(f"shard layout of {name} is {row}: it needs {world_size} "
                             f"non-negative per-rank element counts summing to the unit's "
                             f"{numel} elements")


class CephaloEngine:
    """Runs a ``StagedModel`` with uneven ZeRO-3 sharding and layered gradient accumulation.

    Args:
        staged: the model adapter; its parameters on the CPU, the meta device (with a
            checkpoint, or for a seeded init) or already on ``device``.
        state_ratios: r_i per rank (world-size floats, >= 0, sum 1); default even. Used to lay
            out shards with ``hf_cephalo.planner.state.layout_unit_shards`` unless
            ``shard_layout`` is given.
        shard_layout: per unit (layers in order, then the embedding unit, then the head unit)
            the per-rank element counts.
        process_group: default the world group. device: compute device (default: the
            model's, the CPU for a meta model).
        offload_activations: stash boundary activations in pinned CPU memory (CUDA only);
            None = on for CUDA, off on CPU.
        reduce_scatter_fallback: force the all-reduce-and-slice path instead of reduce-scatter.
        activation_checkpointing: True (the paper's schedule): keep only boundary activations
            and recompute each unit's forward in backward. False: keep every microbatch's
            autograd graph (no recompute: a unit's forward + backward is ~3 forward-equivalents
            instead of ~4, a quarter less compute; activation memory grows with the number of
            microbatches like standard training; same collectives). The plan's
            ``activation_checkpointing`` decides it in the trainer (docs/planner.md).
        precision: the mixed-precision policy ``EnginePrecision(compute, param, reduce)``
            (autocast, gathered-parameter and reduce-scatter dtypes; ``engine/precision.py``);
            default fp32, no autocast. Master parameters, gradients and optimizer state stay
            fp32 (as stock Trainer's ``bf16=True`` / ``fp16=True``). ``compute=torch.float16``
            needs a loss scaler over every rank's shards: ``make_grad_scaler()``,
            ``train_step(..., loss_scale=scaler)``, ``scaler.unscale_(opt)`` before
            ``clip_grad_norm_``, then ``scaler.step(opt)``, ``scaler.update()``. Kept as
            ``engine.precision``.
        root_resident: False (default): the embedding and head units are gathered around
            their uses (embedding forward, head phase, embedding backward) and resharded in
            between, so their full parameters and gradients are not held all step. True: both
            are gathered once per step and kept with their gradients until its end (one fewer
            all-gather, two fewer with tied embeddings; costs the full root all step). One
            decision for all ranks (the plan's ``root_resident``); see docs/engine.md.
        checkpoint: a safetensors checkpoint (folder, Hub id or ``CheckpointFiles``) to read
            this rank's shards from (``engine/loading.py``); default: the model's
            ``cephalo_checkpoint`` attribute (set by ``hf_cephalo.from_pretrained_sharded``),
            else none.
        init_seed: seed of the per-unit init of a model whose parameters are all on the meta
            device and that has no checkpoint (same weights for any plan and world size).
        compile: None (eager, default) or ``CompileOptions(backend=..., mode=...)``: each layer
            unit's module is compiled with ``nn.Module.compile`` (forward, recompute and
            backward; identical layers share graphs), the compiled call installed only while
            the engine runs the unit, so the model is eager between steps and after training,
            as stock Trainer leaves it ([Note: compiled units]). The first ``train_step`` /
            ``evaluate`` compiles every graph before its first collective and raises on every
            rank if a unit fails (see [Note: compile failures before the first collective] in
            ``compile.py``); ``compile_report()`` gives the compile time and graph counts.

    Start (docs/engine.md "Construction"; [Note: no full model after construction] in
    ``loading.py``): units are built one at a time; this rank's range of each unit comes from
    the checkpoint, from the seeded init (meta model), or from RANK 0's in-memory parameters
    (every rank starts from rank 0's weights, as FSDP's ``sync_module_states``). The model is
    never moved to ``device`` as a whole; afterwards the engine holds no reference to the
    original parameters.

    Raises:
        TypeError: ``compile`` neither None nor ``CompileOptions``; ``precision`` not an
            ``EnginePrecision``.
        ValueError: bad ratios / layout, parameters outside units and root or shared between
            units, mixed dtypes in a unit, an autocast dtype with non-fp32 parameters,
            parameters on a device other than meta / CPU / ``device``,
            meta and materialized parameters mixed without a checkpoint, a checkpoint with a
            missing key, a wrong shape or a truncated file — all before the first collective.
    """

    def __init__(self, staged: StagedModel, state_ratios: Sequence[float] | None = None, *,
                 shard_layout: Sequence[Sequence[int]] | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, offload_activations: bool | None = None,
                 reduce_scatter_fallback: bool = False, activation_checkpointing: bool = True,
                 precision: EnginePrecision = EnginePrecision(), root_resident: bool = False,
                 checkpoint: CheckpointLike | None = None, init_seed: int = 0,
                 compile: CompileOptions | None = None):
        if compile is not None and not isinstance(compile, CompileOptions):
            raise TypeError(f"compile={compile!r}: pass hf_cephalo.engine.CompileOptions("
                            "backend=..., mode=...) or None (eager)")
        _refuse_compiled_side_inputs(staged, compile)
        if not isinstance(precision, EnginePrecision):
            raise TypeError(f"precision={precision!r}: pass hf_cephalo.engine.EnginePrecision("
                            "compute, param, reduce) (default: fp32)")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("CephaloEngine needs an initialized torch.distributed process group "
                             "(call dist.init_process_group first, e.g. via torchrun)")
        self.staged, self.group = staged, process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        ratios = _check_ratios(state_ratios, self.world_size)
        staged.prepare_for_training()
        model = staged.model
        first = next(iter(model.parameters()), None)
        self.device = torch.device(device) if device is not None else \
            (first.device if first is not None and not first.is_meta else torch.device("cpu"))
        del first  # holds no parameter while the units are built
        # no model.to(device): units move one at a time ([Note: no full model after construction])
        if checkpoint is None:
            checkpoint = getattr(model, "cephalo_checkpoint", None)
        source = choose_source(model, checkpoint, seed=init_seed, device=self.device,
                               rank=self.rank, world_size=self.world_size, group=process_group)
        self.start_kind: StartKind = source.kind
        self.offload_activations = (self.device.type == "cuda") if offload_activations is None \
            else bool(offload_activations)
        self.streams = CudaStreams(self.device) if self.device.type == "cuda" else None
        self.activation_checkpointing = bool(activation_checkpointing)
        _check_fp32_master(precision.compute, model)
        self.precision = precision
        if precision.compute is not None:  # every forward call under autocast
            self.staged = AutocastStagedModel(staged, self.device.type, precision.compute)
        self.stats = CollectiveStats()
        self._tracker = LiveTracker(self.stats)
        use_all_reduce = reduce_scatter_fallback or not C.reduce_scatter_supported(process_group)
        self.root_resident = bool(root_resident)
        self._build_units(ratios, shard_layout, use_all_reduce, source)
        self.num_units = len(self.units)
        self.compile = compile
        self._compile_s, self._probe_graphs = 0.0, 0  # the probes' wall seconds and graphs
        # [Note: compiled units] in compile.py: compiled calls installed only while running
        self._compiled = CompiledUnits(self.staged.units(), compile) \
            if compile is not None else None
        # [Note: compile failures before the first collective]: (model.training, for_training)
        # pairs probed (evaluate probes its own graphs: no autograd, frozen parameters)
        self._probed: set[tuple[bool, bool]] = set()
        self._failure: str | None = None  # set when a step raised mid-schedule
        self._failure_exc: BaseException | None = None  # that step's exception
        self._abandoned: list = []  # in-flight collectives of that step, kept referenced
        self._param_shards: ParamShards | None = None  # built on first use (param_shards)

    # ---- construction ---------------------------------------------------------------------
    def _build_units(self, ratios, shard_layout, use_all_reduce, source) -> None:
        """Check everything (layout, coverage, checkpoint), then build the units one at a time:
        each is filled by ``source`` and its module entries become placeholders before the next
        ([Note: no full model after construction] in ``loading.py``); then the buffers."""
        model = self.staged.model
        fqns: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            fqns.setdefault(id(p), []).append(name)
        shapes = param_shapes_beside_meta_buffers(model)  # before placeholders replace them
        groups = [(f"unit {i}", [m]) for i, m in enumerate(self.staged.units())]
        groups += [("embed", list(self.staged.embed_modules())),
                   ("head", list(self.staged.head_modules()))]
        collected = [collect_params(name, mods, fqns) for name, mods in groups]
        # a tied input/output embedding lives once, in the embedding unit
        collected[-2], collected[-1], tied = move_shared_params(collected[-2], collected[-1])
        infos = self._check_coverage(groups, collected, fqns)
        numels = [sum(i.numel for i in unit_infos) for unit_infos in infos]
        layout = _layout(ratios, numels) if shard_layout is None else \
            [[int(n) for n in row] for row in shard_layout]
        _check_layout(layout, [name for name, _ in groups], numels, self.world_size)
        source.check([info for unit_infos in infos for info in unit_infos])
        self._key_map = state_dicts.state_dict_keys(self, fqns)
        flat_units = []
        for (name, modules), row in zip(groups, layout):
            params, uses = collected.pop(0)  # drop each unit's originals once it is built
            flat_units.append(self._build_unit(name, modules, params, uses, fqns, row,
                                               use_all_reduce, source))
            del params, uses
        self.units = flat_units[:-2]
        self.root = RootUnits(flat_units[-2], flat_units[-1], tied, self.root_resident)
        # the training dtype (one for the whole model): that of the trainable parts
        self.dtype = next((u.dtype for u in flat_units if u.trainable_numel), flat_units[-1].dtype)
        place_buffers(model, self.device, source,
                      seed=getattr(source, "seed", 0), param_shapes=shapes)

    def _build_unit(self, name, modules, params, uses, fqns, row, use_all_reduce,
                    source) -> FlatParamUnit:
        unit = FlatParamUnit(name, params, uses, fqns, row, rank=self.rank,
                             world_size=self.world_size, group=self.group, device=self.device,
                             stats=self.stats, tracker=self._tracker, streams=self.streams,
                             use_all_reduce=use_all_reduce, param_dtype=self.precision.param,
                             reduce_dtype=self.precision.reduce)
        source.fill(unit, params, modules)
        return unit  # ``params`` (the originals) die with the caller's reference

    @staticmethod
    def _check_coverage(groups, collected, fqns) -> list[tuple]:
        """Each group's ``ParamInfo``s (from its ``collect_params`` result, a tied weight
        already moved to the embedding unit); ValueError for a parameter in two groups or in
        none."""
        owner: dict[int, str] = {}
        infos = []
        for (name, _), (params, _) in zip(groups, collected):
            for p in params:
                if id(p) in owner:
                    raise ValueError(f"parameter {fqns.get(id(p), ['?'])[0]} is in both "
                                     f"{owner[id(p)]} and {name}; tied weights must live in the "
                                     "embedding or head modules only")
                owner[id(p)] = name
            infos.append(param_infos(name, params, fqns))
        missing = [names[0] for pid, names in fqns.items() if pid not in owner]
        if missing:
            raise ValueError(f"parameters {missing} are in no unit and not in embed_modules() "
                             "or head_modules(); the StagedModel adapter must cover every "
                             "model parameter")
        return infos

    # ---- public API ---------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """This rank's 1-D trainable shards (possibly empty), in ``all_units()`` order."""
        return [u.shard_param for u in self.all_units()]

    def all_units(self) -> list[FlatParamUnit]:
        """Layer units in order, then the embedding unit, then the head unit (the order of
        ``parameters()``, ``shard_metadata()``, ``shard_layout`` rows and checkpoints)."""
        return [*self.units, *self.root.both()]

    def unit_numels(self) -> list[int]:
        """Elements of each unit (``all_units()`` order): what a shard layout row sums to."""
        return [u.numel for u in self.all_units()]

    @property
    def param_shards(self) -> ParamShards:
        """This rank's slice of every trainable parameter as its own 1-D ``nn.Parameter``, a
        view of the unit shards (built on first use; [Note: per-parameter shards] in
        ``param_shards.py``): what an optimizer with the model's parameter groups steps."""
        if self._param_shards is None:
            self._param_shards = ParamShards(self.all_units(), self.rank)
            self._param_shards.bind_grads()
        return self._param_shards

    @property
    def has_param_shards(self) -> bool:
        return self._param_shards is not None

    def _global_items(self, microbatches, for_training: bool) -> tuple[int, int]:
        """(local, global) item count: the first collective of a step or an evaluation. With
        compile on, it also carries each rank's compile-probe result (one int per rank; see
        [Note: compile failures before the first collective] in ``compile.py``)."""
        refused, local = None, 0
        try:
            local = sum(int(self.staged.count_items(mb)) for mb in microbatches)
        except ValueError as exc:  # a microbatch the staged model refuses: agreed below
            refused = exc
        failure = None if refused is not None else self._probe_compile(microbatches,
                                                                        for_training)
        codes = [0] * (self.world_size if self.compile is not None else 0)
        if failure is not None:
            codes[self.rank] = failure.unit_index + 1
        refusals = [0] * self.world_size
        refusals[self.rank] = int(refused is not None)
        t = torch.tensor([local, *refusals, *codes], dtype=torch.int64, device=self.device)
        C.all_reduce_sum(t, self.group, self.stats)
        _raise_refused(refused, t[1:1 + self.world_size].tolist())
        codes_seen = t[1 + self.world_size:].tolist()
        if failure is not None:  # the same message on every rank that failed on this unit
            raise failure.on_ranks(codes_seen)
        remote = remote_failure(codes_seen, self.compile, self.rank,
                                [u.name for u in self.units]) if codes else None
        if remote is not None:
            raise remote
        if microbatches:
            self._probed.add((self.staged.model.training, for_training))
        return local, int(t[0].item())

    def compile_report(self) -> CompileStats:
        """This rank's compile cost and graph counts so far (zeros with compile off): see
        ``CompileStats``; ``recompiles`` stays 0 in a run whose shapes the probe covered, and
        at most 2 more (dynamic shapes) for microbatches of other sizes."""
        graphs = graph_count() - self._compiled.graphs_at_compile \
            if self._compiled is not None else 0
        return CompileStats(graphs=graphs, probe_graphs=self._probe_graphs,
                            compile_s=self._compile_s)

    def _probe_compile(self, microbatches, for_training: bool) -> CompileFailure | None:
        """Compile every unit graph before the step's first collective (once per train / eval
        mode and per train_step / evaluate; ranks without a microbatch skip it); the failure,
        if any, to report through the all-reduce."""
        if self.compile is None or not microbatches or \
                (self.staged.model.training, for_training) in self._probed:
            return None
        try:
            with running(self._compiled):
                seconds, graphs = timed_probe(lambda: probe_compile(
                    self.staged, self.units, self.root.embed, microbatches[0], self.device,
                    self.compile, self.rank, for_training=for_training))
        except CompileFailure as failure:
            return failure
        self._compile_s += seconds
        self._probe_graphs += graphs
        if self.rank == 0:
            print(compile_line(self.compile, "training" if for_training else "evaluation",
                               self.num_units, graphs, seconds), flush=True)
        return None

    def make_grad_scaler(self, **kwargs) -> "CephaloGradScaler":
        """A loss scaler for ``EnginePrecision(compute=torch.float16)``: PyTorch's ``ShardedGradScaler`` on
        this engine's device type and process group (``kwargs``: ``init_scale``,
        ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``enabled``), as
        ``CephaloGradScaler`` so that fused optimizers (``AdamW(fused=True)``) work with it.

        Its ``unscale_(optimizer)`` unscales this rank's 1-D shard gradients and SUM-all-reduces
        the found-inf flag over the group (one all-reduce per rank, also for a rank whose
        shards are all empty), so ``step`` skips the optimizer step on every rank alike; see
        docs/engine.md "Mixed precision" and [Note: found-inf shape for fused optimizers] in
        ``grad_scaler.py``."""
        from .grad_scaler import CephaloGradScaler

        return CephaloGradScaler(device=self.device.type, process_group=self.group, **kwargs)

    def train_step(self, microbatches: Sequence[Mapping[str, torch.Tensor]],
                   loss_scale: Any = None) -> StepOutput:
        """Forward + backward of the layered schedule over this rank's microbatches.

        Every rank must call it (a rank with no samples passes ``[]``). Afterwards each shard's
        ``.grad`` holds the gradient of the GLOBAL item-mean loss, ADDED to any existing
        ``.grad`` (call ``zero_grad`` between optimizer steps).
        loss_scale: None, a number / 1-element tensor, or a loss scaler (anything with
            ``scale(loss)``, e.g. ``make_grad_scaler()``): each microbatch backpropagates
            ``scale(loss_sum / N)``, so the gradients are scaled (unscale them before clipping);
            the returned losses are unscaled.
        Raises ValueError (on every rank, before any all-gather) if the global item count is 0.
        If the schedule raises part-way (e.g. out of memory in one microbatch), the exception
        propagates after a local clean-up (``abandon_step``: memory released, gradients
        dropped) and every later collective call (``train_step``, ``evaluate``,
        ``clip_grad_norm_``, ``full_state_dict``, checkpoint save/load) raises RuntimeError.
        """
        self.check_usable("train_step")
        mbs = list(microbatches)
        local_items, global_items = self._global_items(mbs, for_training=True)
        if global_items == 0:
            raise ValueError("the global batch has no items (no 'labels', every label is -100, or "
                             "no rank has samples); nothing to train on")
        scale_loss = _scale_fn(loss_scale)
        if scale_loss is not None and not mbs:
            # a rank without samples never scales a loss; a GradScaler's scale is created
            # lazily by scale(), and its unscale_/step on this rank need it
            scale_loss(torch.zeros((), device=self.device))
        stash = ActivationStash(self.offload_activations, self.streams, self.stats)
        step = LayeredStep(self.staged, self.units, self.root, mbs, global_items, stash,
                           self.device, keep_graphs=not self.activation_checkpointing,
                           scale_loss=scale_loss, reduce_sums=self._reduce_sums)
        try:
            with global_num_items_scope(global_items):  # [Note: global item count for user losses]
                with running(self._compiled):  # [Note: compiled units] in compile.py
                    step.run()
        except BaseException as exc:
            self.abandon_step(stash, exc, "train_step")
            raise
        assert len(stash) == 0 and not step.kept, "schedule left stashed tensors behind"
        if self._param_shards is not None:
            self._param_shards.bind_grads()
        loss = self._reduce_with_touched(step.local_loss_sum.view(1))
        return StepOutput(float(loss) / global_items + step.extra_loss, global_items,
                          float(step.local_loss_sum), local_items)

    def _reduce_with_touched(self, head: torch.Tensor) -> torch.Tensor:
        """SUM-all-reduce ``head`` (1-D float64) in ONE collective with every unit's ``touched``
        flags, and set each unit's ``unreached``: the trainable parameters no rank has given a
        gradient since ``zero_grad``, which the optimizer keeps as they are ([Note: parameters
        without a gradient]). Returns the reduced ``head``."""
        units = self.all_units()
        flags = [t for unit in units for t in unit.touched]
        vec = torch.cat([head.double(), torch.tensor(flags, dtype=torch.float64,
                                                     device=head.device)])
        C.all_reduce_sum(vec, self.group, self.stats)
        summed = iter(vec[head.numel():].tolist())
        for unit in units:
            unit.unreached[:] = [next(summed) == 0 for _ in unit.touched]
        return vec[:head.numel()]

    def _reduce_sums(self, terms: torch.Tensor) -> torch.Tensor:
        """SUM-all-reduce of a staged model's global-batch loss sums (``LayeredStep``)."""
        C.all_reduce_sum(terms, self.group, self.stats)
        return terms

    def forward_step(self, microbatches: Sequence[Mapping[str, torch.Tensor]], *,
                     with_logits: bool = True) -> "OpenStep":
        """The forward half of a training step whose loss the caller computes (a custom
        loop; [Note: open steps] in ``schedule.py``): the layered forward over this rank's
        microbatches, then the head of each with autograd kept. Every rank must call it (a rank
        with no samples passes ``[]``), then ``backward_step`` with the returned step.

        Returns an ``OpenStep``: per microbatch the logits (as ``StagedModel.head_logits``,
        with their graph; none with ``with_logits=False``) and the adapter's loss sums, and the
        local / global item counts. Raises ValueError (every rank, before any all-gather) if
        the global item count is 0 and a loss is wanted; RuntimeError after an earlier failure.
        """
        self.check_usable("forward_step")
        refuse_global_loss(self.staged, "a step whose loss the caller computes "
                           "(forward_step: a custom loop)")  # before any collective
        mbs = list(microbatches)
        local_items, global_items = self._global_items(mbs, for_training=True)
        stash = ActivationStash(self.offload_activations, self.streams, self.stats)
        step = LayeredStep(self.staged, self.units, self.root, mbs, max(global_items, 1), stash,
                           self.device, keep_graphs=not self.activation_checkpointing)
        try:
            with global_num_items_scope(global_items), running(self._compiled):
                step.forward()
                head = step.open_head(with_logits)
        except BaseException as exc:
            self.abandon_step(stash, exc, "forward_step")
            raise
        return OpenStep(step, stash, head.logits, head.loss_sums, local_items, global_items)

    def backward_step(self, open_step: "OpenStep", loss: torch.Tensor | None) -> bool:
        """The backward half: ``loss`` (this rank's share of the global loss, already
        normalized and loss-scaled; None when the rank contributes nothing) is backpropagated
        through the head, then the layered backward runs and reduce-scatters every unit, as in
        ``train_step``. Every rank must call it once per ``forward_step``. Returns whether the
        loss reached this rank's model outputs (False for a loss computed from something
        else; always True for a rank without samples)."""
        self.check_usable("backward_step")
        step, stash = open_step.step, open_step.stash
        try:
            with global_num_items_scope(open_step.global_items), running(self._compiled):
                reached = step.close_head(loss)
        except BaseException as exc:
            self.abandon_step(stash, exc, "backward_step")
            raise
        assert len(stash) == 0 and not step.kept, "schedule left stashed tensors behind"
        if self._param_shards is not None:
            self._param_shards.bind_grads()
        self._reduce_with_touched(torch.zeros(0, dtype=torch.float64, device=self.device))
        return reached or not step.mbs

    def discard_step(self, open_step: "OpenStep", why: str) -> None:
        """Drop an open step whose backward will not come (every rank at the same point, e.g.
        a loop that stopped after a forward): its buffers are released locally, no collective;
        the engine stays usable only if every rank discards the same step (``why`` is logged
        nowhere: it names the caller's reason in the RuntimeError of a later mismatch)."""
        open_step.stash.clear()
        for unit in self.all_units():
            self._abandoned.extend(unit.abandon())
        open_step.step = None

    def abandon_step(self, stash: ActivationStash | None, exc: BaseException,
                      what: str) -> None:
        """A step (or evaluation) raised on this rank mid-schedule: release its memory and
        refuse further steps.

        The other ranks may be blocked in (or past) a collective this rank never reaches, so
        the ranks' collective sequences can no longer be trusted to match: nothing here
        communicates, and every later collective entry point raises (see ``check_usable``)
        instead of hanging or mixing steps. Gathered buffers, stashed
        activations and every shard gradient (partially reduced: unusable) are dropped; the
        local parameter shards and optimizer state are untouched (the step never changed them).
        """
        if stash is not None:
            stash.clear()
        for unit in self.all_units():
            self._abandoned.extend(unit.abandon())
        # The type only, not the message: a refusal that repeated an out-of-memory text would
        # look like a fresh OOM to Accelerate's should_reduce_batch_size (auto_find_batch_size
        # would retry forever); the original exception is chained as the refusal's __cause__.
        self._failure = f"an earlier {what} raised mid-schedule ({type(exc).__name__})"
        self._failure_exc = exc

    def check_usable(self, what: str) -> None:
        """Raise RuntimeError if an earlier ``train_step`` / ``evaluate`` raised part-way.

        Called before every collective entry point (steps, evaluation, clipping, full state
        dicts, checkpoint save/load): after a one-rank failure the ranks' collective sequences
        no longer match, so any further collective could hang or pair the wrong tensors.
        """
        if self._failure is not None:
            raise RuntimeError(
                f"{what} refused on rank {self.rank}: {self._failure}; the ranks' collectives "
                "may be out of step and that step's gradients were dropped. Fix the cause (the "
                "chained exception above), then restart the processes and resume from the last "
                "complete checkpoint") from getattr(self, "_failure_exc", None)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip shard grads by the GLOBAL L2 norm (one all-reduce of squared sums); return it.

        Same formula as ``torch.nn.utils.clip_grad_norm_``: scale = min(1, max_norm/(norm+1e-6)).
        """
        self.check_usable("clip_grad_norm_")
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in self.parameters():
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum()
        C.all_reduce_sum(sq, self.group, self.stats)
        norm = sq.sqrt().to(self.dtype).reshape(())  # 0-dim, training dtype
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    def zero_grad(self) -> None:
        """Drop every shard's gradient (set to None), per-parameter shards' included, and
        forget which parameters received one ([Note: parameters without a gradient])."""
        for p in self.parameters():
            p.grad = None
        for unit in self.all_units():
            unit.touched[:] = unit.unreached[:] = [False] * len(unit.touched)
        if self._param_shards is not None:
            self._param_shards.drop_grads()

    def evaluate(self, microbatches, *, return_logits: bool = True,
                 process_logits: Callable[[torch.Tensor, Mapping], Any] | None = None
                 ) -> EvalOutput:
        """Layered forward only, no gradients (``evaluation.evaluate``)."""
        return evaluation.evaluate(self, microbatches, return_logits=return_logits,
                                   process_logits=process_logits)

    def generate(self, prompt_ids, rows, params, round_: int, *, mode: str = "auto",
                 memory_budget_bytes: int | None = None, pad_to_multiple_of: int | None = None,
                 generation_config=None):
        """Collective: decode this rank's prompts with the model's own ``generate`` over the
        sharded weights (``generation.engine_generate``; [Note: two decode modes]).

        Args:
            prompt_ids: this rank's B prompts as token-id lists (B may be 0).
            rows: (B,) each prompt's global row index, the key of its sampling ([Note: keyed
                sampling] in ``sampling.py``). params: ``SamplingParams``.
            round_: the generation round (part of the key). mode: ``"auto"`` (gather once when
                every rank's ``memory_budget_bytes`` holds the full weights plus its KV cache,
                else sharded), ``"gather_once"`` or ``"sharded"``.
            memory_budget_bytes: bytes this rank may add for the call (None: no limit).
            generation_config: a ``GenerationConfig`` whose logits processors run before the
                sampler (``generation.generate_rows``); None: the model's own.

        Returns:
            ``GenerateOutput(completions, truncated, mode, steps, decoder_start)``.

        Raises:
            ValueError: mismatched rows, an empty prompt, an unknown mode, a budget that holds
                neither mode (after one all-reduce, on every rank, before any gather).
        """
        return generation.engine_generate(self, prompt_ids, rows, params, round_, mode=mode,
                                          memory_budget_bytes=memory_budget_bytes,
                                          pad_to_multiple_of=pad_to_multiple_of,
                                          generation_config=generation_config)

    def iter_full_units(self, order: Sequence[int] | None = None) -> Iterator[FullUnit]:
        """Collective generator, one unit per step (``state_dicts.iter_full_units``)."""
        return state_dicts.iter_full_units(self, order)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full state dict on rank 0 (``state_dicts.full_state_dict``)."""
        return state_dicts.full_state_dict(self)

    def trainable_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the trainable parameters on rank 0 (``state_dicts.trainable_state_dict``)."""
        return state_dicts.trainable_state_dict(self)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Every rank takes its shards of a full dict (``state_dicts.load_full_state_dict``)."""
        return state_dicts.load_full_state_dict(self, state_dict)

    def shard_metadata(self) -> list[UnitShardMeta]:
        """Per unit (layers in order, then the embedding and the head unit): per-rank numel and
        parameter fqns/offsets."""
        return [u.meta() for u in self.all_units()]


def _raise_refused(refused: ValueError | None, flags: list[int]) -> None:
    """After a step's first all-reduce: a rank whose microbatch its staged model refused
    (``count_items`` raised ValueError, e.g. an image batch for a text-only staging) raises
    its own error, every other rank one naming it, so no rank goes on into a collective the
    refusing rank never reaches. Nothing to do when no rank refused."""
    if refused is not None:
        raise refused
    ranks = [r for r, flag in enumerate(flags) if flag]
    if ranks:
        raise ValueError(f"the microbatches of rank(s) {ranks} were refused by the staged model "
                         "(their error says why and what to do); nothing ran on any rank")


def _refuse_compiled_side_inputs(staged: StagedModel, compile: CompileOptions | None) -> None:
    """ValueError (before any collective) for ``compile`` with a model whose units make side
    inputs (an encoder-decoder: models/seq2seq.py; a layer storing keys / values later layers
    reuse: models/kv_sharing.py): the compile probe runs each unit alone on the embedding's
    output, which such a unit does not take."""
    if compile is None:
        return
    making = [i for i in range(staged.num_units) if staged.produces_side_inputs(i)]
    if making:
        raise ValueError(f"compile={compile}: units {making} of {type(staged.model).__name__} "
                         "make side inputs later units read (an encoder-decoder, or layers "
                         "storing keys / values later layers reuse: KV sharing), which "
                         "hf_cephalo does not compile yet; train it without compile")
