"""Profile types (docs/design.md contract 1): what the planner knows about the model, GPUs and network.

Pure Python (no torch import) so ``hf-cephalo plan`` starts fast. Every type round-trips
through JSON (``to_json`` / ``from_json``; ``ClusterProfile.save`` / ``load``); the format is
documented with an example in ``docs/profiles.md``.

Validation happens in ``__post_init__`` and raises ``ValueError`` naming the field, the
offending value and what to do: a device profile without microbatch size 1, negative, NaN or
missing numbers, mismatched list lengths.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from hf_cephalo.units import format_bytes  # re-exported: callers import it from here

__all__ = ["ModelProfile", "RootSplit", "DeviceProfile", "CommProfile", "ClusterProfile",
           "format_bytes", "CLUSTER_PROFILE_FORMAT"]

CLUSTER_PROFILE_FORMAT = "hf_cephalo.cluster_profile/2"
_LEGACY_FORMAT = "hf_cephalo.cluster_profile/1"  # compute memory included the engine buffers


def _check_number(owner: str, name: str, value: Any, *, positive: bool = False) -> float:
    """Return ``value`` as float; ValueError if missing, NaN, infinite or negative."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}: {name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be finite, got {value!r}")
    if value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{owner}: {name} must be {kind}, got {value!r}")
    return float(value)


def _check_int(owner: str, name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{owner}: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value!r}")
    return int(value)


