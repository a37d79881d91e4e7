"""One unit's parameters as two flat parts (trainable, frozen), each sharded across ranks.

``FlatParamUnit`` holds a unit's shards, gathers and reshards them, owns the unit's one flat
gradient and its reduce-scatter; ``split_unit_row`` cuts a layout row into the two parts. The
invariants are the Notes below; the why and the measurements: docs/engine.md, "Flat parameters
and shards" and the sections after it.
"""

# [Note: flat unit layout]
# The unit's distinct parameters (tied weights once) are flattened in one fixed order, trainable
# parameters first, then frozen ones (``requires_grad=False``). That order is the unit's flat
# INDEX, shared by ``ParamInfo.offset``, checkpoints and the layout row, so every rank and every
# saved file agree on which element is which::
#
#     flat index (N,) = [ trainable params ... (Nt) | frozen params ... (N - Nt) ]
#
# but the storage is two parts (``UnitPart``), each one dtype: see [Note: two parts per unit].

# [Note: two parts per unit]
# The trainable part (Nt elements, the training dtype) and the frozen part (N - Nt elements,
# stored in their own dtype: a bf16 LoRA base stays bf16) are two flat buffers, and EACH is
# sharded by the unit's layout row: ``split_unit_row`` cuts rank r's ``n_r`` into ``k_r``
# trainable and ``f_r = n_r - k_r`` frozen elements (largest remainder in integer arithmetic, so
# every rank computes the same split). So every rank holds r_i of the adapters AND r_i of the
# base. The trainable shard (``self.trainable.local``) IS the optimizer's ``shard_param``: frozen
# elements never get a gradient or optimizer state. Every rank issues the same collectives,
# decided from Nt and N, never from its own shard sizes: one all-gather per NON-EMPTY part, and
# a reduce-scatter of the trainable part only ([Note: uneven collectives] in ``collectives.py``).
# Why two parts: docs/engine.md, "Two parts per unit".

# [Note: parameter views while unsharded]
# While a unit is gathered, each trainable parameter is its own autograd leaf that ALIASES its
# slice of the gathered trainable part (``ParamLeaves``; tied uses share the leaf), installed in
# every module entry that uses it (``use_params`` re-points them before every forward call).
# Before the unit's FIRST backward in a step (not at the gather: the timeline planner/memory.py
# [Note: memory terms] prices) ``prepare_grad`` allocates ONE zero-filled (Nt,) gradient and
# presets each leaf's ``.grad`` to its view of it, so autograd adds every microbatch's gradients
# in place: a backward allocates no unit-sized tensor and concatenates nothing, and the flat
# gradient is the reduce-scatter's input as it is. The flat gradient belongs to the unit, not to
# the leaves; on reshard the entries become empty placeholders. How AccumulateGrad does it, and
# the schemes this replaced: docs/engine.md, "Parameter views while unsharded".

# [Note: kept graphs across reshard]
# With activation checkpointing off, every microbatch's forward graph is kept until backward, and
# those graphs save the parameter leaves, which alias the gathered buffer. Resharding then frees
# only the buffer's storage (``untyped_storage().resize_(0)``, shared by the leaves) and keeps the
# tensor objects (FSDP2 frees its unsharded parameters the same way); the backward all-gather
# resizes the storage back and copies the data in through ``.data`` so the version counter that
# autograd checks for the saved leaves (detached aliases share the buffer's counter) does not
# change. The leaves stay the same objects, so their gradients still go into the unit's one flat
# gradient.

# [Note: communication buffers]
# Beyond the shard, the gathered buffer and the gradient, one unit's collectives allocate only:
# the all-gather's (N,) output (one per non-empty part) from its issue (the prefetch) to
# ``wait_unshard``, after which it IS the gathered buffer (the send buffer is the local shard
# itself, or its cast copy with a low-precision ``param_dtype``); the reduce-scatter's (k_r,)
# output from issue to wait, after which it becomes or is added into ``shard_param.grad``; and
# on a rank without a gradient a (Nt,) zero input. Nothing is padded. ``LiveTracker.comm_bytes``
# counts exactly these (peak: ``CollectiveStats.peak_comm_buffer_bytes``) and planner/memory.py
# prices them the same way. Each case (kept graphs, the all-reduce fallback, ``gather_full``):
# docs/engine.md, "Communication buffers".

# [Note: low-precision gathered parameters]
# FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``, one policy for all ranks. The
# master shard (``local``) and the optimizer state stay in the training dtype (fp32); each
# all-gather sends the shard cast to ``param_dtype``, so the gathered buffer, the wire and the
# leaves are low precision. The unit's flat gradient stays an fp32 (Nt,) accumulator (summing l
# microbatches in bf16 / fp16 would round the running sum l - 1 times): a post-accumulate-grad
# hook per leaf adds its low-precision gradient, upcast, into its view of the accumulator and
# drops it, so no unit-sized low-precision tensor exists. The reduce-scatter sends the
# accumulator cast to ``reduce_dtype`` and its result is upcast into the fp32 shard gradient;
# ``gather_full`` (saving, export) gathers the fp32 master shards. Alternatives considered:
# docs/engine.md, "Low-precision gathered parameters".

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from . import collectives as C
from .stats import CollectiveStats


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


