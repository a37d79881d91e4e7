"""A preference pair as one sample: the chosen and rejected rows folded into one row and back
(the DPO and reward doors; [Note: a preference pair is one sample] in dpo.py).

TRL's preference collator returns the ``m`` chosen rows, then the ``m`` rejected ones. ``PairRows``
folds such a batch to one ``(2, ...)`` row per pair, so the weighted split keeps both sequences of
a pair on one rank and in one microbatch (padded as one process pads the global batch);
``unfold_pairs`` restores TRL's layout before the engine runs a microbatch. Tensors with one value
per pair (``per_pair_keys``: DPO's precomputed reference log-probabilities, the reward margin)
stay as they are.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hf_cephalo.runtime import Microbatch, collator_name

__all__ = ["PairRows", "unfold_pairs", "PAIR_ROWS", "PairWidths", "PairPlanning"]

PAIR_ROWS = 2
"""Sequence rows of one preference pair in the engine's microbatch (chosen + rejected): the
doors' ``Job.rows_per_sample``, the planner's pricing of a pair (planner/rows.py)."""


class PairRows:
    """The preference collator with one row per pair: ``collate_fn(examples)``'s tensors of
    ``2m`` rows (chosen rows, then rejected) as ``(m, 2, ...)``; ``per_pair_keys`` tensors and
    other values as they are. ``door`` names the trainer in errors.

    Raises ValueError naming the collator when a row tensor has not ``2m`` rows."""

    def __init__(self, collate_fn: Any, per_pair_keys: Sequence[str], door: str) -> None:
        self.collate_fn = collate_fn
        self.data_collator = collate_fn  # what error messages name (global_width.collator_name)
        self.per_pair_keys, self.door = tuple(per_pair_keys), door

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        batch, m = self.collate_fn(examples), len(examples)
        out = {}
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() >= 1 and key not in self.per_pair_keys:
                if value.shape[0] != 2 * m:
                    raise ValueError(f"data collator {collator_name(self)} returned {key!r} of "
                                     f"shape {tuple(value.shape)} for {m} preference pairs: "
                                     f"{self.door} needs 2 rows per pair (the chosen rows, then "
                                     "the rejected ones), as TRL's DataCollatorForPreference "
                                     "returns them")
                value = torch.stack([value[:m], value[m:]], dim=1)
            out[key] = value
        return out


def unfold_pairs(microbatch: Microbatch, per_pair_keys: Sequence[str]) -> dict[str, Any]:
    """A ``PairRows`` microbatch in TRL's layout: each ``(m, 2, ...)`` tensor (but the
    ``per_pair_keys`` ones) as ``2m`` rows, the ``m`` chosen rows first."""
    out = dict(microbatch)
    for key, value in microbatch.items():
        if torch.is_tensor(value) and value.dim() >= 2 and key not in per_pair_keys:
            out[key] = torch.cat([value[:, 0], value[:, 1]])
    return out


class PairWidths:
    """What prices a pair door's profile (the mixin's ``_planning_dataset``): for each pair of
    a tokenized preference dataset, one row of ``input_ids`` as long as the pair's longer
    sequence (``prompt_ids`` + the longer of ``chosen_ids`` / ``rejected_ids``; without
    ``prompt_ids``, the reward trainer's, the longer of the two), at most ``max_length``
    (the collator's truncation; None: none). The profile is measured per row at that width and
    a pair is priced as ``PAIR_ROWS`` such rows (planner/rows.py). Only lengths are real.
    ``sequence_length_of`` reads its first rows; a dataset without the columns is used as it
    is (``of``)."""

    def __init__(self, dataset: Any, max_length: int | None) -> None:
        self.dataset, self.max_length = dataset, max_length

    @classmethod
    def of(cls, dataset: Any, max_length: int | None) -> Any:
        """A ``PairWidths`` over ``dataset`` when it has the tokenized pair columns and a
        length, else ``dataset`` itself."""
        names = getattr(dataset, "column_names", None) or ()
        if "chosen_ids" in names and "rejected_ids" in names and hasattr(dataset, "__len__"):
            return cls(dataset, max_length)
        return dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        row = self.dataset[index]
        width = len(row.get("prompt_ids") or ()) + max(len(row["chosen_ids"]),
                                                       len(row["rejected_ids"]))
        if self.max_length is not None:
            width = min(width, self.max_length)
        return {"input_ids": [0] * width}


class PairPlanning:
    """What the DPO and reward doors (a sample is a preference pair) tell the planner; a base
    placed before ``CephaloTrainerMixin``, whose ``_planning_dataset`` / ``_rows_per_sample``
    it overrides."""

    def _planning_dataset(self):
        """The profile's rows: each pair's longer sequence, at most ``max_length``
        (``PairWidths``; the tokenized pair dataset has no ``input_ids``)."""
        return PairWidths.of(self.train_dataset, self.args.max_length)

    def _rows_per_sample(self) -> int:
        """2: a pair's chosen and rejected rows share one microbatch (``PairRows``), so the
        planner prices a microbatch of m pairs as 2m rows (planner/rows.py)."""
        return PAIR_ROWS
