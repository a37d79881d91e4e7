"""CephaloGRPOTrainer and CephaloGRPOConfig: TRL's ``GRPOTrainer`` on the Cephalo runtime.

``CephaloTrainerMixin`` + ``GRPOTrainer`` (``CephaloGRPOConfig``: every ``GRPOConfig`` field plus
the ``cephalo_*`` settings). GRPOTrainer builds its reward functions, processing classes and
metrics inside the mixin's ``super().__init__``; then the mixin builds the session. One optimizer
step trains one generation batch of B rows (B = the plan's global batch; B / G prompts, each
G times in a row), rank i its b_i rows; the steps of a generation round read as one process
with the whole batch reads them ([Note: rows of a generation batch] in rollout.py):

1. completions come from ONE method, ``_cephalo_rollout`` (today the user's ``rollout_func``,
   called with the whole groups this rank's rows touch, in order; without one the trainer is
   refused: built-in generation lands separately);
2. rewards per row on the rank that holds it (TRL's own ``_calculate_rewards``), gathered in
   global row order; advantages as one process computes them (``rollout.group_advantages``);
3. the old policy's and the reference's per-token log-probabilities by forward-only passes
   over this rank's microbatches (the policy's engine, a second engine over TRL's ``ref_model``,
   or the policy with its LoRA adapter off: [Note: the reference log-probabilities] in dpo.py);
4. GRPOTrainer's own ``compute_loss`` per microbatch in the engine's head, its loss rescaled
   to the microbatch's share of the one-process loss ([Note: each loss type's normalizer]).

[Note: each loss type's normalizer]
The engine's step adds ``compute_loss`` of every microbatch; the one-process loss of the
batch is the sum of those shares when each is ``TRL's microbatch loss x its share``:
``dapo``: TRL divides the token sum by ``num_items_in_batch`` (here the GLOBAL batch's loss
tokens; ``accelerator.num_processes`` is 1 in the head): share 1. ``bnpo``: TRL divides by the
microbatch's tokens; one process by the batch's: share tokens_mb / N, N = the batch's loss
tokens. ``grpo``: a mean over the microbatch's rows of per-row token means; one process over
the batch's rows: share rows_mb / N, N = B. ``dr_grpo``: the token sum over
rows_mb x max_completion_length: share rows_mb / N, N = B. Items counted by ``CompletionItems``.

Requires the ``trl`` extra (written against TRL 1.16). docs/trl.md, "GRPO: CephaloGRPOTrainer".
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # the optional extra
    raise ImportError("CephaloGRPOTrainer needs TRL: pip install 'hf-cephalo[trl]' "
                      "(trl>=1.16)") from exc

from hf_cephalo.integrations.trainer.accumulation import AccumulationStep
from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
from hf_cephalo.integrations.trl.config import (CephaloTRLConfig, TRLModelByName, TRLModelCard,
                                                 trl_config_dataclass)
from hf_cephalo.integrations.trl.fused import FusedLMHead
from hf_cephalo.integrations.trl.rollout import GenerationRows, RowGroups
from hf_cephalo.integrations.trl.rollout_step import RolloutStep
from hf_cephalo.integrations.trl.support import GRPO_FIELD_SUPPORT
from hf_cephalo.models.base import Microbatch, WrappedStagedModel, refuse_global_loss
from hf_cephalo.runtime.user_loss import HeadView

__all__ = ["CephaloGRPOConfig", "CephaloGRPOTrainer", "CompletionItems"]

PER_TOKEN_LOSSES = ("dapo", "bnpo")
"""Loss types whose item count is the batch's loss tokens; the others count rows."""
BUILT_LOSSES = ("dapo", "bnpo", "grpo", "dr_grpo")


