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

from typing import NamedTuple

__all__ = ["PRECISIONS", "ELEMENT_BYTES", "Precision"]

PRECISIONS = ("fp32", "bf16", "fp16")
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
