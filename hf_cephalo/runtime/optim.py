"""The optimizer over the shards: built by name, or an optimizer the user built re-pointed.

Every front end's optimizer steps the engine's per-parameter shards (``engine.param_shards``,
[Note: per-parameter shards] in engine/param_shards.py): one 1-D shard per trainable parameter,
so the model's parameter groups survive sharding exactly (stock Trainer's decay / no-decay
groups, a user's per-group learning rates).

- ``shard_optimizer``: a new optimizer of a class and kwargs over named groups (the Trainer's
  ``optim`` / ``optimizer_cls_and_kwargs``).
- ``repoint_optimizer``: an optimizer the user built over the model's parameters BEFORE the engine
  existed (``accelerator.prepare(model, optimizer)``, ``Trainer(optimizers=(opt, sched))``)
  keeps its class, groups, hyperparameters and identity; each group's parameters are replaced
  by their shards, in place, as Accelerate re-points an optimizer at FSDP2's sharded parameters
  (``accelerate.utils.fsdp_utils.fsdp2_switch_optimizer_parameters``), so an LR scheduler built
  on it stays bound.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

__all__ = ["shard_optimizer", "repoint_optimizer", "repoint_problems", "parameter_names",
           "check_elementwise_optimizer", "decay_groups", "engine_names", "NOT_ELEMENTWISE"]

NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon", "Shampoo", "GaLoreAdamW",
                   "GaLoreAdamW8bit", "GaLoreAdafactor", "Apollo", "Lomo", "AdaLomo")
"""Optimizer classes whose state or update is not one value per parameter element (or that
need a closure / sparse gradients), so they cannot step flat 1-D shards."""


def check_elementwise_optimizer(optimizer_cls: type, what: str) -> None:
    """Refuse (ValueError, before any collective) an optimizer class that cannot step 1-D
    shards: a closure (LBFGS), sparse gradients (SparseAdam), factored or matrix-shaped state
    (Adafactor, Muon, Shampoo, GaLore, APOLLO), or the model itself (LOMO)."""
    names = {c.__name__ for c in optimizer_cls.__mro__}
    bad = sorted(names.intersection(NOT_ELEMENTWISE))
    if bad:
        raise ValueError(f"{what}: {optimizer_cls.__name__} is not an element-wise optimizer (it "
                         "needs a closure, sparse gradients, matrix-shaped state or the model "
                         "itself), so it cannot step the engine's 1-D parameter shards; use "
                         "torch.optim.AdamW, Adam, SGD, RMSprop, Adagrad, NAdam, RAdam, ...")


def decay_groups(names: Iterable[str], decay_names: set[str], weight_decay: float
                 ) -> list[dict[str, Any]]:
    """Stock ``Trainer.create_optimizer``'s two groups by parameter name: the names in
    ``decay_names`` with ``weight_decay``, the rest (biases, norms) with 0."""
    names = list(names)
    return [{"names": [n for n in names if n in decay_names], "weight_decay": weight_decay},
            {"names": [n for n in names if n not in decay_names], "weight_decay": 0.0}]


def shard_optimizer(engine, optimizer_cls: type, optimizer_kwargs: Mapping[str, Any],
                    groups: Sequence[Mapping[str, Any]]) -> torch.optim.Optimizer:
    """``optimizer_cls(param_groups, **optimizer_kwargs)`` over this rank's shards, one group per
    entry of ``groups`` (its ``names``: trainable parameter names, the rest: the group's
    hyperparameters).

    Raises ValueError for a non-element-wise optimizer class or an unknown name.
    """
    check_elementwise_optimizer(optimizer_cls, "optimizer")
    shards = engine.param_shards.by_name
    param_groups = []
    for group in groups:
        unknown = [n for n in group["names"] if n not in shards]
        if unknown:
            raise ValueError(f"optimizer group names {unknown[:3]} are not trainable parameters "
                             "of the model")
        param_groups.append({**{k: v for k, v in group.items() if k != "names"},
                             "params": [shards[n] for n in group["names"]]})
    return optimizer_cls(param_groups, **optimizer_kwargs)


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> the engine's name for every parameter of ``model``: what
    ``repoint_optimizer`` needs, taken before the engine replaces the parameters.

    The engine names parameters as the model it stages does: a LoRA ``PeftModel``'s are those
    of the model it wraps (``base_model.model.``'s names, without that prefix), so an optimizer
    or a decay group built over the ``PeftModel`` finds its shards (``engine_names``).
    """
    from hf_cephalo.models.peft_lora import is_peft_model

    inner = model.base_model.model if is_peft_model(model) else model
    return {id(p): n for n, p in inner.named_parameters()}


