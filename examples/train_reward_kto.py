"""A reward model, then KTO, with TRL's RewardTrainer and KTOTrainer on the Cephalo runtime, offline.

Launch on 2 CPU processes (no GPU, no download):

    accelerate launch --config_file accelerate_configs/cephalo_cpu.yaml \\
        examples/train_reward_kto.py --output_dir outputs/reward_kto --max_steps 10

Two stages of a preference pipeline, each a stock TRL script with two names changed
(``RewardTrainer`` -> ``CephaloRewardTrainer``, ``KTOTrainer`` -> ``CephaloKTOTrainer``, and
their configs; docs/trl.md "Reward models and KTO"):

1. Reward model: a small Llama classifier (``LlamaForSequenceClassification``, one label) on
   preference pairs built from Python's own documentation (``pydoc_preference_dataset``: each
   question with its own topic's answer as "chosen" and another topic's as "rejected"); a pair is
   one sample, the loss and the accuracy those of the global batch. Saved, then reloaded with
   ``AutoModelForSequenceClassification.from_pretrained`` on rank 0, which scores a chosen and a
   rejected answer of a held-out question.
2. KTO: a small Llama causal LM against a frozen copy of itself (the reference, its own sharded
   engine) on the same pairs as desirable / undesirable rows (``unpaired``); the KL estimate is
   that of the global batch.

The tokenizer is a byte-level BPE with ChatML markers trained on the same text (rank 0 trains it;
every rank trains the same one from the same text, so nothing is sent).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig,
                          LlamaForCausalLM, LlamaForSequenceClassification, set_seed)

from hf_cephalo import (CephaloKTOConfig, CephaloKTOTrainer, CephaloRewardConfig,
                        CephaloRewardTrainer)
from hf_cephalo.demo_data import pydoc_preference_dataset, pydoc_texts, train_chat_tokenizer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True, help="Where both stages write.")
    parser.add_argument("--max_steps", type=int, default=10, help="Optimizer steps per stage.")
    parser.add_argument("--global_batch_size", type=int, default=8,
                        help="Pairs (reward) / rows (KTO) per optimizer step, all ranks.")
    parser.add_argument("--max_pairs", type=int, default=64,
                        help="Preference pairs for training, built from the documentation (at "
                             "most ~78 at 120 characters an answer; >= 3).")
    args = parser.parse_args()
    if args.max_steps < 1 or args.global_batch_size < 2 or args.max_pairs < 3:
        parser.error(f"--max_steps {args.max_steps} (>= 1), --global_batch_size "
                     f"{args.global_batch_size} (>= 2), --max_pairs {args.max_pairs} (>= 3)")
    return args


def llama_config(tokenizer, **extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                       **extra)


def common(args: argparse.Namespace, stage: str) -> dict:
    return dict(output_dir=os.path.join(args.output_dir, stage), max_steps=args.max_steps,
                cephalo_global_batch_size=args.global_batch_size, logging_steps=1,
                save_strategy="no", report_to="none", bf16=False, seed=7, max_length=128,
                train_sampling_strategy="sequential", disable_tqdm=True)


def train_reward_model(args, tokenizer, pairs, held_out) -> None:
    set_seed(7)
    model = LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1))
    config = CephaloRewardConfig(**common(args, "reward"), learning_rate=1e-3)
    trainer = CephaloRewardTrainer(model=model, args=config, train_dataset=pairs,
                                   processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "accuracy" in h]
    trainer.save_model(config.output_dir)  # every rank; rank 0 writes
    if trainer.is_world_process_zero():
        print(f"reward model: loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f}, accuracy "
              f"{logs[-1]['accuracy']:.2f}, margin {logs[-1]['margin']:.4f} (global batch)")
        reloaded = AutoModelForSequenceClassification.from_pretrained(config.output_dir).eval()
        saved = AutoTokenizer.from_pretrained(config.output_dir)
        with torch.no_grad():
            for kind in ("chosen", "rejected"):
                ids = saved(held_out["prompt"] + held_out[kind], return_tensors="pt")
                print(f"  held-out question, {kind} answer: reward "
                      f"{reloaded(**ids).logits.item():.4f}")


def unpaired(pairs):
    """KTO's rows from preference pairs, each pair's desirable row next to its undesirable one
    (KTOTrainer's own unpairing puts every chosen row first, so with sequential sampling a
    global batch would hold one kind only)."""
    import datasets

    rows = {"prompt": [], "completion": [], "label": []}
    for pair in pairs:
        for kind, label in (("chosen", True), ("rejected", False)):
            rows["prompt"].append(pair["prompt"])
            rows["completion"].append(pair[kind])
            rows["label"].append(label)
    return datasets.Dataset.from_dict(rows)


def train_kto(args, tokenizer, pairs) -> None:
    set_seed(7)
    model = LlamaForCausalLM(llama_config(tokenizer))
    reference = copy.deepcopy(model)
    config = CephaloKTOConfig(**common(args, "kto"), learning_rate=5e-4, beta=0.1,
                              desirable_weight=1.0, undesirable_weight=1.0)
    trainer = CephaloKTOTrainer(model=model, ref_model=reference, args=config,
                                train_dataset=unpaired(pairs), processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "kl" in h]
    if trainer.is_world_process_zero():
        print(f"KTO: loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f}, kl {logs[-1]['kl']:.4f}, "
              f"rewards/margins {logs[-1].get('rewards/margins', float('nan')):.4f} "
              "(global batch)")


def main() -> None:
    args = parse_args()
    tokenizer = train_chat_tokenizer(pydoc_texts(200_000), vocab_size=1024, model_max_length=256)
    data = pydoc_preference_dataset(args.max_pairs + 1, max_answer_chars=120)
    pairs, held_out = data.select(range(len(data) - 1)), data[len(data) - 1]  # the last held out
    train_reward_model(args, tokenizer, pairs, held_out)
    train_kto(args, tokenizer, pairs)


if __name__ == "__main__":
    main()
