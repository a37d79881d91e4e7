"""Generation on the sharded engine: transformers' own decode loop over a gathered or a
layer-by-layer gathered model, with keyed sampling.

[Note: two decode modes]
The engine holds every unit as per-rank shards; the model object's parameter entries are
empty placeholders between uses. Generation runs the model's own ``generate`` (its KV cache
classes, position handling and attention masks) over the model object while the units'
gathered views are installed in it, in one of two modes, one mode for every rank of a call:

- **gather once** (``"gather_once"``): every unit (layers, embedding, head) is all-gathered once
  for the call, the rank decodes its rows locally without any further collective, and the
  gathered buffers are freed at the end. Memory: the full weights in the gathered dtype plus
  the KV cache of this rank's rows. What ZeRO-3's ``ds3_gather_for_generation`` does, priced
  before it is chosen (``choose_mode``).
- **layered sharded decode** (``"sharded"``): the embedding and head units are gathered for the
  call; each layer unit is all-gathered by a forward pre-hook right before the layer runs
  (the next layer's all-gather issued as it starts, as in training's prefetch) and resharded
  by a forward hook right after, so one all-gather per layer per decode step. Every rank runs
  the same number of decode steps (lock-step, ``LockStepStop``): a rank whose rows have all
  ended, or that has none, keeps stepping (on a one-token stand-in row that never ends, so that
  ``generate``'s own EOS stop cannot end it early) until every rank's rows
  have ended or ``max_new_tokens`` is reached. Memory: the shard, the root, two layer units,
  the KV cache.

[Note: encoder-decoder generation]
For an encoder-decoder (``config.is_encoder_decoder``: T5, BART and the staged seq2seq models)
the prompts are the encoder's inputs, right-padded as tokenizers pad them (BART's absolute
positions would move under left padding), and ``generate`` returns DECODER tokens: the decoder
start token, then the completion. So the keyed sampler's positions count from the decoder's
width 1, not the prompt's, and the start token is returned apart (``decoder_start``). In the
sharded mode the encoder layers run once per call and the decoder layers once per step, each
gathered by its hook; the first decoder unit is a container (the encoder's junction modules,
e.g. T5's final norm, and decoder layer 0) that is never called itself, so each member
carries the unit's hooks and the unit is gathered for the junction and again for each step.

Both modes produce the same tokens: the same forward code on the same weights, and sampling
keyed by the global row ([Note: keyed sampling] in ``sampling.py``). The modes differ in
time (gather once: no collective per step; sharded: one all-gather per layer and step, plus one
all-reduce per step for the lock-step stop) and memory.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..models.base import staged_call
from . import collectives as C
from .sampling import KeyedSampler, SamplingParams

__all__ = ["DECODE_MODES", "GenerateOutput", "generate_rows", "engine_generate", "choose_mode",
           "kv_cache_bytes_per_token", "LockStepStop", "decode_memory_bytes", "gathered_bytes",
           "is_encoder_decoder"]

DECODE_MODES = ("auto", "gather_once", "sharded")


class GenerateOutput(NamedTuple):
    """Result of a generation call on one rank.

    completions: per local row, the generated token ids up to and including the first EOS
        (all ``max_new_tokens`` ids when none came: the row was truncated).
    truncated: per local row, True when it reached ``max_new_tokens`` without an EOS.
    mode: the decode mode every rank used (``"gather_once"`` or ``"sharded"``).
    steps: decode steps (forward calls) this rank ran.
    decoder_start: the decoder tokens ``generate`` put before every completion: an
        encoder-decoder's start token (``[decoder_start_token_id]``, [Note: encoder-decoder
        generation]); () for a decoder-only model, whose completions follow the prompt, and
        for a rank that decoded no rows.
    """

    completions: list[list[int]]
    truncated: list[bool]
    mode: str
    steps: int
    decoder_start: tuple[int, ...] = ()


class LockStepStop:
    """A transformers ``StoppingCriteria``: a row stops when the sampler saw its EOS; with a
    ``group``, ALL rows stop together only once every rank's rows have (one SUM all-reduce of
    this rank's unfinished-row count per decode step), so every rank runs the same number of
    forward calls ([Note: two decode modes]). Without a group the ended rows stop as they end.
    """

    def __init__(self, sampler: KeyedSampler, group=None, lockstep: bool = False,
                 stats=None):
        self.sampler, self.group, self.lockstep, self.stats = sampler, group, lockstep, stats
        self.steps = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.steps += 1
        done = self.sampler.update_done(input_ids).clone()
        if not self.lockstep:
            return done
        flag = torch.tensor([float((~done).sum())], dtype=torch.float64, device=done.device)
        if self.stats is not None:
            C.all_reduce_sum(flag, self.group, self.stats)
        else:
            dist.all_reduce(flag, group=self.group)
        return torch.full_like(done, bool(flag.item() == 0))


def _pad(prompt_ids: Sequence[Sequence[int]], pad: int, multiple: int | None, device,
         left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) padded ids and attention mask, P rounded up to ``multiple`` (TRL's
    ``pad_to_multiple_of``); left-padded for a decoder, right-padded (``left=False``) for an
    encoder's input, as tokenizers and ``DataCollatorForSeq2Seq`` pad it."""
    width = max(len(p) for p in prompt_ids)
    if multiple:
        width = -(-width // multiple) * multiple
    ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for j, row in enumerate(prompt_ids):
        if len(row):
            where = slice(width - len(row), width) if left else slice(0, len(row))
            ids[j, where] = torch.as_tensor(list(row), dtype=torch.long)
            mask[j, where] = 1
    return ids.to(device), mask.to(device)


def is_encoder_decoder(model) -> bool:
    """True for a model whose ``generate`` runs an encoder on the prompt and decodes from the
    decoder start token ([Note: encoder-decoder generation])."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def _decode_config(params: SamplingParams, base: Any = None, prompt_width: int = 0):
    """The ``GenerationConfig`` of a keyed decode: ``base``'s fields (a front end's resolved
    generation settings, its EOS ``params``' own: its logits processors run as in
    ``generate``, before the sampler) with what the keyed sampler owns overridden (greedy
    argmax over its scores, one beam, the length, the pad). Fields left unset (without
    ``base``: all but those, the EOS too) ``generate`` fills from the model's own
    ``generation_config``; its EOS stop ends rows where the sampler's does, and the stand-in
    row keeps a lock-step call going ([Note: two decode modes]). The length is given as
    ``max_length`` = ``prompt_width`` (the decoder's tokens before the completion) +
    ``params.max_new_tokens``, the same stop as ``max_new_tokens``: given as ``max_new_tokens``,
    ``generate`` warns "Both max_new_tokens and max_length" on every call once the model's own
    ``generation_config`` has a ``max_length`` (as ``Seq2SeqTrainer``'s evaluation leaves it)."""
    import copy

    from transformers import GenerationConfig

    config = GenerationConfig() if base is None else copy.deepcopy(base)
    config.update(max_new_tokens=None, max_length=int(prompt_width) + params.max_new_tokens,
                  do_sample=False,
                  num_beams=1, pad_token_id=params.pad_token_id, temperature=None, top_k=None,
                  top_p=None, min_p=None, use_cache=True)
    return config


def _check_rows(prompt_ids, rows) -> None:
    if len(rows) != len(prompt_ids):
        raise ValueError(f"generate: {len(prompt_ids)} prompts but {len(rows)} global row "
                         "indices; pass one global row index per prompt")
    empty = [j for j, p in enumerate(prompt_ids) if len(p) == 0]
    if empty:
        raise ValueError(f"generate: prompt(s) {empty} are empty; every row needs at least one "
                         "prompt token (e.g. the tokenizer's BOS)")


def _check_vocab(model, prompt_ids) -> None:
    """ValueError for a prompt token id outside the model's input embedding."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    size = getattr(embedding, "num_embeddings", None)
    if size is None:
        return
    bad = [(j, t) for j, p in enumerate(prompt_ids) for t in p if not 0 <= int(t) < size]
    if bad:
        j, t = bad[0]
        raise ValueError(f"generate: prompt {j} holds token id {t}, outside the model's "
                         f"vocabulary of {size} (ids 0..{size - 1}); tokenize with the "
                         "model's own tokenizer")


@torch.no_grad()
def generate_rows(model: nn.Module, prompt_ids: Sequence[Sequence[int]], rows: Sequence[int],
                  params: SamplingParams, round_: int, *, device: torch.device | None = None,
                  pad_to_multiple_of: int | None = None, lockstep_group: Any = None,
                  lockstep: bool = False, stats=None, generation_config: Any = None
                  ) -> GenerateOutput:
    """Decode ``prompt_ids`` with ``model.generate`` (its own KV cache and masks) and keyed
    sampling, on a model whose weights are all present (a plain model, or the engine's during
    a call). The single-process reference and both engine modes run this function.

    Args:
        prompt_ids: B token-id lists: a decoder's prompts (left-padded here with
            ``params.pad_token_id``) or an encoder-decoder's encoder inputs (right-padded;
            [Note: encoder-decoder generation]).
        rows: (B,) the global row index of each prompt (its sampling key).
        round_: the generation round (part of the key).
        lockstep: every rank of ``lockstep_group`` calls this the same number of times and
            runs the same number of decode steps (``LockStepStop``); each rank decodes one
            extra one-token stand-in row that never ends (``KeyedSampler(keep_alive=True)``),
            so ``generate`` does not stop when this rank's own rows have (a rank without
            prompts decodes only it and returns no completions).
        generation_config: a ``GenerationConfig`` whose logits processors (repetition
            penalty, forced tokens, ...) run before the sampler (``_decode_config``); None:
            the model's own ``generation_config`` alone, as ``generate`` merges it in.

    Returns:
        ``GenerateOutput`` (``mode`` empty: the caller's).

    Raises:
        ValueError: ``rows`` and ``prompt_ids`` differ in length, a prompt is empty or holds a
            token id outside the vocabulary.
    """
    _check_rows(prompt_ids, rows)
    _check_vocab(model, prompt_ids)
    device = device or next(iter(model.parameters())).device
    real = len(prompt_ids)
    if real == 0 and not lockstep:
        return GenerateOutput([], [], "", 0)
    if lockstep:  # a stand-in row that never ends keeps this rank in step with the others
        prompt_ids, rows = [*prompt_ids, [params.pad_token_id]], [*rows, -1]
    enc_dec = is_encoder_decoder(model)
    ids, mask = _pad(prompt_ids, params.pad_token_id, pad_to_multiple_of, device,
                     left=not enc_dec)
    start = 1 if enc_dec else ids.shape[1]  # the decoder's tokens before the completion
    sampler = KeyedSampler(params, rows, round_, start, device, keep_alive=lockstep)
    stop = LockStepStop(sampler, lockstep_group, lockstep, stats)
    from transformers import LogitsProcessorList, StoppingCriteriaList
    out = model.generate(input_ids=ids, attention_mask=mask,
                         generation_config=_decode_config(params, generation_config, start),
                         logits_processor=LogitsProcessorList([sampler]),
                         stopping_criteria=StoppingCriteriaList([stop]))
    completions, truncated = [], []
    eos = set(params.eos_token_ids)
    for tokens in out[:real, start:].tolist():
        end = next((k for k, t in enumerate(tokens) if t in eos), None)
        completions.append(tokens[:end + 1] if end is not None else tokens)
        truncated.append(end is None)
    decoder_start = tuple(out[0, :start].tolist()) if enc_dec and real else ()
    return GenerateOutput(completions, truncated, "", stop.steps, decoder_start)


def kv_cache_bytes_per_token(config: Any, element_size: int) -> int:
    """Bytes of KV cache one token of one row costs: 2 (K and V) x layers x KV heads x head
    dim x ``element_size``, from the model config's ``num_hidden_layers``,
    ``num_key_value_heads`` (else ``num_attention_heads``) and ``head_dim`` (else
    ``hidden_size / num_attention_heads``). An upper bound for sliding-window or linear-attention
    layers, which keep less. 0 when the config lacks the fields.

    An encoder-decoder (``is_encoder_decoder``) caches in its decoder layers only
    (``decoder_layers`` / ``num_decoder_layers``; T5's head dim ``d_kv``): self-attention K / V
    per decoder token and cross-attention K / V per encoder token, so the same bytes per token
    price a row of P prompt (encoder) tokens and T new tokens at (P + T) tokens, as for a
    decoder-only model."""
    text = getattr(config, "get_text_config", lambda: config)()
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    if getattr(text, "is_encoder_decoder", False):
        layers = getattr(text, "decoder_layers", None) or \
            getattr(text, "num_decoder_layers", None) or layers
        heads = getattr(text, "decoder_attention_heads", None) or heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or getattr(text, "d_kv", None) or (
        text.hidden_size // heads if heads and getattr(text, "hidden_size", None) else None)
    if not (layers and kv and head_dim):
        return 0
    return 2 * int(layers) * int(kv) * int(head_dim) * int(element_size)


def gathered_bytes(engine) -> tuple[int, int, int]:
    """(every unit, the embedding + head units, the largest layer unit) in bytes, in the
    dtypes they are all-gathered in."""
    def size(unit):
        return sum(part.numel * torch.empty(0, dtype=unit.gather_dtype(part)).element_size()
                   for part in unit.parts)
    root = size(engine.root.embed) + size(engine.root.head)
    layers = [size(u) for u in engine.units]
    return root + sum(layers), root, max(layers, default=0)


def decode_memory_bytes(engine, num_rows: int, max_tokens: int, mode: str) -> int:
    """Predicted bytes a call adds on this rank beyond its resident shards: gathered weights
    (the whole model for ``gather_once``; the root and two layer units for ``sharded``) plus
    the KV cache of ``num_rows`` rows of ``max_tokens`` tokens (prompt + completion), in the
    gathered dtype. Logits and activations of one token per row are not counted."""
    element = torch.empty(0, dtype=engine.units[0].param_dtype if engine.units else
                          torch.float32).element_size()
    kv = kv_cache_bytes_per_token(getattr(engine.staged.model, "config", None), element)
    cache = kv * num_rows * max_tokens
    full, root, layer = gathered_bytes(engine)
    return (full if mode == "gather_once" else root + 2 * layer) + cache


def choose_mode(engine, mode: str, num_rows: int, max_tokens: int,
                memory_budget_bytes: int | None,
                refused: Exception | None = None) -> tuple[str, int]:
    """Collective (one all-reduce): the decode mode every rank uses, and the number of ranks
    whose budget the gather-once mode would exceed. ``"auto"``: gather once if it fits
    every rank's ``memory_budget_bytes`` (None: no limit on that rank), else sharded.
    ``refused``: this rank's own refusal of its inputs, raised here after the all-reduce (the
    other ranks raise one naming this rank), so no rank is left waiting in a collective.

    Raises (on every rank, after the all-reduce, before any gather):
        ValueError: a rank's refusal; an unknown mode; a rank that asked for ``gather_once`` explicitly while some
            rank's budget does not hold it; a rank whose budget does not hold even the sharded
            mode (its KV cache is too large: fewer rows or a shorter ``max_completion_length``).
    """
    if refused is None and mode not in DECODE_MODES:
        refused = ValueError(f"generate: decode mode {mode!r}; choose one of {DECODE_MODES}")
    once = decode_memory_bytes(engine, num_rows, max_tokens, "gather_once")
    sharded = decode_memory_bytes(engine, num_rows, max_tokens, "sharded")
    budget = memory_budget_bytes
    flags = torch.zeros(3 + engine.world_size, dtype=torch.float64, device=engine.device)
    flags[3 + engine.rank] = float(refused is not None)
    flags[0] = float(budget is not None and once > budget)  # gather-once does not fit here
    flags[1] = float(budget is not None and sharded > budget)  # nothing fits here
    flags[2] = float(mode == "gather_once")
    C.all_reduce_sum(flags, engine.group, engine.stats)
    too_big_once, too_big, asked_once = (int(f) for f in flags.tolist()[:3])
    if refused is not None:
        raise refused
    ranks = [r for r, f in enumerate(flags.tolist()[3:]) if f]
    if ranks:
        raise ValueError(f"generate: the inputs of rank(s) {ranks} were refused (their error "
                         "says why); nothing was generated on any rank")
    if too_big:
        raise ValueError(
            f"generate: {too_big} rank(s) cannot hold even the layered sharded decode (this "
            f"rank: {sharded / 2**20:.1f} MiB for {num_rows} row(s) of up to {max_tokens} "
            f"tokens, budget {'none' if budget is None else f'{budget / 2**20:.1f} MiB'}); the "
            "KV cache is too large: generate fewer rows per rank or fewer tokens "
            "(max_completion_length)")
    if asked_once and too_big_once:
        raise ValueError(f"generate: decode mode 'gather_once' does not fit on {too_big_once} "
                         f"rank(s) (this rank needs {once / 2**20:.1f} MiB); use 'sharded' or "
                         "'auto'")
    if mode == "auto":
        mode = "sharded" if too_big_once else "gather_once"
    return mode, too_big_once


@contextlib.contextmanager
def _gathered(units: Sequence):
    """All-gather ``units`` (every rank, same order), install their views; reshard on exit."""
    try:
        for unit in units:
            unit.start_unshard()
        for unit in units:
            unit.wait_unshard(requires_grad=False)
            unit.use_params()
        yield
    finally:
        for unit in units:
            unit.reshard()


@contextlib.contextmanager
def _layer_hooks(engine):
    """Forward hooks that gather each layer unit right before its module runs and reshard it
    right after, issuing the next layer's all-gather as a layer starts ([Note: two decode
    modes])."""
    modules, units = engine.staged.units(), engine.units
    handles = []

    def pre(i):
        def hook(module, args, kwargs=None):
            units[i].start_unshard()
            units[i].wait_unshard(requires_grad=False)
            if i + 1 < len(units):
                units[i + 1].start_unshard()
            units[i].use_params()
        return hook

    def post(i):
        def hook(module, args, output):
            units[i].reshard()
        return hook

    try:
        for i, unit_module in enumerate(modules):
            # a container unit is never called itself: its members are ([Note: encoder-decoder
            # generation]); each gathers the unit as it starts and reshards it as it ends
            members = list(unit_module) if isinstance(unit_module, nn.ModuleList) \
                else [unit_module]
            for module in members:
                # first of the pre-hooks: a timing hook (emulated slowdown) sees the gathered
                # layer
                handles.append(module.register_forward_pre_hook(pre(i), prepend=True))
                handles.append(module.register_forward_hook(post(i)))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for unit in units:
            unit.reshard()


def engine_generate(engine, prompt_ids: Sequence[Sequence[int]], rows: Sequence[int],
                    params: SamplingParams, round_: int, *, mode: str = "auto",
                    memory_budget_bytes: int | None = None,
                    pad_to_multiple_of: int | None = None,
                    generation_config: Any = None) -> GenerateOutput:
    """Collective: every rank calls it (with its own rows, possibly none). See
    ``CephaloEngine.generate``."""
    engine.check_usable("generate")
    refused = None
    try:
        _check_rows(prompt_ids, rows)
        _check_vocab(engine.staged.model, prompt_ids)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"generate: params must be hf_cephalo SamplingParams, got "
                             f"{type(params).__name__}")
    except ValueError as exc:
        refused = exc
    width = max((len(p) for p in prompt_ids), default=1)
    max_new = getattr(params, "max_new_tokens", 0)
    mode, _ = choose_mode(engine, mode, len(prompt_ids), width + max_new, memory_budget_bytes,
                          refused)
    try:
        return _decode(engine, prompt_ids, rows, params, round_, mode, pad_to_multiple_of,
                       generation_config)
    except BaseException as exc:  # mid-decode: the ranks' collectives may be out of step
        engine.abandon_step(None, exc, "generate")
        raise


def _decode(engine, prompt_ids, rows, params, round_, mode, pad_to_multiple_of,
            generation_config):
    model = engine.staged.model
    autocast = torch.autocast(engine.device.type, dtype=engine.precision.compute) \
        if engine.precision.compute is not None else contextlib.nullcontext()
    lockstep = mode == "sharded"
    units = engine.all_units() if mode == "gather_once" else engine.root.both()
    with staged_call(), autocast, _gathered(units), \
            (_layer_hooks(engine) if lockstep else contextlib.nullcontext()):
        out = generate_rows(model, prompt_ids, rows, params, round_, device=engine.device,
                            pad_to_multiple_of=pad_to_multiple_of, lockstep_group=engine.group,
                            lockstep=lockstep, stats=engine.stats,
                            generation_config=generation_config)
    return out._replace(mode=mode)
