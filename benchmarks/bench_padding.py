"""Padded-token overhead (padded tokens / real tokens) of the two collation modes on the main
job's data ([Note: padding independent of the plan] in hf_cephalo/runtime/sampler.py).

The main job (``scripts/demo.sh``: ``examples/train_clm.py`` on Python's pydoc_data text) feeds
``group_texts`` blocks of ``--block_size`` tokens through ``default_data_collator``: every row
has the same length, so neither mode pads. To show what the modes cost where rows differ, the
same text (same BPE tokenizer as the example trains, vocabulary 2048) is also fed one pydoc
topic per row, truncated to ``--max-length`` tokens, through transformers'
``DataCollatorForLanguageModeling`` (pads to the longest row it is given). Both modes run the
real loader code (``WeightedBatchSampler`` + ``GlobalBatchCollator`` / ``MicrobatchCollator``)
over one epoch (shuffled with ``--seed``) for each plan, all ranks; a padded token is an
``attention_mask`` zero.

    python benchmarks/bench_padding.py [--max-length 512] [--seed 0]
"""

from __future__ import annotations

import argparse

from torch.utils.data import DataLoader

from hf_cephalo.demo_data import group_texts, pydoc_text_dataset, train_bpe_tokenizer
from hf_cephalo.runtime.sampler import (GlobalBatchCollator, MicrobatchCollator,
                                             WeightedBatchSampler)

PLANS = {  # name: (batch sizes b_i, microbatch sizes m_i)
    "demo hand-made plan b=[6,10] m=[3,5]": ([6, 10], [3, 5]),
    "b=[4,12] m=[1,3]": ([4, 12], [1, 3]),
    "b=[8,8] m=[2,2]": ([8, 8], [2, 2]),
}


def count_tokens(rows, collator, batch_sizes, micro, mode: str, seed: int) -> tuple[int, int]:
    """(real tokens, padded tokens) over one epoch, summed over all ranks."""
    real = padded = 0
    for rank, m in enumerate(micro):
        sampler = WeightedBatchSampler(len(rows), batch_sizes, rank, seed=seed,
                                       yield_global_batch=mode == "global_batch")
        collate = (GlobalBatchCollator(collator, batch_sizes, rank, m) if mode == "global_batch"
                   else MicrobatchCollator(collator, m))
        for microbatches in DataLoader(rows, batch_sampler=sampler, collate_fn=collate):
            for mb in microbatches:
                mask = mb["attention_mask"]
                real += int(mask.sum())
                padded += int(mask.numel() - mask.sum())
    return real, padded


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-length", type=int, default=512, help="tokens per topic row")
    parser.add_argument("--block-size", type=int, default=64, help="the demo's --block_size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="smallest settings: 30 topics, rows of at most 64 tokens (the suite's check that the"
                             " benchmark runs)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_length, args.block_size = 64, 32
    from transformers import DataCollatorForLanguageModeling, default_data_collator

    text = pydoc_text_dataset()
    if args.smoke:
        text = text.select(range(min(30, len(text))))
    tokenizer = train_bpe_tokenizer(text["text"], vocab_size=2048)
    blocks = group_texts(text, tokenizer, args.block_size)
    packed = [blocks[i] for i in range(len(blocks))]
    topics = [{"input_ids": ids[:args.max_length]}
              for ids in tokenizer(list(text["text"]), add_special_tokens=False,
                                   verbose=False)["input_ids"]]
    datasets = {
        f"demo data: {len(packed)} group_texts blocks of {args.block_size}, "
        "default_data_collator": (packed, default_data_collator),
        f"one pydoc topic per row ({len(topics)} rows, <= {args.max_length} tokens), "
        "DataCollatorForLanguageModeling": (topics, DataCollatorForLanguageModeling(tokenizer,
                                                                                    mlm=False)),
    }
    print("padded tokens / real tokens, one epoch, all ranks")
    print(f"{'data':<82} {'plan':<38} {'global_batch':>12} {'microbatch':>10}")
    for data_name, (rows, collator) in datasets.items():
        for plan_name, (sizes, micro) in PLANS.items():
            ratios = []
            for mode in ("global_batch", "microbatch"):
                real, padded = count_tokens(rows, collator, sizes, micro, mode, args.seed)
                ratios.append(padded / real)
            print(f"{data_name:<82} {plan_name:<38} {ratios[0]:>12.3f} {ratios[1]:>10.3f}")


if __name__ == "__main__":
    main()
