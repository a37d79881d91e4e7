"""The process-level environment variables, declared once (stdlib only: read at import time).

A job's settings (``HF_CEPHALO_<SETTING>``, e.g. ``HF_CEPHALO_MEMORY_FRACTION``) are declared
and read by ``runtime.settings.CephaloSettings``; the variables below are not settings of a job
but of the process (where the profile cache lives, how verbose the profiler is, how errors are
printed under a launcher). Every other module reads them through ``env_text`` / ``env_flag`` /
``env_int``, which refuse a name not declared here.
"""

from __future__ import annotations

import os

__all__ = ["PROCESS_ENV", "env_text", "env_flag", "env_int"]

PROCESS_ENV = {
    "HF_CEPHALO_PROFILE_CACHE": "folder of the profile cache (default "
                                "~/.cache/hf_cephalo/profiles)",
    "HF_CEPHALO_PROFILE_MAX_MICROBATCH_SIZE": "largest microbatch size profiled at start (8)",
    "HF_CEPHALO_VERBOSE": "1: the profiler prints every rank's progress every second",
    "HF_CEPHALO_ALL_RANK_ERRORS": "1: under a launcher every rank prints its own traceback",
    "HF_CEPHALO_TORCH_VERSION": "scripts/setup_env.sh: the torch release it installs (2.13.0)",
    "HF_CEPHALO_ACCELERATE_CHECKOUT": "tests/test_benchmarks_smoke.py: a checkout of Accelerate's "
                                      "repository for accelerate_examples.py --smoke (unset: "
                                      "that test skips)",
}
"""Name -> what it does (its default in parentheses)."""

_TRUE = ("1", "true", "yes")


def _declared(name: str) -> str:
    if name not in PROCESS_ENV:
        raise KeyError(f"{name} is not a declared process variable (hf_cephalo/environment.py)")
    return name


def env_text(name: str) -> str:
    """The variable's value, stripped ("" when unset)."""
    return os.environ.get(_declared(name), "").strip()


def env_flag(name: str) -> bool:
    """Whether the variable is 1 / true / yes (any case)."""
    return env_text(name).lower() in _TRUE


def env_int(name: str, default: int) -> int:
    """The variable as an int, ``default`` when unset. Raises ValueError naming the variable
    for a value that is not an integer."""
    text = env_text(name)
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer") from None
