"""Find the staged-model adapter for a Hugging Face model by its class (docs/design.md contract 5).

Lookup walks the model's class hierarchy, so a user subclass of ``LlamaForCausalLM`` gets the
Llama adapter. Users add their own architectures with ``register_adapter`` (see
docs/adding_a_model.md).
"""

from __future__ import annotations

import functools
import re

import torch
import transformers
from torch import nn

from hf_cephalo.models.base import StagedModel
from hf_cephalo.models.generic_heads import task_word
from hf_cephalo.models.gpt2 import GPT2SequenceClassifierStagedModel, GPT2StagedModel
from hf_cephalo.models.gpt_neox import GPTNeoXStagedModel
from hf_cephalo.models.peft_lora import is_peft_model, unwrap_peft_model
from hf_cephalo.models.seq2seq import BartStagedModel, T5StagedModel
from hf_cephalo.models.seq2seq_families import (MarianStagedModel, MBartStagedModel,
                                                PegasusStagedModel)
from hf_cephalo.models.seq2seq_gemma import T5Gemma2StagedModel, T5GemmaStagedModel
from hf_cephalo.models.seq2seq_heads import SEQ2SEQ_HEAD_ADAPTERS
from hf_cephalo.models.seq2seq_t5_kin import (T5_KIN_REFUSALS, LongT5StagedModel,
                                              MT5StagedModel, Pop2PianoStagedModel,
                                              T5TokenClassifierStagedModel, UMT5StagedModel)
from hf_cephalo.models.seq2seq_kin import (NOT_EXACT, BigBirdPegasusStagedModel,
                                           BlenderbotSmallStagedModel, BlenderbotStagedModel,
                                           FSMTStagedModel, LEDStagedModel, M2M100StagedModel,
                                           MvpStagedModel, PegasusXStagedModel, PLBartStagedModel)
from hf_cephalo.models.speech_seq2seq import MoonshineStagedModel, Speech2TextStagedModel
from hf_cephalo.models.whisper import WhisperStagedModel

_ADAPTERS: dict[str, type[StagedModel]] = {}

MIN_TRANSFORMERS_MAJOR = 5
"""The built-in adapters follow transformers 5.x module layouts and mask builders (the model
tests pass on 5.24 and 5.25, not on 5.22 or older: pyproject.toml requires 5.24); 4.x lays
models out differently (e.g. ``vit.encoder.layer``, ``past_key_values``)."""


def check_transformers_version(version: str) -> None:
    """Raise ValueError if ``version`` (e.g. "4.46.0") is older than the adapters support."""
    major = int(version.split(".")[0])
    if major < MIN_TRANSFORMERS_MAJOR:
        raise ValueError(f"hf_cephalo's model adapters need "
                         f"transformers>={MIN_TRANSFORMERS_MAJOR}.0 "
                         f"(found {version}); upgrade with `pip install -U 'transformers>=5'`.")


def register_adapter(model_class: type | str, adapter: type[StagedModel]) -> None:
    """Use ``adapter`` (a ``StagedModel`` subclass taking the model as its only argument) for
    models of class ``model_class`` (the class or its ``__name__``) and their subclasses.

    Raises TypeError if ``adapter`` is not a StagedModel subclass. A later registration for the
    same class name replaces the earlier one.
    """
    if not (isinstance(adapter, type) and issubclass(adapter, StagedModel)):
        raise TypeError(f"adapter must be a StagedModel subclass, got {adapter!r}")
    name = model_class if isinstance(model_class, str) else model_class.__name__
    _ADAPTERS[name] = adapter


def supported_model_classes() -> list[str]:
    """Names of the model classes with a registered adapter, sorted."""
    return sorted(_ADAPTERS)


