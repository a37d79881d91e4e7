"""SFT benchmark: CephaloSFTTrainer vs stock TRL SFTTrainer under FSDP2, with and without packing.

Two gloo ranks on CPU emulate a 1x and a 3x slower device. Both systems train the same small
Llama (built from a config) on the same offline chat data (``pydoc_chat_dataset``: ~1,500
conversations about Python's documentation, a ChatML BPE tokenizer trained on the same text),
the same global batch of ``--global-batch-size`` rows, in fp32, in ONE run, for three data
layouts:

  * no packing: one conversation per row, padded to the global batch's longest;
  * packing wrapped: rows of exactly ``--max-length`` tokens cut from the concatenated text;
  * packing bfd: best-fit decreasing, padding-free (TRL's flattening collator, per-document
    positions, block-diagonal attention).

Systems:
  (a) stock ``SFTTrainer`` on accelerate's FSDP2 path (``fully_shard`` per decoder layer + the
      root, reshard after forward) with the even split FSDP2 needs (B / 2 rows per rank).
      Accelerate refuses FSDP on a CPU-only state, so the benchmark sets the state's
      distributed type to FSDP with an FSDP2 plugin after the Trainer built its Accelerator:
      everything after that is stock (``accelerator.prepare`` -> ``fsdp2_prepare_model``).
      The 3x rank is emulated as Cephalo emulates it: each decoder layer's forward and
      backward are timed and followed by a sleep of 2x their duration (``emulate_layers``).
  (b) ``CephaloSFTTrainer`` with ``--cephalo_emulate_slowdown 1 3``: it profiles both ranks,
      plans (b_i, m_i, r_i) and trains (live re-balancing off, so every timed step runs the
      start plan).

Measured per step (median of ``--steps`` steps after ``--warmup``): the step time (rank 0's,
between consecutive step ends: the ranks meet in every step's collectives) and the tokens
trained, TRL's own ``num_tokens`` (real tokens: attention-mask sum, or the padding-free row's
length). Printed: tokens/s, Cephalo / FSDP2, packing vs no packing, and the physical bound:
rank 0 alone (no emulation, no communication) trains the global batch (forward, backward,
AdamW) while rank 1 waits; with speeds 1 and 1/3 a perfect split takes that time / (1 + 1/3).
Benchmarks never assert wall clock.

Usage: python benchmarks/bench_sft.py [--steps 6] [--global-batch-size 16] [--max-length 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from rank_launch import free_port, run_ranks  # this folder is on sys.path

LAYOUTS = {"no packing": dict(packing=False),
           "packing wrapped": dict(packing=True, packing_strategy="wrapped"),
           "packing bfd (padding-free)": dict(packing=True, packing_strategy="bfd")}
SYSTEMS = ("FSDP2 (stock SFTTrainer)", "CephaloSFTTrainer")


def build_model(args, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=args.max_length, use_cache=False)
    return LlamaForCausalLM(cfg).float()


def chat_data(args):
    """The conversations, answers cut to deterministic lengths spread over 40 ..
    ``--answer-chars`` characters (chat data is not of one length: what padding wastes and
    packing recovers)."""
    from hf_cephalo.demo_data import pydoc_chat_dataset

    data = pydoc_chat_dataset("messages", args.max_pairs, max_answer_chars=args.answer_chars,
                              parts=True)
    spread = max(args.answer_chars - 40, 1)

    def cut(row, i):
        user, assistant = row["messages"]
        size = 40 + (i * 137) % spread
        return {"messages": [user, {**assistant, "content": assistant["content"][:size]}]}
    return data.map(cut, with_indices=True)


def sft_kwargs(args, layout: str, out_dir: str) -> dict:
    return dict(output_dir=out_dir, report_to="none", max_steps=args.warmup + args.steps,
                logging_steps=1, save_strategy="no", seed=0, bf16=False,
                gradient_checkpointing=False, disable_tqdm=True, use_cpu=True,
                max_length=args.max_length, learning_rate=1e-3, dataloader_drop_last=True,
                **LAYOUTS[layout])


# ---- the emulated 3x rank for FSDP2 (what profiler.emulate does for Cephalo's units) --------

class _BackwardStart(torch.autograd.Function):
    """Identity on a layer's output; its backward (the first of the layer's) starts the clock.
    A copy, not a view: FSDP2 hooks its pre-backward on the layer's output, which an in-place
    op on a view would bypass."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock[0] = time.perf_counter()
        return grad, None


class _BackwardEnd(torch.autograd.Function):
    """Identity on a layer's input; its backward (the last of the layer's) sleeps (s - 1) x
    the layer's backward time."""

    @staticmethod
    def forward(ctx, x, clock, factor):
        ctx.clock, ctx.factor = clock, factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep((ctx.factor - 1) * (time.perf_counter() - ctx.clock[0]))
        return grad, None, None


