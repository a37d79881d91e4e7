"""CephaloDPOTrainer and CephaloDPOConfig: TRL's ``DPOTrainer`` on the Cephalo runtime.

``CephaloTrainerMixin`` + ``DPOTrainer`` (``CephaloDPOConfig``: every ``DPOConfig`` field plus
the ``cephalo_*`` settings): DPOTrainer tokenizes the pairs and builds its collator and reference
inside the mixin's ``super().__init__``, then the mixin builds the session. docs/trl.md, "DPO:
CephaloDPOTrainer". Requires the ``trl`` extra (written against TRL 1.16).

[Note: a preference pair is one sample]
TRL's collator returns the ``m`` chosen rows, then the ``m`` rejected ones, and the DPO loss is a
MEAN over pairs. So a pair is one sample of the weighted split: ``pairs.PairRows`` folds a batch to one
``(2, ...)`` row per pair (both sequences stay on one rank, in one microbatch, padded as one
process pads the global batch), ``unfold_pairs`` restores TRL's layout before the engine runs a
microbatch, and the item count is the number of pairs (``PairItems``), so the microbatches' pair
means times ``m / N`` add up to the global batch's mean. Loss types that are not a mean of
per-pair terms (``aot``, ``aot_unpaired``, ``sft``) are refused.

[Note: the reference log-probabilities]
``DPOTrainer.compute_loss`` runs in the engine's head per microbatch, where no second model can
run, so the reference log-probabilities come with the batch (``ref_chosen_logps`` /
``ref_rejected_logps``), as with TRL's ``precompute_ref_log_probs``: precomputed by TRL before
planning, or each step by a forward-only pass over this rank's microbatches, through a second
engine over the ``ref_model`` sharded by the same plan's r_i (``Session.forward_only_engine``),
or through the policy's own engine with its adapters disabled (PEFT without ``ref_model``).
The three ways in detail: docs/trl.md, "DPO: CephaloDPOTrainer".
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers.trainer_utils import EvalLoopOutput

try:
    from trl import DPOConfig, DPOTrainer
except ImportError as exc:  # the optional extra
    raise ImportError("CephaloDPOTrainer needs TRL: pip install 'hf-cephalo[trl]' "
                      "(trl>=1.16)") from exc

from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
from hf_cephalo.integrations.trl.config import (CephaloTRLConfig, TRLModelByName, TRLModelCard,
                                                 trl_config_dataclass)
from hf_cephalo.integrations.trl.fused import FusedLMHead
from hf_cephalo.integrations.trl.pairs import PairPlanning, PairRows, unfold_pairs
from hf_cephalo.integrations.trl.support import DPO_FIELD_SUPPORT
from hf_cephalo.integrations.trl.whole_eval import evaluate_whole_set, no_predict
from hf_cephalo.runtime import HeadView, Microbatch, WrappedStagedModel, refuse_global_loss

__all__ = ["CephaloDPOConfig", "CephaloDPOTrainer"]

# what DPOTrainer.__init__ passes add_fused_lm_head (trl/trainer/dpo_trainer.py, TRL 1.16)
_DPO_FUSED_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
_REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")  # one value per pair
_BATCH_LOSSES = {
    "aot": "sorts the log-ratios of the whole batch (a pair's term depends on the others)",
    "aot_unpaired": "sorts the log-ratios of the whole batch (a pair's term depends on the "
                    "others)",
    "sft": "a token mean over the batch's chosen completions, not a mean of per-pair terms",
}


class PairItems(WrappedStagedModel):
    """The engine's item count of a DPO microbatch: its pairs (half its rows). Inside
    ``reference(head)``: no items (no loss) and, as the head's "logits", each row's per-token
    completion log-probabilities (2m, S - 1) from TRL's fused head ``head`` on the final hidden
    states — the computation of TRL's own reference forward."""

    def __init__(self, inner) -> None:
        refuse_global_loss(inner, "TRL's DPO loss")
        super().__init__(inner)
        self._reference_head: FusedLMHead | None = None

    @contextlib.contextmanager
    def reference(self, head: FusedLMHead):
        self._reference_head = head
        try:
            yield
        finally:
            self._reference_head = None

    def count_items(self, microbatch: Microbatch) -> int:
        ids = microbatch.get("input_ids")
        if self._reference_head is not None or ids is None or \
                microbatch.get("completion_mask") is None:
            return 0
        return int(ids.shape[0]) // 2

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        if self._reference_head is None:
            return self.inner.head_logits(hidden, microbatch, ctx)
        labels = microbatch["input_ids"].masked_fill(microbatch["completion_mask"] == 0, -100)
        return self._reference_head(HeadView(self.inner, hidden, microbatch, ctx),
                                    {"labels": labels}).log_probs


