"""Demo data: pydoc text -> BPE tokenizer -> fixed-length blocks; scikit-learn digits for ViT."""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from hf_cephalo.demo_data import (
    EOS_TOKEN,
    digits_image_datasets,
    group_texts,
    pydoc_text_dataset,
    pydoc_texts,
    train_bpe_tokenizer,
)


@pytest.fixture(scope="module")
def small_corpus():
    return pydoc_text_dataset(max_chars=60_000)


@pytest.fixture(scope="module")
def tokenizer(small_corpus):
    return train_bpe_tokenizer(small_corpus["text"], vocab_size=600)


def test_pydoc_texts_deterministic_and_bounded():
    full = pydoc_texts()
    assert len(full) > 50 and sum(map(len, full)) > 100_000
    assert pydoc_texts() == full
    part = pydoc_texts(max_chars=20_000)
    assert part == full[:len(part)] and sum(map(len, part)) <= 20_000
    assert pydoc_texts(max_chars=1) == full[:1]  # at least one topic
    with pytest.raises(ValueError, match="max_chars = 0"):
        pydoc_texts(max_chars=0)


def test_tokenizer_round_trip_and_save(tokenizer, tmp_path):
    assert 258 < len(tokenizer) <= 600
    for text in ["def f(x):\n    return x ** 2  # comment", "naïve café ∑ 日本", "  leading spaces"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text  # byte-level: lossless, no unknown token
    # BPE merges learned: common words take fewer tokens than bytes
    assert len(tokenizer("statement")["input_ids"]) < len("statement")
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token_id != tokenizer.eos_token_id
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "for i in range(10): print(i)"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.eos_token_id == tokenizer.eos_token_id
    with pytest.raises(ValueError, match="vocab_size = 100"):
        train_bpe_tokenizer(["abc"], vocab_size=100)


def test_group_texts_blocks_are_the_token_stream(small_corpus, tokenizer):
    block = 64
    grouped = group_texts(small_corpus, tokenizer, block)
    stream = []
    for text in small_corpus["text"]:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(grouped) == len(stream) // block
    flat = [t for row in grouped["input_ids"] for t in row]
    assert flat == stream[:len(flat)]
    assert all(len(r) == block for r in grouped["input_ids"])
    assert grouped["labels"] == grouped["input_ids"]
    assert all(set(m) == {1} for m in grouped["attention_mask"])
    with pytest.raises(ValueError, match="block_size = 1"):
        group_texts(small_corpus, tokenizer, 1)
    with pytest.raises(ValueError, match="text_column = 'body'"):
        group_texts(small_corpus, tokenizer, 8, text_column="body")
    with pytest.raises(ValueError, match="fewer than block_size"):
        group_texts(small_corpus.select([0]), tokenizer, 100_000)


def test_digits_splits_cover_the_data_exactly():
    from sklearn.datasets import load_digits

    splits = digits_image_datasets(image_size=8, num_channels=1, test_fraction=0.25, seed=1)
    digits = load_digits()
    train, test = splits["train"][:], splits["test"][:]
    assert len(train["labels"]) + len(test["labels"]) == len(digits.target)
    assert len(test["labels"]) == int(np.ceil(0.25 * 1797))
    # at size 8 the resize is the identity: the rows are exactly (x/16 - 0.5)/0.5, each once
    rows = torch.cat([train["pixel_values"], test["pixel_values"]]).reshape(-1, 64)
    expected = (torch.tensor(digits.images, dtype=torch.float32).reshape(-1, 64) / 16 - 0.5) / 0.5
    labels = torch.cat([train["labels"], test["labels"]])
    got = sorted(zip(map(tuple, rows.tolist()), labels.tolist()))
    want = sorted(zip(map(tuple, expected.tolist()), digits.target.tolist()))
    assert got == want
    assert set(test["labels"].tolist()) == set(range(10))  # stratified held-out split


def test_digits_vit_shape_and_range():
    splits = digits_image_datasets(image_size=16, seed=0)
    x = splits["train"][:]["pixel_values"]
    assert x.shape == (len(splits["train"]), 3, 16, 16) and x.dtype == torch.float32
    assert x.min() >= -1.0 and x.max() <= 1.0 and x.std() > 0.1
    assert torch.equal(x[:, 0], x[:, 2])  # gray repeated over channels
    assert splits["train"].features["labels"].names == [str(d) for d in range(10)]
    with pytest.raises(ValueError, match="image_size = 4"):
        digits_image_datasets(image_size=4)
