"""What the planner needs to know of the model itself (``ModelProfile``), without timing it.

``model_profile``: units, parameters per unit and outside the units (embedding, head, ties),
trainable parameters (PEFT), state bytes. ``ModelProfile.param_bytes`` /
``boundary_bytes_per_sample``: the parameters' element size and the bytes of one sample's
embedding output (the boundary tensor the engine stashes). ``model_dtype``: the parameters'
dtype.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from hf_cephalo.models.base import StagedModel, WrappedStagedModel
from hf_cephalo.profiles.precision import Precision
from hf_cephalo.profiles.types import ModelProfile

__all__ = ["model_profile", "model_dtype", "boundary_bytes_per_sample", "side_bytes_per_sample", "largest_unit",
           "unit_groups", "mean_unit_numel", "ProfiledUnit", "refuse_reshaping_units"]

# [Note: layers of different sizes]
# Where a model's layers differ in size (DeepSeek-V3 / GLM-5's dense first layers before MoE
# ones, Gemma 4's full-attention layers wider than its sliding ones, Llama 4's interleaved MoE
# layers), the model profile records each layer's elements (``ModelProfile.unit_params``), so
# the training state, each unit's shards and each gathered buffer are priced per layer, as the
# engine allocates them. The profiler measures one layer of each size (``unit_groups``) and
# records, per rank, the layers' mean forward / backward time and kept graph (each size
# weighted by its count, so L times it is the rank's sum over its layers) and the largest
# layer's activation memory (the peak one unit's recompute reaches); the collectives are timed
# at the layers' mean size (their time is linear in bytes). L·T_i is then each rank's exact sum
# over its layers, and the step the cost model prices, L·max_i T_i, a lower bound on the
# engine's Σ_u max_i T_i,u, equal where every rank's speed ratio is the same for each layer
# size (docs/planner.md, "Layers of different sizes").


def _unique_params(modules) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for mod in modules:
        for p in mod.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def model_dtype(staged: StagedModel) -> torch.dtype:
    return next(iter(staged.units()[0].parameters())).dtype


def unit_sizes(staged: StagedModel) -> list[int]:
    """Elements of each unit (layer), in order."""
    return [sum(p.numel() for p in u.parameters()) for u in staged.units()]


def unit_groups(staged: StagedModel) -> list[tuple[int, int]]:
    """(index of the first layer of a size, number of layers of that size), one pair per
    distinct layer size in the order they first appear: ``[(0, L)]`` for identical layers.
    [Note: layers of different sizes]"""
    sizes = unit_sizes(staged)
    first: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        first.setdefault(n, [i, 0])[1] += 1
    return [(i, count) for i, count in first.values()]


def mean_unit_numel(staged: StagedModel) -> int:
    """The layers' mean element count (rounded): the size whose collectives the profiler times."""
    sizes = unit_sizes(staged)
    return round(sum(sizes) / len(sizes))


def largest_unit(staged: StagedModel) -> int:
    """The index of the largest unit (most elements; the first of equal ones, so 0 for
    identical layers): its size is ``ModelProfile.params_per_unit``."""
    sizes = unit_sizes(staged)
    return max(range(len(sizes)), key=lambda i: (sizes[i], -i))


class ProfiledUnit(WrappedStagedModel):
    """``staged`` seen through one of its units, u: ``units()`` is ``[units()[u]]`` and
    ``run_unit(0, ...)`` runs unit u with unit u's own layer arguments (``ctx``), so the
    profiler's code for "unit 0" measures a layer of another size (``unit_groups``). Anything
    else is ``staged``'s."""

    def __init__(self, inner: StagedModel, index: int):
        super().__init__(inner)
        self.index = index

    def units(self) -> list[nn.Module]:
        return [self.inner.units()[self.index]]

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        if index != 0:
            raise IndexError(f"ProfiledUnit has one unit (the model's unit {self.index}); "
                             f"got index {index}")
        return self.inner.run_unit(self.index, hidden, ctx)


