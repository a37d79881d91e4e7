"""Cephalo's settings, declared once (``CephaloSettings``), and the job precision they set.

Every front end reads the same settings: ``CephaloPlugin`` (the Accelerate door) is this class
plus Accelerate's distributed type, and ``CephaloTrainingArguments`` / the TRL configs get one
``cephalo_<name>`` field per setting generated from it (``cephalo_fields``), with the same help
text, so a setting, its default, its environment variable and its validation exist in one place.

Resolution (``CephaloSettings.__post_init__``): a value left None falls back to the
environment variable ``HF_CEPHALO_<NAME>`` (``env_name``), then to the setting's default
(``SettingSpec.default``). Precedence: explicit > environment > default. The environment route
exists because stock ``accelerate launch`` rejects unknown keys in its YAML config
(docs/design.md contract 6).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from hf_cephalo.environment import PROCESS_ENV
from hf_cephalo.planner.types import DEFAULT_MEMORY_FRACTION
from hf_cephalo.profiles.precision import FASTEST_FIRST, PRECISIONS
from hf_cephalo.units import DEFAULT_MAX_SHARD_SIZE

if TYPE_CHECKING:  # torch-free at import: ``hf-cephalo plan`` reads these settings
    from hf_cephalo.engine.precision import EnginePrecision

__all__ = ["CephaloSettings", "ENV_PREFIX", "env_name", "cephalo_fields", "JobPrecision",
           "ACTIVATION_OFFLOAD_CHOICES", "ADAPTIVE_CHOICES",
           "PARAM_DTYPE_CHOICES", "REDUCE_DTYPE_CHOICES", "COLLATE_CHOICES",
           "LOSS_REDUCTION_CHOICES", "DECODE_MODE_CHOICES", "GENERATION_SPLIT_CHOICES"]

ENV_PREFIX = "HF_CEPHALO_"
ACTIVATION_OFFLOAD_CHOICES = ("on", "off", "auto")
ADAPTIVE_CHOICES = ("off", "batch", "state")
PARAM_DTYPE_CHOICES = ("auto", *FASTEST_FIRST)
REDUCE_DTYPE_CHOICES = PRECISIONS
COLLATE_CHOICES = ("global_width", "global_batch", "microbatch")
LOSS_REDUCTION_CHOICES = ("mean", "sum")
DECODE_MODE_CHOICES = ("auto", "gather_once", "sharded")
GENERATION_SPLIT_CHOICES = ("rows", "plan")


def env_name(name: str) -> str:
    """Environment variable of a setting: ``memory_fraction`` -> ``HF_CEPHALO_MEMORY_FRACTION``."""
    return ENV_PREFIX + name.removeprefix("cephalo_").upper()


def _setting(default: Any, help: str, cli_type: Any = None) -> Any:
    """A setting: None in the dataclass (so the environment can fill it), its real default and
    help text in the metadata; ``cli_type`` is the type the command-line field gets when it
    differs from the setting's own (lists parsed from '1,3')."""
    return field(default=None, metadata={"default": default, "help": help, "cli_type": cli_type})


_warned_unknown: set[str] = set()


def warn_unknown_environment() -> None:
    """Warn once per variable about an ``HF_CEPHALO_*`` variable that is neither a setting's
    nor a declared process variable (a misspelling would otherwise be ignored silently),
    naming the closest known name."""
    known = {env_name(f.name) for f in fields(CephaloSettings)} | set(PROCESS_ENV)
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIX) and name not in known and name not in _warned_unknown:
            _warned_unknown.add(name)
            close = difflib.get_close_matches(name, sorted(known), n=1)
            logging.getLogger(__name__).warning(
                "%s is set but is not a Cephalo setting or variable, so it is ignored%s",
                name, f"; did you mean {close[0]}?" if close else "")


