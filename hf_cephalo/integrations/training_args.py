"""CephaloTrainingArguments: TrainingArguments plus the cephalo_* settings.

Every cephalo_* field left unset (None) falls back to the environment variable
``HF_CEPHALO_<FIELD NAME WITHOUT PREFIX, UPPER CASE>`` (e.g. ``HF_CEPHALO_PLAN_FILE``) and then
to its built-in default. Precedence: explicit argument > environment > default. The
environment route exists because stock ``accelerate launch`` rejects unknown keys in its YAML
config (docs/design.md contract 6), so Cephalo settings cannot live there.

[Note: batch size semantics]
- The global batch size B (samples per optimizer step, all ranks together) comes from the plan
  (``Plan.global_batch_size``); ``cephalo_global_batch_size`` asks the planner for a B when no
  plan file is given, and must equal the plan's B when both are given.
- Without either, B = ``per_device_train_batch_size`` × world size: the optimizer sees the same
  batch as stock ``Trainer`` with ``gradient_accumulation_steps = 1``. Otherwise
  ``per_device_train_batch_size`` is ignored: each rank's b_i comes from the plan.
- Cephalo already accumulates gradients inside each step (l_i microbatches of m_i samples per
  rank, layered, paper §3.2), so ``gradient_accumulation_steps`` must stay 1: ``CephaloTrainer``
  refuses any other value with the equivalent ``cephalo_global_batch_size`` to use instead.
- ``per_device_eval_batch_size`` is the evaluation microbatch size of every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Literal, NamedTuple

import torch
from transformers import TrainingArguments

from hf_cephalo.integrations.accelerate import CephaloPlugin, env_name

__all__ = ["CephaloTrainingArguments"]

logger = logging.getLogger(__name__)

_PLUGIN_FIELDS = [f.name for f in fields(CephaloPlugin) if f.name != "distributed_type"]


class EnginePrecision(NamedTuple):
    """``CephaloEngine`` precision arguments (None = fp32 / no autocast)."""

    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None


def check_bf16_support(device_name: str, capability: tuple[int, int]) -> None:
    """Refuse --bf16 on a GPU without bf16 tensor cores (compute capability < 8.0: V100, T4,
    P100, P40, ...): ValueError proposing --fp16."""
    if tuple(capability) < (8, 0):
        raise ValueError(f"--bf16 on {device_name} (compute capability "
                         f"{capability[0]}.{capability[1]} < 8.0, no bf16 support): use --fp16 "
                         "(fp16 autocast with a sharded loss scaler) instead")


@dataclass
class CephaloTrainingArguments(TrainingArguments):
    """TrainingArguments for CephaloTrainer; see the module docstring for batch size rules.

    When CUDA is absent, ``use_cpu`` is set automatically: workers started by stock
    ``accelerate launch`` then build a MULTI_CPU (gloo) state with the real number of processes
    instead of silently reporting a single process (docs/design.md contract 6).

    Raises ValueError in ``__post_init__`` for an invalid cephalo_* value (after environment
    fallback; the message names the field, its environment variable and the value), a missing
    plan/profile file, ``fp16`` together with ``bf16``, or a param / reduce dtype that does not
    fit the compute dtype (``bf16=True`` and ``fp16=True`` are supported: autocast with fp32
    master weights, fp16 with a sharded loss scaler). Refused fields (``gradient_accumulation_steps
    != 1``, ``fp16_full_eval``, ``bf16_full_eval``, and every field docs/trainer_support.md
    refuses) are reported by ``CephaloTrainer``, all in one message (``refused_settings``).
    """

    cephalo_plan_file: str | None = field(default=None, metadata={"help": (
        "Path of a plan JSON written by `hf-cephalo plan --out plan.json` (per-rank batch size, "
        "microbatch size, number of microbatches and training-state ratio). If unset, the trainer "
        "plans at start from --cephalo_profile_file. Env: HF_CEPHALO_PLAN_FILE.")})
    cephalo_profile_file: str | None = field(default=None, metadata={"help": (
        "Path of a cluster profile JSON (per-rank seconds per unit fwd/bwd, memory bytes, "
        "collective seconds; `hf-cephalo profile`). Used to plan when no plan file is given; if "
        "neither is given the trainer profiles this cluster at start. Env: HF_CEPHALO_PROFILE_FILE.")})
    cephalo_global_batch_size: int | None = field(default=None, metadata={"help": (
        "Global batch size B in samples per optimizer step, summed over all ranks. Must equal the "
        "plan's value if a plan file is given. Default: the plan's value, else "
        "per_device_train_batch_size x world size. Env: HF_CEPHALO_GLOBAL_BATCH_SIZE.")})
    cephalo_memory_fraction: float | None = field(default=None, metadata={"help": (
        "Fraction c in (0, 1] of each device's memory capacity (bytes) the plan may use "
        "(paper §2.4 memory constraints). Default 0.8. Env: HF_CEPHALO_MEMORY_FRACTION.")})
    cephalo_activation_offload: Literal["on", "off", "auto"] | None = field(default=None, metadata={
        "help": ("Offload checkpointed boundary activations to pinned CPU memory: 'on', 'off', or "
                 "'auto' (on for CUDA, off on CPU). Default 'auto'. Env: HF_CEPHALO_ACTIVATION_OFFLOAD.")})
    # Both emulation lists are declared list[str] so that the command line takes '1,3' and '8e9'
    # as well as '1 3' (HfArgumentParser would apply float/int to each token); __post_init__
    # normalizes them to list[float] (slowdown) and list[int] (bytes), like the env fallbacks.
    cephalo_emulate_slowdown: list[str] | None = field(default=None, metadata={"help": (
        "Emulate a heterogeneous cluster on identical devices: per-rank compute slowdown factors "
        "(dimensionless, >= 1; 2.0 = each unit's compute takes twice as long), one per rank in "
        "rank order: '1,3' or '1 3'. Env: HF_CEPHALO_EMULATE_SLOWDOWN='1,3'.")})
    cephalo_emulate_memory_cap_bytes: list[str] | None = field(default=None, metadata={"help": (
        "Emulated per-rank memory capacity in bytes (> 0, whole numbers; 8e9 allowed), one per rank "
        "in rank order: '8e9,4e9' or '8e9 4e9'; the planner uses it instead of the device's real "
        "capacity. Env: HF_CEPHALO_EMULATE_MEMORY_CAP_BYTES='8e9,4e9'.")})
    cephalo_emulate_slowdown_schedule: str | None = field(default=None, metadata={"help": (
        "Emulate a cluster whose speeds drift during training: 'STEP:F0,F1;STEP:F0,F1' gives, from "
        "each global step (0-based; the first entry is step 0), one slowdown factor (>= 1) per "
        "rank, e.g. '0:1,1;10:1,3' (rank 1 three times slower from step 10). Not together with "
        "--cephalo_emulate_slowdown. Env: HF_CEPHALO_EMULATE_SLOWDOWN_SCHEDULE.")})
    cephalo_adaptive: Literal["off", "batch", "state"] | None = field(default=None, metadata={
        "help": ("Live re-balancing while training (docs/adaptive.md): 'batch' (default) re-plans "
                 "the per-rank batch b_i, microbatch m_i and count l_i from measured speeds and "
                 "switches at a step boundary (nothing moves; same global batches); 'state' may "
                 "also re-lay the state ratios r_i in memory (shards and optimizer state move "
                 "between ranks) when that beats the best split on the running r_i; 'off' keeps "
                 "the start plan. "
                 "Env: HF_CEPHALO_ADAPTIVE.")})
    cephalo_adaptive_threshold: float | None = field(default=None, metadata={"help": (
        "Relative predicted step-time gain, in (0, 1), a live switch needs (default 0.05 = 5%). "
        "Env: HF_CEPHALO_ADAPTIVE_THRESHOLD.")})
    cephalo_adaptive_interval: int | None = field(default=None, metadata={"help": (
        "Steps between two exchanges of the measured speeds (one small all-gather), >= 1; "
        "default 5. Env: HF_CEPHALO_ADAPTIVE_INTERVAL.")})
    cephalo_adaptive_hysteresis_steps: int | None = field(default=None, metadata={"help": (
        "At most one live switch per this many steps (>= 0; default 20). "
        "Env: HF_CEPHALO_ADAPTIVE_HYSTERESIS_STEPS.")})

    cephalo_save_full_model: bool | None = field(default=None, metadata={"help": (
        "Also write the full model into every checkpoint-N (the files save_model writes: "
        "sharded safetensors + config, loadable with from_pretrained). Default false: checkpoints "
        "hold the sharded engine state only, and `hf-cephalo export checkpoint-N --out DIR` writes "
        "the full model on demand. Flag: --cephalo_save_full_model true. Env: HF_CEPHALO_SAVE_FULL_MODEL=1.")})
    cephalo_max_shard_size: str | None = field(default=None, metadata={"help": (
        "Largest weight file save_model writes, as save_pretrained's max_shard_size: bytes or a "
        "size such as '5GB' (units TB, GB, MB, KB, powers of 1000); bigger models are written as "
        "model-0000k-of-0000n.safetensors + model.safetensors.index.json. Default '50GB' "
        "(save_pretrained's). Env: HF_CEPHALO_MAX_SHARD_SIZE.")})

    cephalo_param_dtype: str | None = field(default=None, metadata={"help": (
        "dtype of the gathered parameters (FSDP2 MixedPrecisionPolicy.param_dtype; the fp32 "
        "master shards and optimizer state are unchanged): 'auto' (default: bf16 with --bf16, "
        "fp16 with --fp16, fp32 otherwise; halves all-gathered bytes and gathered-unit memory), "
        "'bf16', 'fp16' (must match --bf16 / --fp16) or 'fp32'. Env: HF_CEPHALO_PARAM_DTYPE.")})
    cephalo_reduce_dtype: str | None = field(default=None, metadata={"help": (
        "dtype of the gradient reduce-scatter: 'fp32' (default; gradients accumulate in fp32 "
        "either way) or the param dtype (half the reduce-scatter bytes). "
        "Env: HF_CEPHALO_REDUCE_DTYPE.")})

    cephalo_precision: str | None = field(default=None, metadata={"help": (
        "Precision per rank: 'auto' (each GPU its fastest: bf16 > fp16 > fp32 from its compute "
        "capability; fp32 on the CPU) or one of fp32 / bf16 / fp16 per rank in rank order "
        "('bf16,bf16,fp16,fp32'). fp32 master weights, all-gathers and reduce-scatters; one "
        "loss scaler on every rank when a rank is fp16 (docs/engine.md 'Precision per rank'). "
        "A plan that records per-rank precisions (hf-cephalo plan --precision auto) decides "
        "them; without a plan each rank is profiled in its precision at start (not with "
        "--cephalo_profile_file). Not with --bf16 / --fp16. "
        "Env: HF_CEPHALO_PRECISION.")})
    # str, not Literal: HfArgumentParser would make Literal choices case-sensitive, and
    # "True" (HF style, as --torch_compile True) must parse as the env and Python do
    # (planner.types.parse_activation_checkpointing, via CephaloPlugin)
    cephalo_activation_checkpointing: str | None = field(
        default=None, metadata={"help": (
            "Activation checkpointing of the plan the trainer makes at start: 'true' (default: "
            "each unit's forward is recomputed in its backward, the paper's schedule), 'false' "
            "(every microbatch's forward graph is kept until its backward: no recompute, ~1/4 "
            "less compute per step, activation memory grows with layers x microbatches; the "
            "plan fails when that does not fit) or 'auto' (plan both, keep the faster one that "
            "fits); any case ('True' works). A --cephalo_plan_file records its own choice: 'false' "
            "or 'true' that differs from it is refused. Not 'false' with "
            "--gradient_checkpointing (with 'auto' that flag means 'true'). "
            "Env: HF_CEPHALO_ACTIVATION_CHECKPOINTING.")})
    cephalo_collate: Literal["global_batch", "microbatch"] | None = field(default=None, metadata={
        "help": ("Where the data collator pads: 'global_batch' (default) collates each global "
                 "batch once, on every rank, then splits it into ranks and microbatches, so every "
                 "row is padded as in a single process with the whole batch, whatever the plan; "
                 "'microbatch' collates each microbatch on its own: fewer padded tokens, but a "
                 "row's padding (and so the loss, with left padding or without position_ids) "
                 "then depends on the plan. A packing collator that pads nothing "
                 "(DataCollatorWithFlattening) is applied per microbatch either way. "
                 "Env: HF_CEPHALO_COLLATE.")})

    def __post_init__(self) -> None:
        self._resolve_cephalo_fields()
        for flag in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag} = {getattr(self, flag)}: need at least 1 (samples per "
                                 "rank; the evaluation microbatch size for the eval flag)")
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are both set: pick one compute dtype (--bf16 on "
                             "GPUs with compute capability >= 8.0, --fp16 on older ones)")
        if self.cephalo_precision is not None:
            self._check_rank_precision_flags()
        self.engine_precision()  # bad param / reduce dtypes: ValueError now
        if self.bf16 and not self.use_cpu and torch.cuda.is_available():
            check_bf16_support(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
        if not self.use_cpu and not torch.cuda.is_available():
            # Without cpu=True, torchrun-started workers see an initialized process group but
            # Accelerate reports DistributedType.NO and one process (docs/design.md contract 6).
            logger.info("CUDA is not available: setting use_cpu=True (MULTI_CPU over gloo)")
            self.use_cpu = True
        super().__post_init__()

    def refused_settings(self) -> dict[str, str]:
        """Field name -> message for the refused fields this class words itself (checked with
        every other refusal by ``CephaloTrainer``: [Note: one refusal message] in support.py).

        ``gradient_accumulation_steps != 1`` (the message gives the equivalent
        ``--cephalo_global_batch_size``), ``fp16_full_eval``, ``bf16_full_eval``.
        """
        refused = {}
        if self.gradient_accumulation_steps != 1:
            # the launcher's WORLD_SIZE if set: args.world_size would create the process group
            world = os.environ.get("WORLD_SIZE", "")
            world = world if world.isdigit() else "world size"
            refused["gradient_accumulation_steps"] = (
                f"--gradient_accumulation_steps = {self.gradient_accumulation_steps}: Cephalo "
                "accumulates gradients inside each step itself (l_i microbatches of m_i samples "
                "per rank, from the plan), so leave gradient_accumulation_steps = 1 and set "
                "--cephalo_global_batch_size to the global batch size you want (stock Trainer's "
                f"equivalent: per_device_train_batch_size x world size x "
                f"gradient_accumulation_steps = {self.per_device_train_batch_size} x {world} x "
                f"{self.gradient_accumulation_steps})")
        for flag, why in (("fp16_full_eval", "evaluation runs through the engine in the "
                           "training precision; drop the flag"),
                          ("bf16_full_eval", "evaluation runs through the engine in the "
                           "training precision (bf16 autocast with --bf16); drop the flag")):
            if getattr(self, flag):
                refused[flag] = f"--{flag} is not supported by CephaloTrainer: {why}"
        return refused

    def _resolve_cephalo_fields(self) -> None:
        # CephaloPlugin owns environment fallback, defaults and validation; copy its normalized
        # values back so that args and plugin never disagree.
        # whether the user chose activation checkpointing (flag, Python or env) rather than
        # taking the default: an explicit choice that contradicts a plan file is refused
        # (replan.check_plan_file_checkpointing); the plugin fills the default in below
        self._cephalo_activation_checkpointing_given = \
            self.cephalo_activation_checkpointing is not None or \
            bool(os.environ.get(env_name("activation_checkpointing"), "").strip())
        plugin = CephaloPlugin(**{name: getattr(self, "cephalo_" + name) for name in _PLUGIN_FIELDS})
        for name in _PLUGIN_FIELDS:
            setattr(self, "cephalo_" + name, getattr(plugin, name))

    @property
    def place_model_on_device(self) -> bool:
        """False: stock ``Trainer.__init__`` would ``model.to(args.device)`` the WHOLE model
        (``Trainer._move_model_to_device``) before CephaloTrainer builds the engine, which moves
        only this rank's shards and one unit at a time (and a meta-device model cannot be moved
        at all). This is the hook transformers provides for integrations that place the model
        themselves."""
        return False

    def _check_rank_precision_flags(self) -> None:
        """--cephalo_precision decides each rank's compute dtype and gathers in fp32 when the
        ranks differ: refuse the one-precision flags beside it instead of ignoring them."""
        clash = [f for f, on in (("--bf16", self.bf16), ("--fp16", self.fp16),
                                 (f"--cephalo_param_dtype {self.cephalo_param_dtype}",
                                  self.cephalo_param_dtype != "auto"),
                                 (f"--cephalo_reduce_dtype {self.cephalo_reduce_dtype}",
                                  self.cephalo_reduce_dtype != "fp32")) if on]
        if clash:
            raise ValueError(f"--cephalo_precision {self.cephalo_precision} sets each rank's "
                             f"precision, but {' and '.join(clash)} set(s) one for the whole job:"
                             " drop them (per rank: fp32 master, all-gather and reduce-scatter; "
                             "each rank autocasts in its own precision), or drop "
                             "--cephalo_precision")

    def engine_precision(self) -> EnginePrecision:
        """The engine's ``autocast_dtype`` / ``param_dtype`` / ``reduce_dtype`` from --bf16 /
        --fp16 and ``cephalo_param_dtype`` / ``cephalo_reduce_dtype``.

        Raises ValueError: a low param dtype without (or other than) the compute dtype, a
        reduce dtype other than fp32 or the param dtype."""
        compute = "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
        param = compute if self.cephalo_param_dtype == "auto" else self.cephalo_param_dtype
        reduce = self.cephalo_reduce_dtype
        if param != "fp32" and param != compute:
            raise ValueError(f"cephalo_param_dtype = {param!r} but the compute dtype is "
                             f"{compute} ({'--' + compute if compute != 'fp32' else 'no --bf16/--fp16'}"
                             f"): gather in the compute dtype ('auto'), or 'fp32', or set "
                             f"--{param}")
        if reduce != "fp32" and reduce != param:
            raise ValueError(f"cephalo_reduce_dtype = {reduce!r} is lower than (or differs "
                             f"from) the param dtype {param!r}: use 'fp32' or {param!r}")
        dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
        return EnginePrecision(dtypes[compute], dtypes[param], dtypes[reduce])

    @property
    def cephalo_offload_activations(self) -> bool | None:
        """``cephalo_activation_offload`` as the engine's argument: True, False, or None (auto)."""
        return {"on": True, "off": False, "auto": None}[self.cephalo_activation_offload]

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError if a per-rank emulation list does not have ``world_size`` entries."""
        CephaloPlugin.from_training_args(self).check_world_size(world_size)

    def resolve_global_batch_size(self, world_size: int, plan_global_batch_size: int | None = None) -> int:
        """The global batch size B (samples per optimizer step) per [Note: batch size semantics].

        Raises ValueError if ``cephalo_global_batch_size`` disagrees with the plan's value.
        """
        if plan_global_batch_size is not None:
            if (self.cephalo_global_batch_size is not None
                    and self.cephalo_global_batch_size != plan_global_batch_size):
                raise ValueError(
                    f"cephalo_global_batch_size = {self.cephalo_global_batch_size} but the plan "
                    f"{self.cephalo_plan_file!r} has global_batch_size = {plan_global_batch_size}; "
                    "re-plan with the batch size you want or drop the flag")
            return plan_global_batch_size
        if self.cephalo_global_batch_size is not None:
            return self.cephalo_global_batch_size
        return self.per_device_train_batch_size * world_size
