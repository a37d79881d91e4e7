"""Which transformers classes train on hf_cephalo, checked one by one (issue 36).

For every causal LM in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (and with
``--seq-cls`` every ``...ForSequenceClassification`` of a decoder or an encoder-decoder in
``MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES``), from the class's default config:

1. a tiny random model (sizes shrunk by ``models/shrink.tiny_config``; a field the default
   config leaves unset although the forward needs it set as a checkpoint or the user would,
   ``UNSET_DEFAULTS``; the transforms that
   change the math around the layers -- embedding / residual / attention multipliers, logit
   scaling and softcapping, the MoE router loss -- set to NON-default values where the config
   has them, so a skipped transform shows; norm weights moved off 1);
2. ``stage_model`` on it: staged, or refused with a reason;
3. for a staged model, an INDEPENDENT comparison (not the self-check's): a right-padded batch of
   5 rows (left-padded for classifiers) run as microbatches of 2 and 3 rows through ``embed`` /
   ``run_unit`` / ``head_loss`` (plus the global router loss), loss and every parameter gradient
   against the model's own ``model(**batch).loss.backward()`` (fp32, rtol 1e-5, atol 1e-6).

Status per class: ``exact`` (staged and equal), ``refused`` (with the reason; nothing would
run; this includes a tiny copy that does not build or run although transformers builds the
default config: the self-check refuses such a model the same way, and where the copy builds
but its forward fails on the batch, the reason is hf_cephalo's own refusal of it, which says
what inputs besides text the forward takes), ``not built`` (transformers
itself cannot build the class from its default config, on the meta device, e.g. it needs a
checkpoint-specific config), or ``WRONG`` (staged but not equal: a bug; the exit status is
then 1). ``--write-docs`` writes the table to docs/supported_models.md.

With ``--tasks`` (issue 47) also the classes of transformers' image-classification,
token-classification, masked-LM, question-answering, seq2seq-LM and speech-seq2seq mappings
(``TASK_MAPPINGS``), each on its task's inputs (images of the config's size, per-token labels,
masked-LM labels, answer spans); ``CRASH`` marks a raw exception from ``stage_model`` (never
allowed: a class outside the path gets one ``UnsupportedModelError``; the exit status is then
1). ``--rows-out FILE`` appends each row as it is done (JSON lines), ``--rows-in FILE ...``
renders rows of several such runs (the mappings run in parallel processes), and
``--no-causal --write-docs`` keeps the page's causal-LM part as generated before;
``--no-causal --recheck-docs --only NAME ... --write-docs`` takes the page's task rows as they
are, checks the ``--only`` classes again in each mapping that lists them and writes the page
(a fix that changes a few classes' rows, without the hours of a whole task sweep).

Run: ``python benchmarks/model_coverage.py [--seq-cls] [--tasks all] [--write-docs]
[--only NAME ...]`` (about 2 minutes for the causal LMs on 2 quiet CPU cores, far longer for
the task mappings, whose image classifiers run at their configs' image sizes; no downloads).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import transformers
from transformers.models.auto import configuration_auto, modeling_auto

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_cephalo.models import stage_model  # noqa: E402
from hf_cephalo.models.base import run_unit_in  # noqa: E402
from hf_cephalo.models.document_inputs import with_document_inputs  # noqa: E402
from hf_cephalo.models.generic_heads import (CAUSAL_LM, ENCODER_TASKS,  # noqa: E402
                                             IMAGE_CLASSIFICATION, MASKED_LM,
                                             QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION,
                                             TOKEN_CLASSIFICATION, image_batch, task_of,
                                             token_labels)
from hf_cephalo.models.registry import UnsupportedModelError  # noqa: E402
from hf_cephalo.models.self_check import (float64_batch, float64_copy,  # noqa: E402
                                          token_id_range)
from hf_cephalo.models.shrink import TINY_MAX_NUMEL, tiny_config, tiny_numel  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs",
                    "supported_models.md")

NON_DEFAULT = {  # config field -> value where the field exists (the transforms a path may skip)
    "embedding_multiplier": 3.0, "logits_scaling": 2.0, "residual_multiplier": 0.5,
    "attention_multiplier": 0.3, "logit_scale": 0.7, "final_logit_softcapping": 3.0,
    "attn_logit_softcapping": 4.0, "scale_emb": 2.5, "dim_model_base": 48,
    "output_router_logits": True, "router_aux_loss_coef": 0.3, "aux_loss_coef": 0.3,
}

UNSET_DEFAULTS = {  # config field -> value (from the config) where the default config leaves it
    # None although the forward needs it: every checkpoint sets it (DeepSeek-V2's default has no
    # experts per token), or the user must (X-MOD: model.set_default_language(...))
    "num_experts_per_tok": lambda cfg: 2,
    "default_language": lambda cfg: (getattr(cfg, "languages", None) or [None])[0],
}


CAUSAL = "causal-lm"
TASK_MAPPINGS = {  # --tasks name -> transformers' mapping of that task
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
}


TEXT_ONLY = (" An `exact` class here is an audio- or vision-language model whose own forward on "
             "text is a causal LM's: staged for **text-only** fine-tuning of its language model "
             "(a batch with `input_features`, `pixel_values` or other non-text inputs is "
             "refused, docs/adding_a_model.md \"Vision-language models on text\"); the "
             "encoder-decoders (a forward taking `decoder_input_ids`) are refused")
SEQ2SEQ_NOTE = (TEXT_ONLY + ", except T5's, mT5's, UMT5's, LongT5's, BART's, mBART's, "
                "Pegasus's, T5Gemma's and T5Gemma 2's `...ForConditionalGeneration` and "
                "`MarianMTModel`, and those of BART's kin (Blenderbot, Blenderbot-small, PLBart, "
                "MVP, M2M100, FSMT, BigBird-Pegasus, LED, PEGASUS-X), which train as seq2seq "
                "models (their own loss on `labels`, the decoder's input their own shift of "
                "them: models/seq2seq.py, models/seq2seq_families.py, models/seq2seq_t5_kin.py, "
                "models/seq2seq_kin.py, models/seq2seq_gemma.py; T5Gemma 2 on text only, its "
                "vision tower unused and a batch with `pixel_values` refused).")
SPEECH_NOTE = (TEXT_ONLY + ", except Whisper's, Speech2Text's, Moonshine's and Pop2Piano's "
               "`...ForConditionalGeneration`, which train as speech-to-text models (random audio "
               "as each one's feature extractor gives it: log-mel `input_features`, frames of "
               "features or raw `input_values`, and token `labels`; their own loss and label "
               "shift: models/whisper.py, models/speech_seq2seq.py, models/seq2seq_t5_kin.py).")
TASK_NOTES = {"seq2seq-lm": SEQ2SEQ_NOTE, "speech-seq2seq": SPEECH_NOTE}
"""What a mapping's `exact` means where it is not the task's own training."""


@dataclass
class Row:
    model_type: str
    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0
    mapping: str = CAUSAL


def _config(model_type: str):
    config = configuration_auto.CONFIG_MAPPING[model_type]()
    text = config.get_text_config()
    for cfg in {id(config): config, id(text): text}.values():
        fields = cfg.to_dict()
        for key, value in NON_DEFAULT.items():
            if key in fields:
                setattr(cfg, key, value)
        for key, value in UNSET_DEFAULTS.items():
            if key in fields and fields[key] is None:
                setattr(cfg, key, value(cfg))
        # an encoder-decoder's forward fills the shifted labels' -100 with the pad id, which
        # Moonshine's default config leaves None: the eos id, as a checkpoint or the user sets it
        if getattr(cfg, "is_encoder_decoder", False) and "pad_token_id" in fields and \
                fields["pad_token_id"] is None and isinstance(fields.get("eos_token_id"), int):
            cfg.pad_token_id = cfg.eos_token_id
        # T5's default config has no decoder start token; every T5 checkpoint sets the pad id
        if getattr(cfg, "is_encoder_decoder", False) and \
                getattr(cfg, "decoder_start_token_id", None) is None and \
                isinstance(getattr(cfg, "pad_token_id", None), int):
            cfg.decoder_start_token_id = cfg.pad_token_id
    return config


FEATURES_AS_EMBEDDINGS = {"pop2piano"}
"""Speech encoder-decoders whose encoder takes the feature extractor's ``input_features``
(frames x d_model) as its input embeddings, although their ``main_input_name`` is
``input_ids`` (Pop2Piano): the sweep feeds them features, their training input."""


def _speech_batch(config, seed: int, main_input: str,
                  padded_mels: bool) -> dict[str, torch.Tensor]:
    """5 rows of random audio and token labels of lengths 6, 3, 5, 2, 6 padded with -100. The
    audio as the model's feature extractor gives it: with ``padded_mels``, log-mel features
    (num_mel_bins x 2 x max_source_positions) that every clip is padded to (Whisper); else
    features (frames x input_feat_per_channel x input_channels: Speech2Text; frames x d_model:
    ``FEATURES_AS_EMBEDDINGS``) or raw samples (``input_values``: Moonshine) of 64 frames /
    4000 samples, with an ``attention_mask`` marking each row's length (64, 40, 56, 24, 64
    frames; samples in proportion)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(4, config.vocab_size - 8, (5, 6), generator=g)
    labels[torch.arange(6)[None, :] >= torch.tensor([6, 3, 5, 2, 6])[:, None]] = -100
    if padded_mels:
        features = torch.randn(5, config.num_mel_bins, 2 * config.max_source_positions,
                               generator=g)
        return {"input_features": features, "labels": labels}
    steps = 4000 if main_input == "input_values" else 64
    width = config.d_model if config.model_type in FEATURES_AS_EMBEDDINGS else \
        getattr(config, "input_feat_per_channel", 0) * getattr(config, "input_channels", 0)
    shape = (5, steps) if main_input == "input_values" else (5, steps, width)
    lengths = torch.tensor([64, 40, 56, 24, 64]) * steps // 64
    mask = (torch.arange(steps)[None, :] < lengths[:, None]).long()
    return {main_input: torch.randn(*shape, generator=g), "attention_mask": mask,
            "labels": labels}


