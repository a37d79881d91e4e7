"""CephaloRewardTrainer and CephaloRewardConfig: TRL's ``RewardTrainer`` on the Cephalo runtime.

``CephaloTrainerMixin`` + ``RewardTrainer`` (``CephaloRewardConfig``: every ``RewardConfig``
field plus the ``cephalo_*`` settings): RewardTrainer tokenizes the pairs, sets the pad token and
builds its collator inside the mixin's ``super().__init__``, then the mixin builds the session.
docs/trl.md, "Reward models: CephaloRewardTrainer". Requires the ``trl`` extra (written against
TRL 1.16).

[Note: a reward pair is one sample]
TRL's ``DataCollatorForPreference`` returns the ``m`` chosen rows, then the ``m`` rejected ones
(and ``margin``, one value per pair); the loss ``-logsigmoid(r_c - r_r [- margin])`` plus
``center_rewards_coefficient * mean((r_c + r_r)^2)`` is a MEAN over pairs. So a pair is one sample
of the weighted split: ``pairs.PairRows`` folds a batch to one ``(2, ...)`` row per pair (both
sequences on one rank, in one microbatch, padded to the global batch's width), ``unfold_pairs``
restores TRL's layout before the engine runs a microbatch, and the item count is the number of
pairs (``RewardPairItems``): the microbatches' pair means times ``m / N`` add up to the global
batch's mean.

[Note: reward metrics of the global batch]
``RewardTrainer.compute_loss`` gathers the rewards (rows: concatenated over the microbatches by
the step's exchange, so min / mean / max are the global batch's) and the per-batch MEANS of
accuracy and margin, which the exchange would add up over microbatches. So the door also
reduces, per microbatch, the count of pairs with r_c > r_r and the sum of r_c - r_r, and sets
``accuracy`` and ``margin`` to those sums over the global batch's N pairs, as one process with
the whole batch computes them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

try:
    from trl import RewardConfig, RewardTrainer
except ImportError as exc:  # the optional extra
    raise ImportError("CephaloRewardTrainer needs TRL: pip install 'hf-cephalo[trl]' "
                      "(trl>=1.16)") from exc

from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
from hf_cephalo.integrations.trl.config import (CephaloTRLConfig, TRLModelByName, TRLModelCard,
                                                 dataset_columns, trl_config_dataclass)
from hf_cephalo.integrations.trl.pairs import PairPlanning, PairRows, unfold_pairs
from hf_cephalo.integrations.trl.support import REWARD_FIELD_SUPPORT
from hf_cephalo.runtime import Microbatch, WrappedStagedModel, refuse_global_loss

__all__ = ["CephaloRewardConfig", "CephaloRewardTrainer"]

_PER_PAIR_KEYS = ("margin",)  # one value per pair, not per row


class RewardPairItems(WrappedStagedModel):
    """The engine's item count of a reward microbatch: its pairs (half its rows)."""

    def __init__(self, inner) -> None:
        refuse_global_loss(inner, "TRL's reward loss")
        super().__init__(inner)

    def count_items(self, microbatch: Microbatch) -> int:
        ids = microbatch.get("input_ids")
        return 0 if ids is None else int(ids.shape[0]) // 2


class _OnePairOfZeros:
    """The replay's model (head_calls.py): one pair of zero rewards, so that TRL's
    ``logits.chunk(2)`` splits them; the replay's gathers are answered from the records, its
    loss discarded. Anything else is the stand-in model's."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, **inputs: Any):
        from transformers.modeling_outputs import SequenceClassifierOutput

        out = self._model(**inputs)
        return SequenceClassifierOutput(logits=out.logits.new_zeros((2, *out.logits.shape[1:])))


def _replay_pair(inputs: dict[str, Any]) -> dict[str, Any]:
    """The replay's zero-row inputs as ONE pair of zeros (``margin``: one value)."""
    out = {}
    for key, value in inputs.items():
        if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == 0:
            value = value.new_zeros((1 if key in _PER_PAIR_KEYS else 2, *value.shape[1:]))
        out[key] = value
    return out


