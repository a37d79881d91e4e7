"""Elastic training: re-plan for the world a (re)start gets and resume on the same trajectory.

Beyond the stock resume this module holds what a checkpoint ran on (``plan.json``,
``cephalo_run.json``: ``write_checkpoint_record``), the resume checks (``check_resume``) and
the time lost per change (``ElasticProgress``). docs/guide.md, "runtime/elastic.py".

[Note: world-independent trajectory]
For any plan the engine's gradient is the full-batch gradient of the step's global batch
(docs/design.md contract 4), and the global batch of step k is a function of (seed, epoch,
dataset length, B) only (``sampler.global_batches``; the plan only splits it by b_i). With B
fixed, a run that changes world at a checkpoint therefore follows the uninterrupted run's
trajectory up to floating-point reduction order. Hence B must not change on resume, and a
missing ``cephalo_global_batch_size`` (B = per_device_train_batch_size x world size) is refused
once the world changed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any, NamedTuple

from hf_cephalo.file_modes import apply_default_mode
from hf_cephalo.planner import Plan

__all__ = ["RUN_RECORD_NAME", "PLAN_NAME", "PROGRESS_NAME", "RESTARTS_NAME", "RunRecord",
           "Progress", "ResumeReport", "write_checkpoint_record", "read_checkpoint_record",
           "check_resume", "format_plan_change", "latest_checkpoint", "run_fingerprint", "ElasticProgress"]

logger = logging.getLogger(__name__)

RUN_RECORD_NAME = "cephalo_run.json"  # in checkpoint-N: what the run was (RunRecord)
PLAN_NAME = "plan.json"  # in checkpoint-N: the plan it ran on
PROGRESS_NAME = "cephalo_progress.json"  # in output_dir: the last finished step (Progress)
RESTARTS_NAME = "cephalo_restarts.jsonl"  # in output_dir: one ResumeReport per resume


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunRecord:
    """What a checkpoint was trained with (``cephalo_run.json``).

    Attributes:
        global_batch_size: B, samples per optimizer step (all ranks).
        model_fingerprint: ``run_fingerprint`` of the model (class + shape-defining config).
        model_class: the model's class name (for messages).
        world_size: ranks of the run that wrote it.
        device_names: device name per rank (emulation included), rank order.
        global_step: the checkpoint's step.
        saved_time_s: wall-clock time of the save (seconds since the epoch).
    """

    global_batch_size: int
    model_fingerprint: str
    model_class: str
    world_size: int
    device_names: list[str]
    global_step: int
    saved_time_s: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(data)
        if missing:
            raise ValueError(f"{RUN_RECORD_NAME}: missing keys {sorted(missing)}")
        return cls(**{k: data[k] for k in names})


class Progress(NamedTuple):
    """The last finished training step of the run in ``output_dir`` (``cephalo_progress.json``)."""

    global_step: int
    time_s: float  # wall clock at the end of that step, seconds since the epoch
    world_size: int


class ResumeReport(NamedTuple):
    """Time lost to one change of world, logged on resume.

    Attributes:
        checkpoint: the checkpoint resumed from.
        checkpoint_step: its global step.
        last_step: the last step finished before the restart (None: not recorded).
        steps_redone: ``last_step - checkpoint_step`` (steps computed twice), 0 if unknown.
        restart_s: seconds from the end of ``last_step`` to the start of the first step after
            the resume (detection, rendezvous, process start, planning, engine build, loading);
            None if no progress was recorded.
        old_world_size / new_world_size: ranks before / after.
        old_plan / new_plan: the plans (old None for a checkpoint without ``plan.json``).
    """

    checkpoint: str
    checkpoint_step: int
    last_step: int | None
    steps_redone: int
    restart_s: float | None
    old_world_size: int | None
    new_world_size: int
    old_plan: Plan | None
    new_plan: Plan

    def to_json(self) -> dict[str, Any]:
        out = self._asdict()
        out["old_plan"] = None if self.old_plan is None else self.old_plan.to_json()
        out["new_plan"] = self.new_plan.to_json()
        return out


def _write_json_atomic(path: str, data: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    apply_default_mode(tmp)  # a leftover tmp of a reused pid keeps its mode: [Note: file modes]
    os.replace(tmp, path)


def run_fingerprint(model) -> str:
    """``profiles.cache.model_fingerprint`` without ``config.architectures`` and ``config.dtype``
    — ``save_pretrained`` sets both on the live model, so a model saved mid-run
    (``cephalo_save_full_model``) and the same model built fresh, or loaded with
    ``from_pretrained``, must fingerprint alike (the checkpoint loader checks the shards' dtypes
    itself) — and without the special token ids: ``Trainer.train`` aligns them with the
    tokenizer's when it starts, after the resume check but before any save (TRL's trainers
    also set the pad token), so the saving run and the resuming one saw different ones."""
    import hashlib

    from hf_cephalo.profiles.cache import model_description

    description = model_description(model)
    for key in ("architectures", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
                "pad_token_id"):
        description["desc"].pop(key, None)
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def write_checkpoint_record(directory: str, plan: Plan, record: RunRecord) -> None:
    """Rank 0: ``plan.json`` and ``cephalo_run.json`` into a checkpoint (staging) directory."""
    plan.save(os.path.join(directory, PLAN_NAME))
    _write_json_atomic(os.path.join(directory, RUN_RECORD_NAME), record.to_json())


def read_checkpoint_record(checkpoint: str) -> tuple[Plan | None, RunRecord | None]:
    """The plan and run record of ``checkpoint`` (None for files a checkpoint written before
    elastic support lacks).

    Raises:
        ValueError: a file exists but cannot be parsed (names the file).
    """
    plan_path, record_path = (os.path.join(checkpoint, n) for n in (PLAN_NAME, RUN_RECORD_NAME))
    plan = Plan.load(plan_path) if os.path.isfile(plan_path) else None
    record = None
    if os.path.isfile(record_path):
        try:
            with open(record_path) as f:
                record = RunRecord.from_json(json.load(f))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"{record_path}: unreadable run record ({exc}); the checkpoint is "
                             "damaged, resume from an earlier one") from exc
    return plan, record


def check_resume(checkpoint: str, record: RunRecord | None, plan: Plan, fingerprint: str,
                 model_class: str, global_batch_size_given: bool) -> None:
    """Refuse a checkpoint that would change the trajectory: another model, another B.

    Every rank reads the same files, so every rank raises the same error (no rank is left in a
    collective). See [Note: world-independent trajectory].

    Raises:
        ValueError: the record's model fingerprint or global batch size differ from this run's.
    """
    if record is None:
        return
    if record.model_fingerprint != fingerprint:
        raise ValueError(
            f"{checkpoint} was trained on another model ({record.model_class}, fingerprint "
            f"{record.model_fingerprint}) than this run's ({model_class}, fingerprint "
            f"{fingerprint}); resume with the model it was trained on or start a new output_dir")
    if record.global_batch_size != plan.global_batch_size:
        how = ("--cephalo_global_batch_size is not set, so B = per_device_train_batch_size x "
               f"world size ({plan.world_size} ranks now, {record.world_size} then)"
               if not global_batch_size_given else "the plan or --cephalo_global_batch_size says so")
        raise ValueError(
            f"{checkpoint} was trained with global batch size {record.global_batch_size} but "
            f"this run plans {plan.global_batch_size} ({how}); the trajectory continues only "
            f"with the same B: set --cephalo_global_batch_size {record.global_batch_size} "
            "(elastic jobs must always set it)")


def _plan_rows(plan: Plan) -> list[tuple]:
    return [(r.device, r.batch_size, r.microbatch_size, r.num_microbatches, r.state_ratio)
            for r in plan.ranks]


def format_plan_change(old: Plan | None, new: Plan) -> str:
    """The old and new plans side by side, one row per rank (b_i, m_i, l_i, r_i %).

    The header says what changed: the world (``elastic re-plan: 3 -> 2 ranks``), only the plan
    on the same number of ranks (``re-plan on the same 2 ranks``); a resume onto the very same
    plan is one line without the table (it is no re-plan). A change of activation
    checkpointing (an elastic re-plan with ``--cephalo_activation_checkpointing auto``) is said
    in the header."""
    if old is not None and _plan_rows(old) == _plan_rows(new) and \
            old.activation_checkpointing == new.activation_checkpointing:
        return (f"Cephalo resume on the same plan: {new.world_size} ranks, global batch size "
                f"{new.global_batch_size}")
    def rows(plan: Plan | None, n: int) -> list[str]:
        cells = [] if plan is None else [
            f"{r.device[:14]:<14} {r.batch_size:>4} {r.microbatch_size:>4} "
            f"{r.num_microbatches:>4} {100 * r.state_ratio:>7.2f}" for r in plan.ranks]
        return cells + [f"{'':<14} {'':>4} {'':>4} {'':>4} {'':>7}"] * (n - len(cells))

    n = max(new.world_size, 0 if old is None else old.world_size)
    head = f"{'device':<14} {'b_i':>4} {'m_i':>4} {'l_i':>4} {'r_i %':>7}"
    what = (f"re-plan on the same {new.world_size} ranks"
            if old is not None and old.world_size == new.world_size else
            f"elastic re-plan: {'?' if old is None else old.world_size} -> {new.world_size} ranks")
    if old is not None and old.activation_checkpointing != new.activation_checkpointing:
        on_off = {True: "on", False: "off"}
        what += (f", activation checkpointing {on_off[old.activation_checkpointing]} -> "
                 f"{on_off[new.activation_checkpointing]}")
    lines = [f"Cephalo {what}, global batch size {new.global_batch_size}",
             f"{'rank':>4} | before: {head} | after: {head}"]
    for i, (a, b) in enumerate(zip(rows(old, n), rows(new, n))):
        lines.append(f"{i:>4} |         {a} |        {b}")
    return "\n".join(lines)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest COMPLETE ``checkpoint-N`` in ``output_dir`` (with the completeness marker;
    staging dirs never match), or None; newer incomplete ones are skipped with a warning
    naming them (``checkpoint.newest_complete_checkpoint``)."""
    from hf_cephalo.engine.checkpoint import newest_complete_checkpoint

    newest = newest_complete_checkpoint(output_dir)
    # said once: every rank of a job resolves the same checkpoint (RANK is set by the launcher)
    if newest.path is not None and newest.skipped and os.environ.get("RANK", "0") == "0":
        logger.warning("resume: skipped %d incomplete checkpoint(s) newer than %s (no "
                       "completeness marker: their save did not finish): %s",
                       len(newest.skipped), newest.path, ", ".join(newest.skipped))
    return newest.path


