"""Training script of tests/test_elastic_launch.py, started by torchrun (elastic agents).

Environment: ELASTIC_OUT (output_dir), ELASTIC_LOG (per-step records), ELASTIC_PROFILE (the
cluster profile file: a pool of device profiles), and for the chaos:
ELASTIC_DIE_AT_STEP=k: at the end of step k of a 3-rank world this worker SIGKILLs its elastic
agent and itself (the node leaves); ELASTIC_WAIT_AT_STEP=k: at the end of step k of a 2-rank
world every worker waits (up to 120 s) for the agents to restart it when a third node joins.

Every rank appends one JSON line per step to ELASTIC_LOG/steps-<generation>-<rank>.jsonl
(generation: rank 0's start time, one per rendezvous round): step,
world size, the sample ids of its batch (recovered from the token ids) and the step's loss.
Rank 0 saves the final full parameters to ELASTIC_LOG/final.pt.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import TrainerCallback  # noqa: E402

from hf_cephalo.integrations.trainer.trainer import CephaloTrainer  # noqa: E402
from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments  # noqa: E402
from tests.models_fixtures import build  # noqa: E402

NUM_SAMPLES, GLOBAL_BATCH, MAX_STEPS, SAVE_STEPS = 40, 12, 14, 4  # 4 steps per epoch, last of 4
LOG = os.environ["ELASTIC_LOG"]


def dataset():
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(NUM_SAMPLES):
        ids = torch.randint(1, 97, (12,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, 6, (), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


ROWS = dataset()
ID_OF = {tuple(r["input_ids"].tolist()): i for i, r in enumerate(ROWS)}
assert len(ID_OF) == NUM_SAMPLES


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


class Recording(CephaloTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        ids = [ID_OF[tuple(row.tolist())] for mb in inputs for row in mb["input_ids"]]
        loss = super().training_step(model, inputs, num_items_in_batch)
        rank = self.args.process_index
        with open(os.path.join(LOG, f"steps-{self.generation}-{rank}.jsonl"), "a") as f:
            f.write(json.dumps(dict(generation=self.generation, step=self.state.global_step + 1,
                                    rank=rank, world=self.args.world_size, ids=ids,
                                    loss=float(loss))) + "\n")
        return loss


class Chaos(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        die = os.environ.get("ELASTIC_DIE_AT_STEP")
        if die and int(die) == state.global_step and args.world_size == 3:
            os.kill(os.getppid(), signal.SIGKILL)  # the elastic agent: this node leaves
            os.kill(os.getpid(), signal.SIGKILL)
        wait = os.environ.get("ELASTIC_WAIT_AT_STEP")
        if wait and int(wait) == state.global_step and args.world_size == 2:
            Path(LOG, f"waiting-{args.process_index}").touch()
            deadline = time.time() + 120
            while time.time() < deadline:  # the agents restart us when the third node joins
                time.sleep(0.2)


def main():
    Path(LOG, f"pid-{os.getpid()}").touch()  # the test kills leftover workers by these ids
    args = CephaloTrainingArguments(
        output_dir=os.environ["ELASTIC_OUT"], report_to="none", learning_rate=3e-3,
        adam_epsilon=1e-4, weight_decay=0.01, warmup_steps=2, max_steps=MAX_STEPS,
        logging_steps=1, save_strategy="steps", save_steps=SAVE_STEPS, seed=5, max_grad_norm=1.0,
        disable_tqdm=True, cephalo_profile_file=os.environ["ELASTIC_PROFILE"],
        cephalo_global_batch_size=GLOBAL_BATCH)
    trainer = Recording(model=build("llama").train(), args=args, train_dataset=ROWS,
                        data_collator=collate)
    # one id per worker generation (rendezvous round), the same on every rank
    generation = [f"{time.time():.6f}"]
    torch.distributed.broadcast_object_list(generation, src=0)
    trainer.generation = generation[0]
    trainer.add_callback(Chaos())  # after the session callback: step k's progress is recorded first
    has_checkpoint = any(p.name.startswith("checkpoint-") for p in Path(args.output_dir).glob("*"))
    trainer.train(resume_from_checkpoint=True if has_checkpoint else None)
    params = trainer.engine.full_state_dict()  # collective; the full model on rank 0
    if args.process_index == 0:
        torch.save({k: v.clone() for k, v in params.items()}, os.path.join(LOG, "final.pt"))


if __name__ == "__main__":
    main()