@dataclass(kw_only=True)
class CephaloSettings:
    """Cephalo's settings (docs/accelerate.md "Settings"). Every field left None falls back to
    ``HF_CEPHALO_<NAME>`` and then to its default; ``__post_init__`` normalizes and validates.

    Raises ValueError naming the setting, its ``--cephalo_*`` flag, its environment variable
    and the value, for: a missing plan/profile file, a global batch size < 1, a memory fraction
    outside (0, 1], an unknown choice (activation offload, adaptive mode, activation
    checkpointing, collate scope, param / reduce dtype, loss reduction), a slowdown factor < 1
    or not finite, a memory cap < 1 byte, emulation lists of different lengths, or a precision
    list with an unknown name.
    """

    plan_file: str | None = _setting(None, (
        "Path of a plan JSON written by `hf-cephalo plan --out plan.json` (per-rank batch size, "
        "microbatch size, number of microbatches and training-state ratio). If unset, the job "
        "plans at start from the profile file, or profiles this cluster."))
    profile_file: str | None = _setting(None, (
        "Path of a cluster profile JSON (per-rank seconds per unit fwd/bwd, memory bytes, "
        "collective seconds; `hf-cephalo profile`). Used to plan when no plan file is given; if "
        "neither is given the job profiles this cluster at start."))
    global_batch_size: int | None = _setting(None, (
        "Global batch size B in samples per optimizer step, summed over all ranks. Must equal the "
        "plan's value if a plan file is given. Default: the plan's value, else the per-device "
        "batch size x world size (x gradient accumulation steps)."))
    memory_fraction: float | None = _setting(DEFAULT_MEMORY_FRACTION, (
        "Fraction c in (0, 1] of each device's memory capacity (bytes) the plan may use "
        "(paper §2.4 memory constraints)."))
    activation_offload: str | None = _setting("auto", (
        "Offload checkpointed boundary activations to pinned CPU memory: 'on', 'off', or "
        "'auto' (on for CUDA, off on CPU)."), cli_type=Literal["on", "off", "auto"])
    emulate_slowdown: list[float] | None = _setting(None, (
        "Emulate a heterogeneous cluster on identical devices: per-rank compute slowdown factors "
        "(dimensionless, >= 1; 2.0 = each unit's compute takes twice as long), one per rank in "
        "rank order: '1,3' or '1 3'."), cli_type=list[str])
    emulate_memory_cap_bytes: list[int] | None = _setting(None, (
        "Emulated per-rank memory capacity in bytes (> 0, whole numbers; 8e9 allowed), one per "
        "rank in rank order: '8e9,4e9' or '8e9 4e9'; the planner uses it instead of the device's "
        "real capacity."), cli_type=list[str])
    emulate_slowdown_schedule: str | None = _setting(None, (
        "Emulate a cluster whose speeds drift during training: 'STEP:F0,F1;STEP:F0,F1' gives, "
        "from each global step (0-based; the first entry is step 0), one slowdown factor (>= 1) "
        "per rank, e.g. '0:1,1;10:1,3' (rank 1 three times slower from step 10). Not together "
        "with emulate_slowdown."))
    adaptive: str | None = _setting("batch", (
        "Live re-balancing while training (docs/adaptive.md): 'batch' re-plans the per-rank "
        "batch b_i, microbatch m_i and count l_i from measured speeds and switches at a step "
        "boundary (nothing moves; same global batches); 'state' may also re-lay the state "
        "ratios r_i in memory (shards and optimizer state move between ranks) when that beats "
        "the best split on the running r_i; 'off' keeps the start plan."),
        cli_type=Literal["off", "batch", "state"])
    adaptive_threshold: float | None = _setting(0.05, (
        "Relative predicted step-time gain, in (0, 1), a live switch needs (0.05 = 5%)."))
    adaptive_interval: int | None = _setting(5, (
        "Steps between two exchanges of the measured speeds (one small all-gather), >= 1."))
    adaptive_hysteresis_steps: int | None = _setting(20, (
        "At most one live switch per this many steps (>= 0)."))
    save_full_model: bool | None = _setting(False, (
        "Also write the full model into every checkpoint (the files save_model writes: sharded "
        "safetensors + config, loadable with from_pretrained). False: checkpoints hold the "
        "sharded state only, and `hf-cephalo export checkpoint-N --out DIR` writes the full "
        "model on demand."))
    max_shard_size: str | None = _setting(DEFAULT_MAX_SHARD_SIZE, (
        "Largest weight file save_model writes, as save_pretrained's max_shard_size: bytes or a "
        "size such as '5GB' (units TB, GB, MB, KB, powers of 1000); bigger models are written as "
        "model-0000k-of-0000n.safetensors + model.safetensors.index.json."))
    param_dtype: str | None = _setting("auto", (
        "dtype of the gathered parameters (FSDP2 MixedPrecisionPolicy.param_dtype; the fp32 "
        "master shards and optimizer state are unchanged): 'auto' (bf16 with bf16 mixed "
        "precision, fp16 with fp16, fp32 otherwise; halves all-gathered bytes and gathered-unit "
        "memory), 'bf16', 'fp16' (must match the mixed precision) or 'fp32'."))
    reduce_dtype: str | None = _setting("fp32", (
        "dtype of the gradient reduce-scatter: 'fp32' (gradients accumulate in fp32 either way) "
        "or the param dtype (half the reduce-scatter bytes)."))
    precision: str | None = _setting(None, (
        "Precision per rank: 'auto' (each GPU its fastest: bf16 > fp16 > fp32 from its compute "
        "capability; fp32 on the CPU) or one of fp32 / bf16 / fp16 per rank in rank order "
        "('bf16,bf16,fp16,fp32'). fp32 master weights, all-gathers and reduce-scatters; one loss "
        "scaler on every rank when a rank is fp16 (docs/engine.md 'Precision per rank'). A plan "
        "that records per-rank precisions (hf-cephalo plan --precision auto) decides them; "
        "without a plan each rank is profiled in its precision at start (not with a profile "
        "file). Not with one mixed precision for the whole job (bf16 / fp16)."))
    # str, not Literal: HfArgumentParser makes Literal choices case-sensitive, and "True" (HF
    # style, as --torch_compile True) must parse (planner.types.parse_activation_checkpointing)
    activation_checkpointing: str | None = _setting("auto", (
        "Activation checkpointing of the plan made at start: 'auto' (the default: plan both, "
        "keep the faster one that fits, so the forward graphs are kept wherever they fit in "
        "memory, as stock training without --gradient_checkpointing, and each unit is "
        "recomputed only where they do not; the plan line says which and why), 'true' (each "
        "unit's forward is recomputed in its backward, the paper's schedule: least activation "
        "memory) or 'false' (every microbatch's forward graph is kept until its backward: no "
        "recompute, ~1/4 less compute per step, activation memory grows with layers x "
        "microbatches; the plan fails when that does not fit); any case ('True' works). "
        "--gradient_checkpointing asks for 'true'. A plan file records its own choice: 'false' "
        "or 'true' that differs from it is refused."))
    collate: str | None = _setting("global_width", (
        "Where the data collator runs and pads (docs/data.md): 'global_width' each rank reads, "
        "transforms and collates only its own b_i rows, padded to the width of the whole global "
        "batch (one small exchange per step), so every row is padded as in a single process "
        "with the whole batch, whatever the plan; a collator whose output that cannot reproduce "
        "(random masking, a width that is not the longest row's; checked on the first step) "
        "gets 'global_batch', said once in the log. 'global_batch' every rank reads and collates "
        "all B samples of each step, then keeps its rows (the same padding; O(B) data work per "
        "rank). 'microbatch' collates each microbatch on its own: fewer padded tokens, but a "
        "row's padding (and so the loss, with left padding or without position_ids) then "
        "depends on the plan. A packing collator that pads nothing "
        "(DataCollatorWithFlattening) is applied per microbatch in every mode."),
        cli_type=Literal["global_width", "global_batch", "microbatch"])
    loss_reduction: str | None = _setting("mean", (
        "Custom training loops (CephaloAccelerator): how accelerator.backward(loss) reads a loss "
        "the loop computed. 'mean': a mean over this rank's items (tokens with a label after the "
        "causal shift for language models, samples for classifiers: what outputs.loss and "
        "reduction='mean' losses are), weighted by this rank's share of the global item count, "
        "so the gradient is that of the mean over the whole global batch; 'sum': already this "
        "rank's part of the global loss (e.g. a sum divided by outputs.num_items_in_batch), "
        "backpropagated as it is (docs/accelerate.md 'Your own training loop')."),
        cli_type=Literal["mean", "sum"])

    decode_mode: str | None = _setting("auto", (
        "How every rank decodes in the generating doors (GRPO, RLOO; docs/generation.md): "
        "'gather_once' (each unit all-gathered once per generation round, no collective per "
        "token), 'sharded' (one all-gather per layer per decoded token, every rank in "
        "lock-step: the full weights never on one rank) or 'auto' (gather once when every "
        "rank's memory budget holds the full weights and its KV cache, else sharded)."),
        cli_type=Literal["auto", "gather_once", "sharded"])
    generation_split: str | None = _setting("rows", (
        "Which rows a rank decodes in the generating doors: 'rows' (the rows it trains, b_i) "
        "or 'plan' (g_i from the generation planner: each rank's decode speed is measured at "
        "the first round and the split that finishes the round soonest is used; only token ids "
        "move between ranks; docs/generation.md). The completions are the same either way."),
        cli_type=Literal["rows", "plan"])

    def __post_init__(self) -> None:
        given = set()  # set explicitly or by the environment (not the default)
        for f in fields(CephaloSettings):
            if getattr(self, f.name) is None:
                value = os.environ.get(env_name(f.name), "").strip()
                setattr(self, f.name, value if value else f.metadata["default"])
                if value:
                    given.add(f.name)
            else:
                given.add(f.name)
        self._given = frozenset(given)
        warn_unknown_environment()
        self._validate()

    def was_given(self, name: str) -> bool:
        """Whether setting ``name`` was set (argument or environment) rather than defaulted:
        an explicit choice that contradicts a plan file is refused, a default is not."""
        return name in self._given

    @classmethod
    def default_of(cls, name: str) -> Any:
        """The built-in default of setting ``name`` (after no argument and no environment)."""
        return next(f.metadata["default"] for f in fields(cls) if f.name == name)

    def _bad(self, name: str, requirement: str) -> ValueError:
        return ValueError(f"{name} = {getattr(self, name)!r} (--cephalo_{name}, "
                          f"CephaloPlugin({name}=...) or env {env_name(name)}): {requirement}")

    def _validate(self) -> None:
        commands = {"plan_file": "`hf-cephalo plan --profile PROFILE -B N --out FILE` (or "
                                 "--cluster CLUSTER.yaml --model MODEL for a spec-sheet estimate)",
                    "profile_file": "`hf-cephalo profile --model-config MODEL_DIR --out FILE` "
                                    "(under the launcher, one process per rank)"}
        for name, command in commands.items():
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise self._bad(name, f"no such file; write one with {command} or leave it unset")
        if self.global_batch_size is not None:
            self.global_batch_size = self._integer("global_batch_size", 1, "samples")
        fraction = _float(self.memory_fraction)
        if not 0.0 < fraction <= 1.0:
            raise self._bad("memory_fraction", "must be a number in (0, 1]")
        self.memory_fraction = fraction
        self._validate_saving()
        self._validate_emulation()
        if self.precision is not None:
            names = str(self.precision).replace(",", " ").split()
            if names != ["auto"] and (not names or any(n not in PRECISIONS for n in names)):
                raise self._bad("precision", "must be 'auto' or one of fp32 / bf16 / fp16 per "
                                             "rank in rank order, e.g. 'bf16,bf16,fp16,fp32'")
            self.precision = ",".join(names)
        self._validate_adaptive()
        for name, choices in (("activation_offload", ACTIVATION_OFFLOAD_CHOICES),
                              ("param_dtype", PARAM_DTYPE_CHOICES),
                              ("reduce_dtype", REDUCE_DTYPE_CHOICES),
                              ("collate", COLLATE_CHOICES),
                              ("loss_reduction", LOSS_REDUCTION_CHOICES),
                              ("decode_mode", DECODE_MODE_CHOICES),
                              ("generation_split", GENERATION_SPLIT_CHOICES)):
            value = str(getattr(self, name)).strip().lower()
            if value not in choices:
                raise self._bad(name, f"must be one of {choices}")
            setattr(self, name, value)
        from hf_cephalo.planner.types import (ACTIVATION_CHECKPOINTING_CHOICES,
                                              parse_activation_checkpointing)

        try:  # the one parser of the choice, as the CLI's (any case: "True" as HF flags)
            self.activation_checkpointing = parse_activation_checkpointing(
                self.activation_checkpointing)
        except ValueError:
            raise self._bad("activation_checkpointing",
                            f"must be one of {ACTIVATION_CHECKPOINTING_CHOICES} (any case)") \
                from None

    def _integer(self, name: str, low: int, what: str) -> int:
        value = _float(getattr(self, name))
        if not (math.isfinite(value) and value == int(value) and value >= low):
            raise self._bad(name, f"must be an integer >= {low} ({what})")
        return int(value)

    def _validate_saving(self) -> None:
        from hf_cephalo.engine.export import parse_max_shard_size

        flag = self.save_full_model
        if isinstance(flag, str):
            words = {"1": True, "true": True, "yes": True, "on": True,
                     "0": False, "false": False, "no": False, "off": False}
            if flag.strip().lower() not in words:
                raise self._bad("save_full_model", "must be true or false (1/0, yes/no, on/off)")
            flag = words[flag.strip().lower()]
        if not isinstance(flag, bool):
            raise self._bad("save_full_model", "must be true or false")
        self.save_full_model = flag
        size = self.max_shard_size
        if isinstance(size, str) and size.strip().isdigit():
            size = int(size.strip())
        try:
            parse_max_shard_size(size)
        except ValueError as e:
            raise self._bad("max_shard_size", f"{e}") from None
        self.max_shard_size = size

    def _validate_emulation(self) -> None:
        if self.emulate_slowdown is not None:
            self.emulate_slowdown = _parse_list(self.emulate_slowdown, float, "emulate_slowdown")
            if not self.emulate_slowdown or not all(1.0 <= x < math.inf
                                                    for x in self.emulate_slowdown):
                raise self._bad("emulate_slowdown", "need one finite factor >= 1 per rank (a "
                                                    "device cannot be emulated faster than it is)")
        if self.emulate_memory_cap_bytes is not None:
            self.emulate_memory_cap_bytes = _parse_list(self.emulate_memory_cap_bytes, int,
                                                        "emulate_memory_cap_bytes")
            if not self.emulate_memory_cap_bytes or min(self.emulate_memory_cap_bytes) < 1:
                raise self._bad("emulate_memory_cap_bytes",
                                "need one capacity >= 1 (bytes) per rank")
        if (self.emulate_slowdown is not None and self.emulate_memory_cap_bytes is not None
                and len(self.emulate_slowdown) != len(self.emulate_memory_cap_bytes)):
            raise ValueError(f"emulate_slowdown has {len(self.emulate_slowdown)} entries but "
                             f"emulate_memory_cap_bytes has {len(self.emulate_memory_cap_bytes)}; "
                             "give one value per rank in both (--cephalo_emulate_slowdown, "
                             "--cephalo_emulate_memory_cap_bytes)")
        if self.emulate_slowdown_schedule is not None:
            from hf_cephalo.profiler.emulate import SlowdownSchedule

            if self.emulate_slowdown is not None:
                raise ValueError("--cephalo_emulate_slowdown and "
                                 "--cephalo_emulate_slowdown_schedule are both set: give the "
                                 "schedule alone (its step-0 entry is the start)")
            self.emulate_slowdown_schedule = str(self.emulate_slowdown_schedule)
            SlowdownSchedule.parse(self.emulate_slowdown_schedule)  # ValueError naming the flag

    def _validate_adaptive(self) -> None:
        mode = str(self.adaptive).strip().lower()
        if mode not in ADAPTIVE_CHOICES:
            raise self._bad("adaptive", f"must be one of {ADAPTIVE_CHOICES}")
        self.adaptive = mode
        threshold = _float(self.adaptive_threshold)
        if not 0.0 < threshold < 1.0:
            raise self._bad("adaptive_threshold", "must be a number in (0, 1) (the relative "
                            "predicted step-time gain a switch needs; 0.05 = 5%)")
        self.adaptive_threshold = threshold
        self.adaptive_interval = self._integer("adaptive_interval", 1, "steps between exchanges")
        self.adaptive_hysteresis_steps = self._integer("adaptive_hysteresis_steps", 0,
                                                       "steps between switches")

    @property
    def offload_activations(self) -> bool | None:
        """``activation_offload`` as the engine's argument: True, False, or None (auto)."""
        return {"on": True, "off": False, "auto": None}[self.activation_offload]

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError if a per-rank emulation list does not have ``world_size`` entries.

        Call once the world size is known, before any collective.
        """
        for name in ("emulate_slowdown", "emulate_memory_cap_bytes"):
            values = getattr(self, name)
            if values is not None and len(values) != world_size:
                raise self._bad(name, f"has {len(values)} entries but the world size is "
                                      f"{world_size}; give one value per rank in rank order")
        if self.emulate_slowdown_schedule is not None:
            from hf_cephalo.profiler.emulate import SlowdownSchedule

            SlowdownSchedule.parse(self.emulate_slowdown_schedule).check_world_size(world_size)


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _parse_list(value: Any, cast: type, name: str) -> list:
    """'1,2.5', '1 2.5', [1, 2.5] or ['1,2.5'] (command-line tokens) -> list of ``cast`` (float
    or int; '8e9' is a whole number of bytes); ValueError naming the setting ``name``, its
    value, flag and environment variable."""
    what = f"{name} = {value!r}"
    where = f"--cephalo_{name}, CephaloPlugin({name}=...) or env {env_name(name)}"
    parts = [value] if isinstance(value, str) else list(value)
    items = [x for part in parts
             for x in (part.replace(",", " ").split() if isinstance(part, str) else [part])]
    try:
        numbers = [float(x) for x in items]
    except (TypeError, ValueError):
        example = "'8e9,4e9'" if cast is int else "'1,2.5'"
        raise ValueError(f"{what} is not a list of numbers ({where}: use e.g. {example})") from None
    if cast is int:
        if any(not math.isfinite(x) or x != int(x) for x in numbers):
            raise ValueError(f"{what}: entries must be whole numbers ({where}: use e.g. "
                             "'8e9,4e9')")
        return [int(x) for x in numbers]
    return numbers


def cephalo_fields() -> list[tuple[str, Any, Any]]:
    """``(cephalo_<name>, type, field)`` per setting, for ``dataclasses.make_dataclass``: the
    command-line fields of ``CephaloTrainingArguments`` and the TRL configs (default None, so
    the environment can fill them; help = the setting's help + its default and environment
    variable)."""
    import typing

    hints = typing.get_type_hints(CephaloSettings)  # real types: the annotations are strings
    out = []
    for f in fields(CephaloSettings):
        default = f.metadata["default"]
        said = "unset" if default is None else repr(default)
        # argparse %-formats help text ("5%" would make --help raise)
        help_text = f"{f.metadata['help']} Default: {said}. Env: {env_name(f.name)}." \
            .replace("%", "%%")
        cli = f.metadata["cli_type"]
        out.append((f"cephalo_{f.name}", hints[f.name] if cli is None else cli | None,
                    field(default=None, metadata={"help": help_text})))
    return out


@dataclass(frozen=True)
class JobPrecision:
    """The job's one precision (compute / gathered-parameter / reduce dtype names: fp32, bf16,
    fp16) and, with ``per_rank``, the ``precision`` setting that gives each rank its own.

    Build it with ``JobPrecision.resolve``; the names are what profiles and plans record
    ([Note: precision tags] in profiles/precision.py).
    """

    compute: str
    param: str
    reduce: str
    per_rank: str | None = None

    @classmethod
    def resolve(cls, compute: str, settings: CephaloSettings) -> "JobPrecision":
        """``compute`` ("fp32" / "bf16" / "fp16": the front end's mixed precision) with the
        settings' param / reduce dtypes and per-rank precision.

        Raises ValueError: a low param dtype without (or other than) the compute dtype, a
        reduce dtype other than fp32 or the param dtype, or per-rank precision beside a
        one-precision job (bf16 / fp16 mixed precision, a param or reduce dtype)."""
        if settings.precision is not None:
            clash = [f for f, on in (("--bf16 (bf16 mixed precision)", compute == "bf16"),
                                     ("--fp16 (fp16 mixed precision)", compute == "fp16"),
                                     (f"--cephalo_param_dtype {settings.param_dtype}",
                                      settings.param_dtype != "auto"),
                                     (f"--cephalo_reduce_dtype {settings.reduce_dtype}",
                                      settings.reduce_dtype != "fp32")) if on]
            if clash:
                raise ValueError(
                    f"--cephalo_precision {settings.precision} sets each rank's precision, but "
                    f"{' and '.join(clash)} set(s) one for the whole job: drop them (per rank: "
                    "fp32 master, all-gather and reduce-scatter; each rank autocasts in its own "
                    "precision), or drop --cephalo_precision")
        param = compute if settings.param_dtype == "auto" else settings.param_dtype
        reduce = settings.reduce_dtype
        if param != "fp32" and param != compute:
            raise ValueError(f"cephalo_param_dtype = {param!r} but the compute dtype is "
                             f"{compute} ({'--' + compute if compute != 'fp32' else 'no --bf16/--fp16'}"
                             f"): gather in the compute dtype ('auto'), or 'fp32', or set "
                             f"--{param}")
        if reduce != "fp32" and reduce != param:
            raise ValueError(f"cephalo_reduce_dtype = {reduce!r} is lower than (or differs "
                             f"from) the param dtype {param!r}: use 'fp32' or {param!r}")
        return cls(compute, param, reduce, settings.precision)

    def engine(self) -> EnginePrecision:
        """The engine's precision policy (``CephaloEngine(precision=...)``): these names as
        torch dtypes, fp32 as None."""
        from hf_cephalo.engine.precision import EnginePrecision
        from hf_cephalo.engine.rank_precision import DTYPES

        return EnginePrecision(DTYPES[self.compute], DTYPES[self.param], DTYPES[self.reduce])

    def profile(self):
        """The profiler's ``Precision`` (profiles/precision.py) of the one job precision."""
        from hf_cephalo.profiles.precision import Precision

        return Precision(self.compute, self.param, self.reduce)

    def tag(self, model_dtype: str) -> str | None:
        """The [Note: precision tags] string the job's profile and plan must record; None with
        per-rank precision (those are checked per rank instead)."""
        return None if self.per_rank is not None else self.profile().tag(model_dtype)


assert all(f.default is None and f.default_factory is MISSING  # noqa: S101 - declaration rule
           for f in fields(CephaloSettings)), "settings default to None (env fallback)"
