"""Plan (docs/design.md contract 3): per-rank batch size, microbatch size, microbatches, state share.

JSON written by ``hf-cephalo plan --out plan.json``; format in ``docs/profiles.md``.

Microbatching rule for hand-made plans: ``num_microbatches = ceil(batch_size / microbatch_size)``;
when ``microbatch_size`` does not divide ``batch_size`` the LAST microbatch is smaller
(``batch_size - (num_microbatches - 1) * microbatch_size`` samples). Plans from the optimizer
always have ``batch_size == num_microbatches * microbatch_size``. A rank with
``batch_size == 0`` has ``microbatch_size == 0`` and ``num_microbatches == 0``: it holds its
state share and joins every collective but computes nothing.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from hf_cephalo.launch_check import single_process_hint
from hf_cephalo.profiles.precision import PRECISIONS, Precision
from hf_cephalo.profiles.types import ModelProfile, file_remedy, read_json_file, write_json_file

__all__ = ["RankPlan", "Plan", "PLAN_FORMAT", "DEFAULT_MEMORY_FRACTION",
           "check_batch_and_fraction", "ACTIVATION_CHECKPOINTING_CHOICES",
           "parse_activation_checkpointing", "activation_checkpointing_setting"]

ACTIVATION_CHECKPOINTING_CHOICES = ("true", "false", "auto")
DEFAULT_MEMORY_FRACTION = 0.8
"""c: the fraction of each GPU's memory the plan may use (paper §3: cap at 80 %)."""


def parse_activation_checkpointing(value: Any) -> str:
    """The one parser of the activation-checkpointing choice (``hf-cephalo plan
    --activation-checkpointing``, ``--cephalo_activation_checkpointing``, its env variable,
    ``CephaloPlugin``): "true", "false" or "auto", case-insensitive and stripped, so the
    Hugging Face style ``True`` / ``False`` works as for ``--torch_compile True``.

    Raises:
        ValueError: any other value (names it and the choices).
    """
    word = str(value).strip().lower()
    if word not in ACTIVATION_CHECKPOINTING_CHOICES:
        raise ValueError(f"activation checkpointing {value!r}: give true, false or auto "
                         "(any case)")
    return word


def activation_checkpointing_setting(value: Any) -> bool | None:
    """``parse_activation_checkpointing`` as ``optimize``'s argument: True, False, or None
    (auto: plan both, keep the faster one that fits)."""
    return {"true": True, "false": False, "auto": None}[parse_activation_checkpointing(value)]


def activation_checkpointing_mode(on: bool, reason: str = "") -> str:
    """How the plan prints (the trainer's plan line, ``hf-cephalo plan``) its activation
    checkpointing: "on (recompute in backward)" or "off (forward graphs kept)", then
    ``[auto: reason]`` when ``--activation-checkpointing auto`` chose it and said why."""
    mode = "on (recompute in backward)" if on else "off (forward graphs kept)"
    return f"{mode} [auto: {reason}]" if reason else mode


PLAN_FORMAT = "hf_cephalo.plan/1"

_RATIO_TOL = 1e-6


def check_batch_and_fraction(global_batch_size: int, memory_fraction: float) -> None:
    """The planner's input check: B an integer >= 1 (samples), c a number in (0, 1].

    Raises:
        ValueError: naming the offending value.
    """
    B = global_batch_size
    if isinstance(B, bool) or not isinstance(B, numbers.Integral) or B < 1:
        raise ValueError(f"global batch size must be an integer >= 1, got {B!r}")
    c = memory_fraction
    if isinstance(c, bool) or not isinstance(c, numbers.Real) or not 0 < c <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {c!r}")