def adapter_summary() -> str:
    """The registered adapters in one short phrase for messages: how many classes of how many
    model types, the types by name (``config_class.model_type`` of the transformers class; a
    class that is not one of transformers' is named itself) and where each class is listed,
    e.g. "38 classes of 25 model types (bart, ..., whisper; each class:
    hf_cephalo.models.supported_model_classes(), docs/supported_models.md)". One class name
    per adapter made the messages grow by a line with each new family."""
    types = set()
    for name in supported_model_classes():
        config_class = getattr(getattr(transformers, name, None), "config_class", None)
        types.add(getattr(config_class, "model_type", None) or name)
    return (f"{len(_ADAPTERS)} classes of {len(types)} model types ({', '.join(sorted(types))};"
            f" each class: hf_cephalo.models.supported_model_classes(), "
            f"docs/supported_models.md)")


class UnsupportedModelError(ValueError):
    """No adapter for a model's class. ``alternatives``: supported classes that can stand in
    for the model, i.e. heads of the same architecture (same ``config.model_type``) for a bare
    base model without a head (``["BertForSequenceClassification"]`` for a ``BertModel``);
    empty when the model has a head of its own (loading another head would train another
    task) or the architecture has no adapter."""

    def __init__(self, message: str, alternatives: list[str]):
        super().__init__(message)
        self.alternatives = alternatives


GUIDE = "docs/adding_a_model.md"
"""How to write and register an adapter; every unsupported-model message points to it."""


def _same_architecture(model: nn.Module) -> list[str]:
    """Class names of the model's architecture (its ``config.model_type``) that hf_cephalo
    trains: its causal-LM and sequence-classification heads in transformers' auto mappings
    (the generic path stages those; the classifier first for an encoder, which has a masked-LM
    head), then its image-classification, token-classification, question-answering and
    masked-LM heads, then classes with a registered adapter; no repeats."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return []
    from transformers.models.auto import modeling_auto as auto

    names = [auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type),
             auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)]
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:  # an encoder: classify first
        names.reverse()
    names += [mapping.get(model_type) for mapping in (  # the generic path's other task heads
        auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)]
    names += [name for name in supported_model_classes()
              if getattr(getattr(getattr(transformers, name, None), "config_class", None),
                         "model_type", None) == model_type]
    return list(dict.fromkeys(n for n in names if isinstance(n, str)))


def head_kind(class_name: str) -> str | None:
    """The task of a Hugging Face class from its name: ``"SequenceClassification"`` for
    ``LlamaForSequenceClassification``, ``"CausalLM"`` for ``...ForCausalLM`` and GPT-2's
    ``...LMHeadModel``; ``"QuestionAnswering"`` for XLNet's ``...ForQuestionAnsweringSimple``
    (``generic_heads.task_word``); None for a name of neither form (a base model such as
    ``BertModel``)."""
    if class_name.endswith("LMHeadModel"):
        return "CausalLM"
    before, sep, kind = class_name.rpartition("For")
    return task_word(kind) if sep and before and kind[:1].isupper() else None


def _model_head_kind(model: nn.Module) -> str | None:
    """``head_kind`` of the model's class or its nearest base class that has one (a user
    subclass ``MyClassifier(OPTForSequenceClassification)`` is a sequence classifier); a class
    whose name says no head but that transformers lists as a causal LM
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: ``BertGenerationDecoder``) is a causal LM (the
    self-check still proves its forward one by what it computes)."""
    for cls in type(model).__mro__:
        kind = head_kind(cls.__name__)
        if kind is None and cls.__name__ in causal_lm_class_names():
            kind = "CausalLM"
        if kind:
            return kind
    return None


@functools.lru_cache(maxsize=None)
def causal_lm_class_names() -> frozenset[str]:
    """Class names in transformers' causal-LM auto mapping (read once)."""
    from transformers.models.auto import modeling_auto as auto
    names = set()
    for value in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(value if isinstance(value, (tuple, list)) else (value,))
    return frozenset(names)


def _is_base_model(model: nn.Module) -> bool:
    """A Hugging Face base model without a head (``LlamaModel``, ``BertModel``): its
    ``base_model`` (the module under ``base_model_prefix``) is itself, and its class names no
    head. (transformers also answers ``base_model`` with the model itself when the prefix's
    attribute is missing, e.g. ``Llama4ForCausalLM``, ``T5ForConditionalGeneration``: those
    have heads.)"""
    return getattr(model, "base_model", None) is model and hasattr(model, "config") \
        and _model_head_kind(model) is None