def _batch(config, task: str, seed: int = 0, cls: type | None = None) -> dict[str, torch.Tensor]:
    """5 rows for ``task``: images (image classification); audio for a speech encoder-decoder
    whose input is ``input_features`` or ``input_values`` (``_speech_batch``: Whisper,
    Speech2Text, Moonshine, Pop2Piano); else 11 tokens right-padded (left for a sequence
    classifier) to lengths 11, 6, 9, 4, 11 with the task's labels, and the boxes / HTML paths
    of a document model whose forward takes them (``models.document_inputs``)."""
    if task == IMAGE_CLASSIFICATION:
        return image_batch(config, rows=5, seed=seed,
                           main_input=getattr(cls, "main_input_name", None) or "pixel_values")
    main_input = getattr(cls, "main_input_name", None)
    if getattr(config, "model_type", None) in FEATURES_AS_EMBEDDINGS:
        main_input = "input_features"
    padded_mels = main_input == "input_features" and hasattr(config, "num_mel_bins") and \
        hasattr(config, "max_source_positions")
    framed = getattr(config, "is_encoder_decoder", False) and (
        main_input == "input_values" or
        main_input == "input_features" and hasattr(config, "input_feat_per_channel") or
        config.model_type in FEATURES_AS_EMBEDDINGS)
    if padded_mels or framed:
        return _speech_batch(config, seed, main_input, padded_mels)
    classifier = task == SEQUENCE_CLASSIFICATION
    g = torch.Generator().manual_seed(seed)
    text = config.get_text_config()
    vocab = token_id_range(config)  # CANINE: Unicode code points, no vocab_size
    rows, seq = 5, 11
    ids = torch.randint(4, vocab - 8, (rows, seq), generator=g)
    pad = getattr(text, "pad_token_id", None)
    pad = pad if isinstance(pad, int) else 0
    lengths = torch.tensor([11, 6, 9, 4, 11])
    pos = torch.arange(seq)[None, :]
    mask = (pos >= seq - lengths[:, None]).long() if classifier else \
        (pos < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad)
    if classifier and getattr(config, "is_encoder_decoder", False):
        ids = _end_with_eos(ids, text)
    batch = {"input_ids": ids, "attention_mask": mask}
    if classifier:
        batch["labels"] = torch.tensor([0, 1, 1, 0, 1]) % max(int(config.num_labels), 1)
    elif task in (TOKEN_CLASSIFICATION, MASKED_LM, QUESTION_ANSWERING):
        batch.update(token_labels(task, config, ids, mask, g))
    else:
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, 2] = -100
        batch["labels"] = labels
    # boxes / HTML paths where the forward takes them ([Note: document inputs])
    return batch if cls is None else with_document_inputs(cls, config, batch, seed)