@dataclass(frozen=True)
class ParamInfo:
    """One distinct parameter inside a unit's flat buffer.

    fqn: the model's parameter name (first one for tied weights); aliases: every name it has.
    offset, numel: element range in the unit's flat index ``[trainable | frozen]``; shape: its
    shape.
    """

    fqn: str
    aliases: tuple[str, ...]
    shape: torch.Size
    offset: int
    numel: int
    requires_grad: bool


@dataclass(frozen=True)
class UnitShardMeta:
    """Sharding of one unit (for sharded checkpoints).

    numel_per_rank: the layout row, elements of the unit each rank owns (rank order; sum =
    numel; split into the two parts by ``split_unit_row``); trainable_numel: the first
    ``trainable_numel`` elements of the flat index are trainable; params: layout.
    """

    name: str
    numel: int
    trainable_numel: int
    numel_per_rank: tuple[int, ...]
    params: tuple[ParamInfo, ...]


class LiveTracker:
    """Accounting of unsharded parameter / gradient elements and communication-buffer bytes
    alive (feeds ``CollectiveStats``; see [Note: communication buffers])."""

    def __init__(self, stats: CollectiveStats):
        self.stats = stats
        self.param_numel = 0
        self.grad_numel = 0
        self.comm_bytes = 0

    def add_comm(self, nbytes: int) -> None:
        """Account ``nbytes`` of communication buffers (negative: released)."""
        self.comm_bytes += nbytes
        self.stats.peak_comm_buffer_bytes = max(self.stats.peak_comm_buffer_bytes,
                                                self.comm_bytes)

    def add_params(self, numel: int) -> None:
        self.param_numel += numel
        self.stats.peak_unsharded_numel = max(self.stats.peak_unsharded_numel, self.param_numel)

    def add_grad(self, numel: int) -> None:
        self.grad_numel += numel
        self.stats.peak_unsharded_grad_numel = max(self.stats.peak_unsharded_grad_numel,
                                                   self.grad_numel)


def collect_params(name: str, modules: Sequence[nn.Module], fqns: dict[int, list[str]]):
    """Distinct parameters of ``modules`` (trainable first) and every (module, attr) use of each.

    Raises ValueError for mixed dtypes among the trainable (or among the frozen) parameters,
    or non-floating ones (one flat buffer per part: [Note: two parts per unit]).
    """
    order: list[nn.Parameter] = []
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in modules:
        for sub in module.modules():
            for attr, p in sub._parameters.items():
                if p is None:
                    continue
                if id(p) not in uses:
                    order.append(p)
                    uses[id(p)] = []
                if (sub, attr) not in uses[id(p)]:
                    uses[id(p)].append((sub, attr))
    for part, group in (("trainable", [p for p in order if p.requires_grad]),
                        ("frozen", [p for p in order if not p.requires_grad])):
        dtypes = sorted({str(p.dtype) for p in group})
        if len(dtypes) > 1:
            raise ValueError(f"unit {name!r} mixes parameter dtypes {dtypes} among its {part} "
                             f"parameters; the engine keeps one flat buffer per part of a unit "
                             f"(trainable, frozen): cast "
                             f"the {part} parameters to one dtype (e.g. model.float() before "
                             "get_peft_model; a bf16 frozen base beside fp32 adapters is fine)")
        if group and not group[0].dtype.is_floating_point:
            raise ValueError(f"unit {name!r} has non-floating parameters ({dtypes[0]}, e.g. "
                             "quantized weights); load the model in a floating dtype (float32 "
                             "or bfloat16, not quantized)")
    order.sort(key=lambda p: not p.requires_grad)  # stable: trainable first
    return order, uses


def move_shared_params(owner, other) -> tuple[tuple, tuple, bool]:
    """Give ``owner`` every parameter that both ``collect_params`` results hold (tied weights
    shared by the embedding and the head), with the uses ``other`` had of it.

    Returns ``(owner', other', shared)``: ``other'`` keeps only its own parameters; shared is
    True if any parameter moved (the head then needs the embedding unit gathered too).
    """
    owner_params, owner_uses = owner
    other_params, other_uses = other
    mine = {id(p) for p in owner_params}
    uses = {k: list(v) for k, v in owner_uses.items()}
    shared = False
    for p in other_params:
        if id(p) in mine:
            shared = True
            uses[id(p)] += [u for u in other_uses[id(p)] if u not in uses[id(p)]]
    rest = [p for p in other_params if id(p) not in mine]
    return (owner_params, uses), (rest, {id(p): other_uses[id(p)] for p in rest}), shared


