"""``hf-cephalo`` command line. Subcommands live in one registry (``SUBCOMMANDS``).

Adding a subcommand (``profile``, ``simulate``, ``export``, ...)::

    from hf_cephalo.cli import register_subcommand
    register_subcommand("simulate", "predict a plan", add_arguments=_add, run=_run)

or add an entry to ``_BUILTIN`` below (each built-in one is a module of this package: plan,
simulate, profile, export). ``run(args) -> int`` returns the exit status; a ``ValueError`` it
raises is printed as ``error: ...`` with exit status 2 (bad user input); under a launcher with
several ranks (``torchrun ... -m hf_cephalo.cli profile``) only the first rank with that message
prints it, and the launcher's report names it (``rank_errors``).
Heavy imports (torch, matplotlib) happen inside ``run`` so ``hf-cephalo plan`` starts fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NamedTuple, Sequence

from hf_cephalo.cli.export import add_export_arguments, run_export
from hf_cephalo.cli.plan import (add_plan_arguments, format_plan_table, plan_figure, plot_plan,
                                 run_plan)
from hf_cephalo.cli.profile import add_profile_arguments, run_profile
from hf_cephalo.cli.simulate import add_simulate_arguments, run_simulate

__all__ = ["main", "register_subcommand", "SUBCOMMANDS", "build_parser", "format_plan_table",
           "plan_figure", "plot_plan"]


class Subcommand(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(name: str, help: str, *, add_arguments, run) -> None:
    """Register ``hf-cephalo <name>``; ValueError if the name is taken."""
    if name in SUBCOMMANDS:
        raise ValueError(f"subcommand {name!r} is already registered")
    SUBCOMMANDS[name] = Subcommand(help, add_arguments, run)


_BUILTIN = {
    "plan": Subcommand("choose per-rank batch, microbatch and state share (exact optimizer)",
                       add_plan_arguments, run_plan),
    "simulate": Subcommand("predict throughput and memory of Cephalo's plan and the baselines "
                           "(even split, compute or memory balance only, batch ∝ peak FLOP/s)",
                           add_simulate_arguments, run_simulate),
    "export": Subcommand("merge a sharded checkpoint into a Hugging Face model directory "
                         "(offline, no process group)", add_export_arguments, run_export),
    "profile": Subcommand("measure this cluster (one unit's forward/backward and memory per rank, "
                          "collectives) and write a cluster profile JSON",
                          add_profile_arguments, run_profile),
}
for _name, _sub in _BUILTIN.items():
    SUBCOMMANDS.setdefault(_name, _sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-cephalo", description="Heterogeneous-GPU training "
                                     "for Hugging Face models (Cephalo).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, spec in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=spec.help, description=spec.help)
        spec.add_arguments(p)
        p.set_defaults(_run=spec.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-cephalo`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except ValueError as e:
        _print_error(str(e), type(e).__name__)
        return 2
    except BrokenPipeError:  # stdout closed early (e.g. piped into head): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except OSError as e:  # a path the checks above did not foresee: the message, no traceback
        _print_error(_os_error_message(e), type(e).__name__)
        return 2


def _print_error(message: str, kind: str) -> None:
    """``error: <message>`` on stderr; under a launcher once per job (the first rank with this
    message prints, the launcher's report names it: ``rank_errors.report_error_once``)."""
    from hf_cephalo.rank_errors import report_error_once

    if report_error_once(message, kind):
        print(f"error: {message}", file=sys.stderr, flush=True)


def _os_error_message(e: OSError) -> str:
    """'<reason>: <path>' and what to do, for a file the command could not read or write."""
    if e.filename is None:
        return str(e)
    paths = repr(e.filename) + (f" -> {e.filename2!r}" if e.filename2 is not None else "")
    return f"{e.strerror or e}: {paths}; check the path and its permissions"
