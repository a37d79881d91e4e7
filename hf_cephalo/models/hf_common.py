"""Shared pieces of the Hugging Face adapters: partition check, losses as sums, training prep.

Every adapter reproduces the model's own forward by calling the model's own submodules (the
embedding modules, each decoder layer, the final norm and head) and the same mask builders
(``transformers.masking_utils``) with the same arguments as the model's ``forward`` does, so
attention backends (eager / sdpa / flex), packed-sequence detection and sliding windows behave
exactly as in ``model(**inputs)``. Written against transformers 5.x.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from hf_cephalo.models.base import HeadEvalOutput, HeadOutput, Microbatch, StagedModel

IGNORE_INDEX = -100
"""Label value excluded from the loss and from the item count (the HF / PyTorch convention)."""

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass
class DecoderContext:
    """Per-microbatch, parameter-free tensors shared by all units of a decoder (never
    differentiated; built once by ``embed`` and reused by the engine's recompute).

    masks: attention type ("full_attention" / "sliding_attention") -> the mask the model's
        forward would pass its layers (None when the backend uses ``is_causal`` instead).
    position_ids: (m, S) or (1, S) int64, the positions used for rotary / learned embeddings.
    position_embeddings: rotary (cos, sin), each (m or 1, S, head_dim); None for models
        without rotary embeddings.
    """

    masks: dict[str, Any]
    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class EncoderContext:
    """Per-microbatch tensors for bidirectional encoders (never differentiated).

    mask: what the model's forward passes its layers (None without padding).
    position_ids: (m, S) or None, forwarded to the layers as the model does.
    """

    mask: Any
    position_ids: torch.Tensor | None = None


def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """(1, S) positions 0..S-1, as the HF forward makes them without a cache."""
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)


def microbatch_position_ids(microbatch: Microbatch, input_ids: torch.Tensor) -> torch.Tensor:
    """The microbatch's ``position_ids`` (m, S) when given (packed sequences), else
    ``default_position_ids(input_ids)`` (1, S)."""
    position_ids = microbatch.get("position_ids")
    if position_ids is None:
        position_ids = default_position_ids(input_ids)
    return position_ids


CAUSAL_MASK_BUILDERS: dict[str, Callable[..., Any]] = {
    FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
"""Attention type -> the ``transformers.masking_utils`` builder a decoder's forward uses for it."""


def build_causal_masks(config: Any, layer_types: Sequence[str], inputs_embeds: torch.Tensor,
                       attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor) -> dict[str, Any]:
    """One mask per attention type in ``layer_types``, built by the model's own builder
    (``CAUSAL_MASK_BUILDERS``) with the arguments a decoder's forward passes it without a cache.

    inputs_embeds (m, S, H); attention_mask (m, S) 0/1 or None; position_ids (m or 1, S).
    Raises KeyError for a type not in ``CAUSAL_MASK_BUILDERS`` (adapters check first).
    """
    return {kind: CAUSAL_MASK_BUILDERS[kind](config=config, inputs_embeds=inputs_embeds,
                                             attention_mask=attention_mask, cache=None,
                                             position_ids=position_ids)
            for kind in dict.fromkeys(layer_types)}


def rotary_cos_sin(rotary_emb: nn.Module, hidden: torch.Tensor,
                   position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary (cos, sin), each (m or 1, S, head_dim), for ``DecoderContext``.

    cos/sin depend on positions only (``hidden`` gives dtype and device); no_grad keeps the
    context free of autograd history, since the engine reuses it across recomputes.
    """
    with torch.no_grad():
        return rotary_emb(hidden, position_ids=position_ids)


def require_key(microbatch: Microbatch, key: str, adapter: str) -> torch.Tensor:
    """``microbatch[key]``, or ValueError naming the missing key and the keys present."""
    value = microbatch.get(key) if isinstance(microbatch, Mapping) else None
    if value is None:
        present = (sorted(microbatch) if isinstance(microbatch, Mapping)
                   else type(microbatch).__name__)
        raise ValueError(f"{adapter}: the microbatch has no {key!r} (keys present: {present}); "
                         f"pass it as the collator's {key!r} field.")
    return value


def check_partition(model: nn.Module, root_modules: Sequence[nn.Module],
                    units: Sequence[nn.Module], adapter: str) -> None:
    """Check that root and unit parameters are disjoint and together exactly ``model.parameters()``.

    Tied weights count once (by identity). Raises ValueError naming the stray parameters, e.g.
    when a user attached an extra module the adapter does not know about.
    """
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    root_ids = {id(p) for m in root_modules for p in m.parameters()}
    unit_ids: set[int] = set()
    for i, unit in enumerate(units):
        ids = {id(p) for p in unit.parameters()}
        if ids & (root_ids | unit_ids):
            raise ValueError(f"{adapter}: unit {i} shares parameters with the root unit or an "
                             f"earlier unit; units must own their parameters.")
        unit_ids |= ids
    covered = root_ids | unit_ids
    missing = sorted(names[i] for i in names.keys() - covered)
    extra = len(covered - names.keys())
    if missing or extra:
        raise ValueError(f"{adapter}: root modules + units do not cover model.parameters() exactly "
                         f"(not covered: {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                         f"{extra} foreign parameters). A model with extra modules needs its own "
                         f"adapter: see docs/adding_a_model.md.")


# ---- losses as SUMS (the engine divides by the global item count) ---------------------------

class OwnParameters(nn.Module):
    """The parameters and buffers ``owner`` holds itself, not those of its submodules, as a
    module of its own: a root module for an ``owner`` that also contains the layers (XLNet's
    ``transformer`` holds ``mask_emb`` beside its ``layer`` list), whose ``parameters()``
    would otherwise hand the layers' parameters to the root too.

    It shares ``owner``'s entry dicts (no copy): the engine's views and placeholders written
    into its ``_parameters`` land in ``owner``, as does ``.to()``; it is never called (the
    model's own forward reads ``owner``). A ``_init_weights`` that tests the owner's class
    does not recognize it."""

    def __init__(self, owner: nn.Module):
        super().__init__()
        object.__setattr__(self, "_parameters", owner._parameters)
        object.__setattr__(self, "_buffers", owner._buffers)
        object.__setattr__(self, "_non_persistent_buffers_set",
                           owner._non_persistent_buffers_set)

    def forward(self, *args, **kwargs):
        raise RuntimeError("OwnParameters holds another module's entries; it is never called")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Causal shift as in ``transformers.loss.loss_utils.ForCausalLMLoss``: position t is scored
    against label t+1; the last position gets IGNORE_INDEX. labels (m, S) -> (m, S)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def count_causal_items(labels: torch.Tensor, shift: bool = True) -> int:
    """Tokens scored by the causal LM loss: labels != -100 after the shift (``shift=False``:
    labels != -100, for a model whose own loss takes its labels as given)."""
    return int(((shift_labels(labels) if shift else labels) != IGNORE_INDEX).sum().item())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor,
                       shift: bool = True) -> HeadOutput:
    """Summed next-token cross entropy. logits (m, S, V), labels (m, S) with -100 ignored.

    Equals ``ForCausalLMLoss`` (same shift, half-precision logits upcast to fp32) times its item
    count, so loss_sum / num_items == the model's own mean loss. Unlike ``ForCausalLMLoss``,
    fp64 logits are kept in fp64 (never downcast). ``shift=False``: position t is scored against
    ``labels[t]``, as the causal LMs of transformers' encoder-decoder families compute it
    (``BartForCausalLM``: ``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))``, labels
    shifted by the caller).
    """
    labels = labels.to(logits.device)
    targets = (shift_labels(labels) if shift else labels).reshape(-1)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets,
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return HeadOutput(loss_sum, int((targets != IGNORE_INDEX).sum().item()))


def problem_type(config: Any, labels: torch.Tensor) -> str:
    """The classification problem type HF resolves (``ForSequenceClassificationLoss``), without
    mutating ``config``: regression for 1 label, single-label for integer labels, else
    multi-label."""
    if config.problem_type is not None:
        return config.problem_type
    if config.num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def count_classification_items(labels: torch.Tensor, config: Any) -> int:
    """Items the HF classification loss averages over: samples with label != -100 for
    single-label cross entropy; every label element for regression (MSE) and multi-label (BCE)."""
    if problem_type(config, labels) == "single_label_classification":
        return int((labels != IGNORE_INDEX).sum().item())
    return labels.numel()


def classification_loss_sum(logits: torch.Tensor, labels: torch.Tensor, config: Any) -> HeadOutput:
    """Summed classification loss. logits (m, num_labels); labels (m,) or (m, num_labels).

    Mirrors ``BertForSequenceClassification.forward`` / ``ForSequenceClassificationLoss`` with
    reduction "sum" instead of "mean", so loss_sum / num_items equals the model's loss.
    """
    labels = labels.to(logits.device)
    kind = problem_type(config, labels)
    num_items = count_classification_items(labels, config)
    if kind == "single_label_classification":
        loss_sum = F.cross_entropy(logits.reshape(-1, config.num_labels), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
    elif kind == "regression":
        if config.num_labels == 1:
            loss_sum = F.mse_loss(logits.squeeze(), labels.squeeze(), reduction="sum")
        else:
            loss_sum = F.mse_loss(logits, labels, reduction="sum")
    elif kind == "multi_label_classification":
        loss_sum = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    else:
        raise ValueError(f"config.problem_type={kind!r} is not supported; use "
                         f"'single_label_classification', 'multi_label_classification' or "
                         f"'regression'.")
    return HeadOutput(loss_sum, num_items)


# ---- last non-pad token pooling (decoder classifiers) ------------------------------------------

def pad_token_id_of(config: Any) -> int | None:
    """The pad token id a decoder classification head pools with: ``config.get_text_config()
    .pad_token_id``, as ``GenericForSequenceClassification.forward`` reads it
    (transformers/modeling_layers.py; for GPT-2 the text config is the config itself)."""
    return config.get_text_config().pad_token_id


def check_poolable(input_ids: torch.Tensor, pad_token_id: int | None, model_name: str) -> None:
    """ValueError when ``pad_token_id`` is None and the microbatch has more than one row.

    Mirrors ``GenericForSequenceClassification.forward`` / ``GPT2ForSequenceClassification
    .forward`` (transformers 5.24), which refuse a batch of more than one row without a pad
    token since they cannot tell where each row ends; the engine calls the head once per
    microbatch, so the rule applies per microbatch as stock applies it per forward call
    (per device batch under DDP). input_ids (m, S).
    """
    if pad_token_id is None and input_ids.shape[0] != 1:
        raise ValueError(
            f"{model_name}: config.pad_token_id is None, so the last token of each row cannot be "
            f"found in a microbatch of {input_ids.shape[0]} rows (transformers: 'Cannot handle "
            f"batch sizes > 1 if no padding token is defined.'); set model.config.pad_token_id "
            f"before training (tokenizer.pad_token_id, or tokenizer.eos_token_id for a "
            f"tokenizer without a pad token, as for GPT-2).")


def pool_last_non_pad(logits: torch.Tensor, input_ids: torch.Tensor, pad_token_id: int | None,
                      model_name: str) -> torch.Tensor:
    """The logits of each row's last non-pad token: logits (m, S, L), input_ids (m, S) ->
    (m, L).

    Copied from ``GenericForSequenceClassification.forward`` (transformers/modeling_layers.py,
    5.24; GPT-2's is the same): the rightmost position whose token is not ``pad_token_id``, so
    left and right padding both work (the attention mask is not consulted, as in stock); a row of
    pad tokens only pools position 0 (argmax of zeros); ``pad_token_id`` None pools the last
    position of a one-row microbatch and raises ValueError for more rows (``check_poolable``).
    """
    check_poolable(input_ids, pad_token_id, model_name)
    if pad_token_id is None:
        last_non_pad_token: torch.Tensor | int = -1
    else:
        non_pad_mask = (input_ids != pad_token_id).to(logits.device, torch.int32)
        token_indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
        last_non_pad_token = (token_indices * non_pad_mask).argmax(-1)
    return logits[torch.arange(input_ids.shape[0], device=logits.device), last_non_pad_token]


# ---- base adapter -----------------------------------------------------------------------------

class HFStagedModel(StagedModel):
    """Common part of the HF adapters: partition check at construction, training preparation.

    Subclasses set ``model_classes`` (class names they accept) and implement the contract of
    ``StagedModel``. Raises ValueError at construction if root modules + units do not cover the
    model's parameters exactly.
    """

    model_classes: tuple[str, ...] = ()

    def __init__(self, model: nn.Module):
        super().__init__(model)
        check_partition(model, self.root_modules(), self.units(), type(self).__name__)

    def loss_from_logits(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        """The summed loss of this microbatch given the head's ``logits`` (the task's loss:
        ``CausalLMStagedModel`` / ``ClassifierStagedModel``)."""
        raise NotImplementedError(f"{type(self).__name__} has no loss_from_logits: derive the "
                                  "adapter from CausalLMStagedModel or ClassifierStagedModel")

    def head_loss(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> HeadOutput:
        """``loss_from_logits`` of ``head_logits``: one head pass."""
        return self.loss_from_logits(self.head_logits(hidden, microbatch, ctx), microbatch)

    def head_loss_and_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                             ctx: Any) -> HeadEvalOutput:
        """Loss and logits from ONE head pass (evaluation with predictions)."""
        logits = self.head_logits(hidden, microbatch, ctx)
        return HeadEvalOutput(self.loss_from_logits(logits, microbatch), logits)

    def prepare_for_training(self) -> None:
        """Force ``config.use_cache = False`` and map the model's own activation checkpointing
        onto the engine's.

        The engine always recomputes every unit in backward (per-unit activation checkpointing,
        docs/design.md contract 4), so a model-level ``gradient_checkpointing_enable()`` is redundant: it
        would recompute each layer a second time inside the engine's recompute. It is therefore
        switched off here with a warning; the memory saving it asked for is provided by the engine.
        """
        config = getattr(self.model, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False
        if any(getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules()):
            warnings.warn("The model has Hugging Face gradient checkpointing enabled; hf_cephalo "
                          "turns it off because its engine already recomputes every layer in "
                          "backward (per-unit activation checkpointing).", UserWarning,
                          stacklevel=2)
            disable = getattr(self.model, "activation_checkpointing_disable", None)
            if disable is None:
                disable = self.model.gradient_checkpointing_disable
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                disable()


class CausalLMStagedModel(HFStagedModel):
    """Common part of the decoder-only causal-LM adapters: the summed next-token loss and its
    item count, read from the microbatch's ``labels`` (m, S) with -100 ignored, shifted by one
    position (``label_shift``; False for a model whose own loss takes its labels as given).

    Subclasses implement structure, ``embed``, ``run_unit`` and the head in two parts:
    ``final_hidden`` (the final norm: (m, S, H) -> (m, S, H)) and ``output_head`` (the (V, H)
    projection, ``lm_head``), so that ``head_logits`` = ``output_head()(final_hidden(...))``
    (m, S, V) and a loss that never materializes the logits (TRL's chunked log-probabilities,
    ``integrations/trl/fused.py``) can project the final hidden states itself, tile by tile.
    ``head_loss`` and ``head_loss_and_logits`` (``HFStagedModel``) run the head once.
    Raises ValueError when the microbatch has no ``labels``.
    """

    label_shift: bool = True
    """Whether the loss scores position t against ``labels[t + 1]`` (``ForCausalLMLoss``) or,
    False, against ``labels[t]`` (the generic path decides it from the model's own loss)."""

    def final_hidden(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        """The last unit's output through the final norm: (m, S, H) -> (m, S, H), what the HF
        backbone returns as ``last_hidden_state``."""
        raise NotImplementedError(f"{type(self).__name__} must implement final_hidden")

    def output_head(self) -> nn.Module:
        """The output projection (``lm_head``: weight (V, H), bias (V,) or None), a head module."""
        raise NotImplementedError(f"{type(self).__name__} must implement output_head")

    def output_projection(self) -> nn.Module:
        """The (V, H) projection ``final_hidden`` feeds, for a loss that applies the config's
        logit scaling / softcapping itself as TRL's fused head does; ``output_head()`` here
        (the generic path also answers it where the logits are transformed after it)."""
        return self.output_head()

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        """Final norm + output projection: (m, S, H) -> logits (m, S, V), as the model's forward."""
        return self.output_head()(self.final_hidden(hidden, microbatch, ctx))

    def loss_from_logits(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        """Summed next-token cross entropy over labels != -100 (after the causal shift, where
        ``label_shift``)."""
        labels = require_key(microbatch, "labels", type(self).__name__)
        return causal_lm_loss_sum(logits, labels, self.label_shift)

    def count_items(self, microbatch: Microbatch) -> int:
        """Tokens scored by ``head_loss``: labels != -100 after the causal shift (where
        ``label_shift``); 0 without ``labels`` (prediction on unlabeled data; training then
        refuses the empty batch)."""
        if microbatch.get("labels") is None:
            return 0
        return count_causal_items(microbatch["labels"], self.label_shift)


class ClassifierStagedModel(HFStagedModel):
    """Common part of the classification adapters (sequence and image): the summed
    classification loss and its item count under HF's ``problem_type`` rule, read from the
    microbatch's ``labels`` ((m,) int64 class ids with -100 ignored, or float targets for
    regression / multi-label).

    Subclasses implement structure, ``embed``, ``run_unit`` and ``head_logits`` (m, num_labels);
    ``head_loss`` and ``head_loss_and_logits`` (``HFStagedModel``) run the head once.
    Raises ValueError when the microbatch has no ``labels``.
    """

    def loss_from_logits(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        """Summed classification loss (see ``classification_loss_sum``)."""
        labels = require_key(microbatch, "labels", type(self).__name__)
        return classification_loss_sum(logits, labels, self.model.config)

    def count_items(self, microbatch: Microbatch) -> int:
        """Samples with label != -100 (single-label), else label elements; 0 without
        ``labels`` (prediction on unlabeled data; training then refuses the empty batch)."""
        if microbatch.get("labels") is None:
            return 0
        return count_classification_items(microbatch["labels"], self.model.config)


class LastTokenClassifierStagedModel(ClassifierStagedModel):
    """Common head of the decoder sequence classifiers (``LlamaForSequenceClassification``,
    ``GPT2ForSequenceClassification``, ...): the score layer on every position, then the
    logits of each row's last non-pad token (``pool_last_non_pad``), then the classification
    loss of ``ClassifierStagedModel`` (items = samples, or label elements for regression /
    multi-label).

    Subclasses implement the decoder body (``units``, ``embed``, ``run_unit``) and
    ``token_logits`` (final norm + score on every position); the head reads the microbatch's
    ``input_ids`` (m, S) to find the pooled position, as the model's forward does.
    """

    def token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + score: (m, S, H) -> (m, S, num_labels)."""
        raise NotImplementedError(f"{type(self).__name__} must implement token_logits")

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        """(m, S, H) -> pooled logits (m, num_labels), as ``model(**microbatch).logits``.

        Scores every position, then pools, in stock's order, so the arithmetic is stock's (the
        score layer is H x num_labels: S x more of it is small beside one decoder layer)."""
        input_ids = require_key(microbatch, "input_ids", type(self).__name__)
        return pool_last_non_pad(self.token_logits(hidden), input_ids,
                                 pad_token_id_of(self.model.config), type(self.model).__name__)

    def check_microbatch_sizes(self, sizes) -> None:
        """Without a pad token only one-row microbatches can be pooled (``check_poolable``):
        refuse a plan with some m_i > 1 on every rank alike, before the first collective."""
        if pad_token_id_of(self.model.config) is None and max(sizes, default=0) > 1:
            check_poolable(torch.zeros(max(sizes), 1, dtype=torch.long), None,
                           type(self.model).__name__)

    def count_items(self, microbatch: Microbatch) -> int:
        """As ``ClassifierStagedModel.count_items``; first the pad-token check of the head
        (``check_poolable``): the engine counts items before a step's first collective, so a
        microbatch the head would refuse is refused before this rank all-gathers anything."""
        input_ids = microbatch.get("input_ids")
        if input_ids is not None:
            check_poolable(input_ids, pad_token_id_of(self.model.config), type(self.model).__name__)
        return super().count_items(microbatch)


def causal_adapter(staged: StagedModel) -> "CausalLMStagedModel | None":
    """The causal-LM adapter inside ``staged`` (unwrapping ``.inner``: a user loss, head
    calls), or None for a classifier."""
    inner = staged
    while not isinstance(inner, CausalLMStagedModel) and hasattr(inner, "inner"):
        inner = inner.inner
    return inner if isinstance(inner, CausalLMStagedModel) else None


def is_causal_lm(staged: StagedModel) -> bool:
    """Whether ``staged`` (possibly wrapped) is a causal language model (the one way the
    runtime and the doors ask: the label shift, the output class, the shape of empty logits)."""
    return causal_adapter(staged) is not None


def empty_logits(staged: StagedModel, inputs: Mapping[str, Any], device=None) -> torch.Tensor:
    """The logits of 0 rows of ``inputs`` (a batch) as the model's forward would shape them:
    (0, T, vocab_size) for a causal LM (T from ``input_ids`` (rows, T), 0 without), (0, T, C)
    for a head scoring every position (``token_logits_width``: a token classifier's labels, a
    masked LM's vocabulary, question answering's start and end; an encoder-decoder LM's
    vocabulary, T its decoder's positions: ``logits_length``), (0, num_labels) for a
    classifier."""
    config = staged.model.config
    input_ids = inputs.get("input_ids")
    seq = input_ids.shape[1] if isinstance(input_ids, torch.Tensor) and input_ids.dim() > 1 \
        else 0
    length = getattr(staged, "logits_length", None)
    if callable(length):
        seq = length(inputs)
    if is_causal_lm(staged):
        return torch.zeros((0, seq, config.get_text_config().vocab_size), device=device)
    width = getattr(staged, "token_logits_width", None)
    if callable(width):
        return torch.zeros((0, seq, width()), device=device)
    return torch.zeros((0, config.num_labels), device=device)

