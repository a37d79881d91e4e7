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

try:
    from trl import RewardConfig, RewardTrainer
except ImportError as exc:  # the optional extra
    raise ImportError("CephaloRewardTrainer needs TRL: pip install 'hf-cephalo[trl]' "
                      "(trl>=1.16)") from exc

from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
from hf_cephalo.integrations.trl.config import (CephaloTRLConfig, TRLModelByName, TRLModelCard,
                                                 trl_config_dataclass)
from hf_cephalo.integrations.trl.pairs import PairRows, unfold_pairs
from hf_cephalo.integrations.trl.support import REWARD_FIELD_SUPPORT
from hf_cephalo.models.base import Microbatch, WrappedStagedModel, refuse_global_loss

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


class CephaloRewardTrainer(TRLModelByName, TRLModelCard, CephaloTrainerMixin, RewardTrainer):
    """``RewardTrainer`` on the Cephalo runtime (see the module notes and
    ``CephaloTrainerMixin`` for the arguments and errors). ``model``: a
    ``*ForSequenceClassification`` object with ``num_labels=1`` (RewardTrainer's ValueError
    otherwise), or a Hub id / folder loaded on the meta device, each rank reading its shards
    (``TRLModelByName``).

    Logged per step: ``loss`` (the mean over the global batch's pairs), ``accuracy``,
    ``margin``, ``min_reward`` / ``mean_reward`` / ``max_reward`` and ``num_tokens``, those of
    the whole global batch ([Note: reward metrics of the global batch]).

    Raises ``RefusedSettings`` (a ValueError, before any collective, in the mixin's one
    refusal message) for: a train dataset without the columns RewardTrainer reads
    (``reward_problems``); an evaluation dataset or eval strategy (reward evaluation on the
    engine is not built); the config's refused values.
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
            raise ValueError(_NO_EVALUATION)
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

    def evaluate(self, *args: Any, **kwargs: Any):
        raise ValueError(_NO_EVALUATION)


_NO_EVALUATION = (
    "CephaloRewardTrainer does not evaluate yet: the reward model's evaluation loss and metrics "
    "through the engine are not built and tested; drop eval_dataset / evaluate() (and "
    "eval_strategy), and evaluate the saved model with stock RewardTrainer")


def reward_problems(args, kwargs: dict[str, Any]) -> list[str]:
    """The reward refusals that need the objects (datasets); one message each (empty: none)."""
    problems = []
    if kwargs.get("eval_dataset") is not None or (
            args is not None and str(getattr(args.eval_strategy, "value", args.eval_strategy))
            != "no"):
        problems.append(_NO_EVALUATION)
    train = kwargs.get("train_dataset")
    columns = _column_names(train)
    if columns is not None and not ({"chosen", "rejected"} <= columns or
                                    {"chosen_ids", "rejected_ids"} <= columns or
                                    {"chosen_input_ids", "rejected_input_ids"} <= columns):
        problems.append(
            f"train_dataset has the columns {sorted(columns)}: RewardTrainer needs a preference "
            "dataset with 'chosen' and 'rejected' (text or messages, optionally 'prompt' and "
            "'margin'), or tokenized 'chosen_ids' and 'rejected_ids'; rename or build those "
            "columns")
    return problems


def _column_names(dataset) -> set[str] | None:
    """A datasets ``Dataset``'s column names (None for anything else or an unknown schema)."""
    names = getattr(dataset, "column_names", None)
    return set(names) if isinstance(names, (list, tuple)) else None
