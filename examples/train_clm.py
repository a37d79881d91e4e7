"""Causal language modeling with CephaloTrainer: Llama (default) or GPT-2, from scratch or a checkpoint.

Launch on 2 CPU processes (no GPU needed) with an uneven plan:

    accelerate launch --config_file accelerate_configs/cephalo_cpu.yaml examples/train_clm.py \\
        --cephalo_plan_file plan.json --output_dir outputs/clm --max_steps 40

Everything a stock ``run_clm.py`` user knows applies: the script parses
``(ModelArguments, DataArguments, CephaloTrainingArguments)`` with ``HfArgumentParser``, so every
``TrainingArguments`` flag works (``--learning_rate``, ``--max_steps``, ``--logging_steps`` ...)
plus the ``--cephalo_*`` flags (docs/accelerate.md).

- Model: a small Llama built from its config (``--model_type gpt2`` for GPT-2), or
  ``--model_name_or_path`` (a Hub id or a local checkpoint directory of safetensors), loaded
  with ``hf_cephalo.from_pretrained_sharded``: the model is built on the meta device and each
  rank reads only its shards of the checkpoint (needs ``--cephalo_plan_file`` or
  ``--cephalo_profile_file``: a meta model cannot be profiled at start).
- Data: ``--train_file`` (a plain text file), or ``--dataset_name`` (``datasets.load_dataset``),
  else Python's own documentation text (``pydoc_data.topics``, shipped with CPython).
- Tokenizer: ``--tokenizer_name`` (or the checkpoint's), else a byte-level BPE trained on the data.

At the end the model is saved (``save_model``, every rank), reloaded with ``from_pretrained`` on
rank 0, its logits are compared with the trained sharded model's logits computed by the engine
on the same batch (fp32, rtol 1e-5, atol 1e-5), and a greedy sample is generated.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config,
                          GPT2LMHeadModel, HfArgumentParser, LlamaConfig, LlamaForCausalLM,
                          default_data_collator, set_seed)

from hf_cephalo import CephaloTrainer, CephaloTrainingArguments, from_pretrained_sharded
from hf_cephalo.demo_data import group_texts, pydoc_text_dataset, train_bpe_tokenizer
from hf_cephalo.integrations import format_loss_trend, progress_bars_from_rank_zero

logger = logging.getLogger("train_clm")

# Same tolerance as the engine parity tests for a forward pass (fp32): the engine runs the
# model's own modules unit by unit, so logits differ from a plain forward only by rounding.
_LOGITS_RTOL, _LOGITS_ATOL = 1e-5, 1e-5


@dataclass(kw_only=True)
class ModelArguments:
    """Which model to train. Sizes apply to models built from scratch (no --model_name_or_path)."""

    model_type: Literal["llama", "gpt2"] = field(default="llama", metadata={
        "help": "Architecture built from scratch: 'llama' or 'gpt2'. Ignored with --model_name_or_path."})
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Hub id or local directory of a causal LM safetensors checkpoint to fine-tune "
                "(hf_cephalo.from_pretrained_sharded: each rank reads only its shards)."})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "Hub id or local directory of a tokenizer. Default: the checkpoint's tokenizer, or "
                "a byte-level BPE trained on the training text."})
    vocab_size: int = field(default=2048, metadata={
        "help": "Vocabulary size (tokens) of the trained BPE tokenizer (>= 258)."})
    hidden_size: int = field(default=128, metadata={"help": "Hidden size (features) of a new model."})
    num_layers: int = field(default=4, metadata={"help": "Number of transformer layers of a new model."})
    num_heads: int = field(default=4, metadata={"help": "Attention heads of a new model."})

    def __post_init__(self) -> None:
        if self.model_type not in ("llama", "gpt2"):
            raise ValueError(f"--model_type {self.model_type!r}: use 'llama' or 'gpt2' (or "
                             "--model_name_or_path for any supported checkpoint)")
        for name in ("hidden_size", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} = {getattr(self, name)} must be >= 1")
        if self.vocab_size < 258:  # checked on every rank: only rank 0 trains the tokenizer
            raise ValueError(f"--vocab_size {self.vocab_size} must be >= 258 (256 byte symbols + "
                             "2 special tokens)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden_size {self.hidden_size} must be a multiple of "
                             f"--num_heads {self.num_heads}")


@dataclass(kw_only=True)
class DataArguments:
    """Where the text comes from and how it is cut into blocks."""

    train_file: str | None = field(default=None, metadata={
        "help": "A plain UTF-8 text file to train on (one document per line or free text)."})
    dataset_name: str | None = field(default=None, metadata={
        "help": "A dataset for datasets.load_dataset (Hub id or local path)."})
    dataset_config_name: str | None = field(default=None, metadata={
        "help": "The dataset's configuration name, if it has several."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    max_chars: int | None = field(default=None, metadata={
        "help": "Default data only: keep whole pydoc topics up to this many characters."})
    block_size: int = field(default=64, metadata={"help": "Tokens per training sample (>= 2)."})
    validation_fraction: float = field(default=0.05, metadata={
        "help": "Fraction in [0, 1) of the blocks held out for evaluation (0: no evaluation)."})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "Keep at most this many training blocks (samples)."})
    prompt: str = field(default="The assert statement", metadata={
        "help": "Prompt of the generated sample printed at the end."})
    max_new_tokens: int = field(default=32, metadata={"help": "Tokens to generate (greedy)."})

    def __post_init__(self) -> None:
        if self.train_file is not None and self.dataset_name is not None:
            raise ValueError("give either --train_file or --dataset_name, not both")
        if self.train_file is not None:
            if not os.path.isfile(self.train_file):
                raise ValueError(f"--train_file {self.train_file!r} does not exist or is not a file")
            if os.path.getsize(self.train_file) == 0:
                raise ValueError(f"--train_file {self.train_file!r} is empty; give a text file "
                                 "with at least a few block_size tokens of text")
        if self.block_size < 2:
            raise ValueError(f"--block_size {self.block_size} must be >= 2 (tokens)")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"--validation_fraction {self.validation_fraction} must be in [0, 1)")
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise ValueError(f"--max_train_samples {self.max_train_samples} must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens {self.max_new_tokens} must be >= 1")


def load_text(data_args: DataArguments):
    """The raw text as a ``datasets.Dataset`` with a ``text_column`` column."""
    import datasets

    if data_args.train_file is not None:
        return datasets.load_dataset("text", data_files={"train": data_args.train_file},
                                     split="train")
    if data_args.dataset_name is not None:
        return datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name,
                                     split="train")
    return pydoc_text_dataset(max_chars=data_args.max_chars)


def load_tokenizer(model_args: ModelArguments, text, training_args: CephaloTrainingArguments,
                   text_column: str):
    """The given tokenizer, or a BPE trained on ``text`` by rank 0 and sent to the other ranks.

    The trained tokenizer's files travel by broadcast, not through ``output_dir``: machines of a
    multi-machine job need not share a filesystem, and every rank must use the same vocabulary.
    """
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is not None:
        tokenizer = AutoTokenizer.from_pretrained(name)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    files = [None]
    if training_args.process_index == 0:
        tokenizer = train_bpe_tokenizer(text[text_column], vocab_size=model_args.vocab_size)
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            files = [{f: Path(tmp, f).read_bytes() for f in os.listdir(tmp)}]
    if training_args.world_size > 1:  # args.world_size has set up the process group
        dist.broadcast_object_list(files, src=0)
    if training_args.process_index == 0:
        return tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        for f, data in files[0].items():
            Path(tmp, f).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)


def build_model(model_args: ModelArguments, tokenizer, block_size: int):
    """A new small Llama / GPT-2 sized for ``tokenizer``, or the checkpoint's model."""
    if model_args.model_name_or_path is not None:
        # Built on the meta device; the engine reads only this rank's shards from the
        # safetensors files (no process ever holds the whole model; docs/checkpoints.md).
        return from_pretrained_sharded(model_args.model_name_or_path, dtype=torch.float32)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    h, n, heads = model_args.hidden_size, model_args.num_layers, model_args.num_heads
    if model_args.model_type == "gpt2":
        config = GPT2Config(vocab_size=len(tokenizer), n_embd=h, n_layer=n, n_head=heads,
                            n_positions=max(block_size, 64), **special)
        return GPT2LMHeadModel(config)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=h, intermediate_size=4 * h,
                         num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max(block_size, 64), **special)
    return LlamaForCausalLM(config)


