"""The pieces of a generating TRL trainer's step that are the math of ONE process with the
whole generation batch, whatever rank holds a row (``CephaloGRPOTrainer``, grpo.py).

[Note: rows of a generation batch]
One process with the whole generation batch of B rows (B / G prompts, each repeated G times in
a row: TRL's ``RepeatSampler``) computes every reward, every group's mean and std and every
logged statistic over those B rows. On the engine, rank i trains the consecutive global rows
[o_i, o_i + b_i) of each batch (the weighted split, sequential over ``GenerationRows``), so a
group may span ranks and a rank may hold none. So each rank computes the per-row values of its
own rows (completion lengths, rewards of every reward function), one row gather in rank order
makes the batch's values in global row order on every rank, and the group statistics are
computed there, each rank keeping its rows' advantages: the same numbers as one process,
whatever the plan. Widths are the batch's too: prompts left-padded and completions
right-padded to the global batch's longest (rounded up to ``pad_to_multiple_of``), so every
token sits at the position one process gives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["Advantages", "GenerationRows", "RowGroups", "group_advantages", "pad_rows",
           "padded_width"]

POSITION = "_cephalo_row"
"""The key ``GenerationRows`` adds to each row: its index in the epoch's row order."""


class GenerationRows(torch.utils.data.Dataset):
    """A prompt dataset in the row order one process reads it (``order``: TRL's
    ``RepeatSampler`` indices, each prompt G times in a row): row j is the dataset's row
    ``order[j]`` as a dict, plus ``POSITION`` = j."""

    def __init__(self, dataset, order: Sequence[int]) -> None:
        self.dataset, self.order = dataset, list(order)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, j: int) -> dict[str, Any]:
        return {**dict(self.dataset[self.order[j]]), POSITION: j}


@dataclass(frozen=True)
class RowGroups:
    """This rank's rows of one generation batch and the whole groups they touch.

    Attributes:
        rows: this rank's row dicts (``POSITION`` removed), in global order.
        batch_rows: their row numbers in the batch (0 .. B - 1), consecutive.
        group_rows: the batch row numbers of every group they touch, whole (G per group).
        group_prompts: the prompt of each entry of ``group_rows``.
    """

    rows: list[dict[str, Any]]
    batch_rows: list[int]
    group_rows: list[int]
    group_prompts: list[Any]

    @classmethod
    def of(cls, rows: list[dict[str, Any]], batch_size: int, num_generations: int) -> "RowGroups":
        rows = [dict(r) for r in rows]
        batch_rows = [r.pop(POSITION) % batch_size for r in rows]
        first: dict[int, dict[str, Any]] = {}
        for row, j in zip(rows, batch_rows):
            first.setdefault(j // num_generations, row)
        group_rows, prompts = [], []
        for group, row in first.items():
            group_rows += range(group * num_generations, (group + 1) * num_generations)
            prompts += [row["prompt"]] * num_generations
        return cls(rows, batch_rows, group_rows, prompts)

    def mine(self, values: Any) -> Any:
        """``values`` given for every entry of ``group_rows``: this rank's entries (a list or
        tensor with one entry per group row; anything else as it is)."""
        if isinstance(values, (list, tuple)) and len(values) == len(self.group_rows):
            where = {j: k for k, j in enumerate(self.group_rows)}
            return [values[where[j]] for j in self.batch_rows]
        return values


def pad_rows(rows: Sequence[Sequence[float]], width: int, value: float, *, left: bool,
             dtype: torch.dtype) -> torch.Tensor:
    """(len(rows), width): each row padded with ``value`` on the left or right to ``width``."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for k, row in enumerate(rows):
        n = len(row)
        if n:
            target = out[k, width - n:] if left else out[k, :n]
            target.copy_(torch.as_tensor(list(row), dtype=dtype))
    return out


def padded_width(longest: int, multiple: int | None) -> int:
    """``longest`` rounded up to a multiple of ``multiple`` (TRL's ``pad`` with
    ``pad_to_multiple_of``)."""
    if multiple is None or multiple <= 1:
        return longest
    return -(-longest // multiple) * multiple


@dataclass(frozen=True)
class Advantages:
    """What one process computes from the batch's rewards: ``advantages`` (B,), the
    per-row ``rewards`` (weighted sum, NaN where unscorable) and ``is_std_zero`` (B,)."""

    advantages: torch.Tensor
    rewards: torch.Tensor
    is_std_zero: torch.Tensor


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str, aggregation: str) -> Advantages:
    """GRPO's advantages of a whole generation batch (rewards_per_func: (B, num_funcs), the
    global batch's rows in order), exactly as ``GRPOTrainer._generate_and_score_completions``
    computes them on one process (TRL 1.16): ``sum_then_normalize`` (group mean; std of the
    group, of the batch, or none) or ``normalize_then_sum``.

    Raises ValueError for an unknown ``scale_rewards`` / ``aggregation``."""
    from trl.trainer.utils import nanstd

    G = num_generations
    weights = weights.to(rewards_per_func.device).unsqueeze(0)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
        if scale_rewards in ("group", "none"):
            std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0) if G > 1 \
                else torch.zeros_like(rewards)
        elif scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 \
                else torch.zeros_like(rewards)
        else:
            raise ValueError(f"scale_rewards = {scale_rewards!r}: use 'batch', 'group' or 'none'")
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, G, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if G > 1 else torch.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
        rewards = (reward_k * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 \
            else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        raise ValueError(f"multi_objective_aggregation = {aggregation!r}: use "
                         "'sum_then_normalize' or 'normalize_then_sum'")
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    logged = (rewards_per_func * weights).nansum(dim=1)
    logged[unscorable] = torch.nan
    return Advantages(torch.nan_to_num(advantages, nan=0.0), logged, is_std_zero)
