"""Options and input checks shared by the ``hf-cephalo`` subcommands.

The options naming the cluster profile (``--profile`` | ``--cluster`` with ``--model``), the
``--precision`` and ``--activation-checkpointing`` parsers, and the checks ``plan`` and
``simulate`` (and ``profile`` for its ``--out``) run before reading, solving, measuring or
printing anything: readable inputs, writable distinct outputs, a plot file matplotlib can
write. Each raises ValueError (``error: ...``, exit status 2).
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from hf_cephalo.planner.types import (DEFAULT_MEMORY_FRACTION, activation_checkpointing_setting,
                                      parse_activation_checkpointing)
from hf_cephalo.profiles.precision import PRECISIONS

__all__ = ["DEFAULT_EFFICIENCY", "DEFAULT_PRECISION", "add_cluster_source_arguments",
           "precision_arg", "checkpointing_word", "checkpointing_arg", "check_output_file",
           "check_common_plan_options"]

DEFAULT_EFFICIENCY = 0.5  # --efficiency of spec-sheet estimates
DEFAULT_PRECISION = "fp32"  # --precision of spec-sheet estimates


def add_cluster_source_arguments(p: argparse.ArgumentParser, model_example: str) -> None:
    """--profile | --cluster (+ --model, --efficiency): where ``load_cluster`` gets the
    cluster profile."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="measured cluster profile JSON (docs/profiles.md)")
    src.add_argument("--cluster", help="cluster YAML of GPU types per machine (spec-sheet "
                                       "estimate; needs --model)")
    p.add_argument("--model", help=f"the model for --cluster: a table shape (e.g. "
                                   f"{model_example}), a folder holding a transformers "
                                   f"config.json (or the file), a Hub id in the local Hub cache "
                                   f"(nothing is downloaded), or a model_type such as qwen3 "
                                   f"(transformers' defaults); a config is built on the meta "
                                   f"device and its own layers, experts and layer kinds priced "
                                   f"(docs/planner.md, 'Any model by its config')")
    p.add_argument("--model-override", nargs="+", metavar="KEY=VALUE",
                   help="with a config --model: change fields of the config, e.g. "
                        "num_hidden_layers=28 hidden_size=1024 (values read as JSON)")
    p.add_argument("--sequence-length", type=int, default=None,
                   help="with --cluster: tokens per sample the estimate prices (default: the "
                        "table shape's, 512 for a config --model)")
    p.add_argument("--efficiency", type=float, default=None,
                   help=f"assumed fraction of peak FLOP/s for --cluster estimates (default "
                        f"{DEFAULT_EFFICIENCY}; not with --profile)")
    p.add_argument("--root-resident", action="store_true",
                   help="price the engine keeping its embedding and head units gathered with "
                        "their gradients all step (CephaloEngine root_resident=True; recorded "
                        "in the plan, the trainer builds the engine with it) instead of the "
                        "default split root, gathered around its uses")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="with --cluster: plan LoRA fine-tuning of rank r instead of full "
                        "fine-tuning (only the adapter carries gradient and optimizer state)")
    p.add_argument("--lora-targets", nargs="+", default=["q", "v"],
                   help="attention projections LoRA adapts, of q k v o (default: q v)")
    p.add_argument("--frozen-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="storage of the frozen base with --lora-rank: fp32 (4 B) or bf16 (2 B; "
                        "the engine keeps a bf16 base beside fp32 adapters, each sharded by r_i)")


def precision_arg(value: str) -> str:
    """``--precision``: fp32 / bf16 / fp16, ``auto`` or a comma list of those (one per rank;
    its length is checked against the cluster)."""
    names = value.replace(",", " ").split()
    if value != "auto" and (not names or any(n not in PRECISIONS for n in names)):
        raise argparse.ArgumentTypeError(
            f"{value!r}: give fp32, bf16, fp16, auto, or one of those per rank (bf16,fp16,fp32)")
    return value


def checkpointing_word(value: str) -> str:
    """argparse ``type`` of ``--activation-checkpointing``: the one parser of the choice
    (``planner.types.parse_activation_checkpointing``, any case), its message on a bad value."""
    try:
        return parse_activation_checkpointing(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def checkpointing_arg(args: argparse.Namespace) -> bool | None:
    """``--activation-checkpointing`` as ``optimize``'s argument (None: auto)."""
    return activation_checkpointing_setting(getattr(args, "activation_checkpointing", "true"))


def _require_matplotlib(flag: str = "--plot") -> None:
    """ValueError with the install hint when matplotlib is missing (checked before solving)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag} needs matplotlib, which is not installed; "
                         "pip install 'hf-cephalo[plot]' (or drop --plot)") from None


def _check_input_file(path: str, flag: str, what: str) -> None:
    """ValueError unless ``path`` is an existing, readable file (not a directory)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give the {what} file inside it")
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path!r} does not exist; give the path of a {what} file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag} {path!r} is not readable; check its permissions")


