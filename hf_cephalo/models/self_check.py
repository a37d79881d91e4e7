"""Before a model trains on the generic path: prove the staging exact on a tiny copy of it.

[Note: the self-check]
``generic_staged(model)`` builds a tiny random model of the SAME class from the SAME config,
only sizes shrunk (``shrink.tiny_config``: layers, widths, experts, vocabulary, with the fields
tied to them kept tied; every flag, multiplier, scale, softcap and layer pattern kept; where
the config class validates its sizes, sizes it accepts; no cache, as it trains), finds the
layout on it (``generic.trace_layout``; of several layer stacks, the one its forward runs on
text: ``find_layers``), then compares, in fp32 on CPU, the staged loss and every parameter
gradient with the model's own ``model(**batch, labels=...)`` over a padded batch cut into two
microbatches. Only if they agree (rtol 1e-5) is the user's model staged, with the tiny copy's
layout; otherwise ``StructureError`` says what differed. A class that is not a sequence
classifier must first prove a causal LM by what it computes (``causal_check.causal_lm_problem``; a
vision-language ``...ForConditionalGeneration`` on text is one). It needs no weights of the
user's model (it works on a meta-device model) and no process group, so every rank refuses
alike before any collective. Results are cached per (class, config) in the process.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import MutableMapping
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hf_cephalo.models.base import run_unit_in
from hf_cephalo.models.causal_check import causal_lm_problem
from hf_cephalo.models.document_inputs import with_document_inputs
from hf_cephalo.models.forward_refusals import refuse_by_own_forward
from hf_cephalo.models.generic import (GenericContext, Layout, NotCausalLMError, StructureError,
                                       forward_inputs, trace_layout)
from hf_cephalo.models.generic_heads import (CAUSAL_LM, ENCODER_TASKS,
                                             IMAGE_CLASSIFICATION, SEQUENCE_CLASSIFICATION,
                                             image_batch, staged_class, task_of, token_labels)
from hf_cephalo.models.generic_repeats import repeats_problem
from hf_cephalo.models.kv_sharing import find_kv_sharing
from hf_cephalo.models.shrink import TINY_MAX_NUMEL, int_field, tiny_config, tiny_numel

RTOL, ATOL = 1e-5, 1e-6
"""The self-check's tolerance on losses and gradients (fp32)."""


@dataclass(frozen=True)
class Proof:
    """What the self-check proved for one (class, config): the layout, and the module structure
    of the tiny copy (outside its layers; each layer) that a real model must have too."""

    layout: Layout
    outside: dict
    layers: list
    extra_layers: int | None = None
    """len(layer stack) - the text config's num_hidden_layers on the tiny copy (None: no such
    field): a real model must have the same difference (a layer appended after construction
    would run in no forward, or the forward would stop at the config's count). None also where
    the forward calls its layers several times each (``Layout.repeats``: ALBERT holds
    num_hidden_groups layer groups for num_hidden_layers calls)."""
    stages: bool = False
    """The units are a hierarchical backbone's stages (``Layout.reshapes``): ``layers`` holds
    each stage's modules as a set with every list index read as ``*`` (``_structure``), since
    the shrink cuts each stage to at most 2 blocks and a real stage is deeper."""


_CACHE: dict[tuple, Proof | StructureError] = {}


