"""The layered gradient-accumulation schedule (paper §3.3, Fig. 4; docs/design.md contract 4).

``LayeredStep`` runs one step (or one evaluation) of a rank's microbatches unit by unit;
``RootUnits`` holds the embedding and head units, ``RngState`` the state a recompute replays.
The invariants are the Notes below; the schedule step by step: docs/engine.md, "Schedule (per
step)" and "Layered schedule".
"""

# [Note: layered schedule]
# A step runs every microbatch through one unit before the next: the embedding unit E (a tied
# embedding lives here, once), the L layer units, the head unit H (loss + its backward), then
# the layer units in reverse, each microbatch recomputed from its stashed boundary input, and
# E's backward last. Each unit (E and H too, unless ``root_resident``) is gathered around its
# uses with the next one prefetched, and its gradient is reduce-scattered ONCE per step, after
# every microbatch's backward. The collective sequence depends only on L, the tie and
# ``root_resident``, never on the number of microbatches, so ranks with 3, 1 or 0 microbatches
# issue the same collectives and none hangs. A tied E gets two reduce-scatters that both ADD
# into its one shard gradient. A recompute runs the unit on a detached stashed input
# (``requires_grad=True``, so parameter gradients exist even when no input needs one) with the
# forward's CPU / CUDA RNG state restored, so gradients and dropout masks are those of one
# forward pass. Pseudo-code and the collective counts: docs/engine.md, "Layered schedule".

# [Note: side inputs]
# A tensor ``embed`` computes from parameters that units read besides the hidden states
# (``StagedModel.side_inputs(ctx)``: Gemma 3n's per-layer inputs) stays in the microbatch's ctx
# from the forward phase (no graph) to E's backward. Each unit's recompute (and a kept forward)
# reads detached copies with ``requires_grad=True`` (``with_side_inputs``), like its boundary
# input; their gradients are summed per microbatch over the units that read them
# (``side_grads[j]``) and, in E's backward, backpropagated through the re-run ``embed``
# together with the hidden state's gradient (one ``autograd.backward`` over both). No
# collective is added: the sequence stays that of [Note: layered schedule].
#
# A unit k may also MAKE side inputs (``produces_side_inputs(k)``: an encoder-decoder's first
# decoder unit makes the encoder's output from its boundary input, the last encoder layer's
# output, and every later decoder unit's cross-attention reads it). ``produce_side_inputs``
# appends them to the ctx k runs on; the forward phase keeps that ctx (no graph) as the
# microbatch's ctx for the units after k and keeps the ctx k started from (``made_from``).
# Backward walks units last to first, so the units after k have summed their gradients for
# the made tensors into ``side_grads[j]`` (after the earlier ones' entries) before k's
# backward; k's recompute re-makes them with a graph from its stashed input (forward RNG
# replayed) and runs ONE ``autograd.backward([y, *made], [g, *their sums])``, so the gradient
# flows into k's parameters and, through k's boundary input gradient, into the units before
# k (the encoder). Their sums are dropped there; the entries of the earlier side inputs go on
# to E's backward as above. Still no collective: ranks with 0, 1 or 3 microbatches issue the
# same sequence. Several units may make side inputs (T5's layer 0 of each stack; the store
# layers of KV sharing, Gemma 3n / Gemma 4, whose keys / values the later layers reuse:
# [Note: KV sharing as made side inputs] in models/kv_sharing.py): each appends after the
# earlier ones' and drops its own sums in its backward, so the later making unit's entries
# are consumed first. A side input a layer writes into a dict other layers read in any other
# form stays refused (self_check._refuse_shared_layer_state).

# [Note: open steps]
# A custom training loop computes its own loss from the model's outputs between the forward and
# the backward (``CephaloEngine.forward_step`` / ``backward_step``). The step then splits at the
# head: ``open_head`` runs the head of every microbatch with autograd on (each final hidden
# state a leaf, the head units gathered with their gradients prepared) and hands back the logits
# and loss sums; the caller's loss is backpropagated once (``close_head``), the leaves' gradients
# become the boundary gradients g[L][j], and the layered backward continues as in ``head``. The
# collectives are those of a ``run`` step. The head graphs of all the rank's microbatches live
# until that backward (memory grows with b_i in the head, as with any loop holding its logits).

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..models.base import run_unit_in, with_side_input_leaves
from .flat_param import FlatParamUnit
from .offload import ActivationStash