def check_reloaded(trainer: CephaloTrainer, save_dir: str, sample: dict[str, torch.Tensor],
                   tokenizer, data_args: DataArguments) -> None:
    """Collective. Engine logits (trained, sharded) vs the reloaded checkpoint's; rank 0 generates."""
    trainer.model.eval()
    is_main = trainer.is_world_process_zero()
    mbs = trainer._prepare_input([sample]) if is_main else []
    engine_logits = trainer.engine.evaluate(mbs).logits  # every rank joins the all-gathers
    trainer.accelerator.wait_for_everyone()  # rank 0 has finished writing the checkpoint
    if not is_main:
        return
    # Same device and precision as training: with --bf16 the engine computed under bf16
    # autocast from parameters gathered in the param dtype (bf16 by default), so the reloaded
    # fp32 weights get the same cast (parameters only: buffers such as rotary tables stay as
    # the engine keeps them) and run under the same autocast.
    device = trainer.args.device
    reloaded = AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32).to(device)
    param_dtype = trainer.args.engine_precision().param
    if param_dtype is not None:
        for p in reloaded.parameters():
            p.data = p.data.to(param_dtype)
    reloaded.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                         enabled=bool(trainer.args.bf16)):
        reloaded_logits = reloaded(input_ids=sample["input_ids"].to(device),
                                   attention_mask=sample["attention_mask"].to(device)).logits
    reloaded_logits = reloaded_logits.float().cpu()
    ours = engine_logits[0].float().cpu()
    diff = (ours - reloaded_logits).abs().max().item()
    torch.testing.assert_close(reloaded_logits, ours, rtol=_LOGITS_RTOL, atol=_LOGITS_ATOL)
    print(f"reloaded checkpoint {save_dir}: logits equal the trained model's on a sample batch "
          f"{tuple(sample['input_ids'].shape)} (max abs diff {diff:.2e}, rtol {_LOGITS_RTOL}, "
          f"atol {_LOGITS_ATOL})", flush=True)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(save_dir)
    prompt = reloaded_tokenizer(data_args.prompt, return_tensors="pt").to(device)
    generated = reloaded.generate(**prompt, max_new_tokens=data_args.max_new_tokens,
                                  do_sample=False, pad_token_id=reloaded_tokenizer.pad_token_id)
    new_tokens = generated[0, prompt["input_ids"].shape[1]:]
    eos = reloaded.generation_config.eos_token_id  # an id, a list of ids, or None
    eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    if len(new_tokens) and new_tokens[0].item() in eos_ids:
        print(f"generated (greedy): the model emitted the end-of-text token at once after the "
              f"prompt {data_args.prompt!r} (no new text; train longer or change --prompt)",
              flush=True)
        return
    text = reloaded_tokenizer.decode(generated[0], skip_special_tokens=True)
    print(f"generated (greedy, {data_args.max_new_tokens} new tokens): {text!r}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, CephaloTrainingArguments))
    # progress bars only on a terminal: in a log file (`> log`) every refresh of a bar lands;
    # there the logged losses say the same. --disable_tqdm false/true overrides it.
    parser.set_defaults(disable_tqdm=not sys.stderr.isatty())
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    # datasets' map/filter and the model-loading bars: rank 0's only (every rank maps the same
    # text: one set of bars, as with stock main_process_first), none with --disable_tqdm
    progress_bars_from_rank_zero(training_args.process_index, training_args.disable_tqdm)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        level=logging.INFO if training_args.process_index == 0 else logging.WARNING)
    # transformers' loggers print through their own handler and, where the environment sets CI=1,
    # also propagate to the root handler configured above: every transformers warning twice
    hf_logging.disable_propagation()

    text = load_text(data_args)
    if data_args.text_column not in text.column_names:
        raise ValueError(f"--text_column {data_args.text_column!r} is not a column of the data "
                         f"(columns: {text.column_names})")
    tokenizer = load_tokenizer(model_args, text, training_args, data_args.text_column)
    blocks = group_texts(text, tokenizer, data_args.block_size, text_column=data_args.text_column)
    num_eval = math.floor(len(blocks) * data_args.validation_fraction)
    train = blocks.select(range(num_eval, len(blocks)))
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    evaluation = blocks.select(range(num_eval)) if num_eval else None
    if training_args.process_index == 0:
        print(f"data: {len(blocks)} blocks of {data_args.block_size} tokens -> {len(train)} train, "
              f"{num_eval} eval; vocabulary {len(tokenizer)}", flush=True)

    set_seed(training_args.seed)  # the same initial weights on every rank
    model = build_model(model_args, tokenizer, data_args.block_size)
    if training_args.process_index == 0:
        print(f"model: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} "
              "parameters", flush=True)
    trainer = CephaloTrainer(model=model, args=training_args, train_dataset=train,
                             eval_dataset=evaluation, processing_class=tokenizer,
                             data_collator=default_data_collator)
    # a path, "true" for the last checkpoint-N in output_dir; a bad path raises CheckpointError
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero() and losses:
        print(f"train loss: {format_loss_trend(losses)}", flush=True)
    if evaluation is not None:
        metrics = trainer.evaluate()
        if trainer.is_world_process_zero():
            print(f"eval loss {metrics['eval_loss']:.4f} (perplexity "
                  f"{math.exp(min(metrics['eval_loss'], 50)):.1f}) on {num_eval} blocks", flush=True)

    save_dir = os.path.join(training_args.output_dir, "final")
    trainer.save_model(save_dir)  # collective: every rank
    if trainer.is_world_process_zero():
        print(f"saved model and tokenizer to {save_dir}", flush=True)
    sample = default_data_collator([train[i] for i in range(min(2, len(train)))])
    check_reloaded(trainer, save_dir, sample, tokenizer, data_args)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:] or None)
