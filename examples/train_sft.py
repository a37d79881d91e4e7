"""Chat fine-tuning with TRL's SFTTrainer on the Cephalo runtime (CephaloSFTTrainer), offline.

Launch on 2 CPU processes (no GPU, no download) with an emulated 1x / 3x pair:

    accelerate launch --config_file accelerate_configs/cephalo_cpu.yaml examples/train_sft.py \\
        --output_dir outputs/sft --cephalo_global_batch_size 16 \\
        --cephalo_emulate_slowdown 1 3 --max_steps 60

A stock TRL script with two names changed: ``SFTTrainer`` -> ``CephaloSFTTrainer`` and
``SFTConfig`` -> ``CephaloSFTConfig`` (every SFTConfig flag — ``--packing``,
``--packing_strategy``, ``--assistant_only_loss``, ``--max_length`` ... — plus the
``--cephalo_*`` flags; docs/trl.md). ``pip install 'hf-cephalo[trl]'``.

- Data: a chat dataset built from Python's own documentation (``pydoc_data.topics``, shipped
  with CPython): the user asks what the documentation says about a topic, the assistant answers
  with a part of its text (``hf_cephalo.demo_data.pydoc_chat_dataset``, ~1,500
  conversations); the last ``--eval_pairs`` are held out.
- Tokenizer: a byte-level BPE trained on that text with ChatML turn markers and a chat template
  whose assistant turns carry ``{% generation %}`` markers (``--assistant_only_loss``), or
  ``--tokenizer_name``.
- Model: a small Llama from its config, or ``--model_name_or_path`` (read shard by shard,
  ``from_pretrained_sharded``; give ``--cephalo_profile_file`` or a plan: a meta model cannot be
  profiled at start).
- Defaults: packing on (best-fit decreasing, padding-free: documents never attend to each other),
  ``--assistant_only_loss``, fp32 (``--bf16`` for bf16 autocast, TRL's default on GPUs).

At the end: TRL's metrics (entropy, mean_token_accuracy, num_tokens) of the last logged steps,
the eval loss, the model saved (``save_model``: every rank; rank 0 writes), reloaded with
``from_pretrained`` on rank 0 and asked a held-out question (greedy).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import (AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, LlamaConfig,
                          LlamaForCausalLM, set_seed)
from transformers.utils import logging as hf_logging

from hf_cephalo import CephaloSFTConfig, CephaloSFTTrainer, from_pretrained_sharded
from hf_cephalo.demo_data import (CHAT_FORMATS, pydoc_chat_dataset, pydoc_chat_pairs, pydoc_texts,
                                  train_chat_tokenizer)
from hf_cephalo.integrations import format_loss_trend, progress_bars_from_rank_zero

logger = logging.getLogger("train_sft")


@dataclass(kw_only=True)
class ModelArguments:
    """Which model to fine-tune. Sizes apply to a model built from its config."""

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Hub id or local directory of a causal LM safetensors checkpoint "
                "(hf_cephalo.from_pretrained_sharded: each rank reads only its shards)."})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "Tokenizer with a chat template (Hub id or directory). Default: the checkpoint's, "
                "or a BPE with ChatML markers trained on the pydoc text."})
    vocab_size: int = field(default=2048, metadata={
        "help": "Vocabulary size (tokens) of the trained BPE, ChatML markers not counted "
                "(>= 258)."})
    hidden_size: int = field(default=128, metadata={
        "help": "Hidden size (features) of a new model."})
    num_layers: int = field(default=4, metadata={"help": "Transformer layers of a new model."})
    num_heads: int = field(default=4, metadata={"help": "Attention heads of a new model."})

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} = {getattr(self, name)} must be >= 1")
        if self.vocab_size < 258:
            raise ValueError(f"--vocab_size {self.vocab_size} must be >= 258 (256 byte symbols "
                             "+ 2 special tokens)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden_size {self.hidden_size} must be a multiple of "
                             f"--num_heads {self.num_heads}")


@dataclass(kw_only=True)
class DataArguments:
    """The offline chat data (pydoc_chat_dataset)."""

    dataset_format: str = field(default="messages", metadata={
        "help": f"TRL dataset format: one of {CHAT_FORMATS}."})
    answer_chars: int = field(default=300, metadata={
        "help": "Characters per answer: each topic's text is cut into parts of at most this "
                "many characters, one conversation per part."})
    max_pairs: int | None = field(default=None, metadata={
        "help": "Keep the first this many conversations (all ~1,500 at 300 characters)."})
    eval_pairs: int = field(default=64, metadata={
        "help": "Conversations held out (the last ones) for evaluation (0: none)."})
    max_new_tokens: int = field(default=48, metadata={"help": "Tokens of the greedy reply."})

    def __post_init__(self) -> None:
        if self.dataset_format not in CHAT_FORMATS:
            raise ValueError(f"--dataset_format {self.dataset_format!r}: use one of {CHAT_FORMATS}")
        if self.answer_chars < 1 or self.eval_pairs < 0 or self.max_new_tokens < 1:
            raise ValueError(f"--answer_chars {self.answer_chars} (>= 1), --eval_pairs "
                             f"{self.eval_pairs} (>= 0), --max_new_tokens {self.max_new_tokens} "
                             "(>= 1): a value is out of range")


def load_tokenizer(model_args: ModelArguments, args: CephaloSFTConfig):
    """The given tokenizer, or a ChatML BPE trained on the pydoc text by rank 0 and sent to
    the others (by broadcast: the machines of a job need not share a filesystem)."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is not None:
        return AutoTokenizer.from_pretrained(name)
    files = [None]
    if args.process_index == 0:
        tokenizer = train_chat_tokenizer(pydoc_texts(), vocab_size=model_args.vocab_size,
                                         model_max_length=args.max_length or 1024)
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            files = [{f: Path(tmp, f).read_bytes() for f in os.listdir(tmp)}]
    if args.world_size > 1:  # args.world_size has set up the process group
        dist.broadcast_object_list(files, src=0)
    if args.process_index == 0:
        return tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        for f, data in files[0].items():
            Path(tmp, f).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)


