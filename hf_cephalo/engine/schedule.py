"""The layered gradient-accumulation schedule (paper §3.3, Fig. 4; docs/design.md contract 4).

[Note: layered schedule]
Forward (no autograd graph is kept; activations are checkpointed at unit boundaries)::

    gather root; prefetch unit 0
    for each microbatch j: h[0][j] = embed(j)                      # stash h[0][j]
    for unit i in 0..L-1:  wait unit i; prefetch unit i+1
        for each microbatch j: h[i+1][j] = unit_i(h[i][j])         # stash h[i+1][j]
        reshard unit i (except the last unit: backward starts with it)
Head (root still gathered)::

    for each microbatch j: loss_j = head_loss(h[L][j]) / N;  backward -> g[L][j] (stashed)
Backward::

    for unit i in L-1..0: wait unit i; prefetch unit i-1
        for each microbatch j (last first): recompute unit_i(h[i][j]) with the forward's RNG state
                               (not for the last unit's last microbatch: its forward graph was
                               kept, it is the first one backward needs),
                               backward with g[i+1][j] -> g[i][j] (stashed), grads accumulate
        (each microbatch first prefetches the next one's stashed tensors, across unit
        boundaries too; the host waits for the compute stream per microbatch with offload,
        else per unit: see [Note: host waits for the compute stream] in offload.py)
        reduce-scatter unit i's gradient ONCE; wait unit i+1's reduce-scatter; reshard unit i
    for each microbatch j: recompute embed(j), backward with g[0][j]
    reduce-scatter root; reshard root; wait every reduce-scatter

Root unit (embeddings + final norm + head): gathered ONCE at the start of the step and kept
gathered until after the embedding backward, like FSDP2's root module; its gradient is
reduce-scattered once. Collectives per step: all-gathers = 2L (L forward, L-1 backward, 1 root),
reduce-scatters = L + 1, plus two 8-byte all-reduces (item count, loss sum) — independent of the
number of microbatches, and identical on every rank, including a rank with no microbatch (it
runs no compute but joins every collective), so ranks with 3 vs 1 vs 0 microbatches never hang.

Autograd: each recompute runs the unit on a detached stashed input with ``requires_grad=True``
and calls ``torch.autograd.backward(output, boundary_grad)`` directly, so the unit's parameter
gradients are produced even when the input does not depend on a trainable tensor (the trap of
reentrant checkpointing). Dropout is replayed like ``torch.utils.checkpoint``: the CPU (and
CUDA) RNG state before each forward call is saved and restored inside ``fork_rng`` for the
recompute, so the global RNG advances exactly as in one forward pass.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .flat_param import FlatParamUnit
from .offload import ActivationStash


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


class LayeredStep:
    """One training step of the layered schedule over this rank's microbatches.

    Args:
        staged: the StagedModel; units: the L layer units; root: the root unit.
        microbatches: this rank's microbatches (may be empty).
        global_num_items: N, the all-reduced item count every loss sum is divided by.
        stash: boundary activation / gradient store; device: compute device.
        keep_graphs: keep every forward graph instead of recomputing in backward (activation
            memory grows with l like standard training; see [Note: kept graphs across reshard]).
    """

    def __init__(self, staged, units: Sequence[FlatParamUnit], root: FlatParamUnit,
                 microbatches: Sequence[Any], global_num_items: int, stash: ActivationStash,
                 device: torch.device, keep_graphs: bool = False):
        self.staged, self.units, self.root = staged, list(units), root
        self.mbs, self.N = list(microbatches), global_num_items
        self.stash, self.device = stash, device
        self.ctxs: list[Any] = []
        self.rng: dict[tuple, RngState] = {}
        self.keep_graphs = keep_graphs
        self.kept: dict[tuple, tuple] = {}  # (unit, microbatch) -> (input, output) with graph
        self.local_loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # no host sync

    def run(self) -> None:
        self.forward()
        self.head()
        self.backward()

    def forward(self) -> None:
        """Embed every microbatch, then each unit over every microbatch (no graph kept)."""
        L = len(self.units)
        self.root.wait_unshard(requires_grad=True)
        (self.units[0] if L else self.root).start_unshard()
        with torch.no_grad():
            for j, mb in enumerate(self.mbs):
                self.stash.one_microbatch_in_flight(self.device)
                self.rng[("embed", j)] = RngState(self.device)
                self.root.use_params()
                hidden, ctx = self.staged.embed(mb)
                self.ctxs.append(ctx)
                self.stash.start_offload((0, j), hidden)
            self.stash.start_reload((0, 0))  # unit 0's first input, offloaded meanwhile
            for i, unit in enumerate(self.units):
                # [Note: host waits for the compute stream]
                self.stash.one_unit_in_flight(self.device)
                unit.wait_unshard(requires_grad=True)
                if i + 1 < L:
                    self.units[i + 1].start_unshard()
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
                    self.stash.start_offload((i + 1, j), self.staged.run_unit(i, x, self.ctxs[j]))
                if i + 1 < L:
                    unit.reshard(keep_graph_storage=self.keep_graphs)

    def _forward_kept(self, unit: FlatParamUnit, i: int, j: int) -> None:
        """Run with autograd and keep the graph for backward instead of recomputing. Always
        for the last unit's last microbatch (backward starts right there; same peak as the
        recompute it replaces); for every (unit, microbatch) when ``keep_graphs``."""
        x = self.stash.pop((i, j)).detach().requires_grad_(True)
        with torch.enable_grad():  # views made under no_grad would not track the leaf
            unit.use_params()
            y = self.staged.run_unit(i, x, self.ctxs[j])
        self.kept[(i, j)] = (x, y)
        self.stash.start_offload((i + 1, j), y.detach())

    def head(self) -> None:
        """Head loss + its backward per microbatch; stashes the boundary gradients g[L][j]."""
        L = len(self.units)
        for j, mb in enumerate(self.mbs):
            self.stash.wait_offload((L, j))
            self.stash.start_reload((L, j + 1))
            self.stash.one_microbatch_in_flight(self.device)
            hidden = self.stash.pop((L, j)).detach().requires_grad_(True)
            self.root.use_params()
            out = self.staged.head_loss(hidden, mb, self.ctxs[j])
            torch.autograd.backward(out.loss_sum / self.N)
            self.root.note_grad()
            self.local_loss_sum += out.loss_sum.detach().double()
            # the last microbatch's boundary gradient is the first one backward reads
            self.stash.start_offload(("grad", j), _grad_or_zeros(hidden),
                                     keep=j == len(self.mbs) - 1)

    def backward(self) -> None:
        """Units in reverse with recompute, one reduce-scatter each; then the embedding."""
        L = len(self.units)
        for i in reversed(range(L)):
            unit = self.units[i]
            # [Note: host waits for the compute stream]
            self.stash.one_unit_in_flight(self.device)
            unit.wait_unshard(requires_grad=True)
            if i > 0:
                self.units[i - 1].start_unshard()
            for j in reversed(range(len(self.mbs))):  # the kept graph (last j) goes first
                self._recompute_backward(unit, i, j)
            unit.start_reduce_grad()
            if i + 1 < L:
                self.units[i + 1].wait_reduce_grad()
            unit.reshard()
        for j, mb in enumerate(self.mbs):
            self.stash.wait_offload(("grad", j))
            self.stash.start_reload(("grad", j + 1))
            self.stash.one_microbatch_in_flight(self.device)
            grad = self.stash.pop(("grad", j))
            fork = self.rng.pop(("embed", j)).replay()
            try:
                self.root.use_params()
                hidden, _ = self.staged.embed(mb)
            finally:
                fork.__exit__(None, None, None)
            if hidden.requires_grad:
                torch.autograd.backward(hidden, grad)
            self.root.note_grad()
        self.root.start_reduce_grad()
        for unit in self.units[:1]:
            unit.wait_reduce_grad()
        self.root.wait_reduce_grad()
        self.root.reshard()

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
            x, y = self.kept.pop((i, j))
            torch.autograd.backward(y, self.stash.pop(("grad", j)))
            unit.note_grad()
            self.stash.start_offload(("grad", j), _grad_or_zeros(x), keep=i == 0 and j == 0)
            return
        self.stash.wait_offload((i, j))
        x = self.stash.pop((i, j)).detach().requires_grad_(True)
        grad = self.stash.pop(("grad", j))
        fork = self.rng.pop((i, j)).replay()
        try:
            unit.use_params()
            y = self.staged.run_unit(i, x, self.ctxs[j])
        finally:
            fork.__exit__(None, None, None)
        torch.autograd.backward(y, grad)
        unit.note_grad()
        # unit 0's gradient for microbatch 0 is the first one the embedding backward reads
        self.stash.start_offload(("grad", j), _grad_or_zeros(x), keep=i == 0 and j == 0)


def _grad_or_zeros(x: torch.Tensor) -> torch.Tensor:
    return x.grad if x.grad is not None else torch.zeros_like(x)
