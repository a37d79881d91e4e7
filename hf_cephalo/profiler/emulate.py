"""Emulated heterogeneity: make identical devices behave like slower or smaller ones.

EMULATION for one-machine development and CI, not a model of any real GPU; one value per rank
(``cephalo_emulate_slowdown``, ``cephalo_emulate_memory_cap_bytes``, or ``EmulationConfig``).
Compute slowdown s_i >= 1 (``EmulatedStagedModel``): each call and backward is timed, then the
rank sleeps (s_i - 1) x elapsed; collectives keep their real speed, and as a ``StagedModel`` the
wrapper goes through the real profile -> plan -> train path. Memory capacity C_i
(``apply_memory_cap``, ``check_plan_memory``): the allocator's limit on CUDA; on CPU the plan's
need is checked against C_i (``EmulatedOutOfMemoryError``). Details: docs/profiling.md,
"Emulated heterogeneity".
"""

# [Note: slowdown of the backward pass]
# The engine calls ``torch.autograd.backward(y, grad)`` itself, outside the adapter, so the
# wrapper cannot time it with a call boundary. When ``run_unit``/``head_loss`` runs with grad
# enabled on an input that requires grad, the wrapper registers two tensor hooks: one on the
# output (fires first in backward: start time) and one on the input (fires when the input's
# gradient is complete, i.e. after the unit's backward: end time, then sleep). Hooks are
# removed after they fire, so stashed tensors carry nothing into later microbatches.

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from hf_cephalo.models.base import (HeadEvalOutput, HeadOutput, Microbatch, StagedModel,
                                    WrappedStagedModel)
from hf_cephalo.units import GIB

__all__ = ["EmulationConfig", "EmulatedStagedModel", "EmulatedOutOfMemoryError", "ComputeTimer",
           "SlowdownSchedule", "apply_memory_cap", "check_plan_memory", "emulated_device_name",
           "find_emulated"]


class EmulatedOutOfMemoryError(ValueError):
    """A plan needs more memory than a rank's emulated capacity (CPU accounting method)."""


SCHEDULE_FLAG = "--cephalo_emulate_slowdown_schedule (env HF_CEPHALO_EMULATE_SLOWDOWN_SCHEDULE)"


@dataclass(frozen=True)
class SlowdownSchedule:
    """Per-rank slowdown factors that change at given training steps (emulated drift).

    Text form ``"STEP:F0,F1,...;STEP:..."``: from global step STEP (0-based, the step about to
    run; the first entry is step 0) rank i runs ``F_i`` times slower, e.g. ``"0:1,1;10:1,3"``:
    both ranks at their own speed, from step 10 rank 1 three times slower.

    Attributes:
        steps: the steps at which factors change, strictly increasing, the first 0.
        factors: per entry, one factor per rank (finite, >= 1).
    """

    steps: tuple[int, ...]
    factors: tuple[tuple[float, ...], ...]

    @classmethod
    def parse(cls, text: str) -> "SlowdownSchedule":
        """Parse the text form. Raises ValueError naming the flag, the entry and the fix: a
        malformed entry, steps not strictly increasing or not starting at 0, a factor that is
        not a finite number >= 1, or entries of different rank counts."""
        where = f"slowdown schedule {text!r} ({SCHEDULE_FLAG})"
        steps, factors = [], []
        for entry in [e.strip() for e in str(text).split(";") if e.strip()]:
            head, sep, tail = entry.partition(":")
            try:
                step = int(head)
                values = tuple(float(x) for x in tail.replace(",", " ").split())
            except ValueError:
                step, values = -1, ()
            if not sep or step < 0 or not values:
                raise ValueError(f"{where}: entry {entry!r} is not STEP:F0,F1,... (a step >= 0, "
                                 "then one factor per rank), e.g. '0:1,1;10:1,3'")
            if not all(math.isfinite(v) and v >= 1.0 for v in values):
                raise ValueError(f"{where}: entry {entry!r} has a factor that is not a finite "
                                 "number >= 1 (factors <= 0 are meaningless, and a device cannot "
                                 "be emulated faster than it is)")
            steps.append(step)
            factors.append(values)
        if not steps:
            raise ValueError(f"{where}: empty; give e.g. '0:1,1;10:1,3'")
        if steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"{where}: steps {steps} must start at 0 and be strictly increasing")
        if len({len(f) for f in factors}) != 1:
            raise ValueError(f"{where}: entries give {[len(f) for f in factors]} factors; give "
                             "one factor per rank in every entry")
        return cls(tuple(steps), tuple(factors))

    @property
    def world_size(self) -> int:
        return len(self.factors[0])

    def factors_at(self, step: int) -> tuple[float, ...]:
        """The per-rank factors in force at global step ``step`` (0-based)."""
        current = self.factors[0]
        for at, values in zip(self.steps, self.factors):
            if at <= step:
                current = values
        return current

    def check_world_size(self, world_size: int) -> None:
        """ValueError (before any collective) when the schedule is for another world size."""
        if self.world_size != world_size:
            raise ValueError(f"slowdown schedule ({SCHEDULE_FLAG}) gives {self.world_size} "
                             f"factors per entry but the world size is {world_size}: give one "
                             "factor per rank")