class CompletionItems(WrappedStagedModel):
    """The engine's item count of a GRPO microbatch ([Note: each loss type's normalizer]): its
    loss tokens (``completion_mask`` x ``tool_mask``) for ``per_token`` loss types, else its
    rows. Inside ``logprobs(head)``: no items (no loss) and, as the head's "logits", each
    row's completion log-probabilities (m, C) from TRL's fused head ``head`` — what
    ``GRPOTrainer._get_per_token_logps_and_entropies`` computes for the old policy and the
    reference."""

    def __init__(self, inner, per_token: bool) -> None:
        refuse_global_loss(inner, "TRL's GRPO loss")
        super().__init__(inner)
        self.per_token = per_token
        self._head: FusedLMHead | None = None

    @contextlib.contextmanager
    def logprobs(self, head: FusedLMHead):
        self._head = head
        try:
            yield
        finally:
            self._head = None

    def count_items(self, microbatch: Microbatch) -> int:
        if self._head is not None or microbatch.get("completion_mask") is None:
            return 0
        if self.per_token:
            return int(loss_mask(microbatch).sum())
        return int(microbatch["input_ids"].shape[0])

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        if self._head is None:
            return self.inner.head_logits(hidden, microbatch, ctx)
        width = microbatch["completion_ids"].shape[1]
        labels = microbatch["input_ids"].masked_fill(microbatch["attention_mask"] == 0, -100)
        labels[:, :-width] = -100  # only the completion tokens are scored, as TRL's
        out = self._head(HeadView(self.inner, hidden, microbatch, ctx), {"labels": labels})
        return out.log_probs[:, -width:]


def loss_mask(microbatch: Microbatch) -> torch.Tensor:
    """(m, C): the completion tokens the loss scores (TRL's ``completion_mask * tool_mask``)."""
    mask = microbatch["completion_mask"]
    tool = microbatch.get("tool_mask")
    return mask if tool is None else mask * tool


@trl_config_dataclass(GRPOConfig)
class CephaloGRPOConfig(CephaloTRLConfig, GRPOConfig):
    """``GRPOConfig`` plus the ``cephalo_*`` settings (``CephaloTRLConfig``: the rules of
    ``CephaloTrainingArguments``; ``trl_config_dataclass``: GRPOConfig's own defaults).

    The generation batch is Cephalo's global batch B (the plan's; ``generation_batch_size`` is
    set to it by the trainer): one optimizer step trains it. Raises ValueError as
    ``CephaloTrainingArguments`` and ``GRPOConfig`` do; settings the engine cannot honour are
    refused by ``CephaloGRPOTrainer`` in one message (``refused_settings``)."""

    @staticmethod
    def cephalo_field_support() -> dict:
        """The table of this config's own fields (``support.training_args_problems``)."""
        return GRPO_FIELD_SUPPORT

    def refused_settings(self) -> dict[str, str]:
        """``CephaloTrainingArguments.refused_settings`` plus the GRPO values the table cannot
        word per field."""
        refused = super().refused_settings()
        if self.gradient_accumulation_steps != 1:
            refused["gradient_accumulation_steps"] = (
                f"--gradient_accumulation_steps = {self.gradient_accumulation_steps}: "
                "CephaloGRPOTrainer trains the whole generation batch (the plan's global batch) "
                "in one optimizer step, each rank in its own microbatches; set the global batch "
                "(--cephalo_global_batch_size or the plan) and leave it at 1")
        if self.steps_per_generation not in (None, 1):
            refused["steps_per_generation"] = (
                f"--steps_per_generation = {self.steps_per_generation} (generation_batch_size "
                f"{self.generation_batch_size}): one process shuffles the rows of a generation "
                "batch across its optimizer steps, which would move completions between ranks "
                "(not built); generate once per step: leave steps_per_generation and "
                "generation_batch_size unset")
        if self.loss_type not in BUILT_LOSSES:
            refused["loss_type"] = (
                f"--loss_type {self.loss_type!r}: not validated on the engine (built and tested "
                f"against stock: {', '.join(BUILT_LOSSES)})")
        return refused


