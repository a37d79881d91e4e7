"""Byte units, one home for the whole package (planner, profiler, integrations).

Binary units, as device memory is sold and as ``torch.cuda`` reports it. Pure Python.
``DEFAULT_MAX_SHARD_SIZE``: the largest weight file a Hugging Face save writes by default.
"""

from __future__ import annotations

__all__ = ["KIB", "MIB", "GIB", "TIB", "DEFAULT_MAX_SHARD_SIZE", "format_bytes"]

KIB = float(1 << 10)
MIB = float(1 << 20)
GIB = float(1 << 30)
TIB = float(1 << 40)

DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers 5.x save_pretrained's default


def format_bytes(n: float) -> str:
    """A byte count in adaptive binary units, one decimal: ``'512 B'``, ``'3.0 KiB'``, ``'1.5 GiB'``."""
    n = float(n)
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
