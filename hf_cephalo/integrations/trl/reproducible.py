"""``reproducible_rollout``: TRL's generation, sampled as Cephalo samples ([Note: keyed sampling]).

Stock ``GRPOTrainer`` samples with ``torch.multinomial`` on each process's own generator, so a
run's completions depend on the number of processes and on which process got which prompt.
Cephalo keys every sampled token by (seed, generation round, global row, position) instead.
``reproducible_rollout(seed)`` is a ``rollout_func`` that stock ``GRPOTrainer`` accepts on ONE
process and that samples exactly that way: with it, stock GRPO on one process and
``CephaloGRPOTrainer`` on any plan generate the same completions, which is how their
equivalence is shown (docs/trl.md, "GRPO"). The round is the optimizer step at which the
generation batch is made (``trainer.state.global_step``; evaluation batches use a separate
range), the row the prompt's index in the generation batch, so a resumed run samples what the
uninterrupted run sampled.

What it reads from the trainer (``GRPOConfig`` fields of the same names): ``max_completion_length``,
``temperature``, ``top_p``, ``top_k``, ``min_p``; the EOS ids (``trainer.eos_token_ids``) and the
pad id of its tokenizer; ``pad_to_multiple_of``. It refuses, with the reason, what it does not
reproduce: ``repetition_penalty`` other than 1, ``generation_kwargs``, multimodal prompts, vLLM.
"""

from __future__ import annotations

from typing import Any, Callable

from hf_cephalo.runtime import SamplingParams, generate_rows

__all__ = ["EVAL_ROUND_OFFSET", "reproducible_rollout", "sampling_params", "generation_round"]

EVAL_ROUND_OFFSET = 1 << 40
"""Evaluation generation rounds are ``EVAL_ROUND_OFFSET + global_step``, apart from training's."""


def sampling_params(args: Any, trainer: Any, seed: int) -> SamplingParams:
    """``SamplingParams`` from a ``GRPOConfig`` / ``RLOOConfig`` and its trainer.

    Raises:
        ValueError: a generation setting keyed sampling does not reproduce (named, with what
            to do instead).
    """
    problems = []
    if float(getattr(args, "repetition_penalty", 1.0) or 1.0) != 1.0:
        problems.append(f"repetition_penalty={args.repetition_penalty} (it depends on the "
                        "tokens a row has seen; set 1.0)")
    if getattr(args, "generation_kwargs", None):
        problems.append(f"generation_kwargs={args.generation_kwargs!r} (set None: the sampling "
                        "settings are max_completion_length, temperature, top_p, top_k, min_p)")
    if getattr(args, "use_vllm", False):
        problems.append("use_vllm=True (generation runs on the trainer's own model)")
    if problems:
        raise ValueError("reproducible sampling cannot honour " + "; ".join(problems))
    if args.max_completion_length is None:
        raise ValueError("max_completion_length=None: set the completion length limit (a "
                         "completion without an EOS would otherwise never end)")
    tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
    pad = tokenizer.pad_token_id
    return SamplingParams(max_new_tokens=int(args.max_completion_length), do_sample=True,
                          temperature=float(args.temperature), top_k=int(args.top_k or 0),
                          top_p=float(args.top_p), min_p=args.min_p,
                          eos_token_ids=tuple(trainer.eos_token_ids),
                          pad_token_id=int(pad if pad is not None else trainer.eos_token_ids[0]),
                          seed=int(seed))


def generation_round(trainer: Any) -> int:
    """The round key of the generation batch being made now: the optimizer step, offset by
    ``EVAL_ROUND_OFFSET`` in evaluation."""
    step = int(trainer.state.global_step)
    return step if trainer.model.training else EVAL_ROUND_OFFSET + step


def tokenize_prompts(trainer: Any, prompts: list) -> list[list[int]]:
    """The prompts' token ids as the trainer tokenizes them for generation (chat template,
    ``_tokenize_prompts``). Raises ValueError for multimodal prompts."""
    prompt_ids, images, multimodal = trainer._tokenize_prompts(prompts)
    if images is not None or multimodal:
        raise ValueError("reproducible sampling does not take multimodal prompts (images or "
                         "processor fields); use text prompts")
    return [list(map(int, ids)) for ids in prompt_ids]


def reproducible_rollout(seed: int = 0) -> Callable[[list, Any], dict]:
    """A ``rollout_func`` for stock ``GRPOTrainer`` on ONE process that samples as Cephalo does.

    ``GRPOTrainer(..., rollout_func=hf_cephalo.reproducible_rollout(seed))``: each call
    tokenizes the generation batch's prompts, decodes them with the trainer's model
    (``model.generate``, KV cache) and keyed sampling, row ``j`` keyed by its index in the
    batch; returns ``{"prompt_ids", "completion_ids", "logprobs": None}`` (each completion up to
    and including its first EOS), as TRL's own transformers generation does. ``seed``: pass the
    ``seed`` of the config the Cephalo run uses (``CephaloGRPOTrainer`` keys with ``args.seed``).

    Raises (at the first call): ValueError for settings it cannot reproduce
    (``sampling_params``), more than one process (stock numbers rows per process, so rows
    would collide: run it on one process; ``CephaloGRPOTrainer`` numbers them globally).
    """
    def rollout_func(prompts: list, trainer: Any) -> dict:
        if trainer.accelerator.num_processes != 1:
            raise ValueError(f"reproducible_rollout runs on ONE process (this run has "
                             f"{trainer.accelerator.num_processes}): stock GRPOTrainer numbers "
                             "the rows of each process from 0, so two processes would sample "
                             "alike; on several ranks use CephaloGRPOTrainer")
        params = sampling_params(trainer.args, trainer, seed)
        prompt_ids = tokenize_prompts(trainer, prompts)
        model = trainer.accelerator.unwrap_model(trainer.model)
        out = generate_rows(model, prompt_ids, list(range(len(prompt_ids))), params,
                            generation_round(trainer), device=trainer.accelerator.device,
                            pad_to_multiple_of=getattr(trainer, "pad_to_multiple_of", None))
        return {"prompt_ids": prompt_ids, "completion_ids": out.completions, "logprobs": None}

    return rollout_func
