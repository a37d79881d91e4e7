"""CephaloKTOTrainer and CephaloKTOConfig: TRL's ``KTOTrainer`` on the Cephalo runtime.

``CephaloTrainerMixin`` + ``KTOTrainer`` (``CephaloKTOConfig``: every ``KTOConfig`` field plus the
``cephalo_*`` settings): KTOTrainer unpairs, tokenizes and adds the KL rows to its dataset, builds
its collator and its reference inside the mixin's ``super().__init__``, then the mixin builds the
session. A row (prompt + completion, desirable or not, with its KL row) is one sample of the
weighted split; KTO's loss is a mean over the rows of a batch, so the item count is the rows and
each microbatch contributes its mean times m / N. docs/trl.md, "KTO: CephaloKTOTrainer". Requires
the ``trl`` extra (written against TRL 1.16).

[Note: the KL estimate of the global batch]
KTO's loss reads one detached scalar of the whole batch, the KL estimate
``clamp(mean(log p(y'|x) - log p_ref(y'|x)), 0)`` over the batch's KL rows: each prompt x with a
completion y' of another row (TRL rotates the completions by one within each chunk of
``per_device_train_batch_size`` rows of the dataset). Stock DDP averages the ranks' means and
pairs within each device's batch, so its numbers change with the per-device batch size; here the
rotation runs within each chunk of the GLOBAL batch size B (``_prepare_dataset``), the pairing
one process with the whole batch makes, independent of the plan. Each step, before the engine's
training step: the reference pass (main and KL rows in ONE forward-only call), then the policy's
forward-only pass over the KL rows, then ONE exchange of (sum, count) over every rank
(``Session.gather_rows``, an idle rank sends zeros): the global mean, also with no desirable or no
undesirable row on a rank. KTO's loss then reads it as every row's KL term (``_compute_kl_logps``).
The policy's KL pass is a forward of its own (stock's is too: no gradient flows through it), so a
step runs the policy's units' all-gathers twice.

[Note: the reference log-probabilities of KTO]
As for DPO ([Note: the reference log-probabilities] in dpo.py): the loss runs in the engine's
head, where no second model can run, so the reference log-probabilities come with the batch
(``ref_logps``, and the KL rows' through the KL exchange), computed each step through a second
engine over ``ref_model`` sharded by the same plan, or through the policy's own engine with its
adapters disabled (PEFT without ``ref_model``).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

try:
    from trl import KTOConfig, KTOTrainer
except ImportError as exc:  # the optional extra
    raise ImportError("CephaloKTOTrainer needs TRL: pip install 'hf-cephalo[trl]' "
                      "(trl>=1.16)") from exc

from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
from hf_cephalo.integrations.trl.config import (CephaloTRLConfig, TRLModelByName, TRLModelCard,
                                                 dataset_columns, trl_config_dataclass)
from hf_cephalo.integrations.trl.fused import FusedLMHead
from hf_cephalo.integrations.trl.support import KTO_FIELD_SUPPORT
from hf_cephalo.integrations.trl.whole_eval import evaluate_whole_set, no_predict
from hf_cephalo.runtime import HeadView, Microbatch, WrappedStagedModel, refuse_global_loss

__all__ = ["CephaloKTOConfig", "CephaloKTOTrainer"]

# what KTOTrainer.__init__ passes add_fused_lm_head (trl/trainer/kto_trainer.py, TRL 1.16)
_KTO_FUSED_OUTPUTS = ("log_probs", "entropy", "mean_logits")
_ROWS = ("input_ids", "attention_mask", "completion_mask")


class KTORows(WrappedStagedModel):
    """The engine's item count of a KTO microbatch: its rows. Inside ``reference(head)``: no
    items (no loss) and, as the head's "logits", each row's per-token completion
    log-probabilities (m, S - 1) from TRL's fused head ``head`` on the final hidden states."""

    def __init__(self, inner) -> None:
        refuse_global_loss(inner, "TRL's KTO loss")
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
        return int(ids.shape[0])

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        if self._reference_head is None:
            return self.inner.head_logits(hidden, microbatch, ctx)
        labels = microbatch["input_ids"].masked_fill(microbatch["completion_mask"] == 0, -100)
        return self._reference_head(HeadView(self.inner, hidden, microbatch, ctx),
                                    {"labels": labels}).log_probs