def build_model(model_args: ModelArguments, tokenizer, max_length: int):
    if model_args.model_name_or_path is not None:
        return from_pretrained_sharded(model_args.model_name_or_path, dtype=torch.float32)
    h = model_args.hidden_size
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=h, intermediate_size=4 * h,
                         num_hidden_layers=model_args.num_layers,
                         num_attention_heads=model_args.num_heads,
                         num_key_value_heads=model_args.num_heads,
                         max_position_embeddings=max(max_length, 64),
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config)


def ask(save_dir: str, question: str, chat: bool, max_new_tokens: int) -> str:
    """Rank 0: the saved model's greedy reply to ``question``, through the chat template (a
    conversational format) or as the "Question: ...\nAnswer:" prompt the other formats train."""
    tokenizer = AutoTokenizer.from_pretrained(save_dir)
    model = AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32).eval()
    if chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
    else:
        prompt = tokenizer(f"Question: {question}\nAnswer:", return_tensors="pt")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stop = [t for t in (end, tokenizer.eos_token_id) if isinstance(t, int) and t >= 0]
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop or None, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, CephaloSFTConfig))
    # TRL's defaults except: packing on, loss on the assistant turns only, fp32 (bf16 autocast
    # is slow on most CPUs), a learning rate for a model trained from scratch, bars only on a
    # terminal (in a log file every refresh of a bar lands)
    parser.set_defaults(packing=True, assistant_only_loss=True, max_length=256, bf16=False,
                        learning_rate=1e-3, logging_steps=10, report_to="none",
                        save_strategy="no", disable_tqdm=not sys.stderr.isatty())
    model_args, data_args, args = parser.parse_args_into_dataclasses(args=argv)
    progress_bars_from_rank_zero(args.process_index, args.disable_tqdm)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        level=logging.INFO if args.process_index == 0 else logging.WARNING)
    hf_logging.disable_propagation()
    main_rank = args.process_index == 0

    data = pydoc_chat_dataset(data_args.dataset_format, data_args.max_pairs,
                              max_answer_chars=data_args.answer_chars, parts=True)
    num_eval = min(data_args.eval_pairs, len(data) - 1)
    train = data.select(range(len(data) - num_eval))
    evaluation = data.select(range(len(data) - num_eval, len(data))) if num_eval else None
    tokenizer = load_tokenizer(model_args, args)
    if main_rank:
        print(f"data: {len(data)} {data_args.dataset_format} conversations -> {len(train)} "
              f"train, {num_eval} eval; vocabulary {len(tokenizer)}", flush=True)
    set_seed(args.seed)  # the same initial weights on every rank
    model = build_model(model_args, tokenizer, args.max_length or 1024)
    if main_rank:
        print(f"model: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} "
              "parameters", flush=True)
    trainer = CephaloSFTTrainer(model=model, args=args, train_dataset=train,
                                eval_dataset=evaluation, processing_class=tokenizer)
    if main_rank:
        packed = "seq_lengths" in trainer.train_dataset.column_names
        print(f"SFT rows: {len(trainer.train_dataset)} "
              f"({'packed, ' + args.packing_strategy if packed else 'one conversation each'}); "
              f"padding-free: {trainer.padding_free}", flush=True)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    if main_rank and logs:
        print(f"train loss: {format_loss_trend([h['loss'] for h in logs])}", flush=True)
        last = logs[-1]
        print(f"TRL metrics at step {last['step']}: entropy {last['entropy']:.3f}, "
              f"mean_token_accuracy {last['mean_token_accuracy']:.3f}, num_tokens "
              f"{int(last['num_tokens']):,}", flush=True)
    if evaluation is not None:
        metrics = trainer.evaluate()
        if main_rank:
            print(f"eval loss {metrics['eval_loss']:.4f}, eval mean_token_accuracy "
                  f"{metrics['eval_mean_token_accuracy']:.3f} on {num_eval} conversations",
                  flush=True)
    save_dir = os.path.join(args.output_dir, "final")
    trainer.save_model(save_dir)  # collective: every rank; rank 0 writes
    trainer.accelerator.wait_for_everyone()
    if main_rank:
        pairs = pydoc_chat_pairs(data_args.max_pairs, max_answer_chars=data_args.answer_chars,
                                 parts=True)
        question = pairs[len(train) if num_eval else 0][0]  # the first held-out one
        chat = data_args.dataset_format in ("messages", "conversational_prompt_completion")
        reply = ask(save_dir, question, chat, data_args.max_new_tokens)
        print(f"saved to {save_dir}; asked {question!r}, the reloaded model replies "
              f"(greedy): {reply!r}", flush=True)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:] or None)
