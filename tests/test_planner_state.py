"""Greedy state partition and the per-unit shard layout (docs/design.md contract 2, paper §3)."""

import numpy as np
import pytest

from hf_cephalo.planner.state import integer_targets, layout_unit_shards, partition_state


def _check_ratio_split(layout, ratios, numels):
    """Every unit is split by the ratios (each piece within 2 elements of r_i * numel_u) and
    every rank's running total within 1 element of its exact share (docs: [Note: ratio-split
    layout] in planner/state.py)."""
    r = np.asarray(ratios, dtype=np.float64) / np.sum(ratios)
    lay = np.asarray(layout, dtype=np.float64).reshape(len(numels), len(r))
    assert np.abs(lay - np.outer(numels, r)).max(initial=0) < 2
    assert np.abs(np.cumsum(lay, axis=0) - np.outer(np.cumsum(numels), r)).max(initial=0) < 1


def test_three_to_one_over_two_equal_units():
    # every unit split 3:1, not one unit 1:1 and one 1:0 (which made a padded all-gather of the
    # 1:0 unit move 2x the even bytes)
    assert layout_unit_shards([0.75, 0.25], [4, 4]) == [[3, 1], [3, 1]]
    layout = layout_unit_shards([0.7, 0.2, 0.1], [1000] * 5)
    assert layout == [[700, 200, 100]] * 5


def test_even_ratios_give_even_units():
    layout = layout_unit_shards([0.25] * 4, [100, 100, 37])
    assert layout[0] == [25] * 4 and layout[1] == [25] * 4
    assert sorted(layout[2]) == [9, 9, 9, 10]


def test_unequal_units_root_last_and_zero_ratio():
    ratios = [0.5, 0.3, 0.0, 0.2]
    numels = [1000, 1000, 1000, 5003]  # root unit last, larger than the layers
    layout = layout_unit_shards(ratios, numels)
    assert [sum(row) for row in layout] == numels
    totals = np.sum(layout, axis=0).tolist()
    assert totals == integer_targets(ratios, sum(numels))
    assert all(row[2] == 0 for row in layout)
    _check_ratio_split(layout, ratios, numels)


def test_random_layouts_are_exact_and_ratio_split():
    rng = np.random.default_rng(5)
    for _ in range(500):
        n = int(rng.integers(1, 6))
        ratios = rng.dirichlet(np.ones(n) * rng.choice([0.1, 1.0]))
        if rng.random() < 0.3:
            ratios[int(rng.integers(0, n))] = 0.0
            if ratios.sum() == 0:
                ratios[0] = 1.0
            ratios = ratios / ratios.sum()
        numels = rng.integers(0, 50, size=int(rng.integers(1, 7))).tolist()
        layout = layout_unit_shards(ratios.tolist(), numels)
        assert [sum(row) for row in layout] == numels
        assert all(x >= 0 for row in layout for x in row)
        _check_ratio_split(layout, ratios.tolist(), numels)
        for i, r in enumerate(ratios):
            if r == 0:
                assert all(row[i] == 0 for row in layout)


def test_even_ratios_keep_divisible_units_exactly_even():
    # the equal-size collective fast path needs exactly equal shards
    for n in (2, 3, 4, 8):
        layout = layout_unit_shards([1.0 / n] * n, [n * 1000, n * 7, n * 123457, 0])
        assert all(len(set(row)) == 1 for row in layout), (n, layout)


@pytest.mark.parametrize("ratios", [[0.5, 0.6], [1.2, -0.2], [float("nan"), 1.0], []])
def test_bad_ratios_are_rejected_with_values(ratios):
    with pytest.raises(ValueError, match="ratios"):
        layout_unit_shards(ratios, [10, 10])


def test_partition_minimizes_max_utilization():
    S = 100.0
    mem, cap = [10.0, 50.0, 0.0], [100.0, 100.0, 50.0]
    r = partition_state(S, mem, cap)
    assert sum(r) == pytest.approx(1.0)
    util = [(ri * S + m) / c for ri, m, c in zip(r, mem, cap)]
    # water level: (100 + 10 + 50 + 0) / 250 = 0.64 for all three
    assert util == pytest.approx([0.64] * 3)
    # a rank already above the level gets no state
    r = partition_state(10.0, [90.0, 0.0], [100.0, 100.0])
    assert r == pytest.approx([0.0, 1.0])
    # brute-force check on random instances: no other split lowers the maximum
    rng = np.random.default_rng(0)
    for _ in range(50):
        mem, cap = rng.uniform(0, 5, 3), rng.uniform(5, 10, 3)
        r = np.array(partition_state(7.0, mem, cap))
        best = max((r * 7.0 + mem) / cap)
        for other in rng.dirichlet(np.ones(3), size=200):
            assert max((other * 7.0 + mem) / cap) >= best - 1e-12