class HeadOutputs(NamedTuple):
    """What ``LayeredStep.open_head`` returns per microbatch: logits (empty without
    ``with_logits``) and the adapter's loss sums (0-dim), both with autograd graphs."""

    logits: list
    loss_sums: list


class RngState:
    """CPU (+ CUDA) RNG state captured before a forward call, for replay in the recompute."""

    def __init__(self, device: torch.device):
        self.devices = [device] if device.type == "cuda" else []
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]

    def replay(self):
        fork = torch.random.fork_rng(devices=self.devices)
        fork.__enter__()
        torch.set_rng_state(self.cpu)
        for d, s in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(s, d)
        return fork


@dataclass(frozen=True)
class RootUnits:
    """The root's two units and how the schedule gathers them (see [Note: layered schedule]).

    embed: the embedding unit (``StagedModel.embed_modules()``; owns a tied weight).
    head: the head unit (``head_modules()`` minus what ``embed`` owns).
    tied: the head uses a parameter of ``embed`` (tied input/output embeddings), so the head
        phase gathers both units.
    resident: gather both at the start of the step and keep them (with their gradients)
        gathered until its end (the engine's ``root_resident``); else gather around each use.
    """

    embed: FlatParamUnit
    head: FlatParamUnit
    tied: bool
    resident: bool = False

    def both(self) -> list[FlatParamUnit]:
        return [self.embed, self.head]

    def head_phase(self) -> list[FlatParamUnit]:
        """Units the head (loss / logits) needs gathered."""
        return [self.head, self.embed] if self.tied else [self.head]