def _end_with_eos(ids: torch.Tensor, config) -> torch.Tensor:
    """``ids`` (left-padded: the last column is real in every row) ending each row with the
    config's eos token and holding it nowhere else: an encoder-decoder classifier (BART's,
    T5's) pools each row at its last eos and refuses a row without one, as a tokenizer's
    output never is."""
    eos = getattr(config, "eos_token_id", None)
    if not isinstance(eos, int):
        return ids
    ids = ids.masked_fill(ids == eos, eos + 1 if eos + 1 < config.vocab_size else eos - 1)
    ids[:, -1] = eos
    return ids


def _staged_loss_and_grads(model, staged, batch, sizes=(2, 3)):
    start, mbs = 0, []
    for m in sizes:
        mbs.append({k: v[start:start + m] for k, v in batch.items()})
        start += m
    n = sum(staged.count_items(mb) for mb in mbs)
    model.zero_grad(set_to_none=True)
    staged.begin_step()
    try:
        total = 0.0
        for mb in mbs:
            hidden, ctx = staged.embed(mb)
            for i in range(staged.num_units):  # with the side inputs units make (T5, BART)
                hidden, ctx = run_unit_in(staged, i, hidden, ctx)
            total = total + staged.head_loss(hidden, mb, ctx).loss_sum / n
        sums = staged.global_loss_sums()
        extra = 0.0 if sums is None else staged.finish_global_loss(sums)
        loss = total + extra
        loss.backward()
    finally:
        staged.end_step()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


