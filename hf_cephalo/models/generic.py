"""One staged model for any layer-stack Hugging Face model: the model's OWN forward around its layers.

[Note: the generic staged model]
The engine needs three calls (``embed``, ``run_unit``, ``head_loss``); a hand-written adapter
re-implements the model's forward to provide them, and so drifts from it. This adapter instead
runs ``model(**inputs)`` itself with the decoder layers swapped for stubs: ``embed`` records
each layer's arguments and the first layer's input; ``run_unit(i)`` calls layer i with exactly
those arguments; ``head_*`` runs the forward again with pass-through layers. So everything
before and after the layers is the model's own code. Three facts make this exact, each checked,
never assumed: each layer's output goes straight to the next layer (object identity, every
call), the layer arguments do not depend on parameters (none requires grad on the tiny copy),
and the head reads the embedding side only through tied weights (the self-check,
``models/self_check.py``). A vision-language model is staged for text-only fine-tuning of its
language model where its own forward on text runs one layer stack and is a causal LM's: its
never-called towers sit on the head side, untrained, and a microbatch with their inputs
(``pixel_values``) is refused (``GenericDecoderBody.check_inputs``). Details:
docs/adding_a_model.md, "The generic path".
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hf_cephalo.models.base import Microbatch, staged_call
from hf_cephalo.models.generic_outputs import (BAD_FORM, FakeLayerChain, call_layer, check_streams,
                                              form_problem, has_plain_extras, layer_form,
                                              parameter_shapes, traced_forward, wrap_output)
from hf_cephalo.models.generic_repeats import (check_order, run_repeated, runs_in_order,
                                              stop_after_layers)
from hf_cephalo.models.hf_common import (CausalLMStagedModel, ClassifierStagedModel,
                                         HFStagedModel, LastTokenClassifierStagedModel,
                                         OwnParameters, check_poolable, pad_token_id_of,
                                         require_key)
from hf_cephalo.models.kv_sharing import (KVSharing, made_tensors, shared_call, store_layers,
                                          written)
from hf_cephalo.models.router_loss import (AttachRouterGrad, RouterLoss, router_coef_name,
                                           router_spec)

NOT_MODEL_INPUTS = frozenset({"labels", "return_dict", "output_attentions", "output_hidden_states",
                              "output_router_logits", "use_cache", "cache", "past_key_values",
                              "inputs_embeds", "logits_to_keep", "num_items_in_batch",
                              "return_loss", "cache_position", "start_positions",
                              "end_positions"})
"""Forward parameters never taken from a microbatch (the staged model sets or drops them)."""


class StructureError(ValueError):
    """The model's forward does something the generic path cannot stage (the message says what).

    causal_lm: True when the self-check found the class's own forward on text to be a causal
    LM's (``causal_check.causal_lm_problem``) before the staging failed; False otherwise."""

    causal_lm: bool = False


class NotCausalLMError(StructureError):
    """The class's own forward on text (``input_ids``, ``attention_mask``, ``labels``) does not
    return a causal LM's output: logits over the vocabulary and the next-token loss of them
    (labels shifted by one, or taken as given)."""


class TextOnlyInputError(ValueError):
    """A microbatch carries inputs of a tower the staged model does not run (``pixel_values``
    for a vision-language model staged for text-only fine-tuning)."""


class _Stop(Exception):
    """Raised inside a stub to end the model's forward early (not an error)."""


