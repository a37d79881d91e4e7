"""CephaloTrainingArguments: TrainingArguments plus the cephalo_* settings.

Every cephalo_* field left unset (None) falls back to the environment variable
``HF_CEPHALO_<FIELD NAME WITHOUT PREFIX, UPPER CASE>`` (e.g. ``HF_CEPHALO_PLAN_FILE``) and then
to its built-in default. Precedence: explicit argument > environment > default. The
environment route exists because stock ``accelerate launch`` rejects unknown keys in its YAML
config (docs/design.md contract 6), so Cephalo settings cannot live there.

The global batch size B is resolved once into the runtime's ``Job`` (``job_from_training_args``;
[Note: batch size semantics] in runtime/job.py). ``per_device_eval_batch_size`` is the
evaluation microbatch size of every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, make_dataclass
from typing import TYPE_CHECKING

import torch
from transformers import TrainingArguments

from hf_cephalo.runtime import CephaloSettings, JobPrecision, cephalo_fields

if TYPE_CHECKING:  # the engine is imported when a job builds it, not with the arguments
    from hf_cephalo.runtime import EnginePrecision

__all__ = ["CephaloTrainingArguments", "CephaloArguments", "job_from_training_args"]

logger = logging.getLogger(__name__)

CephaloArguments = make_dataclass("CephaloArguments", cephalo_fields(), kw_only=True)
CephaloArguments.__module__ = __name__
CephaloArguments.__doc__ = (
    "One ``cephalo_<name>`` command-line field per Cephalo setting (``CephaloSettings``: help, "
    "default and environment variable declared there once); mixed into "
    "``CephaloTrainingArguments`` and the TRL configs.")


def check_bf16_support(device_name: str, capability: tuple[int, int]) -> None:
    """Refuse --bf16 on a GPU without bf16 tensor cores (compute capability < 8.0: V100, T4,
    P100, P40, ...): ValueError proposing --fp16."""
    if tuple(capability) < (8, 0):
        raise ValueError(f"--bf16 on {device_name} (compute capability "
                         f"{capability[0]}.{capability[1]} < 8.0, no bf16 support): use --fp16 "
                         "(fp16 autocast with a sharded loss scaler) instead")


@dataclass
class CephaloTrainingArguments(CephaloArguments, TrainingArguments):
    """TrainingArguments for CephaloTrainer; see the module docstring for batch size rules.

    When CUDA is absent, ``use_cpu`` is set automatically: workers started by stock
    ``accelerate launch`` then build a MULTI_CPU (gloo) state with the real number of processes
    instead of silently reporting a single process (docs/design.md contract 6).

    Raises ValueError in ``__post_init__`` for an invalid cephalo_* value (after environment
    fallback; the message names the field, its environment variable and the value), a missing
    plan/profile file, ``fp16`` together with ``bf16``, or a param / reduce dtype that does not
    fit the compute dtype (``bf16=True`` and ``fp16=True`` are supported: autocast with fp32
    master weights, fp16 with a sharded loss scaler). Refused fields (``fp16_full_eval``,
    ``bf16_full_eval``, and every field docs/trainer_support.md refuses) are reported by
    ``CephaloTrainer``, all in one message (``refused_settings``).
    """

    def __post_init__(self) -> None:
        self._resolve_cephalo_fields()
        for flag in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag} = {getattr(self, flag)}: need at least 1 (samples per "
                                 "rank; the evaluation microbatch size for the eval flag)")
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are both set: pick one compute dtype (--bf16 on "
                             "GPUs with compute capability >= 8.0, --fp16 on older ones)")
        self.job_precision()  # bad param / reduce dtypes, per-rank beside --bf16: ValueError now
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

        ``fp16_full_eval``, ``bf16_full_eval``.
        """
        refused = {}
        for flag, why in (("fp16_full_eval", "evaluation runs through the engine in the "
                           "training precision; drop the flag"),
                          ("bf16_full_eval", "evaluation runs through the engine in the "
                           "training precision (bf16 autocast with --bf16); drop the flag")):
            if getattr(self, flag):
                refused[flag] = f"--{flag} is not supported by CephaloTrainer: {why}"
        return refused

    def _resolve_cephalo_fields(self) -> None:
        # CephaloSettings owns environment fallback, defaults and validation; copy its normalized
        # values back so that the fields and the settings never disagree.
        settings = CephaloSettings(**{f.name: getattr(self, "cephalo_" + f.name)
                                      for f in fields(CephaloSettings)})
        # whether the user chose activation checkpointing (flag, Python or env) rather than
        # taking the default: an explicit choice that contradicts a plan file is refused
        # (runtime planning, check_plan_file_checkpointing)
        self._cephalo_activation_checkpointing_given = \
            settings.was_given("activation_checkpointing")
        for f in fields(CephaloSettings):
            setattr(self, "cephalo_" + f.name, getattr(settings, f.name))

    def cephalo_settings(self) -> CephaloSettings:
        """The resolved Cephalo settings of these arguments (the ``cephalo_*`` fields)."""
        return CephaloSettings(**{f.name: getattr(self, "cephalo_" + f.name)
                                  for f in fields(CephaloSettings)})

    @property
    def place_model_on_device(self) -> bool:
        """False: stock ``Trainer.__init__`` would ``model.to(args.device)`` the WHOLE model
        (``Trainer._move_model_to_device``) before CephaloTrainer builds the engine, which moves
        only this rank's shards and one unit at a time (and a meta-device model cannot be moved
        at all). This is the hook transformers provides for integrations that place the model
        themselves."""
        return False

    def job_precision(self, settings: CephaloSettings | None = None) -> JobPrecision:
        """The job's precision from --bf16 / --fp16 and the cephalo_* dtype settings
        (``settings``: this object's, built when not given; ``JobPrecision.resolve``;
        ValueError for a combination it refuses)."""
        compute = "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
        return JobPrecision.resolve(compute, settings or self.cephalo_settings())

    def engine_precision(self) -> EnginePrecision:
        """The engine's precision policy (``job_precision().engine()``)."""
        return self.job_precision().engine()


