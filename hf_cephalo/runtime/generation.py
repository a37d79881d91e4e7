"""Generation for the doors: the engine's decode modes and keyed sampling behind the runtime.

The doors import no ``hf_cephalo.engine``; what they need to generate is here:
``SamplingParams``, ``generate_rows`` (a model whose weights are all present: one process, the
single-process reference, ``hf_cephalo.reproducible_rollout``) and ``session_generate`` (the
sharded engine, ``Session.generate``). Both run the same code on the same keys, so a row's
completion is the same whichever decoded it ([Note: keyed sampling] in
``engine/sampling.py``, [Note: two decode modes] in ``engine/generation.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from ..engine.generation import DECODE_MODES, GenerateOutput, generate_rows, is_encoder_decoder
from ..engine.sampling import SamplingParams, sample_key

__all__ = ["DECODE_MODES", "GenerateOutput", "SamplingParams", "generate_rows", "generate_tensor",
           "sampling_from_generation_config", "ResolvedGeneration", "resolve_generation",
           "generation_budget_bytes", "sample_key", "session_generate"]


def generation_budget_bytes(plan, rank: int) -> int | None:
    """Bytes rank ``rank`` may add for a generation call: ``c x C_i`` (the plan's memory
    fraction of its device's capacity) minus the plan's predicted training peak
    ``r_i S + M_i(m_i)``, which keeps the training state and leaves the activations' room
    unused (conservative: generation runs between steps, when no activation is live). None
    when the plan does not know the rank's capacity or prediction (no cap is enforced)."""
    rp = plan.ranks[rank] if plan is not None and rank < len(plan.ranks) else None
    if rp is None or rp.memory_capacity_bytes is None or rp.predicted_memory_bytes is None:
        return None
    return max(0, int(plan.memory_fraction * rp.memory_capacity_bytes
                      - rp.predicted_memory_bytes))


def session_generate(session, prompt_ids: Sequence[Sequence[int]], rows: Sequence[int],
                     params: SamplingParams, round_: int, *, mode: str = "auto",
                     pad_to_multiple_of: int | None = None,
                     generation_split: Sequence[int] | None = None,
                     generation_config=None) -> GenerateOutput:
    """Collective: ``CephaloEngine.generate`` over the session's engine, with this rank's
    budget from its plan (``generation_budget_bytes``).

    ``generation_split``: g_i, the rows each rank DECODES (rank order, summing to the distinct
    rows of all ranks), apart from the rows it holds and trains (b_i): the prompts' token ids are
    all-gathered, rank i decodes the g_i rows that come i-th in global row order, and the
    completions' token ids are all-gathered back, each rank keeping its own rows
    ([Note: generation split]). None: each rank decodes its own rows. The completions are the
    same either way (keyed sampling). A rank with an emulated slowdown decodes that much slower
    (``generation_plan.emulated_decode``), as the decode profiles it is planned from measured.
    ``generation_config``: as ``CephaloEngine.generate`` (its logits processors run before the
    sampler; ``resolve_generation`` builds one from ``generate`` keywords).

    Raises:
        ValueError: a split of another world size or total, or one row index given with two
            different prompts (every rank alike, after the prompts' exchange).
    """
    from .generation_plan import emulated_decode  # it imports this module

    budget = generation_budget_bytes(session.plan, session.job.rank)
    if generation_split is None:
        with emulated_decode(session.engine.staged):
            return session.engine.generate(prompt_ids, rows, params, round_, mode=mode,
                                           memory_budget_bytes=budget,
                                           pad_to_multiple_of=pad_to_multiple_of,
                                           generation_config=generation_config)
    import torch.distributed as dist

    # [Note: generation split] decoding is memory-bandwidth-bound, training compute-bound: the
    # planner's g_i for the decode differs from b_i; only token ids cross ranks, twice
    group, world, rank = session.group, session.job.world_size, session.job.rank
    mine = [(int(r), list(map(int, p))) for r, p in zip(rows, prompt_ids)]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    # a row two ranks both hold (a group spanning ranks, decoded whole by each) once
    held: dict[int, list[int]] = {}
    clashes = sorted({r for part in everyone for r, p in part if held.setdefault(r, p) != p})
    if clashes:  # every rank sees the same table: every rank raises
        raise ValueError(f"generate: global row(s) {clashes[:8]} are given with different "
                         "prompts on different ranks; a row index must name one prompt (pass "
                         "each prompt's index in the global batch as its row)")
    table = sorted(held.items())
    split = [int(g) for g in generation_split]
    if len(split) != world or sum(split) != len(table) or min(split) < 0:
        raise ValueError(f"generation_split {split}: needs {world} non-negative counts summing "
                         f"to the {len(table)} rows of the generation batch")
    start = sum(split[:rank])
    todo = table[start:start + split[rank]]
    with emulated_decode(session.engine.staged):
        out = session.engine.generate([p for _, p in todo], [r for r, _ in todo], params,
                                      round_, mode=mode, memory_budget_bytes=budget,
                                      pad_to_multiple_of=pad_to_multiple_of,
                                      generation_config=generation_config)
    decoded: list = [None] * world
    dist.all_gather_object(decoded, (out.decoder_start, [(r, c, t) for (r, _), c, t in zip(
        todo, out.completions, out.truncated)]), group=group)
    by_row = {r: (c, t) for _, part in decoded for r, c, t in part}
    start = next((st for st, _ in decoded if st), ())  # every decoding rank's is the same
    return out._replace(completions=[by_row[int(r)][0] for r in rows],
                        truncated=[by_row[int(r)][1] for r in rows],
                        decoder_start=start if rows else ())


_GENERATE_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p",
                  "eos_token_id", "pad_token_id")


