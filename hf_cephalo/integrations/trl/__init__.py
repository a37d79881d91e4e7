"""The TRL doors (the ``trl`` extra): ``CephaloSFTTrainer`` / ``CephaloSFTConfig``,
``CephaloDPOTrainer`` / ``CephaloDPOConfig``, ``CephaloGRPOTrainer`` / ``CephaloGRPOConfig`` and
``CephaloRLOOTrainer`` / ``CephaloRLOOConfig``, ``CephaloRewardTrainer`` / ``CephaloRewardConfig``
and ``CephaloKTOTrainer`` / ``CephaloKTOConfig``, drop-ins for TRL's, and
``reproducible_rollout`` (a ``rollout_func`` for stock GRPOTrainer that samples as the engine
does) (names imported lazily: the package imports without trl)."""

from hf_cephalo.lazy import lazy_exports

_EXPORTS = {
    "CephaloSFTTrainer": "sft",
    "CephaloSFTConfig": "sft",
    "CephaloDPOTrainer": "dpo",
    "CephaloDPOConfig": "dpo",
    "CephaloRewardTrainer": "reward",
    "CephaloRewardConfig": "reward",
    "CephaloKTOTrainer": "kto",
    "CephaloKTOConfig": "kto",
    "CephaloGRPOTrainer": "grpo",
    "CephaloGRPOConfig": "grpo",
    "CephaloRLOOTrainer": "rloo",
    "CephaloRLOOConfig": "rloo",
    "reproducible_rollout": "reproducible",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
