"""Each rank's peak host memory loading a checkpoint sharded and exporting it again, per class.

2 gloo ranks on CPU, state ratios 0.8 / 0.2, for a Llama, a Qwen3, a Gemma 3, a GPT-OSS, and
the MoE classes whose checkpoints store one tensor per expert (Qwen3-MoE, Mixtral, OLMoE) of
about 30 M parameters each (most of them in the layers, as in a 7B model). The parent saves each
with ``save_pretrained(max_shard_size=...)``; then, in ONE run, each rank measures:

* ``load``: ``from_pretrained_sharded`` (the model on the meta device) + ``CephaloEngine``,
  which reads this rank's slices of each unit from the checkpoint's files
  ([Note: no full model after construction] in engine/loading.py);
* ``export``: ``save_pretrained_streamed(max_shard_size=...)``, rank 0 writing one output
  file at a time while the units are gathered one at a time ([Note: streamed save]).

Peak = ``VmHWM`` minus ``VmRSS`` just before the phase (``bench_save_memory.PeakRSS``), printed
as a multiple of P = the model's fp32 parameter bytes. A rank that held the whole model would
show >= 1.0; the bound each phase should stay under is the rank's share r_i of P plus one
gathered unit and one file's tensors (``bound``). The export is checked: ``from_pretrained`` of
it gives the saved model's tensors bit for bit.

    python benchmarks/bench_load_memory.py [--max-shard-size 20MB] [--only qwen3 gpt_oss]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_save_memory import PeakRSS  # noqa: E402

RATIOS = [0.8, 0.2]
COMMON = dict(vocab_size=4000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
MODELS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=64)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(head_dim=64, sliding_window=64, final_logit_softcapping=30.0)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig",
                dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                     intermediate_size=512, sliding_window=64)),
    # checkpoints that store one tensor per expert, merged into the fused parameter on load
    # and split back on save ([Note: merged expert tensors] in engine/merged_keys.py)
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(head_dim=64, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=352, decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                     intermediate_size=352)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig",
              dict(num_experts=8, num_experts_per_tok=2, intermediate_size=352)),
}


SMOKE = dict(COMMON, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
"""``--smoke``: the smallest model of each kind (numbers meaningless)."""


def _build(name: str, common: dict = COMMON):
    import torch
    import transformers

    cls, cfg_cls, extra = MODELS[name]
    extra = {k: min(v, common["hidden_size"] // 4) if k == "head_dim" else v
             for k, v in extra.items()}
    config = getattr(transformers, cfg_cls)(**{**common, **extra})
    torch.manual_seed(0)
    return getattr(transformers, cls)(config).float()


def _worker(rank: int, world_size: int, port: int, names: list[str], root: str, shard: str, q):
    import torch
    import torch.distributed as dist

    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.engine.export import save_pretrained_streamed
    from hf_cephalo.models import stage_model
    from hf_cephalo.runtime.pretrained import from_pretrained_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    # a warm-up load of the first model, unmeasured: the first load in a process also pays
    # for lazily imported modules and the allocator's first arenas
    del_me = CephaloEngine(stage_model(from_pretrained_sharded(os.path.join(root, names[0]))),
                           RATIOS)
    del del_me
    for name in names:
        path = os.path.join(root, name)
        dist.barrier()
        with PeakRSS() as load:
            engine = CephaloEngine(stage_model(from_pretrained_sharded(path)), RATIOS)
        units = [u.numel for u in engine.all_units()]
        dist.barrier()
        out = os.path.join(root, f"{name}-export")
        with PeakRSS() as export:
            save_pretrained_streamed(engine, out, max_shard_size=shard)
        dist.barrier()
        results[name] = (load.delta_bytes, export.delta_bytes, max(units) * 4)
        del engine
    q.put((rank, results))
    dist.destroy_process_group()


def main(argv=None) -> int:
    import torch
    import transformers

    from hf_cephalo.engine.export import parse_max_shard_size
    from rank_launch import free_port, run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-shard-size", default="20MB")
    parser.add_argument("--only", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--smoke", action="store_true",
                        help="smallest settings: Llama only, 2 layers of hidden 64, 20 kB shards "
                             "(the suite's check that the benchmark runs; numbers meaningless)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.only, args.max_shard_size = ["llama"], "20kB"
    names = list(args.only)
    shard_bytes = parse_max_shard_size(args.max_shard_size)
    sizes, saved = {}, {}
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            model = _build(name, SMOKE if args.smoke else COMMON)
            sizes[name] = sum(p.numel() for p in model.parameters()) * 4
            model.save_pretrained(os.path.join(root, name), max_shard_size=args.max_shard_size)
            saved[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            del model
        port = free_port()
        got = dict(run_ranks(_worker, [(r, 2, port, names, root, args.max_shard_size)
                                       for r in range(2)], timeout_s=1800))
        exact = {}
        for name in names:
            cls = getattr(transformers, MODELS[name][0])
            back = cls.from_pretrained(os.path.join(root, f"{name}-export"), dtype=torch.float32)
            state = back.state_dict()
            exact[name] = set(state) == set(saved[name]) and all(
                torch.equal(state[k], v) for k, v in saved[name].items())
    print(f"2 ranks, state ratios {RATIOS}, checkpoint and export max_shard_size "
          f"{args.max_shard_size}; peak - base as a multiple of P (the model's fp32 bytes)")
    print(f"{'model':<9} {'P MB':>6} {'rank':>4} {'load':>6} {'export':>7} {'bound':>6} "
          f"{'export == saved':>16}")
    for name in names:
        for rank in sorted(got):
            load, export, unit = got[rank][name]
            p = sizes[name]
            bound = RATIOS[rank] + (unit + shard_bytes) / p
            print(f"{name:<9} {p / 1e6:>6.0f} {rank:>4} {load / p:>6.2f} {export / p:>7.2f} "
                  f"{bound:>6.2f} {str(exact[name]):>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
