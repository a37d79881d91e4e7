"""The generic staged model's cost (issue 36): its step time against direct calls of the layers,
and the self-check's cost at start.

One process, CPU (or ``--device cuda``), a Llama-shaped model built from a config (no
download). Per step, the same global batch as ``--microbatches`` microbatches, forward +
backward, three ways, timed interleaved (median of ``--steps`` after a warm-up, so a load
change on a shared machine hits all alike):

* ``model``: the model's own ``model(**mb).loss`` per microbatch, scaled to the global mean
  (standard gradient accumulation in one process: what the other two compute);
* ``direct``: what a hand-written adapter does (the Llama adapter this path replaced): the
  embedding, rotary embeddings and causal mask computed once per microbatch by direct calls,
  each decoder layer called with them, then the final norm, the LM head and the loss;
* ``generic``: ``stage_model(model)``'s ``embed`` / ``run_unit`` / ``head_loss`` per microbatch,
  i.e. the model's own forward around stub layers (what the engine runs per unit).

It prints each as a multiple of ``model`` (the bound: one process, no staging) and ``generic``
over ``direct`` (goal <= 1.02x). The same for a ViT image classifier (``--image-size``, patches
of 16, the same hidden size and depth): ``direct`` is what the hand-written ViT adapter that the
generic path replaced did (embeddings, the bidirectional mask, each layer, the final norm, the
[CLS] row, the classifier, the loss), ``generic`` is ``stage_model``'s staging (issue 47, goal
<= 1.02x). Then the self-check: for each class of the 2026 zoo
(``tests/zoo_fixtures.py``), the first ``stage_model`` of a model of that class and config (a
tiny copy built and compared: cold), and a second one (cached), in seconds.

Usage: python benchmarks/bench_generic.py [--hidden 512] [--layers 4] [--seq 256]
       [--microbatches 4] [--microbatch-size 2] [--steps 10] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_cephalo.models import stage_model  # noqa: E402
from hf_cephalo.models import self_check  # noqa: E402


def build(args) -> transformers.PreTrainedModel:
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(args.hidden // 128, 1), max_position_embeddings=args.seq)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(args.device)


def microbatches(args) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(args.microbatches):
        ids = torch.randint(0, args.vocab, (args.microbatch_size, args.seq), generator=g)
        mask = torch.ones_like(ids)
        mask[0, args.seq - 8 * (i + 1):] = 0  # uneven padding
        labels = ids.masked_fill(mask == 0, -100)
        out.append({k: v.to(args.device) for k, v in
                    dict(input_ids=ids, attention_mask=mask, labels=labels).items()})
    return out


def _items(mb) -> int:
    return int((mb["labels"][:, 1:] != -100).sum())


def step_model(model, mbs) -> None:
    n = sum(_items(mb) for mb in mbs)
    for mb in mbs:
        (model(**mb).loss * (_items(mb) / n)).backward()


def step_direct(model, mbs) -> None:
    from transformers.masking_utils import create_causal_mask

    inner, n = model.model, sum(_items(mb) for mb in mbs)
    for mb in mbs:
        hidden = inner.embed_tokens(mb["input_ids"])
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        position_ids = positions[None]
        rotary = inner.rotary_emb(hidden, position_ids)
        mask = create_causal_mask(config=model.config, inputs_embeds=hidden,
                                  attention_mask=mb["attention_mask"], cache=None,
                                  position_ids=position_ids)
        for layer in inner.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary,
                           position_ids=position_ids)
        logits = model.lm_head(inner.norm(hidden))
        loss = model.loss_function(logits, mb["labels"], vocab_size=model.config.vocab_size,
                                   num_items_in_batch=n)
        loss.backward()


def step_generic(staged, mbs) -> None:
    n = sum(staged.count_items(mb) for mb in mbs)
    staged.begin_step()
    try:
        for mb in mbs:
            hidden, ctx = staged.embed(mb)
            for i in range(staged.num_units):
                hidden = staged.run_unit(i, hidden, ctx)
            (staged.head_loss(hidden, mb, ctx).loss_sum / n).backward()
    finally:
        staged.end_step()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ways(model, mbs, step_own, step_direct, args) -> dict[str, float]:
    """The three ways of one model (``_timed``): its own forward (``step_own``), the direct
    calls a hand-written adapter makes (``step_direct``), and ``stage_model``'s staging."""
    staged = stage_model(model)
    staged.prepare_for_training()
    return _timed({"model": lambda: step_own(model, mbs),
                   "direct": lambda: step_direct(model, mbs),
                   "generic": lambda: step_generic(staged, mbs)}, model, args)


def time_steps(args) -> dict[str, float]:
    """Llama: the model's own forward, the retired Llama adapter's direct calls, generic."""
    return _time_ways(build(args), microbatches(args), step_model, step_direct, args)