@trl_config_dataclass(RewardConfig)
class CephaloRewardConfig(CephaloTRLConfig, RewardConfig):
    """``RewardConfig`` plus the ``cephalo_*`` settings (``CephaloTRLConfig``: the rules of
    ``CephaloTrainingArguments``; ``trl_config_dataclass``: RewardConfig's own defaults, e.g.
    ``learning_rate`` 1e-4).

    Raises ValueError as ``CephaloTrainingArguments`` and ``RewardConfig`` do; settings the
    engine cannot honour are refused by ``CephaloRewardTrainer`` in one message
    (``refused_settings``, the table ``REWARD_FIELD_SUPPORT``).
    """

    @staticmethod
    def cephalo_field_support() -> dict:
        """The table of this config's own fields (``support.training_args_problems``)."""
        return REWARD_FIELD_SUPPORT


class CephaloRewardTrainer(PairPlanning, TRLModelByName, TRLModelCard, CephaloTrainerMixin, RewardTrainer):
    """``RewardTrainer`` on the Cephalo runtime (see the module notes and
    ``CephaloTrainerMixin`` for the arguments and errors). ``model``: a
    ``*ForSequenceClassification`` object with ``num_labels=1`` (RewardTrainer's ValueError
    otherwise), or a Hub id / folder loaded on the meta device, each rank reading its shards
    (``TRLModelByName``).

    Logged per step: ``loss`` (the mean over the global batch's pairs), ``accuracy``,
    ``margin``, ``min_reward`` / ``mean_reward`` / ``max_reward`` and ``num_tokens``, those of
    the whole global batch ([Note: reward metrics of the global batch]).

    ``evaluate()`` / ``predict()`` (and ``eval_strategy``) run through the engine and give
    stock's numbers for the whole eval set in one batch ([Note: reward evaluation of the whole
    set], ``evaluation_loop``).

    Raises ``RefusedSettings`` (a ValueError, before any collective, in the mixin's one
    refusal message) for: a train or eval dataset without the columns RewardTrainer reads,
    ``include_for_metrics`` (``reward_problems``); the config's refused values.
    """

    def __init__(self, model: Any = None, args=None, **kwargs: Any) -> None:
        self._script_args = args  # read by _hook_problems, inside the mixin's __init__
        super().__init__(model, args, **kwargs)
        self.data_collator = PairRows(self.data_collator, _PER_PAIR_KEYS,
                                      "CephaloRewardTrainer")

    def _load_named_model(self, name: str, args, whole: bool = False):
        """A name, loaded as stock RewardTrainer loads it (``create_model_from_path`` with
        ``AutoModelForSequenceClassification``, ``num_labels=1``, after ``set_seed(seed)``), whole
        on every rank: the new ``score`` head is drawn from the whole model's random stream, as
        stock draws it; the engine shards it afterwards. ``model_init_kwargs`` are then hidden
        from RewardTrainer (it would say they "will be ignored")."""
        from transformers import AutoModelForSequenceClassification, set_seed
        from trl.trainer.reward_trainer import suppress_seqcls_warning
        from trl.trainer.utils import create_model_from_path

        kwargs = dict(args.model_init_kwargs or {})
        kwargs.update(device_map=None, num_labels=1)
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        set_seed(args.seed)
        with suppress_seqcls_warning():
            model = create_model_from_path(name, AutoModelForSequenceClassification, **kwargs)
        if args.model_init_kwargs:
            self._used_init_kwargs = (args, args.model_init_kwargs)
            args.model_init_kwargs = None
        return model

    def _hook_problems(self, model, kwargs: dict[str, Any]) -> list[str]:
        """The mixin's, plus ``reward_problems``: all in the one refusal message."""
        return super()._hook_problems(model, kwargs) + reward_problems(self._script_args,
                                                                       kwargs)

    def _engine_staged(self, staged):
        return RewardPairItems(staged)

    def _engine_microbatches(self, microbatches: list) -> list:
        return [unfold_pairs(mb, _PER_PAIR_KEYS) for mb in microbatches]

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """``RewardTrainer.compute_loss`` on this microbatch (its mean over the microbatch's m
        pairs), times m / N, N the global batch's pairs ([Note: a reward pair is one sample]);
        accuracy and margin of the global batch ([Note: reward metrics of the global batch])."""
        if return_outputs:
            raise ValueError(_NO_OUTPUTS)
        if inputs["input_ids"].shape[0] == 0:  # the step's replay (head_calls.py)
            inputs, model = _replay_pair(inputs), _OnePairOfZeros(model)
        pairs = inputs["input_ids"].shape[0] // 2
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        with torch.no_grad():
            chosen, rejected = outputs.logits.detach().float().squeeze(-1).chunk(2)
            sums = torch.stack([(chosen > rejected).float().sum(), (chosen - rejected).sum()])
            sums = self.accelerator.reduce(sums, "sum")  # the step's exchange: global sums
        mode = "train" if self.model.training else "eval"
        total = float(num_items_in_batch)
        self._metrics[mode]["accuracy"][-1] = (sums[0] / total).item()
        self._metrics[mode]["margin"][-1] = (sums[1] / total).item()
        return loss * pairs / num_items_in_batch

    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Stock ``evaluate`` / ``predict``'s loop through the engine ([Note: reward evaluation
        of the whole set]): every pair once, in dataset order.

        Returns ``EvalLoopOutput``, as stock's with the N pairs in one batch: ``predictions``
        (2N, 1) float32, the N chosen rewards then the N rejected ones (after
        ``preprocess_logits_for_metrics(predictions, ())``), ``label_ids`` () (RewardTrainer
        has no label names; both None with ``prediction_loss_only``), metrics
        ``{prefix}_loss`` (the mean over the N pairs) and ``compute_metrics``' (called with
        ``label_ids=()``, as stock); ``accuracy``, ``margin``, ``min_reward`` /
        ``mean_reward`` / ``max_reward`` of the whole set go to the eval metrics
        RewardTrainer's ``log`` adds (one entry per loop). Collective: every rank."""
        if prediction_loss_only is None:
            prediction_loss_only = self.args.prediction_loss_only
        self.model.eval()
        before = {key: list(values) for key, values in self._metrics["eval"].items()}
        loss_sum, num_items, local = 0.0, 0, []
        for indices, microbatches in zip(dataloader.batch_sampler.local_batches(), dataloader):
            microbatches = self._engine_microbatches(self._prepare_input(microbatches))
            out = self._engine_evaluate(microbatches, return_logits=True)
            if out.num_items:
                loss_sum += out.loss * out.num_items
                num_items += out.num_items
            local += _local_pairs(indices, out.logits)
        chosen, rejected = _gathered_pairs(local, dataloader.batch_sampler.dataset_length,
                                           self.args.world_size)
        self._metrics["eval"].clear()
        self._metrics["eval"].update(before)
        self._metrics["eval"]["num_tokens"] = [self._total_train_tokens]
        for key, value in _reward_metrics(chosen, rejected).items():
            self._metrics["eval"][key].append(value)
        metrics, predictions = {}, None
        if not prediction_loss_only:
            predictions = torch.cat([chosen, rejected]).unsqueeze(-1)
            if self.preprocess_logits_for_metrics is not None:
                predictions = self.preprocess_logits_for_metrics(predictions, ())
            predictions = predictions.numpy()
            if self.compute_metrics is not None:  # stock's labels: () (RewardTrainer has none)
                metrics = self.compute_metrics(EvalPrediction(predictions=predictions,
                                                              label_ids=()))
        metrics = denumpify_detensorize(metrics)
        if num_items:
            metrics["loss"] = loss_sum / num_items
        metrics = {k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}": v
                   for k, v in metrics.items()}
        return EvalLoopOutput(predictions=predictions,
                              label_ids=None if prediction_loss_only else (), metrics=metrics,
                              num_samples=dataloader.batch_sampler.dataset_length)