@dataclass(kw_only=True)
class RankPlan:
    """One rank's share of the work.

    Attributes:
        rank: global rank.
        device: device type name (free text).
        batch_size: b_i, samples per iteration on this rank (>= 0).
        microbatch_size: m_i, samples per microbatch (0 iff batch_size == 0).
        num_microbatches: l_i = ceil(b_i / m_i) (0 iff batch_size == 0).
        state_ratio: r_i, this rank's fraction of the training state (0..1, sum over ranks 1).
        predicted_memory_bytes: r_i·S + M_i(m_i) from the cost model, bytes (None if unknown).
        memory_capacity_bytes: C_i, bytes (None if unknown).
        precision: this rank's compute precision ("fp32", "bf16" or "fp16") in a plan made
            for precision per rank (``--precision auto`` or a per-rank list; docs/engine.md
            "Precision per rank"); None: the job's one precision (``Plan.precision``).
    """

    rank: int
    device: str = "unknown"
    batch_size: int
    microbatch_size: int
    num_microbatches: int
    state_ratio: float
    predicted_memory_bytes: float | None = None
    memory_capacity_bytes: float | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        who = f"plan rank {self.rank}"
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"{who} ({self.device}): precision must be one of {list(PRECISIONS)}"
                             f", got {self.precision!r}")
        for name in ("rank", "batch_size", "microbatch_size", "num_microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{who}: {name} must be a non-negative integer, got {v!r}")
        b, m, l = self.batch_size, self.microbatch_size, self.num_microbatches
        if b == 0:
            if m != 0 or l != 0:
                raise ValueError(f"{who}: batch_size 0 needs microbatch_size 0 and "
                                 f"num_microbatches 0, got m={m}, l={l}")
        elif m == 0:
            raise ValueError(f"{who}: batch_size {b} needs microbatch_size >= 1, got 0 "
                             "(only an idle rank, batch_size 0, has microbatch_size 0)")
        elif l != math.ceil(b / m):
            raise ValueError(f"{who}: num_microbatches must be ceil(batch_size / microbatch_size)"
                             f" = ceil({b}/{m}), got {l}")
        r = self.state_ratio
        if not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 <= r <= 1 + _RATIO_TOL:
            raise ValueError(f"{who}: state_ratio must be in [0, 1], got {r!r}")
        self.state_ratio = float(r)

    @property
    def last_microbatch_size(self) -> int:
        """Samples in the last microbatch (smaller when m_i does not divide b_i)."""
        if self.batch_size == 0:
            return 0
        return self.batch_size - (self.num_microbatches - 1) * self.microbatch_size


