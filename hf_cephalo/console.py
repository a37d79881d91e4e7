"""Lines the package prints (plans, re-plans, reports), kept above any progress bar."""

from __future__ import annotations

import sys

__all__ = ["print_line"]


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