def _words(kind: str) -> str:
    """``"SequenceClassification"`` -> ``"sequence classification"``; ``"CausalLM"`` ->
    ``"causal LM"`` (an acronym keeps its capitals)."""
    return " ".join(w if w.isupper() else w.lower()
                    for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z][a-z]*", kind))


def _body_of(adapter: type[StagedModel]) -> type[StagedModel]:
    """The class holding an adapter's units and embedding: its ``...Body`` base
    (``GPT2DecoderBody``) where it has one, else the adapter itself."""
    return next((c for c in adapter.__mro__ if c.__name__.endswith("Body")), adapter)


def scope_text() -> str:
    """What hf_cephalo trains, for the unsupported-model messages."""
    return ("hf_cephalo trains the causal-LM, sequence-classification, image-classification, "
            "token-classification, masked-LM and question-answering heads of Hugging Face "
            "models whose layers run in a row (its generic path runs the model's own forward "
            "around its layers; a vision-language model's language model on text where that "
            f"forward is a causal LM's) and, through hand-written adapters, {adapter_summary()}")


def _unsupported(model: nn.Module, found: str = "") -> UnsupportedModelError:
    """The error for a model neither an adapter nor the generic path stages, with the advice
    that fits its class: a base model -> load it with a head hf_cephalo trains; another head
    (token classification, masked LM, ...) -> write an adapter for it, over an existing body
    where the architecture has one; anything else -> what hf_cephalo stages. Each points to
    GUIDE. ``found``: what the self-check found the class's forward on text to be (a
    ``NotCausalLMError``'s reason), said with the head's refusal."""
    name = type(model).__name__
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile(model)
        return UnsupportedModelError(
            f"hf_cephalo cannot stage a torch.compile'd model ({name} of "
            f"{type(model._orig_mod).__name__}): pass the model itself; the engine compiles "
            "each layer unit when asked (--torch_compile, or Accelerate's dynamo_backend)", [])
    register = (f"register it with hf_cephalo.models.register_adapter({name}, YourAdapter) "
                f"(see {GUIDE})")
    scope = scope_text()
    same = _same_architecture(model)
    kind = _model_head_kind(model)
    if _is_base_model(model) and same:
        return UnsupportedModelError(
            f"hf_cephalo cannot train {name}: it is a base model without a head, hence without "
            f"a training loss. Load the model as {' or '.join(same)} (e.g. "
            f"{same[0]}.from_pretrained(path)); to train another head, write an adapter for "
            f"that head's class (see {GUIDE}).", same)
    if hasattr(model, "config"):
        adapters = [n for n in same if n in _ADAPTERS]
        if adapters:
            body = _body_of(_ADAPTERS[adapters[0]])
            reuse = (f" that reuses the units and embedding of "
                     f"{body.__module__}.{body.__qualname__} and")
        else:
            reuse = " that"
        words = _words(kind) if kind else ""
        head = f"{'an' if words[:1] in tuple('aeiou') else 'a'} {words} head" if kind \
            else "a head of another kind"
        return UnsupportedModelError(
            f"hf_cephalo cannot train {name} ({head}): {scope}; this head is none of "
            f"those{f' ({found})' if found else ''}. Loading the model as another class would "
            f"train another head and loss. To train this head, write an adapter{reuse} "
            f"defines the head (head_modules, head_logits, the loss), and {register}.", [])
    return UnsupportedModelError(
        f"hf_cephalo has no staged-model adapter for {name}, which is not a Hugging Face model "
        f"with a head: {scope}. To train another kind of model, write an adapter and "
        f"{register}.", [])


GENERIC_HEADS = ("CausalLM", "SequenceClassification", "ImageClassification",
                 "TokenClassification", "MaskedLM", "QuestionAnswering")