@dataclass(kw_only=True)
class Plan:
    """The whole plan. ``ranks`` is in rank order; see module doc for the microbatching rule.

    Attributes:
        global_batch_size: B = sum of b_i, samples per iteration.
        memory_fraction: c, the fraction of device memory the plan was made for.
        uneven_state: whether the state ratios differ between ranks (uneven collectives).
        predicted_iteration_s: cost-model iteration time in seconds (None for hand-made plans).
        ranks: one RankPlan per rank.
        model: optional model fingerprint {name, num_units, params_per_unit, params_other}
            checked by ``validate_for``.
        root_resident: the engine keeps the root (embedding and head units) gathered with its
            gradients for the whole step (``CephaloEngine(root_resident=True)``); False (the
            engine's default) gathers each root unit around its uses. The memory model prices
            the choice (docs/planner.md "Memory model") and the trainer builds the engine with it.
        activation_checkpointing: True (the engine's default, the paper's schedule): each
            unit's forward is recomputed in its backward and only the boundary activations are
            kept; False: every microbatch's forward graph is kept until its backward (no
            recompute: ~1/4 fewer FLOPs, activation memory grows with L·l_i). The cost and
            memory models price the choice (docs/planner.md); the trainer builds the engine
            with ``CephaloEngine(activation_checkpointing=...)``. A plan file without the key
            reads as True (plans written before it existed).
        precision: the precision the plan was made for (profiles/precision.py [Note: precision
            tags], e.g. ``"float32+autocast-bf16+gather-bf16"``: the profile's tag); None for
            hand-made plans and plans written before it was recorded (not checked).
    """

    global_batch_size: int
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    uneven_state: bool = False
    predicted_iteration_s: float | None = None
    ranks: list[RankPlan] = field(default_factory=list)
    model: dict[str, Any] | None = None
    root_resident: bool = False
    activation_checkpointing: bool = True
    precision: str | None = None

    def __post_init__(self) -> None:
        if self.precision is not None:
            Precision.parse(self.precision)  # ValueError if malformed
        if not self.ranks:
            raise ValueError("plan: no ranks; a plan needs one entry per rank")
        for i, r in enumerate(self.ranks):
            if r.rank != i:
                raise ValueError(f"plan: ranks must be listed in rank order 0..N-1, entry {i} "
                                 f"has rank {r.rank}")
        total = sum(r.batch_size for r in self.ranks)
        if total != self.global_batch_size or total < 1:
            raise ValueError(f"plan: global_batch_size {self.global_batch_size} must equal the "
                             f"sum of per-rank batch sizes {[r.batch_size for r in self.ranks]} "
                             f"(= {total}) and be >= 1")
        if not isinstance(self.root_resident, bool):
            raise ValueError(f"plan: root_resident must be true or false, got {self.root_resident!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError("plan: activation_checkpointing must be true or false, got "
                             f"{self.activation_checkpointing!r}")
        ratio_sum = sum(r.state_ratio for r in self.ranks)
        if abs(ratio_sum - 1.0) > _RATIO_TOL:
            raise ValueError(f"plan: state ratios {self.state_ratios} sum to {ratio_sum}, not 1")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"plan: memory_fraction must be in (0, 1], got {self.memory_fraction}")

    # --- accessors -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def batch_sizes(self) -> list[int]:
        return [r.batch_size for r in self.ranks]

    @property
    def microbatch_sizes(self) -> list[int]:
        return [r.microbatch_size for r in self.ranks]

    @property
    def num_microbatches(self) -> list[int]:
        return [r.num_microbatches for r in self.ranks]

    @property
    def state_ratios(self) -> list[float]:
        return [r.state_ratio for r in self.ranks]

    @property
    def rank_precisions(self) -> list[str] | None:
        """Per rank its compute precision when the plan records one per rank, else None."""
        if all(r.precision is None for r in self.ranks):
            return None
        missing = [r.rank for r in self.ranks if r.precision is None]
        if missing:
            raise ValueError(f"plan: ranks {missing} have no precision while others have one; "
                             "a per-rank precision plan lists one for every rank (re-plan)")
        return [r.precision for r in self.ranks]

    def unit_layout(self, unit_numels: Sequence[int]) -> list[list[int]]:
        """Per-unit per-rank shard sizes for this plan's state ratios (``state.layout_unit_shards``)."""
        from hf_cephalo.planner.state import layout_unit_shards

        return layout_unit_shards(self.state_ratios, unit_numels)

    # --- constructors ----------------------------------------------------------------------
    @classmethod
    def even(cls, world_size: int, global_batch_size: int,
             microbatch_size: int | None = None) -> "Plan":
        """Equal batches (the first B mod N ranks get one more sample) and equal state shares.

        ``microbatch_size=None`` means one microbatch per rank (m_i = b_i).
        """
        if world_size < 1 or global_batch_size < 1:
            raise ValueError(f"Plan.even: world_size ({world_size}) and global_batch_size "
                             f"({global_batch_size}) must be >= 1")
        q, rem = divmod(global_batch_size, world_size)
        sizes = [q + (1 if i < rem else 0) for i in range(world_size)]
        micro = [microbatch_size or b for b in sizes]
        return cls.from_ratios(sizes, micro, [1.0 / world_size] * world_size)

    @classmethod
    def from_ratios(cls, batch_sizes: Sequence[int], microbatch_sizes: Sequence[int],
                    state_ratios: Sequence[float], *, devices: Sequence[str] | None = None,
                    memory_fraction: float = DEFAULT_MEMORY_FRACTION, root_resident: bool = False,
                    activation_checkpointing: bool = True) -> "Plan":
        """A hand-made plan: l_i = ceil(b_i / m_i) (last microbatch smaller), b_i may be 0.

        Raises:
            ValueError: lists of different lengths, negative sizes, m_i < 1 for b_i > 0,
                ratios that are negative or do not sum to 1.
        """
        n = len(batch_sizes)
        if n == 0:
            raise ValueError("Plan.from_ratios: no ranks; give one batch size per rank")
        if len(microbatch_sizes) != n or len(state_ratios) != n:
            raise ValueError(f"Plan.from_ratios: batch_sizes ({n}), microbatch_sizes "
                             f"({len(microbatch_sizes)}) and state_ratios ({len(state_ratios)}) "
                             "must have one entry per rank")
        ranks = []
        for i, (b, m, r) in enumerate(zip(batch_sizes, microbatch_sizes, state_ratios)):
            b, m = int(b), int(m)
            if b > 0 and m < 1:
                raise ValueError(f"Plan.from_ratios: rank {i} has batch_size {b} but "
                                 f"microbatch_size {m}; use m >= 1")
            m = min(m, b) if b > 0 else 0
            ranks.append(RankPlan(rank=i, device=devices[i] if devices else "unknown",
                                  batch_size=b, microbatch_size=m,
                                  num_microbatches=math.ceil(b / m) if b else 0,
                                  state_ratio=float(r)))
        uneven = max(state_ratios) - min(state_ratios) > _RATIO_TOL
        return cls(global_batch_size=sum(int(b) for b in batch_sizes),
                   memory_fraction=memory_fraction, uneven_state=uneven, ranks=ranks,
                   root_resident=root_resident, activation_checkpointing=activation_checkpointing)

    # --- validation ------------------------------------------------------------------------
    def validate_for(self, world_size: int, model_profile: ModelProfile | None = None,
                     precision: str | None = None, plan_file: str | None = None) -> None:
        """Check this plan fits the job; ValueError naming the mismatch (before any collective).

        ``precision``: the job's [Note: precision tags] string; refused when the plan records
        another one (its times and memory were predicted for other dtypes). ``plan_file``: the
        file the plan was read from (``--cephalo_plan_file``), named in the world-size error.
        """
        if precision is not None and self.precision not in (None, precision):
            raise ValueError(
                f"plan was made for precision {self.precision!r} but this job trains in "
                f"{precision!r} (master dtype + autocast / gathered-parameter / reduce dtypes: "
                "--bf16 / --fp16, cephalo_param_dtype, cephalo_reduce_dtype); re-plan for this "
                "precision (`hf-cephalo plan` from a profile measured with `hf-cephalo profile "
                "--precision ... --param-dtype ...`, or drop cephalo_plan_file) or train with "
                "the plan's precision")
        if self.world_size != world_size:
            source = "plan" if plan_file is None else f"plan file {plan_file!r}"
            remedy = "" if plan_file is None else \
                " or drop --cephalo_plan_file to plan at start"
            # one process for a plan of several is most often the launch, not the plan
            # ([Note: one process where several were asked] in hf_cephalo/launch_check.py)
            launch = "; re-run" if world_size != 1 or self.world_size < 2 else \
                f"; {single_process_hint(self.world_size)}. Otherwise re-run"
            raise ValueError(f"{source} is for world size {self.world_size} but the job has "
                             f"world size {world_size}{launch} `hf-cephalo plan` for this "
                             f"cluster{remedy}")
        if model_profile is not None and self.model is not None:
            mine = {k: self.model.get(k) for k in ("num_units", "params_per_unit", "params_other")}
            theirs = {k: getattr(model_profile, k) for k in mine}
            if mine != theirs:
                raise ValueError(f"plan was made for model {self.model.get('name')!r} {mine} but "
                                 f"the job's model {model_profile.name!r} has {theirs}; re-plan "
                                 "for this model (`hf-cephalo plan` from its profile, or drop "
                                 "cephalo_plan_file so the trainer plans at start)")

    # --- JSON ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for rank in out["ranks"]:  # one precision per job: the file reads as before
            if rank["precision"] is None:
                del rank["precision"]
        out["format"] = PLAN_FORMAT
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Plan":
        if not isinstance(data, Mapping) or "ranks" not in data or "global_batch_size" not in data:
            raise ValueError("plan JSON needs 'global_batch_size' and 'ranks'; see docs/profiles.md")
        fmt = data.get("format", PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise ValueError(f"plan JSON: format {fmt!r} is not supported; this version reads "
                             f"{PLAN_FORMAT!r} (re-run hf-cephalo plan, or upgrade hf_cephalo)")
        keys = ("rank", "device", "batch_size", "microbatch_size", "num_microbatches",
                "state_ratio", "predicted_memory_bytes", "memory_capacity_bytes", "precision")
        ranks = []
        for i, r in enumerate(data["ranks"]):
            missing = [k for k in keys[2:6] if k not in r]
            if missing:
                raise ValueError(f"plan JSON: rank entry {i} misses {missing}")
            ranks.append(RankPlan(**{k: r[k] for k in keys if k in r}))
        return cls(global_batch_size=data["global_batch_size"],
                   memory_fraction=data.get("memory_fraction", DEFAULT_MEMORY_FRACTION),
                   uneven_state=bool(data.get("uneven_state", False)),
                   predicted_iteration_s=data.get("predicted_iteration_s"),
                   ranks=ranks, model=data.get("model"),
                   root_resident=bool(data.get("root_resident", False)),
                   activation_checkpointing=data.get("activation_checkpointing", True),
                   precision=data.get("precision"))

    def save(self, path: str | Path) -> None:
        write_json_file(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """The plan in ``path``. Raises ValueError naming the file and the route to a valid
        one (``hf-cephalo plan --out``, docs/profiles.md) when it is not a valid plan."""
        data = read_json_file(path, "plan file")
        try:
            return cls.from_json(data)
        except ValueError as e:
            message = str(e).removeprefix("plan JSON: ").removeprefix("plan: ")
            remedy = file_remedy(message, "plan", "`hf-cephalo plan --profile PROFILE -B N --out FILE`")
            raise ValueError(f"plan file {str(path)!r}: {message}{remedy}") from None
