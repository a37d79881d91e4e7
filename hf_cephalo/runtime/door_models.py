"""Staging a model for a door (``CephaloTrainer``, ``CephaloAccelerator.prepare``, TRL's
trainers): ``models.stage_model`` less the models the engine trains but no door takes yet.
"""

from __future__ import annotations

from torch import nn

from hf_cephalo.models.base import StagedModel
from hf_cephalo.models.registry import stage_model as stage_any_model
from hf_cephalo.models.seq2seq import Seq2SeqStagedModel


def stage_model(model: nn.Module) -> StagedModel:
    """``hf_cephalo.models.stage_model(model)`` for a door.

    Raises:
        ValueError: as ``models.stage_model`` (an unsupported class, ...), and for an
            encoder-decoder (T5's and BART's ``...ForConditionalGeneration``): the engine trains
            them exactly (``CephaloEngine`` with a plan: docs/engine.md, "Side inputs"), but
            the doors' data path (one sequence length per row for padding and splitting), item
            counts and predictions are those of decoder-only and encoder-only models, unchecked
            for a second sequence. Raised before any collective.
    """
    staged = stage_any_model(model)
    if isinstance(staged, Seq2SeqStagedModel):
        raise ValueError(
            f"{type(staged.model).__name__} is an encoder-decoder: hf_cephalo's engine trains "
            "it exactly (hf_cephalo.engine.CephaloEngine with a plan, Plan.from_ratios; "
            "docs/engine.md, \"Side inputs\"), but this door does not take encoder-decoders "
            "yet (its padding, batch split, item counts and predictions are checked for one "
            "token sequence per row, not an encoder's and a decoder's). Nothing was run")
    return staged