def emulate_layers(model, factor: float) -> None:
    """Each decoder layer's forward and backward followed by a sleep of (factor - 1) x their
    duration (before ``fully_shard``: FSDP2's unshard / reshard hooks stay outside the clock)."""
    if factor == 1.0:
        return
    for layer in model.model.layers:
        forward, clock = layer.forward, [0.0]

        def timed(hidden, *a, _forward=forward, _clock=clock, **kw):
            hidden = _BackwardEnd.apply(hidden, _clock, factor)
            t = time.perf_counter()
            out = _forward(hidden, *a, **kw)
            time.sleep((factor - 1) * (time.perf_counter() - t))
            return _BackwardStart.apply(out, _clock)
        layer.forward = timed


class StepClock:
    """A TrainerCallback's step-end times (perf_counter, s)."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                clock.ends.append(time.perf_counter())

        self.ends: list[float] = []
        self.callback = Callback()


def _measure(trainer, clock: StepClock, args) -> dict:
    """Median step time over the timed steps and TRL's num_tokens per step."""
    trainer.train()
    logs = [h for h in trainer.state.log_history if "num_tokens" in h and "loss" in h]
    tokens = [b["num_tokens"] - a["num_tokens"] for a, b in zip(logs, logs[1:])]
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    timed = slice(args.warmup - 1, None)  # step k's time needs the end of step k - 1
    return dict(step_s=statistics.median(steps[timed]), tokens=statistics.median(tokens[timed]),
                loss=logs[-1]["loss"])


