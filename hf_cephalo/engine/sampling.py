"""Sampling keyed by the global row: completions that do not depend on the plan.

[Note: keyed sampling]
A sampled token is a function of the logits and of the key (seed, round, global row, position),
nothing else: no generator state is carried from one row or one step to the next. After the
logits are warped as transformers' sampling warpers do (temperature, top-k, top-p, min-p, in
that order, ``GenerationMixin._get_logits_processor``), each row adds Gumbel noise
``g = -log(-log(u))`` with ``u ~ U[0, 1)^V`` drawn from a CPU ``torch.Generator`` seeded with a
64-bit hash of its key, and takes the argmax (the Gumbel-max trick: ``argmax(l + g)`` is a
sample of ``softmax(l)``; Gumbel 1954, as used by Maddison et al. 2014, "A* Sampling"). So the
same prompt on global row ``r`` in round ``k`` gets the same completion on any plan, world size,
rank or batch composition, and a resumed run re-samples exactly what the uninterrupted run
sampled. Stock sampling (``torch.multinomial`` on each rank's own generator) draws from one
stream per rank, so what a row gets depends on which rank decoded it and after which rows.

The noise is drawn on the CPU in float64 (the CPU generator's stream is the same on every
machine; a CUDA generator's is not guaranteed to match across devices) and added to the
float64 warped logits on the logits' device. Cost: one ``(V,)`` draw per row and token.
Greedy decoding (``do_sample=False``) adds no noise: the argmax of the logits.

What remains plan-dependent: the logits themselves, which a different padding width or batch
size can move in the last bits; a sampled token flips only when two perturbed logits tie
within that rounding (measured: never in the tests' runs; docs/generation.md).
"""

from __future__ import annotations

import hashlib
import math
import operator
import struct
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import LogitsProcessor

__all__ = ["SamplingParams", "sample_key", "gumbel_noise", "KeyedSampler", "warp_logits"]