class _SummedLogps:
    """Each row's summed completion log-probability (m,) of microbatches, through ``runner``'s
    forward-only ``evaluate`` inside ``context()`` with ``rows`` (the engine's ``KTORows``)
    answering TRL's fused log-probabilities. Collective (the engine's): every rank calls it,
    also with no microbatches."""

    def __init__(self, runner, rows: KTORows, context) -> None:
        self.runner, self.rows, self.context = runner, rows, context
        self.head = FusedLMHead(outputs=("log_probs",))  # add_fused_lm_head(ref_model)'s

    def __call__(self, microbatches: list[dict[str, Any]]) -> list[torch.Tensor]:
        with self.context(), self.rows.reference(self.head):
            out = self.runner.evaluate(microbatches, return_logits=True)
        return [per_token.sum(dim=1) for per_token in out.logits]


def _kl_rows(microbatch: dict[str, Any]) -> dict[str, Any]:
    """The KL rows of a microbatch as a microbatch of their own (mismatched completions)."""
    return {key: microbatch[f"KL_{key}"] for key in _ROWS}


@trl_config_dataclass(KTOConfig)
class CephaloKTOConfig(CephaloTRLConfig, KTOConfig):
    """``KTOConfig`` plus the ``cephalo_*`` settings (``CephaloTRLConfig``: the rules of
    ``CephaloTrainingArguments``; ``trl_config_dataclass``: KTOConfig's own defaults, e.g.
    ``learning_rate`` 1e-6 and ``train_sampling_strategy`` "sequential").

    Raises ValueError as ``CephaloTrainingArguments`` and ``KTOConfig`` do; settings the engine
    cannot honour are refused by ``CephaloKTOTrainer`` in one message (the table
    ``KTO_FIELD_SUPPORT``).
    """

    @staticmethod
    def cephalo_field_support() -> dict:
        """The table of this config's own fields (``support.training_args_problems``)."""
        return KTO_FIELD_SUPPORT