@dataclass(frozen=True)
class Layout:
    """Where the generic staged model finds each part of a model (relative module names).

    layers: the layer ``ModuleList``'s name (``"model.layers"``).
    embed: parameter- or buffer-holding modules called before the first layer.
    head: those called after the last layer (a module in both lists is a tied use).
    embed_only: parameter-holding modules called before the first layer only; the head pass
        stubs them (their unit is not gathered then).
    output_len: None when a layer returns its hidden states; k when it returns a k-tuple (or
        list) with the hidden states first; a key when it returns a dict holding only them,
        under that key (SqueezeBERT's ``"feature_map"``; ``generic_outputs.layer_form``). Stub layers return the other k - 1 entries as None
        (attention weights, cache entries the model reads only when asked for them): where
        the model's forward would use one of them, the self-check's comparison differs or
        fails, and the class is refused.
    plain_head: the logits are exactly ``get_output_embeddings()`` of its input (no scaling or
        softcapping after it), so ``output_head()`` may stand for the whole head; where not,
        only ``output_projection()`` is answered (TRL's fused log-probabilities apply the
        config's scaling and softcapping themselves, as on stock).
    inputs: the forward inputs of the traced (checked) microbatch (``input_ids``,
        ``attention_mask``).
    unused: the outermost parameter-holding modules the traced forward never called (a
        vision-language model's vision tower and projector on text): on the head side, never
        trained. Where there are some, a microbatch may carry only ``inputs`` and
        ``position_ids`` (``GenericDecoderBody.check_inputs``): another input (``pixel_values``)
        would run a module the layout never placed.
    label_shift: a causal LM's own loss scores position t against ``labels[t + 1]`` (True,
        ``ForCausalLMLoss``) or against ``labels[t]`` (False: the causal LMs of transformers'
        encoder-decoder families, ``BartForCausalLM`` and its kin, whose callers shift the
        labels); decided from what the loss computes (``causal_check.causal_lm_problem``).
    side: the layer arguments computed from parameters before the layers (side inputs:
        Gemma 3n's per-layer inputs), as (layer index, positional index or keyword) pairs,
        found by the self-check on the tiny copy (``side_arguments``); the engine carries
        their gradient back into the embedding unit ([Note: side inputs] in engine/schedule.py).
    """

    layers: str
    embed: tuple[str, ...]
    head: tuple[str, ...]
    embed_only: tuple[str, ...]
    output_len: int | str | None
    plain_head: bool = False
    inputs: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()
    label_shift: bool = True
    side: tuple[tuple[int, int | str], ...] = ()
    plain_extras: bool = False
    """A layer returns, after its hidden states, plain data (numbers) the forward reads (a
    hierarchical stage's output dimensions, which Swin V2, Donut-Swin and FocalNet turn into
    the next stage's ``input_dimensions``): the stubs return it as the real layer would, from a
    run of the layers on fake tensors (shapes only: no compute, no random numbers;
    ``generic_outputs.FakeLayerChain``); every other entry stays None."""
    kv: KVSharing | None = None
    """Layers that store keys / values later layers read (KV sharing: Gemma 3n, Gemma 4 with
    num_kv_shared_layers > 0), found by the self-check; they make side inputs
    ([Note: KV sharing as made side inputs] in models/kv_sharing.py)."""
    reshapes: bool = False
    """Some layer (a hierarchical backbone's stage) returns hidden states of another shape
    than its input's, on the tiny copy (``StagedModel.hidden_shape_changes``)."""
    repeats: bool = False
    """The forward calls a layer several times in a row (ALBERT's shared layer group): a unit
    runs its layer once per recorded call ([Note: repeated layer calls])."""


@dataclass
class GenericContext:
    """Per-microbatch layer arguments recorded by ``embed`` (never differentiated).

    calls: per layer, (positional arguments after the hidden states, keyword arguments).
    stub_shapes: per embedding-only module, the (shape, dtype) tree of its output.
    """

    calls: list[tuple[tuple, dict]]
    stub_shapes: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    origin: int | None = None  # ``key`` of the ctx this one copies (``with_side_inputs``)
    made: tuple = ()  # (store layer, key, (k, v)): what the store layers made (KV sharing)

    @property
    def key(self) -> int:
        """The microbatch's identity: the same for a copy made by ``with_side_inputs``."""
        return id(self) if self.origin is None else self.origin


class _Stub(nn.Module):
    """Stands in for a module during one forward: calls ``fn(*args, **kwargs)``; any other
    attribute is the real module's (``decoder_layer.attention_type``), and so are its
    parameters: a forward that reads ``next(self.parameters()).dtype`` finds them even when
    every module holding parameters is stubbed (OpenAI GPT's body in the head pass)."""

    def __init__(self, real: nn.Module, fn: Callable):
        super().__init__()
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_fn", fn)
        self._modules["stubbed"] = real

    def forward(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)


@contextlib.contextmanager
def swapped(model: nn.Module, replacements: dict[str, nn.Module]) -> Iterator[None]:
    """Swap submodules by name (``"model.layers.3"``) for the ``with`` block, then restore."""
    saved = []
    try:
        for name, new in replacements.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            saved.append((parent, child, parent._modules[child]))
            parent._modules[child] = new
        yield
    finally:
        for parent, child, old in reversed(saved):
            parent._modules[child] = old


def split_hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, tuple, dict]:
    """A layer call's hidden states (first positional, or ``hidden_states=``) and the rest."""
    if args:
        return args[0], tuple(args[1:]), dict(kwargs)
    kwargs = dict(kwargs)
    if "hidden_states" not in kwargs:
        raise StructureError("the model calls its layers without hidden states as the first "
                             "argument or as hidden_states=")
    return kwargs.pop("hidden_states"), (), kwargs


