"""CephaloRLOOTrainer and CephaloRLOOConfig: TRL's ``RLOOTrainer`` on the Cephalo runtime.

The same door as ``CephaloGRPOTrainer`` (grpo.py; ``rollout_door.RolloutDoor``: one generation
batch of B rows per optimizer step, rank i its b_i rows, rewards gathered in global row order)
with RLOO's math, as one process with the whole batch computes it:

- the old policy's per-token log-probabilities at generation time (always, as RLOOTrainer),
  summed per row into ``old_logps``; with ``beta`` > 0 the reference's, and the KL of each row
  (sum over its completion of old - ref) subtracted from its reward, gathered with the rewards
  (``reward_clip_range`` first, as stock);
- the leave-one-out baseline per group over the global batch, then ``normalize_advantages``
  over the batch;
- RLOOTrainer's ``compute_loss`` per microbatch, a mean over its rows: share rows_mb / B.

Stock ``RLOOTrainer`` takes no ``rollout_func``; this door does (the same keyword as
``GRPOTrainer``'s), and without one it is refused (built-in generation lands separately).
docs/trl.md, "RLOO: CephaloRLOOTrainer", says how equivalence with stock is shown.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from trl import RLOOConfig, RLOOTrainer
except ImportError as exc:  # the optional extra
    raise ImportError("CephaloRLOOTrainer needs TRL: pip install 'hf-cephalo[trl]' "
                      "(trl>=1.16)") from exc

from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
from hf_cephalo.integrations.trl.config import (CephaloTRLConfig, TRLModelByName, TRLModelCard,
                                                 trl_config_dataclass)
from hf_cephalo.integrations.trl.rollout import Advantages
from hf_cephalo.integrations.trl.rollout_door import RolloutDoor, one_step_per_generation
from hf_cephalo.integrations.trl.rollout_step import RolloutStep
from hf_cephalo.integrations.trl.support import RLOO_FIELD_SUPPORT

__all__ = ["CephaloRLOOConfig", "CephaloRLOOTrainer", "rloo_advantages"]


@trl_config_dataclass(RLOOConfig)
class CephaloRLOOConfig(CephaloTRLConfig, RLOOConfig):
    """``RLOOConfig`` plus the ``cephalo_*`` settings (as ``CephaloGRPOConfig``: the
    generation batch is Cephalo's global batch B). Raises ValueError as
    ``CephaloTrainingArguments`` and ``RLOOConfig`` do; settings the engine cannot honour are
    refused by ``CephaloRLOOTrainer`` in one message (``refused_settings``)."""

    @staticmethod
    def cephalo_field_support() -> dict:
        """The table of this config's own fields (``support.training_args_problems``)."""
        return RLOO_FIELD_SUPPORT

    def refused_settings(self) -> dict[str, str]:
        """``CephaloTrainingArguments.refused_settings`` plus one generation batch per step."""
        refused = super().refused_settings()
        refused.update(one_step_per_generation(self))
        return refused


def rloo_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, kl: torch.Tensor | None,
                    beta: float, num_generations: int, clip_range, normalize: bool) -> Advantages:
    """RLOO's advantages of a whole generation batch (rewards_per_func: (B, num_funcs); kl:
    (B,) each row's summed old - ref log-ratio, or None), exactly as
    ``RLOOTrainer._generate_and_score_completions`` computes them on one process (TRL 1.16)."""
    from trl.trainer.utils import nanstd

    G = num_generations
    weights = weights.to(rewards_per_func.device).unsqueeze(0)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    rewards[unscorable] = torch.nan
    if clip_range:
        rewards = rewards.clamp(min=clip_range[0], max=clip_range[1])
    if beta != 0.0:
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, G)
    std = nanstd(grouped, dim=1) if G > 1 else torch.zeros(grouped.shape[0])
    if G > 1:
        counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1))
        advantages = rewards - baselines.view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    logged = (rewards_per_func * weights).nansum(dim=1)
    logged[unscorable] = torch.nan
    return Advantages(torch.nan_to_num(advantages, nan=0.0), logged,
                      torch.isclose(std, torch.zeros_like(std)))


