"""Real `accelerate launch` runs of the shipped configs: 2 CPU processes over gloo.

Each launch costs several seconds, so there are few of them and the worker script
(tests/launch_scripts/check_accelerate.py) runs many checks inside each launched process.
Every launch runs in its own session under a hard timeout (tests/launch_utils.py); on timeout the
whole process group (launcher, torchrun and workers) is killed so a hang fails the test instead of
stalling CI.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.dist_utils import budget_s, free_port, test_timeout
from tests.launch_utils import ROOT, LaunchResult, start_launch, wait_all

pytestmark = pytest.mark.slow

CONFIGS = ROOT / "accelerate_configs"
WORKER = ROOT / "tests" / "launch_scripts" / "check_accelerate.py"
LAUNCH_S = 25.0  # a launch measured 5-19 s on 2 cores under load 6 ([Note: test time budgets])
LAUNCH_TIMEOUT_S = budget_s(LAUNCH_S)
pytestmark = [pytestmark, test_timeout(LAUNCH_S)]


def _launch(config: str, port: int, out_dir: Path, env_extra: dict[str, str] | None = None,
            extra_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = ()) -> subprocess.Popen:
    return start_launch(CONFIGS / config, WORKER, (str(out_dir), *worker_args), port=port,
                        launcher_args=extra_args, env_extra=env_extra)


def _wait_all(procs: list[subprocess.Popen]) -> list[LaunchResult]:
    return wait_all(procs, LAUNCH_TIMEOUT_S)


def _summaries(out_dir: Path, world_size: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def _check_multi_cpu(summaries: list[dict]) -> None:
    for rank, s in enumerate(summaries):
        assert s["rank"] == s["process_index"] == rank
        assert s["num_processes"] == s["world_size"] == 2  # the real number, not 1
        assert s["distributed_type"] == "DistributedType.MULTI_CPU" and s["backend"] == "gloo"
        assert s["cephalo_distributed_type"] == "CEPHALO" and s["use_cpu"] is True


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU (gloo) path")
def test_single_machine_cpu_config(tmp_path):
    from hf_cephalo.planner import Plan

    plan_file = tmp_path / "plan.json"
    Plan.from_ratios([2, 4], [1, 2], [0.6, 0.4]).save(plan_file)  # uneven batch and state
    env = {"HF_CEPHALO_GLOBAL_BATCH_SIZE": "6", "HF_CEPHALO_PLAN_FILE": str(plan_file)}
    [(rc, out)] = _wait_all([_launch("cephalo_cpu.yaml", free_port(), tmp_path, env_extra=env,
                                     worker_args=("train",))])
    assert rc == 0, out[-4000:]
    summaries = _summaries(tmp_path, 2)
    _check_multi_cpu(summaries)
    # the environment fallback reaches the workers through the launcher
    assert all(s["plugin_global_batch_size"] == s["args_global_batch_size"] == 6 for s in summaries)
    # 37 samples, b = (2, 5): 5 full steps + a last step of 2 split 1/1 (proportional 0.57/1.43)
    assert summaries[0]["local_steps"] == [2, 2, 2, 2, 2, 1]
    assert summaries[1]["local_steps"] == [5, 5, 5, 5, 5, 1]
    # CephaloTrainer end to end under the launcher: global loss identical on both ranks, going
    # down; the saved checkpoint reloads with from_pretrained and generates on rank 0
    train = [s["train"] for s in summaries]
    assert train[0]["losses"] == train[1]["losses"] and len(train[0]["losses"]) == 6
    assert train[0]["losses"][-1] < train[0]["losses"][0]
    assert train[0]["eval_loss"] == train[1]["eval_loss"]
    assert train[0]["sample"].startswith("The assert statement") and train[1]["sample"] is None
    assert "Cephalo plan: global batch size 6" in out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU (gloo) path")
def test_two_machines_on_loopback(tmp_path):
    port = free_port()
    procs = [_launch(f"cephalo_cpu_2machines_rank{r}.yaml", port, tmp_path) for r in range(2)]
    results = _wait_all(procs)
    for machine, (rc, out) in enumerate(results):
        assert rc == 0, f"machine_rank {machine}:\n{out[-4000:]}"
    _check_multi_cpu(_summaries(tmp_path, 2))


def test_bad_setting_fails_on_every_rank_without_hanging(tmp_path):
    [(rc, out)] = _wait_all([_launch("cephalo_cpu.yaml", free_port(), tmp_path,
                                     env_extra={"HF_CEPHALO_MEMORY_FRACTION": "2"})])
    assert rc != 0
    assert "memory_fraction = '2' (--cephalo_memory_fraction, CephaloPlugin(memory_fraction=...) or env HF_CEPHALO_MEMORY_FRACTION)" in out
    assert not list(tmp_path.glob("rank*.json"))
