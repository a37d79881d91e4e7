"""``hf-cephalo export``: merge a sharded checkpoint into a Hugging Face model directory.

Offline, no process group: the shards of a Trainer ``checkpoint-N`` (or of
``hf_cephalo.engine.checkpoint.save_checkpoint``) are written as safetensors weight files
loadable with ``from_pretrained`` (``engine.checkpoint.export_hf``); with ``--merge-lora`` the
LoRA adapter is merged into the base weights (``engine.peft_merge.export_merged_lora``).
"""

from __future__ import annotations

import argparse
import os

from hf_cephalo.units import DEFAULT_MAX_SHARD_SIZE

__all__ = ["add_export_arguments", "run_export"]


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a sharded checkpoint directory (a Trainer checkpoint-N or "
                                      "one written by hf_cephalo.engine.checkpoint.save_checkpoint)")
    p.add_argument("--out", required=True, help="write the Hugging Face model directory here")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the CRC-32 check of the shard files (sizes are still checked)")
    p.add_argument("--overwrite", action="store_true",
                   help="allow --out to be a non-empty directory that is not a previous export "
                        "(never the checkpoint directory itself)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help="largest weight file, as save_pretrained's max_shard_size: bytes or a "
                        "size such as '5GB' (units TB, GB, MB, KB; powers of 1000). Larger "
                        "weights go into model-0000k-of-0000n.safetensors files with an index "
                        f"(default {DEFAULT_MAX_SHARD_SIZE}, save_pretrained's)")
    p.add_argument("--merge-lora", action="store_true",
                   help="the checkpoint is of a LoRA PeftModel run: write the base model with "
                        "the adapter merged into its weights (PEFT's merge_and_unload, streamed "
                        "one unit at a time), loadable with the base class's from_pretrained")
    p.add_argument("--adapter-config",
                   help="with --merge-lora: adapter_config.json (or its directory) when the "
                        "checkpoint has none (engine-level checkpoints); default: the "
                        "checkpoint's own")


def run_export(args: argparse.Namespace) -> int:
    checkpoint, out = os.path.realpath(args.checkpoint), os.path.realpath(args.out)
    if os.path.commonpath([checkpoint, out]) == checkpoint:
        where = "the checkpoint directory itself" if out == checkpoint else \
            "inside the checkpoint directory"
        raise ValueError(f"--out {args.out!r} is {where} ({args.checkpoint!r}); the export "
                         "would mix model files into the checkpoint: give a directory outside it")
    from hf_cephalo.engine.checkpoint import export_hf

    if args.adapter_config is not None and not args.merge_lora:
        raise ValueError(f"--adapter-config {args.adapter_config!r} is read only with "
                         "--merge-lora; add --merge-lora or drop --adapter-config")
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    kwargs = dict(verify=not args.no_verify, overwrite=args.overwrite, max_shard_size=size)
    if args.merge_lora:
        from hf_cephalo.engine.peft_merge import export_merged_lora

        out = export_merged_lora(args.checkpoint, args.out, adapter_config=args.adapter_config,
                                 **kwargs)
    else:
        out = export_hf(args.checkpoint, args.out, **kwargs)
    weights = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    merged = " with the LoRA adapter merged" if args.merge_lora else ""
    print(f"exported {args.checkpoint} to {out}{merged}: {len(weights)} weight file(s) "
          f"(load with from_pretrained)")
    return 0