def check_output_file(path: str, flag: str, example: str) -> None:
    """ValueError unless a file can be written at ``path``: not a directory, in an existing
    writable directory (checked before any solving, measuring or printing)."""
    if not path or path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file path such as "
                         f"{os.path.join(path or '.', example)!r}")
    out_dir = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(out_dir):
        raise ValueError(f"{flag} {path!r}: directory {out_dir!r} does not exist; create it or "
                         "give another path")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path!r} exists and is not writable; give another path")
    elif not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r}: directory {out_dir!r} is not writable; give "
                         "another path")


def _plot_formats() -> list[str]:
    """File extensions matplotlib writes without extra tools (pgf needs LaTeX)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"})


def _check_plot_path(path: str, flag: str = "--plot", example: str = "plot.png") -> None:
    """matplotlib installed, ``path`` a writable file whose extension names a format matplotlib
    writes (it would otherwise append '.png' and write elsewhere); before any solving."""
    _require_matplotlib(flag)
    check_output_file(path, flag, example)
    ext = os.path.splitext(path)[1][1:].lower()
    formats = _plot_formats()
    if ext not in formats:
        stem = os.path.splitext(path)[0] if ext else path
        raise ValueError(f"{flag} {path!r}: the file name must end in an image format matplotlib "
                         f"writes ({', '.join('.' + f for f in formats)}), e.g. {stem + '.png'!r}")


def _check_distinct_paths(args: argparse.Namespace, outputs: Sequence[str],
                          inputs: Sequence[str] = ("profile", "cluster")) -> None:
    """Refuse two outputs at one path, or an output that would overwrite an input file."""
    seen: dict[str, str] = {}
    for name in list(inputs) + list(outputs):
        path = getattr(args, name, None)
        if not path:
            continue
        key = os.path.realpath(path)
        flag = "--" + name.replace("_", "-")
        if key in seen:
            raise ValueError(f"{flag} {path!r} is the same file as {seen[key]}; give separate "
                             "paths")
        seen[key] = f"{flag} {path!r}" + (" (an input)" if name in inputs else "")


def _check_fraction(value: float | None, flag: str, what: str, note: str) -> None:
    if value is not None and not 0 < value <= 1:  # also refuses nan
        raise ValueError(f"{flag} {value}: {what} must be in (0, 1] ({note})")


def check_common_plan_options(args: argparse.Namespace, outputs: Sequence[str]) -> None:
    """Checks shared by plan and simulate, all before reading, solving or printing anything."""
    _check_fraction(args.memory_fraction, "--memory-fraction", "memory fraction",
                    f"the share of each GPU's memory a plan may use; default "
                    f"{DEFAULT_MEMORY_FRACTION}")
    _check_fraction(args.efficiency, "--efficiency", "efficiency",
                    f"the assumed share of peak FLOP/s; default {DEFAULT_EFFICIENCY}")
    if args.profile:
        _check_input_file(args.profile, "--profile", "cluster profile JSON")
    else:
        _check_input_file(args.cluster, "--cluster", "cluster YAML")
    for name in outputs:
        path = getattr(args, name)
        if path is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "plot":
            _check_plot_path(path, flag)
        else:
            example = "profile.json" if name == "save_profile" else "plan.json"
            check_output_file(path, flag, example)
    _check_distinct_paths(args, outputs)
