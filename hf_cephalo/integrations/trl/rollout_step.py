"""One generation round of ``CephaloGRPOTrainer`` (grpo.py): this rank's rows of the generation
batch -> its microbatches, with every value one process with the whole batch would give them
([Note: rows of a generation batch] in rollout.py). Collective: every rank calls it at every
generation round, also a rank without rows."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from hf_cephalo.integrations.trl.rollout import RowGroups, group_advantages, pad_rows, padded_width
from hf_cephalo.runtime import StepExchange

__all__ = ["RolloutStep", "round_steps"]


def round_steps(args) -> int:
    """The optimizer steps one generation round feeds for the config ``args``:
    ``steps_per_generation`` (1 where unset) x ``num_iterations``."""
    return max(int(getattr(args, "steps_per_generation", None) or 1), 1) * args.num_iterations


class _Pass:
    """A forward-only pass giving each row's completion log-probabilities: ``runner``'s
    ``evaluate`` (the session's, or a forward-only engine the session built) with ``items``
    (the engine's ``CompletionItems``) in log-probability mode, inside ``context()``."""

    def __init__(self, runner, items, context: Callable[[], Any], head) -> None:
        self.runner, self.items, self.context, self.head = runner, items, context, head

    def __call__(self, microbatches: list[dict[str, Any]]) -> list[torch.Tensor]:
        with self.context(), self.items.logprobs(self.head):
            out = self.runner.evaluate(microbatches, return_logits=True)
        return list(out.logits)


class RolloutStep:
    """``step(groups, generation_round)`` -> this rank's microbatches of the round (dicts of
    the TRL trainer's loss inputs plus ``input_ids`` / ``attention_mask`` for the engine).
    GRPO's; ``rloo.RLOORolloutStep`` overrides the decoding, log-probabilities and
    advantages."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.exchange = StepExchange(trainer.session.group)
        head = trainer._fused_head(("log_probs",))
        self.policy = _Pass(trainer.session, trainer._items, contextlib.nullcontext, head)
        self.entropy_head = trainer._fused_head(("log_probs", "entropy"))
        self.reference = None
        if trainer.beta != 0.0:
            self.reference = self._reference(trainer, head)

    @staticmethod
    def needs_old_logprobs(args) -> bool:
        """GRPOTrainer's rule for the old policy's log-probabilities: gradient accumulation
        steps not a multiple of the steps a round feeds (``round_steps``), so with one step per
        generation: ``num_iterations`` > 1."""
        return args.gradient_accumulation_steps % round_steps(args) != 0

    @classmethod
    def passes_per_round(cls, args) -> int:
        """The forward-only passes ``_logprobs`` runs per generation round for the config
        ``args``: the old policy's (``needs_old_logprobs``) plus the reference's with ``beta``
        != 0."""
        return int(cls.needs_old_logprobs(args)) + int(args.beta != 0.0)

    @staticmethod
    def _reference(trainer, head) -> _Pass:
        """TRL's ``ref_model`` as a second engine sharded by the plan, or (a PEFT policy) the
        policy's own engine with its adapter off (``use_adapter``, as GRPOTrainer)."""
        from hf_cephalo.integrations.trl.rollout_door import CompletionItems
        from hf_cephalo.runtime import stage_model

        if trainer.ref_model is not None:
            items = CompletionItems(stage_model(trainer.ref_model), trainer._items.per_token)
            engine = trainer.session.forward_only_engine(items)
            return _Pass(engine, items, contextlib.nullcontext, head)
        from trl.trainer.utils import use_adapter

        model = trainer.model
        name = "ref" if "ref" in getattr(model, "peft_config", {}) else None
        return _Pass(trainer.session, trainer._items, lambda: use_adapter(model, name), head)

    # ---- the round -----------------------------------------------------------------------
    def __call__(self, groups: RowGroups, generation_round: int) -> list[dict[str, Any]]:
        out = self._agreed(lambda: self._rollout(groups, generation_round), "the rollout")
        prompts = [row["prompt"] for row in groups.rows]
        completions = self._decode(prompts, out["prompt_ids"], out["completion_ids"])
        tool_mask = out["extra"].pop("env_mask", None)
        widths = self._length_metrics(out["prompt_ids"], out["completion_ids"], tool_mask)
        rows = self._tensors(out, tool_mask, widths)
        microbatches = self._cut(rows)
        self._logprobs(microbatches, rows)
        for i, row in enumerate(groups.rows):  # rollout extras reach the reward functions
            for key, values in out["extra"].items():
                row[key] = values[i] if isinstance(values, list) else values
        rewards = self._agreed(lambda: self._local_rewards(groups.rows, prompts, completions,
                                                           out["completion_ids"]),
                               "a reward function")
        advantages = self._advantages(rewards, groups, prompts, completions, microbatches)
        start = 0
        for mb in microbatches:
            n = mb["input_ids"].shape[0]
            mb["advantages"] = advantages[start:start + n]
            start += n
        self._flush_user_logs(len(prompts))
        return microbatches

    def _agreed(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()``; when it raises on any rank, the same ``LoaderStepError`` on every rank
        (one status exchange: never a hang, never one rank alone failing)."""
        result, error = None, None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = exc
        self.exchange.agree(error, f"CephaloGRPOTrainer: {what}")
        return result

    def _rollout(self, groups: RowGroups, generation_round: int) -> dict[str, Any]:
        """This rank's rows of the rollout of the whole groups it touches (none: empty)."""
        if not groups.rows:
            if self.trainer.rollout_func is None:  # built-in generation is collective
                self.trainer._cephalo_rollout([], [], generation_round)
            return {"prompt_ids": [], "completion_ids": [], "logprobs": None, "extra": {}}
        output = self.trainer._cephalo_rollout(groups.group_prompts, groups.group_rows,
                                               generation_round)
        mine = {key: groups.mine(value) for key, value in output.items()}
        logprobs = mine.pop("logprobs")
        return {"prompt_ids": mine.pop("prompt_ids"), "completion_ids": mine.pop("completion_ids"),
                "logprobs": logprobs, "extra": mine}

    def _decode(self, prompts: list, prompt_ids: list, completion_ids: list) -> list:
        """The completions as GRPOTrainer decodes them (text, or assistant messages)."""
        from trl.data_utils import is_conversational

        t = self.trainer
        if not prompts:
            return []
        if not is_conversational({"prompt": prompts[0]}):
            return t.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        tok = t._tokenizer
        if getattr(tok, "response_template", None) is not None or \
                getattr(tok, "response_schema", None) is not None:
            from trl.chat_template_utils import parse_response

            return [[parse_response(tok, ids, prefix=prompt_ids[i], tools=t.tools)]
                    for i, ids in enumerate(completion_ids)]
        contents = t.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        return [[{"role": "assistant", "content": c}] for c in contents]

    def _length_metrics(self, prompt_ids: list, completion_ids: list, tool_mask) -> tuple:
        """GRPOTrainer's completion metrics over the batch's rows; returns the batch's
        (prompt width, completion width) before rounding."""
        t = self.trainer
        metrics = t._metrics["train"]
        prompt_lengths = self._gather(torch.tensor([len(ids) for ids in prompt_ids],
                                                   dtype=torch.long))
        lengths = torch.tensor([sum(m) for m in tool_mask] if tool_mask is not None
                               else [len(ids) for ids in completion_ids], dtype=torch.long)
        lengths = self._gather(lengths)
        t.state.num_input_tokens_seen += int(prompt_lengths.sum() + lengths.sum())
        metrics["num_tokens"] = [t.state.num_input_tokens_seen]
        metrics["completions/mean_length"].append(lengths.float().mean().item())
        metrics["completions/min_length"].append(lengths.float().min().item())
        metrics["completions/max_length"].append(lengths.float().max().item())
        truncated = self._gather(self._truncated(completion_ids))
        metrics["completions/clipped_ratio"].append(truncated.float().mean().item())
        terminated = lengths[~truncated]
        if len(terminated) == 0:
            terminated = torch.zeros(1)
        metrics["completions/mean_terminated_length"].append(terminated.float().mean().item())
        metrics["completions/min_terminated_length"].append(terminated.float().min().item())
        metrics["completions/max_terminated_length"].append(terminated.float().max().item())
        full_lengths = self._gather(torch.tensor([len(ids) for ids in completion_ids],
                                                 dtype=torch.long))
        return int(prompt_lengths.max()), int(full_lengths.max())

    def _truncated(self, completion_ids: list) -> torch.Tensor:
        t = self.trainer
        eos_and_pad = [*t.eos_token_ids, t._tokenizer.pad_token_id]
        return torch.tensor([ids[-1] not in eos_and_pad for ids in completion_ids],
                            dtype=torch.bool)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``tensor`` in global row order (rank order = row order)."""
        return self.trainer.session.gather_rows(tensor).cpu()

    def _tensors(self, out: dict[str, Any], tool_mask, widths: tuple) -> dict[str, Any]:
        """This rank's rows as GRPOTrainer's padded tensors, at the BATCH's widths."""
        t = self.trainer
        device, pad_id = t.args.device, t._tokenizer.pad_token_id
        P, C = (padded_width(w, t.pad_to_multiple_of) for w in widths)
        prompt_ids, completion_ids = out["prompt_ids"], out["completion_ids"]
        rows = {
            "prompt_ids": pad_rows(prompt_ids, P, pad_id, left=True, dtype=torch.long),
            "prompt_mask": pad_rows([[1] * len(x) for x in prompt_ids], P, 0, left=True,
                                    dtype=torch.long),
            "completion_ids": pad_rows(completion_ids, C, pad_id, left=False, dtype=torch.long),
            "completion_mask": pad_rows([[1] * len(x) for x in completion_ids], C, 0,
                                        left=False, dtype=torch.long)}
        if out["logprobs"] is not None:
            rows["sampling_per_token_logps"] = pad_rows(
                [[float("nan") if x is None else x for x in lp] for lp in out["logprobs"]], C,
                0.0, left=False, dtype=torch.float32)
        if tool_mask is not None:
            rows["tool_mask"] = pad_rows(tool_mask, C, 1, left=False, dtype=torch.long)
        if t.mask_truncated_completions and prompt_ids:
            keep = (~self._truncated(completion_ids)).unsqueeze(1).long()
            rows["completion_mask"] = rows["completion_mask"] * keep
            if tool_mask is not None:
                rows["tool_mask"] = rows["tool_mask"] * keep
        mask = rows["completion_mask"] * rows.get("tool_mask", 1)
        rows["num_items_in_batch"] = self._gather(mask.sum().reshape(1)).sum()
        rows["input_ids"] = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
        rows["attention_mask"] = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
        return {k: v.to(device) for k, v in rows.items()}

    def _cut(self, rows: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        """This rank's rows in microbatches of its m_i."""
        t = self.trainer
        n = rows["input_ids"].shape[0]
        m = max(t.plan.ranks[t.args.process_index].microbatch_size, 1)
        return [{k: (v if v.dim() == 0 else v[s:s + m]) for k, v in rows.items()}
                for s in range(0, n, m)]

    def _logprobs(self, microbatches: list[dict[str, Any]], rows: dict[str, Any]) -> None:
        """The old policy's (when GRPOTrainer needs them: ``num_iterations`` > 1) and the
        reference's per-token log-probabilities, into each microbatch. Collective."""
        t = self.trainer
        with torch.no_grad():
            if self.needs_old_logprobs(t.args):
                for mb, logps in zip(microbatches, self.policy(microbatches)):
                    mb["old_per_token_logps"] = logps
            if self.reference is not None:
                for mb, logps in zip(microbatches, self.reference(microbatches)):
                    mb["ref_per_token_logps"] = logps

    def entropy_threshold(self, microbatches: list[dict[str, Any]], q: float) -> float | None:
        """TRL's ``torch.quantile(q)`` of the entropies of every loss token of the step's
        global batch under the current weights (None: no loss token). Collective: a
        forward-only pass of the policy and one row gather."""
        from hf_cephalo.integrations.trl.rollout_door import loss_mask

        with torch.no_grad(), self.policy.items.logprobs(self.entropy_head, "entropy"):
            out = self.policy.runner.evaluate(microbatches, return_logits=True)
        local = [ent[loss_mask(mb).bool()].float().cpu()
                 for mb, ent in zip(microbatches, out.logits)]
        gathered = self._gather(torch.cat(local) if local else torch.zeros(0))
        return None if gathered.numel() == 0 else torch.quantile(gathered, q)

    def _local_rewards(self, rows, prompts, completions, completion_ids) -> torch.Tensor:
        """(b_i, num_funcs): TRL's ``_calculate_rewards`` on this rank's rows, its closing
        all-gather left out (the rows are gathered in global order by ``_advantages``)."""
        import importlib

        t = self.trainer
        if not rows:
            return torch.zeros((0, len(t.reward_funcs)), device=t.args.device)
        module = importlib.import_module(type(t)._calculate_rewards.__module__)
        saved = module.gather
        module.gather = lambda tensor: tensor  # scoped: restored below
        try:
            return t._calculate_rewards(rows, prompts, completions, completion_ids)
        finally:
            module.gather = saved

    def _group_advantages(self, rewards_per_func: torch.Tensor, microbatches: list):
        """The batch's advantages from its rewards (``rollout.Advantages``): GRPO's."""
        t = self.trainer
        return group_advantages(rewards_per_func, t.reward_weights, t.num_generations,
                                t.scale_rewards, t.multi_objective_aggregation)

    def _advantages(self, rewards: torch.Tensor, groups: RowGroups, prompts: list,
                    completions: list, microbatches: list) -> torch.Tensor:
        """The batch's rewards in global row order -> advantages (this rank's rows), and
        TRL's reward metrics and completion logs, as one process computes them."""
        from accelerate.utils import gather_object
        from trl.trainer.utils import nanstd

        t = self.trainer
        rewards_per_func = self._gather(rewards)
        result = self._group_advantages(rewards_per_func, microbatches)
        metrics = t._metrics["train"]
        for i, name in enumerate(t.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
            metrics[f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, i]).item())
        metrics["reward"].append(torch.nanmean(result.rewards).item())
        metrics["reward_std"].append(nanstd(result.rewards).item())
        metrics["frac_reward_zero_std"].append(result.is_std_zero.float().mean().item())
        t._logs["prompt"].extend(gather_object(prompts))
        t._logs["completion"].extend(gather_object(completions))
        for i, name in enumerate(t.reward_func_names):
            t._logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
        t._logs["advantages"].extend(result.advantages.tolist())
        return result.advantages[groups.batch_rows].to(t.args.device) if groups.batch_rows \
            else result.advantages[:0].to(t.args.device)

    def _flush_user_logs(self, num_rows: int) -> None:
        """What reward functions logged (``log_extra`` / ``log_metric``), gathered over the
        ranks as GRPOTrainer flushes it (a metric: its values' sum over their count)."""
        from accelerate.utils import gather_object

        t = self.trainer
        for column in sorted(set(gather_object(list(t._pending_extra_logs)))):
            values = t._pending_extra_logs.get(column, [None] * num_rows)
            t._logs["extra"][column].extend(gather_object(values))
        t._pending_extra_logs.clear()
        for name in sorted(set(gather_object(list(t._pending_metrics)))):
            values = t._pending_metrics.get(name, [])
            local = torch.tensor([[sum(values), len(values)]], dtype=torch.float32)
            total, count = self._gather(local).sum(dim=0).tolist()
            t._metrics["train"][name].append(total / count)
        t._pending_metrics.clear()
