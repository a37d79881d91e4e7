"""Checks CephaloTrainer makes before profiling, planning or any collective.

[Note: fail fast]
Everything that can be decided from the arguments, the model class, the dataset types and a
given plan is checked here, first thing in ``CephaloTrainer.__init__``: an automatic profile
takes minutes (~90 s for MiniLM on 2 CPU cores), and an error after it wastes that time on every
rank. Every rank evaluates the same inputs, so every rank raises the same error and none is
left waiting in a collective. What needs the profile (a plan that cannot fit, an emulated
memory cap) can only be checked after it (``runtime.planning.resolve_plan``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch import nn

from hf_cephalo.integrations.trainer.support import RefusedSettings, training_args_problems
from hf_cephalo.runtime import (Plan, StagedModel, is_stream, parameter_names, repoint_problems,
                                stage_model)

__all__ = ["check_script", "dataset_problems", "optimizer_problems",
           "engine_checkpointing_replaces_model_checkpointing"]

logger = logging.getLogger(__name__)


def _dataset_error(dataset: Any, description: str, max_steps: int) -> str | None:
    if dataset is None or not is_stream(dataset):
        return None
    name = type(dataset).__name__
    if description == "train_dataset":  # read as a stream: runtime/streaming.py
        if max_steps > 0 or _has_length(dataset):
            return None
        return (f"train_dataset: {name} is a stream without a length, so the number of "
                "training steps cannot be inferred: set --max_steps (as stock Trainer requires "
                "for an IterableDataset)")
    return (f"{description}: {name} is a stream; CephaloTrainer evaluates a dataset with a "
            "length (its rows are split by the plan's per-rank batch sizes b_i and gathered in "
            "order). Materialize the part you evaluate on first, e.g. "
            "datasets.Dataset.from_generator(lambda: (yield from iterable.take(n)), "
            "features=iterable.features)")


def _has_length(dataset: Any) -> bool:
    try:
        len(dataset)
    except TypeError:
        return False
    return True


def dataset_problems(train_dataset: Any = None, eval_dataset: Any = None, *,
                     max_steps: int = -1) -> list[str]:
    """One message per dataset CephaloTrainer cannot read: a streamed train dataset (an
    ``IterableDataset``) without a length and without ``max_steps`` > 0 (stock's rule), a
    streamed eval dataset; empty when all fit.

    ``eval_dataset`` may be a dict of named datasets (each is checked).
    """
    evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("", eval_dataset)]
    problems = []
    for description, dataset in [("train_dataset", train_dataset),
                                 *((f"eval_dataset{f'[{k!r}]' if k else ''}", d) for k, d in evals)]:
        message = _dataset_error(dataset, description, max_steps)
        if message:
            problems.append(message)
    return problems


def optimizer_problems(model: nn.Module | None, optimizers: Any) -> list[str]:
    """Why ``Trainer(optimizers=(optimizer, scheduler))`` cannot be re-pointed at the model's
    shards (``runtime.optim.repoint_problems``: a class that cannot step 1-D shards, an
    optimizer that stepped or holds another model's tensors, a scheduler bound to another
    optimizer), or a scheduler given without its optimizer; empty when it can."""
    optimizer, scheduler = (tuple(optimizers or ()) + (None, None))[:2]
    if model is None or (optimizer is None and scheduler is None):
        return []
    if optimizer is None:
        return ["optimizers: a scheduler without its optimizer would set the learning rate of "
                "an optimizer nobody steps: pass optimizers=(optimizer, scheduler), or (None, "
                "None)"]
    return repoint_problems(optimizer, parameter_names(model), "optimizers", scheduler=scheduler)


def check_script(args, model: nn.Module | None, hook_problems: list[str], *,
                 train_dataset: Any = None, eval_dataset: Any = None,
                 model_refused: bool = False) -> StagedModel:
    """Every refusal of the script's settings at once ([Note: one refusal message] in
    support.py); returns the staged model.

    Collects, in this order: the ``TrainingArguments`` fields (``training_args_problems``), the
    Trainer arguments and hooks (``hook_problems``, from ``CephaloTrainer._hook_problems``), the
    datasets (``dataset_problems``) and the model (no model, or a class without an adapter:
    ``stage_model``'s message). Needs no process group; run it before anything else.
    ``model_refused``: a hook problem already refuses the model (its class overrides
    ``forward``): it is not staged, since what staging would report follows from that
    override (one reason per refusal).

    Raises:
        RefusedSettings: (a ValueError) one message listing every problem found.
    """
    problems = [*training_args_problems(args), *hook_problems,
                *dataset_problems(train_dataset, eval_dataset, max_steps=args.max_steps)]
    staged = None
    if model is None:
        problems.append("model: CephaloTrainer needs a model: pass model=... (model_init is not "
                        "supported: build the model yourself)")
    elif isinstance(model, str):
        problems.append(f"model = {model!r}: pass the model object, not its name (a name would "
                        "be loaded whole on every rank): AutoModelForCausalLM.from_pretrained"
                        "(name) or hf_cephalo.from_pretrained_sharded(name)")
    elif not model_refused:
        try:
            staged = stage_model(model, seq2seq=True)  # [Note: encoder-decoders at the doors]
        except ValueError as e:  # an unsupported class or PEFT setup, with the route to take
            problems.append(f"model: {e}")
    if problems:  # a TRL config names its trainer and page (integrations/trl/config.py)
        raise RefusedSettings(problems, **getattr(args, "cephalo_refusal_source", dict)())
    return staged


def engine_checkpointing_replaces_model_checkpointing(args, plan: Plan | None = None) -> None:
    """``gradient_checkpointing`` / ``activation_checkpointing``: the engine recomputes every
    unit in backward, which IS activation checkpointing. Stock ``Trainer.train()`` would switch
    the model's own checkpointing on as well (each layer's forward then runs three times per
    microbatch instead of two), so the flags are logged and cleared on ``args``.

    The user asked for checkpointing, so a plan without it is refused (before any collective):
    ``--cephalo_activation_checkpointing false``, or a plan (``plan`` / ``--cephalo_plan_file``)
    that records it off; with ``auto`` the trainer plans with checkpointing on. A flag that is on
    only by the config class's default (TRL's ``SFTConfig``) is not a request: it is cleared
    without a word and nothing is refused (``auto`` still plans with checkpointing on).

    Raises:
        ValueError: the flag with ``--cephalo_activation_checkpointing false`` or such a plan.
    """
    asked = args.activation_checkpointing or args.gradient_checkpointing
    # a config whose DEFAULT is on (TRL's SFTConfig) did not ask: no refusal, no warning
    fields = getattr(type(args), "__dataclass_fields__", {})
    by_default = all(name in fields and getattr(args, name) == fields[name].default
                     for name in ("activation_checkpointing", "gradient_checkpointing"))
    if asked and by_default:
        if args.cephalo_activation_checkpointing == "auto":
            args.cephalo_activation_checkpointing = "true"  # as when asked: plan with it on
        logger.debug("gradient_checkpointing is on by the config's default; the engine's "
                     "per-unit activation checkpointing replaces the model's")
        args.activation_checkpointing = False
        args.gradient_checkpointing = False
        return
    if asked and args.cephalo_activation_checkpointing == "false":
        raise ValueError(
            "--gradient_checkpointing (or --activation_checkpointing) asks for activation "
            "checkpointing but --cephalo_activation_checkpointing is 'false' (keep every forward "
            "graph, no recompute): drop one of them ('true' or 'auto' with the stock flag plans "
            "with checkpointing; the engine's own checkpointing replaces the model's)")
    if asked and plan is None and args.cephalo_plan_file is not None:
        plan = Plan.load(args.cephalo_plan_file)
    if asked and plan is not None and not plan.activation_checkpointing:
        source = "plan" if args.cephalo_plan_file is None else \
            f"plan file {args.cephalo_plan_file!r}"
        raise ValueError(
            "--gradient_checkpointing (or --activation_checkpointing) asks for activation "
            f"checkpointing but the {source} was made without it (activation_checkpointing "
            "false: forward graphs kept): drop the flag, or re-plan with `hf-cephalo plan "
            "--activation-checkpointing true`")
    # said once per job: every rank runs this with the same flags (RANK: the launcher's, set
    # before the process group exists), so the other ranks would repeat both lines
    say = logger.warning if os.environ.get("RANK", "0") == "0" else logger.debug
    if asked and args.cephalo_activation_checkpointing == "auto":
        say("--gradient_checkpointing with --cephalo_activation_checkpointing auto: "
            "planning with activation checkpointing on, as the flag asks")
        args.cephalo_activation_checkpointing = "true"
    if asked:
        say("gradient_checkpointing/activation_checkpointing: the Cephalo engine already "
            "recomputes every layer in backward (per-unit activation checkpointing); the "
            "model's own checkpointing is not switched on in addition")
        args.activation_checkpointing = False
        args.gradient_checkpointing = False
