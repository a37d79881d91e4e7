"""`hf-cephalo plan` end to end (in-process `main`, plus one console-script run)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_cephalo.cli import SUBCOMMANDS, main
from hf_cephalo.planner.types import Plan


def test_plan_from_cluster_yaml(tmp_path, capsys):
    out, png, prof = tmp_path / "plan.json", tmp_path / "plan.png", tmp_path / "profile.json"
    rc = main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "llama-3b",
               "--global-batch-size", "256", "--out", str(out), "--plot", str(png),
               "--save-profile", str(prof)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "predicted iteration time" in text and "samples/s" in text
    assert "spec-sheet estimates" in text
    for dev in ("L4", "A6000", "P40", "P100"):
        assert dev in text
    plan = Plan.load(out)
    assert plan.global_batch_size == 256 and plan.world_size == 8
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the saved profile plans to the same result
    out2 = tmp_path / "plan2.json"
    assert main(["plan", "--profile", str(prof), "-B", "256", "--out", str(out2)]) == 0
    assert Plan.load(out2).batch_sizes == plan.batch_sizes


def test_plan_errors_exit_2(tmp_path, capsys):
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "-B", "8"]) == 2
    assert "--cluster needs --model" in capsys.readouterr().err
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "llama-3b",
                 "-B", "0"]) == 2
    assert "global batch size must be an integer >= 1" in capsys.readouterr().err
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "gpt-99b",
                 "-B", "8"]) == 2
    assert "unknown model 'gpt-99b'" in capsys.readouterr().err
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"model": {}, "comm": {}, "devices": []}))
    assert main(["plan", "--profile", str(bad), "-B", "8"]) == 2
    assert "missing field" in capsys.readouterr().err
    # infeasible: aggregate memory names the binding constraint
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "vit-e",
                 "-B", "64", "--memory-fraction", "0.2"]) == 2
    assert "aggregate memory" in capsys.readouterr().err


def test_registry_holds_plan():
    assert "plan" in SUBCOMMANDS
    with pytest.raises(SystemExit):
        main(["--help"])


def test_console_script():
    exe = shutil.which("hf-cephalo", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("console script not installed")
    r = subprocess.run([exe, "plan", "--cluster", "examples/clusters/cluster_b.yaml", "--model",
                        "llama-7b", "-B", "512"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("A10G") == 16 and r.stdout.count("T4") == 32
