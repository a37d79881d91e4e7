"""The document inputs a layout-aware text model's forward takes beside its tokens, for the
batches hf_cephalo builds itself (the self-check's, the coverage sweep's, the profiler's).

[Note: document inputs]
Document models read each token's place on the page: a box (``bbox``: LayoutLM, LayoutLMv3,
LiLT, Bros) or its position in the HTML tree (``xpath_tags_seq`` / ``xpath_subs_seq``:
MarkupLM). Bros refuses a forward without boxes; the others fill in constant defaults, on which
the check would prove the staging only for pages whose tokens all sit in one place. So where
the forward takes such an input, the check's batch gives varied ones, and the staging is proven
with them flowing through the model's own embeddings; in training they are forward inputs of
the microbatch like ``token_type_ids`` (``generic.forward_inputs``), cut into microbatches by
rows, so the user's collator must give them (the tokenizer / processor of these models does).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

BOX_COORDINATE_MAX = 1000
"""The largest integer box coordinate of the LayoutLM family's tokenizers (pages normalized to
0..1000); below ``max_2d_position_embeddings`` (1024)."""


def _forward_takes(cls: type) -> set[str]:
    try:
        return set(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):  # no inspectable forward: no document inputs
        return set()


def document_inputs(cls: type, config: Any, ids: torch.Tensor, mask: torch.Tensor,
                    g: torch.Generator) -> dict[str, torch.Tensor]:
    """The document inputs ``cls.forward`` takes, for tokens ``ids`` (B, S) with padding
    ``mask`` (B, S) ([Note: document inputs]); {} for a model that takes none.

    ``bbox`` (B, S, 4): boxes (x0, y0, x1, y1) with x0 <= x1, y0 <= y1, zeros on padding;
    int64 in [0, min(1000, max_2d_position_embeddings - 1)] where the config embeds coordinates
    by value (``max_2d_position_embeddings``: LayoutLM, LayoutLMv3, LiLT), else float32 in
    [0, 1] (a page-normalized box the model scales itself: Bros's ``bbox_scale``).
    ``xpath_tags_seq`` / ``xpath_subs_seq`` (B, S, max_depth) int64: tag ids below
    ``max_xpath_tag_unit_embeddings`` and subscripts below ``max_xpath_subs_unit_embeddings``,
    the config's ``tag_pad_id`` / ``subs_pad_id`` on padding. Raises nothing; a config without
    the fields an input needs gets no such input (its forward's default stands)."""
    takes = _forward_takes(cls)
    out: dict[str, torch.Tensor] = {}
    if "bbox" in takes:
        out["bbox"] = _boxes(config, ids.shape, mask, g)
    depth = getattr(config, "max_depth", None)
    for key, limit_field, pad_field in (
            ("xpath_tags_seq", "max_xpath_tag_unit_embeddings", "tag_pad_id"),
            ("xpath_subs_seq", "max_xpath_subs_unit_embeddings", "subs_pad_id")):
        limit, pad = getattr(config, limit_field, None), getattr(config, pad_field, None)
        if key in takes and all(isinstance(v, int) for v in (depth, limit, pad)):
            seq = torch.randint(0, limit, (*ids.shape, depth), generator=g)
            out[key] = seq.masked_fill((mask == 0)[..., None], pad)
    return out


def _boxes(config: Any, shape: torch.Size, mask: torch.Tensor,
           g: torch.Generator) -> torch.Tensor:
    """(B, S, 4) boxes for ``document_inputs``."""
    corners = torch.rand(*shape, 2, 2, generator=g)  # two random points per token
    low, high = corners.min(dim=-1).values, corners.max(dim=-1).values  # (B, S, 2) each: x, y
    boxes = torch.cat([low, high], dim=-1)  # x0, y0, x1, y1
    grid = getattr(config, "max_2d_position_embeddings", None)
    if isinstance(grid, int) and grid > 1:
        boxes = (boxes * min(BOX_COORDINATE_MAX, grid - 1)).long()
    return boxes.masked_fill((mask == 0)[..., None], 0)


def with_document_inputs(cls: type, config: Any, batch: dict[str, torch.Tensor],
                         seed: int = 0) -> dict[str, torch.Tensor]:
    """``batch`` with the document inputs of ``cls`` added (``document_inputs``, from its
    ``input_ids`` (B, S) and ``attention_mask`` (B, S), ones where it has none); ``batch``
    itself where it has no ``input_ids`` (images, audio) or the model takes none."""
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        return batch
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    extra = document_inputs(cls, config, ids, mask, torch.Generator().manual_seed(seed + 1))
    return {**batch, **extra} if extra else batch
