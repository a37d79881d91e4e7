"""``hf-cephalo profile``: measure this cluster and write a cluster profile JSON.

One process per rank under torchrun / accelerate launch (or one): each rank builds the model of
``--model-config`` with random weights, times one unit's forward / backward and its memory for
microbatch sizes 1..M, the ranks time the collectives, and rank 0 writes ``--out``. Every check
of the options and the model config runs before any collective (``run_profile``'s steps, in
order), so a bad input is one ``error: ...`` line per job.
"""

from __future__ import annotations

import argparse
import os

from hf_cephalo.cli.arguments import check_output_file
from hf_cephalo.profiles.precision import PRECISIONS

__all__ = ["add_profile_arguments", "run_profile"]


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-config", required=True,
                   help="Hugging Face model config: a config.json file or a directory holding one, "
                        "a Hub id in the local Hub cache, or a model_type such as qwen3 (the "
                        "model is built from it with random weights; nothing is downloaded)")
    p.add_argument("--model-override", nargs="+", metavar="KEY=VALUE",
                   help="change fields of the model config, e.g. num_hidden_layers=2 "
                        "hidden_size=256 (values read as JSON)")
    p.add_argument("--model-class", help="model class, e.g. LlamaForCausalLM (default: the "
                                         "config's first 'architectures' entry)")
    p.add_argument("--out", required=True, help="write the cluster profile JSON here (rank 0)")
    p.add_argument("--sequence-length", type=int, default=128,
                   help="tokens per sample of the profiled microbatches (default 128)")
    p.add_argument("--max-microbatch-size", type=int, default=8,
                   help="M: microbatch sizes 1..M are profiled (default 8)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="parameter dtype of the profiled model: float32 (default; also for "
                        "--precision bf16) or bfloat16 (a model trained in bfloat16 parameters); "
                        "float16 is refused (Cephalo does not train in float16)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per microbatch size (median)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16 / fp16: time the forward under that autocast, as training with "
                        "--bf16 / --fp16 runs (default fp32)")
    p.add_argument("--param-dtype", choices=("auto", *PRECISIONS), default="auto",
                   help="gathered-parameter dtype of the job (cephalo_param_dtype): auto "
                        "(default: the --precision dtype, as the trainer's default), fp32, or "
                        "the --precision dtype; the unit is profiled gathered in it")
    p.add_argument("--reduce-dtype", choices=PRECISIONS, default="fp32",
                   help="gradient reduce-scatter dtype of the job (cephalo_reduce_dtype): fp32 "
                        "(default) or the param dtype; recorded in the profile's precision")
    p.add_argument("--emulate-slowdown", help="emulation: per-rank compute slowdown, e.g. '1,3'")
    p.add_argument("--emulate-memory-cap-bytes",
                   help="emulation: per-rank memory capacity in bytes, e.g. '8e9,4e9'")
    p.add_argument("--no-cache", action="store_true", help="measure even if a cached profile exists")
    p.add_argument("--verbose", action="store_true", help="progress of every rank once a second, "
                   "with the time of each microbatch size (default: rank 0, a line every 15 s)")
    p.add_argument("--cache-dir", help="profile cache directory (default $HF_CEPHALO_PROFILE_CACHE "
                                       "or ~/.cache/hf_cephalo/profiles)")


def run_profile(args: argparse.Namespace) -> int:
    """Profile every rank (one process per rank under torchrun / accelerate launch, or one)."""
    _check_profile_dtype(args.dtype, args.precision)
    args.model_config = _local_model_config(args)
    config_file, config_data = _read_model_config(args.model_config)
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes --out: check before measuring
        check_output_file(args.out, "--out", "profile.json")
    config, emulation = _measure_options(args)
    model = _build_model(args, config_file, config_data)
    staged = _stage(model, config_file)
    _check_sequence_length(args, model, config_file)
    device = _init_process_group()
    cluster, rank = _measure(args, staged, config, device, emulation)
    if rank == 0:
        _write_profile(cluster, args.out)
    return 0


def _measure_options(args: argparse.Namespace):
    """(MeasureConfig, EmulationConfig or None) of the measurement and emulation options."""
    from hf_cephalo.profiler.emulate import EmulationConfig
    from hf_cephalo.profiler.measure import MeasureConfig

    config = MeasureConfig(max_microbatch_size=args.max_microbatch_size,
                           sequence_length=args.sequence_length, repeats=args.repeats,
                           precision=args.precision, verbose=args.verbose,
                           param_dtype=args.precision if args.param_dtype == "auto"
                           else args.param_dtype, reduce_dtype=args.reduce_dtype)
    slow = _per_rank_list(args.emulate_slowdown, float, "--emulate-slowdown")
    caps = _per_rank_list(args.emulate_memory_cap_bytes, int, "--emulate-memory-cap-bytes")
    emulation = None if slow is None and caps is None else \
        EmulationConfig(slowdown=slow, memory_cap_bytes=caps)
    return config, emulation


def _build_model(args: argparse.Namespace, config_file: str, config_data: dict):
    """The model of --model-config (random weights, --dtype) as --model-class; ValueError
    naming the fix when transformers cannot build it."""
    import torch

    from hf_cephalo.profiler.measure import build_model_from_config

    if args.model_class:
        _check_model_class(args.model_class, config_file, config_data)
    try:
        return build_model_from_config(args.model_config, args.model_class,
                                       getattr(torch, args.dtype))
    except ValueError as e:  # keep the first line; transformers appends ~200 config names
        from hf_cephalo.models import adapter_summary

        raise ValueError(f"{str(e).splitlines()[0].rstrip('.;: ')}; hf_cephalo trains the "
                         f"causal-LM and sequence-classification heads of transformers' models, "
                         f"and through adapters {adapter_summary()}") from None
    except (AttributeError, TypeError, KeyError) as e:  # a class that does not fit the config
        name = args.model_class or (config_data.get("architectures") or
                                    ["AutoModelForCausalLM"])[0]
        raise ValueError(f"cannot build {name} from model config {config_file!r} (model_type "
                         f"{config_data['model_type']!r}): {type(e).__name__}: {e}; pass a "
                         "--model-class that fits this config") from None


def _stage(model, config_file: str):
    """``stage_model(model)``; a base model without a head is a ValueError naming the heads."""
    from hf_cephalo.models import UnsupportedModelError, stage_model

    try:
        return stage_model(model)
    except UnsupportedModelError as e:
        if not e.alternatives:
            raise
        raise ValueError(f"model config {config_file!r} builds {type(model).__name__}, a base "
                         f"model without a head, which hf_cephalo cannot train; pass --model-class "
                         f"{e.alternatives[0]} (supported heads of this architecture: "
                         f"{', '.join(e.alternatives)}) and train the model as that class; for "
                         "another head see docs/adding_a_model.md") from None


def _check_sequence_length(args: argparse.Namespace, model, config_file: str) -> None:
    """Refuse a --sequence-length beyond the model's positions (before any collective)."""
    from hf_cephalo.profiler.measure import max_positions

    limit = None if getattr(model, "main_input_name", "input_ids") == "pixel_values" \
        else max_positions(model)
    if limit is not None and args.sequence_length > limit:  # before any collective
        raise ValueError(f"--sequence-length {args.sequence_length} exceeds the model's {limit} "
                         f"positions (model config {config_file!r}); give --sequence-length "
                         f"{limit} or less")


def _init_process_group():
    """This rank's device; the process group under a launcher with several ranks."""
    import torch
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # device_id binds the NCCL communicator to this rank's GPU (a barrier before any
            # collective would otherwise guess global rank % local GPU count)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return device


def _measure(args: argparse.Namespace, staged, config, device, emulation):
    """(cluster profile, this rank): ``profile_cluster`` (or the cache), then the process
    group destroyed whatever happened."""
    import torch.distributed as dist

    from hf_cephalo.profiler.measure import profile_cluster
    from hf_cephalo.profiles.cache import ProfileCache

    cache = False if args.no_cache else ProfileCache(args.cache_dir)
    try:
        cluster = profile_cluster(staged, config, device=device, emulation=emulation, cache=cache,
                                  remeasure_hint="pass --no-cache (or delete that file)")
    finally:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if dist.is_initialized():
            dist.destroy_process_group()
    return cluster, rank


def _write_profile(cluster, out: str) -> None:
    """Rank 0: write the profile to ``out`` and print its summary, a line per rank."""
    from hf_cephalo.profiles.types import format_bytes

    cluster.save(out)
    m = cluster.model
    units = f"{m.num_units} units x {m.params_per_unit} params" if m.unit_params is None else \
        f"{m.num_units} units of {sum(m.unit_params)} params (per unit {m.unit_params})"
    print(f"model {m.name}: {units} + "
          f"{m.params_other} other; all-gather {cluster.comm.allgather_s * 1e3:.2f} ms, "
          f"reduce-scatter {cluster.comm.reducescatter_s * 1e3:.2f} ms per unit")
    for i, d in enumerate(cluster.devices):
        print(f"rank {i} {d.name}: m=1 fwd {d.fwd_s[0] * 1e3:.2f} ms bwd {d.bwd_s[0] * 1e3:.2f} ms, "
              f"m={d.microbatch_sizes[-1]} fwd {d.fwd_s[-1] * 1e3:.2f} ms bwd "
              f"{d.bwd_s[-1] * 1e3:.2f} ms, compute memory {format_bytes(d.compute_memory_bytes[-1])}")
    print(f"cluster profile written to {out}")


def _per_rank_list(text: str | None, cast, flag: str):
    if text is None:
        return None
    try:
        return [cast(float(x)) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated numbers, one per rank") from None


def _check_profile_dtype(dtype: str, precision: str) -> None:
    """Refuse a --dtype / --precision pair no Cephalo job trains with: its profile would be
    refused by every job (profiles record the dtype and jobs check it)."""
    if dtype == "float16":
        raise ValueError("--dtype float16: Cephalo does not train in float16 parameters (fp16 "
                         "training is fp16 autocast over float32 master weights with a sharded "
                         "loss scaler), so no job could use this profile; use --dtype float32 "
                         "(with --precision fp16 / bf16 for training with --fp16 / --bf16) or "
                         "--dtype bfloat16")
    if dtype != "float32" and precision != "fp32":
        raise ValueError(f"--dtype {dtype} with --precision {precision}: {precision} autocast runs "
                         "over float32 "
                         "parameters (master weights) and the engine refuses other parameter "
                         "dtypes, so no job could use this profile; use --dtype float32 "
                         "--precision bf16 (training with --bf16), or --dtype bfloat16 "
                         "--precision fp32 (a model trained in bfloat16 parameters)")


def _local_model_config(args: argparse.Namespace) -> str:
    """``--model-config`` as a local file: as given where it exists and nothing is overridden,
    else the config a cached Hub id or a model_type names (``profiler.config_shape``), with
    ``--model-override`` applied, written to a temporary folder that lives until exit."""
    if os.path.exists(args.model_config) and not args.model_override:
        return args.model_config
    import atexit
    import shutil
    import tempfile

    from hf_cephalo.profiler.config_shape import parse_overrides, resolve_model_config

    config, _ = resolve_model_config(args.model_config, parse_overrides(args.model_override),
                                     flag="--model-config")
    folder = tempfile.mkdtemp(prefix="hf_cephalo_model_config_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config.save_pretrained(folder)
    return folder


def _read_model_config(path: str) -> tuple[str, dict]:
    """(config file, its JSON) of --model-config: a config.json or a directory holding one.
    ValueError naming the file when it is missing, not JSON or not a Hugging Face config."""
    import json

    if not os.path.exists(path):
        raise ValueError(f"model config {path!r} does not exist; give a config.json file or a "
                         "directory holding one")
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"model config directory {path!r} holds no config.json; give a "
                         "config.json file or a directory holding one")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model config {file!r} is not valid JSON ({e}); give a Hugging Face "
                         "config.json") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"model config {file!r} has no 'model_type'; give a Hugging Face "
                         "config.json (the one save_pretrained writes beside the weights)")
    return file, data


def _check_model_class(name: str, file: str, data: dict) -> None:
    """Refuse --model-class when its config type is not the config's model_type (the model
    would fail deep inside transformers, e.g. a LlamaConfig has no 'embd_pdrop')."""
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        return  # build_model_from_config names the missing class
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(f"--model-class {name} is not a concrete transformers model class; "
                         "give the model's own class, e.g. "
                         f"{(data.get('architectures') or ['LlamaForCausalLM'])[0]}")
    expected = getattr(getattr(cls, "config_class", None), "model_type", "")
    if expected and expected != data["model_type"]:
        archs = data.get("architectures") or []
        try:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(data["model_type"])
        except ImportError:
            causal = None
        hint = (f"pass --model-class {archs[0]} (the config's architecture) or omit it" if archs
                else f"pass a {data['model_type']} model class such as {causal}" if causal
                else f"pass a {data['model_type']} model class")
        raise ValueError(f"--model-class {name} builds from a {expected!r} config but "
                         f"{file!r} has model_type {data['model_type']!r}; {hint}")
