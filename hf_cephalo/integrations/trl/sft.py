"""CephaloSFTTrainer and CephaloSFTConfig: TRL's ``SFTTrainer`` on the Cephalo runtime.

Swap ``SFTTrainer`` for ``CephaloSFTTrainer`` and ``SFTConfig`` for ``CephaloSFTConfig``
(every ``SFTConfig`` field plus the ``cephalo_*`` settings); launch as any CephaloTrainer script
(docs/trl.md). The trainer is ``CephaloTrainerMixin`` + ``SFTTrainer``, as thin as TRL's own
subclasses: SFTTrainer prepares its datasets (chat template, completion / assistant masks,
packing) and its collator inside the mixin's ``super().__init__``, so the planner sees the
tokenized, packed rows; then the mixin builds the session. What SFT needs beyond the mixin is
declared, not re-implemented:

- SFTTrainer's own ``compute_loss`` runs per microbatch in the engine's head, its
  ``gather_for_metrics`` calls deferred to one exchange per step, so ``entropy``,
  ``mean_token_accuracy`` and ``num_tokens`` are those of the whole global batch ([Note:
  collectives inside the engine's head] in head_calls.py);
- its fused LM head (``loss_type`` nll / chunked_nll: no (B, T, V) logits) is answered from the
  engine's head (``trl_fused.FusedLMHead``);
- its padding-free collator (``padding_free``, bfd packing) is applied per microbatch
  (``runtime.sampler.packs_without_padding``);
- every ``SFTConfig`` field is classified (``trl_support.SFT_FIELD_SUPPORT``).

Requires the ``trl`` extra (``pip install hf-cephalo[trl]``; written against TRL 1.16).
"""

from __future__ import annotations

from typing import Any

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as exc:  # the optional extra
    raise ImportError("CephaloSFTTrainer needs TRL: pip install 'hf-cephalo[trl]' "
                      "(trl>=1.16)") from exc

from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
from hf_cephalo.integrations.trl.config import (CephaloTRLConfig, TRLModelByName, TRLModelCard,
                                                 trl_config_dataclass)
from hf_cephalo.integrations.trl.fused import FusedLMHead
from hf_cephalo.integrations.trl.support import SFT_FIELD_SUPPORT

__all__ = ["CephaloSFTConfig", "CephaloSFTTrainer"]

# what SFTTrainer.__init__ passes add_fused_lm_head (trl/trainer/sft_trainer.py, TRL 1.16)
_SFT_FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")


@trl_config_dataclass(SFTConfig)
class CephaloSFTConfig(CephaloTRLConfig, SFTConfig):
    """``SFTConfig`` plus the ``cephalo_*`` settings (``CephaloTRLConfig``: the rules of
    ``CephaloTrainingArguments``, environment fallbacks, validation in ``__post_init__``, CPU
    auto-detection; ``trl_config_dataclass``: SFTConfig's own defaults).

    TRL's defaults are kept (``bf16`` True unless ``fp16``, ``gradient_checkpointing`` True —
    the engine's own per-unit recompute, ``logging_steps`` 10, ``learning_rate`` 2e-5). Raises
    ValueError as ``CephaloTrainingArguments`` and ``SFTConfig`` do; settings the engine cannot
    honour are refused by ``CephaloSFTTrainer`` in one message (``refused_settings``).
    """

    @staticmethod
    def cephalo_field_support() -> dict:
        """The table of this config's own fields (``support.training_args_problems``)."""
        return SFT_FIELD_SUPPORT

    def refused_settings(self) -> dict[str, str]:
        """``CephaloTrainingArguments.refused_settings`` plus the SFT combinations the table
        cannot word per field (padding-free with ``pad_to_multiple_of``)."""
        refused = super().refused_settings()
        padding_free = self.padding_free or (self.packing and
                                             self.packing_strategy in ("bfd", "bfd_split"))
        if padding_free and self.pad_to_multiple_of is not None:
            refused["pad_to_multiple_of"] = (
                f"--pad_to_multiple_of = {self.pad_to_multiple_of} with padding-free batches "
                "(padding_free, or packing with a bfd strategy): Cephalo collates them per "
                "microbatch, so every microbatch's row would be padded instead of the global "
                "batch's once (num_tokens would count that padding); drop pad_to_multiple_of")
        return refused


class CephaloSFTTrainer(TRLModelByName, TRLModelCard, CephaloTrainerMixin, SFTTrainer):
    """``SFTTrainer`` on the Cephalo runtime (see the module note and ``CephaloTrainerMixin``
    for the arguments and errors). ``model``: a model object, or a Hub id / folder, loaded as
    stock TRL loads it but on the meta device, each rank reading its shards
    (``TRLModelByName``, ``pretrained.load_named_model``: ValueError for ``model_init_kwargs``
    it cannot honour)."""

    _hides_used_init_kwargs = True  # TRLModelByName: no false "will be ignored" warning

    def _engine_call_variants(self) -> dict[str, Any]:
        return {"fused_lm_head": FusedLMHead(outputs=_SFT_FUSED_OUTPUTS)}