@dataclass(kw_only=True)
class EmulationConfig:
    """Per-rank emulation settings (rank order); ``None`` leaves that knob off.

    Attributes:
        slowdown: compute slowdown factor per rank (dimensionless, finite, >= 1); with a
            ``schedule``, its step-0 factors (what the profile at start measures).
        memory_cap_bytes: emulated device memory capacity per rank, bytes (> 0).
        schedule: factors that change during training (``SlowdownSchedule``), or None.
    """

    slowdown: list[float] | None = None
    memory_cap_bytes: list[int] | None = None
    schedule: SlowdownSchedule | None = None

    def __post_init__(self) -> None:
        if self.schedule is not None:
            if self.slowdown is not None:
                raise ValueError("give either a slowdown (--cephalo_emulate_slowdown) or a "
                                 f"slowdown schedule ({SCHEDULE_FLAG}), not both")
            self.slowdown = list(self.schedule.factors[0])
        if self.slowdown is not None:
            self.slowdown = [float(s) for s in self.slowdown]
            if not self.slowdown or not all(math.isfinite(s) and s >= 1.0 for s in self.slowdown):
                raise ValueError(f"emulated slowdown {self.slowdown}: need one finite factor >= 1 "
                                 "per rank (a device cannot be emulated faster than it is)")
        if self.memory_cap_bytes is not None:
            self.memory_cap_bytes = [int(c) for c in self.memory_cap_bytes]
            if not self.memory_cap_bytes or min(self.memory_cap_bytes) < 1:
                raise ValueError(f"emulated memory_cap_bytes {self.memory_cap_bytes}: need one "
                                 "capacity >= 1 byte per rank")

    @classmethod
    def from_settings(cls, settings: Any) -> "EmulationConfig | None":
        """From the ``emulate_*`` settings (``runtime.settings.CephaloSettings``); None when
        none is set."""
        slow = settings.emulate_slowdown
        cap = settings.emulate_memory_cap_bytes
        text = settings.emulate_slowdown_schedule
        if slow is None and cap is None and text is None:
            return None
        return cls(slowdown=slow, memory_cap_bytes=cap,
                   schedule=None if text is None else SlowdownSchedule.parse(text))

    def check_world_size(self, world_size: int) -> None:
        if self.schedule is not None:
            self.schedule.check_world_size(world_size)
        for name in ("slowdown", "memory_cap_bytes"):
            values = getattr(self, name)
            if values is not None and len(values) != world_size:
                raise ValueError(f"emulated {name} has {len(values)} entries {values} but the "
                                 f"world size is {world_size}: give one value per rank")

    def slowdown_of(self, rank: int) -> float:
        return 1.0 if self.slowdown is None else self.slowdown[rank]

    def cap_of(self, rank: int) -> int | None:
        return None if self.memory_cap_bytes is None else self.memory_cap_bytes[rank]


