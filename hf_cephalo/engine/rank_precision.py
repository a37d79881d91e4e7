"""Precision per rank: each rank computes in its own precision inside one data-parallel job.

[Note: precision per rank]
Only the compute differs between ranks: every rank holds fp32 master shards and optimizer
state, accumulates fp32 gradients (autocast's weight cast has an fp32 backward) and
reduce-scatters fp32. When the ranks' precisions differ the all-gather is the fp32 master
(``EnginePrecision.param`` None), cast by each rank inside autocast: the one exact choice (a
bf16 gather rounds an fp16 / fp32 rank's weights, an fp16 gather overflows). ONE loss scaler
(``CephaloEngine.make_grad_scaler``) serves every rank as soon as one computes in fp16: its
scale is a power of 2, so scaling and unscaling is exact for bf16 / fp32 ranks; found-inf is
SUM-all-reduced, so every rank skips the same step; one ``scaler.pt`` resumes onto any plan.
With one precision for all, the job is the ordinary ``--bf16`` / ``--fp16`` / fp32 job.
Why, the costs and the rejected alternative: docs/engine.md, "Precision per rank (issue 25)".
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..profiles.precision import (PRECISIONS, auto_precision, capability_precisions,
                                  check_rank_precisions, parse_rank_precisions)
from .precision import EnginePrecision

__all__ = ["RankPrecision", "DTYPES", "rank_precision", "device_precisions",
           "resolve_rank_precisions", "check_scalable_optimizer"]

# precision name (PRECISIONS) -> torch dtype, None = fp32 (no cast); the package's one such map
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class RankPrecision(NamedTuple):
    """One rank's precision in a per-rank job.

    engine: its ``CephaloEngine(precision=...)`` policy.
    loss_scaling: True when ANY rank computes in fp16: then every rank trains with the job's
        one scaler ([Note: precision per rank]).
    """

    engine: EnginePrecision
    loss_scaling: bool


def rank_precision(precisions: Sequence[str], rank: int) -> RankPrecision:
    """``rank``'s engine precision in a job whose ranks compute in ``precisions`` (rank order):
    its own autocast dtype; gathered parameters in that dtype when every rank shares it, else
    fp32 ([Note: precision per rank]); fp32 reduce-scatter; loss scaling if any rank is fp16."""
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not 0 <= rank < len(precisions):
        raise ValueError(f"precisions {list(precisions)} / rank {rank}: need one of "
                         f"{list(PRECISIONS)} per rank and 0 <= rank < {len(precisions)}")
    mine = DTYPES[precisions[rank]]
    uniform = len(set(precisions)) == 1
    return RankPrecision(EnginePrecision(mine, mine if uniform else None, None),
                         "fp16" in precisions)


def device_precisions(device: torch.device) -> tuple[str, ...]:
    """Precisions ``device`` runs, fastest first (``capability_precisions``; any on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return capability_precisions(torch.cuda.get_device_capability(device))
    return capability_precisions(None)


def resolve_rank_precisions(value: str | Sequence[str], world_size: int,
                            devices: Sequence[str],
                            capabilities: Sequence[tuple[int, int] | None]) -> list[str]:
    """``--cephalo_precision`` resolved to one precision per rank, checked against the devices.

    value: ``"auto"`` or a per-rank list (``parse_rank_precisions``). devices / capabilities:
        per rank its device name and CUDA capability (None for the CPU) — the same on every
        rank (e.g. from the plan or one all-gather of device facts), so every rank raises alike.
    auto: each device's fastest precision (``auto_precision``: fp32 on the CPU).
    Raises ValueError: a list of the wrong length or an unknown name; a rank whose device lacks
        its precision (naming the rank and device) — before the engine's first collective.
    """
    if len(devices) != world_size or len(capabilities) != world_size:
        raise ValueError(f"{len(devices)} device names / {len(capabilities)} capabilities for "
                         f"world size {world_size}: give one per rank")
    names = parse_rank_precisions(value, world_size)
    if names is None:
        names = [auto_precision(c) for c in capabilities]
    check_rank_precisions(names, devices, [capability_precisions(c) for c in capabilities])
    return names


def check_scalable_optimizer(optimizer: torch.optim.Optimizer, precisions: Sequence[str],
                             devices: Sequence[str]) -> None:
    """Refuse an optimizer the job's loss scaler cannot drive when a rank computes in fp16.

    ``GradScaler`` unscales the gradients of ``optimizer.param_groups`` and steps without a
    closure; an optimizer without param groups, or one that needs a closure (``LBFGS``: the
    scaler raises "Closure use is not currently supported"), cannot be unscaled.
    Raises ValueError naming the fp16 ranks and their devices (no collective).
    """
    if "fp16" not in precisions:
        return
    fp16 = ", ".join(f"rank {i} ({d})" for i, (p, d) in enumerate(zip(precisions, devices))
                     if p == "fp16")
    why = None
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        why = "it has no param_groups to unscale"
    elif isinstance(optimizer, torch.optim.LBFGS):
        why = "its step needs a closure, which GradScaler does not support"
    if why is not None:
        raise ValueError(f"{fp16} compute in fp16, which needs the job's loss scaler, but the "
                         f"optimizer {type(optimizer).__name__} cannot be unscaled ({why}): use "
                         "a torch.optim optimizer such as AdamW, or give those ranks bf16 / fp32")
