"""The cluster profile of ``hf-cephalo plan`` and ``simulate``: a measured profile
(``--profile``) or a spec-sheet estimate (``--cluster`` with ``--model``), its model as
``--lora-rank`` trains it, the machines of ``--gpu-types``, and for ``--precision auto`` the
precision policy with the shortest predicted iteration (``planner.precision.choose_precision``).

Spec-sheet options (``--efficiency``, ``--precision``) given with ``--profile`` are refused
rather than silently ignored.
"""

from __future__ import annotations

import argparse

from hf_cephalo.cli.arguments import DEFAULT_EFFICIENCY, DEFAULT_PRECISION, checkpointing_arg

__all__ = ["load_cluster", "model_shape", "spec_cluster", "restrict_gpu_types", "auto_precision_plan",
           "apply_lora", "estimate_options"]


def load_cluster(args: argparse.Namespace, *, precision_applies_to_profile: bool = False):
    """The cluster profile of ``--profile``, or the spec-sheet estimate of ``--cluster``.

    ``--efficiency`` (and ``--precision``, unless the caller uses it for something else) only
    shape spec-sheet estimates: given explicitly with ``--profile`` they are refused rather
    than silently ignored.
    """
    if args.profile:
        from hf_cephalo.profiles.types import ClusterProfile

        if getattr(args, "lora_rank", None) is not None:
            raise ValueError(f"--lora-rank {args.lora_rank} applies only to --cluster estimates; "
                             f"the profile {args.profile} already fixes the model (profile the "
                             "PeftModel as it will train: hf-cephalo profile / CephaloTrainer)")
        for flag, value in (("--model", args.model),
                            ("--model-override", getattr(args, "model_override", None)),
                            ("--sequence-length", getattr(args, "sequence_length", None))):
            if value is not None:
                raise ValueError(f"{flag} {value} applies only to --cluster estimates; the "
                                 f"profile {args.profile} already fixes the model (drop {flag}, "
                                 "or use --cluster with --model)")
        ignored = [f"--efficiency {args.efficiency}"] if args.efficiency is not None else []
        if args.precision is not None and not precision_applies_to_profile:
            ignored.append(f"--precision {args.precision}")
        if ignored:
            raise ValueError(f"{' and '.join(ignored)} {'apply' if len(ignored) > 1 else 'applies'}"
                             f" only to --cluster spec-sheet estimates; the profile "
                             f"{args.profile} already holds each GPU's times (drop "
                             f"{' and '.join(f.split()[0] for f in ignored)}, or use --cluster "
                             "with --model)")
        return ClusterProfile.load(args.profile)
    from hf_cephalo.profiles.specs import estimate_cluster_profile, load_cluster_yaml

    return apply_lora(estimate_cluster_profile(load_cluster_yaml(args.cluster), model_shape(args),
                                                **estimate_options(args)), args)


def model_shape(args: argparse.Namespace):
    """What ``--model`` names, resolved once per command (kept on ``args``): a table
    ``ModelShape`` (``--sequence-length`` replacing its own), or the ``ConfigShape`` of a
    transformers config read from a meta-device build (``profiler.config_shape``).

    Raises:
        ValueError: no --model, a form it does not take, ``--model-override`` with a table
            shape, or a model hf_cephalo cannot stage (the reason named).
    """
    shape = getattr(args, "_model_shape", None)
    if shape is not None:
        return shape
    if not args.model:
        raise ValueError("--cluster needs --model (a table shape such as llama-3b, a config "
                         "folder, a cached Hub id or a model_type: docs/planner.md)")
    from hf_cephalo.profiles.specs import MODEL_SHAPES, get_model_shape

    overrides = getattr(args, "model_override", None)
    seq_len = getattr(args, "sequence_length", None)
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"--sequence-length {seq_len}: give a number of tokens >= 1")
    if args.model.lower() in {k.lower() for k in MODEL_SHAPES}:
        shape = get_model_shape(args.model)
        if overrides:
            raise ValueError(f"--model-override applies to a config --model; {args.model} is a "
                             "table shape (fixed): give its model_type (e.g. llama) or a config "
                             "folder with the fields to change")
        if seq_len is not None and shape.family == "vit":
            raise ValueError(f"--sequence-length {seq_len}: {shape.name}'s tokens are fixed by "
                             f"its image patches ({shape.seq_len}); drop --sequence-length")
        if seq_len is not None:
            from dataclasses import replace
            shape = replace(shape, seq_len=seq_len)
    else:
        shape = _config_shape(args.model, overrides, seq_len, list(MODEL_SHAPES))
    args._model_shape = shape
    return shape