def _check_batch(config: Any, task: str, seed: int = 0,
                 main_input: str = "pixel_values") -> dict[str, torch.Tensor]:
    """The tiny copy's batch for its task: four images (image classification), else four
    rows of 9 tokens with left padding on one row (sequence classifier) or right padding
    (the other text tasks), and the task's labels with ignored positions; pad ids avoided in
    the real tokens. ValueError when the config names no vocabulary or image size."""
    if task == IMAGE_CLASSIFICATION:
        return image_batch(config, seed=seed, main_input=main_input)
    g = torch.Generator().manual_seed(seed)
    pad = getattr(config.get_text_config(), "pad_token_id", None)  # a config may define none
    ids = torch.randint(4, token_id_range(config) - 8, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    pad_id = pad if isinstance(pad, int) else 0
    if task == SEQUENCE_CLASSIFICATION:
        mask[1, :3] = 0
        ids[1, :3] = pad_id
        kind = config.problem_type or ("regression" if config.num_labels == 1
                                       else "single_label_classification")
        if kind == "single_label_classification":
            labels = torch.tensor([0, 1, 1, 0]) % max(int(config.num_labels), 1)
        elif kind == "multi_label_classification":
            labels = (torch.rand(4, config.num_labels, generator=g) > 0.5).float()
        else:
            labels = torch.randn(4, config.num_labels, generator=g).squeeze(-1)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    mask[2, 6:] = 0
    ids[2, 6:] = pad_id
    if task != CAUSAL_LM:
        return {"input_ids": ids, "attention_mask": mask,
                **token_labels(task, config, ids, mask, g)}
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


UNICODE_CODE_POINTS = 0x110000
"""The ids of a model that reads characters as their Unicode code points (CANINE: its
tokenizer's vocabulary is every code point, ``chr(i)`` -> i)."""


def token_id_range(config: Any) -> int:
    """The number of token ids the model reads, for the check's random tokens: the text
    config's ``vocab_size``; for a config without one whose model hashes each id into
    ``num_hash_buckets`` embedding rows (CANINE, whose ids are Unicode code points, any of them
    valid), ``UNICODE_CODE_POINTS``. ValueError when the config names neither."""
    text = config.get_text_config()
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int):
        return vocab
    if isinstance(getattr(text, "num_hash_buckets", None), int):
        return UNICODE_CODE_POINTS
    raise ValueError(f"{type(config).__name__} names no vocabulary size (vocab_size) to "
                     "build the check's token ids")


def _staged_loss(staged, batch: dict, cut: int):
    """The staged loss mean over the whole batch, run as two microbatches (rows [0, cut),
    [cut, end)), with autograd through embed, every unit and the head."""
    total, items = 0.0, 0
    mbs = [{k: v[:cut] for k, v in batch.items()}, {k: v[cut:] for k, v in batch.items()}]
    n = sum(staged.count_items(mb) for mb in mbs)
    staged.begin_step()
    for mb in mbs:
        hidden, ctx = staged.embed(mb)
        missed = sorted(set(side_arguments(ctx)) - set(staged.layout.side), key=str)
        if missed:  # the layout's side inputs come from the first microbatch's forward
            raise StructureError(f"layer arguments depend on parameters in one microbatch but "
                                 f"not in another ({missed[:3]})")
        # every unit reads the side inputs through with_side_inputs, as in the engine
        ctx = staged.with_side_inputs(ctx, staged.side_inputs(ctx))
        inputs, before = [], _shared_state(ctx)
        for i in range(staged.num_units):
            inputs.append(hidden)
            hidden, made = run_unit_in(staged, i, hidden, ctx)
            if made is not ctx:  # a store layer (KV sharing) made side inputs: as in the
                # engine, the units after it read them through with_side_inputs
                ctx = staged.with_side_inputs(made, staged.side_inputs(made))
        _refuse_shared_layer_state(staged, inputs + [hidden], ctx, before)
        out = staged.head_loss(hidden, mb, ctx)
        total = total + out.loss_sum / n
        items += out.num_items
    terms = staged.global_loss_sums()
    extra = 0.0 if terms is None else staged.finish_global_loss(terms, 1.0)
    return total + extra


def _shared_state(ctx: GenericContext) -> dict[int, dict]:
    """{id: a copy of its items} of every dict-like layer argument (a dict the layers share)."""
    return {id(v): dict(v) for args, kwargs in ctx.calls for v in [*args, *kwargs.values()]
            if isinstance(v, MutableMapping)}


