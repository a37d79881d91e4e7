"""GRPO with TRL's GRPOTrainer on the Cephalo runtime (CephaloGRPOTrainer), offline.

Launch on 2 CPU processes (no GPU, no download) with an emulated 1x / 3x pair:

    accelerate launch --config_file accelerate_configs/cephalo_cpu.yaml examples/train_grpo.py \\
        --output_dir outputs/grpo --cephalo_emulate_slowdown 1 3 --max_steps 40

A stock TRL GRPO script with two names changed: ``GRPOTrainer`` -> ``CephaloGRPOTrainer`` and
``GRPOConfig`` -> ``CephaloGRPOConfig`` (every GRPOConfig flag plus the ``--cephalo_*`` flags;
docs/trl.md "GRPO"). Completions are generated on the sharded engine, sampled by keys of the
global row, so the run does not depend on the plan (``--cephalo_decode_mode``,
``--cephalo_generation_split plan``; docs/generation.md).

- Task (verifiable): "How many letters are in '<word>'?" for words of Python's own
  documentation (``pydoc_data.topics``, shipped with CPython); the reward functions check the
  completion: ``format_reward`` (1 when it starts with a number) and ``count_reward`` (1 when
  that number is the word's letter count).
- Tokenizer: one token per character (printable ASCII, built in code: the same on every rank).
- Model: a small Qwen3 from its config, trained from scratch: within ~40 steps it learns to
  answer with a number (the format reward rises); counting letters takes a larger model and a
  longer run.

At the end rank 0 prints the mean reward of the first and of the last logged steps.
"""

from __future__ import annotations

import re
import string
import sys
from dataclasses import dataclass, field

import datasets
from transformers import HfArgumentParser, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers import set_seed

from hf_cephalo import CephaloGRPOConfig, CephaloGRPOTrainer
from hf_cephalo.demo_data import pydoc_texts

_NUMBER = re.compile(r"\s*(\d+)")


@dataclass(kw_only=True)
class TaskArguments:
    """The prompts and the model built from its config."""

    num_prompts: int = field(default=512, metadata={"help": "Distinct words asked about."})
    hidden_size: int = field(default=64, metadata={"help": "Hidden size of the new model."})
    num_layers: int = field(default=2, metadata={"help": "Transformer layers of the new model."})

    def __post_init__(self) -> None:
        for name in ("num_prompts", "hidden_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} = {getattr(self, name)} must be >= 1")
        if self.hidden_size % 4:
            raise ValueError(f"--hidden_size {self.hidden_size} must be a multiple of 4 (heads)")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus <pad> (0) and </s> (1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def prompts(n: int) -> datasets.Dataset:
    """``n`` questions about distinct alphabetic words of the pydoc text, with the answer."""
    words, seen = [], set()
    for word in re.findall(r"[a-z]{3,9}", " ".join(pydoc_texts(200000)).lower()):
        if word not in seen:
            seen.add(word)
            words.append(word)
        if len(words) == n:
            break
    return datasets.Dataset.from_dict({
        "prompt": [f"How many letters are in '{w}'? " for w in words],
        "letters": [len(w) for w in words]})


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 for a completion that starts with a number, else 0.0."""
    return [1.0 if _NUMBER.match(c) else 0.0 for c in completions]


def count_reward(completions, letters, **kwargs) -> list[float]:
    """1.0 for a completion whose leading number is the word's letter count, else 0.0."""
    return [1.0 if (m := _NUMBER.match(c)) and int(m.group(1)) == n else 0.0
            for c, n in zip(completions, letters)]


def main(argv: list[str] | None = None) -> None:
    parser = HfArgumentParser((TaskArguments, CephaloGRPOConfig))
    # a model trained from scratch: a larger learning rate; fp32 on CPUs; short completions
    parser.set_defaults(learning_rate=3e-3, bf16=False, num_generations=8,
                        per_device_train_batch_size=8, max_completion_length=4, beta=0.0,
                        logging_steps=5, max_steps=40, report_to="none", save_strategy="no",
                        disable_tqdm=not sys.stderr.isatty())
    task, args = parser.parse_args_into_dataclasses(args=argv)
    if args.beta != 0.0:  # TRL loads the reference model from the policy's path (stock too)
        raise ValueError(f"--beta {args.beta}: a KL term needs a reference model, which TRL "
                         "loads from the model's checkpoint path, and this example builds its "
                         "model from a config in memory (no path); keep --beta 0 here, or pass "
                         "a saved model's folder as GRPOTrainer's model in your own script")
    tokenizer = char_tokenizer()
    set_seed(args.seed)  # the same initial weights on every rank
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=task.hidden_size,
                         intermediate_size=4 * task.hidden_size,
                         num_hidden_layers=task.num_layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=task.hidden_size // 4,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    trainer = CephaloGRPOTrainer(model=Qwen3ForCausalLM(config), args=args,
                                 reward_funcs=[format_reward, count_reward],
                                 train_dataset=prompts(task.num_prompts),
                                 processing_class=tokenizer)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    if trainer.is_world_process_zero() and rewards:
        print(f"mean reward: first logged step {rewards[0]:.3f}, last {rewards[-1]:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