def _replay_pair(inputs: dict[str, Any]) -> dict[str, Any]:
    """The replay's zero-row inputs (head_calls.py) as ONE pair of zeros, so that TRL's
    ``logps.chunk(2)`` splits them; the replay's gathers are answered from the records, its
    loss discarded."""
    out = {}
    for key, value in inputs.items():
        if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == 0:
            value = value.new_zeros((1 if key in _REF_KEYS else 2, *value.shape[1:]))
        out[key] = value
    return out


@trl_config_dataclass(DPOConfig)
class CephaloDPOConfig(CephaloTRLConfig, DPOConfig):
    """``DPOConfig`` plus the ``cephalo_*`` settings (``CephaloTRLConfig``: the rules of
    ``CephaloTrainingArguments``; ``trl_config_dataclass``: DPOConfig's own defaults).

    Raises ValueError as ``CephaloTrainingArguments`` and ``DPOConfig`` do; settings the engine
    cannot honour are refused by ``CephaloDPOTrainer`` in one message (``refused_settings``).
    """

    @staticmethod
    def cephalo_field_support() -> dict:
        """The table of this config's own fields (``support.training_args_problems``)."""
        return DPO_FIELD_SUPPORT

    def refused_settings(self) -> dict[str, str]:
        """``CephaloTrainingArguments.refused_settings`` plus the DPO values the table cannot
        word per field: the loss types that are not a mean of per-pair terms."""
        refused = super().refused_settings()
        if self.ld_alpha is not None and not self.precompute_ref_log_probs:
            refused["ld_alpha"] = (
                f"--ld_alpha = {self.ld_alpha} with a reference computed each step: the step's "
                "reference pass sums whole completions (integrations/trl/dpo.py); set "
                "precompute_ref_log_probs=True (TRL weights the reference as stock), or drop "
                "ld_alpha")
        batch = [t for t in self.loss_type if t in _BATCH_LOSSES]
        if batch:
            why = "; ".join(f"{t}: {_BATCH_LOSSES[t]}" for t in batch)
            refused["loss_type"] = (
                f"--loss_type {list(self.loss_type)} ({', '.join(batch)}): Cephalo adds up each microbatch's share of the global "
                f"batch's mean over pairs, which these losses are not ({why}); use per-pair "
                "losses (sigmoid, hinge, ipo, robust, bco_pair, ...)")
        return refused


