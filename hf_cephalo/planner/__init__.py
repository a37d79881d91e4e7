"""planner: the exact Cephalo optimizer (paper §2.4), pure Python/numpy.

Public API::

    from hf_cephalo.planner import optimize, Plan, RankPlan, layout_unit_shards, predict

Never imports torch (``hf-cephalo plan`` starts fast and the planner is tested without GPUs).
"""

from hf_cephalo.planner.optimize import InfeasiblePlanError, optimize, solve_assignment
from hf_cephalo.planner.predict import Prediction, predict
from hf_cephalo.planner.state import layout_unit_shards, partition_state
from hf_cephalo.planner.types import Plan, RankPlan

__all__ = [
    "optimize", "solve_assignment", "InfeasiblePlanError", "Plan", "RankPlan",
    "layout_unit_shards", "partition_state", "predict", "Prediction",
]
