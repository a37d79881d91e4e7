"""Engine: uneven flat-parameter sharding and layered gradient accumulation (docs/design.md contract 4)."""

from .compile import CompileOptions, CompileStats
from .engine import CephaloEngine, StepOutput
from .evaluation import EvalOutput
from .checkpoint_files import CheckpointFiles, resolve_checkpoint
from .flat_param import ParamInfo, ShardedState, UnitShardMeta
from .loading import StartKind
from .precision import EnginePrecision
from .relayout import relayout_state
from .state_dicts import FullUnit
from .stats import CollectiveStats

__all__ = ["CephaloEngine", "CheckpointFiles", "CollectiveStats", "CompileOptions", "CompileStats",
           "EnginePrecision", "EvalOutput", "FullUnit",
           "ParamInfo", "ShardedState", "StartKind", "StepOutput", "UnitShardMeta",
           "relayout_state", "resolve_checkpoint"]