def emulated_device_name(base_name: str, slowdown: float = 1.0,
                         cap_bytes: int | None = None) -> str:
    """Device name recorded in profiles for an emulated device, e.g. ``"cpu [emulated 3x]"``.

    The name differs from the real device's, so cached and given profiles of the real device
    are never mistaken for the emulated one (and the other way round).
    """
    parts = []
    if slowdown != 1.0:
        parts.append(f"{slowdown:g}x slower")
    if cap_bytes is not None:
        parts.append(f"cap {cap_bytes / GIB:.3g} GiB")
    return f"{base_name} [emulated {', '.join(parts)}]" if parts else base_name


@dataclass
class ComputeTimer:
    """Seconds of compute seen by an ``EmulatedStagedModel`` (including the emulated waits).

    Attributes:
        compute_s: total seconds in embed/run_unit/head calls and unit/head backward passes.
        unit_s: of which seconds in units (``run_unit`` calls and unit backward passes).
        sleep_s: of which seconds spent waiting for the emulated slowdown.
        calls: number of timed spans.
    """

    compute_s: float = 0.0
    unit_s: float = 0.0
    sleep_s: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.compute_s, self.unit_s, self.sleep_s, self.calls = 0.0, 0.0, 0.0, 0


class EmulatedStagedModel(WrappedStagedModel):
    """A ``StagedModel`` that delegates to ``inner`` and stretches its compute by ``slowdown``.

    Args:
        inner: the real adapter (shares its model; no copy).
        slowdown: factor >= 1; 1 only times the calls (``timer``) without waiting.
        device: the compute device; CUDA calls synchronize it around each timed call.

    See the module docstring and [Note: slowdown of the backward pass].
    """

    def __init__(self, inner: StagedModel, slowdown: float = 1.0,
                 device: torch.device | str | None = None):
        if not isinstance(inner, StagedModel):
            raise TypeError(f"EmulatedStagedModel wraps a StagedModel, got {type(inner).__name__}")
        if not (math.isfinite(slowdown) and slowdown >= 1.0):
            raise ValueError(f"slowdown = {slowdown!r}: need a finite factor >= 1")
        super().__init__(inner)
        self.slowdown = float(slowdown)
        self.device = torch.device(device) if device is not None else None
        self.timer = ComputeTimer()

    # ---- timing ---------------------------------------------------------------------------
    def _sync(self) -> None:
        # The compute stream only: a device-wide sync would also wait for the engine's
        # in-flight all-gathers / offload copies and stretch them as if they were compute.
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _stretch(self, elapsed_s: float, unit: bool) -> None:
        """Wait (slowdown - 1) × elapsed and account the whole span."""
        wait_s = (self.slowdown - 1.0) * max(elapsed_s, 0.0)
        if wait_s > 0:
            time.sleep(wait_s)
        self.timer.compute_s += elapsed_s + wait_s
        if unit:
            self.timer.unit_s += elapsed_s + wait_s
        self.timer.sleep_s += wait_s
        self.timer.calls += 1

    def _timed(self, fn, *args, unit: bool = False):
        self._sync()
        t0 = time.perf_counter()
        out = fn(*args)
        self._sync()
        self._stretch(time.perf_counter() - t0, unit)
        return out

    def _slow_backward(self, inp: torch.Tensor, out: torch.Tensor, unit: bool) -> None:
        """Stretch the backward from ``out`` to ``inp``.

        See [Note: slowdown of the backward pass].
        """
        if not (torch.is_grad_enabled() and isinstance(inp, torch.Tensor) and inp.requires_grad
                and out.requires_grad):
            return
        start: list[float] = []
        handles: list = []

        def on_out(grad):
            self._sync()
            start.append(time.perf_counter())
            handles[0].remove()
            return None

        def on_in(grad):
            self._sync()
            if start:
                self._stretch(time.perf_counter() - start[0], unit)
            handles[1].remove()
            return None

        handles.append(out.register_hook(on_out))
        handles.append(inp.register_hook(on_in))

    # ---- computation ----------------------------------------------------------------------
    def embed(self, microbatch: Microbatch):
        return self._timed(self.inner.embed, microbatch)

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        out = self._timed(self.inner.run_unit, index, hidden, ctx, unit=True)
        self._slow_backward(hidden, out, unit=True)
        return out

    def head_loss(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> HeadOutput:
        out = self._timed(self.inner.head_loss, hidden, microbatch, ctx)
        self._slow_backward(hidden, out.loss_sum, unit=False)
        return out

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        return self._timed(self.inner.head_logits, hidden, microbatch, ctx)

    def head_loss_and_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                             ctx: Any) -> HeadEvalOutput:
        return self._timed(self.inner.head_loss_and_logits, hidden, microbatch, ctx)