class CephaloKTOTrainer(TRLModelByName, TRLModelCard, CephaloTrainerMixin, KTOTrainer):
    """``KTOTrainer`` on the Cephalo runtime (see the module notes and ``CephaloTrainerMixin``
    for the arguments and errors; ``ref_model`` as KTOTrainer's). ``model``: a causal LM object,
    or a Hub id / folder loaded on the meta device as for SFT (``TRLModelByName``).

    Logged per step: ``loss`` (the mean over the global batch's rows), ``kl`` (the global
    batch's KL estimate, [Note: the KL estimate of the global batch]), ``rewards/*``,
    ``logps/*``, ``logits/*``, ``entropy``, ``num_tokens``: those of the whole global batch.

    Raises ``RefusedSettings`` (a ValueError; before any collective, in the mixin's one refusal
    message, ``kto_problems`` and the table) for: a global batch of one row with the KL term; a
    train dataset without the columns KTOTrainer reads; a ``PeftModel`` that already has an
    adapter and no ``ref_model``; no ``ref_model`` on a full fine-tune of a model built from
    its config; ``compute_metrics`` / ``preprocess_logits_for_metrics`` (``_NO_PREDICT``;
    ``predict()`` raises it too); the refused fields
    (``precompute_ref_log_probs``, ``sync_ref_model``, ``activation_offloading``).
    """

    # KTOTrainer's override returns a SequentialSampler on transformers < 5.2 only (stock's
    # sampler otherwise); the weighted split keeps train_sampling_strategy "sequential" itself
    _get_train_sampler = Trainer._get_train_sampler

    def __init__(self, model: torch.nn.Module | str | None = None, ref_model=None, args=None,
                 **kwargs: Any) -> None:
        self._script_args = args  # read by _hook_problems, inside the mixin's __init__
        self._kl_batch_size = _global_batch_size(args, kwargs.get("plan"))
        self._step_kl = 0.0
        super().__init__(model, args, ref_model=ref_model, **kwargs)
        self._reference = self._policy_kl = None
        if self.ref_model is not None:
            from hf_cephalo.runtime import stage_model

            rows = KTORows(stage_model(self.ref_model))
            self._reference = _SummedLogps(self.session.forward_only_engine(rows), rows,
                                           contextlib.nullcontext)
        else:  # a PEFT policy: its own engine with the adapters disabled
            from trl.trainer.utils import use_adapter

            peft_model = self.model
            self._reference = _SummedLogps(self.session, self._rows,
                                           lambda: use_adapter(peft_model, None))
        if self.calculate_KL:
            self._policy_kl = _SummedLogps(self.session, self._rows, contextlib.nullcontext)

    def _hook_problems(self, model, kwargs: dict[str, Any]) -> list[str]:
        """The mixin's, plus ``kto_problems``: all in the one refusal message, before
        KTOTrainer or any collective runs."""
        return super()._hook_problems(model, kwargs) + kto_problems(
            model, kwargs.get("ref_model"), self._script_args, kwargs, self._kl_batch_size)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name: str):
        """KTOTrainer's preparation, its KL completions rotated within each chunk of the
        global batch size B instead of ``per_device_train_batch_size`` ([Note: the KL estimate
        of the global batch])."""
        args = copy.copy(args)
        args.per_device_train_batch_size = self._kl_batch_size
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _rows_per_sample(self) -> int:
        """1: the KL rows never share a microbatch with the rows they belong to (the reference
        pass runs them as microbatches of their own, the policy's KL pass apart, both
        forward-only), so the training microbatch of m samples is m rows."""
        return 1

    def _engine_staged(self, staged):
        self._rows = KTORows(staged)
        return self._rows

    def _engine_call_variants(self) -> dict[str, Any]:
        return {"fused_lm_head": FusedLMHead(outputs=_KTO_FUSED_OUTPUTS)}

    def _engine_microbatches(self, microbatches: list) -> list:
        """The step's reference log-probabilities and KL estimate ([Note: the KL estimate of
        the global batch]); collective: every rank, each step."""
        total, count = self._reference_pass(microbatches)
        if self.calculate_KL:
            self._step_kl = self._global_kl(total, count)
        return microbatches

    def _reference_pass(self, microbatches: list) -> tuple[torch.Tensor, int]:
        """Sets each microbatch's ``ref_logps`` (and zero ``ref_KL_logps``); returns this
        rank's KL (sum of policy - reference log-probabilities over its KL rows (float64), their
        number); zeros without the KL term. Collective (the engines' forward-only passes)."""
        n = len(microbatches)
        kl_rows = [_kl_rows(mb) for mb in microbatches] if self.calculate_KL else []
        ref = self._reference([{k: mb[k] for k in _ROWS} for mb in microbatches] + kl_rows)
        for mb, logps in zip(microbatches, ref[:n]):
            mb["ref_logps"] = logps
            mb["ref_KL_logps"] = torch.zeros_like(logps)  # the KL term arrives whole, below
        total = torch.zeros((), dtype=torch.float64)
        if not self.calculate_KL:
            return total, 0
        policy = self._policy_kl(kl_rows)
        for p, r in zip(policy, ref[n:]):
            total = total + (p - r).double().sum().cpu()
        return total, sum(int(p.shape[0]) for p in policy)

    def _global_kl(self, total: torch.Tensor, count: int) -> float:
        """``sum / count`` over every rank's KL rows (ONE exchange; collective), as float32."""
        sums = self.session.gather_rows(torch.stack(
            [total.cpu(), torch.tensor(float(count), dtype=torch.float64)]).reshape(1, 2))
        total, count = sums.sum(dim=0).tolist()
        return float(torch.tensor(total / count, dtype=torch.float32))

    def _compute_kl_logps(self, model, batch):
        """The step's global KL estimate for each KL row (the reference's arrive as zeros), so
        KTO's ``(KL_logps - ref_KL_logps).mean()`` is that estimate; None without the KL term."""
        if not self.calculate_KL:
            return None
        rows = batch["KL_input_ids"].shape[0]
        return torch.full((rows,), self._step_kl, dtype=torch.float32,
                          device=batch["KL_input_ids"].device)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """``KTOTrainer.compute_loss`` on this microbatch (its mean over the microbatch's m
        rows, the reference log-probabilities and the KL estimate read from the batch), times
        m / N, N the global batch's rows; ``kl`` logged as the global estimate (the step's
        exchange would add up the microbatches' copies); [Note: KTO's gathers do not depend on
        the labels]."""
        if return_outputs:
            raise ValueError(_NO_PREDICT)
        rows = inputs["input_ids"].shape[0]
        precompute, self.precompute_ref_logps = self.precompute_ref_logps, True
        gathers = _LabelCountGathers(self, inputs)
        try:
            with gathers:
                loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        finally:
            self.precompute_ref_logps = precompute
        mode = "train" if self.model.training else "eval"
        gathers.drop_metrics_of_absent_labels(self._metrics[mode])
        if self.calculate_KL:
            self._metrics[mode]["kl"][-1] = max(self._step_kl, 0.0)
        return loss * rows / num_items_in_batch

    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """``evaluate()``'s loop through the engine, as stock with the whole eval set in ONE
        batch ([Note: KTO evaluation of the whole set]): every row once; metrics
        ``{prefix}_loss`` (the mean over the N rows); ``kl`` (the whole set's estimate),
        ``rewards/*``, ``logps/*``, ``logits/*``, ``entropy`` of the whole set go to the eval
        metrics KTOTrainer's ``log`` adds (one entry per loop). No predictions (``predict``
        is refused). Collective: every rank."""
        self.model.eval()
        steps = [self._prepare_input(microbatches) for microbatches in dataloader]
        total, count = torch.zeros((), dtype=torch.float64), 0
        for microbatches in steps:  # the reference log-probabilities; the KL sums
            step_total, step_count = self._reference_pass(microbatches)
            total, count = total + step_total, count + step_count
        if self.calculate_KL:
            self._step_kl = self._global_kl(total, count)
        return evaluate_whole_set(self, steps, dataloader.batch_sampler.dataset_length,
                                  metric_key_prefix)

    def predict(self, *args: Any, **kwargs: Any):
        """Refused (ValueError, on every rank before any collective): see ``_NO_PREDICT``."""
        raise ValueError(_NO_PREDICT)