# [Note: reward evaluation of the whole set]
# Stock RewardTrainer evaluates through Trainer's loop: per eval batch, compute_loss appends
# that batch's metrics, and eval_loss is the mean of the batches' losses; with the whole eval
# set in ONE batch (per_device_eval_batch_size = N, one process) they are the whole set's.
# Here the eval loader splits the set by the plan's b_i (unshuffled), the engine runs each
# step's microbatches (the loss: each microbatch's pair mean x m / N_step, so the sum over
# steps of loss x N_step is the set's loss sum), and each pair's two rewards are gathered once,
# in dataset order: accuracy, margin and min / mean / max reward are computed from all of them,
# ONE entry per loop (the per-step entries compute_loss leaves are dropped), so the numbers are
# stock's one-batch ones whatever the plan and per_device_eval_batch_size.

_NO_OUTPUTS = (
    "CephaloRewardTrainer.compute_loss(return_outputs=True): the engine runs the model in "
    "layers and returns the loss only; use trainer.evaluate() / predict() (the rewards are "
    "predict()'s predictions)")


def _local_pairs(indices: list[int], logits: list[torch.Tensor]) -> list[tuple[int, float, float]]:
    """(dataset index, chosen reward, rejected reward) of each pair of this rank's eval step;
    ``logits``: one (2m, 1) tensor per microbatch, the m chosen rows first."""
    rows, position = [], 0
    for rewards in logits:
        chosen, rejected = rewards.detach().float().cpu().reshape(-1).chunk(2)
        for c, r in zip(chosen.tolist(), rejected.tolist()):
            rows.append((indices[position], c, r))
            position += 1
    return rows


