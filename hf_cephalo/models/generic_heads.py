"""The task heads of the generic path: which head a class has, its staged model, its check batch.

[Note: the generic task heads]
The generic staged model (``generic.py``) runs the model's own forward around its layers for
any head; what differs between tasks is the loss as a SUM with its item count (the engine
divides by the global count, docs/design.md contract 4), the shape of the logits and the
inputs the self-check feeds a tiny copy. A class's task is read from its name (its nearest
base class with a ``...For<Task>`` name), and the task's loss is stock's, item for item:

- causal LM: next-token cross entropy (``GenericCausalLM``); sequence and image
  classification: HF's ``problem_type`` rule over samples (``GenericEncoderClassifier``, or
  last-non-pad pooling for a decoder ``score`` head);
- token classification and masked LM: cross entropy of every position against ``labels``
  as given (no shift), items = labels != -100 (``ForTokenClassification`` / ``ForMaskedLM``);
- question answering: ``(CE(start) + CE(end)) / 2`` over rows; stock divides each term by
  its own count of positions inside the sequence, so only microbatches whose positions all
  lie inside it are exact (any other is refused before the step's first collective).
Every head is proven on a tiny copy by the self-check (``self_check.py``) before it stages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from hf_cephalo.models.base import HeadOutput, Microbatch
from hf_cephalo.models.generic import (GenericCausalLM, GenericContext, GenericDecoderBody,
                                       GenericEncoderClassifier, GenericSequenceClassifier)
from hf_cephalo.models.hf_common import IGNORE_INDEX, HFStagedModel, require_key

CAUSAL_LM = "CausalLM"
SEQUENCE_CLASSIFICATION = "SequenceClassification"
IMAGE_CLASSIFICATION = "ImageClassification"
TOKEN_CLASSIFICATION = "TokenClassification"
MASKED_LM = "MaskedLM"
QUESTION_ANSWERING = "QuestionAnswering"

CLASSIFIER_TASKS = frozenset({SEQUENCE_CLASSIFICATION, IMAGE_CLASSIFICATION})
"""Tasks whose labels are one per sample (HF's ``problem_type`` rule)."""

TOKEN_TASKS = frozenset({TOKEN_CLASSIFICATION, MASKED_LM})
"""Tasks scoring every position against ``labels`` (m, S) as given."""

ENCODER_TASKS = CLASSIFIER_TASKS | TOKEN_TASKS | {QUESTION_ANSWERING}
"""Tasks the generic path stages besides the causal LM (which a class may also prove by what
its forward computes, whatever its name: ``causal_check.causal_lm_problem``)."""

TASK_ALIASES = {"QuestionAnsweringSimple": QUESTION_ANSWERING}
"""Class-name suffixes that name a task under another word: XLNet's, XLM's and Flaubert's
``...ForQuestionAnsweringSimple`` is the plain span head (``qa_outputs`` -> start and end
logits, stock's ``(CE(start) + CE(end)) / 2``), as ``BertForQuestionAnswering``; their
``...ForQuestionAnswering`` is the beam-search head (start / end top-k, answer class)."""


def task_word(kind: str) -> str:
    """The task a ``...For<kind>`` class name says: ``kind`` itself, or its ``TASK_ALIASES``
    entry (``"QuestionAnsweringSimple"`` -> ``"QuestionAnswering"``)."""
    return TASK_ALIASES.get(kind, kind)


def task_of(cls: type) -> str | None:
    """The generic task of a model class: the ``...For<Task>`` suffix of its nearest base class
    that has one (read through ``task_word``), when that task is in ``ENCODER_TASKS`` or the
    causal LM; else None (``DeiTForImageClassificationWithTeacher``, ``BertForPreTraining``,
    a base model)."""
    for c in cls.__mro__:
        before, sep, kind = c.__name__.rpartition("For")
        if sep and before and kind[:1].isupper():
            kind = task_word(kind)
            return kind if kind in ENCODER_TASKS or kind == CAUSAL_LM else None
    return None


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> HeadOutput:
    """Summed cross entropy of every position against ``labels`` as given. logits (m, S, C),
    labels (m, S) with -100 ignored; as ``ForTokenClassification`` / ``ForMaskedLMLoss`` (fp32
    upcast of half logits) times its item count."""
    labels = labels.to(logits.device)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    flat = labels.reshape(-1)
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat,
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return HeadOutput(loss_sum, int((flat != IGNORE_INDEX).sum().item()))


class GenericTokenHead(GenericDecoderBody, HFStagedModel):
    """Token classification or masked LM on the generic path: the model's own head (the
    transform, decoder and bias of a masked LM; dropout and classifier of a token classifier),
    logits (m, S, C), the summed cross entropy against ``labels`` (m, S) as given (-100
    ignored), items = labels != -100."""

    def token_logits_width(self) -> int:
        """C of the logits (m, S, C): the vocabulary of a masked LM (its output embeddings'
        rows), else ``config.num_labels``."""
        if task_of(type(self.model)) == MASKED_LM:
            head = self.model.get_output_embeddings()
            weight = getattr(head, "weight", None)
            if isinstance(weight, torch.Tensor):
                return int(weight.shape[0])
            return int(self.model.config.get_text_config().vocab_size)
        return int(self.model.config.num_labels)

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                    ctx: GenericContext) -> torch.Tensor:
        """(m, S, H) -> logits (m, S, C), as ``model(**microbatch).logits``."""
        return self.head_forward(hidden, microbatch, ctx).logits

    def loss_from_logits(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        labels = require_key(microbatch, "labels", type(self).__name__)
        return token_loss_sum(logits, labels)

    def count_items(self, microbatch: Microbatch) -> int:
        """Positions with label != -100; 0 without ``labels``."""
        self.check_inputs(microbatch)
        labels = microbatch.get("labels")
        return 0 if labels is None else int((labels != IGNORE_INDEX).sum().item())


QA_LABELS = ("start_positions", "end_positions")


class GenericQuestionAnswering(GenericDecoderBody, HFStagedModel):
    """Extractive question answering on the generic path: the model's own ``qa_outputs`` head;
    ``head_logits`` (m, S, 2) = start and end logits stacked on the last dimension; the loss sum
    is ``(CE_sum(start) + CE_sum(end)) / 2`` over the rows, items = rows with both positions.

    Raises ValueError (in ``count_items``, before a step's first collective) for a microbatch
    with a position outside [0, S): stock clamps it to S and ignores it, dividing the start and
    end terms by different counts that depend on the padding, which a sum over items cannot
    reproduce on another cut of the batch.
    """

    prediction_outputs = ("start_logits", "end_logits")
    """The model's outputs ``head_logits`` stacks on its last dimension, in that order (stock's
    evaluation returns them as a tuple of predictions)."""

    def token_logits_width(self) -> int:
        """2: the start and end logits of every position."""
        return 2

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                    ctx: GenericContext) -> torch.Tensor:
        """(m, S, H) -> (m, S, 2): ``start_logits`` and ``end_logits`` of the model's output."""
        out = self.head_forward(hidden, microbatch, ctx)
        return torch.stack([out.start_logits, out.end_logits], dim=-1)

    def loss_from_logits(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        positions = [require_key(microbatch, k, type(self).__name__) for k in QA_LABELS]
        return answer_loss_sum(logits, positions, type(self.model).__name__)

    def count_items(self, microbatch: Microbatch) -> int:
        """Rows (each scored once for its start and once for its end); 0 without positions."""
        self.check_inputs(microbatch)
        positions = [microbatch.get(k) for k in QA_LABELS]
        if any(p is None for p in positions):
            return 0
        main = microbatch.get(getattr(self.model, "main_input_name", "input_ids"))
        if torch.is_tensor(main) and main.dim() > 1:
            check_answer_positions(positions, main.shape[1], type(self.model).__name__)
        return int(positions[0].reshape(-1).shape[0])


def answer_loss_sum(logits: torch.Tensor, positions: list[torch.Tensor],
                    model_name: str) -> HeadOutput:
    """Question answering's loss as a sum over rows: logits (m, S, 2) (start and end stacked),
    positions [start (m,) or (m, 1), end (m,) or (m, 1)] -> ``(CE_sum(start) + CE_sum(end)) /
    2``, items = m; stock's ``(CE(start) + CE(end)) / 2`` (means over rows, half logits
    upcast) times m. ValueError for a position outside [0, S) (``check_answer_positions``)."""
    check_answer_positions(positions, logits.shape[1], model_name)
    total = 0.0
    for j, target in enumerate(positions):
        scores = logits[..., j].float() if logits.dtype not in (
            torch.float32, torch.float64) else logits[..., j]
        total = total + F.cross_entropy(scores, target.reshape(-1).to(logits.device),
                                        reduction="sum")
    return HeadOutput(total / 2, int(positions[0].reshape(-1).shape[0]))


def check_answer_positions(positions: list[torch.Tensor], seq_len: int, model_name: str) -> None:
    """ValueError when an answer position lies outside [0, ``seq_len``) (the positions the
    logits score): stock ignores it and divides the start and end terms by separate counts,
    which a sum over rows cannot reproduce on another cut of the batch."""
    bad = [int(v) for p in positions for v in p.reshape(-1) if not 0 <= int(v) < seq_len]
    if bad:
        raise ValueError(
            f"{model_name}: answer positions {sorted(set(bad))[:5]} lie "
            f"outside the microbatch's {seq_len} tokens; stock ignores such a position and "
            "divides the start and end losses by separate counts that depend on how the "
            "batch is padded, which hf_cephalo cannot reproduce exactly on another cut of "
            "the batch. Point unanswerable questions at the [CLS] token (position 0), as "
            "transformers' question-answering preprocessing does.")


def staged_class(model: nn.Module) -> type:
    """The generic staged class for a model by its task (``task_of``): causal LM (also for a
    name of another task whose forward the self-check proved a causal LM's), a last-token
    classifier (a ``score`` head pooled at the last non-pad token, as
    ``GenericForSequenceClassification``), a position-pooled classifier (BERT's [CLS] pooler,
    an image classifier's own pooling), a token head, or question answering."""
    task = task_of(type(model))
    if task == SEQUENCE_CLASSIFICATION:
        if isinstance(getattr(model, "score", None), nn.Module):
            return GenericSequenceClassifier
        return GenericEncoderClassifier
    if task == IMAGE_CLASSIFICATION:
        return GenericEncoderClassifier
    if task in TOKEN_TASKS:
        return GenericTokenHead
    if task == QUESTION_ANSWERING:
        return GenericQuestionAnswering
    return GenericCausalLM


# ---- the self-check's batches -----------------------------------------------------------------

DEFAULT_IMAGE_SIZE = 64
"""The check's image side for a config that names none (a convolutional network takes any
size its downsampling leaves at least one pixel of: 64 / 32 = 2)."""


IMAGE_TOKENS = 16
"""The check's image length for a classifier of token-id images (ImageGPT's 32 x 32 images are
1024 ids; any length up to its positions is an image prefix it classifies)."""


def _image_shape(config: Any) -> tuple[int, int, int]:
    """(C, H, W) of the pixel inputs a vision config describes (``num_channels``,
    ``image_size`` an int or a pair; ``DEFAULT_IMAGE_SIZE`` where it names none); ValueError
    for an image size of another form."""
    channels = getattr(config, "num_channels", None) or 3
    size = getattr(config, "image_size", None) or DEFAULT_IMAGE_SIZE
    if isinstance(size, dict):
        size = (size.get("height"), size.get("width"))
    if isinstance(size, int):
        size = (size, size)
    if not (isinstance(size, (list, tuple)) and len(size) == 2
            and all(isinstance(s, int) and s > 0 for s in size)):
        raise ValueError(f"{type(config).__name__} names no image size (image_size = "
                         f"{getattr(config, 'image_size', None)!r}) to build the check's pixels")
    return int(channels), int(size[0]), int(size[1])


def class_labels(config: Any, rows: int, g: torch.Generator) -> torch.Tensor:
    """``rows`` labels by HF's ``problem_type`` rule (class ids, multi-label 0/1 floats, or
    regression targets) for a classifier of ``config``."""
    kind = config.problem_type or ("regression" if config.num_labels == 1
                                   else "single_label_classification")
    if kind == "single_label_classification":
        return torch.tensor([0, 1, 1, 0, 1, 0][:rows]) % max(int(config.num_labels), 1)
    if kind == "multi_label_classification":
        return (torch.rand(rows, config.num_labels, generator=g) > 0.5).float()
    return torch.randn(rows, config.num_labels, generator=g).squeeze(-1)


def image_batch(config: Any, rows: int = 4, seed: int = 0,
                main_input: str = "pixel_values") -> dict[str, torch.Tensor]:
    """``rows`` random images (rows, C, H, W) of the config's size (its ``vision_config``'s
    where it has one) and their labels. An image classifier whose input is
    ``input_ids`` and whose config names a vocabulary (ImageGPT: an image as a sequence of
    color-cluster ids; not a vision-language classifier such as ShieldGemma 2, whose text
    config does) gets ``rows`` sequences of ``IMAGE_TOKENS`` random ids of it instead, a patchified model
    (``_patchified``) its patch sequences (``patch_batch``)."""
    g = torch.Generator().manual_seed(seed)
    vision = getattr(config, "vision_config", None) or config
    if main_input == "input_ids" and isinstance(getattr(config, "vocab_size", None), int):
        ids = torch.randint(0, config.vocab_size - 1, (rows, IMAGE_TOKENS), generator=g)
        return {"input_ids": ids, "labels": class_labels(config, rows, g)}
    if _patchified(vision):
        return {**patch_batch(vision, rows, g), "labels": class_labels(config, rows, g)}
    pixels = torch.randn((rows, *_image_shape(vision)), generator=g)
    return {"pixel_values": pixels, "labels": class_labels(config, rows, g)}


def _patchified(config: Any) -> bool:
    """The vision config takes images as patch sequences of a variable grid (SigLIP 2's
    NaFlex form): it names a patch budget (``num_patches``) and a ``patch_size``, no
    ``image_size``."""
    return getattr(config, "image_size", None) is None and all(
        isinstance(getattr(config, k, None), int) for k in ("num_patches", "patch_size"))


def patch_batch(config: Any, rows: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """``rows`` images as their processor gives them to a patchified model (``_patchified``):
    ``pixel_values`` (rows, num_patches, patch_size**2 * C) of flattened patches,
    ``spatial_shapes`` (rows, 2) each image's (h, w) patch grid, and ``pixel_attention_mask``
    (rows, num_patches), 1 on an image's h * w patches and 0 on the padding after them; grids
    of different sizes, so the rows have different padding."""
    n, p = config.num_patches, config.patch_size
    channels = getattr(config, "num_channels", None) or 3
    side = max(int(n ** 0.5), 1)
    grids = [(side, side), (side, max(side - 1, 1)), (max(side - 1, 1), max(side // 2, 1))]
    shapes = torch.tensor([grids[r % len(grids)] for r in range(rows)])
    mask = (torch.arange(n)[None, :] < shapes.prod(-1)[:, None]).long()
    pixels = torch.randn((rows, n, p * p * channels), generator=g) * mask[..., None]
    return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": shapes}


def token_labels(task: str, config: Any, ids: torch.Tensor, mask: torch.Tensor,
                 g: torch.Generator) -> dict[str, torch.Tensor]:
    """The label keys of a text task for ids (B, S) with padding ``mask``: per-token classes
    (token classification), masked-out original ids (masked LM: about a third of the real
    tokens scored), or answer spans inside each row (question answering; with
    ``input_ids`` too where the model finds the question by its separators:
    ``QA_SEPARATORS``)."""
    if task == TOKEN_CLASSIFICATION:
        labels = torch.randint(0, max(int(config.num_labels), 1), ids.shape, generator=g)
        return {"labels": labels.masked_fill(mask == 0, IGNORE_INDEX)}
    if task == MASKED_LM:
        scored = (torch.rand(ids.shape, generator=g) < 0.35) & (mask == 1)
        scored[:, 1] = True
        return {"labels": ids.masked_fill(~scored, IGNORE_INDEX)}
    lengths = mask.sum(-1)
    start = (torch.rand(ids.shape[0], generator=g) * lengths).long()
    end = torch.minimum(start + 2, lengths - 1)
    spans = {"start_positions": start, "end_positions": end}
    if getattr(config, "model_type", None) in QA_SEPARATORS:
        spans["input_ids"] = _question_and_context(config, ids, mask)
    return spans


QA_SEPARATORS = {"longformer"}
"""Model types whose question-answering forward finds the question by the config's
``sep_token_id`` in every row (Longformer: exactly 3 separators, ``<s> question </s></s>
context </s>`` as its tokenizer lays a pair out, the tokens before the first one given
global attention) and refuses rows without them: their check rows are laid out so."""


def _question_and_context(config: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``ids`` (B, S), right-padded by ``mask``, as question / context pairs: the config's
    separator at positions q, q + 1 and the row's last real token (q = 2, less in a row
    shorter than 5 tokens) and nowhere else. ValueError for a row of fewer than 3 tokens."""
    sep = int(config.sep_token_id)
    other = sep + 1 if sep + 1 < config.vocab_size else sep - 1
    out = ids.masked_fill(ids == sep, other)
    for row, length in enumerate(mask.sum(-1).tolist()):
        if length < 3:
            raise ValueError(f"a row of {length} tokens cannot hold a question and a context")
        q = min(2, length - 3)
        out[row, [q, q + 1, length - 1]] = sep
    return out