def _token_id(value) -> int:
    """``value`` as a token id (an int or a numpy / torch integer, not a bool)."""
    if isinstance(value, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(value)


def _token_ids(values) -> tuple[int, ...]:
    return (_token_id(values),) if not isinstance(values, (list, tuple)) else \
        tuple(_token_id(v) for v in values)


def _finite(value) -> float:
    if isinstance(value, bool) or not math.isfinite(float(value)):
        raise ValueError("not a finite number")
    return float(value)


def _flag(value) -> bool:
    if not isinstance(value, bool):
        raise TypeError("not a bool")
    return value


_FIELD_CHECKS = [  # name, what it must be, cast, check on the cast value
    ("max_new_tokens", "an int >= 1 (TRL: max_completion_length)", _token_id, lambda v: v >= 1),
    ("do_sample", "True or False", _flag, lambda v: True),
    ("temperature", "a finite number > 0 (TRL: temperature; greedy: do_sample=False)", _finite,
     lambda v: v > 0),
    ("top_k", "None, 0 (off) or a positive int", _token_id, lambda v: v is None or v >= 0),
    ("top_p", "a number in (0, 1]", _finite, lambda v: 0 < v <= 1),
    ("min_p", "None or a number in [0, 1]", _finite, lambda v: v is None or 0 <= v <= 1),
    ("eos_token_ids", "token ids >= 0 (the tokenizer's EOS ids)", _token_ids,
     lambda v: all(t >= 0 for t in v)),
    ("pad_token_id", "a token id >= 0 (the tokenizer's pad_token_id)", _token_id,
     lambda v: v >= 0),
    ("seed", "an int", _token_id, lambda v: True),
]


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled (the fields of transformers' ``GenerationConfig`` and TRL's
    ``GRPOConfig`` of the same names).

    max_new_tokens: completion tokens at most (>= 1); a row that reaches it without an EOS
        is truncated there (TRL's ``max_completion_length``).
    do_sample: False = greedy (argmax), True = keyed sampling ([Note: keyed sampling]).
    temperature (> 0), top_k (0 or None: off), top_p (in (0, 1]), min_p (None or in [0, 1]):
        the warpers, applied in transformers' order.
    eos_token_ids: a row ends after the first of these; pad_token_id fills after it.
    seed: the job's seed, part of every key.

    Raises:
        ValueError: a field of the wrong type or out of range (named, with its value and what
            it must be).
    """

    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, want, cast, ok in _FIELD_CHECKS:
            value = getattr(self, name)
            try:
                value = None if value is None and name in ("top_k", "min_p") else cast(value)
                good = ok(value)
            except (TypeError, ValueError, OverflowError):
                good = False
            if not good:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: must be {want}")
            object.__setattr__(self, name, value)


def sample_key(seed: int, round_: int, row: int, position: int) -> int:
    """The 63-bit generator seed of one sampled token: a BLAKE2b hash of the four ints
    (each as a signed 64-bit little-endian integer), so nearby keys give unrelated streams."""
    packed = struct.pack("<4q", int(seed), int(round_), int(row), int(position))
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1


def gumbel_noise(keys: Sequence[int], vocab_size: int) -> torch.Tensor:
    """(len(keys), vocab_size) float64 CPU tensor of standard Gumbel noise, row ``j`` drawn
    from a CPU generator seeded with ``keys[j]`` ([Note: keyed sampling])."""
    out = torch.empty(len(keys), vocab_size, dtype=torch.float64)
    gen = torch.Generator()
    for j, key in enumerate(keys):
        gen.manual_seed(int(key))
        out[j] = torch.rand(vocab_size, generator=gen, dtype=torch.float64)
    return out.log_().neg_().log_().neg_()


def warp_logits(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B, V) float64 logits after transformers' own temperature / top-k / top-p / min-p
    warpers (filtered entries -inf), in ``GenerationMixin``'s order."""
    from transformers.generation.logits_process import (MinPLogitsWarper,
                                                        TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    warpers = []
    if float(params.temperature) != 1.0:
        warpers.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k:
        warpers.append(TopKLogitsWarper(top_k=int(params.top_k)))
    if float(params.top_p) < 1.0:
        warpers.append(TopPLogitsWarper(top_p=float(params.top_p)))
    if params.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=float(params.min_p)))
    scores = scores.double()
    for warper in warpers:
        scores = warper(None, scores)
    return scores


class KeyedSampler(LogitsProcessor):
    """A transformers ``LogitsProcessor`` that turns greedy decoding into keyed sampling.

    Passed to ``model.generate(..., do_sample=False, logits_processor=[sampler])``: at each
    step it returns scores whose argmax is the keyed sample of each row ([Note: keyed
    sampling]); a row that has produced an EOS gets the pad token from then on (its scores
    are -inf but at ``pad_token_id``). ``done`` (B,) bool says which rows have ended.

    Args:
        params: ``SamplingParams``. rows: (B,) the global row index of each batch row.
        round_: the generation round (TRL: the optimizer step that generates).
        prompt_width: the tokens before the first sampled one in ``input_ids`` (a decoder's
            padded prompt length; an encoder-decoder's decoder start: 1); token position =
            ``input_ids.shape[1] - prompt_width``.
        keep_alive: the last row is a stand-in that never ends: counted as done, it emits a
            token outside ``eos_token_ids`` (the pad, or the smallest id that is not an EOS),
            so that ``generate``'s own EOS stop (the model's ``generation_config`` EOS) cannot
            end a lock-step call on one rank while the others still decode.
    """

    def __init__(self, params: SamplingParams, rows: Sequence[int], round_: int,
                 prompt_width: int, device: torch.device, keep_alive: bool = False):
        self.params, self.rows, self.round = params, [int(r) for r in rows], int(round_)
        self.prompt_width = int(prompt_width)
        self.done = torch.zeros(len(self.rows), dtype=torch.bool, device=device)
        self._eos = torch.tensor(params.eos_token_ids, dtype=torch.long, device=device)
        eos = set(params.eos_token_ids)
        self.keep_alive = keep_alive
        self._filler = params.pad_token_id if params.pad_token_id not in eos else \
            min(set(range(len(eos) + 1)) - eos)
        if keep_alive:
            self.done[-1] = True

    def update_done(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Mark rows whose last token is an EOS (after the prompt); returns ``done``."""
        if input_ids.shape[1] > self.prompt_width and self._eos.numel():
            self.done |= torch.isin(input_ids[:, -1], self._eos)
        return self.done

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.prompt_width
        done = self.update_done(input_ids)
        p = self.params
        out = warp_logits(scores, p) if p.do_sample else scores.double()
        if p.do_sample:
            keys = [sample_key(p.seed, self.round, row, position) for row in self.rows]
            out = out + gumbel_noise(keys, out.shape[-1]).to(out.device)
        if bool(done.any()):
            out[done] = float("-inf")
            out[done, p.pad_token_id] = 0.0
        if self.keep_alive:
            out[-1] = float("-inf")
            out[-1, self._filler] = 0.0
        return out
