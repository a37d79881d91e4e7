"""Lines the package prints (plans, re-plans, reports), kept above any progress bar."""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["print_line", "format_loss_trend"]


def print_line(text: str) -> None:
    """Print ``text`` and a newline on stdout, flushed, above the progress bars being drawn:
    ``tqdm.write`` clears each bar on stdout / stderr (which share a terminal or a ``2>&1``
    log), prints, and redraws them; a plain ``print`` lands after the bar's last refresh, in
    the middle of its line. Without tqdm, ``print``."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(text, flush=True)
        return
    tqdm.write(text)
    sys.stdout.flush()


def format_loss_trend(losses: Sequence[float]) -> str:
    """One line on the logged training losses (the per-logging-step item means, as logged).

    ``"first 5.1234 -> last 3.2100 (went down; 6 logged values)"``; with fewer than two values the
    trend cannot be told and the line says so instead of calling it a failure.

    Raises:
        ValueError: ``losses`` is empty.
    """
    if not losses:
        raise ValueError("format_loss_trend needs at least one logged loss")
    if len(losses) < 2:
        return (f"{losses[0]:.4f} (too few logged values to tell a trend: 1 logged value; "
                "log more often with --logging_steps)")
    trend = "went down" if losses[-1] < losses[0] else "DID NOT go down"
    return f"first {losses[0]:.4f} -> last {losses[-1]:.4f} ({trend}; {len(losses)} logged values)"