def engine_names(model: torch.nn.Module, names: Iterable[str]) -> set[str]:
    """The engine's names (``parameter_names``) of the parameters ``model.named_parameters()``
    calls ``names``: e.g. stock ``get_decay_parameter_names`` of a ``PeftModel``
    (``base_model.model.model.layers.0...lora_A.default.weight``) as the engine's shards are
    named (``model.layers.0...lora_A.default.weight``)."""
    name_of, wanted = parameter_names(model), set(names)
    return {name_of[id(p)] for n, p in model.named_parameters() if n in wanted}


def repoint_problems(optimizer: torch.optim.Optimizer, name_of: Mapping[int, str], what: str,
                     *, shard_ids: frozenset[int] = frozenset(),
                     scheduler: Any = None) -> list[str]:
    """Why ``optimizer`` cannot be re-pointed at the shards (empty: it can); needs no engine
    and no process group, so a front end can refuse before any collective.

    One message each for: a class that cannot step 1-D shards (``NOT_ELEMENTWISE``); state
    already held (it stepped before the engine existed: that state is not laid out for the
    shards); a tensor that is neither a parameter of the model (``name_of``: ``id(parameter)``
    -> name, taken before the engine replaced them) nor a shard (``shard_ids``); a
    ``scheduler`` bound to another optimizer object (it would step the learning rate of an
    optimizer nobody steps).
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer's
    problems = []
    try:
        check_elementwise_optimizer(type(inner), what)
    except ValueError as e:
        problems.append(str(e))
    if any(inner.state.values()):
        problems.append(f"{what}: the optimizer already holds state (it stepped before the "
                        "engine sharded the model); build it fresh over model.parameters() and "
                        "take its first step through the engine (after prepare(), or in the "
                        "trainer)")
    for i, group in enumerate(inner.param_groups):
        stranger = next((p for p in group["params"]
                         if id(p) not in shard_ids and id(p) not in name_of), None)
        if stranger is not None:
            problems.append(f"{what}: param group {i} holds a tensor of shape "
                            f"{tuple(stranger.shape)} that is not a parameter of the model being "
                            "sharded (a second model's?); Cephalo trains one model: build the "
                            "optimizer over that model's parameters only")
            break
    bound = getattr(scheduler, "optimizer", inner)
    if scheduler is not None and getattr(bound, "optimizer", bound) is not inner:
        problems.append(f"{what}: the LR scheduler {type(scheduler).__name__} is bound to "
                        "another optimizer object than the one given, so it would set the "
                        "learning rate of an optimizer nobody steps; build it over the "
                        "optimizer you pass")
    return problems


def repoint_optimizer(optimizer: torch.optim.Optimizer, engine, name_of: Mapping[int, str],
                      what: str) -> None:
    """Replace, in place, every parameter of ``optimizer`` (built over the model's original
    parameters) by its shard: ``name_of`` maps ``id(original parameter)`` to its name (taken
    before the engine replaced the parameters). Frozen parameters (no gradient, no state under
    stock either) are dropped from their groups; the groups and their hyperparameters stay, and
    so does the object (an LR scheduler built on it stays bound).

    Raises (ValueError, before any collective): the first of ``repoint_problems`` (a class that
    cannot step shards, state already held, a tensor that is not the model's).
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer's
    shards = engine.param_shards
    own = frozenset(id(p) for p in shards.params)
    problems = repoint_problems(inner, name_of, what, shard_ids=own)
    if problems:
        raise ValueError(problems[0])
    for group in inner.param_groups:
        params = []
        for p in group["params"]:
            if id(p) in own:  # already a shard (built over the prepared model's parameters)
                params.append(p)
            elif name_of[id(p)] in shards.by_name:  # else frozen: no shard, no state
                params.append(shards.by_name[name_of[id(p)]])
        group["params"] = params
    inner.state.clear()
