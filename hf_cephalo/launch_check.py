"""Refuse a job that runs as one process where the user launched several.

[Note: one process where several were asked]
Stock ``accelerate launch`` (1.15) starts several workers only through torchrun; otherwise (no
config on a machine without CUDA, ``--cpu``, a ``MULTI_CPU`` config) it runs ONE ``python
train.py`` whatever ``--num_processes`` says, and Accelerate reports ``DistributedType.NO``
with one process: the job would silently train one rank (DESIGN.md contract 6). So a world of
one on CPU, without a launcher's ``WORLD_SIZE``, with the simple launcher's variables and a
``MASTER_ADDR`` that the launcher process itself did not have (``/proc/<ppid>/environ``, where
readable), is that mistake; so is one process given a plan for several ranks.
``accelerate_configs/cephalo_cpu.yaml`` says MULTI_GPU, so torchrun starts the workers. What
the simple launcher passes, in accelerate's source: docs/accelerate.md, "One process where
several were asked for".
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

__all__ = ["CPU_CONFIG", "GPU_CONFIG", "check_launch", "check_this_launch",
           "requested_processes", "single_process_hint"]

CPU_CONFIG = "accelerate_configs/cephalo_cpu.yaml"
"""The Accelerate config that starts N CPU workers (distributed_type MULTI_GPU, gloo)."""

GPU_CONFIG = "accelerate_configs/cephalo.yaml"
"""The Accelerate config for one machine of GPUs."""

# what a launcher that set the world exports: torchrun (WORLD_SIZE, RANK, LOCAL_RANK) and the
# MPI launchers Accelerate's MULTI_CPU state reads (accelerate/state.py, get_int_from_env)
_WORLD_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                    "MV2_COMM_WORLD_SIZE")
# exported by accelerate's simple_launcher on every run (prepare_simple_launcher_cmd_env)
_SIMPLE_LAUNCHER_VARIABLES = ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION")


def requested_processes(launcher_argv: Sequence[str] | None) -> int | None:
    """The ``--num_processes`` of an ``accelerate launch`` command line (``[python]
    .../accelerate launch``, ``python -m accelerate.commands.launch`` or ``accelerate-launch``,
    then its flags, the script and the script's arguments), or None: not that command, no such
    flag (a config file's value is not on the command line), or unparsable. Parsed by
    Accelerate's own parser (``launch_command_parser``), so aliases (``--num-processes``),
    ``=N`` and the script's own arguments are told apart as ``accelerate launch`` does."""
    argv = list(launcher_argv or ())
    start = next((i + 1 for i, word in enumerate(argv)
                  if (word == "launch" and i > 0 and os.path.basename(argv[i - 1]) == "accelerate")
                  or word == "accelerate.commands.launch"
                  or os.path.basename(word) == "accelerate-launch"), None)
    if start is None:
        return None
    try:
        from accelerate.commands.launch import launch_command_parser
    except ImportError:
        return None
    parser = launch_command_parser()

    def _refuse(message: str):  # argparse would print usage and exit the worker
        raise ValueError(message)

    parser.error = _refuse
    try:
        known, _ = parser.parse_known_args(argv[start:])
    except (ValueError, TypeError):
        return None
    return known.num_processes if isinstance(known.num_processes, int) else None


def single_process_hint(plan_world_size: int) -> str:
    """Why a job may have one process where a plan has ``plan_world_size`` ranks, and the
    launch to use instead (the end of ``Plan.validate_for``'s world-size error)."""
    return (f"if you launched {plan_world_size} processes, stock `accelerate launch` started "
            "one: it does so on a machine without CUDA without `--config_file`, with `--cpu` "
            "or with `distributed_type: MULTI_CPU` (it expects mpirun), whatever "
            f"--num_processes says; launch `accelerate launch --config_file {CPU_CONFIG} "
            f"--num_processes {plan_world_size} train.py ...` (CPU workers over gloo; on GPUs "
            f"{GPU_CONFIG}; docs/accelerate.md)")


def check_launch(world_size: int, *, cuda_available: bool, environ: Mapping[str, str],
                 plan_world_size: int | None = None,
                 launcher_environ: Mapping[str, str] | None = None,
                 launcher_argv: Sequence[str] | None = None) -> None:
    """Raise ValueError when this job runs as one CPU process where several were asked for
    ([Note: one process where several were asked]). Pure: reads only its arguments.

    Args:
        world_size: the job's number of processes as the worker sees it.
        cuda_available: whether this worker sees CUDA (the check is for CPU-only machines).
        environ: the worker's environment variables.
        plan_world_size: the ranks of a plan given to the job, if any.
        launcher_environ: the environment the parent process (the launcher) started with, or
            None when unreadable; tells a ``MASTER_ADDR`` the simple launcher set apart from
            one the user's shell exported.
        launcher_argv: the parent process's command line, or None: the ``--num_processes``
            asked for, when it was given there (``requested_processes``).

    Raises:
        ValueError: the offending values, why, and the launch with ``accelerate_configs/
            cephalo_cpu.yaml`` to use instead.
    """
    if world_size != 1 or cuda_available or any(v in environ for v in _WORLD_VARIABLES):
        return  # several processes, a GPU machine, or a launcher that set the world (torchrun)
    plan_ranks = plan_world_size if plan_world_size is not None and plan_world_size > 1 else None
    if not all(v in environ for v in _SIMPLE_LAUNCHER_VARIABLES):  # no launcher at all
        if plan_ranks is not None:
            raise ValueError(
                f"the plan is for {plan_ranks} ranks but this job is one process started "
                f"without a launcher (no WORLD_SIZE): launch it with `accelerate launch "
                f"--config_file {CPU_CONFIG} --num_processes {plan_ranks} train.py ...` (CPU "
                f"workers over gloo; on GPUs {GPU_CONFIG}) or `torchrun --nproc_per_node "
                f"{plan_ranks} train.py ...`, or re-plan for one rank")
        return
    asked = requested_processes(launcher_argv)
    asked = asked if asked is not None and asked > 1 else None
    # the simple launcher sets MASTER_ADDR only for --num_processes > 1 or --num_machines > 1
    set_master = "MASTER_ADDR" in environ and (launcher_environ is None
                                               or "MASTER_ADDR" not in launcher_environ)
    if asked is not None:
        what = f"--num_processes {asked} was asked for"
    elif plan_ranks is not None:
        what = f"the plan is for {plan_ranks} ranks"
    elif set_master:
        what = (f"more than one process was asked for (the launcher set MASTER_ADDR="
                f"{environ['MASTER_ADDR']}, which it does only for --num_processes > 1 or "
                "--num_machines > 1)")
    else:
        return  # `accelerate launch train.py` for one process: nothing was asked of it
    n = asked or plan_ranks or "N"
    raise ValueError(
        f"this job has world size 1 but {what}: stock `accelerate launch` ran the script as ONE "
        "process (its simple launcher: no WORLD_SIZE/RANK reached it, ACCELERATE_USE_CPU="
        f"{environ['ACCELERATE_USE_CPU']}), which on a machine without CUDA it does without "
        "`--config_file`, with `--cpu`, or with `distributed_type: MULTI_CPU` (it expects "
        "mpirun); training would run on one rank. Launch with `accelerate launch --config_file "
        f"{CPU_CONFIG} --num_processes {n} train.py ...` (its distributed_type MULTI_GPU makes "
        "torchrun start the workers; Cephalo runs them on CPU over gloo; docs/accelerate.md), "
        f"or `torchrun --nproc_per_node {n} train.py ...`")


def _parent_file(name: str) -> bytes | None:
    try:
        with open(f"/proc/{os.getppid()}/{name}", "rb") as f:
            return f.read()
    except OSError:  # not Linux, or the parent is gone or another user's
        return None


def check_this_launch(world_size: int, plan_world_size: int | None = None) -> None:
    """``check_launch`` with what this process sees: its environment, ``torch.cuda``, and its
    parent's (the launcher's) start environment and command line from ``/proc`` (Linux).

    Raises:
        ValueError: as ``check_launch``.
    """
    import torch

    if world_size != 1:
        return  # the usual case: nothing to read
    raw_env, raw_argv = _parent_file("environ"), _parent_file("cmdline")
    launcher_environ = None if raw_env is None else dict(
        entry.split("=", 1) for entry in raw_env.decode(errors="replace").split("\0")
        if "=" in entry)
    launcher_argv = None if raw_argv is None else raw_argv.decode(errors="replace").split("\0")
    check_launch(world_size, cuda_available=torch.cuda.is_available(), environ=os.environ,
                 plan_world_size=plan_world_size, launcher_environ=launcher_environ,
                 launcher_argv=launcher_argv)
