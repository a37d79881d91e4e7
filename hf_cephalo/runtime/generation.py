"""Generation for the doors: the engine's decode modes and keyed sampling behind the runtime.

The doors import no ``hf_cephalo.engine``; what they need to generate is here:
``SamplingParams``, ``generate_rows`` (a model whose weights are all present: one process, the
single-process reference, ``hf_cephalo.reproducible_rollout``) and ``session_generate`` (the
sharded engine, ``Session.generate``). Both run the same code on the same keys, so a row's
completion is the same whichever decoded it ([Note: keyed sampling] in
``engine/sampling.py``, [Note: two decode modes] in ``engine/generation.py``).
"""

from __future__ import annotations

from typing import Sequence

from ..engine.generation import DECODE_MODES, GenerateOutput, generate_rows
from ..engine.sampling import SamplingParams, sample_key

__all__ = ["DECODE_MODES", "GenerateOutput", "SamplingParams", "generate_rows",
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
                     pad_to_multiple_of: int | None = None) -> GenerateOutput:
    """Collective: ``CephaloEngine.generate`` over the session's engine, with this rank's
    budget from its plan (``generation_budget_bytes``)."""
    budget = generation_budget_bytes(session.plan, session.job.rank)
    return session.engine.generate(prompt_ids, rows, params, round_, mode=mode,
                                   memory_budget_bytes=budget,
                                   pad_to_multiple_of=pad_to_multiple_of)