def _refuse_shared_layer_state(staged, hiddens: list, ctx: GenericContext,
                               before: dict[int, dict]) -> None:
    """StructureError when a layer reads what another layer wrote into an argument they share,
    other than the KV sharing the staging carries (``Layout.kv``: Gemma 3n's and Gemma 4's,
    whose layers run on fresh dicts, so the recorded one stays unwritten). ``hiddens``: the
    units' inputs and the last output of one forward; ``before``: the dicts' items before it
    (``_shared_state``). Where the layers wrote into a dict, each layer is run again (no grad)
    with those dicts as before the forward; a layer that then fails or differs reads state
    made by a unit, which the engine's recompute would get without its gradient."""
    after = _shared_state(ctx)
    written = {k for k, items in after.items() if items.keys() != before[k].keys()
               or any(items[n] is not before[k][n] for n in items)}
    if not written:
        return

    def fresh(v):
        return type(v)(before[id(v)]) if id(v) in written else v

    for i in range(staged.num_units):
        calls = list(ctx.calls)
        args, kwargs = calls[i]
        calls[i] = (tuple(fresh(v) for v in args), {k: fresh(v) for k, v in kwargs.items()})
        alone = dataclasses.replace(ctx, calls=calls)
        try:
            with torch.no_grad():
                out = staged.run_unit(i, hiddens[i], alone)
            same = torch.allclose(out, hiddens[i + 1], rtol=RTOL, atol=ATOL)
        except Exception:  # noqa: BLE001 - a layer that cannot run without it reads it
            same = False
        if not same:
            raise StructureError(
                f"layer {i} reads what another layer wrote into a dict the layers share, in a "
                f"form the staging does not carry: the engine carries keys / values a store "
                f"layer writes and later layers reuse (KV sharing: Gemma 3n, Gemma 4; "
                f"models/kv_sharing.py), but here the recompute would read the forward's copy "
                f"without a gradient path into the writing layer")


