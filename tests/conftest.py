"""Test order: the longest-running files first (measured), then the rest in pytest's order.

The README's test command runs two pytest workers that take whole files in collection order
(``--dist loadfile``); with the long files first, neither worker ends alone on one of them.
Within a file the order is pytest's, and a run of one file is unchanged. The order is each file's
share of the 120 slowest test phases (``--durations=120``) of a full run of the README's test
command, longest first (the files not listed each had less than 40 s there)."""

SLOW_FIRST = ("test_models_coverage.py", "test_examples.py", "test_compile.py",
              "test_compile_trainer.py", "test_trl_grpo.py", "test_benchmarks_smoke.py",
              "test_elastic_launch.py", "test_trainer_launch.py", "test_trl_dpo.py",
              "test_models_seqcls.py", "test_models_exactness.py", "test_accelerate_launch.py",
              "test_rank_errors.py", "test_generic_trainer_parity.py",
              "test_trainer_lifted_refusals.py", "test_global_width.py", "test_engine_parity.py",
              "test_trl_reward.py", "test_lora.py", "test_generic_doors.py", "test_trl_kto.py",
              "test_export.py", "test_emulate.py", "test_models_heads.py",
              "test_accelerate_loop.py", "test_trl_sft.py", "test_mixed_precision.py",
              "test_parent_death.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable
