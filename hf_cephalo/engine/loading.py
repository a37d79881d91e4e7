"""Where a new engine's shards come from: rank 0's model, a checkpoint's slices, or a seeded init.

[Note: no full model after construction]
``CephaloEngine`` builds its units one at a time (``engine._build_units``): the weight source
writes this rank's element ranges of the unit's two parts ([Note: two parts per unit] in
``flat_param.py``) into its shards, then the module entries become placeholders. Nothing keeps
the original parameter tensors (units keep only ``ParamInfo`` and (module, attribute) entries;
the key map names parameters by fqn), so a rank holds its shards plus at most one unit's full
values. Three starts, chosen by ``choose_source`` from the parameters' devices: ``IN_MEMORY``
(rank 0's values, each rank sent its range: one set of weights), ``CHECKPOINT`` (each rank
reads only its elements, under ``checkpoint_keys.checkpoint_key_map``'s keys; the whole
checkpoint checked on every rank before any collective) and ``INIT`` (the model's own init per
unit under a generator seeded from (seed, unit name), ``unit_seed``: the weights do not depend
on world size, plan or rank). docs/engine.md, "Construction: unit by unit, no full model".
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint_files import CheckpointFiles, read_range, resolve_checkpoint
from .checkpoint_keys import KeyMap, checkpoint_key_map
from .flat_param import FlatParamUnit, ParamInfo
from .merged_keys import MergedKeys, merged_reads, merged_shape


class StartKind(enum.Enum):
    """Where the shards of a new engine come from (see the module docstring)."""

    IN_MEMORY = "in_memory"
    CHECKPOINT = "checkpoint"
    INIT = "init"


CheckpointLike = str | os.PathLike | CheckpointFiles


def unit_seed(seed: int, unit_name: str) -> int:
    """The CPU RNG seed of one unit's init: a 63-bit hash of (seed, unit name), so it depends
    on neither the plan, the world size nor the rank (nor on the other units)."""
    digest = hashlib.sha256(f"hf_cephalo-init:{int(seed)}:{unit_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# ---- choosing the start ----------------------------------------------------------------------
def choose_source(model: nn.Module, checkpoint: CheckpointLike | None, *, seed: int,
                  device: torch.device, rank: int, world_size: int, group):
    """The weight source for ``model`` (validated; no collective).

    Raises:
        ValueError: a parameter on a device other than meta, the CPU or ``device``; meta and
            materialized parameters mixed without a checkpoint; a checkpoint that cannot be
            resolved (``checkpoint_files.resolve_checkpoint``).
    """
    meta, real, bad = [], [], []
    for name, p in model.named_parameters():
        if p.is_meta:
            meta.append(name)
        elif p.device.type == "cpu" or p.device == device:
            real.append(name)
        else:
            bad.append(f"{name} on {p.device}")
    if bad:
        raise ValueError(f"parameters {bad[:3]} are neither on the meta device, the CPU nor the "
                         f"compute device {device}: build the model on the CPU or the meta "
                         "device (the engine moves only this rank's shards)")
    if checkpoint is not None:
        files = checkpoint if isinstance(checkpoint, CheckpointFiles) else \
            resolve_checkpoint(checkpoint)
        return CheckpointSource(files, checkpoint_key_map(model, files.weight_map,
                                                          key_mapping=files.key_mapping), rank)
    if meta and real:
        raise ValueError(f"parameters {meta[:3]} are on the meta device but {real[:3]} are not, "
                         "and no checkpoint was given: build the whole model on the meta device "
                         "(seeded init or checkpoint=...) or materialize it")
    if meta:
        return InitSource(model, seed)
    return RankZeroSource(rank, world_size, group)


# ---- the three sources ---------------------------------------------------------------------
class RankZeroSource:
    """``StartKind.IN_MEMORY``: rank 0's parameter values, sent range by range."""

    kind = StartKind.IN_MEMORY

    def __init__(self, rank: int, world_size: int, group):
        self.rank, self.world_size, self.group = rank, world_size, group

    def check(self, infos: Sequence[ParamInfo]) -> None:
        """Nothing to check (shapes are the model's own)."""

    def _peer(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def fill(self, unit: FlatParamUnit, params: Sequence[torch.Tensor],
             modules: Sequence[nn.Module]) -> None:
        """Collective (point-to-point): rank 0 sends each rank its range of each part."""
        if self.rank != 0:
            for _, _, local in unit.local_segments():
                dist.recv(local, src=self._peer(0), group=self.group)
            return
        with torch.no_grad():
            # (Nt,), (N - Nt,): one unit, transient, each part in its dtype
            full = [f.to(unit.device) for f in unit.flat_from_tensors(params)]
            unit.load_flat(full)
            works = [dist.isend(flat[s:s + n], dst=self._peer(r), group=self.group)
                     for part, flat in zip(unit.parts, full)
                     for r, (s, n) in enumerate(zip(part.starts, part.numel_per_rank))
                     if r != 0 and n > 0]
            for work in works:
                work.wait()

    def fill_buffer(self, key: str, buffer: torch.Tensor, module: nn.Module) -> torch.Tensor:
        """Buffers already exist in memory (never meta here)."""
        return buffer

    def sync_buffer(self, buffer: torch.Tensor) -> None:
        """Collective: rank 0's value of a buffer (already on the compute device)."""
        if self.world_size > 1:
            dist.broadcast(buffer, src=self._peer(0), group=self.group)


class CheckpointSource:
    """``StartKind.CHECKPOINT``: this rank's ranges read from safetensors files."""

    kind = StartKind.CHECKPOINT

    def __init__(self, files: CheckpointFiles, key_map: KeyMap, rank: int):
        self.files, self.key_map, self.rank = files, key_map, rank
        self._keys: dict[str, str] = {}  # parameter fqn -> checkpoint key
        # parameter fqn -> (stored tensors merged into it, each pattern's size along cat_dim)
        self._merged: dict[str, tuple[MergedKeys, list[int]]] = {}

    def _find(self, names: Sequence[str]) -> str | None:
        """The checkpoint key transformers maps onto the first of ``names`` (a parameter's
        fqn and its tied aliases) that has one, or None."""
        to_checkpoint = self.key_map.to_checkpoint
        return next((to_checkpoint[n] for n in names if n in to_checkpoint), None)

    def check(self, infos: Sequence[ParamInfo]) -> None:
        """Every parameter has a key (or, merged from per-expert tensors, every stored tensor
        of it) of the right shape; every file's header is sound.

        Keys are resolved by transformers' own loading renames ([Note: checkpoint keys
        through transformers' mapping] in ``checkpoint_keys.py``). Raises ValueError naming
        the parameter and the file (no collective: every rank sees the same files and raises
        the same error).
        """
        self.files.check_files()
        for info in infos:
            key = self._find(info.aliases)
            if key is None:
                merged = next((self.key_map.merged[n] for n in info.aliases
                               if n in self.key_map.merged), None)
                if merged is not None:
                    self._check_merged(info, merged)
                    continue
                raise ValueError(f"parameter {info.fqn} (names {list(info.aliases)}) is not in "
                                 f"the checkpoint {self.files.where()}, also not under the "
                                 "names from_pretrained maps onto it (transformers' key renames, "
                                 "legacy names, base-model prefix): it is a checkpoint of "
                                 "another model, or its index misses an entry")
            shape = self.files.shape(key)
            if tuple(shape) != tuple(info.shape):
                raise ValueError(f"parameter {info.fqn}: {self.files.weight_map[key]} stores "
                                 f"{key!r} with shape {tuple(shape)}, the model expects "
                                 f"{tuple(info.shape)}: the model's config does not match the "
                                 "checkpoint")
            self._keys[info.fqn] = key

    def _check_merged(self, info: ParamInfo, merged: MergedKeys) -> None:
        shapes = [[tuple(self.files.shape(k)) for k in keys] for keys in merged.keys]
        if merged_shape(merged, shapes) != tuple(info.shape):
            found = {keys[0] if keys else "(none)": f"{len(keys)} x {s[0] if s else ()}"
                     for keys, s in zip(merged.keys, shapes)}
            raise ValueError(f"parameter {info.fqn} {tuple(info.shape)}: transformers merges it "
                             f"from the stored tensors {found} of {self.files.where()}, which "
                             "do not make that shape: the model's config (number of experts, "
                             "sizes) does not match the checkpoint")
        sizes = [s[0][merged.cat_dim] if merged.cat_dim is not None else 0 for s in shapes]
        self._merged[info.fqn] = (merged, sizes)

    def _reads(self, info: ParamInfo, lo: int, hi: int, dest: torch.Tensor):
        """(file, key, stored shape, start, stop, dest) reads giving the parameter's elements
        ``[lo, hi)`` (offsets within the parameter) into ``dest``."""
        if info.fqn not in self._merged:
            key = self._keys[info.fqn]
            return [(self.files.weight_map[key], key, tuple(info.shape), lo, hi, dest)]
        merged, sizes = self._merged[info.fqn]
        return [(self.files.weight_map[key], key, self.files.shape(key), s, t,
                 dest[off:off + t - s])
                for key, s, t, off in merged_reads(merged, tuple(info.shape), sizes, lo, hi)]

    def fill(self, unit: FlatParamUnit, params: Sequence[torch.Tensor],
             modules: Sequence[nn.Module]) -> None:
        """Read the elements of this rank's range, file by file (each opened once per unit
        and closed after it, so mapped file pages do not stay in the process); a parameter
        merged from per-expert tensors reads only the ranges of them its range covers
        ([Note: merged expert tensors] in ``merged_keys.py``)."""
        from safetensors import safe_open

        by_file: dict[str, list[tuple[str, tuple, int, int, torch.Tensor]]] = {}
        for start, stop, local in unit.local_segments():
            for info in unit.infos:
                lo, hi = max(start, info.offset), min(stop, info.offset + info.numel)
                if lo < hi:
                    dest = local[lo - start:hi - start]
                    for path, *read in self._reads(info, lo - info.offset, hi - info.offset,
                                                   dest):
                        by_file.setdefault(path, []).append(read)
        with torch.no_grad():
            for path, reads in by_file.items():
                with safe_open(path, framework="pt") as f:
                    for key, shape, lo, hi, dest in reads:
                        dest.copy_(read_range(f, key, tuple(shape), lo, hi, dest.dtype))

    def fill_buffer(self, key: str, buffer: torch.Tensor, module: nn.Module) -> torch.Tensor:
        """A persistent buffer stored in the checkpoint is read; else None (init it)."""
        from safetensors import safe_open

        found = self._find([key])
        if found is None:
            return None
        with safe_open(self.files.weight_map[found], framework="pt") as f:
            value = f.get_tensor(found)
        if tuple(value.shape) != tuple(buffer.shape):
            raise ValueError(f"buffer {key}: {self.files.weight_map[found]} stores shape "
                             f"{tuple(value.shape)}, the model expects {tuple(buffer.shape)}: "
                             "the model's config does not match the checkpoint")
        return value.to(buffer.dtype)

    def sync_buffer(self, buffer: torch.Tensor) -> None:
        """Every rank read the same file: nothing to do."""


class InitSource:
    """``StartKind.INIT``: each unit materialized on the host and initialized, seeded per unit."""

    kind = StartKind.INIT

    def __init__(self, model: nn.Module, seed: int):
        self.seed = int(seed)
        self._init_fns = init_functions(model)

    def check(self, infos: Sequence[ParamInfo]) -> None:
        """Nothing to check."""

    def fill(self, unit: FlatParamUnit, params: Sequence[torch.Tensor],
             modules: Sequence[nn.Module]) -> None:
        """Materialize the unit as its two full parts on the host, init it, keep this rank's
        ranges."""
        from .flat_param import ParamLeaves, install_param_views

        full = [torch.empty(part.numel, dtype=part.dtype) for part in unit.parts]  # one unit
        leaves = ParamLeaves(unit.infos, full[0], requires_grad=False)  # alias full[0]
        install_param_views(unit.infos, unit.uses, leaves.leaves, full[1])
        for module in _post_order(modules):
            _materialize_buffers(module)
        run_init(self._init_fns, modules, unit_seed(self.seed, unit.name))
        unit.load_flat(full)
        unit.set_placeholders()

    def fill_buffer(self, key: str, buffer: torch.Tensor, module: nn.Module) -> torch.Tensor:
        return None

    def sync_buffer(self, buffer: torch.Tensor) -> None:
        """Seeded: the same on every rank."""


# ---- init helpers ------------------------------------------------------------------------------
def init_functions(model: nn.Module) -> dict[int, Callable[[nn.Module], None]]:
    """id(module) -> the ``_init_weights`` of its nearest enclosing transformers model (as
    ``PreTrainedModel.initialize_weights`` dispatches sub-models); modules outside any such
    model map to their own ``reset_parameters`` when they have one."""
    out: dict[int, Callable] = {}

    def walk(module: nn.Module, owner: Callable | None) -> None:
        if hasattr(module, "_init_weights") and hasattr(module, "config"):
            owner = module._init_weights
        fn = owner if owner is not None else getattr(module, "reset_parameters", None)
        if fn is not None:
            out[id(module)] = fn if owner is not None else (lambda m, f=fn: f())
        for child in module.children():
            walk(child, owner)

    walk(model, None)
    return out


def _post_order(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """Distinct submodules, children before parents (the order ``initialize_weights`` uses)."""
    seen, order = set(), []

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        order.append(module)

    for module in modules:
        visit(module)
    return order


def _init_guard():
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:  # not a transformers model, or an older release
        return contextlib.nullcontext()
    return guard_torch_init_functions()


def run_init(init_fns: dict[int, Callable], modules: Sequence[nn.Module], seed: int) -> None:
    """Apply each submodule's init function (post-order) under a CPU RNG seeded with ``seed``;
    the caller's RNG state is restored afterwards. The CPU generator only: torch.manual_seed
    would also reseed every CUDA device's, which fork_rng(devices=[]) does not give back."""
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _init_guard():
        torch.default_generator.manual_seed(seed)
        for module in _post_order(modules):
            fn = init_fns.get(id(module))
            if fn is not None:
                fn(module)


def _materialize_buffers(module: nn.Module) -> bool:
    """Meta buffers of ``module`` (not recursive) become uninitialized host tensors; whether
    there were any."""
    found = False
    for name, buf in module._buffers.items():
        if buf is not None and buf.is_meta:
            module._buffers[name] = torch.empty_like(buf, device="cpu")
            found = True
    return found


def param_shapes_beside_meta_buffers(model: nn.Module) -> dict[int, dict[str, torch.Size]]:
    """``id(module)`` -> {parameter name: shape} of the modules holding a meta buffer: what
    their init function sees when ``place_buffers`` runs it after the parameters became the
    engine's placeholders (``_fill_meta_buffers``)."""
    return {id(m): {n: p.shape for n, p in m._parameters.items() if p is not None}
            for m in model.modules()
            if any(b is not None and b.is_meta for b in m._buffers.values())}


def place_buffers(model: nn.Module, device: torch.device, source, init_fns=None,
                  seed: int = 0, param_shapes: dict[int, dict[str, torch.Size]] | None = None
                  ) -> None:
    """Every buffer on the compute device, moved one at a time (shared buffers once).

    Meta buffers are read from the checkpoint when it stores them (persistent buffers), else
    computed by their module's init function (e.g. rotary ``inv_freq``, Gemma's scaled
    embedding's ``embed_scale``), seeded by the module's name, with the module's own
    parameters seen as meta tensors of their shapes (``param_shapes``, taken before the engine
    replaced them: an init function that also initializes them then writes nothing, e.g. the
    padding row of an embedding). In-memory starts take rank 0's values (collective).
    Raises ValueError for a meta buffer that neither the checkpoint nor an init function
    provides.
    """
    init_fns = init_functions(model) if init_fns is None else init_fns
    # id(original) -> (original, moved). The original is kept alive until the end: once its
    # module entry points at the moved copy, a freed original's id could be reused by a buffer
    # materialized later (a meta buffer's host tensor) and that buffer would be swapped for the
    # wrong one (Gemma 3n's last ``embed_scale`` became a rotary ``inv_freq`` on a GPU).
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for mod_name, module in model.named_modules():
        metas = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if metas:
            _fill_meta_buffers(mod_name, module, metas, source, init_fns, seed,
                               (param_shapes or {}).get(id(module), {}))
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            if id(buf) not in moved:
                new = buf.to(device)
                source.sync_buffer(new)
                moved[id(buf)] = (buf, new)
            module._buffers[name] = moved[id(buf)][1]


def _fill_meta_buffers(mod_name: str, module: nn.Module, names: list[str], source,
                       init_fns, seed: int, shapes: dict[str, torch.Size]) -> None:
    keys = {n: f"{mod_name}.{n}" if mod_name else n for n in names}
    values = {n: source.fill_buffer(keys[n], module._buffers[n], module) for n in names}
    _materialize_buffers(module)
    if any(v is None for v in values.values()):
        fn = init_fns.get(id(module))
        if fn is None:
            missing = [keys[n] for n, v in values.items() if v is None]
            raise ValueError(f"buffers {missing} are on the meta device and neither the "
                             "checkpoint nor an init function of their module (_init_weights "
                             "or reset_parameters) provides them; build the model on the CPU "
                             "(not the meta device), or give the module a reset_parameters that "
                             "fills them")
        held = dict(module._parameters)
        try:
            for n, shape in shapes.items():  # the placeholders as their shapes, on meta
                if module._parameters.get(n) is not None:
                    module._parameters[n] = nn.Parameter(
                        torch.empty(shape, device="meta", dtype=held[n].dtype),
                        requires_grad=held[n].requires_grad)
            with torch.random.fork_rng(devices=[]), torch.no_grad(), _init_guard():
                torch.default_generator.manual_seed(unit_seed(seed, f"buffers of {mod_name}"))
                fn(module)
        finally:
            module._parameters.update(held)
    for n, v in values.items():
        if v is not None:
            module._buffers[n].copy_(v)


def check_checkpoint(model: nn.Module, files: CheckpointFiles) -> None:
    """Check, before any profiling or collective, that ``files`` can feed ``model`` (any device:
    meta is fine) the way the engine will read them: every parameter found under transformers'
    names (or merged from per-expert tensors) with its shape, every file header sound.

    Raises:
        ValueError: as ``CheckpointSource.check`` (names the parameter and the file).
        NotImplementedError: a conversion other than stacked experts (``checkpoint_key_map``).
    """
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    source = CheckpointSource(files, checkpoint_key_map(model, files.weight_map,
                                                        key_mapping=files.key_mapping), 0)
    source.check([_Named(n[0], tuple(n), tuple(params[i].shape)) for i, n in names.items()])


class _Named(NamedTuple):
    """What ``CheckpointSource.check`` reads of a ``ParamInfo``."""

    fqn: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]


# ---- into an engine that already exists ----------------------------------------------------
def load_weights_into_engine(engine, checkpoint: CheckpointLike) -> None:
    """Overwrite ``engine``'s parameter shards and persistent buffers with a safetensors
    checkpoint's values (a ``save_pretrained`` / ``save_model`` folder), on any plan.

    No collective: each rank reads only the elements of its own shards (``CheckpointSource``,
    the reader a meta-model engine is built with), plus the buffers the checkpoint stores
    (non-persistent ones, absent from ``save_pretrained`` files, are left as they are). Values
    are converted to each part's storage dtype. Everything is checked (every parameter present
    with its shape, every file header sound) before the first value is copied.

    Raises:
        ValueError: the checkpoint cannot be resolved, lacks a parameter, stores another shape,
            or a file is truncated / corrupt (names the parameter and the file).
    """
    model = engine.staged.model
    files = checkpoint if isinstance(checkpoint, CheckpointFiles) else \
        resolve_checkpoint(checkpoint)
    source = CheckpointSource(files, checkpoint_key_map(model, files.weight_map,
                                                        key_mapping=files.key_mapping),
                              engine.rank)
    units = engine.all_units()
    source.check([info for unit in units for info in unit.infos])
    for unit in units:
        source.fill(unit, (), ())
    with torch.no_grad():
        for key, buffer in model.named_buffers():
            value = source.fill_buffer(key, buffer, None)
            if value is not None:
                buffer.copy_(value)
