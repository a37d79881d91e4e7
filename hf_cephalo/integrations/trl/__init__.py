"""The TRL doors (the ``trl`` extra): ``CephaloSFTTrainer`` / ``CephaloSFTConfig``,
``CephaloDPOTrainer`` / ``CephaloDPOConfig``, ``CephaloGRPOTrainer`` / ``CephaloGRPOConfig`` and
``CephaloRLOOTrainer`` / ``CephaloRLOOConfig``, drop-ins for TRL's (names imported lazily: the
package imports without trl)."""

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
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
