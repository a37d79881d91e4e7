"""One process where several were asked for (hf_cephalo/launch_check.py) is refused, naming
``accelerate_configs/cephalo_cpu.yaml`` and why.

The environments below are what stock ``accelerate launch`` 1.15's simple launcher gave a worker
on this CPU-only machine (printed from inside the worker): ``--num_processes 2`` without a
config, and a config saying ``distributed_type: MULTI_CPU`` with ``num_processes: 2``; against
them the ones where nothing was asked for (``--num_processes 1``), a user's own MASTER_ADDR, a
torchrun worker and a plain ``python``. One real launch (``--num_processes 2``, no config) runs
a CephaloTrainer with a one-rank plan, which trained silently on one rank before.
"""

from __future__ import annotations

import os

import pytest

from hf_cephalo import launch_check
from hf_cephalo.launch_check import CPU_CONFIG, check_launch, requested_processes
from tests.dist_utils import budget_s, test_timeout
from tests.launch_utils import ROOT, start_launch, wait_all

# what accelerate's prepare_simple_launcher_cmd_env exported (besides the caller's environment)
SIMPLE = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DYNAMO_MODE": "default",
          "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False",
          "OMP_NUM_THREADS": "1"}
MASTER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # only for > 1 process / machine
ACCELERATE = ["/venv/bin/python", "/venv/bin/accelerate", "launch"]
TORCHRUN = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            **MASTER, **SIMPLE}
LAUNCH_S = 20.0  # a launch whose worker imports transformers and builds a tiny model


def _refusal(**kwargs) -> str:
    kwargs.setdefault("cuda_available", False)
    with pytest.raises(ValueError) as e:
        check_launch(1, **kwargs)
    return str(e.value)


def test_num_processes_without_config_is_refused():
    message = _refusal(environ={**SIMPLE, **MASTER}, launcher_environ={},
                       launcher_argv=[*ACCELERATE, "--num_processes", "2", "train.py", ""])
    assert message == (
        "this job has world size 1 but --num_processes 2 was asked for: stock `accelerate "
        "launch` ran the script as ONE process (its simple launcher: no WORLD_SIZE/RANK reached "
        "it, ACCELERATE_USE_CPU=False), which on a machine without CUDA it does without "
        "`--config_file`, with `--cpu`, or with `distributed_type: MULTI_CPU` (it expects "
        "mpirun); training would run on one rank. Launch with `accelerate launch --config_file "
        f"{CPU_CONFIG} --num_processes 2 train.py ...` (its distributed_type MULTI_GPU makes "
        "torchrun start the workers; Cephalo runs them on CPU over gloo; docs/accelerate.md), "
        "or `torchrun --nproc_per_node 2 train.py ...`")


def test_multi_cpu_config_is_refused_by_the_master_address_the_launcher_set():
    # the count is in the YAML, not on the command line: MASTER_ADDR tells that it was > 1
    message = _refusal(environ={**SIMPLE, **MASTER, "ACCELERATE_USE_CPU": "True"},
                       launcher_environ={"HOME": "/root"},
                       launcher_argv=[*ACCELERATE, "--config_file", "multicpu.yaml", "t.py"])
    assert message.startswith(
        "this job has world size 1 but more than one process was asked for (the launcher set "
        "MASTER_ADDR=127.0.0.1, which it does only for --num_processes > 1 or --num_machines "
        "> 1): stock `accelerate launch` ran the script as ONE process")
    assert f"--config_file {CPU_CONFIG} --num_processes N train.py" in message
    # unreadable /proc (not Linux): the variable alone decides
    assert "MASTER_ADDR=127.0.0.1" in _refusal(environ={**SIMPLE, **MASTER})


def test_a_plan_for_several_ranks_in_one_process_is_refused():
    assert "but the plan is for 3 ranks: stock `accelerate launch` ran the script" in _refusal(
        environ=SIMPLE, plan_world_size=3)
    assert _refusal(environ={"HOME": "/root"}, plan_world_size=3) == (
        "the plan is for 3 ranks but this job is one process started without a launcher (no "
        f"WORLD_SIZE): launch it with `accelerate launch --config_file {CPU_CONFIG} "
        "--num_processes 3 train.py ...` (CPU workers over gloo; on GPUs "
        "accelerate_configs/cephalo.yaml) or `torchrun --nproc_per_node 3 train.py ...`, or "
        "re-plan for one rank")


@pytest.mark.parametrize("case", ["one process asked", "the user's MASTER_ADDR", "torchrun",
                                  "plain python", "cuda", "two ranks", "one-rank plan"])
