"""A small generic staged language model for engine tests and benchmarks.

Embedding (token + learned position) -> N identical pre-norm blocks (causal self-attention +
MLP) -> final LayerNorm -> linear head with next-token cross-entropy (labels -100 ignored).
``ToyLM`` is the plain ``nn.Module`` (the single-process reference); ``ToyStaged`` is its
``StagedModel`` view. Options exercise engine corner cases: tied embeddings, dropout, a frozen
norm inside each block, a ``rare`` parameter used only by microbatches that contain a given
token id, and a side input made by a layer unit (``memory_from``: the shape of an
encoder-decoder's encoder output, read by every later layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import HeadEvalOutput, HeadOutput, Microbatch, StagedModel


@dataclass(kw_only=True)
class ToyConfig:
    """Shape and options of the toy model.

    vocab_size: tokens; hidden_size: model width (elements); num_heads: attention heads
    (divides hidden_size); num_layers: blocks (engine units); mlp_ratio: MLP width / hidden;
    max_seq_len: positions (tokens); tie_embeddings: head weight = token embedding;
    dropout: probability after attention and MLP (0 = off); frozen_norm: the blocks' first
    norm has requires_grad=False; rare_token_id: if set, each block adds a ``rare`` vector at
    positions holding this token id, and only when the microbatch contains it;
    memory_from: if set, the block at this index first makes a ``memory`` from its input (its
    ``mem_norm``, then dropout) and it and every later block add ``mem_proj(memory)`` to their
    input (engine/schedule.py [Note: side inputs]: a side input made by a unit).
    """

    vocab_size: int = 64
    hidden_size: int = 32
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4
    max_seq_len: int = 64
    tie_embeddings: bool = False
    dropout: float = 0.0
    frozen_norm: bool = False
    rare_token_id: int | None = None
    memory_from: int | None = None

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads "
                             f"{self.num_heads}: pick a hidden_size that is a multiple of "
                             "num_heads")
        if min(self.vocab_size, self.hidden_size, self.num_heads, self.max_seq_len) < 1 or \
                self.num_layers < 0 or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"invalid ToyConfig {self}: vocab_size, hidden_size, num_heads and "
                             "max_seq_len must be >= 1, num_layers >= 0, dropout in [0, 1)")


class ToyBlock(nn.Module):
    def __init__(self, cfg: ToyConfig, index: int = 0):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)  # no q/k bias: its exact gradient is 0
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, cfg.mlp_ratio * h)
        self.fc2 = nn.Linear(cfg.mlp_ratio * h, h)
        self.drop = nn.Dropout(cfg.dropout)
        if cfg.rare_token_id is not None:
            self.rare = nn.Parameter(torch.randn(h) * 0.1)
        if cfg.frozen_norm:
            self.ln1.requires_grad_(False)
        if cfg.memory_from is not None and index >= cfg.memory_from:
            if index == cfg.memory_from:
                self.mem_norm = nn.LayerNorm(h)
            self.mem_proj = nn.Linear(h, h)

    def make_memory(self, x: torch.Tensor) -> torch.Tensor:
        """The memory the block at ``memory_from`` makes from its input x (m, S, H)."""
        return self.drop(self.mem_norm(x))

    def forward(self, x: torch.Tensor, rare_mask: torch.Tensor | None = None,
                memory: torch.Tensor | None = None) -> torch.Tensor:
        if memory is not None:
            x = x + self.mem_proj(memory)
        m, s, h = x.shape  # (m, S, H)
        nh = self.cfg.num_heads
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(m, s, nh, h // nh).transpose(1, 2) for t in (q, k, v))  # (m, nh, S, hs)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(m, s, h)))
        x = x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))
        if rare_mask is not None and bool(rare_mask.any()):
            x = x + rare_mask * self.rare  # (m, S, 1) * (H,)
        return x


class ToyLM(nn.Module):
    """The plain model: ``forward(input_ids, labels=None) -> (loss_mean | None, logits)``."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.blocks = nn.ModuleList(ToyBlock(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.wte(input_ids) + self.wpe(pos)  # (m, S, H)

    def rare_mask(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        if self.cfg.rare_token_id is None:
            return None
        return (input_ids == self.cfg.rare_token_id).unsqueeze(-1).float()  # (m, S, 1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.embed(input_ids)
        mask, memory = self.rare_mask(input_ids), None
        for i, block in enumerate(self.blocks):
            if i == self.cfg.memory_from:
                memory = block.make_memory(x)
            x = block(x, mask, memory)
        logits = self.head(self.ln_f(x))  # (B, S, V)
        if labels is None:
            return None, logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                               ignore_index=-100)
        return loss, logits


def count_tokens(labels: torch.Tensor) -> int:
    """Items of a causal LM microbatch: labels != -100 after the one-token shift."""
    return int((labels[:, 1:] != -100).sum())


class ToyCtx(NamedTuple):
    """A ``ToyStaged`` ctx with ``memory_from``: the rare mask and the memory (None until
    the making block ran)."""

    rare_mask: torch.Tensor | None
    memory: torch.Tensor | None = None


class ToyStaged(StagedModel):
    """``StagedModel`` view of ``ToyLM``: units = blocks; embedding = wte, wpe; head = ln_f,
    head (``head.weight`` is ``wte.weight`` when tied: it lives in the embedding unit). With
    ``memory_from`` the memory is a side input that unit makes (``produce_side_inputs``).

    Microbatch keys: ``input_ids`` (m, S) int64, optional ``labels`` (m, S) (default input_ids).
    """

    model: ToyLM

    def units(self) -> list[nn.Module]:
        return list(self.model.blocks)

    def embed_modules(self) -> list[nn.Module]:
        return [self.model.wte, self.model.wpe]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.ln_f, self.model.head]

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Any]:
        ids = microbatch["input_ids"]
        mask = self.model.rare_mask(ids)
        return self.model.embed(ids), (mask if self.model.cfg.memory_from is None else
                                       ToyCtx(mask))

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        if isinstance(ctx, ToyCtx):
            return self.model.blocks[index](hidden, ctx.rare_mask, ctx.memory)
        return self.model.blocks[index](hidden, ctx)

    def side_inputs(self, ctx: Any) -> list[torch.Tensor]:
        return [ctx.memory] if isinstance(ctx, ToyCtx) and ctx.memory is not None else []

    def with_side_inputs(self, ctx: Any, tensors: list[torch.Tensor]) -> Any:
        return ctx._replace(memory=tensors[0]) if tensors else ctx

    def produces_side_inputs(self, index: int) -> bool:
        return index == self.model.cfg.memory_from

    def produce_side_inputs(self, index: int, hidden: torch.Tensor, ctx: Any) -> Any:
        return ctx._replace(memory=self.model.blocks[index].make_memory(hidden))

    def _labels(self, microbatch: Microbatch) -> torch.Tensor:
        return microbatch.get("labels", microbatch["input_ids"])

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        return self.model.head(self.model.ln_f(hidden))

    def head_loss(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> HeadOutput:
        return self._loss(self.head_logits(hidden, microbatch, ctx), microbatch)

    def head_loss_and_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                             ctx: Any) -> HeadEvalOutput:
        logits = self.head_logits(hidden, microbatch, ctx)  # one head pass
        return HeadEvalOutput(self._loss(logits, microbatch), logits)

    def _loss(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        labels = self._labels(microbatch)
        loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum")
        return HeadOutput(loss_sum, count_tokens(labels))

    def count_items(self, microbatch: Microbatch) -> int:
        return count_tokens(self._labels(microbatch))