def compare(model, batch) -> str | None:
    """None when the staged loss and gradients equal the model's own, else what differs; on a
    difference in fp32, compared again in float64 (the self-check's rule: [Note: fp32 rounding
    or another computation] in models/self_check.py), and "rounding: ..." when equal there."""
    pristine = copy.deepcopy(model)
    problem = _compare_once(model, batch)
    if problem is None:
        return None
    try:
        wide_batch = float64_batch(batch)
        again = _compare_once(float64_copy(pristine), wide_batch)
        if again is not None:  # eager float64 attention may be NaN on padding: SDPA
            again = _compare_once(float64_copy(pristine, sdpa=True), wide_batch)
    except Exception as exc:  # noqa: BLE001 - no float64 run: the fp32 verdict stands
        return f"{problem} (float64 did not run: {_short(exc)})"
    return problem if again is not None else f"rounding: {problem} in fp32, equal in float64"


def _compare_once(model, batch) -> str | None:
    staged = _stage(model)
    staged.prepare_for_training()
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    out = ref(**batch)
    out.loss.backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    loss, grads = _staged_loss_and_grads(model, staged, batch)
    if not torch.allclose(loss.double(), out.loss.detach().double(), rtol=RTOL, atol=ATOL):
        return f"loss {float(loss):.7g} vs the model's {float(out.loss):.7g}"
    for key, g in grads.items():
        r = ref_grads[key]
        g = torch.zeros_like(r) if g is None and r is not None else g
        r = torch.zeros_like(g) if r is None and g is not None else r
        if g is not None and not torch.allclose(g, r, rtol=RTOL, atol=ATOL):
            return f"gradient of {key} off by {float((g - r).abs().max()):.3g}"
    return None


