"""Training script of tests/test_parent_death.py: trains a tiny Llama "forever" (long max_steps,
a checkpoint every 2 steps) until the test SIGKILLs its launcher.

Argument: the output directory. Every rank writes ``<out>/worker-<rank>.json`` ({pid, ppid})
once training has begun, so the test knows the worker processes and their parent.
Environment: HF_CEPHALO_PLAN_FILE (a plan file: no profiling at start).
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import TrainerCallback  # noqa: E402

from hf_cephalo.integrations.trainer.trainer import CephaloTrainer  # noqa: E402
from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments  # noqa: E402
from tests.models_fixtures import build  # noqa: E402


class WritePids(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        path = Path(args.output_dir, f"worker-{args.process_index}.json")
        path.write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid()}))


def main():
    out = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(1, 97, (24, 8), generator=g)]
    args = CephaloTrainingArguments(output_dir=out, report_to="none", max_steps=100_000,
                                    save_strategy="steps", save_steps=2, logging_steps=50,
                                    disable_tqdm=True, learning_rate=1e-3)
    trainer = CephaloTrainer(model=build("llama").train(), args=args, train_dataset=rows,
                             data_collator=lambda r: {k: torch.stack([x[k] for x in r]) for k in r[0]},
                             callbacks=[WritePids()])
    trainer.train()


if __name__ == "__main__":
    main()
