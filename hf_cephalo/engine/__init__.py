"""Engine: uneven flat-parameter sharding and layered gradient accumulation (docs/design.md contract 4)."""

from .engine import CephaloEngine, EvalOutput, FullUnit, StepOutput
from .flat_param import ParamInfo, ShardedState, UnitShardMeta
from .stats import CollectiveStats

__all__ = ["CephaloEngine", "CollectiveStats", "EvalOutput", "FullUnit", "ParamInfo", "ShardedState",
           "StepOutput", "UnitShardMeta"]