def whole_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is a view of all of ``b``'s elements as ``b`` lays them out (Gemma 4's
    ``hidden[:, 0:]`` before its first KV-sharing layer, ``logits_to_keep=0``): the same
    values, and the same gradient path."""
    base = a._base
    return torch.is_tensor(b) and base is not None and (base is b or base is b._base) and \
        a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def forward_inputs(model: nn.Module, microbatch: Microbatch) -> dict[str, Any]:
    """The microbatch's keys the model's ``forward`` takes as inputs (labels never: the loss is
    computed as a sum by the staged model). Cached per model class."""
    names = _forward_params(type(model))
    return {k: v for k, v in microbatch.items() if k in names and v is not None}


_PARAMS: dict[type, frozenset] = {}


def _forward_params(cls: type) -> frozenset:
    if cls not in _PARAMS:
        params = inspect.signature(cls.forward).parameters
        _PARAMS[cls] = frozenset(n for n, p in params.items()
                                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                                 and n != "self") - NOT_MODEL_INPUTS
    return _PARAMS[cls]


def _shape_tree(out: Any) -> Any:
    return pytree.tree_map(lambda t: (t.shape, t.dtype, t.device) if torch.is_tensor(t) else t,
                           out)


def _zeros_tree(tree: Any) -> Any:
    return pytree.tree_map(
        lambda s: torch.zeros(s[0], dtype=s[1], device=s[2])
        if isinstance(s, tuple) and len(s) == 3 and isinstance(s[0], torch.Size) else s,
        tree, is_leaf=lambda s: isinstance(s, tuple) and len(s) == 3
        and isinstance(s[0], torch.Size))


class GenericDecoderBody(HFStagedModel):
    """Units = the model's layers; ``embed`` / head passes = the model's own forward around them.

    Built from a ``Layout`` (``models/self_check.py`` finds it on a tiny copy of the model and
    proves the staging exact there first). Microbatch keys: whatever the model's ``forward``
    takes (``input_ids`` (m, S), ``attention_mask`` (m, S), ``position_ids`` (m, S), ...), and
    ``labels`` for the loss.
    """

    def __init__(self, model: nn.Module, layout: Layout):
        self.layout = layout
        self._layers = model.get_submodule(layout.layers)
        self._layer_shapes = [parameter_shapes(layer) for layer in self._layers] \
            if layout.plain_extras else []
        self._stores = store_layers(self._layers, layout.kv)
        self._writes: list = []  # what the last layer run wrote into its shared dict
        self._made_out: tuple | None = None  # (store layer, input, grad mode, its output)
        self._own: dict[str, OwnParameters] = {}  # _root_module's, by name
        super().__init__(model)

    # ---- structure ----
    def units(self) -> list[nn.Module]:
        return list(self._layers)

    def embed_modules(self) -> list[nn.Module]:
        return [self._root_module(n) for n in self.layout.embed]

    def head_modules(self) -> list[nn.Module]:
        return [self._root_module(n) for n in self.layout.head]

    def _root_module(self, name: str) -> nn.Module:
        """The module ``name`` of the layout's embedding or head side, or, where it contains the
        layers (XLNet's ``transformer`` holds ``mask_emb`` itself), its own entries only
        (``OwnParameters``, one per name): its parameters() would include the units'."""
        module = self.model.get_submodule(name)
        if name and not (self.layout.layers + ".").startswith(name + "."):
            return module
        if name not in self._own:
            self._own[name] = OwnParameters(module)
        return self._own[name]

    # ---- the forward with stubs ----
    def _layer_names(self) -> list[str]:
        return [f"{self.layout.layers}.{i}" for i in range(len(self._layers))]

    def _run(self, microbatch: Microbatch, stubs: dict[str, nn.Module], **extra) -> Any:
        inputs = forward_inputs(self.model, microbatch)
        with swapped(self.model, stubs), staged_call():
            try:
                return self.model(**inputs, **extra)
            except _Stop:
                return None

    def check_inputs(self, microbatch: Microbatch) -> None:
        """TextOnlyInputError when the self-check's forward left modules uncalled
        (``Layout.unused``: a vision-language model staged for text-only fine-tuning) and the
        microbatch carries a forward input other than the checked ones and ``position_ids``
        (``pixel_values``, ``token_type_ids``, ...): it would run a module the staging never
        placed, or change the forward in a way the check never saw."""
        if not self.layout.unused:
            return
        allowed = set(self.layout.inputs) | {"position_ids"}
        extra = sorted(k for k in forward_inputs(self.model, microbatch) if k not in allowed)
        if extra:
            name = type(self.model).__name__
            raise TextOnlyInputError(
                f"{name} is staged for text-only fine-tuning of its language model: its own "
                f"forward on {', '.join(sorted(allowed))} runs one layer stack and never calls "
                f"{', '.join(self.layout.unused)}, and the staging is proven exact for that "
                f"forward only. This microbatch also carries {', '.join(extra)}, which the "
                f"staged model does not run (images, audio or other non-text inputs are not "
                f"supported). Drop {'these keys' if len(extra) > 1 else 'that key'} from the "
                f"batch (text-only data; e.g. the tokenizer's output instead of the "
                f"processor's), or train the multimodal model through a hand-written adapter "
                f"(docs/adding_a_model.md).")

    def count_items(self, microbatch: Microbatch) -> int:
        """The head's item count, after ``check_inputs``: the engine counts items before a
        step's first collective, so a microbatch the staged model would refuse is refused
        before this rank all-gathers anything."""
        self.check_inputs(microbatch)
        return super().count_items(microbatch)

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, GenericContext]:
        """The model's forward up to its first layer: hidden (m, S, H) (an image model's
        (m, patches, H) or feature map) and every layer's arguments (``GenericContext``).
        ValueError without the model's ``main_input_name`` (``input_ids``, ``pixel_values``)."""
        require_key(microbatch, getattr(self.model, "main_input_name", None) or "input_ids",
                    type(self).__name__)
        self.check_inputs(microbatch)
        L = len(self._layers)
        calls: list[tuple[int, tuple, dict]] = []  # (layer, args, kwargs) in call order
        first: list[torch.Tensor] = []
        shapes: dict[str, Any] = {}
        chains: list[FakeLayerChain] = []
        layers = list(self._layers)  # the real ones (the forward runs stubs in their place)
        extras: list[tuple] = []

        def recorder(i: int) -> Callable:
            def record(*args, **kwargs):
                hidden, rest, kw = split_hidden(args, kwargs)
                if not first:
                    first.append(hidden)
                elif hidden is not first[0] and not whole_view(hidden, first[0]):
                    raise StructureError(
                        f"the forward of {type(self.model).__name__} changes the hidden states "
                        f"between layers {calls[-1][0]} and {i}; the generic path runs layer "
                        "after layer and cannot stage it")
                calls.append((i, rest, kw))
                if self.layout.plain_extras:
                    if not chains:
                        chains.append(FakeLayerChain(hidden))
                    extras.append(chains[0].step(layers[i], (rest, kw), self._layer_shapes[i]))
                if i == L - 1 and not self.layout.repeats:
                    raise _Stop
                return wrap_output(hidden, self.layout.output_len,
                                   extras[-1] if extras else None)
            return record

        def shape_recorder(name: str, real: nn.Module) -> Callable:
            def record(*args, **kwargs):
                out = real(*args, **kwargs)
                shapes[name] = _shape_tree(out)
                return out
            return record

        stubs = {n: _Stub(self._layers[i], recorder(i)) for i, n in enumerate(self._layer_names())}
        for name in self.layout.embed_only:
            real = self.model.get_submodule(name)
            stubs[name] = _Stub(real, shape_recorder(name, real))
        stop = stop_after_layers(self.model, self.layout.layers, lambda: bool(calls), _Stop) \
            if self.layout.repeats else contextlib.nullcontext()
        with stop:
            self._run(microbatch, stubs, **self.forward_extra(microbatch))
        per = [[(a, k) for j, a, k in calls if j == i] for i in range(L)]
        if not runs_in_order([j for j, _, _ in calls], L) or \
                (len(calls) != L and not self.layout.repeats):
            raise StructureError(f"the forward of {type(self.model).__name__} called its "
                                 f"{L} layers in the order {[j for j, _, _ in calls][:12]}")
        extra = {"layer_extras": extras} if extras else {}
        if self.layout.repeats:
            extra["repeat_calls"] = per
        return first[0], GenericContext([p[0] for p in per], shapes, extra)

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: GenericContext) -> torch.Tensor:
        """Layer ``index`` with the arguments the model's forward gave it: (m, S, H) -> same.
        With KV sharing its shared dict is a fresh one holding what the store layers before it
        made; a store layer's output in the call right after its ``produce_side_inputs``, on
        the same input, is the one that call computed ([Note: KV sharing as made side
        inputs]); any other call drops it."""
        kept, self._made_out = self._made_out, None
        if kept is not None and kept[0] == index and kept[1] is hidden and \
                kept[2] == torch.is_grad_enabled():
            return kept[3]
        if self.layout.repeats:
            return run_repeated(self._layers[index], hidden, ctx.extra["repeat_calls"][index],
                                self.layout.output_len)
        if self.layout.kv is None:
            return call_layer(self._layers[index], hidden, ctx.calls[index],
                              self.layout.output_len)
        call, fresh, given = shared_call(self.layout.kv, ctx.calls[index], index, ctx.made)
        out = call_layer(self._layers[index], hidden, call, self.layout.output_len)
        self._writes = written(given, fresh)
        if self._writes and index not in self._stores:
            raise StructureError(f"layer {index} of {type(self.model).__name__} wrote keys / "
                                 "values into the dict the layers share, but it is not marked "
                                 f"as a store layer ({self.layout.kv.marker} is not True)")
        return out

    def produces_side_inputs(self, index: int) -> bool:
        """Whether layer ``index`` stores keys / values later layers read (KV sharing)."""
        return index in self._stores

    def produce_side_inputs(self, index: int, hidden: torch.Tensor,
                            ctx: GenericContext) -> GenericContext:
        """Run store layer ``index`` on ``hidden`` (``run_unit``) and return ``ctx`` with the
        keys / values it wrote appended to ``made`` (side inputs of the later layers), its
        output kept for a ``run_unit`` on the same input right after."""
        self._writes = []
        out = self.run_unit(index, hidden, ctx)
        if not self._writes:
            raise StructureError(f"layer {index} of {type(self.model).__name__} is marked as a "
                                 f"store layer ({self.layout.kv.marker}) but wrote no keys / "
                                 "values into the dict the layers share")
        made = ctx.made + tuple((index, key, value) for key, value in self._writes)
        self._made_out = (index, hidden, torch.is_grad_enabled(), out)
        return GenericContext(ctx.calls, ctx.stub_shapes, ctx.extra, origin=ctx.key, made=made)

    def hidden_shape_changes(self) -> bool:
        return self.layout.reshapes

    def side_slots(self, ctx: GenericContext) -> list[tuple[int, int | str]]:
        """(layer index, positional index or keyword) of every side input argument of THIS
        model's layer calls: each argument ``Layout.side`` names in any layer of the tiny
        copy, in every layer that takes it. The tiny copy has fewer layers than the model
        (one of each per-layer pattern), so its layer indices do not name the model's: a
        Gemma 4 E with layer types [s, f, s, f] has a 2-layer copy, and its layers 2 and 3
        read per-layer inputs too (taken by index, their gradients were dropped)."""
        keys = dict.fromkeys(key for _, key in self.layout.side)
        return [(i, key) for i, (args, kwargs) in enumerate(ctx.calls) for key in keys
                if (key < len(args) if isinstance(key, int) else key in kwargs)]

    def side_inputs(self, ctx: GenericContext) -> list[torch.Tensor]:
        """The floating tensors of the side input arguments (``side_slots``; per-layer
        inputs: (m, S, P) each) in layer order, then those the store layers made (KV sharing:
        keys / values (m, heads, S, D)) in making order, each once (a tensor several layers
        read is one side input)."""
        out: list[torch.Tensor] = []
        seen: set[int] = set()
        found = [t for i, key in self.side_slots(ctx) for t in pytree.tree_leaves(
            ctx.calls[i][0][key] if isinstance(key, int) else ctx.calls[i][1][key])]
        for t in [*found, *made_tensors(ctx.made)]:
            if torch.is_tensor(t) and t.is_floating_point() and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    def with_side_inputs(self, ctx: GenericContext,
                         tensors: list[torch.Tensor]) -> GenericContext:
        """A copy of ``ctx`` whose side input arguments (``side_slots``) read ``tensors`` in
        place of ``side_inputs(ctx)``; every other argument is the same object (a dict the
        layers share stays shared)."""
        new = {id(old): t for old, t in zip(self.side_inputs(ctx), tensors)}
        calls = [(tuple(args), dict(kwargs)) for args, kwargs in ctx.calls]
        for i, key in self.side_slots(ctx):
            args, kwargs = calls[i]
            value = args[key] if isinstance(key, int) else kwargs[key]
            value = pytree.tree_map(lambda t: new.get(id(t), t), value)
            if isinstance(key, int):
                calls[i] = (args[:key] + (value,) + args[key + 1:], kwargs)
            else:
                kwargs[key] = value
        made = tuple((i, k, pytree.tree_map(lambda t: new.get(id(t), t), v))
                     for i, k, v in ctx.made)
        return GenericContext(calls, ctx.stub_shapes, ctx.extra, origin=ctx.key, made=made)

    def forward_extra(self, microbatch: Microbatch) -> dict[str, Any]:
        """Keyword arguments every staged forward passes (``use_cache=False`` where taken)."""
        return {"use_cache": False} if "use_cache" in inspect.signature(
            type(self.model).forward).parameters else {}

    def head_forward(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: GenericContext,
                     stop_at: nn.Module | None = None) -> Any:
        """The model's forward with every layer a pass-through and the last one returning
        ``hidden``: the model's output object (its ``logits``). With ``stop_at``, returns the
        input of that module (the final hidden states before the output projection) instead."""
        L = len(self._layers)
        extras = ctx.extra.get("layer_extras")

        def passer(i: int) -> Callable:
            def run(*args, **kwargs):
                h, _, _ = split_hidden(args, kwargs)
                return wrap_output(hidden if i == L - 1 else h, self.layout.output_len,
                                   extras[i] if extras else None)
            return run

        stubs = {n: _Stub(self._layers[i], passer(i)) for i, n in enumerate(self._layer_names())}
        for name in self.layout.embed_only:
            tree = ctx.stub_shapes[name]
            stubs[name] = _Stub(self.model.get_submodule(name),
                                lambda *a, _t=tree, **k: _zeros_tree(_t))
        captured: list[torch.Tensor] = []
        handle = None
        if stop_at is not None:
            def grab(module, args, kwargs):
                captured.append(args[0] if args else next(iter(kwargs.values())))
                raise _Stop
            handle = stop_at.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            out = self._run(microbatch, stubs, **self.forward_extra(microbatch))
        finally:
            if handle is not None:
                handle.remove()
        return captured[0] if stop_at is not None else out


