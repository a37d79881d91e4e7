"""The Cephalo runtime: one core behind every front end (docs/design.md contract 8).

Planning at start / restart / live, the weighted split of the same global batches, the engine,
the optimizer over the shards, the loss scaler, checkpoints, the adaptive controller, the
accuracy report, elastic progress and the process group live here, taking one job description
(``job.Job``); ``CephaloTrainer``, ``CephaloAccelerator.prepare`` and the TRL trainers are thin
adapters over it. It imports no ``transformers.Trainer``.
"""

__all__ = ["CompileOptions"]


def __getattr__(name: str):
    """``CompileOptions`` (the engine's torch.compile settings, for the doors), imported lazily:
    ``hf_cephalo.runtime.settings`` is read by ``hf-cephalo plan``, which needs no engine."""
    if name == "CompileOptions":
        from hf_cephalo.engine import CompileOptions
        return CompileOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