class LayeredStep:
    """One training step of the layered schedule over this rank's microbatches.

    Args:
        staged: the StagedModel; units: the L layer units; root: the embedding and head units.
        microbatches: this rank's microbatches (may be empty).
        global_num_items: N, the all-reduced item count every loss sum is divided by.
        stash: boundary activation / gradient store; device: compute device.
        keep_graphs: keep every forward graph instead of recomputing in backward (activation
            memory grows with l like standard training; see [Note: kept graphs across reshard]).
        scale_loss: applied to each microbatch's ``loss_sum / N`` before its backward (a loss
            scaler's ``scale``, fp16); default identity.
        reduce_sums: SUM-all-reduce of the staged model's ``global_loss_sums`` vector over the
            ranks (a collective every rank joins after the forward phase); needed only when the
            staged model has such sums (the MoE router loss of the global batch).
    """

    def __init__(self, staged, units: Sequence[FlatParamUnit], root: RootUnits,
                 microbatches: Sequence[Any], global_num_items: int, stash: ActivationStash,
                 device: torch.device, keep_graphs: bool = False, scale_loss=None,
                 reduce_sums: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.staged, self.units, self.root = staged, list(units), root
        self.mbs, self.N = list(microbatches), global_num_items
        self.stash, self.device = stash, device
        self.ctxs: list[Any] = []
        self.side_grads: dict[int, list] = {}  # microbatch -> summed side-input gradients
        self.made_from: dict[tuple, Any] = {}  # (making unit, microbatch) -> ctx it started from
        self.rng: dict[tuple, RngState] = {}
        self.keep_graphs = keep_graphs
        self.scale_loss = scale_loss if scale_loss is not None else (lambda loss: loss)
        self.kept: dict[tuple, tuple] = {}  # (unit, microbatch) -> (input, output) with graph
        self.reducing: list[FlatParamUnit] = []  # reduce-scatters issued, not yet waited
        self.local_loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # no host sync
        self.reduce_sums = reduce_sums
        self.extra_loss = 0.0  # a global-batch loss term (``finish_global_loss``), added once

    def run(self) -> None:
        self.staged.begin_step()
        try:
            self.forward()
            self.finish_global_loss()
            self.head()
            self.backward()
        finally:
            self.staged.end_step()

    def finish_global_loss(self) -> None:
        """After the forward phase: all-reduce the staged model's ``global_loss_sums`` (every rank,
        the same vector size) and let it finish its global-batch loss term, whose gradient the
        recomputed units add in backward, scaled like the microbatches' losses."""
        terms = self.staged.global_loss_sums()
        if terms is None:
            return
        if self.reduce_sums is None:
            raise RuntimeError(f"{type(self.staged).__name__} has a global-batch loss term "
                               "but this step was given no reduce_sums")
        total = self.reduce_sums(terms.to(self.device))
        grad_scale = float(self.scale_loss(torch.ones((), device=self.device)))
        self.extra_loss = self.staged.finish_global_loss(total.cpu(), grad_scale)

    # ---- a step whose loss the caller computes (a custom training loop) -----------------------
    def open_head(self, with_logits: bool) -> "HeadOutputs":
        """The head phase with autograd kept for the caller's loss (see [Note: open steps]):
        per microbatch the head's logits (``with_logits``) and its own loss sum, each with its
        graph back to the boundary activation ``h[L][j]`` (a leaf) and the head parameters."""
        L = len(self.units)
        phase = self.root.head_phase()
        self._gather(phase)
        if L == 0:
            self.root.embed.start_unshard()  # the embedding backward comes next
        self._hiddens, logits, loss_sums = [], [], []
        for j, mb in enumerate(self.mbs):
            self.stash.wait_offload((L, j))
            self.stash.start_reload((L, j + 1))
            hidden = self.stash.pop((L, j)).detach().requires_grad_(True)
            for unit in phase:
                unit.use_fresh_leaves()  # the microbatches' head gradients meet in fp32
            if with_logits:
                out = self.staged.head_loss_and_logits(hidden, mb, self.ctxs[j])
                loss, logits_j = out.loss, out.logits
                logits.append(logits_j)
            else:
                loss = self.staged.head_loss(hidden, mb, self.ctxs[j])
            loss_sums.append(loss.loss_sum)
            self.local_loss_sum += loss.loss_sum.detach().double()
            self._hiddens.append(hidden)
        return HeadOutputs(logits, loss_sums)

    def close_head(self, loss: torch.Tensor | None) -> bool:
        """Backpropagate the caller's ``loss`` (already normalized and scaled; None: this rank
        contributes no gradient) into the head and the boundary gradients, stash them, leave
        the head phase (its reduce-scatter) and run the layered backward. Returns whether the
        loss reached the model's outputs (some boundary activation got a gradient)."""
        L, root = len(self.units), self.root
        if loss is not None and loss.requires_grad:
            torch.autograd.backward(loss)
        reached = any(h.grad is not None for h in self._hiddens)
        for j, hidden in enumerate(self._hiddens):
            self.stash.start_offload(("grad", j), _grad_or_zeros(hidden),
                                     keep=j == len(self.mbs) - 1)
        self._hiddens = []
        self._leave(root.head_phase(), [] if L else [root.embed], reduce=True)
        self.backward()
        return reached

    # ---- root units: gather around their uses ------------------------------------------------
    def _gather(self, units: Sequence[FlatParamUnit]) -> None:
        for unit in units:
            unit.start_unshard()  # no-op if gathered or in flight; issues all before waiting
        for unit in units:
            unit.wait_unshard(requires_grad=True)

    def _leave(self, units: Sequence[FlatParamUnit], needed: Sequence[FlatParamUnit],
               reduce: bool) -> None:
        """A phase ends: reshard each of ``units`` the next phase does not need (issuing its
        gradient's reduce-scatter first when ``reduce``); resident root units stay."""
        for unit in units:
            if any(unit is n for n in needed) or \
                    (self.root.resident and any(unit is r for r in self.root.both())):
                continue
            if reduce:
                self._start_reduce(unit)
            unit.reshard()

    def _start_reduce(self, unit: FlatParamUnit) -> None:
        """Issue ``unit``'s gradient reduce-scatter (its result is ADDED to the shard grad)."""
        if any(unit is u for u in self.reducing):  # one in flight per unit
            self._wait_reduces(keep=[u for u in self.reducing if u is not unit])
        unit.start_reduce_grad()
        self.reducing.append(unit)

    def _wait_reduces(self, keep: Sequence[FlatParamUnit] = ()) -> None:
        """Wait every issued reduce-scatter except those of ``keep`` (issue order)."""
        for unit in self.reducing:
            if not any(unit is k for k in keep):
                unit.wait_reduce_grad()
        self.reducing = [u for u in self.reducing if any(u is k for k in keep)]

    # ---- phases ---------------------------------------------------------------------------
    def forward(self) -> None:
        """Embed every microbatch, then each unit over every microbatch (no graph kept)."""
        L, root = len(self.units), self.root
        if root.resident:
            root.head.start_unshard()  # gathered once for the whole step
        self._gather([root.embed])
        after_embed = self.units[:1] or root.head_phase()
        for unit in after_embed:
            unit.start_unshard()
        with torch.no_grad():
            for j, mb in enumerate(self.mbs):
                self.stash.one_microbatch_in_flight(self.device)
                self.rng[("embed", j)] = RngState(self.device)
                root.embed.use_params()
                hidden, ctx = self.staged.embed(mb)
                self.ctxs.append(ctx)
                self.stash.start_offload((0, j), hidden)
            self._leave([root.embed], after_embed, reduce=False)
            self.stash.start_reload((0, 0))  # unit 0's first input, offloaded meanwhile
            for i, unit in enumerate(self.units):
                # [Note: host waits for the compute stream]
                self.stash.one_unit_in_flight(self.device)
                unit.wait_unshard(requires_grad=True)
                for nxt in (self.units[i + 1:i + 2] or root.head_phase()):
                    nxt.start_unshard()
                for j in range(len(self.mbs)):
                    self.stash.wait_offload((i, j))
                    # prefetch the next microbatch's input; after the last one, the next
                    # unit's first input (stashed while this unit ran microbatch 0)
                    self.stash.start_reload((i, j + 1) if j + 1 < len(self.mbs) else (i + 1, 0))
                    self.stash.one_microbatch_in_flight(self.device)
                    if self.keep_graphs or (i == L - 1 and j == len(self.mbs) - 1):
                        self._forward_kept(unit, i, j)
                        continue
                    x = self.stash.get((i, j))
                    self.rng[(i, j)] = RngState(self.device)
                    unit.use_params()
                    if self.staged.produces_side_inputs(i):  # [Note: side inputs]
                        self.made_from[(i, j)] = self.ctxs[j]
                    y, self.ctxs[j] = run_unit_in(self.staged, i, x, self.ctxs[j])
                    self.stash.start_offload((i + 1, j), y)
                if i + 1 < L:
                    unit.reshard(keep_graph_storage=self.keep_graphs)

    def _forward_kept(self, unit: FlatParamUnit, i: int, j: int) -> None:
        """Run with autograd and keep the graph for backward instead of recomputing. Always
        for the last unit's last microbatch (backward starts right there; same peak as the
        recompute it replaces); for every (unit, microbatch) when ``keep_graphs``."""
        x = self.stash.pop((i, j)).detach().requires_grad_(True)
        with torch.enable_grad():  # the forward phase runs under no_grad; this graph is kept
            unit.use_params()
            y, sides, made = self._run_with_grad(i, j, x, forward=True)
        if made:  # later units read them without this graph ([Note: side inputs])
            self.ctxs[j] = self.staged.with_side_inputs(
                self.ctxs[j], [s.detach() for s in self.staged.side_inputs(self.ctxs[j])])
        self.kept[(i, j)] = (x, y, sides, made)
        self.stash.start_offload((i + 1, j), y.detach())

    def _run_with_grad(self, i: int, j: int, x: torch.Tensor, forward: bool = False) -> tuple:
        """Unit ``i`` on microbatch ``j``'s input leaf ``x`` with autograd: ``(y, sides,
        made)``: its output, the side-input leaves it read (``_unit_ctx``) and the side inputs
        it made, with their graph ([Note: side inputs]). A making unit starts from the ctx
        before it made them: the current one in the ``forward`` phase (which then becomes the
        ctx with the made ones, for the later units), else the one the forward kept."""
        if not self.staged.produces_side_inputs(i):
            ctx, sides = self._unit_ctx(j)
            return self.staged.run_unit(i, x, ctx), sides, []
        if forward:
            self.made_from[(i, j)] = self.ctxs[j]
        ctx, sides = self._unit_ctx(j, self.made_from[(i, j)])
        ctx = self.staged.produce_side_inputs(i, x, ctx)
        made = self.staged.side_inputs(ctx)[len(sides):]
        if forward:
            self.ctxs[j] = ctx
        return self.staged.run_unit(i, x, ctx), sides, made

    def head(self) -> None:
        """Head loss + its backward per microbatch; stashes the boundary gradients g[L][j].
        Then the head's gradient (and a tied embedding's head-use gradient) is
        reduce-scattered and its units resharded, unless the step keeps them."""
        L, root = len(self.units), self.root
        phase = root.head_phase()
        self._gather(phase)
        if L == 0:
            root.embed.start_unshard()  # the embedding backward comes next
        for j, mb in enumerate(self.mbs):
            self.stash.wait_offload((L, j))
            self.stash.start_reload((L, j + 1))
            self.stash.one_microbatch_in_flight(self.device)
            hidden = self.stash.pop((L, j)).detach().requires_grad_(True)
            for unit in phase:
                unit.use_params()
            out = self.staged.head_loss(hidden, mb, self.ctxs[j])
            for unit in phase:
                unit.prepare_grad()
            torch.autograd.backward(self.scale_loss(out.loss_sum / self.N))
            self.local_loss_sum += out.loss_sum.detach().double()
            # the last microbatch's boundary gradient is the first one backward reads
            self.stash.start_offload(("grad", j), _grad_or_zeros(hidden),
                                     keep=j == len(self.mbs) - 1)
        self._leave(phase, [] if L else [root.embed], reduce=True)

    def backward(self) -> None:
        """Units in reverse with recompute, one reduce-scatter each; then the embedding."""
        L, root = len(self.units), self.root
        for i in reversed(range(L)):
            unit = self.units[i]
            # [Note: host waits for the compute stream]
            self.stash.one_unit_in_flight(self.device)
            unit.wait_unshard(requires_grad=True)
            (self.units[i - 1] if i > 0 else root.embed).start_unshard()
            for j in reversed(range(len(self.mbs))):  # the kept graph (last j) goes first
                self._recompute_backward(unit, i, j)
            self._start_reduce(unit)
            self._wait_reduces(keep=[unit])  # the unit after this one (or the head phase)
            unit.reshard()
        self._gather([root.embed])
        for j, mb in enumerate(self.mbs):
            self._embed_backward(j, mb)
        last = root.both() if root.resident else [root.embed]
        for unit in last:
            self._start_reduce(unit)
        self._wait_reduces()
        for unit in last:
            unit.reshard()

    def _embed_backward(self, j: int, mb: Any) -> None:
        """E's backward for microbatch ``j``: re-run ``embed`` (forward RNG replayed) and
        backpropagate the boundary gradient g[0][j] and the side inputs' summed gradients
        together ([Note: side inputs])."""
        self.stash.wait_offload(("grad", j))
        self.stash.start_reload(("grad", j + 1))
        self.stash.one_microbatch_in_flight(self.device)
        grad = self.stash.pop(("grad", j))
        fork = self.rng.pop(("embed", j)).replay()
        try:
            self.root.embed.use_params()
            hidden, ctx = self.staged.embed(mb)
        finally:
            fork.__exit__(None, None, None)
        self.root.embed.prepare_grad()
        outputs, grads = ([hidden], [grad]) if hidden.requires_grad else ([], [])
        side_grads = self.side_grads.pop(j, None)
        if side_grads is not None:
            sides = self.staged.side_inputs(ctx)
            assert len(sides) == len(side_grads), "side inputs differ between embed calls"
            for side, side_grad in zip(sides, side_grads):
                if side_grad is not None and side.requires_grad:
                    outputs.append(side)
                    grads.append(side_grad)
        if outputs:
            torch.autograd.backward(outputs, grads)

    def _unit_ctx(self, j: int, ctx: Any = None) -> tuple[Any, list[torch.Tensor]]:
        """Microbatch ``j``'s ctx (or ``ctx``) for a unit run with autograd: its side inputs
        replaced by fresh leaves (returned too) whose gradients ``_add_side_grads`` collects."""
        return with_side_input_leaves(self.staged, self.ctxs[j] if ctx is None else ctx)

    def _backward_unit(self, i: int, j: int, y: torch.Tensor, grad: torch.Tensor,
                       sides: list[torch.Tensor], made: list[torch.Tensor]) -> None:
        """Unit ``i``'s backward for microbatch ``j``: its output gradient and, for a unit that
        made side inputs, the later units' summed gradients for them, in ONE backward; then
        its own side-input leaves' gradients into the sums, and the units before it read the
        ctx it started from again ([Note: side inputs])."""
        outputs, grads = [y], [grad]
        if made:
            sums = self.side_grads.get(j, [])
            made_grads = sums[len(sides):len(sides) + len(made)]
            del sums[len(sides):]  # consumed here; E's backward sees the earlier entries only
            for tensor, tensor_grad in zip(made, made_grads):
                if tensor_grad is not None and tensor.requires_grad:
                    outputs.append(tensor)
                    grads.append(tensor_grad)
        torch.autograd.backward(outputs, grads)
        self._add_side_grads(j, sides)
        if (i, j) in self.made_from:
            self.ctxs[j] = self.made_from.pop((i, j))

    def _add_side_grads(self, j: int, sides: list[torch.Tensor]) -> None:
        """Add the gradients the unit just gave microbatch ``j``'s side-input leaves into the
        microbatch's sums (a side input no unit differentiates keeps None)."""
        if not sides:
            return
        sums = self.side_grads.setdefault(j, [])
        sums.extend([None] * (len(sides) - len(sums)))
        for k, side in enumerate(sides):
            if side.grad is not None:
                sums[k] = side.grad if sums[k] is None else sums[k].add_(side.grad)

    def _recompute_backward(self, unit: FlatParamUnit, i: int, j: int) -> None:
        self.stash.wait_offload(("grad", j))
        # prefetch the next microbatch (backward walks them last to first); after microbatch 0,
        # the next unit's first one: its boundary gradient is this unit's output for the last
        # microbatch, already stashed
        last = len(self.mbs) - 1
        if j > 0:
            self.stash.start_reload(("grad", j - 1))
            self.stash.start_reload((i, j - 1))
        elif i > 0:
            self.stash.start_reload(("grad", last))
            self.stash.start_reload((i - 1, last))
        self.stash.one_microbatch_in_flight(self.device)
        if (i, j) in self.kept:
            x, y, sides, made = self.kept.pop((i, j))
            unit.prepare_grad()
            self._backward_unit(i, j, y, self.stash.pop(("grad", j)), sides, made)
            self.stash.start_offload(("grad", j), _grad_or_zeros(x), keep=i == 0 and j == 0)
            return
        self.stash.wait_offload((i, j))
        x = self.stash.pop((i, j)).detach().requires_grad_(True)
        grad = self.stash.pop(("grad", j))
        fork = self.rng.pop((i, j)).replay()
        try:
            unit.use_params()
            y, sides, made = self._run_with_grad(i, j, x)
        finally:
            fork.__exit__(None, None, None)
        unit.prepare_grad()
        self._backward_unit(i, j, y, grad, sides, made)
        # unit 0's gradient for microbatch 0 is the first one the embedding backward reads
        self.stash.start_offload(("grad", j), _grad_or_zeros(x), keep=i == 0 and j == 0)


def _grad_or_zeros(x: torch.Tensor) -> torch.Tensor:
    return x.grad if x.grad is not None else torch.zeros_like(x)