class CephaloDPOTrainer(PairPlanning, TRLModelByName, TRLModelCard, CephaloTrainerMixin, DPOTrainer):
    """``DPOTrainer`` on the Cephalo runtime (see the module notes and ``CephaloTrainerMixin``
    for the arguments and errors; ``ref_model`` as DPOTrainer's). ``model``: a model object, or
    a Hub id / folder loaded on the meta device as for SFT (``TRLModelByName``).

    Raises ``RefusedSettings`` (a ValueError; before any collective, in the mixin's one
    refusal message, ``dpo_problems`` and ``CephaloDPOConfig.refused_settings``) for: a
    ``PeftModel`` that already has an adapter and no ``ref_model`` (TRL copies it into a second
    adapter the engine would train beside the first); no ``ref_model`` on a full fine-tune of a
    model built from its config (TRL would load a copy by an empty name);
    ``precompute_ref_log_probs`` on a meta model, or with an in-memory dataset on several
    ranks, or with evaluation; ``compute_metrics`` / ``preprocess_logits_for_metrics``
    (``predict()`` raises the same reason); the config's refused values. ``evaluate()`` and
    ``eval_strategy`` give stock's numbers for the whole eval set in one batch
    (``evaluation_loop``).
    """

    def __init__(self, model: torch.nn.Module | None = None, ref_model=None, args=None,
                 **kwargs: Any) -> None:
        self._script_args = args  # read by _hook_problems, inside the mixin's __init__
        super().__init__(model, args, ref_model=ref_model, **kwargs)
        self.data_collator = PairRows(self.data_collator, _REF_KEYS, "CephaloDPOTrainer")
        self._reference = None  # [Note: the reference log-probabilities]
        if not self.precompute_ref_logps:
            if self.ref_model is not None:
                from hf_cephalo.runtime import stage_model

                pairs = PairItems(stage_model(self.ref_model))
                engine = self.session.forward_only_engine(pairs)
                self._reference = _ReferencePass(engine, pairs, contextlib.nullcontext)
            else:  # a PEFT policy: its own engine with the adapters disabled
                from trl.trainer.utils import use_adapter

                peft_model = self.model
                self._reference = _ReferencePass(self.session, self._pair_items,
                                                 lambda: use_adapter(peft_model, None))

    def _hook_problems(self, model, kwargs: dict[str, Any]) -> list[str]:
        """The mixin's, plus the DPO refusals that need the objects (``dpo_problems``): all in
        the one refusal message, before DPOTrainer or any collective runs."""
        return super()._hook_problems(model, kwargs) + dpo_problems(
            model, kwargs.get("ref_model"), self._script_args, kwargs)

    def _restage_after_init(self, staged) -> bool:
        """DPOTrainer decided in its ``__init__`` whether it adds a MoE's router loss
        (``aux_loss_enabled``: the config has ``output_router_logits``, whatever its value, and
        the coefficient is not 0); refused here, before planning: its term is per call of the
        policy (chosen and rejected rows together), while the engine's covers the global batch.
        """
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError(
                f"CephaloDPOTrainer: {type(self.model).__name__} is a mixture of experts, and "
                "DPOTrainer adds its router load-balancing loss to every call's loss "
                f"(router_aux_loss_coef = {self.router_aux_loss_coef}); the DPO door cannot add "
                "it as stock does (the engine's router loss is the whole global batch's, added "
                "apart from DPO's loss): set router_aux_loss_coef=0.0 in the DPOConfig, which "
                "turns it off in stock DPOTrainer too")
        return super()._restage_after_init(staged)

    def _engine_staged(self, staged):
        self._pair_items = PairItems(staged)
        return self._pair_items

    def _engine_call_variants(self) -> dict[str, Any]:
        outputs = _DPO_FUSED_OUTPUTS + (("log_sum_sq_probs",) if self.use_weighting else ())
        return {"fused_lm_head": FusedLMHead(outputs=outputs)}

    def _engine_microbatches(self, microbatches: list) -> list:
        """Each pair unfolded into TRL's rows; the step's reference log-probabilities added
        ([Note: the reference log-probabilities])."""
        microbatches = [unfold_pairs(mb, _REF_KEYS) for mb in microbatches]
        if self._reference is not None:
            self._reference(microbatches)
        return microbatches

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """``DPOTrainer.compute_loss`` on this microbatch (its mean over the microbatch's m
        pairs, the reference log-probabilities read from the batch), times m / N, N the
        global batch's pairs ([Note: a preference pair is one sample])."""
        if return_outputs:
            raise ValueError(_NO_PREDICT)
        if inputs["input_ids"].shape[0] == 0:  # the step's replay (head_calls.py)
            inputs = _replay_pair(inputs)
        pairs = inputs["input_ids"].shape[0] // 2
        precompute, self.precompute_ref_logps = self.precompute_ref_logps, True
        try:
            loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        finally:
            self.precompute_ref_logps = precompute
        return loss * pairs / num_items_in_batch

    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """``evaluate()``'s loop through the engine, as stock with the whole eval set in ONE
        batch ([Note: evaluation of the whole set in one exchange] in whole_eval.py): every
        pair once; metrics ``{prefix}_loss`` (the mean over the N pairs); DPO's ``rewards/*``,
        ``logps/*``, ``logits/*``, ``entropy``, ``mean_token_accuracy`` of the whole set go to
        the eval metrics DPOTrainer's ``log`` adds (one entry per loop). No predictions
        (``predict`` is refused). Collective: every rank."""
        self.model.eval()
        steps = [self._engine_microbatches(self._prepare_input(microbatches))
                 for microbatches in dataloader]  # each step's reference pass: collective
        return evaluate_whole_set(self, steps, dataloader.batch_sampler.dataset_length,
                                  metric_key_prefix)

    def predict(self, *args: Any, **kwargs: Any):
        """Refused (ValueError, on every rank before any collective): see ``_NO_PREDICT``."""
        raise ValueError(_NO_PREDICT)