class CephaloGRPOTrainer(TRLModelByName, TRLModelCard, CephaloTrainerMixin, GRPOTrainer):
    """``GRPOTrainer`` on the Cephalo runtime (see the module note and ``CephaloTrainerMixin``
    for the arguments and errors; ``reward_funcs``, ``rollout_func`` ... as GRPOTrainer's).

    Raises ``RefusedSettings`` (a ValueError; before any collective, in the mixin's one refusal
    message) for: no ``rollout_func`` (built-in generation on the engine lands separately),
    tools / environments, an evaluation dataset, an iterable dataset, a global batch that
    ``num_generations`` does not divide, a shuffled dataset read for more than one epoch, and
    the config's refused values (``CephaloGRPOConfig.refused_settings``, the field table).
    At a step: ``LoaderStepError`` (a ValueError) on EVERY rank when the rollout or a reward
    function raised on some rank.
    """

    def __init__(self, model, reward_funcs=None, args=None, **kwargs: Any) -> None:
        self._script_args = args  # read by _hook_problems, inside the mixin's __init__
        self._batch_size = _global_batch(args, kwargs.get("plan"))
        if self._batch_size is not None and args is not None:
            args.generation_batch_size = self._batch_size  # one generation batch per step
        super().__init__(model, args, reward_funcs=reward_funcs, **kwargs)
        self._rollout = RolloutStep(self)

    # ---- construction ----------------------------------------------------------------------
    def _hook_problems(self, model, kwargs: dict[str, Any]) -> list[str]:
        """The mixin's, minus GRPOTrainer's own sampler (replaced by ``GenerationRows``), plus
        the GRPO refusals that need the objects."""
        problems = [p for p in super()._hook_problems(model, kwargs)
                    if not p.startswith("_get_train_sampler")]
        return problems + grpo_problems(self._script_args, self._batch_size, kwargs)

    def _engine_staged(self, staged):
        self._items = CompletionItems(staged, per_token=self.loss_type in PER_TOKEN_LOSSES)
        return self._items

    def _engine_call_variants(self) -> dict[str, Any]:
        return {"fused_lm_head": self._fused_head(("log_probs", "entropy"))}

    def _fused_head(self, outputs: tuple[str, ...]) -> FusedLMHead:
        """TRL's fused head as ``add_fused_lm_head`` sets it up for this trainer."""
        return FusedLMHead(temperature=self.temperature, outputs=outputs,
                           cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)

    # ---- data ------------------------------------------------------------------------------
    def get_train_dataloader(self):
        """This rank's rows of each generation batch: TRL's ``RepeatSampler`` order (every
        prompt G times in a row, each batch ``num_iterations`` times), split by the plan
        (``GenerationRows``, sequential); one list of row dicts per step."""
        from trl.trainer.utils import RepeatSampler

        if self.train_dataset is None:
            raise ValueError("CephaloGRPOTrainer: training requires a train_dataset")
        order = RepeatSampler(self.train_dataset, mini_repeat_count=self.num_generations,
                              batch_size=self._batch_size // self.num_generations,
                              repeat_count=self.num_iterations, shuffle=self.shuffle_dataset,
                              seed=self.args.seed)
        rows = GenerationRows(self.train_dataset, list(order))
        return self.session.train_loader(rows, _Rows(), shuffle=False, whole_batches=True)

    # ---- the step --------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """The mixin's engine step over this rank's rows of the generation batch, with
        GRPOTrainer's step counter and ``step_time`` metric."""
        if isinstance(inputs, AccumulationStep):
            return super().training_step(model, inputs, num_items_in_batch)
        start = time.perf_counter()
        out = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        self._metrics["train"]["step_time"].append(time.perf_counter() - start)
        return out

    def _engine_microbatches(self, microbatches: list) -> list:
        """This rank's rows -> its microbatches of the step: generated and scored once per
        generation round (every ``num_iterations`` steps), replayed in between."""
        rows = [row for mb in microbatches for row in (mb if isinstance(mb, list) else [mb])]
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            groups = RowGroups.of(rows, self._batch_size, self.num_generations)
            self._buffered_inputs = self._rollout(groups, self._step // generate_every)
        self.last_step_num_samples = len(rows)
        return self._buffered_inputs

    def _cephalo_rollout(self, prompts: list, global_rows: list[int],
                         generation_round: int) -> dict[str, Any]:
        """Where completions come from: ``prompts`` are whole groups (each prompt G times in a
        row, in batch order), ``global_rows`` their row numbers in the generation batch,
        ``generation_round`` the batch's number. Returns TRL's rollout dict (``prompt_ids``,
        ``completion_ids``, ``logprobs`` and extra per-row fields), one entry per prompt.
        Today the user's ``rollout_func(prompts, trainer)``, as stock calls it."""
        import copy

        output = self.rollout_func(copy.deepcopy(prompts), self)
        missing = {"prompt_ids", "completion_ids", "logprobs"} - set(output)
        if missing:
            raise ValueError(f"rollout_func must return keys {sorted(missing)} in its output dict.")
        return output

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """``GRPOTrainer.compute_loss`` on this microbatch, times its share of the one-process
        loss ([Note: each loss type's normalizer]); ``num_items_in_batch``: the engine's N."""
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        if inputs["input_ids"].shape[0] == 0:  # the step's replay (head_calls.py): one zero row
            inputs = {k: v.new_zeros((1, *v.shape[1:])) if torch.is_tensor(v) and v.dim() else v
                      for k, v in inputs.items()}
        loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.loss_type == "dapo":
            return loss
        if self.loss_type == "bnpo":
            share = loss_mask(inputs).sum().clamp(min=1.0)
        else:  # grpo, dr_grpo: per-row terms
            share = inputs["input_ids"].shape[0]
        return loss * share / num_items_in_batch

    def evaluate(self, *args: Any, **kwargs: Any):
        raise ValueError(_NO_EVALUATION)


class _Rows:
    """The collator of ``GenerationRows``: the row dicts as they are (TRL's ``identity``).

    ``padding_free`` tells the runtime's loader (``sampler.packs_without_padding``) to apply it
    to each rank's rows alone: it pads nothing, so that is independent of the plan (the
    widths of the generation batch are settled after the rollout, ``rollout_step.py``)."""

    padding_free = True

    def __call__(self, samples: list) -> list:
        return list(samples)


_NO_EVALUATION = (
    "CephaloGRPOTrainer does not evaluate yet: GRPO's evaluation (generation and scoring of the "
    "eval prompts) through the engine is not built and tested; drop eval_dataset / evaluate() "
    "(and eval_strategy), and evaluate the saved model with stock GRPOTrainer")


def _global_batch(args, plan) -> int | None:
    """The generation batch B: the plan's global batch (given, or in the plan file), else
    ``cephalo_global_batch_size``, else stock's per_device_train_batch_size x world size."""
    if args is None:
        return None
    if plan is None and getattr(args, "cephalo_plan_file", None):
        from hf_cephalo.planner import Plan

        plan = Plan.load(args.cephalo_plan_file)
    if plan is not None:
        return plan.global_batch_size
    given = getattr(args, "cephalo_global_batch_size", None)
    return given or args.per_device_train_batch_size * args.world_size


def grpo_problems(args, batch_size: int | None, kwargs: dict[str, Any]) -> list[str]:
    """The GRPO refusals that need the objects (rollout_func, tools, datasets); one message
    each (empty: none)."""
    problems = []
    if kwargs.get("rollout_func") is None:
        problems.append(
            "no rollout_func: CephaloGRPOTrainer takes completions from a rollout_func(prompts, "
            "trainer) -> {'prompt_ids', 'completion_ids', 'logprobs'} (as GRPOTrainer's); "
            "built-in generation on the sharded engine lands separately: set rollout_func")
    for name in ("tools", "environment_factory"):
        if kwargs.get(name):
            problems.append(f"{name}: multi-turn tool calling / environments are not built on "
                            f"the engine; drop {name}")
    if kwargs.get("eval_dataset") is not None or (
            args is not None and str(getattr(args.eval_strategy, "value", args.eval_strategy))
            != "no"):
        problems.append(_NO_EVALUATION)
    train = kwargs.get("train_dataset")
    if train is not None and not hasattr(train, "__len__"):
        problems.append("an iterable train_dataset: the generation batches are read in TRL's "
                        "RepeatSampler order over a map-style dataset; materialize it first")
    if args is not None and batch_size is not None:
        problems += _batch_problems(args, batch_size, train)
    return problems


def _batch_problems(args, batch_size: int, train) -> list[str]:
    G = args.num_generations
    if batch_size % G:
        return [f"num_generations = {G} does not divide the generation batch B = {batch_size} "
                "(the plan's global batch): every prompt's G completions must be in one batch; "
                "choose a global batch that is a multiple of num_generations"]
    if train is None or not hasattr(train, "__len__") or not args.shuffle_dataset:
        return []
    per_epoch = len(train) // (batch_size // G) * args.num_iterations
    steps = args.max_steps if args.max_steps > 0 else per_epoch * args.num_train_epochs
    if per_epoch and steps > per_epoch:
        return [f"shuffle_dataset with {steps} steps over {per_epoch} steps of prompts per epoch: "
                "TRL's RepeatSampler draws a new order each epoch, which the door does not "
                "replay yet; train one epoch (max_steps <= "
                f"{per_epoch}) or set shuffle_dataset=False"]
    return []