# [Note: KTO evaluation of the whole set]
# Stock KTOTrainer with the whole eval set in ONE batch (one process) estimates the KL over all
# N KL rows. Here a first pass over this rank's eval steps computes the reference
# log-probabilities and the KL sums, ONE exchange gives the whole set's estimate, then
# ``evaluate_whole_set`` ([Note: evaluation of the whole set in one exchange] in whole_eval.py)
# evaluates every step with it. This rank's prepared eval microbatches (token ids, reference
# log-probabilities) stay where the inputs go (the device) between the passes.


class _LabelCountGathers:
    """[Note: KTO's gathers do not depend on the labels]
    ``KTOTrainer._compute_loss`` gathers the global numbers of desirable and undesirable rows
    and skips the two gathers of the rewards / log-probabilities of a kind when its number is
    0. In the engine's head a gather answers with this microbatch's own value, so a microbatch
    without desirable (or undesirable) rows would make fewer gathers than the others and the
    step's exchange could not pair them (head_calls.py). Inside ``with`` this wraps the trainer's
    ``accelerator.gather_for_metrics``: the two count gathers (found by their position, checked
    against the microbatch's labels) answer at least 1, so every call makes every gather (an
    empty kind adds sums of 0); after the replay, the metrics stock skips for a kind the GLOBAL
    batch lacks are dropped (``drop_metrics_of_absent_labels``)."""

    def __init__(self, trainer, inputs: dict[str, Any]) -> None:
        self.trainer, self.inputs, self.counts = trainer, inputs, []
        mode_train = trainer.model.training
        # kl?, entropy sum, tokens, num_tokens (train), logits / tokens of each kind, counts
        first = int(trainer.calculate_KL) + 2 + int(mode_train) + 4
        self.positions = (first, first + 1)

    def __enter__(self):
        accelerator = self.trainer.accelerator
        real, calls = accelerator.gather_for_metrics, [0]

        def gather(value, use_gather_object=False):
            k, calls[0] = calls[0], calls[0] + 1
            out = real(value, use_gather_object=use_gather_object)
            if k in self.positions:
                self._check(k, value)
                self.counts.append(float(out.sum()))
                out = out.clamp(min=1)
            return out

        accelerator.gather_for_metrics = gather
        return self

    def __exit__(self, *exc) -> None:
        del self.trainer.accelerator.gather_for_metrics  # the class's method again

    def _check(self, k: int, value) -> None:
        labels = self.inputs["label"]
        if labels.shape[0] == 0:  # the replay: zero rows
            return
        want = int(labels.sum()) if k == self.positions[0] else int((~labels.bool()).sum())
        if int(value.sum()) != want:
            raise ValueError("KTOTrainer's metric gathers are not in the order CephaloKTOTrainer "
                             "was written for (TRL 1.16): the number of desirable rows is not "
                             f"its gather {self.positions[0]}; use the TRL version of the "
                             "hf-cephalo[trl] extra")

    def drop_metrics_of_absent_labels(self, metrics) -> None:
        """The metrics stock does not log for a kind without rows (read after the replay)."""
        if self.inputs["label"].shape[0] != 0 or len(self.counts) != 2:
            return
        chosen, rejected = self.counts
        names = ([] if chosen else ["rewards/chosen", "logps/chosen"]) + \
            ([] if rejected else ["rewards/rejected", "logps/rejected"])
        if names:
            names.append("rewards/margins")
        for name in names:
            metrics[name].pop()
            if not metrics[name]:  # stock never made the key: KTOTrainer.log averages each list
                del metrics[name]