def sampling_from_generation_config(model, kwargs: dict, seed: int) -> SamplingParams:
    """``SamplingParams`` from ``model.generate``-style keyword arguments over the model's own
    ``generation_config`` (a keyword wins over the config, as in ``generate``).

    Raises:
        TypeError: a keyword the sharded ``generate`` does not honour (named; what it takes).
        ValueError: no completion length (neither ``max_new_tokens`` nor the config's).
    """
    unknown = sorted(set(kwargs) - set(_GENERATE_KEYS))
    if unknown:
        raise TypeError(f"generate on the sharded model does not take {unknown}: it decodes "
                        f"with keyed sampling and takes {list(_GENERATE_KEYS)} (plus rows, "
                        "round_, seed, mode, generation_split); beams, penalties and streamers "
                        "are not built")
    config = getattr(model, "generation_config", None)

    def pick(name, default=None):
        for value in (kwargs.get(name), getattr(config, name, None)):
            if value is not None:
                return value
        return default

    max_new = pick("max_new_tokens")
    if max_new is None:
        raise ValueError("generate: pass max_new_tokens (the sharded generate needs a "
                         "completion length limit)")
    eos = pick("eos_token_id", ())
    eos = (eos,) if isinstance(eos, int) else tuple(eos or ())
    pad = pick("pad_token_id", eos[0] if eos else 0)
    return SamplingParams(max_new_tokens=int(max_new), do_sample=bool(pick("do_sample", False)),
                          temperature=float(pick("temperature", 1.0)),
                          top_k=int(pick("top_k", 0) or 0), top_p=float(pick("top_p", 1.0)),
                          min_p=pick("min_p"), eos_token_ids=eos, pad_token_id=int(pad),
                          seed=int(seed))


class ResolvedGeneration(NamedTuple):
    """What an encoder-decoder's ``generate(**gen_kwargs)`` would decode with, for the keyed
    decode: ``params`` (length, EOS, pad, sampling) and ``config``, the model's
    ``generation_config`` updated with the keywords and transformers' defaults (its logits
    processors run before the sampler)."""

    params: SamplingParams
    config: Any