"""Heads the generic path (``models/generic.py``, ``models/generic_heads.py``) stages for a
class without an adapter by their name. A class with another head
(``...ForConditionalGeneration``) is staged as a causal LM where its own forward on text
computes one and the staging is exact, both proven on a tiny copy (``_generic_text_lm``)."""


def _generic(model: nn.Module) -> StagedModel:
    """``model`` on the generic path (self-checked on a tiny copy first), or
    UnsupportedModelError with the reason the check gave."""
    from hf_cephalo.models.generic import StructureError
    from hf_cephalo.models.self_check import generic_staged
    try:
        return generic_staged(model)
    except StructureError as exc:
        name = type(model).__name__
        advice = "" if getattr(exc, "fix_given", False) else \
            f" Train it through a hand-written adapter ({GUIDE}) or report the class."
        raise UnsupportedModelError(
            f"hf_cephalo cannot train {name} exactly: {exc}. Nothing was run.{advice}",
            []) from exc


def _encoder_decoder(model: nn.Module) -> UnsupportedModelError | None:
    """The refusal of an encoder-decoder model without an adapter (its forward takes
    ``decoder_input_ids``: ProphetNet, SpeechT5, ...), None for any other model: why it cannot
    train exactly where ``T5_KIN_REFUSALS`` or ``NOT_EXACT`` knows (Switch Transformers,
    NLLB-MoE), else that it has no adapter. The encoder-decoders with adapters
    (``models/seq2seq.py``, ``models/seq2seq_families.py``, ``models/seq2seq_t5_kin.py``,
    ``models/seq2seq_kin.py``, ``models/seq2seq_gemma.py``, ``models/seq2seq_heads.py``,
    ``models/whisper.py``, ``models/speech_seq2seq.py``) never get here; the generic path
    stages one layer stack, not an encoder, a decoder and the code between them."""
    import inspect
    if "decoder_input_ids" not in inspect.signature(type(model).forward).parameters:
        return None
    name = type(model).__name__
    not_exact = {**T5_KIN_REFUSALS, **NOT_EXACT}
    why = next((not_exact[c.__name__] for c in type(model).__mro__ if c.__name__ in not_exact),
               None)
    if why is not None:
        return UnsupportedModelError(f"hf_cephalo cannot train {name} exactly: it is an "
                                     f"encoder-decoder model whose staging cannot be exact yet: "
                                     f"{why}. Nothing was run. {scope_text()}.", [])
    return UnsupportedModelError(
        f"hf_cephalo cannot train {name}: it is an encoder-decoder model (its forward takes "
        f"decoder_input_ids) without an adapter; the generic path stages one layer stack, not "
        f"an encoder, a decoder whose cross-attention reads the encoder's output and the code "
        f"between them. Nothing was run. T5, BART and their kin (Pop2Piano among T5's), "
        f"T5Gemma, T5Gemma 2 (on text) and Whisper, Speech2Text and Moonshine train "
        f"(models/seq2seq.py, models/seq2seq_families.py, models/seq2seq_t5_kin.py, "
        f"models/seq2seq_kin.py, models/seq2seq_gemma.py, models/whisper.py, "
        f"models/speech_seq2seq.py), as do the question-answering and classification heads of "
        f"T5, mT5, UMT5, BART, mBART and MVP, LED's question answering and T5Gemma's and "
        f"T5Gemma 2's token and sequence classifiers (models/seq2seq_heads.py) and a "
        f"decoder-only or encoder-only model of the task ({scope_text()}); to train this "
        f"one, write an adapter like those (see {GUIDE}).", [])