_NO_PREDICT = no_predict("CephaloKTOTrainer", "KTOTrainer")


def _global_batch_size(args, plan) -> int | None:
    """The job's global batch size B (the plan's, ``cephalo_global_batch_size``, or
    per_device_train_batch_size x world x accumulation), None for args the mixin refuses."""
    from hf_cephalo.integrations.trainer.training_args import (CephaloArguments,
                                                              job_from_training_args)

    if not isinstance(args, CephaloArguments):
        return None
    return job_from_training_args(args, args.world_size, plan=plan).global_batch_size


def kto_problems(model, ref_model, args, kwargs: dict[str, Any], batch_size) -> list[str]:
    """The KTO refusals that need the objects (model, ref_model, datasets, peft_config) or the
    global batch size; one message each (empty: none)."""
    from accelerate.utils import is_peft_model

    problems = []
    if kwargs.get("compute_metrics") is not None or \
            kwargs.get("preprocess_logits_for_metrics") is not None:
        problems.append(_NO_PREDICT)
    kl = args is not None and args.loss_type != "apo_zero_unpaired"
    if kl and batch_size is not None and batch_size <= 1:
        problems.append(
            f"a global batch of {batch_size} row with loss_type {args.loss_type!r}: the KL "
            "estimate pairs each prompt with the completion of another row of the global batch; "
            "give a global batch of 2 rows or more (cephalo_global_batch_size, or "
            "per_device_train_batch_size x processes)")
    if kl and args.per_device_train_batch_size <= 1:
        problems.append(
            f"per_device_train_batch_size = {args.per_device_train_batch_size} with loss_type "
            f"{args.loss_type!r}: stock KTOTrainer refuses it (its KL rows pair within one "
            "device's batch); CephaloKTOTrainer pairs them within the global batch, whose size "
            "the plan or cephalo_global_batch_size gives: set per_device_train_batch_size to 2 "
            "or more")
    for name, columns in dataset_columns(kwargs):
        if not ({"completion", "label"} <= columns or {"chosen", "rejected"} <= columns):
            problems.append(
                f"{name} has the columns {sorted(columns)}: KTOTrainer needs unpaired "
                "preference rows ('prompt', 'completion', 'label': True for desirable) or "
                "paired ones ('chosen', 'rejected', optionally 'prompt', unpaired by "
                "KTOTrainer); rename or build those columns")
    problems += _reference_problems(model, ref_model, kwargs, is_peft_model)
    return problems


def _reference_problems(model, ref_model, kwargs, is_peft_model) -> list[str]:
    problems = []
    if model is not None and not isinstance(model, str) and is_peft_model(model) \
            and ref_model is None and kwargs.get("peft_config") is None:
        problems.append(
            "a PeftModel with its own adapter and no ref_model: KTOTrainer copies the adapter "
            "into a second 'ref' adapter, which the engine would train beside the first; pass "
            "the base model with peft_config=..., or give ref_model")
    if isinstance(model, torch.nn.Module) and ref_model is None and not is_peft_model(model) \
            and kwargs.get("peft_config") is None \
            and not getattr(getattr(model, "config", None), "_name_or_path", ""):
        problems.append(
            "ref_model=None on a full fine-tune of a model built from its config: KTOTrainer "
            "would load the reference copy by the model's name, which is empty; pass "
            "ref_model=copy.deepcopy(model) (before training), or train a LoRA adapter "
            "(peft_config=...)")
    return problems