class _Crash(Exception):
    """``stage_model`` raised something other than ``UnsupportedModelError``: a raw exception,
    which a class outside the path must never get (status ``CRASH``)."""


def _stage(model):
    try:
        return stage_model(model)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - a raw exception from stage_model
        raise _Crash(_short(exc)) from exc


def check(model_type: str, class_name: str, mapping: str = CAUSAL) -> Row:
    """Build, stage and compare one class (see the module docstring)."""
    t0 = time.perf_counter()
    row = _check(model_type, class_name)
    row.mapping, row.seconds = mapping, time.perf_counter() - t0
    return row


def _check(model_type: str, class_name: str) -> Row:
    cls = getattr(transformers, class_name, None)
    if cls is None:
        return Row(model_type, class_name, "not built", "not importable from transformers")
    task = task_of(cls)
    task = task if task in ENCODER_TASKS else CAUSAL_LM
    classifier = task == SEQUENCE_CLASSIFICATION
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = tiny_config(_config(model_type))
            text = config.get_text_config()
            if classifier and getattr(text, "pad_token_id", None) is None:
                text.pad_token_id = 0
            config._attn_implementation = "eager"
            numel = tiny_numel(cls, config)
    except Exception as exc:  # noqa: BLE001 - the class does not build in transformers
        if not _default_builds(cls, model_type):
            return Row(model_type, class_name, "not built", _short(exc))
        return _default_refusal(cls, model_type, exc)  # the shrink fails: stage_model decides
    if numel > TINY_MAX_NUMEL:  # the self-check refuses it the same way (never allocated)
        return Row(model_type, class_name, "refused",
                   f"the tiny copy would hold {numel / 1e6:.0f}M parameters: its config has "
                   "sizes the self-check does not shrink")
    model = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model = cls(config).float().eval()
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 1:
                        p.add_(0.1 * torch.randn(p.shape))
            batch = _batch(config, task, cls=cls)
            with torch.no_grad():  # (no graph left in a module that keeps its last state)
                # transformers' own forward must run for a comparison to mean much; on a copy:
                # a forward may change its model (BigBird-Pegasus switches its block-sparse
                # attention to full on short rows), and the staging must see the model as built
                copy.deepcopy(model)(**batch)
    except Exception as exc:  # noqa: BLE001 - the tiny copy does not build / run
        if not _default_builds(cls, model_type):
            return Row(model_type, class_name, "not built", _short(exc))
        try:
            reason = _refusal(model)  # built, its forward failed: hf_cephalo's words
        except _Crash as crash:
            return Row(model_type, class_name, "CRASH", str(crash))
        return Row(model_type, class_name, "refused",
                   reason or f"the self-check's tiny copy does not build or run ({_short(exc)})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            problem = compare(model, batch)
    except UnsupportedModelError as exc:
        reason = str(exc).split(": ", 1)[-1].split(". Nothing was run")[0]
        return Row(model_type, class_name, "refused", reason)
    except _Crash as crash:
        return Row(model_type, class_name, "CRASH", str(crash))
    except Exception as exc:  # noqa: BLE001 - staged, then failed: a bug of ours
        return Row(model_type, class_name, "WRONG", f"staged, then raised {_short(exc)}")
    status = "exact" if problem is None or problem.startswith("rounding: ") else "WRONG"
    return Row(model_type, class_name, status, problem or "")


def _refusal(model) -> str | None:
    """hf_cephalo's reason for refusing ``model`` (a tiny copy whose own forward failed on the
    batch: the self-check runs the same forward and says what the model needs), or None where
    there is no model or it stages; ``_Crash`` for a raw exception."""
    if model is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _stage(model)
    except UnsupportedModelError as exc:
        return str(exc).split(": ", 1)[-1].split(". Nothing was run")[0]
    return None


def _default_refusal(cls: type, model_type: str, exc: BaseException) -> Row:
    """The row of a class whose default config builds but whose tiny config does not: what
    ``stage_model`` says of the default-config model on the meta device (a refusal, or
    ``CRASH``)."""
    name = cls.__name__
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = cls(configuration_auto.CONFIG_MAPPING[model_type]())
    try:
        reason = _refusal(model)
    except _Crash as crash:
        return Row(model_type, name, "CRASH", str(crash))
    return Row(model_type, name, "refused", reason or f"the tiny copy does not build "
               f"({_short(exc)}), yet stage_model staged the default-config model")


def _default_builds(cls: type, model_type: str) -> bool:
    """Whether transformers builds ``cls`` from its default config (on the meta device: no
    memory, no forward), i.e. whether a tiny copy that fails is the shrink's failure."""
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            cls(configuration_auto.CONFIG_MAPPING[model_type]())
        return True
    except Exception:  # noqa: BLE001
        return False


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) < 160 else text[:157] + "..."


