"""Test order: the longest-running files first (measured), then the rest in pytest's order.

The README's test command runs two pytest workers that take whole files in collection order
(``--dist loadfile``; a worker is handed its next file while its current one still has two
tests to run); with the long files first, neither worker ends alone on one of them. Within a
file the order is pytest's, and a run of one file is unchanged. The order is each file's total
(setup + call + teardown, ``--durations=0``) run in one process on the 2-core development
machine under load, cold inductor cache; where such a run was not made, the file's phases in
the slowest 30 of a full run of the README's test command place it (the files not listed each
took less than ~20 s).

[Note: one compute thread per test process]
Every process the suite starts computes on one thread: ``OMP_NUM_THREADS=1`` is set here (unless
the caller set it), before any test module imports torch, so the pytest workers, the forkserver
that starts the ranks of tests/dist_utils.py (whose ranks also call ``torch.set_num_threads(1)``)
and every launched job inherit it. The suite runs two pytest workers, each often beside 2-3 rank
processes, on 2 cores: with torch's default (one OpenMP thread per core) the idle threads of one
process spin waiting for work while another process needs the core, and the tiny models' ops
gain nothing from a second thread. Measured: tests/test_models_heads.py's two largest tests took
98 s and 61 s with the default, 36 s and 31 s with one thread, beside the same load.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

SLOW_FIRST = ("test_examples.py", "test_models_coverage.py", "test_compile.py",
              "test_trainer_launch.py", "test_benchmarks_smoke.py", "test_elastic_launch.py",
              "test_heads_trainer_parity.py", "test_compile_trainer.py",
              "test_accelerate_launch.py", "test_generic_trainer_parity.py",
              "test_global_width.py", "test_models_exactness.py", "test_rank_errors.py",
              "test_trl_grpo.py", "test_engine_parity.py", "test_trl_dpo.py",
              "test_plan_memory.py", "test_models_registry.py", "test_planner_optimize.py",
              "test_trainer_lifted_refusals.py", "test_generic_engine_parity.py",
              "test_generic_doors.py", "test_models_heads.py", "test_parent_death.py",
              "test_trl_reward.py", "test_lora.py", "test_trl_kto.py", "test_export.py",
              "test_emulate.py", "test_accelerate_loop.py", "test_trl_sft.py",
              "test_mixed_precision.py", "test_adaptive.py", "test_models_seqcls.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable
