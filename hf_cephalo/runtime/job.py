"""The job description: what a run is, resolved ONCE before planning (docs/design.md contract 8).

Each front end builds a ``Job`` from its own settings (``CephaloTrainingArguments`` for the
Trainer and the TRL trainers, an ``Accelerator`` + ``CephaloPlugin`` for a custom loop) and
hands it to the runtime; no function of the runtime reads a front end's settings object.

[Note: batch size semantics]
The global batch size B (samples per optimizer step, all ranks together) is decided here, once:
- a plan (``Plan`` object or plan file) fixes B; an explicit ``global_batch_size`` setting must
  equal it;
- else the ``global_batch_size`` setting;
- else the front end's stock global batch: per-device batch size x world size x gradient
  accumulation steps, what the optimizer sees under stock DDP / Trainer.
``global_batch_size_given`` says whether B was fixed (a plan or the setting) rather than derived
from the world size: an elastic resume onto another world keeps the trajectory only then
([Note: world-independent trajectory] in ``elastic.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_cephalo.engine.compile import CompileOptions
from hf_cephalo.planner import Plan
from hf_cephalo.planner.optimize import check_scoring_passes
from hf_cephalo.profiler.emulate import EmulationConfig
from hf_cephalo.runtime.data import LoaderOptions
from hf_cephalo.runtime.settings import CephaloSettings, JobPrecision

__all__ = ["Job", "resolve_global_batch_size"]


def resolve_global_batch_size(settings: CephaloSettings, stock_global_batch_size: int,
                              plan: Plan | None, plan_source: str = "the plan"
                              ) -> tuple[int, bool]:
    """(B, given) per [Note: batch size semantics].

    Raises ValueError when the ``global_batch_size`` setting disagrees with the plan's B.
    """
    explicit = settings.global_batch_size
    if plan is not None:
        if explicit is not None and explicit != plan.global_batch_size:
            raise ValueError(
                f"cephalo_global_batch_size = {explicit} but {plan_source} has "
                f"global_batch_size = {plan.global_batch_size}; re-plan with the batch size you "
                "want or drop the flag")
        return plan.global_batch_size, True
    if explicit is not None:
        return explicit, True
    return stock_global_batch_size, False


@dataclass(frozen=True, kw_only=True)
class Job:
    """One training job as the runtime sees it (built by a front end; see the module note).

    Attributes:
        settings: the resolved Cephalo settings.
        world_size / rank: the process group's (rank = global rank).
        device: this rank's compute device.
        output_dir: where plans, profiles, progress and reports go; None when the front end
            names no folder (a loop without ``project_dir``): then the runtime writes no file.
        seed: the run's seed (per-unit init of a meta model); data_seed: the seed of the
            sampler's permutations (the front end's data seed, else ``seed``).
        global_batch_size: B (samples per optimizer step); global_batch_size_given: fixed by
            a plan or the setting (see [Note: batch size semantics]); global_batch_origin:
            how the front end derived B when it was not given (printed in the plan line,
            e.g. "per_device_train_batch_size 2 x 2 processes x gradient_accumulation_steps
            4"; "" when given).
        precision: the job's precision (``JobPrecision``).
        compile: per-unit ``torch.compile`` options, None for eager.
        loader: the DataLoader worker / pinning settings of the training loader.
        activation_checkpointing_given: the user chose the setting (rather than its default),
            so a plan file that contradicts it is refused.
        file_plan: the plan of ``settings.plan_file``, read once by the front end (None
            without a plan file; the runtime reads the file itself when a front end did not).
        emulation: the per-rank emulation (slowdown, memory caps, schedule) or None.
        rows_per_sample: the sequence rows one sample is in the engine's training microbatch
            (set by the door, not a user option): 2 for a preference pair of the DPO and
            reward doors (chosen + rejected rows share a microbatch), 1 otherwise. The planner
            prices a microbatch of m samples as rows_per_sample x m rows
            (``planner.rows.per_sample_cluster``).
        scoring_passes: forward-only layered passes over the plan's split per optimizer step
            (set by the door, not a user option): a GRPO / RLOO door's old-policy and
            reference log-probability passes (per generation round, over the steps a round
            feeds) and GRPO's entropy-threshold pass; 0 otherwise. The start plan minimizes
            the training step plus this many passes (``planner.optimize(...,
            scoring_passes=)``).
    """

    settings: CephaloSettings
    world_size: int
    rank: int
    device: torch.device
    output_dir: str | None
    seed: int
    data_seed: int
    global_batch_size: int
    global_batch_size_given: bool
    precision: JobPrecision
    global_batch_origin: str = ""
    compile: CompileOptions | None = None
    loader: LoaderOptions = field(default_factory=LoaderOptions)
    activation_checkpointing_given: bool = False
    file_plan: Plan | None = None
    rows_per_sample: int = 1
    scoring_passes: float = 0.0
    emulation: EmulationConfig | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if isinstance(self.rows_per_sample, bool) or not isinstance(self.rows_per_sample, int) \
                or self.rows_per_sample < 1:  # a door's value, checked on every rank
            raise ValueError(f"Job.rows_per_sample must be an int >= 1 (the sequence rows of "
                             f"one sample), got {self.rows_per_sample!r}")
        check_scoring_passes(self.scoring_passes)  # a door's value: ValueError if not >= 0
        self.settings.check_world_size(self.world_size)  # emulation lists: before any collective
        emulation = EmulationConfig.from_settings(self.settings)
        if emulation is not None:
            emulation.check_world_size(self.world_size)
        object.__setattr__(self, "emulation", emulation)

    @property
    def is_main(self) -> bool:
        """Rank 0: prints plans and reports, writes run-level files."""
        return self.rank == 0
