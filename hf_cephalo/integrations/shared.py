"""What more than one door reads: the support-table machinery and the TRL trainer table.

The doors form a chain, each importing only the ones after it: ``trl`` -> ``trainer`` ->
``loop`` -> ``shared`` (tests/test_layering.py). A support table (``Status``, ``Support`` and
its constructors ``stock`` / ``inherited`` / ``not_applicable`` / ``refused``; ``markdown_table``
renders it) classifies every field a front end lets a user set ([Note: no silent no-op] in
``trainer/support.py``): the Trainer's (``trainer/support.py``), the custom loop's
(``loop/support.py``) and TRL's (``trl/support.py``). ``TRL_TRAINER_SUPPORT`` and
``trainer_class_problems`` are here because ``CephaloTrainerMixin`` (trainer door) refuses a TRL
trainer the engine cannot run under any subclass, and docs/trl.md renders the same table.
Imports no TRL: the trainer check reads class names only.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

__all__ = ["Status", "Support", "stock", "inherited", "not_applicable", "refused",
           "markdown_table", "TRL_TRAINER_SUPPORT", "trainer_class_problems"]


class Status(enum.Enum):
    STOCK = "works as stock"
    INHERITED = "stock code path"
    NOT_APPLICABLE = "not applicable"
    REFUSED = "refused"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Support:
    """How CephaloTrainer handles one field or hook.

    note: why / what to do instead (for REFUSED: the fix the error message gives).
    test: ``tests/<file>.py::<name>`` comparing with stock Trainer (STOCK entries).
    refuse_if: value -> True when that value is refused (REFUSED default: "not the default").
    """

    status: Status
    note: str
    test: str | None = None
    refuse_if: Callable[[Any], bool] | None = None
    implies: str | None = None
    """A REFUSED field TrainingArguments turns on whenever this one is set (and may set this
    one itself, as torch_compile fills in torch_compile_backend): only that field is reported."""


def stock(note: str, test: str) -> Support:
    return Support(status=Status.STOCK, note=note, test=test)


def inherited(note: str) -> Support:
    return Support(status=Status.INHERITED, note=note)


def not_applicable(note: str) -> Support:
    return Support(status=Status.NOT_APPLICABLE, note=note)


def refused(note: str, refuse_if: Callable[[Any], bool] | None = None) -> Support:
    return Support(status=Status.REFUSED, note=note, refuse_if=refuse_if)


def markdown_table(title: str, rows: dict[str, Support], level: int = 2) -> list[str]:
    """The lines of one support table (name, status, note, test) under a heading of
    ``level`` (docs/trainer_support.md, docs/trl.md)."""
    out = [f"{'#' * level} {title}", "", "| name | status | note | test |", "|---|---|---|---|"]
    for name, s in rows.items():
        note = s.note.replace("|", "\\|")
        out.append(f"| `{name}` | {s.status.value} | {note} | "
                   f"{'`' + s.test + '`' if s.test else ''} |")
    return out + [""]


# TRL trainer classes: which ones the Cephalo runtime runs (docs/trl.md)

_GENERATES = (
    "generates completions while it trains; the engine generates on its shards "
    "(docs/generation.md), but this trainer's loss, reference / teacher passes and generation "
    "settings are not built and validated on the runtime (GRPO and RLOO are: "
    "CephaloGRPOTrainer, CephaloRLOOTrainer). Run this trainer with stock Accelerate / FSDP2")
_PAIRS = (
    "scores a chosen and a rejected sequence per example: the two rows must stay on one rank "
    "and in one microbatch, and its loss is a per-rank mean; built for DPOTrainer only "
    "(CephaloDPOTrainer), not validated for this trainer's loss and collator")
TRL_TRAINER_SUPPORT: dict[str, Support] = {
    "SFTTrainer": stock("CephaloSFTTrainer (CephaloTrainerMixin + SFTTrainer)",
                        "tests/test_trl_sft.py::test_sft_matches_stock"),
    "DPOTrainer": stock("CephaloDPOTrainer (CephaloTrainerMixin + DPOTrainer): a pair is one "
                        "sample; reference precomputed, a sharded frozen engine, or the PEFT "
                        "policy with its adapters off",
                        "tests/test_trl_dpo.py::test_dpo_matches_stock"),
    "RewardTrainer": stock("CephaloRewardTrainer (CephaloTrainerMixin + RewardTrainer): a "
                           "pair is one sample; loss and metrics of the global batch's pairs",
                           "tests/test_trl_reward.py::test_reward_matches_stock"),
    "CPOTrainer": refused(_PAIRS),
    "ORPOTrainer": refused(_PAIRS),
    "TPOTrainer": refused(_PAIRS),
    "KTOTrainer": stock("CephaloKTOTrainer (CephaloTrainerMixin + KTOTrainer): a row is one "
                        "sample; the KL estimate of the global batch; the reference a sharded "
                        "frozen engine or the PEFT policy with its adapters off",
                        "tests/test_trl_kto.py::test_kto_matches_stock"),
    "GRPOTrainer": stock("CephaloGRPOTrainer (CephaloTrainerMixin + GRPOTrainer): built-in "
                         "generation on the sharded engine (keyed sampling) or a rollout_func; "
                         "rewards, advantages and every loss's normalizer over the global "
                         "generation batch",
                         "tests/test_trl_grpo.py::test_grpo_matches_stock"),
    "RLOOTrainer": stock("CephaloRLOOTrainer (CephaloTrainerMixin + RLOOTrainer): built-in "
                         "generation or a rollout_func; the leave-one-out baseline and "
                         "KL-in-reward over the global generation batch",
                         "tests/test_trl_grpo.py::test_rloo_matches_stock"),
    **{name: refused(_GENERATES) for name in (
        "OnlineDPOTrainer", "XPOTrainer", "NashMDTrainer",
        "PPOTrainer", "GKDTrainer", "GOLDTrainer", "GMPOTrainer", "A2POTrainer",
        "AsyncGRPOTrainer", "DistillationTrainer", "AsyncDistillationTrainer",
        "ServerDistillationTrainer", "IWOPDTrainer", "SDFTTrainer", "SDPOTrainer")},
}
"""TRL trainer class -> support (the first TRL class in a trainer's MRO decides)."""


def trainer_class_problems(cls: type) -> list[str]:
    """One message when ``cls`` (a ``CephaloTrainerMixin`` subclass) sits on a TRL trainer
    the engine cannot run (``TRL_TRAINER_SUPPORT``; an unlisted one is refused as not
    validated); empty otherwise. Reads class names only (no TRL import)."""
    trl = next((c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"
                and c.__name__ != "_BaseTrainer" and c.__name__ != "Trainer"), None)
    if trl is None:
        return []
    support = TRL_TRAINER_SUPPORT.get(trl.__name__)
    if support is None:
        return [f"TRL's {trl.__name__} is not validated on the Cephalo runtime: its training "
                "step, loss and collator are not classified (TRL_TRAINER_SUPPORT in "
                "hf_cephalo/integrations/shared.py); use CephaloSFTTrainer or stock TRL"]
    if support.status is Status.REFUSED:
        return [f"TRL's {trl.__name__} is not supported on the Cephalo runtime: it "
                f"{support.note}"]
    door = _DOOR_ONLY.get(trl.__name__)
    if door is not None and "RolloutDoor" not in {c.__name__ for c in cls.__mro__}:
        return [f"TRL's {trl.__name__} runs on the Cephalo runtime through {door} only (its "
                "rows, rewards and loss normalizers are re-laid for the plan there); use "
                f"{door}"]
    return []


_DOOR_ONLY = {"GRPOTrainer": "CephaloGRPOTrainer", "RLOOTrainer": "CephaloRLOOTrainer"}
"""TRL trainers the mixin alone cannot put on the runtime: the door that does (its bases
include ``rollout_door.RolloutDoor``)."""