def _config_shape(model: str, overrides, seq_len: int | None, table_shapes: list[str]):
    """The ConfigShape of a config ``--model`` (torch and transformers imported here)."""
    import os

    from hf_cephalo.profiler.config_shape import (DEFAULT_SEQ_LEN, config_shape,
                                                  parse_overrides, resolve_model_config)

    config, source = resolve_model_config(model, parse_overrides(overrides), table_shapes)
    name = os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model
    if overrides:
        name += "[" + ",".join(overrides) + "]"
    return config_shape(config, name=name, seq_len=seq_len or DEFAULT_SEQ_LEN, source=source)


def spec_cluster(args: argparse.Namespace):
    """The ClusterSpec of ``--cluster`` (restricted to ``--gpu-types`` where given)."""
    from hf_cephalo.profiles.specs import load_cluster_yaml

    if getattr(args, "gpu_types", None):
        return restrict_gpu_types(args)
    return load_cluster_yaml(args.cluster)


def restrict_gpu_types(args: argparse.Namespace):
    """The cluster YAML with only the machines whose GPUs are all of ``--gpu-types``."""
    from hf_cephalo.profiles.specs import ClusterSpec, get_gpu_spec, load_cluster_yaml

    spec = load_cluster_yaml(args.cluster)
    keep = {get_gpu_spec(g).name for g in args.gpu_types}
    machines = [m for m in spec.machines if m and all(get_gpu_spec(g).name in keep for g in m)]
    if not machines:
        example = " ".join(sorted({get_gpu_spec(g).name for g in next(m for m in spec.machines
                                                                       if m)}))
        raise ValueError(f"--gpu-types {args.gpu_types}: no machine of {args.cluster} has only "
                         f"these GPU types (machines: {spec.machines}); list every GPU type of "
                         f"the machines to keep, e.g. --gpu-types {example}")
    return ClusterSpec(name=f"{spec.name} [{'+'.join(sorted(keep))}]", machines=machines,
                       interconnect_gbps=spec.interconnect_gbps,
                       intra_machine_gbps=spec.intra_machine_gbps)


def auto_precision_plan(args: argparse.Namespace, spec, global_batch_size: int):
    """``--precision auto`` on a spec-sheet cluster: (profile, plan) of the precision policy
    with the shortest predicted iteration (``planner.precision.choose_precision``: each
    precision every GPU runs, and each GPU's fastest); prints the candidates' samples/s."""
    from hf_cephalo.planner.optimize import optimize
    from hf_cephalo.planner.precision import choose_precision, precision_candidates
    from hf_cephalo.profiles.specs import estimate_cluster_profile, spec_precisions

    def plan_for(precisions):
        options = dict(estimate_options(args), precision=precisions)
        cluster = apply_lora(estimate_cluster_profile(spec, model_shape(args), **options), args)
        return cluster, optimize(cluster, global_batch_size, args.memory_fraction,
                                 allow_idle=not args.no_idle, root_resident=args.root_resident,
                                 activation_checkpointing=checkpointing_arg(args))

    choice = choose_precision(precision_candidates([spec_precisions(g) for g in spec.gpus]),
                              plan_for)
    rates = ", ".join(f"{label} {global_batch_size / t:.2f}" if t else f"{label} infeasible"
                      for label, t in choice.predicted_s.items())
    runs = []  # rank order, consecutive equal precisions grouped: "bf16 x3, fp32 x3, fp16 x2"
    for p in choice.precisions:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    print(f"precision auto (B = {global_batch_size}): {choice.label} "
          f"[{', '.join(f'{p} x{n}' for p, n in runs)}]; predicted samples/s per policy: {rates}")
    return plan_for(choice.precisions)[0], choice.plan


def apply_lora(cluster, args: argparse.Namespace):
    """The spec-sheet cluster with its model as ``--lora-rank`` trains it (unchanged without)."""
    if getattr(args, "lora_rank", None) is None:
        return cluster
    from dataclasses import replace

    from hf_cephalo.profiles.specs import lora_model_profile

    frozen = 2.0 if args.frozen_dtype == "bf16" else 4.0
    model = lora_model_profile(cluster.model, model_shape(args), args.lora_rank,
                               tuple(args.lora_targets), frozen)
    return replace(cluster, model=model)


def estimate_options(args: argparse.Namespace) -> dict:
    """efficiency and precision of spec-sheet estimates, the defaults where not given."""
    return {"efficiency": DEFAULT_EFFICIENCY if args.efficiency is None else args.efficiency,
            "precision": args.precision or DEFAULT_PRECISION}