def _gathered_pairs(local: list, num_pairs: int, world_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's pairs in dataset order: the chosen and the rejected rewards, (N,) each
    (float32). Collective with several processes. RuntimeError if a pair is missing or twice."""
    from accelerate.utils import gather_object

    rows = sorted(gather_object(local) if world_size > 1 else local)
    if [row[0] for row in rows] != list(range(num_pairs)):
        raise RuntimeError(f"reward evaluation gathered {len(rows)} pairs for {num_pairs} "
                           "(internal error: each pair must appear exactly once)")
    return (torch.tensor([row[1] for row in rows], dtype=torch.float32),
            torch.tensor([row[2] for row in rows], dtype=torch.float32))


def _reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """RewardTrainer.compute_loss's metrics of one batch holding these pairs (none for none)."""
    if chosen.numel() == 0:
        return {}
    rewards = torch.cat([chosen, rejected])
    return {"min_reward": rewards.min().item(), "mean_reward": rewards.mean().item(),
            "max_reward": rewards.max().item(),
            "accuracy": (chosen > rejected).float().mean().item(),
            "margin": (chosen - rejected).mean().item()}


def reward_problems(args, kwargs: dict[str, Any]) -> list[str]:
    """The reward refusals that need the objects (datasets); one message each (empty: none)."""
    problems = []
    if args is not None and getattr(args, "include_for_metrics", None):
        problems.append(
            f"include_for_metrics={list(args.include_for_metrics)} with CephaloRewardTrainer: "
            "stock hands compute_metrics each eval batch's inputs / losses, which the engine's "
            "reward evaluation (the rewards of every pair, gathered) does not reproduce; drop "
            "include_for_metrics and compute from the predictions (2N rewards, the N chosen "
            "first)")
    for name, columns in dataset_columns(kwargs):
        if not ({"chosen", "rejected"} <= columns or {"chosen_ids", "rejected_ids"} <= columns
                or {"chosen_input_ids", "rejected_input_ids"} <= columns):
            problems.append(
                f"{name} has the columns {sorted(columns)}: RewardTrainer needs a preference "
                "dataset with 'chosen' and 'rejected' (text or messages, optionally 'prompt' "
                "and 'margin'), or tokenized 'chosen_ids' and 'rejected_ids'; rename or build "
                "those columns")
    return problems