def _require_keys(owner: str, data: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{owner}: expected a JSON object, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ValueError(f"{owner}: missing field(s) {missing}; see docs/profiles.md for the format")


def write_json_file(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON indented by 2 with a trailing newline: the on-disk form of
    profile and plan files (docs/profiles.md). Atomic: written beside ``path`` under a name
    of this process, then renamed over it, so a reader (another rank, a job starting) sees
    the old file or the new one, never a part (the mode is ``open()``'s: the umask decides)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def file_remedy(message: str, what: str, command: str) -> str:
    """The next step appended to a malformed profile / plan file's error, unless the message
    already names one (a format version to upgrade, the docs to read)."""
    if "hf-cephalo" in message or "docs/profiles.md" in message:
        return ""
    return f"; write the {what} anew with {command} (format: docs/profiles.md)"


def read_json_file(path: str | Path, what: str) -> Any:
    """The parsed JSON in ``path``. Raises ValueError ("{what} '<path>' is not valid JSON: ...")
    when it does not parse; OSError (e.g. a missing file) propagates unchanged."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON: {e}") from e


class RootSplit(NamedTuple):
    """The root as the engine's embedding unit E and head unit H (``ModelProfile.root_split``)."""

    embed_numel: int  # N_E: embedding unit elements (a tied head weight included)
    head_numel: int  # N_H: head unit elements (without the tied weight)
    tied: bool  # the head phase gathers E too


@dataclass(kw_only=True)
class ModelProfile:
    """Shape of the model as the planner sees it.

    Attributes:
        name: model name (free text, e.g. ``"llama-3b"``); used to check plan/model matches.
        num_units: number of transformer layers (each one FSDP unit).
        params_per_unit: parameters (elements) of one transformer layer; of the largest one
            where they differ (``unit_params``; the device profiles then hold the layers' mean
            times and the largest activation memory: [Note: layers of different sizes] in
            ``profiler/model_facts.py``).
        unit_params: each layer's elements in layer order where they differ (dense and MoE
            layers, full-attention layers wider than sliding ones); None: every layer holds
            ``params_per_unit``. The training state, the shards and the gathered buffers are
            priced per layer from it.
        params_other: parameters outside the layers: embeddings, final norm, head (the root).
        params_embed / params_head: the root's split into the engine's embedding unit (token /
            position embeddings; a tied lm head weight included, once) and its head unit (final
            norm, lm head or classifier, pooler; without a tied weight), elements; both or
            neither, summing to ``params_other``. None (profiles written before the split): the
            memory model prices every root phase with the whole root (``root_split``).
        head_ties_embedding: the head uses a weight of the embedding unit (tied input/output
            embeddings), so the engine gathers the embedding unit for the head phase too.
        state_bytes_per_param: training-state bytes per parameter; 16 for fp32 Adam
            (param 4 + grad 4 + two moments 8; paper §2.4).
        param_bytes: bytes of one element of the engine's flat parameter / gradient buffers
            (the parameters' dtype: 4 for fp32); prices the gathered units and gradients.
        boundary_bytes_per_sample: bytes of one sample's hidden state at a unit boundary
            (sequence length x hidden size x activation element size), what the engine stashes
            per sample and unit boundary; 0 = unknown (the stash is then not priced).
        side_bytes_per_sample: bytes of one sample's side inputs (tensors the embedding unit
            computes from parameters and every layer reads besides the hidden state: Gemma 3n's
            per-layer inputs, sequence length x layers x per-layer width x element size; and
            those a layer unit makes for later units, e.g. an encoder's output), which
            the engine keeps on the device for the whole step, with their summed gradients
            (docs/engine.md, "Side inputs"); 0 for a model without them.
        trainable_params: parameters (elements) that train, e.g. a LoRA adapter's; None = every
            parameter trains (full fine-tuning). Only these carry gradient and optimizer state.
        frozen_bytes_per_param: resident bytes of one frozen element (its storage: 4 for fp32,
            2 for a bf16 base); used when ``trainable_params`` is given. A frozen part stored
            in another dtype than ``param_bytes`` is also gathered at this size (engine/
            flat_param.py [Note: two parts per unit]).
        trainable_per_unit / trainable_embed / trainable_head: trainable elements Nt of one
            layer unit (the largest), of the embedding unit and of the head unit (a LoRA
            adapter's share of each); all three or none, with L·per_unit + embed + head =
            ``trainable_params`` (with ``unit_trainable``: its sum + embed + head).
        unit_trainable: with ``unit_params``, each layer's trainable elements (None: each
            layer's Nt is ``trainable_per_unit`` scaled by its size).
            None (older profiles): every unit trains the fraction trainable_params / num_params
            (``unit_trainable_numels``). Only Nt carries a gradient and a reduce-scatter.
        gathered_param_bytes: e_p, bytes of one element of a gathered unit and of the
            all-gather (2 with ``param_dtype`` bf16 / fp16, FSDP2 ``MixedPrecisionPolicy``);
            None = ``param_bytes`` (the fp32 master weights are gathered, no cast).
        reduce_bytes: e_r, bytes of one element of the gradient reduce-scatter (2 with a bf16 /
            fp16 ``reduce_dtype``); None = ``param_bytes``. The unit's gradient accumulates at
            ``param_bytes`` either way (engine/flat_param.py [Note: low-precision gathered
            parameters]).
    """

    name: str = "model"
    num_units: int
    params_per_unit: int
    params_other: int
    state_bytes_per_param: float = 16.0
    param_bytes: float = 4.0
    boundary_bytes_per_sample: float = 0.0
    side_bytes_per_sample: float = 0.0
    params_embed: int | None = None
    params_head: int | None = None
    head_ties_embedding: bool = False
    trainable_params: int | None = None
    frozen_bytes_per_param: float = 4.0
    gathered_param_bytes: float | None = None
    reduce_bytes: float | None = None
    trainable_per_unit: int | None = None
    trainable_embed: int | None = None
    trainable_head: int | None = None
    unit_params: list[int] | None = None
    unit_trainable: list[int] | None = None

    def __post_init__(self) -> None:
        owner = f"model profile {self.name!r}"
        self.num_units = _check_int(owner, "num_units", self.num_units, minimum=1)
        self.params_per_unit = _check_int(owner, "params_per_unit", self.params_per_unit, minimum=1)
        self._check_unit_lists(owner)
        self.params_other = _check_int(owner, "params_other", self.params_other, minimum=0)
        self.state_bytes_per_param = _check_number(
            owner, "state_bytes_per_param", self.state_bytes_per_param, positive=True
        )
        self.param_bytes = _check_number(owner, "param_bytes", self.param_bytes, positive=True)
        self.boundary_bytes_per_sample = _check_number(
            owner, "boundary_bytes_per_sample", self.boundary_bytes_per_sample)
        self.side_bytes_per_sample = _check_number(
            owner, "side_bytes_per_sample", self.side_bytes_per_sample)
        if (self.params_embed is None) != (self.params_head is None):
            raise ValueError(f"{owner}: give both params_embed and params_head or neither, got "
                             f"params_embed={self.params_embed!r}, params_head={self.params_head!r}")
        if self.params_embed is not None:
            self.params_embed = _check_int(owner, "params_embed", self.params_embed, minimum=0)
            self.params_head = _check_int(owner, "params_head", self.params_head, minimum=0)
            if self.params_embed + self.params_head != self.params_other:
                raise ValueError(f"{owner}: params_embed {self.params_embed} + params_head "
                                 f"{self.params_head} must equal params_other {self.params_other}")
        self.frozen_bytes_per_param = _check_number(
            owner, "frozen_bytes_per_param", self.frozen_bytes_per_param, positive=True)
        for name in ("gathered_param_bytes", "reduce_bytes"):
            if getattr(self, name) is not None:
                value = _check_number(owner, name, getattr(self, name), positive=True)
                if value > self.param_bytes:
                    raise ValueError(f"{owner}: {name} {value} exceeds param_bytes "
                                     f"{self.param_bytes}: a cast only lowers the precision")
                setattr(self, name, value)
        if self.trainable_params is not None:
            self.trainable_params = _check_int(owner, "trainable_params", self.trainable_params,
                                               minimum=0)
            if self.trainable_params > self.num_params:
                raise ValueError(f"{owner}: trainable_params {self.trainable_params} exceeds the "
                                 f"model's {self.num_params} parameters")
        if not isinstance(self.head_ties_embedding, bool):
            raise ValueError(f"{owner}: head_ties_embedding must be true or false, got "
                             f"{self.head_ties_embedding!r}")
        self._check_unit_trainable(owner)

    def _check_unit_lists(self, owner: str) -> None:
        for name, limits in (("unit_params", None), ("unit_trainable", "unit_params")):
            values = getattr(self, name)
            if values is None:
                continue
            if limits is not None and self.unit_params is None:
                raise ValueError(f"{owner}: unit_trainable needs unit_params")
            if not isinstance(values, (list, tuple)) or len(values) != self.num_units:
                raise ValueError(f"{owner}: {name} must list one count per layer "
                                 f"({self.num_units}), got {values!r}")
            values = [_check_int(owner, f"{name}[{i}]", v, minimum=0)
                      for i, v in enumerate(values)]
            caps = [self.params_per_unit] * self.num_units if limits is None \
                else getattr(self, limits)
            if any(v > c for v, c in zip(values, caps)):
                raise ValueError(f"{owner}: {name} {values} exceeds the layers' elements {caps}")
            setattr(self, name, list(values))
        if self.unit_params is not None and max(self.unit_params) != self.params_per_unit:
            raise ValueError(f"{owner}: params_per_unit {self.params_per_unit} must be the "
                             f"largest of unit_params {self.unit_params}")

    def unit_numels(self) -> list[int]:
        """Elements of each layer unit, in layer order."""
        return list(self.unit_params) if self.unit_params is not None else \
            [self.params_per_unit] * self.num_units

    def _check_unit_trainable(self, owner: str) -> None:
        names = ("trainable_per_unit", "trainable_embed", "trainable_head")
        given = [getattr(self, n) is not None for n in names]
        if not any(given):
            return
        if not all(given) or self.trainable_params is None:
            raise ValueError(f"{owner}: give trainable_per_unit, trainable_embed and "
                             "trainable_head together, with trainable_params, or none of them")
        ne, nh, _ = self.root_split()
        for n, limit in zip(names, (self.params_per_unit, ne, nh)):
            value = _check_int(owner, n, getattr(self, n), minimum=0)
            if value > limit:
                raise ValueError(f"{owner}: {n} {value} exceeds the unit's {limit} elements")
            setattr(self, n, value)
        layers = sum(self.unit_trainable) if self.unit_trainable is not None else \
            self.num_units * self.trainable_per_unit
        total = layers + self.trainable_embed + self.trainable_head
        if total != self.trainable_params:
            raise ValueError(f"{owner}: the layers' trainable elements + trainable_embed + "
                             f"trainable_head = {total} must equal trainable_params "
                             f"{self.trainable_params}")

    def unit_trainable_numels(self) -> tuple[float, float, float]:
        """Nt (trainable elements) of (one layer unit, the largest, the embedding unit, the
        head unit), the unit's full numel without frozen parameters; without the per-unit
        fields each unit trains the model's fraction trainable_params / num_params (may be
        fractional). Each layer's: ``layer_trainable_numels``."""
        ne, nh, _ = self.root_split()
        if self.trainable_params is None:
            return float(self.params_per_unit), float(ne), float(nh)
        if self.trainable_per_unit is not None:
            return (float(self.trainable_per_unit), float(self.trainable_embed),
                    float(self.trainable_head))
        f = self.trainable_params / self.num_params
        return f * self.params_per_unit, f * ne, f * nh

    def layer_trainable_numels(self) -> list[float]:
        """Nt of each layer unit, in layer order (``unit_trainable`` where given, else the
        largest layer's Nt scaled by each layer's size)."""
        if self.unit_trainable is not None:
            return [float(n) for n in self.unit_trainable]
        nt = self.unit_trainable_numels()[0]
        return [nt * n / self.params_per_unit for n in self.unit_numels()]

    def root_split(self) -> "RootSplit":
        """The root as the engine's two units (elements), for the memory model.

        Without ``params_embed`` / ``params_head`` (older profiles) the embedding unit is taken
        to be the whole root and the head to use it (tied): every phase of the split root is
        then priced with the whole root gathered, an upper bound on any real split.
        """
        if self.params_embed is None:
            return RootSplit(self.params_other, 0, True)
        return RootSplit(self.params_embed, self.params_head, self.head_ties_embedding)

    @property
    def param_gather_bytes(self) -> float:
        """e_p: bytes per element of the gathered units and all-gathers."""
        return self.param_bytes if self.gathered_param_bytes is None else self.gathered_param_bytes

    @property
    def grad_reduce_bytes(self) -> float:
        """e_r: bytes per element of the gradient reduce-scatters."""
        return self.param_bytes if self.reduce_bytes is None else self.reduce_bytes

    @property
    def num_params(self) -> int:
        """Total parameter count (elements)."""
        return sum(self.unit_numels()) + self.params_other

    @property
    def num_trainable_params(self) -> int:
        """Parameters that train (all of them unless ``trainable_params`` says otherwise)."""
        return self.num_params if self.trainable_params is None else self.trainable_params

    @property
    def state_bytes(self) -> float:
        """S: bytes of the whole training state (paper §2.4: M_state = 16·|P|); with frozen
        parameters (LoRA) 16·|P_trainable| + frozen_bytes_per_param·|P_frozen|."""
        trainable = self.num_trainable_params
        return trainable * self.state_bytes_per_param + \
            (self.num_params - trainable) * self.frozen_bytes_per_param

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ModelProfile":
        _require_keys("model profile", data, ("num_units", "params_per_unit", "params_other"))
        return cls(**{k: data[k] for k in ("name", "num_units", "params_per_unit", "params_other",
                                            "state_bytes_per_param", "param_bytes",
                                            "boundary_bytes_per_sample",
                                            "side_bytes_per_sample", "params_embed",
                                            "params_head", "head_ties_embedding",
                                            "trainable_params", "frozen_bytes_per_param",
                                            "gathered_param_bytes", "reduce_bytes",
                                            "trainable_per_unit", "trainable_embed",
                                            "trainable_head", "unit_params",
                                            "unit_trainable")
                                   if k in data})


# per profiled m, or None
_OPTIONAL_TABLES = ("head_memory_bytes", "embed_s", "head_s", "kept_graph_bytes")
_STEP_TERMS = ("microbatch_overhead_s", "optimizer_s_per_param", "step_overhead_s")


@dataclass(kw_only=True)
class DeviceProfile:
    """One rank's GPU: capacity and the measured (or estimated) cost of ONE unit.

    Attributes:
        name: device type, e.g. ``"A10G"``.
        memory_capacity_bytes: C_i, total device memory in bytes.
        microbatch_sizes: profiled microbatch sizes m (strictly increasing, must contain 1).
        fwd_s: forward time of one unit at each profiled m, seconds (layers of different
            sizes: their mean, each size weighted by its count).
        bwd_s: backward time (without the recompute) of one unit at each profiled m, seconds
            (likewise).
        compute_memory_bytes: activation memory of one microbatch at each profiled m, bytes:
            a unit's recompute + backward (format 1: peak memory minus training state, the
            engine's buffers included); without ``head_memory_bytes`` also the head's.
        head_memory_bytes: optional, the head phase's activation memory at each profiled m
            (the head's loss + backward beside the last unit's kept graph), bytes; the
            planner pairs it with the buffers alive in the head phase.
        kept_graph_bytes: optional, K(m): the bytes ONE microbatch's forward graph of a unit
            holds from its forward to its backward when activation checkpointing is off (the
            tensors autograd saves plus the unit's output; the input is the previous unit's
            output), at each profiled m, bytes. Without it only plans with activation
            checkpointing can be made (profiles measured before it existed).

    Step terms outside the units ([Note: step terms] in ``planner/cost.py``; all optional, an
    older profile without them prices them at 0 s, the model of the paper). Per-rank compute
    speed lives in ``fwd_s`` / ``bwd_s`` and these tables, so a refit from measured times
    scales each by its own factor:

        embed_s: per profiled m, the embedding unit's forward plus its recompute + backward
            for one microbatch, seconds.
        head_s: per profiled m, the head's loss forward + backward for one microbatch, seconds.
        microbatch_overhead_s: the engine's host bookkeeping per unit and microbatch outside
            the unit's own compute (RNG state capture for the recompute and its replay,
            activation stash), seconds.
        optimizer_s_per_param: the optimizer step plus gradient-norm clipping per element of
            this rank's shard, seconds per element.
        step_overhead_s: host time per training step outside compute, collectives and the
            optimizer step (the training loop, data loading, callbacks), seconds; 0 until a
            training run measured it (``planner.predict.refit_to_measured``, written back to
            the profile cache at train end).

    rows_per_sample: k, the sequence rows one sample of the plan is (default 1). Every table
        above is measured per ROW (m = rows in a microbatch); with k > 1 the planner reads
        each at k·m for a microbatch of m samples (``planner.rows.per_sample_cluster``: a
        preference pair is 2 rows). Written to JSON only when k > 1.
    """

    name: str
    memory_capacity_bytes: float
    microbatch_sizes: list[int]
    fwd_s: list[float]
    bwd_s: list[float]
    compute_memory_bytes: list[float]
    head_memory_bytes: list[float] | None = None
    embed_s: list[float] | None = None
    head_s: list[float] | None = None
    kept_graph_bytes: list[float] | None = None
    microbatch_overhead_s: float = 0.0
    optimizer_s_per_param: float = 0.0
    step_overhead_s: float = 0.0
    rows_per_sample: int = 1

    def __post_init__(self) -> None:
        owner = f"device profile {self.name!r}"
        self.rows_per_sample = _check_int(owner, "rows_per_sample", self.rows_per_sample,
                                          minimum=1)
        self.memory_capacity_bytes = _check_number(
            owner, "memory_capacity_bytes", self.memory_capacity_bytes, positive=True
        )
        if not isinstance(self.microbatch_sizes, (list, tuple)) or not self.microbatch_sizes:
            raise ValueError(f"{owner}: microbatch_sizes must be a non-empty list, got "
                             f"{self.microbatch_sizes!r}")
        ms = [_check_int(owner, "microbatch_sizes[]", m, minimum=1) for m in self.microbatch_sizes]
        if any(b <= a for a, b in zip(ms, ms[1:])):
            raise ValueError(f"{owner}: microbatch_sizes must be strictly increasing, got {ms}")
        if ms[0] != 1:
            raise ValueError(f"{owner}: the profile must include microbatch size 1 (got {ms}); "
                             "profile m = 1 so the planner can fall back to it")
        self.microbatch_sizes = ms
        for name in ("microbatch_overhead_s", "optimizer_s_per_param", "step_overhead_s"):
            setattr(self, name, _check_number(owner, name, getattr(self, name)))
        for name in ("fwd_s", "bwd_s", "compute_memory_bytes", "head_memory_bytes", "embed_s",
                     "head_s", "kept_graph_bytes"):
            values = getattr(self, name)
            if name in _OPTIONAL_TABLES and values is None:
                continue
            if not isinstance(values, (list, tuple)) or len(values) != len(ms):
                raise ValueError(f"{owner}: {name} must be a list with one value per microbatch "
                                 f"size {ms}, got {values!r}")
            positive = name in ("fwd_s", "bwd_s")
            setattr(self, name, [_check_number(owner, f"{name}[m={m}]", v, positive=positive)
                                 for m, v in zip(ms, values)])
        for name in ("fwd_s", "bwd_s"):
            vs = getattr(self, name)
            drops = [f"m={a}->{b}" for a, b, x, y in zip(ms, ms[1:], vs, vs[1:]) if y < x]
            if drops:  # measurement noise can do this; the cost model takes any values
                warnings.warn(f"{owner}: {name} decreases with the microbatch size at "
                              f"{', '.join(drops)} (values {vs}); likely timing noise -- "
                              "re-profile with more repeats if the plan looks wrong",
                              stacklevel=3)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.rows_per_sample == 1:  # per-row profiles read and write as before
            del data["rows_per_sample"]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "DeviceProfile":
        keys = ("name", "memory_capacity_bytes", "microbatch_sizes", "fwd_s", "bwd_s",
                "compute_memory_bytes")
        _require_keys("device profile", data, keys)
        optional = {k: data[k] for k in (*_OPTIONAL_TABLES, *_STEP_TERMS, "rows_per_sample")
                    if k in data}
        return cls(**{k: data[k] for k in keys}, **optional)


_ROOT_COMM = ("root_allgather_s", "root_reducescatter_s", "allreduce_s", "collective_wait_s")


@dataclass(kw_only=True)
class CommProfile:
    """Collective latency for ONE unit over the whole world, seconds, and the uneven factor.

    Attributes:
        allgather_s: AG, all-gather of one unit's parameters with EVEN shards.
        reducescatter_s: RS, reduce-scatter of one unit's gradients with EVEN shards.
        uneven_factor: u, measured (AG + RS time of one unit laid out by
            ``uneven_state_ratios``) / (the same with even shards), >= 1; None = not measured
            (spec-sheet what-if profiles, older profiles): the cost model then uses the
            paper's bound 1.15.
        uneven_state_ratios: the state ratios whose layout ``uneven_factor`` was timed for.
        root_allgather_s: the root's all-gathers of one step as the engine issues them (the
            embedding unit at the start of the forward and of the embedding backward, the head
            unit, and the embedding unit for a tied head; ``root_resident``: once each), even
            shards, seconds; 0 = not measured (older profiles).
        root_reducescatter_s: the root's gradient reduce-scatters of one step (the head unit,
            the embedding unit, and its head-use gradient when tied), seconds; 0 = not measured.
        allreduce_s: one small all-reduce (8 bytes: the global item count, the loss sum, the
            squared gradient norm), seconds; 0 = not measured.
        collective_wait_s: what each blocking collective of a step adds beyond its own time
            when the ranks reach it from compute rather than from a barrier (the rendezvous:
            waking the rank that arrived first, on a loaded host its scheduling delay),
            seconds; 0 = not measured.
        overlaps_compute: the collectives run beside the compute (GPUs: NCCL kernels on their
            own stream), so a unit's compute hides them (the paper's max(...) terms); False
            where they take the cores the compute runs on (CPU ranks with gloo: copies and
            reductions on the host), so they add to it. Default True (older profiles).
    """

    allgather_s: float
    reducescatter_s: float
    uneven_factor: float | None = None
    uneven_state_ratios: list[float] | None = None
    root_allgather_s: float = 0.0
    root_reducescatter_s: float = 0.0
    allreduce_s: float = 0.0
    collective_wait_s: float = 0.0
    overlaps_compute: bool = True

    def __post_init__(self) -> None:
        self.allgather_s = _check_number("comm profile", "allgather_s", self.allgather_s)
        self.reducescatter_s = _check_number("comm profile", "reducescatter_s", self.reducescatter_s)
        for name in _ROOT_COMM:
            setattr(self, name, _check_number("comm profile", name, getattr(self, name)))
        if not isinstance(self.overlaps_compute, bool):
            raise ValueError(f"comm profile: overlaps_compute must be true or false, got "
                             f"{self.overlaps_compute!r}")
        if self.uneven_factor is not None:
            u = _check_number("comm profile", "uneven_factor", self.uneven_factor, positive=True)
            if u < 1:
                raise ValueError(f"comm profile: uneven_factor must be >= 1 (a measured ratio is "
                                 f"clamped at 1), got {u!r}")
            self.uneven_factor = u
        if self.uneven_state_ratios is not None:
            self.uneven_state_ratios = [_check_number("comm profile", "uneven_state_ratios[]", r)
                                        for r in self.uneven_state_ratios]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "CommProfile":
        _require_keys("comm profile", data, ("allgather_s", "reducescatter_s"))
        return cls(allgather_s=data["allgather_s"], reducescatter_s=data["reducescatter_s"],
                   uneven_factor=data.get("uneven_factor"),
                   uneven_state_ratios=data.get("uneven_state_ratios"),
                   overlaps_compute=data.get("overlaps_compute", True),
                   **{k: data[k] for k in _ROOT_COMM if k in data})


@dataclass(kw_only=True)
class ClusterProfile:
    """Everything the planner needs: the model, one DeviceProfile per rank (rank order), comm.

    Attributes:
        source: where the numbers come from (``"measured"`` or ``"spec-sheet estimate"``).
        offload_activations: the engine stashes boundary activations in pinned host memory
            (CUDA: on by default); priced against ``host_memory_bytes``.
        machine_of_rank: per rank, the index of its machine (ranks of one machine share its
            host RAM); None = one machine per rank.
        host_memory_bytes: per machine, its RAM in bytes (the limit of the pinned offload
            buffers, times the plan's memory fraction); None = not limited.
        buffers_in_compute_memory: True for format-1 profiles, whose ``compute_memory_bytes``
            already included the engine's buffers (the planner then adds none).
    """

    model: ModelProfile
    devices: list[DeviceProfile]
    comm: CommProfile
    source: str = "measured"
    extra: dict[str, Any] = field(default_factory=dict)
    offload_activations: bool = False
    machine_of_rank: list[int] | None = None
    host_memory_bytes: list[float] | None = None
    buffers_in_compute_memory: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.devices, (list, tuple)) or not self.devices:
            raise ValueError("cluster profile: no devices; give one device profile per rank")
        self.devices = list(self.devices)
        n = len(self.devices)
        if self.machine_of_rank is not None:
            ms = [_check_int("cluster profile", "machine_of_rank[]", k, minimum=0)
                  for k in self.machine_of_rank]
            if len(ms) != n:
                raise ValueError(f"cluster profile: machine_of_rank needs one machine index per "
                                 f"rank ({n}), got {ms}")
            self.machine_of_rank = ms
        if self.host_memory_bytes is not None:
            host = [_check_number("cluster profile", "host_memory_bytes[]", h, positive=True)
                    for h in self.host_memory_bytes]
            need = max(self.machines_of_ranks) + 1
            if len(host) != need:
                raise ValueError(f"cluster profile: host_memory_bytes needs one value per machine "
                                 f"({need}), got {len(host)}")
            self.host_memory_bytes = host

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def machines_of_ranks(self) -> list[int]:
        """Machine index per rank (one machine per rank when ``machine_of_rank`` is None)."""
        return list(self.machine_of_rank) if self.machine_of_rank is not None \
            else list(range(self.world_size))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _LEGACY_FORMAT if self.buffers_in_compute_memory else CLUSTER_PROFILE_FORMAT,
            "source": self.source,
            "model": self.model.to_json(),
            "comm": self.comm.to_json(),
            "devices": [d.to_json() for d in self.devices],
            "offload_activations": self.offload_activations,
            "machine_of_rank": self.machine_of_rank,
            "host_memory_bytes": self.host_memory_bytes,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ClusterProfile":
        _require_keys("cluster profile", data, ("model", "comm", "devices"))
        fmt = data.get("format", _LEGACY_FORMAT)
        if fmt not in (CLUSTER_PROFILE_FORMAT, _LEGACY_FORMAT):
            raise ValueError(f"cluster profile: format {fmt!r} is not supported; this version "
                             f"reads {CLUSTER_PROFILE_FORMAT!r} and {_LEGACY_FORMAT!r} (re-create "
                             "the profile with hf-cephalo profile, or upgrade hf_cephalo)")
        if not isinstance(data["devices"], list):
            raise ValueError(f"cluster profile: devices must be a list, got {data['devices']!r}")
        return cls(
            model=ModelProfile.from_json(data["model"]),
            comm=CommProfile.from_json(data["comm"]),
            devices=[DeviceProfile.from_json(d) for d in data["devices"]],
            source=str(data.get("source", "measured")),
            extra=dict(data.get("extra", {})),
            offload_activations=bool(data.get("offload_activations", False)),
            machine_of_rank=data.get("machine_of_rank"),
            host_memory_bytes=data.get("host_memory_bytes"),
            buffers_in_compute_memory=fmt == _LEGACY_FORMAT,
        )

    def save(self, path: str | Path) -> None:
        write_json_file(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "ClusterProfile":
        """The profile in ``path``. Raises ValueError naming the file and the route to a valid
        one (``hf-cephalo profile``, docs/profiles.md) when it is not a valid profile."""
        data = read_json_file(path, "cluster profile")
        try:
            return cls.from_json(data)
        except ValueError as e:
            message = str(e).removeprefix("cluster profile: ")
            remedy = file_remedy(message, "profile",
                                 "`hf-cephalo profile --model-config MODEL_DIR --out FILE`")
            raise ValueError(f"cluster profile {str(path)!r}: {message}{remedy}") from None