def job_from_training_args(args, world_size: int, *, plan=None, file_plan=None, compile=None,
                           rows_per_sample: int = 1, scoring_passes: float = 0.0):
    """The runtime's ``Job`` of a Trainer run (``CephaloTrainer`` and the TRL trainers):
    ``args``' cephalo_* settings, seed, output directory, precision and DataLoader settings;
    the global batch size resolved once ([Note: batch size semantics] in runtime/job.py) from
    ``plan`` (or the plan file: ``file_plan`` when the caller read it already; the Job
    carries it, so nothing reads the file again), ``cephalo_global_batch_size``, or stock's
    ``per_device_train_batch_size`` x world size x ``gradient_accumulation_steps`` (then
    named in the plan line: ``Job.global_batch_origin``). ``rows_per_sample``: the door's
    sequence rows per sample (``Job.rows_per_sample``; 2 for a preference pair).
    ``scoring_passes``: the door's forward-only passes per step (``Job.scoring_passes``).

    Raises ValueError: ``cephalo_global_batch_size`` disagrees with the plan's."""
    from hf_cephalo.runtime import Job, LoaderOptions, Plan, resolve_global_batch_size

    settings = args.cephalo_settings()  # once per job
    source = "the plan" if plan is not None else f"the plan {settings.plan_file!r}"
    if plan is None and file_plan is None and settings.plan_file is not None:
        file_plan = Plan.load(settings.plan_file)
    if plan is None:
        plan = file_plan
    stock = args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps
    global_batch_size, given = resolve_global_batch_size(settings, stock, plan, source)
    origin = "" if given else (
        f"per_device_train_batch_size {args.per_device_train_batch_size} x {world_size} "
        f"process{'es' if world_size != 1 else ''} x gradient_accumulation_steps "
        f"{args.gradient_accumulation_steps}")
    loader = LoaderOptions(num_workers=args.dataloader_num_workers,
                           pin_memory=args.dataloader_pin_memory,
                           persistent_workers=args.dataloader_persistent_workers,
                           prefetch_factor=args.dataloader_prefetch_factor,
                           multiprocessing_context=args.dataloader_multiprocessing_context)
    return Job(settings=settings, world_size=world_size, rank=args.process_index,
               device=torch.device(args.device), output_dir=args.output_dir, seed=args.seed,
               data_seed=args.data_seed if args.data_seed is not None else args.seed,
               global_batch_size=global_batch_size, global_batch_size_given=given,
               global_batch_origin=origin,
               precision=args.job_precision(settings), compile=compile, loader=loader,
               activation_checkpointing_given=args._cephalo_activation_checkpointing_given,
               file_plan=file_plan, rows_per_sample=rows_per_sample,
               scoring_passes=scoring_passes)