def classes(seq_cls: bool, mapping: str = CAUSAL) -> list[tuple[str, str]]:
    """(model type, class name) of one mapping (``TASK_MAPPINGS``; the causal LMs, with
    ``seq_cls`` also every decoder's and encoder-decoder's sequence classifier), sorted by
    model type."""
    if mapping != CAUSAL:
        pairs = sorted(getattr(modeling_auto, TASK_MAPPINGS[mapping]).items())
    else:
        pairs = sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
    if seq_cls and mapping == CAUSAL:  # the decoders' and the encoder-decoders' classifiers
        decoders = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | \
            set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
        pairs += sorted((t, n) for t, n in
                        modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.items()
                        if t in decoders)
    out = []
    for model_type, names in pairs:
        for name in (names if isinstance(names, (tuple, list)) else (names,)):
            out.append((model_type, name))
    return out


def summary(rows: list[Row]) -> str:
    """One line of counts: classes, built, exact (share of built), refused, wrong, crash."""
    built = [r for r in rows if r.status != "not built"]
    count = {k: len([r for r in rows if r.status == k]) for k in ("exact", "refused", "WRONG",
                                                                  "CRASH")}
    return (f"Of {len(rows)} classes, {len(built)} build; of those {count['exact']} are exact "
            f"({100.0 * count['exact'] / max(len(built), 1):.0f}%), {count['refused']} refused, "
            f"{count['WRONG']} wrong, {count['CRASH']} crash.")


def _table(rows: list[Row]) -> list[str]:
    lines = ["| model type | class | status | reason |", "|---|---|---|---|"]
    for r in rows:
        detail = r.detail.replace("|", "\\|").replace("\n", " ") \
            if r.status != "exact" or r.detail else ""
        lines.append(f"| {r.model_type} | `{r.name}` | {r.status} | {detail} |")
    return lines


def _kept_causal(text: str) -> list[str]:
    """The causal-LM part of an existing page (its lines before the first task section)."""
    lines = text.rstrip("\n").split("\n")
    end = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    while end and not lines[end - 1].strip():
        end -= 1
    return lines[:end]


