"""Evaluation of a ``CephaloEngine``: the layered forward without gradients, a head per microbatch.

``evaluate`` (``CephaloEngine.evaluate`` delegates here) runs the units in the layered order of
a training step (the root units gathered around their uses, every all-gather prefetched one
unit ahead) under ``no_grad``, then the head of each microbatch once, releasing its hidden
state (and its logits unless kept) before the next; the loss sums are all-reduced into the
global item-mean loss of ``EvalOutput``. A failure mid-schedule abandons the step as in
training (``CephaloEngine.abandon_step``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import torch

from ..models.base import global_num_items_scope, run_unit_in
from . import collectives as C
from .compile import running
from .flat_param import FlatParamUnit
from .offload import host_wait

__all__ = ["EvalOutput", "evaluate"]


class EvalOutput(NamedTuple):
    """Result of ``evaluate``: loss (global item mean, NaN if no items), num_items (global),
    logits: one entry per microbatch of this rank: its logits (as ``StagedModel.head_logits``)
    or what ``process_logits`` made of them; empty with ``return_logits=False``."""

    loss: float
    num_items: int
    logits: list[torch.Tensor]
    microbatch_losses: tuple[float, ...] = ()
    """Per microbatch of this rank: its own item-mean loss (its loss sum / its item count, what
    the model's forward returns for that microbatch alone); NaN for a microbatch without items."""


@torch.no_grad()
def evaluate(engine, microbatches, *, return_logits: bool = True,
             process_logits: Callable[[torch.Tensor, Mapping], Any] | None = None
             ) -> EvalOutput:
    """Layered forward only; does not change train/eval mode (call ``model.eval()``).

    The head runs ONCE per microbatch (``StagedModel.head_loss_and_logits``, or
    ``head_loss`` alone when no logits are wanted), and each microbatch's final hidden
    state and logits are released as soon as its head ran, so at most one microbatch's
    logits are on the device at a time unless they are returned.
    return_logits: False keeps no logits (loss only: ``prediction_loss_only``).
    process_logits: called as ``process_logits(logits, microbatch)`` on each microbatch's
        device logits right after its head; its result is kept instead of the logits (e.g.
        ``preprocess_logits_for_metrics`` then ``.cpu()``, so predictions leave the device
        per microbatch). Ignored with ``return_logits=False``.
    """
    engine.check_usable("evaluate")
    mbs = list(microbatches)
    _, global_items = engine._global_items(mbs, for_training=False)
    engine.staged.begin_step()
    extra: list[float] = []
    try:
        with global_num_items_scope(global_items):  # [Note: global item count for user losses]
            with running(engine._compiled):
                loss_sum, logits, mb_sums = _evaluate_layered(
                    engine, mbs, return_logits, process_logits,
                    before_heads=lambda: extra.append(_finish_global_terms(engine)))
    except BaseException as exc:
        engine.staged.end_step()
        engine.abandon_step(None, exc, "evaluate")
        raise
    try:
        C.all_reduce_sum(loss_sum, engine.group, engine.stats)
    finally:
        engine.staged.end_step()
    loss = float(loss_sum) / global_items + extra[0] if global_items else float("nan")
    counts = [engine.staged.count_items(mb) for mb in mbs]
    mb_losses = tuple(float(s) / n if n else float("nan") for s, n in zip(mb_sums, counts))
    return EvalOutput(loss, global_items, logits, mb_losses)


def _finish_global_terms(engine) -> float:
    """Collective: a global-batch term (the MoE router loss) of this evaluation batch, as the
    model's own loss over the whole batch includes it; finished before the heads run, so a loss
    in the head can read it (``StagedModel.global_loss_output``), as in a training step."""
    terms = engine.staged.global_loss_sums()
    if terms is None:
        return 0.0
    return engine.staged.finish_global_loss(engine._reduce_sums(terms.to(engine.device)).cpu())


def _evaluate_layered(engine, mbs, return_logits: bool, process_logits,
                      before_heads: Callable[[], None] = lambda: None):
    """(loss sum (1,) float64, logits per microbatch, loss sum per microbatch) of the
    layered forward. The root
    units are gathered around their uses like in ``train_step`` (kept all along with
    ``root_resident``); every all-gather is prefetched one unit ahead. ``before_heads`` runs
    (on every rank) between the last unit and the heads."""
    root = engine.root
    head_phase = root.head_phase()
    first = root.both() if root.resident else [root.embed]
    after_embed = engine.units[:1] or head_phase
    for unit in [*first, *after_embed]:
        unit.start_unshard()
    root.embed.wait_unshard(requires_grad=False)
    hiddens, ctxs = [], []
    for mb in mbs:
        root.embed.use_params()
        h, ctx = engine.staged.embed(mb)
        hiddens.append(h)
        ctxs.append(ctx)
    if not root.resident and not any(root.embed is u for u in after_embed):
        root.embed.reshard()
    for i, unit in enumerate(engine.units):
        if engine.device.type == "cuda":  # see [Note: host waits for the compute stream]
            host_wait(engine.device, engine.stats)
        unit.wait_unshard(requires_grad=False)
        for nxt in (engine.units[i + 1:i + 2] or head_phase):
            nxt.start_unshard()
        unit.use_params()
        outs = [run_unit_in(engine.staged, i, h, c) for h, c in zip(hiddens, ctxs)]
        hiddens, ctxs = [y for y, _ in outs], [c for _, c in outs]
        unit.reshard()
    before_heads()
    loss_sum = torch.zeros(1, dtype=torch.float64, device=engine.device)
    for unit in head_phase:
        unit.wait_unshard(requires_grad=False)
    mb_sums: list[torch.Tensor] = []
    logits = _eval_heads(engine, hiddens, mbs, ctxs, loss_sum, return_logits,
                         process_logits, head_phase, mb_sums)
    for unit in root.both():
        unit.reshard()
    return loss_sum, logits, mb_sums


def _eval_heads(engine, hiddens: list, mbs, ctxs, loss_sum: torch.Tensor, return_logits: bool,
                process_logits, head_units: list[FlatParamUnit],
                mb_sums: list[torch.Tensor]) -> list:
    """One head pass per microbatch, adding its loss sum into ``loss_sum`` (and appending
    it to ``mb_sums``, (1,) float64 each); each
    microbatch's hidden state (and its logits unless returned) is released before the next
    microbatch's head runs."""
    kept = []
    for j, (mb, ctx) in enumerate(zip(mbs, ctxs)):
        hidden, hiddens[j] = hiddens[j], None
        for unit in head_units:
            unit.use_params()
        before = loss_sum.clone()
        result = _eval_head(engine, hidden, mb, ctx, loss_sum, return_logits, process_logits)
        mb_sums.append(loss_sum - before)
        if return_logits:
            kept.append(result)
    return kept


def _eval_head(engine, hidden, mb, ctx, loss_sum: torch.Tensor, return_logits: bool,
               process_logits):
    """The head of one microbatch: adds its loss sum into ``loss_sum``; returns what is
    kept of its logits (None without ``return_logits``). The logits are locals of this
    call, so they are freed when it returns unless kept. A microbatch without items (no
    ``labels``: ``predict`` on unlabeled data) adds no loss and runs ``head_logits`` only."""
    if engine.staged.count_items(mb) == 0:
        if not return_logits:
            return None
        logits = engine.staged.head_logits(hidden, mb, ctx)
        return logits if process_logits is None else process_logits(logits, mb)
    if not return_logits:
        loss_sum += engine.staged.head_loss(hidden, mb, ctx).loss_sum.double()
        return None
    out = engine.staged.head_loss_and_logits(hidden, mb, ctx)
    loss_sum += out.loss.loss_sum.double()
    return out.logits if process_logits is None else process_logits(out.logits, mb)
