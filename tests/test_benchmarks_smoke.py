"""Every benchmark in benchmarks/ runs: its ``--smoke`` mode (smallest sizes, one timed step),
in this one process, so none breaks unnoticed (a benchmark's numbers are not checked here:
they are meaningless at these sizes). The ranks of the multi-rank ones come from one
forkserver that imports torch, transformers and hf_cephalo once (benchmarks/rank_launch.py).
And a rank that dies ends the benchmark's other ranks at once.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest
import torch

from tests.dist_utils import test_timeout

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")
pytestmark = test_timeout(120.0)

# benchmark -> a line its smoke run prints (its report ran to the end)
SMOKE = {
    "bench_planner": "reference recurrence on Cluster B",
    "bench_padding": "padded tokens / real tokens",
    "bench_generic": "self-check at start",
    "model_coverage": "Of 1 classes, 1 build; of those 1 are exact",
    "bench_precision_error": "| fp32 |",
    "bench_collectives": "even, variable: all-gathers",
    "bench_dataload": "",
    "bench_engine": "physical bound",
    "bench_hetero": "per rank, unit compute per step",
    "bench_adaptive": "load average at the end",
    "bench_loop": "system",
    "bench_relayout": "2 ranks: r =",
    "bench_load_memory": "export == saved",
    "bench_save_memory": "rank 0 peak-base / P",
    "bench_memory": "(a) old: hf_cephalo at",
    "bench_sft": "",
    "bench_generation": "completions identical across the four ways: True",
    "bench_grpo": "Cephalo even vs planned: same completions: True",
    "bench_startup": "Cephalo, cached profile, rank 0's start: import hf_cephalo",
}


@pytest.fixture(scope="module", autouse=True)
def _benchmark_imports():
    sys.path.insert(0, BENCHMARKS)
    yield
    sys.path.remove(BENCHMARKS)


@pytest.fixture()
def _restored(monkeypatch):
    """Ranks from the forkserver; the environment, torch's threads and transformers' log
    verbosity as they were after (a later test in this process reads transformers' logs)."""
    from rank_launch import START_ENV

    import transformers

    env, threads = dict(os.environ), torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()  # model_coverage sets it to errors
    monkeypatch.setenv(START_ENV, "forkserver")
    yield
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)


@pytest.mark.parametrize("name", list(SMOKE))
def test_benchmark_smoke_mode_runs(name, _restored):
    module = __import__(name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = module.main(["--smoke"])
    text = out.getvalue()
    assert status in (None, 0), text
    assert SMOKE[name] in text and text.strip(), text


def test_accelerate_examples_has_a_smoke_mode():
    """accelerate_examples.py runs Accelerate's own example scripts from a checkout of its
    repository, which the suite does not have: its --smoke needs --accelerate PATH."""
    checkout = os.environ.get("HF_CEPHALO_ACCELERATE_CHECKOUT")
    if not checkout:
        pytest.skip("set HF_CEPHALO_ACCELERATE_CHECKOUT to a checkout of Accelerate's "
                    "repository (and pip install evaluate) to run accelerate_examples.py --smoke")
    sys.path.insert(0, BENCHMARKS)
    import accelerate_examples

    assert accelerate_examples.main(["--accelerate", checkout, "--smoke"]) == 0


def _dies_or_hangs(rank, out):
    """Rank 1 raises at once; rank 0 hangs (as a rank blocked in a collective whose backend
    never notices the dead peer), forever but for being ended."""
    import time

    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    while True:
        time.sleep(1)


def test_a_dead_rank_ends_the_others_at_once(_restored):
    from rank_launch import run_ranks

    # the hanging rank 0 is ended by run_ranks: within this test's timeout, not the hour's
    with pytest.raises(RuntimeError, match=r"^benchmark rank 1 exited with status 1 "):
        run_ranks(_dies_or_hangs, [(0,), (1,)], timeout_s=3600)