def read_progress(output_dir: str) -> Progress | None:
    """The run's last finished step, or None (never recorded, or unreadable)."""
    try:
        with open(os.path.join(output_dir, PROGRESS_NAME)) as f:
            return Progress(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


class ElasticProgress:
    """Records progress (rank 0, after every step) and reports a resume (first step after it).

    The runtime's session drives it: ``arm`` when a run resumes from a checkpoint,
    ``step_begin`` / ``step_end`` around every optimizer step. The report is kept in
    ``self.report`` (every rank), printed and appended to ``cephalo_restarts.jsonl`` by rank 0.

    Args:
        output_dir: the run's output directory (None: no file is read or written; the
            resume is still printed); rank: this rank; world_size: the world's.
    """

    def __init__(self, output_dir: str | None, rank: int, world_size: int):
        self.output_dir, self.rank, self.world_size = output_dir, rank, world_size
        self.report: ResumeReport | None = None
        self._armed: tuple[str, int, Plan | None, int | None, Progress | None] | None = None

    def arm(self, checkpoint: str, checkpoint_step: int, old_plan: Plan | None,
            old_world_size: int | None) -> None:
        """A resume from ``checkpoint`` (at ``checkpoint_step``, trained on ``old_plan`` by
        ``old_world_size`` ranks): reported at the next ``step_begin``."""
        self._armed = (checkpoint, checkpoint_step, old_plan, old_world_size,
                       None if self.output_dir is None else read_progress(self.output_dir))

    def step_begin(self, plan: Plan) -> None:
        """Before a step on ``plan``: the resume report, once after ``arm``."""
        if self._armed is None:
            return
        checkpoint, step, old_plan, old_world, progress = self._armed
        self._armed = None
        last = None if progress is None else progress.global_step
        self.report = ResumeReport(
            checkpoint=checkpoint, checkpoint_step=step, last_step=last,
            steps_redone=0 if last is None else max(0, last - step),
            restart_s=None if progress is None else time.time() - progress.time_s,
            old_world_size=old_world, new_world_size=plan.world_size,
            old_plan=old_plan, new_plan=plan)
        if self.rank == 0:
            self._print(self.report)
        if self.rank == 0 and self.output_dir is not None:
            os.makedirs(self.output_dir, exist_ok=True)  # a loop's project_dir may not exist yet
            with open(os.path.join(self.output_dir, RESTARTS_NAME), "a") as f:
                f.write(json.dumps(self.report.to_json()) + "\n")

    @staticmethod
    def _print(report: ResumeReport) -> None:
        restart = "unknown" if report.restart_s is None else f"{report.restart_s:.1f} s"
        print(format_plan_change(report.old_plan, report.new_plan), flush=True)
        print(f"Cephalo resume from {report.checkpoint} (step {report.checkpoint_step}): "
              f"{report.steps_redone} step(s) redone (last finished step "
              f"{report.last_step if report.last_step is not None else 'unknown'}), restart "
              f"took {restart} (end of the last step to the first step now)", flush=True)

    def step_end(self, global_step: int) -> None:
        """After optimizer step ``global_step`` finished: rank 0 rewrites the progress file."""
        if self.rank == 0 and self.output_dir is not None:
            os.makedirs(self.output_dir, exist_ok=True)
            _write_json_atomic(os.path.join(self.output_dir, PROGRESS_NAME),
                               Progress(global_step, time.time(), self.world_size)._asdict())