def build_vit(args) -> transformers.PreTrainedModel:
    cfg = transformers.ViTConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                 num_attention_heads=max(args.hidden // 64, 1),
                                 intermediate_size=args.hidden * 4, image_size=args.image_size,
                                 patch_size=16, num_labels=10)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(cfg).to(args.device)


def image_microbatches(args) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    size = (args.microbatch_size, 3, args.image_size, args.image_size)
    return [{"pixel_values": torch.randn(size, generator=g).to(args.device),
             "labels": torch.randint(0, 10, (args.microbatch_size,), generator=g).to(args.device)}
            for _ in range(args.microbatches)]


def step_image_model(model, mbs) -> None:
    for mb in mbs:
        (model(**mb).loss / len(mbs)).backward()  # equal microbatches: the global mean


def step_image_direct(model, mbs) -> None:
    from transformers.masking_utils import create_bidirectional_mask

    vit = model.vit
    for mb in mbs:
        hidden = vit.embeddings(mb["pixel_values"])
        mask = create_bidirectional_mask(config=model.config, inputs_embeds=hidden,
                                         attention_mask=None)
        for layer in vit.layers:
            hidden = layer(hidden, mask)
        logits = model.classifier(vit.layernorm(hidden)[:, 0, :])
        loss = torch.nn.functional.cross_entropy(logits, mb["labels"], reduction="sum")
        (loss / sum(len(m["labels"]) for m in mbs)).backward()


def _timed(runs: dict, model, args) -> dict[str, float]:
    """Each run once (warm-up; gradients compared with the first run's), then ``args.steps``
    rounds of all runs interleaved; the median seconds per run."""
    grads = {}
    for name, run in runs.items():
        model.zero_grad(set_to_none=True)
        run()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    first = next(iter(runs))
    for name in list(runs)[1:]:
        worst = max(float((a - b).abs().max()) for a, b in zip(grads[name], grads[first]))
        print(f"{name:8s} max |grad - {first}'s| = {worst:.2e}")
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.steps):
        for name, run in runs.items():
            model.zero_grad(set_to_none=True)
            _sync(args.device)
            t0 = time.perf_counter()
            run()
            _sync(args.device)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def time_vit_steps(args) -> dict[str, float]:
    """ViT: the model's own forward, the retired adapter's direct calls, the generic path."""
    return _time_ways(build_vit(args), image_microbatches(args), step_image_model,
                      step_image_direct, args)


def self_check_cost(limit: int | None = None) -> list[tuple[str, float, float]]:
    from tests.zoo_fixtures import ZOO, build_zoo

    out = []
    for name in list(ZOO)[:limit]:
        model = build_zoo(name)
        self_check._CACHE.clear()
        t0 = time.perf_counter()
        stage_model(model)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        stage_model(build_zoo(name))
        out.append((name, cold, time.perf_counter() - t0))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--smoke", action="store_true",
                        help="smallest settings: 1 layer of hidden 64, 1 timed step, the self-check "
                             "cost of one zoo model (the suite's check that the benchmark runs; "
                             "numbers meaningless)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.seq, args.vocab, args.image_size = 64, 1, 16, 128, 32
        args.microbatches, args.microbatch_size, args.steps = 2, 1, 1
    transformers.logging.set_verbosity_error()
    print(f"Llama hidden {args.hidden}, {args.layers} layers, seq {args.seq}, "
          f"{args.microbatches} microbatches of {args.microbatch_size}, {args.device}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads")
    t = time_steps(args)
    print(f"\nstep time (median of {args.steps}):")
    for name in ("model", "direct", "generic"):
        print(f"  {name:8s} {t[name] * 1e3:8.1f} ms  {t[name] / t['model']:.3f}x model")
    print(f"  generic / direct = {t['generic'] / t['direct']:.3f}x (goal <= 1.02x)")
    print(f"\nViT hidden {args.hidden}, {args.layers} layers, {args.image_size}px images in "
          f"patches of 16, {args.microbatches} microbatches of {args.microbatch_size}")
    v = time_vit_steps(args)
    print(f"step time (median of {args.steps}):")
    for name in ("model", "direct", "generic"):
        print(f"  {name:8s} {v[name] * 1e3:8.1f} ms  {v[name] / v['model']:.3f}x model")
    print(f"  generic / direct = {v['generic'] / v['direct']:.3f}x (goal <= 1.02x)")
    print("\nself-check at start (first stage_model of a class and config; then cached):")
    for name, cold, warm in self_check_cost(1 if args.smoke else None):
        print(f"  {name:26s} {cold:6.2f} s cold  {warm * 1e3:7.1f} ms cached")


if __name__ == "__main__":
    main()
