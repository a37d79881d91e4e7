"""What the generic path reads from its layers' outputs beyond their hidden states.

``Layout.plain_extras`` in models/generic.py: a layer (a hierarchical stage) that returns,
after its hidden states, plain data the model's forward reads (Swin V2's output dimensions)
gets it back from its stub as the real layer would, from a run of the layers on fake tensors
(``FakeLayerChain``); ``form_problem`` says why an output of another form cannot be staged.
A layer's output form (``layer_form``): its hidden states, a tuple or list with them first, or
a dict with them as its one entry (SqueezeBERT's ``{"feature_map": hidden}``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


BAD_FORM = object()
"""``layer_form`` of an output the generic path cannot stage (``form_problem`` says why)."""


def layer_form(out: Any) -> Any:
    """The form of a layer's output: None (its hidden states), k (a k-tuple or list with the
    hidden states first), a key (a dict whose one entry, under that key, is the hidden states),
    else ``BAD_FORM``."""
    if isinstance(out, torch.Tensor):
        return None
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return len(out)
    if type(out) is dict and len(out) == 1 and torch.is_tensor(next(iter(out.values()))):
        return next(iter(out))
    return BAD_FORM


def hidden_of(out: Any, form: Any) -> torch.Tensor:
    """The hidden states in a layer's output of form ``form`` (``layer_form``)."""
    return out if form is None else out[form if isinstance(form, str) else 0]


def wrap_output(hidden: torch.Tensor, form: Any, extras: tuple | None = None):
    """What a layer of form ``form`` returns, given its hidden states: the tensor, or
    (hidden, None, ...), or (hidden, *extras) (``layer_extras``), or {key: hidden}."""
    if form is None:
        return hidden
    if isinstance(form, str):
        return {form: hidden}
    return (hidden,) + (extras if extras is not None else (None,) * (form - 1))


def call_layer(layer: nn.Module, hidden: torch.Tensor, call: tuple[tuple, dict],
               form: Any) -> torch.Tensor:
    """Layer ``layer`` on ``hidden`` with the recorded arguments ``call`` (positional, keyword),
    its output of form ``form``: (m, S, H) -> (m, S, H)."""
    args, kwargs = call
    return hidden_of(layer(hidden, *args, **kwargs), form)


class _Undo:
    def __init__(self, undo: Any):
        self.remove = undo


def traced_forward(layer: nn.Module, hook: Any) -> _Undo:
    """Call ``hook(layer, args, kwargs, out)`` after every run of ``layer``'s forward, whether
    the model calls the layer (``layer(...)``) or its ``forward`` directly (SqueezeBERT's
    encoder does: a module hook would not see that call); returns a handle whose ``remove()``
    undoes it (restoring an instance ``forward`` the layer had)."""
    had = layer.__dict__.get("forward")
    real = layer.forward

    def forward(*args, **kwargs):
        out = real(*args, **kwargs)
        hook(layer, args, kwargs, out)
        return out

    def undo():
        if had is None:
            layer.__dict__.pop("forward", None)
        else:
            layer.__dict__["forward"] = had

    layer.forward = forward
    return _Undo(undo)


def _plain(value: Any) -> bool:
    """Plain data: numbers (ints, floats, bools) in tuples, lists or dicts, nothing else (no
    tensor, no cache object)."""
    leaves = pytree.tree_leaves(value)
    return value is not None and bool(leaves) and all(
        isinstance(v, (bool, int, float)) for v in leaves)


def has_plain_extras(out: Any) -> bool:
    """A layer's output (a tuple or list) carries plain data (``_plain``) after its hidden
    states (a stage's output dimensions)."""
    return isinstance(out, (tuple, list)) and any(_plain(e) for e in out[1:])