def find_emulated(staged: StagedModel) -> "EmulatedStagedModel | None":
    """The ``EmulatedStagedModel`` in a chain of wrappers (``.inner``), or None."""
    while staged is not None:
        if isinstance(staged, EmulatedStagedModel):
            return staged
        staged = getattr(staged, "inner", None)
    return None


def apply_memory_cap(cap_bytes: int, device: torch.device | str) -> str:
    """Limit this process to ``cap_bytes`` of device memory where the device allows it.

    CUDA: ``torch.cuda.set_per_process_memory_fraction(cap / total)``; exceeding it raises the
    allocator's out-of-memory error. CPU: nothing to set (the accounting check of
    ``check_plan_memory`` applies). Returns a one-line description of what was done.

    Raises:
        ValueError: ``cap_bytes`` < 1 or larger than the CUDA device's total memory.
    """
    device = torch.device(device)
    if cap_bytes < 1:
        raise ValueError(f"emulated memory cap {cap_bytes} bytes: need >= 1")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if cap_bytes > total:
            raise ValueError(f"emulated memory cap {cap_bytes / GIB:.2f} GiB exceeds the real "
                             f"{total / GIB:.2f} GiB of {device}; emulate a smaller device")
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, device)
        return f"CUDA allocator limited to {cap_bytes / GIB:.2f} GiB of {total / GIB:.2f} GiB"
    return (f"{device.type}: no allocator limit; plans are checked against "
            f"{cap_bytes / GIB:.3f} GiB by accounting (training state + profiled compute memory)")


def check_plan_memory(need_bytes: Sequence[float], cap_bytes: Sequence[float | None]) -> None:
    """Raise ``EmulatedOutOfMemoryError`` if any rank's need exceeds its emulated capacity.

    Args:
        need_bytes: per rank, r_i · S + M_i(m_i) in bytes (``planner.predict``'s memory_bytes).
        cap_bytes: per rank, emulated capacity C_i in bytes, or None (not emulated).

    Every rank evaluates the same lists, so every rank raises the same error (no hang).
    """
    over = [(rank, need, cap) for rank, (need, cap) in enumerate(zip(need_bytes, cap_bytes))
            if cap is not None and need > cap]
    if over:
        detail = "; ".join(f"rank {r} needs {n / GIB:.3f} GiB ({n:.0f} bytes) but its emulated cap "
                           f"is {c / GIB:.3f} GiB ({c:.0f} bytes)" for r, n, c in over)
        raise EmulatedOutOfMemoryError(
            f"emulated out of memory: {detail}. Give these ranks a smaller batch or state share "
            "(re-plan, e.g. drop cephalo_plan_file so the trainer plans for the caps) or raise "
            "cephalo_emulate_memory_cap_bytes")
