"""Worker of tests/test_launch_check.py: build a CephaloTrainer under whatever launcher started
this script, train one step, print the world size it trained on.

``argv[1]`` is the output directory. The trainer gets a ONE-rank plan (no profile at start, so a
run that is not refused finishes in seconds): under ``accelerate launch --num_processes 2``
without a config, on CPU, stock Accelerate starts this script once, and without the launch
check it would train here on one rank and exit 0 ([Note: one process where several were
asked] in hf_cephalo/launch_check.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from hf_cephalo.integrations.trainer.trainer import CephaloTrainer  # noqa: E402
from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments  # noqa: E402
from hf_cephalo.planner import Plan  # noqa: E402
from tests.models_fixtures import build  # noqa: E402


def main(out_dir: str) -> None:
    rows = [{"input_ids": torch.arange(1, 9), "labels": torch.arange(1, 9)} for _ in range(4)]
    args = CephaloTrainingArguments(output_dir=out_dir, report_to="none", max_steps=1,
                                    disable_tqdm=True, save_strategy="no")
    trainer = CephaloTrainer(model=build("llama").train(), args=args,
                             plan=Plan.from_ratios([4], [4], [1.0]), train_dataset=rows,
                             data_collator=lambda b: {k: torch.stack([r[k] for r in b])
                                                      for k in b[0]})
    trainer.train()
    print(f"trained on world size {args.world_size}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