def parameter_shapes(layer: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{name: (shape, dtype)} of a layer's parameters, taken while they are whole: the engine
    later holds them as shards, or as views of a freed buffer, between its gathers."""
    return {n: (p.shape, p.dtype) for n, p in layer.named_parameters()}


class FakeLayerChain:
    """The layers run one after another on fake tensors (shapes and plain values only: no
    arithmetic, no random numbers drawn), from the first layer's input: ``step(layer, call,
    shapes)`` is what that layer returns after its hidden states, each entry other than plain
    data (``_plain``) as None, as the stubs return it (``Layout.plain_extras``). The layer runs
    on fake parameters of its whole ``shapes`` (``parameter_shapes``), never its own: outside
    its unit's gather the engine holds them sharded; floating ones take the hidden states'
    dtype (the gathered one under a low-precision ``param_dtype``)."""

    def __init__(self, hidden: torch.Tensor):
        from torch._subclasses.fake_tensor import FakeTensorMode
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.hidden = self.mode.from_tensor(hidden)

    def step(self, layer: nn.Module, call: tuple[tuple, dict],
             shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> tuple:
        args, kwargs = call
        h = self.hidden
        with self.mode, torch.no_grad():
            params = {n: torch.empty(shape, device=h.device,
                                     dtype=h.dtype if dtype.is_floating_point else dtype)
                      for n, (shape, dtype) in shapes.items()}
            res = torch.func.functional_call(layer, params, (h, *args), kwargs,
                                             tie_weights=False)
        self.hidden = res[0]
        return tuple(e if _plain(e) else None for e in res[1:])


def check_streams(name: str, seen: list[tuple], error: type[Exception],
                  called: list[nn.Module]) -> None:
    """Raise ``error`` where a layer call takes, besides its hidden states, a tensor the layer
    call before it returned beside its hidden states, and its output depends on it: a second
    stream from layer to layer (Zaya's router states, LiLT's layout stream, Kolibri 1.1's key
    pool), which the stubs cannot hand on (they return None there, and each layer gets the
    arguments recorded before any layer ran). A stream the layer ignores (GLM-5's top-k
    indices, which its layers recompute unless configured to share them) is no refusal: run
    again with None there (no grad), the layer's output is bit for bit the same. ``seen``: per
    layer call, (hidden states input, output, args, kwargs) of the traced forward; ``called``:
    the layer module of each call."""
    for i in range(1, len(seen)):
        out = seen[i - 1][1]
        extra = out[1:] if isinstance(out, (tuple, list)) else \
            list(out.values())[1:] if isinstance(out, dict) else []
        made = {id(t) for t in pytree.tree_leaves(extra) if torch.is_tensor(t)}
        _, own, args, kwargs = seen[i]
        keys = [k for k in [*range(1, len(args)), *kwargs] if args or k != "hidden_states"]
        fed = [k for k in keys if any(
            torch.is_tensor(t) and id(t) in made for t in pytree.tree_leaves(
                args[k] if isinstance(k, int) else kwargs[k]))]
        if fed and _reads(called[i], args, kwargs, fed, own):
            params = list(inspect.signature(called[i].forward).parameters)
            names = [(params[k] if k < len(params) else f"argument {k + 1}")
                     if isinstance(k, int) else k for k in fed]
            raise error(f"{name}'s layers carry a second stream of hidden states (layer {i} "
                        f"takes {', '.join(names)} from what layer {i - 1} returned beside its "
                        "hidden states); the generic path hands one hidden-states tensor from "
                        "layer to layer and gives every layer the other arguments the forward "
                        "computed before the first layer ran")


def _reads(layer: nn.Module, args: tuple, kwargs: dict, fed: list, own: Any) -> bool:
    """Whether ``layer``'s output changes when the arguments ``fed`` are None (no grad); a
    layer that cannot run so reads them."""
    args = tuple(None if k in fed else a for k, a in enumerate(args))
    kwargs = {k: None if k in fed else v for k, v in kwargs.items()}
    try:
        with torch.no_grad():
            again = layer(*args, **kwargs)
    except Exception:  # noqa: BLE001 - it needs them
        return True
    first = [t for t in pytree.tree_leaves(own) if torch.is_tensor(t)][:1]
    second = [t for t in pytree.tree_leaves(again) if torch.is_tensor(t)][:1]
    return not (first and second and first[0].shape == second[0].shape
                and torch.equal(first[0], second[0]))


def form_problem(model: nn.Module, seen: list[tuple[Any, Any]], i: int) -> str:
    """Why layer i's output (not its hidden states, nor a tuple or list with them first) cannot
    be staged, from each layer's (hidden states input, output) on the traced forward: where
    the forward hands layer i + 1 a tensor that none of layer i's outputs is, it rearranges
    them between the layers (the real cause); else the output's form."""
    name = type(model).__name__
    out = seen[i][1]
    form = type(out).__name__
    leaves = [t for t in pytree.tree_leaves(out) if torch.is_tensor(t)]
    if len(seen) > i + 1 and not any(t is seen[i + 1][0] for t in leaves):
        given = seen[i + 1][0]
        shapes = ", ".join(str(tuple(t.shape)) for t in leaves) or "none"
        return (f"the forward of {name} changes the hidden states between its layers: layer "
                f"{i} returns a {form} (tensors of shapes {shapes}) and the forward hands layer "
                f"{i + 1} a tensor of shape {tuple(getattr(given, 'shape', ()))}, none of "
                "them (it reshapes or rearranges them in between); the generic path runs "
                "layer after layer on the hidden states each returns, so this model needs a "
                "hand-written adapter (docs/adding_a_model.md)")
    return (f"layer {i} of {name} returns {form}, not its hidden states (nor a tuple or list "
            "with them first, or a dict holding only them)")
