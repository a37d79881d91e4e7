"""Built-in generation of the generating doors (``CephaloGRPOTrainer``, ``CephaloRLOOTrainer``):
completions decoded on the sharded engine when the trainer has no ``rollout_func``.

Each rank decodes the whole groups its rows touch (``rollout_step.RolloutStep``; a group that
spans ranks is decoded on each, and keyed sampling gives it the same tokens there), keyed by
(``seed``, the optimizer step, the row's number in the generation batch, the position)
([Note: keyed sampling] in engine/sampling.py), with the config's ``max_completion_length``,
``temperature``, ``top_p``, ``top_k`` and ``min_p``. So the run equals stock
``GRPOTrainer`` on ONE process with ``rollout_func=hf_cephalo.reproducible_rollout(seed)``
(the same function over the whole batch), whatever the plan. ``--cephalo_decode_mode`` picks
the decode mode and ``--cephalo_generation_split plan`` lets the generation planner choose the
rows each rank decodes from its measured decode speed (docs/generation.md).
"""

from __future__ import annotations

import time
from typing import Any

from hf_cephalo.integrations.trl.reproducible import (generation_round, sampling_params,
                                                       tokenize_prompts)

__all__ = ["BuiltinRollout", "generation_problems"]


def generation_problems(args) -> list[str]:
    """What built-in generation refuses in a GRPO / RLOO config (one message each)."""
    if args is None:
        return []
    problems = []
    if float(getattr(args, "repetition_penalty", 1.0) or 1.0) != 1.0:
        problems.append(f"repetition_penalty = {args.repetition_penalty}: built-in generation "
                        "samples with keyed sampling after temperature / top-k / top-p / min-p "
                        "only; set 1.0 (or pass a rollout_func)")
    if getattr(args, "generation_kwargs", None):
        problems.append(f"generation_kwargs = {args.generation_kwargs!r}: built-in generation "
                        "takes max_completion_length, temperature, top_p, top_k and min_p; set "
                        "None (or pass a rollout_func)")
    for name in ("cache_implementation", "use_transformers_paged",
                 "use_transformers_continuous_batching"):
        if getattr(args, name, None):
            problems.append(f"{name} = {getattr(args, name)!r}: built-in generation decodes "
                            "with transformers' generate and its dynamic KV cache on the "
                            f"sharded engine; leave {name} unset (or pass a rollout_func)")
    if getattr(args, "max_completion_length", 1) is None:
        problems.append("max_completion_length = None: built-in generation needs a completion "
                        "length limit")
    checks = (("temperature", "> 0 (keyed sampling divides the logits by it)",
               lambda v: v > 0),
              ("top_p", "in (0, 1]", lambda v: 0 < v <= 1),
              ("top_k", ">= 0 (0: off)", lambda v: v is None or v >= 0),
              ("min_p", "in [0, 1]", lambda v: v is None or 0 <= v <= 1),
              ("max_completion_length", ">= 1", lambda v: v is None or v >= 1))
    for name, want, ok in checks:
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            problems.append(f"{name} = {value}: built-in generation needs {want}")
    return problems


class BuiltinRollout:
    """``rollout(prompts, global_rows)`` -> TRL's rollout dict, decoded on the engine.
    Collective: every rank calls it at every generation round (a rank without rows with empty
    lists). ``report``: per round, the decode mode, the rows each rank decoded, the measured
    wall seconds on this rank and, with ``generation_split`` 'plan', the planner's prediction;
    ``profiles``: with 'plan', every rank's measured ``DecodeProfile`` (rank order).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.plan = None  # the generation planner's GenerationPlan ('plan' split)
        self.profiles = None  # each rank's measured DecodeProfile it was planned from
        self.report: list[dict[str, Any]] = []

    def _settings(self):
        return self.trainer.session.job.settings

    def _split(self) -> list[int] | None:
        """g_i of the generation planner (measured at the first round; collective then)."""
        if self._settings().generation_split != "plan":
            return None
        if self.plan is None:
            from hf_cephalo.runtime import (generation_budget_bytes, measure_decode_profiles,
                                            plan_generation_split)

            t = self.trainer
            tokens = len(t._planning_dataset()[0]["input_ids"])
            new = int(t.args.max_completion_length)
            session = t.session
            self.profiles = measure_decode_profiles(
                session.engine, seed=session.job.seed,
                memory_budget_bytes=generation_budget_bytes(session.plan, session.job.rank))
            self.plan = plan_generation_split(session, t._batch_size, max(tokens - new, 1),
                                              new, profiles=self.profiles)
        return list(self.plan.rows)

    def __call__(self, prompts: list, global_rows: list[int]) -> dict[str, Any]:
        t = self.trainer
        params = sampling_params(t.args, t, int(t.args.seed))
        prompt_ids = tokenize_prompts(t, prompts) if prompts else []
        split = self._split()
        start = time.perf_counter()
        out = t.session.generate(prompt_ids, list(global_rows), params, generation_round(t),
                                 mode=self._settings().decode_mode,
                                 pad_to_multiple_of=getattr(t, "pad_to_multiple_of", None),
                                 generation_split=split)
        self.report.append(dict(mode=out.mode, split=split, steps=out.steps,
                                measured_s=time.perf_counter() - start,
                                predicted_s=None if self.plan is None else
                                self.plan.predicted_s))
        return {"prompt_ids": prompt_ids, "completion_ids": out.completions, "logprobs": None}