_WARPERS = "the keyed sampler warps with temperature, top_k, top_p and min_p only"
# (field, refused when, why): what the keyed decode of one sequence per row cannot do
_UNBUILT = (
    ("num_return_sequences", lambda v, c: (v or 1) > 1, "one sequence per row is decoded"),
    ("max_time", lambda v, c: v is not None, "a wall-clock stop differs per rank and run"),
    ("stop_strings", lambda v, c: bool(v), "stop strings need the tokenizer inside generate"),
    ("guidance_scale", lambda v, c: v is not None and v != 1, "classifier-free guidance is "
     "not built"),
    ("typical_p", lambda v, c: c.do_sample and v is not None and v < 1, _WARPERS),
    ("epsilon_cutoff", lambda v, c: c.do_sample and v is not None and 0 < v < 1, _WARPERS),
    ("eta_cutoff", lambda v, c: c.do_sample and v is not None and 0 < v < 1, _WARPERS),
    ("top_h", lambda v, c: c.do_sample and v is not None, _WARPERS),
)


def _generation_refusals(config) -> list[str]:
    """One message per setting of the resolved ``config`` the keyed decode does not honour."""
    problems = []
    mode = str(getattr(config.get_generation_mode(), "value", config.get_generation_mode()))
    if mode not in ("greedy_search", "sample"):
        problems.append(
            f"generation mode {mode!r} (num_beams={config.num_beams}): the sharded decode runs "
            "greedy decoding or keyed sampling, one sequence per row; beam search and the "
            "other strategies are not built: set generation_num_beams=1 (and num_beams=1 in "
            "the model's generation_config / the generation keywords)")
    for name, refused_when, why in _UNBUILT:
        value = getattr(config, name, None)
        if refused_when(value, config):
            problems.append(f"{name}={value!r}: {why}")
    return problems


def resolve_generation(model, gen_kwargs: dict, seed: int,
                       generation_config=None) -> ResolvedGeneration:
    """The keyed decode of ``model.generate(**gen_kwargs)`` for an encoder-decoder: the model's
    ``generation_config`` (or ``generation_config``, one about to replace it) updated with
    ``gen_kwargs`` and transformers' defaults (as ``generate`` resolves it); ``max_length``
    counts the decoder's tokens including its start token, so the completion is at most
    ``max_new_tokens`` or else ``max_length - 1`` tokens.

    Raises (before any collective): ValueError for a model that is not an encoder-decoder
    reading token ids, a keyword that is no ``GenerationConfig`` field (``synced_gpus`` is
    accepted: the sharded decode keeps the ranks in step itself), a setting the keyed decode
    does not honour (``num_beams`` > 1, ...: each named with the reason), a length that
    leaves no completion token, or no pad / EOS token.
    """
    import copy

    from transformers import GenerationConfig

    if not is_encoder_decoder(model):
        raise ValueError(f"generation keywords: {type(model).__name__} is not an "
                         "encoder-decoder; this resolution is for encoder-decoders")
    _check_generate_inputs(model, input_ids=())
    config = copy.deepcopy(generation_config or getattr(model, "generation_config", None)
                           or GenerationConfig())
    extra = config.update(**{k: v for k, v in gen_kwargs.items() if k != "synced_gpus"})
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    config.update(**{k: v for k, v in defaults.items() if getattr(config, k, None) is None})
    problems = ([f"{sorted(extra)}: not GenerationConfig fields (model inputs to generate "
                 "are not built)"] if extra else []) + _generation_refusals(config)
    max_new = config.max_new_tokens if config.max_new_tokens is not None else \
        (config.max_length or 20) - 1
    if max_new < 1:
        problems.append(f"max_length={config.max_length}: counts the decoder start token, "
                        "so it leaves no token to generate; use max_length >= 2")
    eos = config.eos_token_id
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    if pad is None:
        problems.append("no pad_token_id and no eos_token_id in the generation config: set "
                        "model.generation_config.pad_token_id")
    if problems:
        raise ValueError("generate on the sharded model: " + "; ".join(problems))
    params = SamplingParams(
        max_new_tokens=int(max_new), do_sample=bool(config.do_sample),
        temperature=float(config.temperature), top_k=int(config.top_k or 0),
        top_p=float(config.top_p), min_p=config.min_p, eos_token_ids=eos,
        pad_token_id=int(pad), seed=int(seed))
    return ResolvedGeneration(params, config)


