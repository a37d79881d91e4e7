"""A job's precision and the tag profiles and plans record it under (pure Python, no torch).

[Note: precision tags]
A profile (``ClusterProfile.extra["dtype"]``) and a plan (``Plan.precision``) record the
precision they were measured / made for as one string::

    <master dtype>[+autocast-<compute>][+gather-<param>][+reduce-<reduce>]

e.g. ``"float32"`` (fp32 training), ``"float32+autocast-bf16"`` (bf16 autocast, fp32
all-gathers), ``"float32+autocast-bf16+gather-bf16"`` (``--bf16`` with bf16 gathered parameters,
the default), ``...+reduce-bf16`` (bf16 reduce-scatter). A part is left out when it is the
master dtype (no cast), so tags written before the gather / reduce parts existed read as fp32
all-gathers and reduce-scatters, which is what those jobs ran. Compute, gather and reduce
dtypes change what a profile measures (forward/backward times, activation memory: an fp32
gathered unit under autocast keeps low-precision cast copies of its weights, a bf16 one does
not) and what the memory model prices (element sizes of the gathered units and collectives), so
the trainer refuses a profile or plan whose tag differs from the job's.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = ["PRECISIONS", "FASTEST_FIRST", "ELEMENT_BYTES", "Precision", "PER_RANK",
           "capability_precisions", "auto_precision", "parse_rank_precisions",
           "check_rank_precisions", "rank_precisions_tag"]

PRECISIONS = ("fp32", "bf16", "fp16")  # the precision names, declared once
FASTEST_FIRST = (*PRECISIONS[1:], PRECISIONS[0])  # bf16 > fp16 > fp32
PER_RANK = "per-rank"  # compute part of the tag of a job whose ranks differ in precision
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes of one element of each dtype


class Precision(NamedTuple):
    """Compute, gathered-parameter and reduce-scatter dtypes of a job (each one of PRECISIONS;
    "fp32" for ``param`` / ``reduce`` means no cast: the fp32 master weights / gradients)."""

    compute: str = "fp32"  # autocast dtype (--bf16 / --fp16), "fp32" = no autocast
    param: str = "fp32"  # dtype of the gathered parameters (cephalo_param_dtype)
    reduce: str = "fp32"  # dtype of the gradient reduce-scatter (cephalo_reduce_dtype)

    def check(self) -> "Precision":
        """Self, or ValueError naming a dtype outside PRECISIONS."""
        for name, value in zip(self._fields, self):
            if value not in PRECISIONS:
                raise ValueError(f"precision {name} = {value!r}: need one of {PRECISIONS}")
        return self

    def tag(self, master: str = "float32") -> str:
        """The [Note: precision tags] string for a model whose parameters are ``master``."""
        parts = [master]
        for prefix, value in (("autocast", self.compute), ("gather", self.param),
                              ("reduce", self.reduce)):
            if value != "fp32":
                parts.append(f"{prefix}-{value}")
        return "+".join(parts)

    @classmethod
    def parse(cls, tag: str) -> tuple[str, "Precision"]:
        """(master dtype, Precision) of a [Note: precision tags] string; ValueError if malformed."""
        master, *parts = str(tag).split("+")
        fields = {"autocast": "compute", "gather": "param", "reduce": "reduce"}
        values = {}
        for part in parts:
            prefix, _, value = part.partition("-")
            if part == f"autocast-{PER_RANK}":  # per-rank precision: RankPlan.precision
                values["compute"] = PER_RANK
                continue
            if prefix not in fields or value not in PRECISIONS:
                raise ValueError(f"precision tag {tag!r}: part {part!r} is not one of "
                                 "autocast-/gather-/reduce-<fp32|bf16|fp16>")
            values[fields[prefix]] = value
        return master, cls(**values)

    @property
    def param_bytes(self) -> int:
        """e_p: bytes of one gathered-parameter element (4 when not cast)."""
        return ELEMENT_BYTES[self.param]

    @property
    def reduce_bytes(self) -> int:
        """e_r: bytes of one reduce-scatter element (4 when not cast)."""
        return ELEMENT_BYTES[self.reduce]


# --- precision per rank (docs/engine.md "Precision per rank") ----------------------------------


def capability_precisions(capability: tuple[int, int] | None) -> tuple[str, ...]:
    """Precisions a device runs, fastest first, from its CUDA compute capability.

    None (the CPU: tests and CI) runs all three (autocast on the CPU supports bf16 and fp16).
    bf16 needs capability >= 8.0 (Ampere: A100, A6000, L4, A10G; the trainer's --bf16 check);
    fp16 is fast from 7.0 (tensor cores: V100, T4) and on 6.0 (P100: packed half); 6.1 (P40,
    GeForce 10xx) runs fp16 at 1/64 of its fp32 rate, so it is left out (fp32 only); below 6.0
    fp32 only. Source: CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table.
    """
    if capability is None:
        return FASTEST_FIRST
    major, minor = int(capability[0]), int(capability[1])
    out = []
    if major >= 8:
        out.append("bf16")
    if major >= 7 or (major, minor) == (6, 0):
        out.append("fp16")
    return (*out, "fp32")


def auto_precision(capability: tuple[int, int] | None) -> str:
    """``--cephalo_precision auto`` for one device: its fastest precision (bf16 > fp16 > fp32);
    fp32 on the CPU (None), where low-precision autocast is emulated, not faster."""
    if capability is None:
        return "fp32"
    return capability_precisions(capability)[0]


def parse_rank_precisions(value: str | Sequence[str], world_size: int) -> list[str] | None:
    """``--cephalo_precision`` as a per-rank list; None for ``"auto"`` (resolved per device).

    Accepts ``"bf16,bf16,fp16,fp32"`` (commas and/or spaces) or a list of names.
    Raises ValueError naming the value: an unknown name, or not ``world_size`` entries.
    """
    if isinstance(value, str):
        if value.strip() == "auto":
            return None
        names = [v for v in value.replace(",", " ").split() if v]
    else:
        names = [str(v) for v in value]
    bad = [v for v in names if v not in PRECISIONS]
    if bad:
        raise ValueError(f"precision list {value!r}: {bad} not one of {list(PRECISIONS)}; give "
                         "'auto' or one precision per rank in rank order, e.g. 'bf16,fp16,fp32'")
    if len(names) != world_size:
        raise ValueError(f"precision list {value!r} has {len(names)} entries but the world size "
                         f"is {world_size}: give one precision per rank in rank order (or 'auto')")
    return names


def check_rank_precisions(precisions: Sequence[str], devices: Sequence[str],
                          supported: Sequence[Sequence[str]]) -> None:
    """Refuse a rank whose device lacks its precision.

    ``devices``: per rank a device name (for the message); ``supported``: per rank the
    precisions that device runs (``capability_precisions`` or a spec sheet's columns).
    Raises ValueError naming every such rank, its device and what it supports.
    """
    bad = [f"rank {i} ({dev}): {p} (it runs {', '.join(ok)})"
           for i, (p, dev, ok) in enumerate(zip(precisions, devices, supported)) if p not in ok]
    if bad:
        raise ValueError(f"precision not supported by the device: {'; '.join(bad)}; give that "
                         "rank a precision its device runs, or '--cephalo_precision auto' "
                         "(CLI: --precision auto)")


def rank_precisions_tag(precisions: Sequence[str], master: str = "float32") -> str:
    """The [Note: precision tags] string of a per-rank job: one precision for all ranks is that
    job's ordinary tag (--bf16 / --fp16: gathered in that dtype); ranks that differ give
    ``<master>+autocast-per-rank`` (each rank's precision is in ``RankPlan.precision``;
    all-gathers and reduce-scatters stay fp32)."""
    if len(set(precisions)) == 1:
        return Precision(precisions[0], precisions[0]).tag(master)
    return f"{master}+autocast-{PER_RANK}"
