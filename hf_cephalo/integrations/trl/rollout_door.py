"""What the generating TRL doors share (``CephaloGRPOTrainer``, grpo.py; ``CephaloRLOOTrainer``,
rloo.py): the generation batch as the plan's global batch, TRL's row order split by the plan,
one generation round per ``num_iterations`` steps through ``rollout_step.RolloutStep``, the
item count of a microbatch and the refusals before any collective. Put ``RolloutDoor`` before
``CephaloTrainerMixin`` in a door's bases; the door says how its loss maps onto the engine's
global item count (``_per_token_items``, ``_loss_share``)."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

import torch

from hf_cephalo.integrations.trainer.accumulation import AccumulationStep
from hf_cephalo.integrations.trl.fused import FusedLMHead
from hf_cephalo.integrations.trl.rollout import GenerationRows, RowGroups
from hf_cephalo.integrations.trl.rollout_step import round_steps
from hf_cephalo.runtime import HeadView, Microbatch, WrappedStagedModel, refuse_global_loss

__all__ = ["CompletionItems", "RolloutDoor", "loss_mask", "one_step_per_generation",
           "rollout_problems", "router_loss_problems"]


class CompletionItems(WrappedStagedModel):
    """The engine's item count of a rollout microbatch: its loss tokens (``completion_mask``
    x ``tool_mask``) when ``per_token``, else its rows. Inside ``logprobs(head)``: no items (no
    loss) and, as the head's "logits", each row's completion log-probabilities (m, C) from
    TRL's fused head ``head`` — what TRL's ``_get_per_token_logps_and_entropies`` computes for
    the old policy and the reference."""

    def __init__(self, inner, per_token: bool) -> None:
        refuse_global_loss(inner, "TRL's GRPO / RLOO loss")
        super().__init__(inner)
        self.per_token = per_token
        self._head: FusedLMHead | None = None

    @contextlib.contextmanager
    def logprobs(self, head: FusedLMHead, output: str = "log_probs"):
        """Inside: the head's "logits" are ``head``'s per-token ``output`` (log_probs, or
        entropy) over the completion."""
        self._head, self._output = head, output
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
        return getattr(out, self._output)[:, -width:]


def loss_mask(microbatch: Microbatch) -> torch.Tensor:
    """(m, C): the completion tokens the loss scores (TRL's ``completion_mask * tool_mask``)."""
    mask = microbatch["completion_mask"]
    tool = microbatch.get("tool_mask")
    return mask if tool is None else mask * tool


class _Rows:
    """The collator of ``GenerationRows``: the row dicts as they are (TRL's ``identity``).

    ``padding_free`` tells the runtime's loader (``sampler.packs_without_padding``) to apply it
    to each rank's rows alone: it pads nothing, so that is independent of the plan (the
    widths of the generation batch are settled after the rollout, ``rollout_step.py``)."""

    padding_free = True

    def __call__(self, samples: list) -> list:
        return list(samples)


class _PlanningRows:
    """One row of ``input_ids`` as long as the longest of the first 16 prompts (tokenized as
    text, or with the chat template) plus ``max_completion_length``: what the planner's
    ``sequence_length_of`` reads. Only its length is real."""

    def __init__(self, prompts, tokenizer, max_completion_length: int) -> None:
        self.length = max_completion_length + max(
            (_prompt_length(prompts[i]["prompt"], tokenizer)
             for i in range(min(len(prompts), 16))), default=0)

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": [0] * self.length}


def _prompt_length(prompt, tokenizer) -> int:
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
    return len(ids["input_ids"] if isinstance(ids, dict) else ids)


class RolloutDoor:
    """The shared methods of the generating doors (see the module note). A door sets
    ``_rollout_step_class`` and defines ``_per_token_items()`` / ``_loss_share(inputs, N)``."""

    _rollout_step_class: type

    def __init__(self, model=None, args=None, **kwargs: Any) -> None:
        self._script_args = args  # read by _hook_problems, inside the mixin's __init__
        self._batch_size = global_batch(args, kwargs.get("plan"))
        if self._batch_size is not None and args is not None:
            args.generation_batch_size = self._batch_size  # one generation batch per step
        self._builtin = None  # built-in generation, made at the first round without rollout_func
        super().__init__(model, args, **kwargs)
        self._rollout = self._rollout_step_class(self)

    def _hook_problems(self, model, kwargs: dict[str, Any]) -> list[str]:
        """The mixin's, minus TRL's own sampler (replaced by ``GenerationRows``), plus the
        rollout refusals that need the objects."""
        problems = [p for p in super()._hook_problems(model, kwargs)
                    if not p.startswith("_get_train_sampler")]
        return problems + rollout_problems(self._script_args, self._batch_size, kwargs,
                                           self._rollout_func_given(kwargs)) \
            + router_loss_problems(model, self._script_args)

    def _rollout_func_given(self, kwargs: dict[str, Any]) -> bool:
        return kwargs.get("rollout_func") is not None

    def _planning_dataset(self):
        """What prices the profile: rows of the longest tokenized prompt among the first 16
        plus ``max_completion_length`` tokens (the rows the engine will train), instead of the
        prompt dataset, which has no ``input_ids``."""
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            return self.train_dataset
        return _PlanningRows(self.train_dataset, self.processing_class,
                             self.args.max_completion_length)

    def _engine_staged(self, staged):
        self._items = CompletionItems(staged, per_token=self._per_token_items())
        return self._items

    def _scoring_passes(self) -> float:
        """Forward-only passes over the plan's split per optimizer step, which the start plan
        prices with the training step (``Job.scoring_passes``): the rollout step's passes per
        generation round (``passes_per_round``: old policy, reference) over the steps a round
        feeds (``steps_per_generation`` x ``num_iterations``), plus GRPO's entropy-threshold
        pass every step (``top_entropy_quantile`` < 1, [Note: the entropy threshold])."""
        args = self.args
        entropy = getattr(args, "top_entropy_quantile", 1.0) < 1.0
        return self._rollout_step_class.passes_per_round(args) / round_steps(args) + float(entropy)

    def _engine_call_variants(self) -> dict[str, Any]:
        return {"fused_lm_head": self._fused_head(("log_probs", "entropy"))}

    def _fused_head(self, outputs: tuple[str, ...]) -> FusedLMHead:
        """TRL's fused head as ``add_fused_lm_head`` sets it up for this trainer."""
        return FusedLMHead(temperature=self.temperature, outputs=outputs,
                           cast_lm_head_to_fp32=getattr(self.args, "cast_lm_head_to_fp32", False))

    def get_train_dataloader(self):
        """This rank's rows of each generation batch: TRL's ``RepeatSampler`` order (every
        prompt G times in a row, each batch ``num_iterations`` times), split by the plan
        (``GenerationRows``, sequential); one list of row dicts per step."""
        from trl.trainer.utils import RepeatSampler

        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}: training requires a train_dataset")
        order = RepeatSampler(self.train_dataset, mini_repeat_count=self.num_generations,
                              batch_size=self._batch_size // self.num_generations,
                              repeat_count=self.num_iterations, shuffle=self.shuffle_dataset,
                              seed=self.args.seed)
        rows = GenerationRows(self.train_dataset, list(order))
        return self.session.train_loader(rows, _Rows(), shuffle=False, whole_batches=True)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The mixin's engine step over this rank's rows of the generation batch, with TRL's
        step counter and ``step_time`` metric."""
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
        generate_every = round_steps(self.args)
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            groups = RowGroups.of(rows, self._batch_size, self.num_generations)
            # the round from the optimizer step, which a resumed run restores (TRL's _step
            # restarts at 0): the same round number as the uninterrupted run
            self._buffered_inputs = self._rollout(groups,
                                                  self.state.global_step // generate_every)
        if getattr(self, "top_entropy_quantile", 1.0) < 1.0:  # [Note: the entropy threshold]
            self._entropy_threshold = self._rollout.entropy_threshold(
                self._buffered_inputs, 1 - self.top_entropy_quantile)
        self.last_step_num_samples = len(rows)
        return self._buffered_inputs

    # [Note: the entropy threshold]
    # GRPO's top_entropy_quantile masks the tokens whose entropy is below a quantile of ALL the
    # step's loss tokens' entropies; TRL computes it inside compute_loss with a gather, which in
    # the engine's head sees one microbatch. So each step first runs a forward-only pass of the
    # policy (the step's weights: the same entropies the training forward computes), gathers
    # every rank's loss-token entropies and takes TRL's quantile of them; the loss's mask then
    # compares against that threshold, as one process does.
    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor,
                              threshold: float) -> torch.Tensor:
        """(m, C) bool: TRL's mask with the step's global threshold ([Note: the entropy
        threshold]); no token when the batch has no loss token."""
        if self._entropy_threshold is None:
            return torch.zeros_like(entropies, dtype=torch.bool)
        return ((entropies * mask.float()) >= self._entropy_threshold) & mask.bool()

    def _cephalo_rollout(self, prompts: list, global_rows: list[int],
                         generation_round: int) -> dict[str, Any]:
        """Where completions come from: ``prompts`` are whole groups (each prompt G times in a
        row, in batch order), ``global_rows`` their row numbers in the generation batch,
        ``generation_round`` the batch's number. Returns TRL's rollout dict (``prompt_ids``,
        ``completion_ids``, ``logprobs`` and extra per-row fields), one entry per prompt.
        The user's ``rollout_func(prompts, trainer)``, as stock GRPOTrainer calls it, or without
        one the engine's built-in generation (``builtin_generation.BuiltinRollout``:
        collective, so every rank calls it each round, with empty lists when it has no rows).

        Raises ValueError when the rollout misses a required key."""
        if self.rollout_func is None:  # built-in generation on the engine (collective)
            if self._builtin is None:
                from hf_cephalo.integrations.trl.builtin_generation import BuiltinRollout

                self._builtin = BuiltinRollout(self)
            return self._builtin(prompts, global_rows)
        output = self.rollout_func(copy.deepcopy(prompts), self)
        missing = {"prompt_ids", "completion_ids", "logprobs"} - set(output)
        if missing:
            raise ValueError(f"rollout_func must return keys {sorted(missing)} in its output dict.")
        return output

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """TRL's ``compute_loss`` on this microbatch, times its share of the one-process loss
        (``_loss_share``); ``num_items_in_batch``: the engine's global item count N."""
        if return_outputs:
            raise ValueError(f"{type(self).__name__} does not support returning outputs")
        if inputs["input_ids"].shape[0] == 0:  # the step's replay (head_calls.py): one zero row
            inputs = {k: v.new_zeros((1, *v.shape[1:])) if torch.is_tensor(v) and v.dim() else v
                      for k, v in inputs.items()}
        loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return loss * self._loss_share(inputs, num_items_in_batch)

    def evaluate(self, *args: Any, **kwargs: Any):
        raise ValueError(no_evaluation(type(self).__name__))