def render(rows: list[Row], kept: str | None = None) -> str:
    """The page: the causal-LM table from ``rows``, or (no causal rows) kept from the page
    ``kept``, then one section per task mapping in ``rows``."""
    causal = [r for r in rows if r.mapping == CAUSAL]
    if not causal and kept is not None:
        return "\n".join(_kept_causal(kept) + _task_sections(rows)) + "\n"
    lines = [
        "# Supported models",
        "",
        "Generated by `python benchmarks/model_coverage.py --seq-cls --tasks all --write-docs` "
        f"with transformers {transformers.__version__} and torch "
        f"{torch.__version__.split('+')[0]}; do not edit by hand.",
        "",
        "Each class of transformers' causal-LM mapping (and each decoder's and "
        "encoder-decoder's sequence classifier, its rows ending with the eos token an "
        "encoder-decoder's classifier pools at) as a tiny random model from its default "
        "config (where it leaves a field the forward needs unset, the value a checkpoint or the user sets: the experts "
        "per token, X-MOD's default language), with embedding / "
        "residual / attention multipliers, logit scaling and softcapping and the MoE router "
        "loss set to non-default values where the config has them: `exact` means "
        "hf_cephalo stages it and its staged loss and every gradient over two microbatches "
        "equal the model's own (fp32, rtol 1e-5 / atol 1e-6; where fp32 rounding of the "
        "reordered sums exceeds that, as for Gemma 4's scaled embeddings, equal in float64 "
        "at the same tolerances, and the fp32 difference is shown); `refused` means hf_cephalo "
        "refuses it before anything runs, with the reason shown (including a tiny copy for "
        "the self-check that does not build or run: such a model is refused the same way); "
        "`not built` means transformers itself cannot build the class from its default config "
        "(a real checkpoint's config may build, and then the self-check decides); `crash` "
        "would be a raw exception from `stage_model` (a bug: the sweep fails). The other "
        "tasks' mappings follow, each checked the same way on its own inputs (images for "
        "image classification; per-token labels, masked-LM labels or answer spans on text).",
        "",
        summary(causal),
        "",
        *_table(causal),
    ]
    return "\n".join(lines + _task_sections(rows)) + "\n"