def _check_generate_inputs(model, input_ids) -> None:
    """ValueError for an encoder-decoder whose encoder does not read token ids (Whisper's
    log-mel ``input_features``): the engine's decode takes prompts as token ids ([Note:
    encoder-decoder generation]); else TypeError for a call without ``input_ids``."""
    main = getattr(model, "main_input_name", "input_ids")
    if is_encoder_decoder(model) and main != "input_ids":
        raise ValueError(
            f"generate: {type(model).__name__}'s encoder reads {main!r}, not token ids, and "
            "the sharded decode takes prompts as token ids: nothing was generated. Generate "
            "with the whole model: trainer.unshard_model().generate(...), or load the saved "
            "model with from_pretrained and call its generate")
    if input_ids is None:
        raise TypeError("generate: input_ids (B, P) is required (the prompts, left-padded; an "
                        "encoder-decoder's encoder inputs)")


def generate_tensor(session, input_ids, attention_mask=None, *, rows=None,
                    round_: int | None = None, seed: int | None = None, mode: str = "auto",
                    generation_split: Sequence[int] | None = None, **kwargs):
    """Collective: ``model.generate`` on the sharded model, as a tensor (the doors' call).

    Args:
        input_ids: (B, P) this rank's prompts, left-padded (B may be 0);
            attention_mask: (B, P), 1 on prompt tokens (default: all ones).
        rows: (B,) the prompts' global row indices (their sampling keys). Default: numbered in
            rank order (rank 0's rows first), which depends on how rows are split over the
            ranks: pass the rows' own indices for completions that do not.
        round_ (default: the optimizer steps done, ``session.global_step``), seed (default
            the job's seed), mode: as ``CephaloEngine.generate``; generation_split: the rows
            each rank decodes (``session_generate``).
        kwargs: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
            ``min_p``, ``eos_token_id``, ``pad_token_id`` (default: the model's
            ``generation_config``).

    Returns:
        (B, P + T) long tensor as ``generate`` returns it: the prompts as given, then each
        completion right-padded with the pad id to the longest on this rank (T). For an
        encoder-decoder (``input_ids``: the encoder's inputs) (B, 1 + T) decoder tokens: the
        decoder start token, then the completion ([Note: encoder-decoder generation]).

    Raises (on every rank, before any collective): ValueError for an encoder-decoder whose
    encoder does not read token ids (Whisper) or a refused keyword value, TypeError without
    ``input_ids`` or for an unknown keyword.
    """
    import torch

    refused = None
    try:  # a refusal on one rank must reach the others before any collective
        _check_generate_inputs(session.model, input_ids)
        params = sampling_from_generation_config(session.model, kwargs,
                                                 session.job.seed if seed is None else seed)
        ids = torch.as_tensor(input_ids)
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        prompts = [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
    except (TypeError, ValueError) as exc:
        refused = exc
    if session.any_rank(refused is not None):
        if refused is not None:
            raise refused
        raise ValueError("generate: another rank's call was refused (its error says why); "
                         "nothing was generated on any rank")
    if rows is None:
        counts = session.gather_rows(torch.tensor([len(prompts)], device=session.job.device))
        start = int(counts[:session.job.rank].sum())
        rows = list(range(start, start + len(prompts)))
    round_ = session.global_step if round_ is None else int(round_)
    out = session_generate(session, prompts, [int(r) for r in rows], params, round_, mode=mode,
                           generation_split=generation_split)
    width = max((len(c) for c in out.completions), default=0)
    tail = torch.full((len(prompts), width), params.pad_token_id, dtype=torch.long)
    for j, tokens in enumerate(out.completions):
        tail[j, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    if is_encoder_decoder(session.model):  # decoder tokens only
        head = torch.tensor(out.decoder_start, dtype=torch.long).expand(len(prompts), -1)
        return torch.cat([head, tail], dim=1).to(ids.device)
    return torch.cat([ids.cpu().long(), tail], dim=1).to(ids.device)