def use_fsdp2(trainer, layer_class: str) -> None:
    """Put a stock Trainer's Accelerator on FSDP2 after the Trainer built it: what accelerate
    does on GPUs for fsdp_version 2 (``fully_shard`` per ``layer_class`` + the root, reshard
    after forward); accelerate refuses FSDP on a CPU-only state. Everything after (prepare ->
    ``fsdp2_prepare_model``) is stock. Call it at the end of an override of
    ``create_accelerator_and_postprocess``."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[layer_class], reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT")
    trainer.is_fsdp_enabled = True


def run_fsdp2(args, rank, layout, tokenizer, out_dir):
    from trl import SFTConfig, SFTTrainer

    class FSDP2SFTTrainer(SFTTrainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            use_fsdp2(self, "LlamaDecoderLayer")

    model = build_model(args, len(tokenizer))
    emulate_layers(model, args.slowdown[rank])
    clock = StepClock()
    config = SFTConfig(**sft_kwargs(args, layout, out_dir),
                       per_device_train_batch_size=args.global_batch_size // 2)
    trainer = FSDP2SFTTrainer(model=model, args=config, train_dataset=chat_data(args),
                              processing_class=tokenizer, callbacks=[clock.callback])
    return _measure(trainer, clock, args), trainer


def run_cephalo(args, rank, layout, tokenizer, out_dir):
    from hf_cephalo import CephaloSFTConfig, CephaloSFTTrainer

    clock = StepClock()
    # activation checkpointing only where memory needs it (FSDP2 runs without it here)
    config = CephaloSFTConfig(**sft_kwargs(args, layout, out_dir),
                              cephalo_global_batch_size=args.global_batch_size,
                              cephalo_emulate_slowdown=args.slowdown,
                              cephalo_activation_checkpointing="auto", cephalo_adaptive="off")
    trainer = CephaloSFTTrainer(model=build_model(args, len(tokenizer)), args=config,
                                train_dataset=chat_data(args), processing_class=tokenizer,
                                callbacks=[clock.callback])
    out = _measure(trainer, clock, args)
    out["plan"] = [(r.batch_size, r.microbatch_size, round(r.state_ratio, 3))
                   for r in trainer.plan.ranks]
    out["recompute"] = bool(trainer.plan.activation_checkpointing)
    return out


BOUND_MICROBATCH_SIZES = (1, 2, 4, 8, 16)


def bound_s(args, rank, trainer, tokenizer) -> dict:
    """The physical bound: rank 0 alone trains one global batch of the stock run's prepared
    rows (forward and backward of each microbatch, gradients accumulated, one AdamW step; no
    emulation, no recompute, no communication) while rank 1 waits, cut into microbatches of
    the row count that is fastest on it (``BOUND_MICROBATCH_SIZES``: a padding-free row's
    attention grows with the square of its length); median step time / (1 + 1/3), the time of
    a perfect split over speeds 1 and 1/3."""
    dist.barrier()
    out = {"bound_s": float("nan"), "bound_m": 0}
    if rank == 0:
        model = build_model(args, len(tokenizer)).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        keep = ("input_ids", "labels", "seq_lengths")
        rows = [{k: r[k] for k in keep if k in r}
                for r in (trainer.train_dataset[i] for i in range(args.global_batch_size))]
        names = ("input_ids", "attention_mask", "position_ids", "labels")
        best = None
        for m in (m for m in BOUND_MICROBATCH_SIZES if m <= len(rows)):
            micro = [{k: v for k, v in trainer.data_collator(rows[i:i + m]).items() if k in names}
                     for i in range(0, len(rows), m)]
            times = []
            for _ in range(1 + max(args.steps // 2, 2)):  # one warm-up, then timed
                t = time.perf_counter()
                for inputs in micro:
                    model(**inputs).loss.backward()
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - t)
            step = statistics.median(times[1:])
            if best is None or step < best[0]:
                best = (step, m)
        out = {"bound_s": best[0] / sum(1 / s for s in args.slowdown), "bound_m": best[1]}
    dist.barrier()
    return out


def worker(rank, args, port, tokenizer_dir, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    torch.set_num_threads(1)
    import datasets
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for layout in LAYOUTS:
                fsdp2, trainer = run_fsdp2(args, rank, layout, tokenizer,
                                           os.path.join(tmp, "fsdp2"))
                cephalo = run_cephalo(args, rank, layout, tokenizer, os.path.join(tmp, "ceph"))
                results[layout] = dict(fsdp2=fsdp2, cephalo=cephalo,
                                       **bound_s(args, rank, trainer, tokenizer))
        out_q.put((rank, results))
    finally:
        dist.destroy_process_group()


def report(args, results, load_before: float) -> None:
    print(f"\n2 CPU ranks emulating slowdown {args.slowdown}; Llama {args.layers} layers, "
          f"hidden {args.hidden}; offline pydoc chat data (answers of {args.answer_chars} "
          f"characters), max_length {args.max_length}; global batch {args.global_batch_size} "
          f"rows; fp32; median of {args.steps} steps after {args.warmup}")
    head = (f"{'layout':<28} {'system':<26} {'plan b/m/r':<26} {'step s':>7} {'tokens':>7} "
            f"{'tokens/s':>9} {'vs FSDP2':>9} {'x bound':>8}")
    print(head)
    print("-" * len(head))
    rates = {}
    for layout, r in results.items():
        base = r["fsdp2"]["tokens"] / r["fsdp2"]["step_s"]
        bound_rate = r["cephalo"]["tokens"] / r["bound_s"]  # the tokens of one global batch
        for name, key in zip(SYSTEMS, ("fsdp2", "cephalo")):
            m = r[key]
            rate = m["tokens"] / m["step_s"]
            rates[(layout, key)] = rate
            plan = "even B/2 per rank" if key == "fsdp2" else \
                " ".join(f"{b}/{mb}/{s:.2f}" for b, mb, s in m["plan"]) + \
                (" AC" if m["recompute"] else "")
            print(f"{layout:<28} {name:<26} {plan:<26} {m['step_s']:>7.3f} {m['tokens']:>7.0f} "
                  f"{rate:>9.0f} {rate / base:>8.2f}x {m['step_s'] / r['bound_s']:>7.2f}x")
        alone = f"rank 0 alone, m={r['bound_m']}"
        print(f"{layout:<28} {'physical bound':<26} {alone:<26} "
              f"{r['bound_s']:>7.3f} {'':>7} {bound_rate:>9.0f}")
    no_pack = "no packing"
    for layout in list(LAYOUTS)[1:]:
        print(f"{layout} vs no packing, tokens/s: Cephalo "
              f"{rates[(layout, 'cephalo')] / rates[(no_pack, 'cephalo')]:.2f}x, FSDP2 "
              f"{rates[(layout, 'fsdp2')] / rates[(no_pack, 'fsdp2')]:.2f}x")
    print(f"load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} (1 min), "
          f"{os.cpu_count()} CPUs")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slowdown", default="1,3", help="per-rank emulated slowdown (default 1,3)")
    p.add_argument("--global-batch-size", type=int, default=16, help="rows per step (even)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (>= 1)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per row (packed length)")
    p.add_argument("--answer-chars", type=int, default=600,
                   help="longest answer (characters); answers spread over 40 .. this")
    p.add_argument("--max-pairs", type=int, default=600, help="conversations (default 600)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary (tokens)")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--smoke", action="store_true",
                   help="smallest settings: B = 2, 1 warm-up and 1 timed step, 2 layers, 40 "
                        "conversations (the suite's check that the benchmark runs; numbers "
                        "meaningless)")
    args = p.parse_args(argv)
    if args.smoke:
        args.global_batch_size, args.steps, args.warmup, args.max_length = 2, 1, 1, 64
        args.answer_chars, args.max_pairs, args.layers, args.hidden, args.vocab = \
            120, 40, 2, 32, 300
    args.slowdown = [float(x) for x in args.slowdown.split(",")]
    if len(args.slowdown) != 2 or args.global_batch_size % 2 or args.warmup < 1:
        p.error("two slowdowns, an even --global-batch-size and --warmup >= 1")
    load_before = os.getloadavg()[0]
    from hf_cephalo.demo_data import pydoc_texts, train_chat_tokenizer

    with tempfile.TemporaryDirectory() as tokenizer_dir, tempfile.TemporaryDirectory() as cache:
        os.environ["HF_CEPHALO_PROFILE_CACHE"] = cache  # this run's profiles (the workers inherit)
        texts = pydoc_texts()
        train_chat_tokenizer(texts[:40] if args.smoke else texts, args.vocab,
                             model_max_length=args.max_length).save_pretrained(tokenizer_dir)
        port = free_port()
        results = dict(run_ranks(worker, [(r, args, port, tokenizer_dir) for r in range(2)],
                                 timeout_s=3600))
    report(args, results[0], load_before)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0], f, indent=2)


if __name__ == "__main__":
    main()