def param_infos(name: str, params: Sequence[nn.Parameter],
                fqns: dict[int, list[str]]) -> tuple[ParamInfo, ...]:
    """Each parameter's place in the unit's flat buffer, in ``params`` order (from
    ``collect_params``: trainable first); unnamed parameters are called ``<name>.<unnamed>``."""
    infos, offset = [], 0
    for p in params:
        names = tuple(fqns.get(id(p), [f"{name}.<unnamed>"]))
        infos.append(ParamInfo(names[0], names, p.shape, offset, p.numel(), p.requires_grad))
        offset += p.numel()
    return tuple(infos)


def install_param_views(infos: Sequence[ParamInfo], uses: Sequence[list[tuple[nn.Module, str]]],
                        leaves: Sequence[torch.Tensor], frozen: torch.Tensor) -> None:
    """Point every module parameter entry at its parameter in the gathered unit.

    ``leaves``: one tensor per trainable parameter (``infos`` order, each of its shape), the
    unit's ``ParamLeaves.leaves``; ``frozen``: (N - Nt,) the detached frozen part, split into
    views; ``infos`` in flat order (trainable first, as ``param_infos`` gives them).
    ``uses[k]`` lists the (module, attribute) entries of ``infos[k]``. See [Note: parameter
    views while unsharded]; the profiler times units through this too.
    """
    trainable = [i for i in infos if i.requires_grad]
    assert len(leaves) == len(trainable) and all(
        i.requires_grad == (k < len(trainable)) for k, i in enumerate(infos)), \
        "trainable parameters must come first in the flat buffer"  # collect_params sorts so
    pieces = [*leaves, *torch.split(frozen, [i.numel for i in infos if not i.requires_grad])]
    for info, entries, piece in zip(infos, uses, pieces):  # same order: trainable first
        view = piece.view(info.shape)
        for module, attr in entries:
            module._parameters[attr] = view


class _FlatGrad:
    """The flat gradient the low-precision hooks add into. Kept apart from ``ParamLeaves`` so
    that a hook (owned by its leaf) refers to no leaf: a leaf -> hook -> leaves cycle would
    keep every gathered unit alive until Python's cycle collector runs."""

    def __init__(self):
        self.grad: torch.Tensor | None = None

    def add(self, info: ParamInfo, leaf: torch.Tensor) -> None:
        assert self.grad is not None, "backward through a unit without prepare_grad"
        grad, leaf.grad = leaf.grad, None
        self.grad[info.offset:info.offset + info.numel].view(info.shape).add_(grad)


class ParamLeaves:
    """The trainable parameters of a gathered unit as autograd leaves aliasing the gathered
    (Nt,) trainable part, and the flat gradient they accumulate into; see [Note: parameter
    views while unsharded].

    Args:
        infos: the unit's ``ParamInfo`` (flat order, trainable first; frozen ones are skipped).
        trainable: (Nt,) the gathered trainable part, in the gathered dtype; not copied.
        requires_grad: leaves that require grad (training) or not (evaluation, init).
    ``leaves[k]`` has the k-th trainable parameter's shape and shares ``trainable``'s storage
    (and version counter). No gradient until ``accumulate_into``.
    """

    def __init__(self, infos: Sequence[ParamInfo], trainable: torch.Tensor, requires_grad: bool,
                 touched: list[bool] | None = None):
        self.infos = [i for i in infos if i.requires_grad]
        flat = trainable.detach()
        self.leaves = [flat[i.offset:i.offset + i.numel].view(i.shape).detach()
                       .requires_grad_(requires_grad) for i in self.infos]
        self.requires_grad = requires_grad and trainable.numel() > 0
        if self.requires_grad and touched is not None:  # [Note: parameters without a gradient]
            for k, leaf in enumerate(self.leaves):
                leaf.register_post_accumulate_grad_hook(functools.partial(_mark, touched, k))
        self.dtype = trainable.dtype
        self._target = _FlatGrad()
        self._hooked = False

    @property
    def grad(self) -> torch.Tensor | None:
        """(Nt,) the flat gradient the leaves accumulate into (None before ``accumulate_into``
        and after ``release_grad``)."""
        return self._target.grad

    def accumulate_into(self, grad: torch.Tensor) -> None:
        """Make every later backward ADD the parameters' gradients into ``grad`` (Nt,).

        Same dtype as the leaves: each leaf's ``.grad`` becomes its view of ``grad`` (autograd
        adds in place). Another dtype (fp32 beside low-precision leaves): a post-accumulate hook
        per leaf adds each gradient into its view and drops it ([Note: low-precision gathered
        parameters])."""
        self._target.grad = grad
        if grad.dtype == self.dtype:
            for info, leaf in zip(self.infos, self.leaves):
                leaf.grad = grad[info.offset:info.offset + info.numel].view(info.shape)
        elif not self._hooked:
            for info, leaf in zip(self.infos, self.leaves):
                leaf.register_post_accumulate_grad_hook(
                    functools.partial(self._target.add, info))
            self._hooked = True

    def release_grad(self) -> None:
        """Detach the leaves from the flat gradient (its owner keeps it)."""
        for leaf in self.leaves:
            # a gradient outside the flat buffer would be lost: a backward ran without
            # accumulate_into (FlatParamUnit.prepare_grad)
            assert leaf.grad is None or (self.grad is not None and
                                         leaf.grad._base is self.grad), "unprepared backward"
            leaf.grad = None
        self._target.grad = None


