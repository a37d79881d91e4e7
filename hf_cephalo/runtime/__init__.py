"""The Cephalo runtime: one core behind every front end (docs/design.md contract 8).

Planning at start / restart / live, the weighted split of the same global batches, the engine,
the optimizer over the shards, the loss scaler, checkpoints, the adaptive controller, the
accuracy report, elastic progress and the process group live here, taking one job description
(``job.Job``); ``CephaloTrainer``, ``CephaloAccelerator.prepare`` and the TRL trainers are thin
adapters over it. It imports no ``transformers.Trainer``.
"""

from hf_cephalo.lazy import lazy_exports

# engine types the doors name (they import no hf_cephalo.engine), imported lazily:
# ``hf_cephalo.runtime.settings`` is read by ``hf-cephalo plan``, which needs no engine
_EXPORTS = {"CompileOptions": "hf_cephalo.engine.compile",
            "EnginePrecision": "hf_cephalo.engine.precision"}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