class GenericCausalLM(GenericDecoderBody, CausalLMStagedModel):
    """A causal LM (``...ForCausalLM``) on the generic path: logits from the model's own head
    code (final norm, scaling, softcapping), the summed next-token loss of ``labels`` (m, S),
    and with ``config.output_router_logits`` the router load-balancing loss of the global batch
    ([Note: global router loss]).

    The router loss is added when ``output_router_logits`` is set and the model declares its
    router output (``_can_record_outputs``) and has ``num_experts``, ``num_experts_per_tok``
    and a coefficient (``router_aux_loss_coef``; JetMoE's ``aux_loss_coef``: ``ROUTER_COEFS``)
    (what transformers' MoE causal LMs compute it from), or its
    text config has them (a vision-language MoE on text, ``Qwen3_5MoeForConditionalGeneration``);
    a model
    whose own loss adds another router term fails the self-check and is refused.
    """

    def __init__(self, model: nn.Module, layout: Layout):
        super().__init__(model, layout)
        self.router: RouterLoss | None = None
        spec = router_spec(model)
        text = model.config.get_text_config()
        # the attributes transformers' MoE causal LMs compute their router loss from, on the
        # model, else (a vision-language model's, on text) on its text config; a class with
        # neither adds no router loss, or one the self-check finds unequal
        source = next((s for s in (model, text) if all(
            isinstance(getattr(s, a, None), (int, float))
            for a in ("num_experts", "num_experts_per_tok")) and router_coef_name(s)), None)
        if getattr(text, "output_router_logits", False) and spec and source is not None:
            self.router = RouterLoss(source, *spec)
            self._routers = [[m for m in layer.modules() if isinstance(m, spec[0])]
                             for layer in self._layers]

    @property
    def label_shift(self) -> bool:  # type: ignore[override]
        """The layout's: whether the model's own loss shifts its labels (``Layout.label_shift``)."""
        return self.layout.label_shift

    def forward_extra(self, microbatch: Microbatch) -> dict[str, Any]:
        extra = super().forward_extra(microbatch)
        if "output_router_logits" in inspect.signature(type(self.model).forward).parameters:
            extra["output_router_logits"] = False  # the global router loss is added apart
        return extra

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, GenericContext]:
        hidden, ctx = super().embed(microbatch)
        mask = microbatch.get("attention_mask")
        ctx.extra["router_mask"] = None if mask is None else mask.reshape(-1)
        return hidden, ctx

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: GenericContext) -> torch.Tensor:
        router = self.router
        if router is None or not (router.collecting or router.total is not None):
            return super().run_unit(index, hidden, ctx)
        logits: list[torch.Tensor] = []
        handles = [m.register_forward_hook(lambda mod, a, out: logits.append(router.logits_of(out)))
                   for m in self._routers[index]]
        try:
            out = super().run_unit(index, hidden, ctx)
        finally:
            for h in handles:
                h.remove()
        mask = ctx.extra.get("router_mask")
        if router.collecting and (index, ctx.key) not in router.seen:
            router.seen.add((index, ctx.key))
            for z in logits:
                router.add(z, mask, ctx.key)
        grads = [z for z in logits if z.requires_grad]
        if torch.is_grad_enabled() and grads:
            out = AttachRouterGrad.apply(out, router, mask, *grads)
        return out

    def global_loss_name(self) -> str | None:
        if self.router is None:
            return None
        return (f"the MoE router load-balancing loss (config.output_router_logits=True, "
                f"{self.router.coef_name}={self.router.coef})")

    def begin_step(self) -> None:
        if self.router is not None:
            self.router.begin_step()

    def global_loss_sums(self) -> torch.Tensor | None:
        return None if self.router is None else self.router.sums.clone()

    def finish_global_loss(self, total: torch.Tensor, grad_scale: float = 1.0) -> float:
        return 0.0 if self.router is None else self.router.finish(total, grad_scale)

    def global_loss_output(self, ctx: Any = None) -> torch.Tensor | None:
        if self.router is None or self.router.total is None:
            return None
        value = self.router.aux if ctx is None else self.router.share(ctx.key)
        return torch.tensor(value, dtype=torch.float32)

    def end_step(self) -> None:
        if self.router is not None:
            self.router.collecting, self.router.total = False, None

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                    ctx: GenericContext) -> torch.Tensor:
        """(m, S, H) -> logits (m, S, V), as ``model(**microbatch).logits``."""
        return self.head_forward(hidden, microbatch, ctx).logits

    def final_hidden(self, hidden: torch.Tensor, microbatch: Microbatch,
                     ctx: GenericContext) -> torch.Tensor:
        """The input of the output projection: (m, S, H), after the final norm."""
        return self.head_forward(hidden, microbatch, ctx, stop_at=self.output_projection())

    def output_projection(self) -> nn.Module:
        """``get_output_embeddings()``, whatever the model does to its output afterwards: for a
        loss that applies the config's logit scaling / softcapping itself (TRL's fused head,
        as stock TRL does on the model's own backbone output)."""
        return self.model.get_output_embeddings()

    def output_head(self) -> nn.Module:
        """``get_output_embeddings()`` when the logits are exactly its output; ValueError for a
        model that transforms its logits after it (softcapping, scaling)."""
        if not self.layout.plain_head:
            raise ValueError(f"{type(self.model).__name__} transforms its logits after the output "
                             "projection (logit scaling or softcapping), so they cannot be "
                             "computed from the projection alone; use a loss on the logits "
                             "instead (e.g. TRL's use_liger_kernel / fused log-probs off).")
        return self.model.get_output_embeddings()