class RLOORolloutStep(RolloutStep):
    """``RolloutStep`` with RLOOTrainer's decoding, old log-probabilities and advantages."""

    def _decode(self, prompts: list, prompt_ids: list, completion_ids: list) -> list:
        from trl.data_utils import is_conversational

        t = self.trainer
        if not prompts:
            return []
        contents = t.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        if is_conversational({"prompt": prompts[0]}):
            return [[{"role": "assistant", "content": c}] for c in contents]
        return contents

    @staticmethod
    def passes_per_round(args) -> int:
        """``RolloutStep.passes_per_round`` for RLOO: the old policy's pass always (as
        RLOOTrainer) plus the reference's with ``beta`` != 0."""
        return 1 + int(args.beta != 0.0)

    def _logprobs(self, microbatches: list[dict[str, Any]], rows: dict[str, Any]) -> None:
        """The old policy's per-token log-probabilities (summed per row: ``old_logps``) and,
        with beta, each row's KL to the reference (kept for the advantages and the ``kl``
        metric). Collective."""
        with torch.no_grad():
            old = self.policy(microbatches)
            ref = self.reference(microbatches) if self.reference is not None else None
        self._kl_rows, self._kl_tokens = [], []
        for k, (mb, logps) in enumerate(zip(microbatches, old)):
            mask = mb["completion_mask"]
            mb["old_logps"] = (logps * mask).sum(1)
            if ref is not None:
                per_token = (logps - ref[k]) * mask
                self._kl_rows.append(per_token.sum(-1))
                self._kl_tokens.append(mask.sum(-1).float())

    def _group_advantages(self, rewards_per_func: torch.Tensor, microbatches: list):
        t = self.trainer
        kl = None
        if t.beta != 0.0:
            kl = self._gather(torch.cat(self._kl_rows) if self._kl_rows else torch.zeros(0))
            tokens = self._gather(torch.cat(self._kl_tokens) if self._kl_tokens else torch.zeros(0))
            t._metrics["train"]["kl"].append((kl.sum() / tokens.sum().clamp(min=1.0)).item())
        return rloo_advantages(rewards_per_func, t.reward_weights, kl, t.beta, t.num_generations,
                               t.reward_clip_range, t.normalize_advantages)


class CephaloRLOOTrainer(TRLModelByName, TRLModelCard, RolloutDoor, CephaloTrainerMixin,
                         RLOOTrainer):
    """``RLOOTrainer`` on the Cephalo runtime (see the module note, ``CephaloGRPOTrainer`` and
    ``CephaloTrainerMixin`` for the arguments and errors). ``rollout_func(prompts, trainer)``:
    where completions come from, as ``GRPOTrainer``'s keyword (stock RLOOTrainer has none).

    Raises ``RefusedSettings`` (a ValueError, before any collective) as
    ``CephaloGRPOTrainer``; ``LoaderStepError`` on every rank when the rollout or a reward
    function raised on some rank."""

    _rollout_step_class = RLOORolloutStep

    def __init__(self, model, reward_funcs=None, args=None, *, rollout_func=None,
                 **kwargs: Any) -> None:
        self.rollout_func = rollout_func
        super().__init__(model, args, reward_funcs=reward_funcs, **kwargs)

    def _rollout_func_given(self, kwargs: dict[str, Any]) -> bool:
        return self.rollout_func is not None

    def _per_token_items(self) -> bool:
        return False  # RLOO's loss is a mean over rows

    def _loss_share(self, inputs: dict[str, Any], num_items_in_batch):
        """RLOOTrainer's loss is its microbatch's mean over rows; one process's over the
        batch's B rows: share rows_mb / B."""
        return inputs["input_ids"].shape[0] / num_items_in_batch