def _task_sections(rows: list[Row]) -> list[str]:
    lines: list[str] = []
    for mapping in TASK_MAPPINGS:
        part = [r for r in rows if r.mapping == mapping]
        if part:
            total = len(classes(False, mapping))
            reached = "" if len(part) >= total else (
                f" This run reached {len(part)} of the mapping's {total} classes (the sweep "
                "was stopped); the others are not checked here.")
            lines += ["", f"## {mapping} (`{TASK_MAPPINGS[mapping]}`)", "",
                      "Generated by `python benchmarks/model_coverage.py --no-causal --tasks "
                      f"{mapping} --write-docs`.{reached}{TASK_NOTES.get(mapping, '')}", "",
                      summary(part), "", *_table(part)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-cls", action="store_true",
                        help="also every decoder's and encoder-decoder's "
                             "...ForSequenceClassification")
    parser.add_argument("--tasks", nargs="*", default=[],
                        help=f"also these mappings ({', '.join(TASK_MAPPINGS)}, or all)")
    parser.add_argument("--no-causal", action="store_true",
                        help="skip the causal-LM mapping (--write-docs keeps the page's)")
    parser.add_argument("--write-docs", action="store_true", help=f"write {DOCS}")
    parser.add_argument("--rows-out", help="also write the rows as JSON lines to this file")
    parser.add_argument("--rows-in", nargs="*", default=[],
                        help="take these files' rows (from --rows-out) instead of checking")
    parser.add_argument("--only", nargs="*", help="class names to check (default: all)")
    parser.add_argument("--recheck-docs", action="store_true",
                        help="take the page's task rows, check the --only classes again "
                             "(needs --no-causal and --only)")
    parser.add_argument("--smoke", action="store_true",
                        help="Qwen3ForCausalLM only, no docs written (the suite's check that "
                             "the sweep runs)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.only, args.write_docs = ["Qwen3ForCausalLM"], False
    tasks = list(TASK_MAPPINGS) if "all" in args.tasks else args.tasks
    unknown = sorted(set(tasks) - set(TASK_MAPPINGS))
    if unknown:
        parser.error(f"unknown --tasks {unknown}")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    t0 = time.perf_counter()
    mappings = ([] if args.no_causal else [CAUSAL]) + tasks
    if args.recheck_docs and not (args.no_causal and args.only):
        parser.error("--recheck-docs needs --no-causal and --only")
    rows = _read_rows(args.rows_in) if args.rows_in else _recheck_page(args.only) \
        if args.recheck_docs else _check_all(mappings, args)
    mappings = list(dict.fromkeys(r.mapping for r in rows))
    for mapping in mappings:
        part = [r for r in rows if r.mapping == mapping]
        print(f"{mapping}: {summary(part)}")
    print(f"{time.perf_counter() - t0:.0f} s")
    if args.write_docs:
        with open(DOCS) as f:
            kept = f.read()
        with open(DOCS + ".tmp", "w") as f:
            f.write(render(rows, kept))
        os.replace(DOCS + ".tmp", DOCS)
        print(f"wrote {os.path.normpath(DOCS)}")
    return 1 if any(r.status in ("WRONG", "CRASH") for r in rows) else 0


def _check_all(mappings: list[str], args) -> list[Row]:
    """Every class of ``mappings`` checked (``--only`` ones), each row printed and, with
    ``--rows-out``, appended to that file as it is done (a long sweep can be rendered from the
    rows of several processes, ``--rows-in``)."""
    rows = []
    if args.rows_out:
        open(args.rows_out, "w").close()
    for mapping in mappings:
        for model_type, name in classes(args.seq_cls, mapping):
            if args.only and name not in args.only:
                continue
            row = check(model_type, name, mapping)
            rows.append(row)
            print(f"{row.status:9s} {name:48s} {row.seconds:6.2f}s  {row.detail[:110]}",
                  flush=True)
            if args.rows_out:
                with open(args.rows_out, "a") as f:
                    f.write(json.dumps(dataclasses.asdict(row)) + "\n")
    return rows


def page_rows(text: str) -> list[Row]:
    """The task sections' rows of a page ``render`` wrote (status, reason; no seconds), in
    page order: ``render(page_rows(text), text) == text``."""
    rows, mapping = [], None
    for line in text.split("\n"):
        if line.startswith("## "):
            mapping = line[3:].split(" ", 1)[0]
        elif mapping and line.startswith("| ") and not line.startswith("| model type"):
            cells = re.split(r"(?<!\\) \| ", line[2:-2])
            if len(cells) != 4:
                raise ValueError(f"not a row of 4 cells: {line!r}")
            model_type, name, status, detail = cells
            rows.append(Row(model_type, name.strip("`"), status, detail.replace("\\|", "|"),
                            mapping=mapping))
    return rows


def _recheck_page(only: list[str]) -> list[Row]:
    """The page's task rows, those of the ``only`` classes checked again (each printed)."""
    with open(DOCS) as f:
        rows = page_rows(f.read())
    for i, row in enumerate(rows):
        if row.name in only:
            rows[i] = check(row.model_type, row.name, row.mapping)
            print(f"{rows[i].status:9s} {row.name:48s} {row.mapping}  {rows[i].detail[:90]}",
                  flush=True)
    return rows


def _read_rows(paths: list[str]) -> list[Row]:
    """The rows of ``paths`` in order; a later file's row for the same (mapping, model type,
    class) replaces an earlier one in place (a re-check of a few classes)."""
    rows: dict[tuple[str, str, str], Row] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = Row(**json.loads(line))
                    rows[(row.mapping, row.model_type, row.name)] = row
    return list(rows.values())


if __name__ == "__main__":
    sys.exit(main())