class GenericEncoderClassifier(GenericDecoderBody, ClassifierStagedModel):
    """A sequence classifier that pools by position (BERT-style [CLS] pooler): the model's own
    head, the summed classification loss of ``labels`` (m,) (or (m, num_labels) for regression /
    multi-label)."""

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                    ctx: GenericContext) -> torch.Tensor:
        """(m, S, H) -> logits (m, num_labels), as ``model(**microbatch).logits``."""
        return self.head_forward(hidden, microbatch, ctx).logits


class GenericSequenceClassifier(GenericDecoderBody, LastTokenClassifierStagedModel):
    """A decoder sequence classifier (``GenericForSequenceClassification`` and the like): the
    model's own head (final norm, score, last-non-pad pooling), the summed classification loss
    of ``labels`` (m,) (or (m, num_labels) for regression / multi-label)."""

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                    ctx: GenericContext) -> torch.Tensor:
        """(m, S, H) -> pooled logits (m, num_labels), as ``model(**microbatch).logits``."""
        input_ids = require_key(microbatch, "input_ids", type(self).__name__)
        check_poolable(input_ids, pad_token_id_of(self.model.config), type(self.model).__name__)
        return self.head_forward(hidden, microbatch, ctx).logits


class ParameterReads(torch.overrides.TorchFunctionMode):
    """While active, records which modules of ``modules`` ((name, module) pairs) have their own
    parameter read by an op, before the first layer or after (``after_layers()``), so that
    ``place_uncalled`` can place the modules never called: SigLIP 2's embeddings read
    ``position_embedding.weight`` and resize it, never calling the embedding. Such a module
    belongs to the side of the layers where it is read, as a called one does (``trace_layout``);
    otherwise the engine would not gather it with that side's unit."""

    def __init__(self, modules: list[tuple[str, nn.Module]], after_layers: Callable[[], bool]):
        super().__init__()
        self._owner = {id(p): name for name, m in modules for p in m.parameters(recurse=False)}
        self._after_layers = after_layers
        self.read: tuple[set[str], set[str]] = (set(), set())  # before / after the layers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            name = self._owner.get(id(leaf)) if isinstance(leaf, nn.Parameter) else None
            if name is not None:
                self.read[self._after_layers()].add(name)
        return func(*args, **kwargs)

    def place_uncalled(self, before: set[str], after: set[str]) -> None:
        """Add to ``before`` / ``after`` (the called modules' names, by side) the modules never
        called whose parameter was read on that side. (A parameter two modules hold, a tied
        embedding, is recorded under one of them: both are called, so nothing changes.)"""
        called = before | after
        before |= self.read[0] - called
        after |= self.read[1] - called