def test_launches_that_got_what_they_asked_for_pass(case):
    world_size, cuda, environ, launcher_environ, argv, plan = 1, False, SIMPLE, {}, None, None
    if case == "one process asked":  # no MASTER_ADDR: accelerate sets it only for > 1
        argv = [*ACCELERATE, "--num_processes", "1", "train.py"]
    elif case == "the user's MASTER_ADDR":  # exported in the shell, so the launcher had it too
        environ, launcher_environ = {**SIMPLE, **MASTER}, dict(MASTER)
        argv = [*ACCELERATE, "train.py", "--num_processes", "4"]  # the script's own flag
    elif case == "torchrun":
        environ = TORCHRUN
    elif case == "plain python":
        environ = dict(MASTER)
    elif case == "cuda":
        cuda, environ = True, {**SIMPLE, **MASTER}
    elif case == "two ranks":
        world_size, environ = 2, {**TORCHRUN, "WORLD_SIZE": "2"}
    else:
        plan = 1
    check_launch(world_size, cuda_available=cuda, environ=environ, plan_world_size=plan,
                 launcher_environ=launcher_environ, launcher_argv=argv)


def test_requested_processes_reads_accelerate_launch_flags():
    assert requested_processes([*ACCELERATE, "--num_processes", "2", "t.py"]) == 2
    assert requested_processes([*ACCELERATE, "--num-processes=3", "t.py"]) == 3
    assert requested_processes([*ACCELERATE, "--cpu", "t.py", "--num_processes", "4"]) is None
    assert requested_processes([*ACCELERATE, "--config_file", "c.yaml", "t.py"]) is None
    assert requested_processes(["/v/bin/python", "-m", "accelerate.commands.launch",
                                "--num_processes", "5", "t.py"]) == 5  # how the tests launch
    assert requested_processes(["/v/bin/accelerate-launch", "--num_processes=6", "t.py"]) == 6
    assert requested_processes(["/bin/bash"]) is None and requested_processes(None) is None
    assert requested_processes(["/bin/x", "launch", "--num_processes", "2", "t.py"]) is None
    assert requested_processes([*ACCELERATE]) is None  # no script: argparse's error, caught


def test_check_this_launch_reads_this_process_and_its_parent(monkeypatch):
    import torch

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                 "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**SIMPLE, **MASTER}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parent = {"environ": b"HOME=/root\0PATH=/bin\0",
              "cmdline": b"/venv/bin/python\0/venv/bin/accelerate\0launch\0--num_processes\0"
                         b"4\0train.py\0"}
    monkeypatch.setattr(launch_check, "_parent_file", parent.get)
    with pytest.raises(ValueError, match="world size 1 but --num_processes 4 was asked for"):
        launch_check.check_this_launch(1)
    launch_check.check_this_launch(2)  # several processes: nothing read, nothing refused
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    launch_check.check_this_launch(1)  # no launcher: a plain single-process run


def test_plan_world_size_error_says_why_for_one_process():
    from hf_cephalo.planner import Plan

    plan = Plan.from_ratios([2, 2], [1, 1], [0.5, 0.5])
    with pytest.raises(ValueError) as e:
        plan.validate_for(1, plan_file="plan.json")
    assert str(e.value) == (
        "plan file 'plan.json' is for world size 2 but the job has world size 1; if you "
        "launched 2 processes, stock `accelerate launch` started one: it does so on a machine "
        "without CUDA without `--config_file`, with `--cpu` or with `distributed_type: "
        "MULTI_CPU` (it expects mpirun), whatever --num_processes says; launch `accelerate "
        f"launch --config_file {CPU_CONFIG} --num_processes 2 train.py ...` (CPU workers over "
        "gloo; on GPUs accelerate_configs/cephalo.yaml; docs/accelerate.md). Otherwise re-run "
        "`hf-cephalo plan` for this cluster or drop --cephalo_plan_file to plan at start")
    with pytest.raises(ValueError) as e:  # another world size than 1: the message as before
        plan.validate_for(3)
    assert str(e.value) == ("plan is for world size 2 but the job has world size 3; re-run "
                            "`hf-cephalo plan` for this cluster")


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU-only launch")
@test_timeout(LAUNCH_S)
def test_accelerate_launch_num_processes_without_config_fails_fast(tmp_path):
    # an empty HF_HOME: no default accelerate config (`accelerate config`) can be picked up
    (tmp_path / "hf_home").mkdir()
    proc = start_launch(None, ROOT / "tests" / "launch_scripts" / "one_process_trainer.py",
                        (str(tmp_path / "out"),), launcher_args=("--num_processes", "2"),
                        env_extra={"HF_HOME": str(tmp_path / "hf_home")})
    [(rc, out)] = wait_all([proc], budget_s(LAUNCH_S))
    assert rc != 0 and "trained on world size" not in out, out[-4000:]
    assert ("ValueError: this job has world size 1 but --num_processes 2 was asked for: stock "
            "`accelerate launch` ran the script as ONE process") in out, out[-4000:]
    assert f"accelerate launch --config_file {CPU_CONFIG} --num_processes 2" in out
    assert os.path.isfile(ROOT / CPU_CONFIG)  # the config the message names ships
