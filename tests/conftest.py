"""Test order: the longest-running files first (measured), then the rest in pytest's order.

The README's test command runs two pytest workers that take whole files in collection order
(``--dist loadfile``); with the long files first, neither worker ends alone on one of them.
Within a file the order is pytest's, and a run of one file is unchanged."""

SLOW_FIRST = ("test_examples.py", "test_elastic_launch.py", "test_trainer_launch.py",
              "test_trl_grpo.py", "test_benchmarks_smoke.py", "test_engine_parity.py",
              "test_compile_trainer.py", "test_models_coverage.py",
              "test_global_width.py", "test_accelerate_launch.py", "test_compile.py",
              "test_rank_errors.py", "test_generic_trainer_parity.py", "test_loading.py",
              "test_parent_death.py", "test_plan_memory.py", "test_mixed_precision.py",
              "test_models_engine_parity.py", "test_trl_sft.py", "test_trl_dpo.py",
              "test_trl_kto.py", "test_trl_reward.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable
