"""The StagedModel contract: a model seen as embedding + a list of identical units + head.

The layered engine (``hf_cephalo.engine``) never imports a concrete model; it drives any
``StagedModel``. The generic decoder path (``models/generic.py``), an adapter for a Hugging Face
architecture (``models/gpt2.py``, ...) or the test model (``models/toy.py``) implements it. docs/design.md contract 5.

Data flow for one microbatch (a dict of tensors as produced by a collator)::

    hidden, ctx = staged.embed(microbatch)             # embed_modules() params only
    for i in range(staged.num_units):
        if staged.produces_side_inputs(i):            # e.g. an encoder's output (seq2seq)
            ctx = staged.produce_side_inputs(i, hidden, ctx)
        hidden = staged.run_unit(i, hidden, ctx)      # unit i params only
    out = staged.head_loss(hidden, microbatch, ctx)   # head_modules() params (+ tied embedding)

``ctx`` carries per-microbatch tensors that are NOT differentiated through (attention masks,
position ids, rotary cos/sin). It is built once per microbatch by ``embed`` and reused by the
recompute in backward, so it must not depend on unit parameters; the exceptions are its side
inputs (``side_inputs``), whose gradients the engine carries back to the embedding or to the
unit that made them (``produce_side_inputs``; docs/engine.md, "Side inputs").
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
from typing import Any, Iterator, Mapping, NamedTuple

import torch
from torch import nn

Microbatch = Mapping[str, torch.Tensor]


_GLOBAL_NUM_ITEMS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "hf_cephalo_global_num_items", default=None)


@contextlib.contextmanager
def global_num_items_scope(num_items: int) -> Iterator[None]:
    """While the engine runs a step or an evaluation: the GLOBAL item count N (all ranks,
    all microbatches) that every loss sum is divided by.

    [Note: global item count for user losses]
    ``head_loss`` returns a SUM and the engine divides it by N. A Hugging Face style loss
    (``compute_loss_func(outputs, labels, num_items_in_batch)``, ``LabelSmoother``) divides by
    ``num_items_in_batch`` itself, so an adapter wrapping one (``hf_cephalo/runtime/user_loss.py``)
    reads N here, passes it as ``num_items_in_batch`` and returns ``loss * N`` as the sum. The
    gradient then equals the full-batch one exactly when the loss is a sum over items divided
    by ``num_items_in_batch`` (true for cross entropy, label smoothing, any per-token loss).
    """
    token = _GLOBAL_NUM_ITEMS.set(int(num_items))
    try:
        yield
    finally:
        _GLOBAL_NUM_ITEMS.reset(token)


def global_num_items() -> int | None:
    """N inside ``global_num_items_scope`` (the engine's step / evaluation), else None."""
    return _GLOBAL_NUM_ITEMS.get()


_STAGED_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hf_cephalo_staged_call", default=False)


@contextlib.contextmanager
def staged_call() -> Iterator[None]:
    """While a staged model calls the user's model object itself (the generic path runs the
    model's own ``forward`` with its layers swapped for stubs): the guard that makes a sharded
    model's ``forward`` raise (``runtime/sharded_model.py``) lets this call through."""
    token = _STAGED_CALL.set(True)
    try:
        yield
    finally:
        _STAGED_CALL.reset(token)


def in_staged_call() -> bool:
    """True inside ``staged_call``."""
    return _STAGED_CALL.get()


def refuse_global_loss(staged: "StagedModel", door: str) -> None:
    """ValueError if ``staged`` adds a global-batch loss term (``global_loss_name``) that
    ``door`` (a loss the caller computes: a custom ``compute_loss``, TRL's trainers) would not
    include or would include per microbatch. Called at construction, before any collective."""
    term = staged.global_loss_name()
    if term is not None:
        raise ValueError(
            f"{door} computes the loss itself, but this model adds {term}, a term over the "
            "whole global batch the engine adds apart from that loss; hf_cephalo cannot give "
            "it the value and gradient the caller's loss code expects. Turn it off (e.g. "
            "model.config.output_router_logits = False) or train with CephaloTrainer's default "
            "loss")


class HeadOutput(NamedTuple):
    """Result of ``StagedModel.head_loss`` for one microbatch.

    loss_sum: 0-dim tensor, the SUM (not mean) of the per-item losses of this microbatch.
    num_items: number of items the sum runs over (tokens with label != -100 after the causal
        shift for language models; samples for classification), as a Python int.
    """

    loss_sum: torch.Tensor
    num_items: int


class HeadEvalOutput(NamedTuple):
    """Result of ``StagedModel.head_loss_and_logits`` for one microbatch: ``loss`` as
    ``head_loss`` returns it and ``logits`` as ``head_logits`` returns them, from one head pass
    where the adapter supports it."""

    loss: HeadOutput
    logits: torch.Tensor


class StagedModel(abc.ABC):
    """A model split into an embedding, ``num_units`` identical transformer layers and a head.

    The root (``root_modules()``) holds every parameter that is not inside a unit; it is split
    into the embedding part (``embed_modules()``, what ``embed`` uses) and the head part
    (``head_modules()``, what ``head_loss`` / ``head_logits`` use), which the engine gathers
    around their uses (docs/engine.md "Root units"). A weight shared by both (tied input and
    output embeddings) belongs to the embedding part: list the module in both or in either;
    the engine keeps it once, in the embedding unit. Adapters must not register extra
    parameters.

    Attributes:
        model: the wrapped ``nn.Module`` (an HF ``PreTrainedModel`` for adapters); its
            ``state_dict()`` keys are the keys checkpoints use.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    # ---- structure -------------------------------------------------------------------
    @abc.abstractmethod
    def units(self) -> list[nn.Module]:
        """The transformer layers in execution order (one engine unit each)."""

    @abc.abstractmethod
    def embed_modules(self) -> list[nn.Module]:
        """Modules ``embed`` uses (token / position embeddings, modules holding only buffers
        such as rotary ``inv_freq``). Their parameters form the engine's embedding unit."""

    @abc.abstractmethod
    def head_modules(self) -> list[nn.Module]:
        """Modules ``head_loss`` / ``head_logits`` use (final norm, lm_head or classifier,
        pooler). Their parameters not already in ``embed_modules()`` form the head unit."""

    def root_modules(self) -> list[nn.Module]:
        """``embed_modules()`` then ``head_modules()`` (each module once): every parameter
        outside the units. With the units' parameters they must be exactly
        ``model.parameters()``."""
        out: list[nn.Module] = []
        for module in [*self.embed_modules(), *self.head_modules()]:
            if not any(module is m for m in out):
                out.append(module)
        return out

    @property
    def num_units(self) -> int:
        return len(self.units())

    # ---- computation -----------------------------------------------------------------
    @abc.abstractmethod
    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Any]:
        """Root-unit input step. Returns ``(hidden, ctx)``; hidden is (m, S, H) or (m, T, H)."""

    @abc.abstractmethod
    def run_unit(self, index: int, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Run unit ``index`` on ``hidden`` (shape kept, except where ``hidden_shape_changes``:
        a hierarchical backbone's stages). Must be deterministic in eval mode and replayable
        (dropout RNG is handled by the engine's recompute)."""

    def hidden_shape_changes(self) -> bool:
        """Whether some unit returns hidden states of another shape than its input's (the
        stages of a hierarchical backbone: ConvNeXt's (m, 96, 56, 56) -> (m, 192, 28, 28)).
        The engine stashes each boundary tensor as it is; the profiler, which times a unit
        of each size on the embedding's output, refuses such a model. Default: False."""
        return False

    def side_inputs(self, ctx: Any) -> list[torch.Tensor]:
        """The side inputs in ``ctx``: tensors ``embed`` computed from parameters that units
        read besides the hidden states (Gemma 3n's per-layer inputs), each listed once, in an
        order that depends on the model and the microbatch's shapes only (the same for the
        ``ctx`` of any call of ``embed`` on that microbatch). The engine hands each unit
        detached copies and carries their summed gradient back into ``embed``
        (docs/engine.md, "Side inputs"). Default: none."""
        return []

    def with_side_inputs(self, ctx: Any, tensors: list[torch.Tensor]) -> Any:
        """``ctx`` with its ``side_inputs`` replaced by ``tensors`` (same order and shapes);
        ``ctx`` itself unchanged. Default: ``ctx`` (no side inputs)."""
        return ctx

    def produces_side_inputs(self, index: int) -> bool:
        """Whether unit ``index`` makes side inputs that later units read (an encoder-decoder's
        first decoder unit makes the encoder's output, read by every decoder layer's
        cross-attention; a KV-sharing store layer its keys / values, read by the later reuse
        layers): the callers then run ``produce_side_inputs`` before ``run_unit``
        (``run_unit_in``). It depends on ``index`` only. Default: False."""
        return False

    def produce_side_inputs(self, index: int, hidden: torch.Tensor, ctx: Any) -> Any:
        """For a unit with ``produces_side_inputs(index)``: ``ctx`` with the side inputs that
        unit makes from its boundary input ``hidden`` appended, so that
        ``side_inputs(result) == side_inputs(ctx) + made`` (each made tensor from ``hidden``
        and unit ``index``'s parameters only); ``ctx`` itself unchanged. The engine carries
        the later units' summed gradients for them back through this call
        (docs/engine.md, "Side inputs"). Raises NotImplementedError by default."""
        raise NotImplementedError(f"{type(self).__name__} makes no side inputs in unit {index}")

    @abc.abstractmethod
    def head_loss(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> HeadOutput:
        """Final norm + head + loss SUM over this microbatch's items (see ``HeadOutput``)."""

    @abc.abstractmethod
    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        """Final norm + head, returning logits as the HF model's forward would: (m, S, V) for
        causal LMs, (m, num_labels) for classifiers."""

    def head_loss_and_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                             ctx: Any) -> HeadEvalOutput:
        """``head_loss`` and ``head_logits`` together, for evaluation with predictions.

        Default: the two methods, i.e. two head passes. Adapters whose loss is a function of
        the logits override it with one pass (the HF adapters do, in ``models/hf_common.py``;
        so does ``models/toy.py``): the engine's ``evaluate`` calls it once per microbatch.
        """
        return HeadEvalOutput(self.head_loss(hidden, microbatch, ctx),
                              self.head_logits(hidden, microbatch, ctx))

    @abc.abstractmethod
    def count_items(self, microbatch: Microbatch) -> int:
        """Items ``head_loss`` will sum over for this microbatch, computed from the inputs
        alone (before any forward), so the engine can all-reduce the global count first."""

    # ---- loss terms of the whole global batch -------------------------------------------
    def global_loss_name(self) -> str | None:
        """A description of the loss term ``global_loss_sums`` carries ("the MoE router
        load-balancing loss ..."), or None (default) when the model has none."""
        return None

    def begin_step(self) -> None:
        """Called on every rank before a training step's (or evaluation's) forward phase.
        Default: nothing."""

    def global_loss_sums(self) -> torch.Tensor | None:
        """A float64 vector of sums this rank's forward phase accumulated, for a loss term that
        is not a sum over items (the MoE router loss, [Note: global router loss] in
        ``models/router_loss.py``); the engine SUM-all-reduces it over ranks after the forward
        phase and hands the total to ``finish_global_loss``. None (default): no such term. None on
        every rank or on none, and of one size on all (it depends on the config only)."""
        return None

    def finish_global_loss(self, total: torch.Tensor, grad_scale: float = 1.0) -> float:
        """The global sums; returns the term's value, added once to the step's loss. The
        layers' backward then adds its gradient times ``grad_scale`` (the loss scale)."""
        return 0.0

    def global_loss_output(self, ctx: Any = None) -> torch.Tensor | None:
        """The global-batch term as the model's own output reports it (``outputs.aux_loss``:
        the MoE router loss before its coefficient; 0-dim, no gradient), between
        ``finish_global_loss`` and ``end_step``, so a loss run in the head (TRL's) can log it:
        for the whole global batch, or with ``ctx`` (a microbatch's context) that microbatch's
        share, the term times its fraction of the rows the term runs over, so the shares of
        every microbatch of every rank add up to the term (what a 0-dim gather of the head's
        replay sums: head_calls.py). None (default): no such term, or outside that window."""
        return None

    def end_step(self) -> None:
        """Called on every rank after a step (also a failed one). Default: nothing."""

    # ---- misc -------------------------------------------------------------------------
    def prepare_for_training(self) -> None:
        """Hook run once before wrapping (e.g. force ``use_cache=False``). Default: nothing."""

    def check_microbatch_sizes(self, sizes) -> None:
        """Raise ValueError when the model cannot run microbatches of these sizes (per rank,
        the plan's m_i): called on every rank with the same plan before the engine's first
        collective, so every rank refuses alike. Default: any size."""


def run_unit_in(staged: StagedModel, index: int, hidden: torch.Tensor,
                ctx: Any) -> tuple[torch.Tensor, Any]:
    """Unit ``index`` on ``hidden`` as a forward runs it: ``(output, ctx)`` where ``ctx`` is
    the one later units read (with the side inputs the unit makes, where
    ``produces_side_inputs(index)``; else the ``ctx`` given). Output shape: see ``run_unit``."""
    if staged.produces_side_inputs(index):
        ctx = staged.produce_side_inputs(index, hidden, ctx)
    return staged.run_unit(index, hidden, ctx), ctx


def with_side_input_leaves(staged: StagedModel, ctx: Any) -> tuple[Any, list[torch.Tensor]]:
    """``(ctx', leaves)``: ``ctx`` with its side inputs replaced by fresh leaves that require
    grad, as a unit run with autograd reads them (the engine's recompute, the profiler's), so
    its backward gives each leaf its gradient; ``(ctx, [])`` for a model without side inputs.
    ``ctx`` itself unchanged."""
    leaves = [s.detach().requires_grad_(True) for s in staged.side_inputs(ctx)]
    return (staged.with_side_inputs(ctx, leaves), leaves) if leaves else (ctx, [])


class WrappedStagedModel(StagedModel):
    """A ``StagedModel`` around another one (``inner``, sharing its model): the structure
    (units, embedding and head modules, item counts, preparation) and every forward call are
    the inner adapter's; a subclass overrides only the calls it changes (autocast, emulated
    slowdown, a user loss). Any other attribute is the inner adapter's.
    """

    def __init__(self, inner: StagedModel):
        super().__init__(inner.model)
        self.inner = inner

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def units(self) -> list[nn.Module]:
        return self.inner.units()

    def embed_modules(self) -> list[nn.Module]:
        return self.inner.embed_modules()

    def head_modules(self) -> list[nn.Module]:
        return self.inner.head_modules()

    def root_modules(self) -> list[nn.Module]:
        return self.inner.root_modules()

    def count_items(self, microbatch: Microbatch) -> int:
        return self.inner.count_items(microbatch)

    def hidden_shape_changes(self) -> bool:
        return self.inner.hidden_shape_changes()

    def prepare_for_training(self) -> None:
        self.inner.prepare_for_training()

    def global_loss_name(self) -> str | None:
        return self.inner.global_loss_name()

    def global_loss_output(self, ctx: Any = None) -> torch.Tensor | None:
        return self.inner.global_loss_output(ctx)

    def begin_step(self) -> None:
        self.inner.begin_step()

    def global_loss_sums(self) -> torch.Tensor | None:
        return self.inner.global_loss_sums()

    def finish_global_loss(self, total: torch.Tensor, grad_scale: float = 1.0) -> float:
        return self.inner.finish_global_loss(total, grad_scale)

    def end_step(self) -> None:
        self.inner.end_step()

    def check_microbatch_sizes(self, sizes) -> None:
        self.inner.check_microbatch_sizes(sizes)

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Any]:
        return self.inner.embed(microbatch)

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.inner.run_unit(index, hidden, ctx)

    def side_inputs(self, ctx: Any) -> list[torch.Tensor]:
        return self.inner.side_inputs(ctx)

    def produces_side_inputs(self, index: int) -> bool:
        return self.inner.produces_side_inputs(index)

    def produce_side_inputs(self, index: int, hidden: torch.Tensor, ctx: Any) -> Any:
        return self.inner.produce_side_inputs(index, hidden, ctx)

    def with_side_inputs(self, ctx: Any, tensors: list[torch.Tensor]) -> Any:
        return self.inner.with_side_inputs(ctx, tensors)

    def head_loss(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> HeadOutput:
        return self.inner.head_loss(hidden, microbatch, ctx)

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        return self.inner.head_logits(hidden, microbatch, ctx)

    def head_loss_and_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                             ctx: Any) -> HeadEvalOutput:
        return self.inner.head_loss_and_logits(hidden, microbatch, ctx)


class AutocastStagedModel(WrappedStagedModel):
    """Delegates to ``inner`` with every forward call (``embed``, ``run_unit``, ``head_loss``,
    ``head_logits``, ``head_loss_and_logits``) under ``torch.autocast(device_type, dtype)``;
    backward stays outside, as the autocast docs prescribe
    (https://pytorch.org/docs/stable/amp.html). The engine wraps its adapter in it for
    ``autocast_dtype``, the profiler for ``precision="bf16"``, so both run the same mixed
    precision. Any other attribute is the inner adapter's.
    """

    def __init__(self, inner: StagedModel, device_type: str, dtype: torch.dtype = torch.bfloat16):
        super().__init__(inner)
        self.device_type, self.dtype = device_type, dtype

    def _amp(self):
        return torch.autocast(self.device_type, dtype=self.dtype)

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Any]:
        with self._amp():
            return self.inner.embed(microbatch)

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        with self._amp():
            return self.inner.run_unit(index, hidden, ctx)

    def produce_side_inputs(self, index: int, hidden: torch.Tensor, ctx: Any) -> Any:
        with self._amp():
            return self.inner.produce_side_inputs(index, hidden, ctx)

    def head_loss(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> HeadOutput:
        with self._amp():
            return self.inner.head_loss(hidden, microbatch, ctx)

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        with self._amp():
            return self.inner.head_logits(hidden, microbatch, ctx)

    def head_loss_and_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                             ctx: Any) -> HeadEvalOutput:
        with self._amp():
            return self.inner.head_loss_and_logits(hidden, microbatch, ctx)