def _mark(touched: list[bool], k: int, _leaf: torch.Tensor) -> None:
    touched[k] = True


def split_unit_row(row: Sequence[int], trainable_numel: int) -> tuple[list[int], list[int]]:
    """Split a unit's layout row (n_r, rank order) into per-rank trainable and frozen counts.

    ``k_r`` is ``Nt·n_r / N`` rounded by largest remainder (ties to the lower rank), integer
    arithmetic only, so every rank computes the same split; ``f_r = n_r - k_r``. Both parts are
    then cut in the proportions of the row, i.e. by the state ratios: see [Note: two parts per
    unit]. Never negative (``k_r <= n_r`` whenever the unit has frozen elements); a rank with
    ``n_r = 0`` gets nothing of either part. Example: row (3, 1), Nt = 2: quotas 1.5 and 0.5,
    the tie goes to rank 0 -> ``([2, 0], [1, 1])``.
    """
    row = [int(n) for n in row]
    numel, nt = sum(row), int(trainable_numel)
    if nt == numel or numel == 0:
        return list(row), [0] * len(row)
    quota = [nt * n // numel for n in row]
    rest = [nt * n % numel for n in row]
    for r in sorted(range(len(row)), key=lambda r: (-rest[r], r))[:nt - sum(quota)]:
        quota[r] += 1
    return quota, [n - k for n, k in zip(row, quota)]


class UnitPart:
    """One dtype-homogeneous part of a unit (its trainable or its frozen parameters), sharded
    by its own per-rank counts; see [Note: two parts per unit].

    offset: first element of the part in the unit's flat index ``[trainable | frozen]``;
    numel: its elements; dtype: its storage dtype; numel_per_rank: (W,) elements per rank;
    starts: (W,) each rank's first element within the part; local: (numel_per_rank[rank],) this
    rank's shard (zeros until the weight source fills it).
    """

    def __init__(self, offset: int, numel: int, dtype: torch.dtype, numel_per_rank, rank: int,
                 device):
        self.offset, self.numel, self.dtype = offset, numel, dtype
        self.numel_per_rank = [int(n) for n in numel_per_rank]
        self.starts = [sum(self.numel_per_rank[:r]) for r in range(len(self.numel_per_rank))]
        self.rank = rank
        self.local = torch.zeros(self.numel_per_rank[rank], dtype=dtype, device=device)

    def flat_range(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of ``rank``'s shard of this part in the unit's flat index."""
        lo = self.offset + self.starts[rank]
        return lo, lo + self.numel_per_rank[rank]

    def adopt(self, numel_per_rank: Sequence[int], local: torch.Tensor) -> None:
        """Take a new per-rank split and this rank's (numel_per_rank[rank],) shard under it
        (``engine/relayout.py`` moved the elements)."""
        self.numel_per_rank = [int(n) for n in numel_per_rank]
        self.starts = [sum(self.numel_per_rank[:r]) for r in range(len(self.numel_per_rank))]
        assert local.numel() == self.numel_per_rank[self.rank] and local.dtype == self.dtype
        self.local = local

    @property
    def element_size(self) -> int:
        return self.local.element_size()


class FlatParamUnit:
    """A unit's parameters as two flat parts (trainable, frozen), this rank's shard of each,
    and the unshard/reshard lifecycle.

    Args:
        name: unit name for messages ("unit 3", "root").
        params, uses: from ``collect_params``; fqns: id(param) -> model parameter names.
        numel_per_rank: (world_size,) this unit's layout row: elements each rank holds, summing
            to the unit's numel (checked by the engine, ``engine._check_layout``); split into
            the two parts by ``split_unit_row`` ([Note: two parts per unit]).
        rank, world_size, group, device: process group placement.
        stats, tracker: shared counters.
        streams: ``offload.CudaStreams`` on CUDA, else None (synchronous collectives' waits).
        param_dtype: dtype of the gathered trainable parameters (None: the training dtype);
            reduce_dtype: dtype of the gradient reduce-scatter (None: the training dtype). See
            [Note: low-precision gathered parameters]; the engine validates both.
    The shards start as zeros: the engine fills them from its weight source (``loading.py``:
    rank 0's in-memory values, a checkpoint's slices or a seeded init) right after construction.
    The unit keeps no reference to ``params`` (see [Note: no full model after construction] in
    ``loading.py``): only their layout (``infos``) and the module entries that use them.
    """

    def __init__(self, name, params, uses, fqns, numel_per_rank, *, rank, world_size, group,
                 device, stats, tracker, streams=None, use_all_reduce=False, param_dtype=None,
                 reduce_dtype=None):
        self.name = name
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device, self.stats, self.tracker, self.streams = device, stats, tracker, streams
        self.use_all_reduce = use_all_reduce
        # per distinct parameter (``infos`` order): every (module, attribute) entry that uses it
        self.uses = [uses[id(p)] for p in params]
        self.infos = param_infos(name, params, fqns)
        self.numel = sum(i.numel for i in self.infos)
        self.trainable_numel = sum(i.numel for i in self.infos if i.requires_grad)
        t_dtypes = [p.dtype for p in params if p.requires_grad]
        f_dtypes = [p.dtype for p in params if not p.requires_grad]
        self.dtype = (t_dtypes or f_dtypes or [torch.float32])[0]  # the training dtype
        self.frozen_dtype = (f_dtypes or [self.dtype])[0]
        self.param_dtype = param_dtype or self.dtype  # gathered (all-gather) dtype
        self.reduce_dtype = reduce_dtype or self.dtype  # reduce-scatter dtype
        self.low_precision = self.param_dtype != self.dtype
        self.numel_per_rank = [int(n) for n in numel_per_rank]
        assert len(self.numel_per_rank) == world_size and sum(self.numel_per_rank) == self.numel \
            and min(self.numel_per_rank) >= 0, (name, self.numel_per_rank, self.numel)
        # [Note: two parts per unit]: (W,) trainable / frozen elements per rank
        self.trainable_per_rank, self.frozen_per_rank = split_unit_row(self.numel_per_rank,
                                                                       self.trainable_numel)
        self.trainable = UnitPart(0, self.trainable_numel, self.dtype, self.trainable_per_rank,
                                  rank, device)
        self.frozen = UnitPart(self.trainable_numel, self.numel - self.trainable_numel,
                               self.frozen_dtype, self.frozen_per_rank, rank, device)
        self.local_numel = self.numel_per_rank[rank]
        self.local_trainable_numel = self.trainable_per_rank[rank]
        # the trainable shard IS the optimizer's parameter: the training state is r_i of the model
        self.shard_param = nn.Parameter(self.trainable.local)
        self.touched = [False] * sum(1 for i in self.infos if i.requires_grad)
        """Per trainable parameter (flat order): whether a backward on this rank accumulated a
        gradient into it since ``zero_grad`` ([Note: parameters without a gradient])."""
        self.unreached = [False] * len(self.touched)
        """Per trainable parameter (flat order): no rank's backward reached it since
        ``zero_grad`` (the ranks' ``touched`` summed at each step's end by the engine)."""
        self.state = ShardedState.SHARDED
        self._pending_ag: list[C.AllGatherResult] | None = None  # one per non-empty part
        self._full: list[torch.Tensor] | None = None  # gathered [(Nt,), (N - Nt,)]
        self._pending_rs: C.ReduceScatterResult | None = None
        self._leaves: ParamLeaves | None = None  # the trainable parameters while gathered
        self._retired: list[ParamLeaves] = []  # earlier leaves of this gather (use_fresh_leaves)
        self._grad_live = False
        self._grad: torch.Tensor | None = None  # (Nt,) training dtype: the unit's flat gradient
        self._rs_input: torch.Tensor | None = None  # kept alive until the reduce-scatter is done
        self._comm_bytes = {"ag": 0, "rs": 0}  # see [Note: communication buffers]
        self._freed_nbytes: list[int] | None = None  # set while resharded with kept graphs
        self.set_placeholders()

    @property
    def at_rest(self) -> bool:
        """SHARDED with no collective in flight and no gradient being accumulated: a step
        boundary, where the layout may change (``relayout.py``)."""
        return self.state is ShardedState.SHARDED and self._pending_ag is None and \
            self._pending_rs is None and not self._grad_live

    # ---- construction ---------------------------------------------------------------------
    def adopt_layout(self, numel_per_rank: Sequence[int], trainable: torch.Tensor,
                     frozen: torch.Tensor) -> None:
        """Switch to a new layout row (re-layout at a step boundary, ``engine/relayout.py``).

        numel_per_rank: (W,) the new row (sum = numel); trainable / frozen: this rank's new
        shards of the two parts under it, (k_rank,) and (f_rank,) of ``split_unit_row``. The
        optimizer's parameter stays the same object (``shard_param.data`` becomes the new
        trainable shard), so optimizer param groups, LR schedulers and state keys stay valid.
        Only while SHARDED with no collective in flight and no live gradient.
        """
        assert self.at_rest, f"{self.name} re-laid mid-step"
        row = [int(n) for n in numel_per_rank]
        assert len(row) == self.world_size and sum(row) == self.numel and min(row) >= 0, row
        self.numel_per_rank = row
        self.trainable_per_rank, self.frozen_per_rank = split_unit_row(row, self.trainable_numel)
        self.trainable.adopt(self.trainable_per_rank, trainable)
        self.frozen.adopt(self.frozen_per_rank, frozen)
        self.local_numel = row[self.rank]
        self.local_trainable_numel = self.trainable_per_rank[self.rank]
        self.shard_param.data = trainable  # same Parameter object, the new shard's storage

    @property
    def parts(self) -> tuple[UnitPart, UnitPart]:
        """(trainable, frozen), in flat-index order (either may be empty)."""
        return self.trainable, self.frozen

    def local_segments(self) -> list[tuple[int, int, torch.Tensor]]:
        """This rank's non-empty shards as ``(lo, hi, local)``: flat-index range [lo, hi) of the
        unit's ``[trainable | frozen]`` index and the (hi - lo,) tensor holding it."""
        return [(*part.flat_range(self.rank), part.local) for part in self.parts
                if part.local.numel()]

    def load_flat(self, flat: Sequence[torch.Tensor]) -> None:
        """Take this rank's shards from the full parts ``(trainable (Nt,), frozen (N - Nt,))``
        (any device; cast to each part's dtype)."""
        with torch.no_grad():
            for part, full in zip(self.parts, flat):
                start = part.starts[self.rank]
                part.local.copy_(full[start:start + part.local.numel()])

    def flat_from_tensors(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The full parts ``(trainable (Nt,), frozen (N - Nt,))`` (CPU, each in its part's
        dtype) from full tensors in ``self.infos`` order, shapes checked (ValueError)."""
        pieces: tuple[list, list] = ([], [])
        for info, t in zip(self.infos, tensors):
            if tuple(t.shape) != tuple(info.shape):
                raise ValueError(f"{info.fqn}: shape {tuple(t.shape)} does not match the model's "
                                 f"{tuple(info.shape)}; pass the weights of a model with this "
                                 "model's config")
            part = self.trainable if info.requires_grad else self.frozen
            pieces[part is self.frozen].append(t.detach().reshape(-1).to("cpu", part.dtype))
        return tuple(torch.cat(p) if p else torch.zeros(0, dtype=part.dtype)
                     for p, part in zip(pieces, self.parts))

    def param_views(self, full: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter (``infos`` order) as a view of the full parts ``(trainable, frozen)``."""
        out = []
        for info in self.infos:
            part, flat = (self.trainable, full[0]) if info.requires_grad else \
                (self.frozen, full[1])
            lo = info.offset - part.offset
            out.append(flat[lo:lo + info.numel].view(info.shape))
        return out

    # ---- unshard / reshard ----------------------------------------------------------------
    def _gathered_parts(self) -> list[UnitPart]:
        """The parts every rank all-gathers: the non-empty ones (rank-identical: from the
        unit's sizes, never from a rank's own shard)."""
        return [part for part in self.parts if part.numel]

    def gather_dtype(self, part: UnitPart) -> torch.dtype:
        """Dtype a part travels and is gathered in: ``param_dtype`` for a part stored in the
        training dtype, else its storage dtype (a bf16 frozen base is gathered as stored)."""
        return self.param_dtype if part.dtype == self.dtype else part.dtype

    def start_unshard(self) -> None:
        """Issue the async all-gather of each non-empty part (no-op if already unsharded or in
        flight)."""
        if self.state is ShardedState.UNSHARDED or self._pending_ag is not None:
            return
        results, comm_bytes = [], 0
        for part in self._gathered_parts():
            if self.streams is not None:
                results.append(self.streams.all_gather(self, part))
            else:
                results.append(C.all_gather_shards(self.send_buffer(part), part.numel_per_rank,
                                                   self.rank, self.group, self.stats,
                                                   async_op=True))
            es = torch.empty(0, dtype=self.gather_dtype(part)).element_size()
            cast = part.local.numel() * es if self.gather_dtype(part) != part.dtype else 0
            comm_bytes += part.numel * es + cast
        self._pending_ag = results
        self._set_comm("ag", comm_bytes)

    @property
    def param_element_size(self) -> int:
        """Bytes per element of the gathered trainable buffer (``param_dtype``)."""
        return torch.empty(0, dtype=self.param_dtype).element_size()

    def send_buffer(self, part: UnitPart) -> torch.Tensor:
        """(n_r,) what this rank's all-gather of ``part`` sends: the shard itself, or its
        ``param_dtype`` copy ([Note: low-precision gathered parameters])."""
        dtype = self.gather_dtype(part)
        return part.local.to(dtype) if dtype != part.dtype else part.local

    def _set_comm(self, key: str, nbytes: int) -> None:
        """Account this unit's in-flight ``key`` buffers (see [Note: communication buffers])."""
        self.tracker.add_comm(nbytes - self._comm_bytes[key])
        self._comm_bytes[key] = nbytes

    def wait_unshard(self, requires_grad: bool) -> None:
        """Wait for the all-gathers; their outputs become the gathered parts; install views."""
        if self.state is ShardedState.UNSHARDED:
            return
        self.start_unshard()
        results, self._pending_ag = self._pending_ag, None
        for result in results:
            if self.streams is not None:
                self.streams.wait_all_gather(result)
            elif result.work is not None:
                result.work.wait()
        self._set_comm("ag", 0)
        self.tracker.add_params(self.numel)
        self.state = ShardedState.UNSHARDED
        outputs = iter(r.output for r in results)
        gathered = [next(outputs) if part.numel else
                    torch.empty(0, dtype=self.gather_dtype(part), device=self.device)
                    for part in self.parts]
        if self._freed_nbytes is not None:  # see [Note: kept graphs across reshard]
            for kept, nbytes, new in zip(self._full, self._freed_nbytes, gathered):
                kept.untyped_storage().resize_(nbytes)
                kept.data.copy_(new)  # .data: no version bump
            self._freed_nbytes = None
            return
        self._full = gathered
        self._leaves = ParamLeaves(self.infos, self._full[0], requires_grad, self.touched)
        if self._grad is not None and self._leaves.requires_grad:  # not reduced yet: keep adding
            self._leaves.accumulate_into(self._grad)
        self.use_params()

    def use_fresh_leaves(self) -> None:
        """New parameter leaves over the gathered unit, accumulating into its flat gradient
        (prepared now), for the next forward call. A custom loop's head runs every
        microbatch before ONE backward ([Note: open steps] in schedule.py); through shared
        leaves autograd would sum the microbatches' gradients in the leaves' dtype (bf16)
        before the fp32 accumulator sees them, against [Note: low-precision gathered
        parameters]; one set of leaves per microbatch keeps that sum in fp32."""
        assert self.state is ShardedState.UNSHARDED, f"{self.name} used while sharded"
        old = self._leaves
        self._retired.append(old)
        self._leaves = ParamLeaves(self.infos, self._full[0], old.requires_grad, self.touched)
        if self._grad is None:
            self.prepare_grad()
        elif self._leaves.requires_grad:
            self._leaves.accumulate_into(self._grad)
        self.use_params()

    def _release_leaf_grads(self) -> None:
        for leaves in [*self._retired, self._leaves]:
            if leaves is not None:
                leaves.release_grad()
        self._retired = []

    def use_params(self) -> None:
        """Point every module parameter entry at a fresh view of the gathered parts.

        See [Note: parameter views while unsharded].
        """
        assert self.state is ShardedState.UNSHARDED, f"{self.name} used while sharded"
        install_param_views(self.infos, self.uses, self._leaves.leaves, self._full[1].detach())

    def reshard(self, keep_graph_storage: bool = False) -> None:
        """Release the gathered parts; module entries become empty placeholders.

        ``keep_graph_storage``: autograd graphs recorded on this unit's views will run later
        (no-recompute mode): free the buffers' memory but keep the tensor objects, so the next
        ``wait_unshard`` refills the same storage. See [Note: kept graphs across reshard].
        """
        if self.state is ShardedState.SHARDED:
            return
        self.set_placeholders()
        if keep_graph_storage:
            self._freed_nbytes = []
            for full in self._full:
                storage = full.untyped_storage()
                self._freed_nbytes.append(storage.nbytes())
                storage.resize_(0)
        else:
            self._release_leaf_grads()  # the unit keeps its flat gradient
            self._full = self._leaves = None
            self._freed_nbytes = None
        self.tracker.param_numel -= self.numel
        self.state = ShardedState.SHARDED

    def abandon(self) -> list:
        """Local clean-up after a step raised mid-schedule (no collective, never blocks).

        Drops the gathered parts, the unit's partially accumulated gradient and any result
        of an issued collective; module entries become placeholders. Returns the in-flight
        collectives' handles, which the caller keeps referenced (their buffers belong to the
        backend until they complete).
        """
        handles = list(self._pending_ag or []) + \
            [r for r in (self._pending_rs, self._rs_input) if r is not None]
        self._pending_ag = self._pending_rs = None
        self._rs_input = None
        self._set_comm("ag", 0)
        self._set_comm("rs", 0)
        self.set_placeholders()
        self._full = self._leaves = self._grad = None
        self._retired = []
        self._freed_nbytes = None
        if self.state is ShardedState.UNSHARDED:
            self.tracker.param_numel -= self.numel
            self.state = ShardedState.SHARDED
        if self._grad_live:
            self._grad_live = False
            self.tracker.grad_numel -= self.trainable_numel
        self.shard_param.grad = None
        return handles

    def set_placeholders(self) -> None:
        """Point every module entry of the unit at an empty (0,) placeholder (the sharded
        state: [Note: the user's model while sharded] in runtime/sharded_model.py)."""
        empty = torch.empty(0, dtype=self.param_dtype, device=self.device)
        for uses in self.uses:
            for module, attr in uses:
                module._parameters[attr] = empty

    # ---- gradients --------------------------------------------------------------------------
    def prepare_grad(self) -> None:
        """Call right before each backward through the gathered unit: the first time after a
        gather (or after ``start_reduce_grad``) allocates the unit's zero-filled (Nt,) gradient
        in the training dtype and makes the parameter leaves accumulate into it; later calls do
        nothing. No-op for leaves without grad (evaluation, no trainable parameter). See
        [Note: parameter views while unsharded]."""
        if self._grad is not None or self._leaves is None or not self._leaves.requires_grad:
            return
        self._grad = torch.zeros(self.trainable_numel, dtype=self.dtype, device=self.device)
        self._leaves.accumulate_into(self._grad)
        if not self._grad_live:
            self._grad_live = True
            self.tracker.add_grad(self.trainable_numel)

    def start_reduce_grad(self) -> None:
        """Issue the SUM reduce-scatter of the unit's accumulated (Nt,) gradient (once per step).

        The input is split by the ranks' trainable counts (frozen elements are never sent); a
        rank that ran no microbatch contributes zeros. See [Note: communication buffers].
        """
        self._release_leaf_grads()
        grad, self._grad = self._grad, None
        es = torch.empty(0, dtype=self.reduce_dtype).element_size()
        comm_bytes = 0 if self.use_all_reduce else self.local_trainable_numel * es
        if grad is None:
            grad = torch.zeros(self.trainable_numel, dtype=self.reduce_dtype, device=self.device)
            comm_bytes += self.trainable_numel * es
        elif grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
            comm_bytes += self.trainable_numel * es
        self._rs_input = grad.contiguous()  # kept alive until the collective completes
        if self.streams is not None:
            self._pending_rs = self.streams.reduce_scatter(self, self._rs_input)
        else:
            self._pending_rs = C.reduce_scatter_shards(
                self._rs_input, self.trainable_per_rank, self.rank, self.group, self.stats,
                async_op=True, use_all_reduce=self.use_all_reduce)
        self._set_comm("rs", comm_bytes)

    def wait_reduce_grad(self) -> None:
        """Wait for the reduce-scatter; ADD the result into ``shard_param.grad``."""
        if self._pending_rs is None:
            return
        result, self._pending_rs = self._pending_rs, None
        if self.streams is not None:
            self.streams.wait_reduce_scatter(result)
        elif result.work is not None:
            result.work.wait()
        self._rs_input = None
        self._set_comm("rs", 0)
        local = result.output  # (k_r,): fresh, or a view of the reduced input (fallback)
        if local.dtype != self.dtype:  # reduced in a low reduce_dtype: upcast (fresh)
            local = local.to(self.dtype)
        elif result.full is not None:
            local = local.clone()
        if self.shard_param.grad is None:
            self.shard_param.grad = local
        else:
            self.shard_param.grad.add_(local)
        if self._grad_live:
            self._grad_live = False
            self.tracker.grad_numel -= self.trainable_numel

    # ---- full tensors -----------------------------------------------------------------------
    def gather_full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: the full parts ``(trainable (Nt,), frozen (N - Nt,))``, each in its
        storage dtype, on every rank (one synchronous all-gather per non-empty part)."""
        return tuple(C.all_gather_shards(part.local, part.numel_per_rank, self.rank, self.group,
                                         self.stats, async_op=False).output if part.numel else
                     part.local.new_zeros(0) for part in self.parts)

    def gather_trainable(self) -> torch.Tensor:
        """Collective: the (Nt,) trainable part on every rank (synchronous all-gather of each
        rank's trainable shard only: a LoRA adapter's save moves the adapter elements, not the
        frozen base)."""
        return C.all_gather_shards(self.trainable.local, self.trainable_per_rank, self.rank,
                                   self.group, self.stats, async_op=False).output

    def meta(self) -> UnitShardMeta:
        return UnitShardMeta(self.name, self.numel, self.trainable_numel,
                             tuple(self.numel_per_rank), self.infos)
