"""``CompletionsCallback``: sample completions of fixed prompts while a CephaloTrainer trains.

Stock callbacks that generate (TRL's ``LogCompletionsCallback``) call the model object's own
``generate``, which a sharded model refuses (its weights are shards). This callback calls
``CephaloTrainer.generate`` instead (collective: every rank runs it at the same steps), keyed by
the prompt's index and the step, so the same step samples the same completions whatever the
plan (docs/generation.md). Rank 0 appends one JSON line per prompt to
``<output_dir>/completions.jsonl``: ``{"step", "prompt", "completion"}``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch
from transformers import TrainerCallback

__all__ = ["CompletionsCallback"]


class CompletionsCallback(TrainerCallback):
    """Every ``every_n_steps`` optimizer steps (and at the end of training), decode
    ``prompts`` with the trainer's sharded model and write them on rank 0.

    Args:
        trainer: the ``CephaloTrainer`` (or TRL door) whose model generates.
        prompts: the prompt texts (tokenized by the trainer's ``processing_class``).
        every_n_steps: >= 1. generate_kwargs: ``trainer.generate``'s keywords
            (``max_new_tokens`` required unless the model's generation_config has one).

    Raises:
        ValueError: no prompts, ``every_n_steps`` < 1, or a trainer without a tokenizer.
    """

    def __init__(self, trainer: Any, prompts: Sequence[str], every_n_steps: int = 100,
                 **generate_kwargs: Any) -> None:
        if not prompts:
            raise ValueError("CompletionsCallback: pass at least one prompt")
        if int(every_n_steps) < 1:
            raise ValueError(f"CompletionsCallback: every_n_steps={every_n_steps}; use >= 1")
        if getattr(trainer, "processing_class", None) is None:
            raise ValueError("CompletionsCallback: the trainer has no processing_class "
                             "(tokenizer) to encode the prompts and decode the completions")
        self.trainer, self.prompts = trainer, list(prompts)
        self.every, self.kwargs = int(every_n_steps), generate_kwargs
        self.last_step: int | None = None

    def _sample(self, step: int) -> None:
        if self.last_step == step:
            return
        self.last_step = step
        tok = self.trainer.processing_class
        tok = getattr(tok, "tokenizer", tok)
        ids = [tok(p, add_special_tokens=True)["input_ids"] for p in self.prompts]
        width = max(len(i) for i in ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for j, row in enumerate(ids):
            input_ids[j, width - len(row):] = torch.tensor(row)
            mask[j, width - len(row):] = 1
        # every rank decodes the same rows: cheap for a few prompts, and no exchange needed
        out = self.trainer.generate(input_ids, mask, rows=list(range(len(ids))), round_=step,
                                    **{"pad_token_id": pad, **self.kwargs})
        if not self.trainer.is_world_process_zero():
            return
        path = os.path.join(self.trainer.args.output_dir, "completions.jsonl")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a") as f:
            for prompt, row in zip(self.prompts, out[:, width:].tolist()):
                text = tok.decode(row, skip_special_tokens=True)
                f.write(json.dumps({"step": step, "prompt": prompt, "completion": text}) + "\n")

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self._sample(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._sample(state.global_step)