def no_evaluation(door: str) -> str:
    return (f"{door} does not evaluate yet: evaluation (generation and scoring of the eval "
            "prompts) through the engine is not built and tested; drop eval_dataset / "
            "evaluate() (and eval_strategy), and evaluate the saved model with stock TRL")


def global_batch(args, plan) -> int | None:
    """The generation batch B: the plan's global batch (given, or in the plan file), else
    ``cephalo_global_batch_size``, else stock's per_device_train_batch_size x world size."""
    if args is None:
        return None
    if plan is None and getattr(args, "cephalo_plan_file", None):
        from hf_cephalo.runtime import Plan

        plan = Plan.load(args.cephalo_plan_file)
    if plan is not None:
        return plan.global_batch_size
    given = getattr(args, "cephalo_global_batch_size", None)
    return given or args.per_device_train_batch_size * args.world_size


def rollout_problems(args, batch_size: int | None, kwargs: dict[str, Any],
                     has_rollout: bool) -> list[str]:
    """The refusals that need the objects (rollout_func, tools, datasets); one message each
    (empty: none)."""
    problems = []
    if not has_rollout:  # built-in generation on the engine
        from hf_cephalo.integrations.trl.builtin_generation import generation_problems

        problems += generation_problems(args)
    for name in ("tools", "environment_factory"):
        if kwargs.get(name):
            problems.append(f"{name}: multi-turn tool calling / environments are not built on "
                            f"the engine; drop {name}")
    if kwargs.get("eval_dataset") is not None or (
            args is not None and str(getattr(args.eval_strategy, "value", args.eval_strategy))
            != "no"):
        problems.append(no_evaluation("this door"))
    train = kwargs.get("train_dataset")
    if set(getattr(train, "column_names", None) or ()) & {"image", "images"}:
        problems.append("multimodal prompts (an image / images column): images through the "
                        "engine's rollout rows are not built; train on text prompts")
    if train is not None and not hasattr(train, "__len__"):
        problems.append("an iterable train_dataset: the generation batches are read in TRL's "
                        "RepeatSampler order over a map-style dataset; materialize it first")
    if args is not None and batch_size is not None:
        problems += _batch_problems(args, batch_size, train)
    return problems