def refuse_reshaping_units(staged: StagedModel) -> None:
    """ValueError for a model whose units change the hidden state's shape (a hierarchical
    backbone's stages, an encoder-decoder: ``StagedModel.hidden_shape_changes``): the
    profiler times one unit of each size on the embedding's output and prices every unit
    boundary at that output's bytes, neither of which holds for it. Raised on every rank
    alike, before any collective. The engine trains such a model under a given plan."""
    if staged.hidden_shape_changes():
        raise ValueError(
            f"{type(staged.model).__name__}'s hidden state changes shape between its units "
            "(a hierarchical backbone's stages, or an encoder-decoder's switch from the "
            "encoder's sequence to the decoder's), which the profiler cannot time or price yet "
            "(it runs each unit on the embedding's output); give a plan instead "
            "(plan=Plan.from_ratios(b_i, m_i, r_i), --cephalo_plan_file), with which the "
            "engine trains it exactly")


def model_profile(staged: StagedModel, name: str | None = None,
                  boundary_bytes_per_sample: float = 0.0,
                  precision: Precision | None = None,
                  side_bytes_per_sample: float = 0.0) -> ModelProfile:
    """ModelProfile of a staged model: units, parameters per unit / outside units, state bytes.

    ``state_bytes_per_param`` = 4 × element size (parameter, gradient and Adam's two moments in
    the parameter dtype: 16 for fp32, paper §2.4); ``param_bytes`` = the element size; ``gathered_param_bytes`` / ``reduce_bytes`` from ``precision`` (None: not cast);
    ``boundary_bytes_per_sample`` and ``side_bytes_per_sample`` as given (the functions of those
    names measure them). A model
    with frozen parameters (PEFT) records its trainable elements, in all and per unit (layer,
    embedding, head), and the frozen parameters' element size (a bf16 base: 2). The
    root is split as the engine splits it (engine.py ``_build_units``): ``params_embed`` =
    the parameters of ``embed_modules()`` (a tied weight once), ``params_head`` = those of
    ``head_modules()`` not already there, ``head_ties_embedding`` when the head uses one of
    the embedding's. Layers of different sizes: each one's elements in ``unit_params`` (and
    trainable elements in ``unit_trainable``), the largest as ``params_per_unit`` ([Note:
    layers of different sizes]).
    """
    units = staged.units()
    sizes = unit_sizes(staged)
    largest = largest_unit(staged)
    unit_ids = {id(p) for u in units for p in u.parameters()}
    embed = {id(p): p.numel() for p in _unique_params(staged.embed_modules())
             if id(p) not in unit_ids}
    head = {id(p): p.numel() for p in _unique_params(staged.head_modules())
            if id(p) not in unit_ids}
    tied = any(k in embed for k in head)
    head_only = sum(n for k, n in head.items() if k not in embed)
    model = staged.model
    if name is None:
        cfg = getattr(model, "config", None)
        name = str(getattr(cfg, "name_or_path", "") or type(model).__name__)
    # a PEFT model as it will train: only its trainable parameters (the adapter) carry state;
    # they are in the training dtype, a frozen base may be stored in its own (bf16)
    params = list(_unique_params([*units, *staged.embed_modules(), *staged.head_modules()]))
    trained = [p for p in params if p.requires_grad]
    elem = trained[0].element_size() if trained else \
        torch.empty((), dtype=model_dtype(staged)).element_size()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    lora = trainable != sum(p.numel() for p in params)
    trained_per_unit = [sum(p.numel() for p in u.parameters() if p.requires_grad)
                        for u in units]
    per_unit = trained_per_unit[largest]
    uneven = len(set(sizes)) > 1
    root = {id(p): p for p in _unique_params([*staged.embed_modules(), *staged.head_modules()])}
    t_embed = sum(root[k].numel() for k in embed if root[k].requires_grad)
    t_head = sum(root[k].numel() for k in head if k not in embed and root[k].requires_grad)
    frozen = [p for p in params if not p.requires_grad]
    frozen_elem = frozen[0].element_size() if frozen else elem
    return ModelProfile(name=name, num_units=len(units), params_per_unit=sizes[largest],
                        unit_params=sizes if uneven else None,
                        unit_trainable=trained_per_unit if uneven and lora else None,
                        params_other=sum(embed.values()) + head_only,
                        params_embed=sum(embed.values()), params_head=head_only,
                        head_ties_embedding=tied, state_bytes_per_param=4.0 * elem,
                        param_bytes=elem, boundary_bytes_per_sample=boundary_bytes_per_sample,
                        side_bytes_per_sample=side_bytes_per_sample,
                        trainable_params=trainable if lora else None,
                        trainable_per_unit=per_unit if lora else None,
                        trainable_embed=t_embed if lora else None,
                        trainable_head=t_head if lora else None,
                        frozen_bytes_per_param=frozen_elem,
                        gathered_param_bytes=None if precision is None or precision.param == "fp32"
                        else precision.param_bytes,
                        reduce_bytes=None if precision is None or precision.reduce == "fp32"
                        else precision.reduce_bytes)