def _generic_any(model: nn.Module, kind: str) -> StagedModel:
    """The generic path for a model with a head (``_generic`` or ``_generic_text_lm`` by its
    ``kind``), encoder-decoders refused first; any exception on the way becomes one
    UnsupportedModelError naming the class and the cause (a model outside the path is refused,
    never crashes)."""
    refusal = _encoder_decoder(model)
    if refusal is not None:
        raise refusal
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    if kind not in GENERIC_HEADS and not isinstance(getattr(text, "vocab_size", None), int):
        raise _unsupported(model)  # no vocabulary: no causal LM to prove, another kind of head
    try:
        return _generic(model) if kind in GENERIC_HEADS else _generic_text_lm(model)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - one refusal with the cause, never a raw error
        name = type(model).__name__
        raise UnsupportedModelError(
            f"hf_cephalo cannot train {name}: staging it on the generic path failed "
            f"({type(exc).__name__}: {str(exc)[:300]}). Nothing was run. {scope_text()}; to "
            f"train this class, write an adapter (see {GUIDE}) or report the class.", []) from exc


def _generic_text_lm(model: nn.Module) -> StagedModel:
    """A model whose head is named neither causal LM nor sequence classification (a
    vision-language ``...ForConditionalGeneration``) on the generic path as a causal LM, for
    text-only fine-tuning of its language model: only where the self-check finds, on a tiny
    copy, that its own forward on text returns logits over the vocabulary and their
    next-token loss (``causal_check.causal_lm_problem``), and that the staging is exact.
    Otherwise UnsupportedModelError: for a forward that is no causal LM, ``_unsupported``'s
    advice for its head; for a causal LM the path cannot stage, the class, the reason and what
    to do."""
    from hf_cephalo.models.generic import NotCausalLMError, StructureError
    from hf_cephalo.models.self_check import generic_staged
    name = type(model).__name__
    try:
        return generic_staged(model)
    except NotCausalLMError as exc:
        raise _unsupported(model, str(exc)) from exc
    except StructureError as exc:
        if not exc.causal_lm:  # the tiny copy did not build or run: nothing proven either way
            raise UnsupportedModelError(
                f"hf_cephalo cannot train {name}: {scope_text()}; a class with another head "
                f"name (here {_words(_model_head_kind(model) or 'another')}) trains as a causal "
                f"LM only where a tiny copy of it proves its forward on text is one, and that "
                f"check could not run: {exc}. Nothing was run. To train it, write an adapter "
                f"and register it with hf_cephalo.models.register_adapter({name}, YourAdapter) "
                f"(see {GUIDE}).", []) from exc
        text_class = _text_class(model)
        other = (f"; its text-only class {text_class} is no way around: it runs the same "
                 f"language model, and from_pretrained on this checkpoint may report the "
                 f"language model's weights as missing (they are stored under {name}'s names)"
                 if text_class and text_class != name else "")
        raise UnsupportedModelError(
            f"hf_cephalo cannot train {name} exactly: its own forward on text (input_ids, "
            f"attention_mask, labels) is a causal LM's (logits over the vocabulary, their "
            f"next-token loss), whose language model hf_cephalo would fine-tune on text only, "
            f"but the generic path cannot stage that forward exactly: {exc}. Nothing was run. "
            f"To fine-tune it, write an adapter for {name} and register it with "
            f"hf_cephalo.models.register_adapter({name}, YourAdapter) (see {GUIDE}){other}.",
            []) from exc