def router_loss_problems(model, args) -> list[str]:
    """A mixture of experts whose router load-balancing loss TRL would add (GRPOTrainer /
    RLOOTrainer turn it on whenever the coefficient is non-zero: ``router_aux_loss_coef``, or
    the model config's when None): TRL adds it per microbatch (a mean over the microbatch's
    chunks, not a sum over the global batch's items), so it cannot be split exactly."""
    config = getattr(model, "config", None)
    if config is None or args is None:
        return []
    text_config = config.get_text_config()
    coef = getattr(args, "router_aux_loss_coef", None)
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if not hasattr(text_config, "output_router_logits") or not coef:
        return []
    return [f"router_aux_loss_coef = {coef} on the mixture of experts "
            f"{type(model).__name__}: TRL adds the router's load-balancing loss per microbatch "
            "(a per-microbatch mean, not a sum over the global batch's items), which the engine "
            "cannot split exactly; set router_aux_loss_coef=0.0 in the config"]


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
                f"replay yet; train one epoch (max_steps <= {per_epoch}) or set "
                "shuffle_dataset=False"]
    return []


def one_step_per_generation(args) -> dict[str, str]:
    """The refusals of gradient accumulation and ``steps_per_generation`` > 1 (a generating
    door trains one generation batch per optimizer step), and of a live re-balancing inside a
    generation round (``num_iterations`` > 1)."""
    refused = {}
    if args.gradient_accumulation_steps != 1:
        refused["gradient_accumulation_steps"] = (
            f"--gradient_accumulation_steps = {args.gradient_accumulation_steps}: the door "
            "trains the whole generation batch (the plan's global batch) in one optimizer "
            "step, each rank in its own microbatches; set the global batch "
            "(--cephalo_global_batch_size or the plan) and leave it at 1")
    adaptive = getattr(args, "cephalo_adaptive", "off") or "off"
    if args.num_iterations > 1 and adaptive != "off":
        refused["num_iterations"] = (
            f"--cephalo_adaptive {adaptive} with num_iterations = {args.num_iterations}: a live "
            "switch of the split between two iterations of a generation batch would give a "
            "rank rows whose completions and old log-probabilities another rank holds (not "
            "built); set --cephalo_adaptive off, or num_iterations 1")
    if args.steps_per_generation not in (None, 1):
        refused["steps_per_generation"] = (
            f"--steps_per_generation = {args.steps_per_generation} (generation_batch_size "
            f"{args.generation_batch_size}): one process shuffles the rows of a generation "
            "batch across its optimizer steps, which would move completions between ranks "
            "(not built); generate once per step: leave steps_per_generation and "
            "generation_batch_size unset")
    return refused