def boundary_bytes_per_sample(staged: StagedModel, make_microbatch: Callable[[int], Any],
                              device: torch.device | str,
                              dtype: torch.dtype | None = None) -> float:
    """Bytes of one sample's embedding output: the boundary tensor the engine stashes per sample
    and unit boundary (sequence length x hidden size x element size). ``dtype``: the gathered
    parameters' dtype when cast (the embedding then outputs it), else the output's own."""
    mb = {k: v.to(device) for k, v in make_microbatch(1).items()}
    with torch.no_grad():
        hidden, _ = staged.embed(mb)
    size = hidden.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size()
    return float(hidden.numel() * size)


def side_bytes_per_sample(staged: StagedModel, make_microbatch: Callable[[int], Any],
                          device: torch.device | str) -> float:
    """Bytes of one sample's side inputs, which the engine keeps on the device through the
    step: those of its embedding's ctx (``StagedModel.side_inputs``: Gemma 3n's per-layer
    inputs) plus those a unit makes (``produce_side_inputs``, run here on the embedding's
    output: the profiler takes only models whose units keep the hidden state's shape); 0 for
    a model without them.

    Raises:
        ValueError: a unit that makes side inputs is not materialized (a model on the meta
            device): give a plan instead."""
    mb = {k: v.to(device) for k, v in make_microbatch(1).items()}
    with torch.no_grad():
        hidden, ctx = staged.embed(mb)
        for index, unit in enumerate(staged.units()):
            if not staged.produces_side_inputs(index):
                continue
            if any(p.is_meta for p in unit.parameters()):
                raise ValueError(
                    f"unit {index} of {type(staged.model).__name__} makes side inputs but its "
                    "parameters are not materialized (a model on the meta device), so the "
                    "profiler cannot measure them; give a plan instead "
                    "(plan=Plan.from_ratios(b_i, m_i, r_i), --cephalo_plan_file)")
            ctx = staged.produce_side_inputs(index, hidden, ctx)
    return float(sum(t.numel() * t.element_size() for t in staged.side_inputs(ctx)))


def profiling_stand_in(staged: StagedModel) -> StagedModel:
    """A staged copy of a meta-device model (sharded loading) that the profiler can run: the
    profiler runs only the root modules (embedding, head) and one unit of each size
    (``unit_groups``: unit 0 for identical layers; ``compute.py``; the other units are counted,
    never run), so a copy of the model, free while on the meta device, gets
    those modules materialized on the CPU with the model's own initialization
    (``_init_weights``: random weights, its buffers), each unit's shape and count as the
    model's, and the same fingerprint for the profile cache. Host memory: the embedding, the
    head and one layer of each size. The user's model is not touched.

    Raises:
        ValueError: the model has no ``_init_weights`` to initialize them with (not a
            transformers model): give a plan or a profile file.
    """
    import copy

    from hf_cephalo.models import stage_model

    model = copy.deepcopy(staged.model)
    for module in model.modules():  # a forward patched onto the instance (TRL's fused head
        module.__dict__.pop("forward", None)  # closes over the original): the class's own
    if not callable(getattr(model, "_init_weights", None)):
        raise ValueError(f"{type(model).__name__} is on the meta device and has no "
                         "_init_weights to build a profiling copy with: give a plan "
                         "(--cephalo_plan_file) or a profile (--cephalo_profile_file)")
    copied = stage_model(model)
    run = [*copied.root_modules(), *(copied.units()[i] for i, _ in unit_groups(copied))]
    uses: dict[int, list[tuple[nn.Module, str]]] = {}  # tied weights: one parameter, many uses
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            uses.setdefault(id(p), []).append((module, name))
    with torch.no_grad():
        for module in run:
            module.to_empty(device="cpu")
            for sub in module.modules():
                model._init_weights(sub)
    for group in uses.values():  # to_empty gave each use its own tensor: tie them again
        first = getattr(*group[0])
        for module, name in group[1:]:
            setattr(module, name, first)
    return copied