def module_partition(model: nn.Module, layers: nn.ModuleList) -> list[tuple[str, nn.Module]]:
    """The modules outside ``layers`` holding parameters or buffers directly, by name."""
    inside = {id(m) for m in layers.modules()}
    return [(n, m) for n, m in model.named_modules()
            if id(m) not in inside and (next(m.parameters(recurse=False), None) is not None
                                        or next(m.buffers(recurse=False), None) is not None)]


def trace_layout(model: nn.Module, microbatch: Microbatch, layers_name: str) -> Layout:
    """Run ``model(**inputs)`` once (no grad) with forward hooks on every module outside the
    layers, and sort them by when they run: before the first layer (embedding side) or after
    the last (head side). A parameter-holding module never called goes to the head side (it
    gets no gradient, as in the model; ``Layout.unused`` names the outermost ones). The head
    pass stubs the largest modules that run before the first layer only (so their dropout
    draws no random numbers twice). Also records the layers' output form and the forward
    inputs it ran on (``Layout.inputs``).

    Raises StructureError when the layers are not called in order, each once, or return
    something other than their hidden states.
    """
    layers = model.get_submodule(layers_name)
    order: list[int] = []
    output_len: list[Any] = []  # per call: ``layer_form`` of its output
    plain: list[bool] = []
    seen: list[tuple] = []  # per layer call: (its hidden states input, its output, args, kwargs)
    before: set[str] = set()
    after: set[str] = set()
    called_at: list[int] = []  # per module call: how many layer calls came before it
    handles = []

    def on_layer(i):
        def hook(module, args, kwargs, out):
            order.append(i)
            seen.append((args[0] if args else kwargs.get("hidden_states"), out, args, kwargs))
            output_len.append(layer_form(out))  # a tuple's extras: None in the stubs (Layout)
            plain.append(has_plain_extras(out))
        return hook

    def on_module(name):
        def hook(module, args, out):
            (after if order else before).add(name)
            called_at.append(len(order))
        return hook

    inside = {id(m) for m in layers.modules()}
    outside = [(n, m) for n, m in model.named_modules()
               if n and id(m) not in inside and not (layers_name + ".").startswith(n + ".")]
    for i, layer in enumerate(layers):
        handles.append(traced_forward(layer, on_layer(i)))
    for name, module in outside:
        handles.append(module.register_forward_hook(on_module(name)))
    reads = ParameterReads(outside, lambda: bool(order))
    try:
        with torch.no_grad(), reads:
            model(**forward_inputs(model, microbatch))
    finally:
        for h in handles:
            h.remove()
    called = before | after  # embed_only: called modules only (a stub stands in for calls)
    reads.place_uncalled(before, after)
    check_order(type(model).__name__, order, len(layers), called_at, StructureError)
    check_streams(type(model).__name__, seen, StructureError, [layers[j] for j in order])
    if BAD_FORM in output_len:
        raise StructureError(form_problem(model, seen, output_len.index(BAD_FORM)))
    if len(set(output_len)) != 1:
        raise StructureError(f"the layers of {type(model).__name__} return different forms")
    parts = module_partition(model, layers)
    has_params = {n for n, m in parts if next(m.parameters(recurse=False), None) is not None}
    embed = [n for n, _ in parts if n in before]
    head = [n for n, _ in parts if n in after or (n in has_params and n not in before)]
    only_before = {n for n, _ in outside if n in before & called and n not in after and not any(
        a.startswith(n + ".") for a in after)}
    embed_only = [n for n in only_before if not any(n.startswith(o + ".") for o in only_before)]
    quiet = {n for n, m in outside if n not in before and n not in after
             and next(m.parameters(), None) is not None}
    unused = sorted(n for n in quiet if not any(n.startswith(o + ".") for o in quiet))
    return Layout(layers_name, tuple(embed), tuple(head), tuple(sorted(embed_only)),
                  output_len[0], inputs=tuple(sorted(forward_inputs(model, microbatch))),
                  unused=tuple(unused), plain_extras=any(plain),
                  repeats=order != list(range(len(layers))))
