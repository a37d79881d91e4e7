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
- every ``SFTConfig`` field is classified (``trl_support.SFT_FIELD_SUPPORT``);
- a MoE's router load-balancing loss is the engine's, over the global batch ([Note: router
  loss in the SFT door]).

[Note: router loss in the SFT door]
SFTTrainer adds ``router_aux_loss_coef * outputs.aux_loss`` to each ``compute_loss`` call (the
router loss of that call's rows) and logs ``aux_loss``. The engine adds ``coef * aux`` of the
WHOLE global batch once per step, with its exact gradient into every layer's router
([Note: global router loss] in models/router_loss.py); TRL's term, added per microbatch in the
head, would count it once per microbatch and give the routers no gradient (the layers ran
before the head). So while ``compute_loss`` runs, this door reads TRL's coefficient as 0 (the
``router_aux_loss_coef`` property): TRL's loss is the token loss, and the fused head still
answers ``aux_loss`` with the global batch's value, so the logged ``aux_loss`` is stock's.
SFTTrainer's ``__init__`` switches the config's ``output_router_logits`` on (coefficient != 0)
or off and writes its coefficient into the config, after the mixin staged the model: the door
then sets the model's own ``router_aux_loss_coef`` to it and stages the model again
(``_restage_after_init``), so the engine adds exactly the term stock SFT adds.

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
    _global_loss_apart = True  # [Note: router loss in the SFT door]
    _loss_running = False

    @property
    def router_aux_loss_coef(self) -> float:
        """SFTTrainer's router loss coefficient; 0.0 while ``compute_loss`` runs, where the
        engine adds the term itself ([Note: router loss in the SFT door])."""
        return 0.0 if self._loss_running else self._router_coef

    @router_aux_loss_coef.setter
    def router_aux_loss_coef(self, value: float) -> None:
        self._router_coef = value

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """SFTTrainer's ``compute_loss``, its router term left to the engine."""
        held, self._loss_running = self._loss_running, True
        try:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        finally:
            self._loss_running = held

    def _restage_after_init(self, staged) -> bool:
        """After SFTTrainer set the config's ``output_router_logits`` and coefficient: the
        model's own coefficient follows the config, and the model is staged again when the
        router loss it adds (on / off, coefficient) is not the one TRL trains with."""
        text = self.model.config.get_text_config()
        if not hasattr(text, "router_aux_loss_coef"):
            return False
        coef, changed = text.router_aux_loss_coef, False
        for module in self.model.modules():  # the causal LM reads its own copy
            own = getattr(module, "router_aux_loss_coef", None)
            if isinstance(own, (int, float)) and not isinstance(own, bool) and own != coef:
                module.router_aux_loss_coef, changed = coef, True
        router = getattr(staged, "router", None)
        return changed or bool(getattr(text, "output_router_logits", False)) != (router is not None)

    def _engine_call_variants(self) -> dict[str, Any]:
        return {"fused_lm_head": FusedLMHead(outputs=_SFT_FUSED_OUTPUTS)}