_NO_PREDICT = no_predict("CephaloDPOTrainer", "DPOTrainer")
_NO_PRECOMPUTED_EVAL = (
    "precompute_ref_log_probs=True with evaluation (eval_dataset / eval_strategy): reading "
    "the eval set's precomputed reference column through the engine is not built or tested; "
    "drop precompute_ref_log_probs (the reference then runs sharded each step, evaluation "
    "included), or evaluate the saved model with stock DPOTrainer")


def dpo_problems(model, ref_model, args, kwargs: dict[str, Any]) -> list[str]:
    """The DPO refusals that need the objects (model, ref_model, datasets, peft_config); one
    message each (empty: none)."""
    from accelerate.utils import is_peft_model

    problems = []
    evaluating = kwargs.get("eval_dataset") is not None or (
        args is not None and str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no")
    if evaluating and getattr(args, "precompute_ref_log_probs", False):
        problems.append(_NO_PRECOMPUTED_EVAL)
    if kwargs.get("compute_metrics") is not None or \
            kwargs.get("preprocess_logits_for_metrics") is not None:
        problems.append(_NO_PREDICT)
    if model is not None and not isinstance(model, str) and is_peft_model(model) \
            and ref_model is None and kwargs.get("peft_config") is None:
        problems.append(
            "a PeftModel with its own adapter and no ref_model: DPOTrainer copies the adapter "
            "into a second 'ref' adapter, which the engine would train beside the first; pass "
            "the base model with peft_config=..., or give ref_model")
    precompute = getattr(args, "precompute_ref_log_probs", False)
    if isinstance(model, torch.nn.Module) and ref_model is None and not precompute \
            and not is_peft_model(model) and kwargs.get("peft_config") is None \
            and not getattr(getattr(model, "config", None), "_name_or_path", ""):
        problems.append(
            "ref_model=None on a full fine-tune of a model built from its config: DPOTrainer "
            "would load the reference copy by the model's name, which is empty; pass "
            "ref_model=copy.deepcopy(model) (before training), or "
            "precompute_ref_log_probs=True, or train a LoRA adapter (peft_config=...)")
    train = kwargs.get("train_dataset")
    if precompute and getattr(args, "world_size", 1) > 1 and train is not None \
            and hasattr(train, "cache_files") and not train.cache_files:
        problems.append(
            "precompute_ref_log_probs=True with an in-memory train_dataset on "
            f"{args.world_size} processes: TRL writes the reference column as a cache file "
            "beside the dataset's files, and an in-memory dataset caches in a per-process "
            "temporary directory the other ranks cannot read (stock TRL fails the same way); "
            "save it first: dataset.save_to_disk(path), then datasets.load_from_disk(path)")
    if precompute and isinstance(model, torch.nn.Module) and ref_model is None and any(
            p.is_meta for p in model.parameters()):
        problems.append(
            "precompute_ref_log_probs=True with a model on the meta device "
            "(from_pretrained_sharded): TRL computes the reference over the dataset with the "
            "whole model before the engine shards it; load the model whole, or drop "
            "precompute_ref_log_probs (the reference then runs sharded, each step)")
    return problems


class _ReferencePass:
    """One step's reference log-probabilities ([Note: the reference log-probabilities]):
    ``runner.evaluate`` (the session's, or a forward-only engine the session built) over this
    rank's unfolded microbatches inside ``context()`` (the
    adapters off) with ``pairs`` (the engine's ``PairItems``) answering TRL's fused
    log-probabilities as the head's output; each row's sum over its completion, the chosen half
    as ``ref_chosen_logps`` (m,), the rejected half as ``ref_rejected_logps``. Collective (the
    engine's): every rank calls it each step, also with no microbatches."""

    def __init__(self, runner, pairs: PairItems, context) -> None:
        self.runner, self.pairs, self.context = runner, pairs, context
        self.head = FusedLMHead(outputs=("log_probs",))  # add_fused_lm_head(ref_model)'s

    def __call__(self, microbatches: list[dict[str, Any]]) -> None:
        with self.context(), self.pairs.reference(self.head):
            out = self.runner.evaluate(microbatches, return_logits=True)
        for mb, per_token in zip(microbatches, out.logits):
            mb["ref_chosen_logps"], mb["ref_rejected_logps"] = per_token.sum(dim=1).chunk(2)