def _text_class(model: nn.Module) -> str | None:
    """The causal-LM class transformers maps the model's text config to (``Gemma4ForCausalLM``
    for ``Gemma4ForConditionalGeneration``), or None."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return None
    from transformers.models.auto import modeling_auto as auto
    name = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(
        getattr(config.get_text_config(), "model_type", None))
    return name if isinstance(name, str) else None


def adapter_for(model: nn.Module) -> type[StagedModel]:
    """The adapter class registered for ``model``'s class or its nearest registered base class.

    Raises:
        UnsupportedModelError (a ValueError): no adapter; the message names the supported
            classes, points to docs/adding_a_model.md and gives the advice that fits the class
            (``_unsupported``): a bare base model (``BertModel``) is told to load a supported
            head of its architecture (``BertForSequenceClassification``); a head of its own is
            told how to add an adapter for it.
        ValueError: a PEFT ``PeftModel`` that is not one LoRA adapter (``peft_lora.py``).

    A LoRA ``PeftModel`` gets the adapter of the model it wraps (``peft_model.base_model.model``).
    """
    if is_peft_model(model):
        model = unwrap_peft_model(model)
    adapter = _registered_adapter(model)
    if adapter is None:
        raise _unsupported(model)
    return adapter


def _registered_adapter(model: nn.Module) -> type[StagedModel] | None:
    """The adapter registered for ``model``'s class or its nearest registered base class, or
    None. Staging asks this first: most models take the generic path, and ``_unsupported``'s
    message (which imports every adapter's transformers module to name the architecture's
    classes) is built only when it is raised."""
    for cls in type(model).__mro__:
        if cls.__name__ in _ADAPTERS:
            return _ADAPTERS[cls.__name__]
    return None


def stage_model(model: nn.Module) -> StagedModel:
    """Wrap a Hugging Face model in its staged-model adapter (no copy; shares parameters).

    A LoRA ``PeftModel`` is staged as the model it wraps, LoRA layers inside the units (see
    [Note: LoRA in the engine] in ``peft_lora.py``); ``staged.model`` is then the wrapped model.

    Staging leaves torch's global RNG as it found it (state and ``initial_seed()``): the
    self-check seeds its tiny copy, and the user's dropout masks and a loader's seed must not
    depend on whether a check ran (the check is cached per class and config).

    Raises ValueError (``UnsupportedModelError``) for an unsupported class or a setting its
    adapter refuses (an encoder-decoder's layer drop: the adapter's own message, prefixed with
    the class), ValueError for a PEFT wrapper other than one LoRA adapter, ValueError for a
    built-in adapter with transformers < 5, or when the adapter's root modules and units do not
    cover ``model.parameters()`` exactly (e.g. extra modules attached to the model).
    """
    if isinstance(model, StagedModel):
        return model
    with torch.random.fork_rng(devices=[]):
        return _stage(model)


def _stage(model: nn.Module) -> StagedModel:
    inner = unwrap_peft_model(model) if is_peft_model(model) else model
    adapter = _registered_adapter(inner)
    if adapter is None:
        refusal = _encoder_decoder(inner) if hasattr(inner, "config") else None
        if refusal is not None:  # whatever its name says (MarianMTModel, EncoderDecoderModel)
            raise refusal
        kind = _model_head_kind(inner)
        if kind is None or _is_base_model(inner) or not hasattr(inner, "config"):
            raise _unsupported(inner)
        check_transformers_version(transformers.__version__)
        return _generic_any(inner, kind)
    if is_peft_model(model):
        model = model.base_model.model
    if adapter.__module__.startswith("hf_cephalo.models."):
        check_transformers_version(transformers.__version__)
    try:
        return adapter(model)
    except UnsupportedModelError:
        raise
    except ValueError as exc:  # the adapter refuses a setting (layer drop, SpecAugment, ...)
        raise UnsupportedModelError(f"hf_cephalo cannot train {type(inner).__name__}: {exc}",
                                    []) from exc


for _adapter in (GPT2StagedModel, GPT2SequenceClassifierStagedModel, GPTNeoXStagedModel,
                 T5StagedModel, BartStagedModel, WhisperStagedModel, MBartStagedModel,
                 MarianStagedModel, PegasusStagedModel, MT5StagedModel, UMT5StagedModel,
                 LongT5StagedModel, T5TokenClassifierStagedModel, *SEQ2SEQ_HEAD_ADAPTERS,
                 BlenderbotStagedModel, BlenderbotSmallStagedModel, PLBartStagedModel,
                 MvpStagedModel, M2M100StagedModel, Speech2TextStagedModel, MoonshineStagedModel,
                 FSMTStagedModel, BigBirdPegasusStagedModel, LEDStagedModel,
                 PegasusXStagedModel, Pop2PianoStagedModel, T5GemmaStagedModel,
                 T5Gemma2StagedModel):
    for _name in _adapter.model_classes:
        register_adapter(_name, _adapter)
