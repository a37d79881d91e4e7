"""Shared pieces of the TRL tests: a chat tokenizer and chat data built offline from the packaged
pydoc text, a tiny Llama, and the SFT sub-cases (dataset format + SFTConfig overrides)."""

from __future__ import annotations

import os

import torch

SEED, B = 7, 4
# uneven plans of the TRL tests: 2 ranks b = [1, 3], m = [1, 2]; 3 ranks b = [1, 3, 0],
# m = [1, 1, 0] (different l_i and an idle rank)
PLANS = {2: ([1, 3], [1, 2], [0.35, 0.65]), 3: ([1, 3, 0], [1, 1, 0], [0.2, 0.5, 0.3])}
NUM_PAIRS = 32
SFT_CASES = {
    # prompt-completion strings; the prompt masked out
    "completion_only": ("prompt_completion", dict(completion_only_loss=True, max_length=48)),
    # conversational messages; only the assistant turns (chat template generation markers)
    "assistant_only": ("messages", dict(assistant_only_loss=True, max_length=48)),
    # plain text packed into full rows, attention across documents inside a row (as stock)
    "packing_wrapped": ("text", dict(packing=True, packing_strategy="wrapped", max_length=32)),
    # best-fit packing, padding-free: one flattened row per microbatch, per-document positions
    "packing_bfd_padding_free": ("messages", dict(packing=True, packing_strategy="bfd",
                                                  padding_free=True, max_length=96)),
    # conversational prompt-completion with TRL's (deprecated alias) chunked loss, scored on
    # the whole sequence (prompt included)
    "chunked_nll": ("conversational_prompt_completion", dict(loss_type="chunked_nll",
                                                              completion_only_loss=False,
                                                              max_length=48)),
}


def plan(world_size: int):
    """The ``PLANS`` entry as a ``Plan`` (b_i, m_i, r_i)."""
    from hf_cephalo.planner import Plan

    return Plan.from_ratios(*PLANS[world_size])


def state_copy(model) -> dict:
    """A detached copy of ``model``'s state dict (what the runs compare)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def step_logs(history: list[dict], metrics) -> dict[str, list]:
    """Each of ``metrics``' values over the per-step training log rows of ``history``."""
    rows = [h for h in history if "loss" in h and "train_loss" not in h]
    return {m: [h[m] for h in rows if m in h] for m in metrics}


EVAL_WALL_CLOCK = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second",
                   "eval_model_preparation_time")


def eval_logs(history: list[dict]) -> list[dict]:
    """Every evaluation's logged ``eval_*`` values, wall-clock ones aside."""
    return [{k: v for k, v in h.items() if k.startswith("eval_") and k not in EVAL_WALL_CLOCK}
            for h in history if "eval_loss" in h]


def assert_same_state(got: dict, ref: dict, rtol: float, atol: float) -> None:
    """The same parameter names, each value within rtol / atol of the reference's."""
    assert set(got) == set(ref)
    for key, value in ref.items():
        torch.testing.assert_close(torch.as_tensor(got[key]), value, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{key}: {m}")


def save_tokenizer(path: str) -> str:
    """A 512-entry BPE + ChatML tokenizer trained on pydoc text, saved under ``path``."""
    from hf_cephalo.demo_data import pydoc_texts, train_chat_tokenizer

    train_chat_tokenizer(pydoc_texts(60000), 512).save_pretrained(path)
    return path


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_dataset(fmt: str, num_pairs: int = NUM_PAIRS, offset: int = 0):
    """``pydoc_chat_dataset`` rows with answers of 20-60 characters (documents of different
    lengths, so packing puts several in a row and padding differs per row)."""
    import datasets

    from hf_cephalo.demo_data import pydoc_chat_dataset

    ds = pydoc_chat_dataset(fmt, offset + num_pairs, max_answer_chars=200)
    ds = ds.select(range(offset, offset + num_pairs))
    rows = ds.to_dict()

    def cut(text: str, i: int) -> str:
        return text[:20 + 10 * (i % 5)]

    if fmt == "messages":
        rows["messages"] = [[m[0], {**m[1], "content": cut(m[1]["content"], i)}]
                            for i, m in enumerate(rows["messages"])]
    elif fmt == "conversational_prompt_completion":
        rows["completion"] = [[{**c[0], "content": cut(c[0]["content"], i)}]
                              for i, c in enumerate(rows["completion"])]
    elif fmt == "prompt_completion":
        rows["completion"] = [cut(c, i) for i, c in enumerate(rows["completion"])]
    else:
        rows["text"] = [t[:t.index("Answer:") + 8] + cut(t[t.index("Answer:") + 8:], i)
                        for i, t in enumerate(rows["text"])]
    return datasets.Dataset.from_dict(rows)


def tiny_llama(vocab_size: int):
    import transformers

    torch.manual_seed(SEED)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg)


def offline_env() -> None:
    """No hub access, no telemetry, no progress bars (the ranks and the stock runs). The bars
    are switched off in this process only, not through HF_DATASETS_DISABLE_PROGRESS_BARS: the
    module fixtures call this in pytest's own process, whose environment every later launch
    inherits (tests/test_examples.py checks datasets' bars of a launched script)."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    import datasets

    datasets.disable_progress_bars()