def _compare(model: nn.Module, staged, batch: dict) -> str | None:
    """None when the staged loss and gradients equal the model's own, else what differs."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    ref = model(**batch)
    if not torch.is_tensor(getattr(ref, "loss", None)):
        raise StructureError(f"{type(model).__name__}'s own forward returns no loss for labels "
                             "(it computes logits only), so there is no loss of its own for "
                             "the staging to match or to train")
    ref.loss.backward()
    ref_loss = ref.loss.detach()
    ref_grads = {n: None if p.grad is None else p.grad.clone() for n, p in params}
    model.zero_grad(set_to_none=True)
    try:
        loss = _staged_loss(staged, batch, cut=1)
        loss.backward()
    finally:
        staged.end_step()
    if not torch.allclose(loss.detach().double(), ref_loss.double(), rtol=RTOL, atol=ATOL):
        return f"loss {float(loss):.8g} != the model's own {float(ref_loss):.8g}"
    for n, p in params:
        a, b = p.grad, ref_grads[n]
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        if not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            diff = float((a - b).abs().max())
            return f"gradient of {n} differs from the model's own by {diff:.3g}"
    return None


def _side_of(staged, batch: dict) -> tuple:
    """``Layout.side`` of the tiny copy: the layer arguments its forward computes from
    parameters (with autograd on, on the check's batch)."""
    with torch.enable_grad():
        _, ctx = staged.embed({k: v for k, v in batch.items() if k != "labels"})
    return side_arguments(ctx)


def side_arguments(ctx: GenericContext) -> tuple[tuple[int, int | str], ...]:
    """The layer arguments that carry autograd history (computed from parameters before the
    layers), as (layer index, positional index or keyword): ``Layout.side``, the side inputs
    the engine carries gradients for."""
    found = []
    for i, (args, kwargs) in enumerate(ctx.calls):
        for key, value in [*enumerate(args), *kwargs.items()]:
            if any(torch.is_tensor(t) and t.requires_grad for t in pytree.tree_leaves(value)):
                found.append((i, key))
    return tuple(found)


def _plain_head(model: nn.Module, staged, batch: dict) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return False
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        hidden, ctx = staged.embed(batch)
        for i in range(staged.num_units):
            hidden, ctx = run_unit_in(staged, i, hidden, ctx)
        final = staged.head_forward(hidden, batch, ctx, stop_at=head)
        return torch.equal(head(final), logits)


def _reshapes(staged, batch: dict) -> bool:
    """Whether a unit of the staged tiny copy returns hidden states of another shape than its
    input's (``Layout.reshapes``)."""
    with torch.no_grad():
        hidden, ctx = staged.embed(batch)
        for i in range(staged.num_units):
            out, ctx = run_unit_in(staged, i, hidden, ctx)
            if out.shape != hidden.shape:
                return True
            hidden = out
    return False


def find_layers(model: nn.Module, batch: dict | None = None) -> str:
    """The name of the model's layer stack, or StructureError saying why none fits.

    With several candidates (a multimodal model: one stack per tower) and a ``batch``, the
    stack is the one whose layers the model's own forward on that batch runs (traced with
    forward hooks, no grad): on text, a vision-language model runs its language model's layers
    only. Exactly one stack must run, or the stacks that run must nest in the stages of one
    outer stack (a hierarchical backbone: ``outer_stack``), which is then the stack."""
    cands = layer_list_candidates(model)
    if len(cands) == 1:
        return cands[0][0]
    found = [f"{n} ({len(m)})" for n, m in cands]
    which = ""
    if cands and batch is not None:
        ran = _stacks_run(model, batch, cands)
        if len(ran) == 1:
            return ran[0]
        outer = outer_stack(model, ran)
        if outer is not None:
            return outer
        which = (f"; its forward on the check's inputs runs {len(ran)} of them "
                 f"({', '.join(ran) or 'none'})")
    raise StructureError(
        f"{type(model).__name__} has {len(cands)} layer stacks (lists of the layer classes "
        f"it declares in _no_split_modules, else of one layer class: "
        f"{', '.join(found) or 'none'}){which}; the generic path needs exactly one stack "
        "that the forward runs (a multimodal model's language model, on text inputs), or "
        "stacks that lie inside the stages of one outer list of stage modules (a "
        "hierarchical backbone: each stage one unit)")


def layer_list_candidates(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """``ModuleList``s whose entries are all of a class the model declares unsplittable
    (``_no_split_modules``, what FSDP wraps): the candidates for the layer stack. For a class
    declaring none, the outermost lists of one parameter-holding class instead, of modules
    that hold submodules (a list of leaf modules, e.g. MarkupLM's per-depth xpath
    ``nn.Embedding`` tables, is a table of parameters, no stack of layers; the self-check
    then decides whether the forward really runs them as a stack)."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    out = [(n, m) for n, m in lists if all(type(e).__name__ in declared for e in m)]
    if not out:  # a class that declares none: the lists of one parameter-holding layer class
        out = [(n, m) for n, m in lists if len({type(e) for e in m}) == 1
               and next(m[0].parameters(), None) is not None
               and next(m[0].children(), None) is not None
               and not any(n.startswith(o + ".") for o, _ in lists if o != n)]
    return out


def _inside_item(name: str, outer: str) -> bool:
    """Whether module ``name`` lies strictly inside an item of the list ``outer``
    (``encoder.stages.2.layers`` inside ``encoder.stages``; not ``encoder.stages.2`` itself)."""
    rest = name[len(outer) + 1:] if name.startswith(outer + ".") else ""
    return "." in rest


def outer_stack(model: nn.Module, names: list[str]) -> str | None:
    """The stack of stages that holds the nested stacks ``names`` (a hierarchical backbone:
    ``convnext.encoder.stages`` holds ``convnext.encoder.stages.i.layers``), or None: one of
    ``names`` whose items hold all the others, else the innermost ``ModuleList`` whose items
    hold every one of them, its items all of one parameter-holding class that is no list
    itself (a stage module the forward calls; PoolFormer's and PVT's lists of lists are none).
    Each stage then is one unit, its downsampling included; the self-check decides whether
    the forward runs the stages as a row."""
    if len(names) < 2:
        return None
    for name in names:
        if all(o == name or _inside_item(o, name) for o in names):
            return name
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    for name, stages in sorted(lists, key=lambda nm: -nm[0].count(".")):
        if all(_inside_item(o, name) for o in names):
            kinds = {type(e) for e in stages}
            if len(kinds) == 1 and not issubclass(next(iter(kinds)), nn.ModuleList) \
                    and next(stages[0].parameters(), None) is not None:
                return name
            return None
    return None


def _stacks_run(model: nn.Module, batch: dict,
                cands: list[tuple[str, nn.ModuleList]]) -> list[str]:
    """Names of the candidate stacks any of whose layers ``model(**batch inputs)`` calls."""
    ran: set[str] = set()
    handles = [layer.register_forward_hook(lambda *_, _n=name: ran.add(_n))
               for name, stack in cands for layer in stack]
    try:
        with torch.no_grad():
            model(**forward_inputs(model, batch))
    except Exception as exc:  # noqa: BLE001 - the forward itself fails: a refusal with its cause
        raise StructureError(f"the forward of a tiny {type(model).__name__} fails on text "
                             f"inputs ({type(exc).__name__}: {exc})") from exc
    finally:
        for h in handles:
            h.remove()
    return [name for name, _ in cands if name in ran]


def check_class(cls: type, config: Any) -> Proof:
    """The layout of ``cls`` under ``config``, proven on a tiny copy; cached. Raises
    StructureError with the reason when the generic path would not be exact."""
    key = (cls, config.to_json_string(use_diff=False) if hasattr(config, "to_json_string")
           else repr(config))
    hit = _CACHE.get(key)
    if hit is None:
        try:
            # the tiny copy, its batch and every comparison on the CPU whatever the caller's
            # default device (a model built under ``with torch.device("meta")`` is staged
            # inside that context: the copy would be on meta too, and its checks fail)
            with torch.device("cpu"):
                hit = _check(cls, config)
        except StructureError as exc:
            hit = exc
        _CACHE[key] = hit
    if isinstance(hit, StructureError):
        raise hit
    return hit


def _check(cls: type, config: Any) -> Proof:
    cfg = tiny_config(config)
    task = task_of(cls)
    task = task if task in ENCODER_TASKS else CAUSAL_LM  # another name: a causal LM, if proven
    text = cfg.get_text_config()
    if task == SEQUENCE_CLASSIFICATION and getattr(text, "pad_token_id", None) is None:
        text.pad_token_id = 0  # pooling needs one (stock refuses more rows without it too)
    try:
        numel = tiny_numel(cls, cfg)
    except Exception as exc:  # noqa: BLE001 - any failure to build is a refusal with its cause
        raise StructureError(f"could not build a tiny copy of {cls.__name__} to check the "
                             f"staging ({type(exc).__name__}: {exc})") from exc
    if numel > TINY_MAX_NUMEL:
        raise StructureError(f"a tiny copy of {cls.__name__} to check the staging would still "
                             f"hold {numel / 1e6:.0f}M parameters (its config has sizes the "
                             f"check does not know how to shrink; limit "
                             f"{TINY_MAX_NUMEL / 1e6:.0f}M)")
    try:
        with warnings.catch_warnings(), torch.device("cpu"):
            warnings.simplefilter("ignore")
            # the CPU generator only (torch.manual_seed would also reseed every CUDA device,
            # which stage_model's fork_rng(devices=[]) does not restore); the copy is on the CPU
            torch.default_generator.manual_seed(0)
            tiny = cls(cfg).float().eval()
    except Exception as exc:  # noqa: BLE001 - any failure to build is a refusal with its cause
        raise StructureError(f"could not build a tiny copy of {cls.__name__} to check the "
                             f"staging ({type(exc).__name__}: {exc})") from exc
    _perturb(tiny)
    try:
        batch = _check_batch(cfg, task, main_input=getattr(cls, "main_input_name", None)
                             or "pixel_values")
        batch = with_document_inputs(cls, cfg, batch)  # [Note: document inputs]
    except ValueError as exc:
        raise StructureError(f"could not build the check's batch for a tiny {cls.__name__} "
                             f"({exc})") from exc
    _refuse_batch_norm(tiny, batch)
    if task == CAUSAL_LM:  # a causal LM by what its forward computes on text, whatever its name
        problem, label_shift = causal_lm_problem(tiny, batch)
        if problem is not None:
            raise NotCausalLMError(f"{cls.__name__}'s own forward on text (input_ids, "
                                   f"attention_mask, labels) is not a causal LM's: {problem}")
    else:
        label_shift = True
    try:
        return _prove(cls, tiny, batch, task, label_shift)
    except StructureError as exc:
        exc.causal_lm = task == CAUSAL_LM  # proven a causal LM above; the staging failed
        raise


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _refuse_batch_norm(tiny: nn.Module, batch: dict) -> None:
    """StructureError for a model whose forward on ``batch`` runs BatchNorm layers (one only
    another input's path runs, e.g. a speech encoder's on text, is not refused). In training a
    BatchNorm layer normalizes each microbatch by that microbatch's own mean and variance and
    updates its running statistics once per microbatch (and again in the recompute of
    activation checkpointing): the loss, the gradients and the statistics would depend on the
    plan's microbatches, where stock normalizes each device's batch once. The comparison on the
    tiny copy runs in eval mode (running statistics), where the staging is exact, so it cannot
    see this; the refusal is by the module types the forward runs."""
    names: list[str] = []
    hooks = [module.register_forward_hook(lambda *_, name=name: names.append(name))
             for name, module in tiny.named_modules() if isinstance(module, BATCH_NORMS)]
    try:
        if hooks:
            with torch.no_grad():
                tiny(**batch)
    except Exception:  # noqa: BLE001 - the comparisons below report a forward that fails
        pass
    finally:
        for hook in hooks:
            hook.remove()
    if names:
        more = ", ..." if len(names) > 1 else ""
        raise StructureError(
            f"{type(tiny).__name__} has BatchNorm layers ({names[0]}{more}): in training each "
            "normalizes a microbatch by that microbatch's own statistics and updates its running "
            "statistics once per microbatch (again in the recompute), so its gradients and "
            "statistics would depend on the plan instead of equalling one process's whole "
            "batch; hf_cephalo trains models without BatchNorm (LayerNorm, GroupNorm, RMSNorm)")


def _prove(cls: type, tiny: nn.Module, batch: dict, task: str,
           label_shift: bool = True) -> Proof:
    """The layout of the tiny copy ``tiny`` of ``cls`` (a causal LM's loss shifting its labels
    or not: ``label_shift``), its staging compared with its own forward on ``batch``;
    StructureError with what differed."""
    layers = find_layers(tiny, batch)
    refuse_by_own_forward(tiny, batch, layers, task)
    hint = ""  # why a staged model that builds may still fail to run
    try:
        layout = dataclasses.replace(trace_layout(tiny, batch, layers), label_shift=label_shift)
        first = staged_class(tiny)(tiny, layout)
        # from here the staged forwards run (the first one in _side_of's embed)
        hint = ("; the generic path runs each layer on the previous layer's hidden states with "
                "the arguments the model's forward gave the layers before any ran, so a layer "
                "that reads another layer's other outputs (a shared key pool, top-k indices, "
                "a stage's output dimensions) fails this way")
        layout = dataclasses.replace(layout, side=_side_of(first, batch),
                                     kv=find_kv_sharing(first, batch, StructureError))
        if layout.repeats:
            why = repeats_problem(cls.__name__, layout.kv, layout.side, layout.plain_extras)
            if why:
                raise StructureError(why)
        staged = staged_class(tiny)(tiny, layout)
        problem = _compare(tiny, staged, batch)
        if problem is not None and _equal_in_float64(tiny, batch, layout):
            problem = None  # [Note: fp32 rounding or another computation]
        plain = task == CAUSAL_LM and _plain_head(tiny, staged, batch)
        reshapes = _reshapes(staged, batch)
    except StructureError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise StructureError(f"staging a tiny {cls.__name__} failed ({type(exc).__name__}: "
                             f"{exc}){hint}") from exc
    if problem is not None:
        raise StructureError(f"the staged {cls.__name__} is not the model's own computation on a "
                             f"tiny copy: {problem} (and not equal in float64 either)")
    final = dataclasses.replace(layout, plain_head=plain, reshapes=reshapes)
    return Proof(final, _outside(tiny, layers),
                 [_structure(m, reshapes) for m in tiny.get_submodule(layers)],
                 None if layout.repeats else _extra_layers(tiny, layers), reshapes)


# [Note: fp32 rounding or another computation]
# The staged forward sums the same terms in another order than the model's own (a tied
# embedding's two gradient uses, microbatches, the global mean), so in fp32 the two differ by
# rounding, which grows with the magnitudes involved (Gemma 4's scaled embeddings and softcapped
# logits: 4e-6 on a tied embedding's gradient, beyond atol 1e-6). A class whose fp32 comparison
# fails is compared again in float64, same batch, same layout, same tolerances (rtol 1e-5,
# atol 1e-6): rounding then shrinks by nine orders of magnitude while a different computation
# (a skipped multiplier, another loss) keeps its size, so only the latter is refused. The loss
# itself may stay fp32 inside the model (transformers' loss upcasts logits with ``.float()``):
# about 1e-7 relative, within the tolerance. Where the float64 copy's eager attention is NaN
# on padding (its softmax runs in float32), the comparison is run again with SDPA on both sides.


def float64_copy(model: nn.Module, sdpa: bool = False) -> nn.Module:
    """A float64 copy of ``model`` ([Note: fp32 rounding or another computation]); with
    ``sdpa``, SDPA attention where it ran eager and the class has SDPA (both sides of a
    comparison use it: eager takes its softmax in float32, where float64's mask minimum is
    -inf, so a fully masked padding row is NaN and spreads, as in Gemma 4); grouped
    expert matmuls, which have no float64 kernel, run as the loop over experts, which computes
    the same inside the layers, on both sides of a comparison."""
    wide = copy.deepcopy(model).double()
    if getattr(wide.config, "_experts_implementation", None) not in (None, "eager"):
        wide.set_experts_implementation("eager")
    if sdpa and getattr(wide.config, "_attn_implementation", None) == "eager":
        try:
            wide.set_attn_implementation("sdpa")
        except Exception:  # noqa: BLE001 - no SDPA for this class: eager, as before
            pass
    return wide


def _equal_in_float64(tiny: nn.Module, batch: dict, layout: Layout) -> bool:
    """Whether a float64 copy of ``tiny`` stages equal to its own forward, with its attention
    as is or else with SDPA (``float64_copy``); False also when a kernel of the model has no
    float64 version."""
    return any(_equal_in_float64_once(tiny, batch, layout, sdpa) for sdpa in (False, True))


def float64_batch(batch: dict) -> dict:
    """``batch`` with its floating-point tensors in float64 (pixels, float labels), for a
    float64 copy ([Note: fp32 rounding or another computation]): a model that does not cast
    its inputs to its weights' dtype (BiT's first convolution) fails on float32 pixels."""
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in batch.items()}


def _equal_in_float64_once(tiny: nn.Module, batch: dict, layout: Layout, sdpa: bool) -> bool:
    batch = float64_batch(batch)
    try:
        wide = float64_copy(tiny, sdpa)
        traced = trace_layout(wide, batch, layout.layers)
        staged = staged_class(wide)(wide, dataclasses.replace(
            traced, label_shift=layout.label_shift, side=layout.side, kv=layout.kv))
        return _compare(wide, staged, batch) is None
    except Exception:  # noqa: BLE001 - no float64 check possible: the fp32 verdict stands
        return False


def _extra_layers(model: nn.Module, layers: str) -> int | None:
    """Layers in ``layers`` beyond the ``num_hidden_layers`` of the config of the stack that
    holds them: the nearest module above them with a config (SigLIP 2's vision tower for its
    vision layers, whose text tower may have another depth), else the text config."""
    config = model.config.get_text_config()
    parts = layers.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        own = getattr(model.get_submodule(".".join(parts[:cut])), "config", None)
        if int_field(own, "num_hidden_layers") is not None:
            config = own
            break
    count = int_field(config, "num_hidden_layers")
    return None if count is None else len(model.get_submodule(layers)) - count


def _perturb(model: nn.Module) -> None:
    """Move every norm weight and bias off its initial value (ones / zeros), so a skipped or
    misplaced norm changes the result."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


# PEFT's wrappers of one module (a LoRA Linear around its base Linear, modules_to_save around
# a head): the wrapped module counts, since the wrapper runs in its place inside the same call.
_WRAPPERS = {"BaseTunerLayer": "base_layer", "AuxiliaryTrainingWrapper": "original_module"}


def _wrapped(module: nn.Module) -> nn.Module | None:
    for cls in type(module).__mro__:
        attr = _WRAPPERS.get(cls.__name__)
        if attr is not None and isinstance(getattr(module, attr, None), nn.Module):
            return getattr(module, attr)
    return None


def _modules(root: nn.Module, skip: set[int] = frozenset()) -> dict[str, str]:
    """{name: class name} of ``root``'s modules, a PEFT wrapper read as the module it wraps
    (its adapter submodules left out), modules whose id is in ``skip`` left out."""
    out: dict[str, str] = {}

    def walk(prefix: str, module: nn.Module) -> None:
        if id(module) in skip:
            return
        inner = _wrapped(module)
        if inner is not None:
            walk(prefix, inner)
            return
        out[prefix] = type(module).__name__
        for name, child in module._modules.items():
            if child is not None:
                walk(f"{prefix}.{name}" if prefix else name, child)

    walk("", root)
    return out


def _structure(module: nn.Module, stage: bool = False) -> Any:
    """{name: class name} of a layer's modules; for a hierarchical backbone's stage
    (``Proof.stages``), the sorted set of (name, class name) with every list index read as
    ``*`` (a stage of 9 blocks, in a ``ModuleList`` or an ``nn.Sequential``, is built like one
    of 2 where its blocks are built like those)."""
    found = _modules(module)
    if not stage:
        return found
    return sorted({(".".join("*" if p.isdigit() else p for p in n.split(".")), c)
                   for n, c in found.items()})


def _outside(model: nn.Module, layers: str) -> dict[str, str]:
    return _modules(model, skip={id(m) for m in model.get_submodule(layers).modules()})


def _same_structure(model: nn.Module, proof: Proof) -> None:
    """StructureError unless ``model`` has the tiny copy's modules outside its layers and each
    of its layers is built like one of the tiny copy's (a model changed after construction,
    e.g. a pooler removed or a module attached, is not the model the check ran on)."""
    outside = _outside(model, proof.layout.layers)
    if outside != proof.outside:
        diff = sorted(set(outside.items()) ^ set(proof.outside.items()))[:4]
        raise StructureError(f"its modules differ from a {type(model).__name__} built from its "
                             f"config (first differences: {diff}); the check ran on the latter")
    extra = _extra_layers(model, proof.layout.layers)
    if proof.extra_layers is not None and extra != proof.extra_layers:
        count = len(model.get_submodule(proof.layout.layers))
        raise StructureError(f"it holds {count} layers in {proof.layout.layers} but its config "
                             f"says num_hidden_layers = {count - extra} (a layer added or "
                             "removed after construction); build the model from a config that "
                             "counts its layers")
    for i, layer in enumerate(model.get_submodule(proof.layout.layers)):
        if _structure(layer, proof.stages) not in proof.layers:
            raise StructureError(f"its layer {i} is built unlike any layer of a "
                                 f"{type(model).__name__} built from its config")


def generic_staged(model: nn.Module):
    """``model`` on the generic path, after ``check_class`` proved it on a tiny copy.

    Raises StructureError (a ValueError) with the reason when the class cannot be staged
    exactly or the model is not built as its config says; no process group is needed.
    """
    _refuse_block_sparse(model)
    proof = check_class(type(model), model.config)
    _same_structure(model, proof)
    try:
        return staged_class(model)(model, proof.layout)
    except (ValueError, AttributeError) as exc:
        raise StructureError(str(exc)) from exc


def _refuse_block_sparse(model: nn.Module) -> None:
    """StructureError for a BigBird model with block-sparse attention (``attention_type``
    ``"block_sparse"``, its default config's). Its forward picks the attention per call: rows
    of at most (5 + 2 x num_random_blocks) x block_size tokens switch the whole model to full
    attention (``set_attention_type``, changing its layers), longer ones run block-sparse
    attention, which pads the input to a multiple of block_size and builds its block masks
    inside the model's forward, around the layers: not staged. The check's tiny copy switches
    on its short batch, so without this refusal the model was refused as "built unlike" its
    own tiny copy, a reason that named no cause."""
    base = getattr(model, "base_model", None)
    kind = getattr(base, "attention_type", None)
    if getattr(model.config, "model_type", None) != "big_bird" or kind != "block_sparse":
        return
    limit = (5 + 2 * model.config.num_random_blocks) * model.config.block_size
    error = StructureError(
        f"{type(model).__name__} has attention_type='block_sparse': hf_cephalo stages BigBird "
        "with full attention only (block-sparse attention pads the input to a multiple of "
        "block_size and builds its block masks inside the model's forward; not staged; its "
        f"forward runs full attention only on rows of at most {limit} tokens, block-sparse on "
        "longer ones). Train it with full attention: "
        "model.base_model.set_attention_type('original_full') before handing it over")
    error.fix_given = True  # the registry adds no generic advice after this fix
    raise error
