"""The loader's per-step collectives: a small all-gather of integers, and failing on every rank.

``StepExchange`` runs in the main process of every rank of ``group`` (DataLoader workers have no
process group), once or twice per step in the same order on every rank, including a rank
without rows in that step ([Note: the global width] in ``global_width.py``).

[Note: a rank that fails while loading]
A rank whose read, measurement or collation raises does not leave its peers waiting in the next
exchange: it joins that exchange with a failure status, and when any status is set every rank
learns the failing ranks' messages (one ``all_gather_object``) and raises the same ValueError
(``"<what> failed on rank R: <Type>: <message>"``; the failing rank's own exception is its
cause), before any collective of the training step, so the launcher prints it once
(``hf_cephalo.rank_errors``). A rank that dies or hangs outright is not covered: its peers
wait in the exchange until the process group's timeout, as in any collective.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["StepExchange", "LoaderStepError"]


class LoaderStepError(ValueError):
    """A step's data failed on some rank; raised on every rank with the same message."""


class StepExchange:
    """All-gather of one int64 vector per rank per step over ``group`` (None: the default
    group; one process without a process group gathers from itself).

    Args:
        group: the process group of the ranks that split the global batch.
        device: where the gathered tensors live; None: the current CUDA device when the group's
            backend is NCCL only (NCCL takes device tensors), else the CPU (gloo). A CUDA
            exchange runs on a side stream, so it waits for no compute already queued.
    """

    def __init__(self, group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        if device is None:
            backend = str(dist.get_backend(group)) if self.distributed else "gloo"
            device = "cpu" if "gloo" in backend or not torch.cuda.is_available() \
                else torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def gather(self, vector: Sequence[int]) -> list[list[int]]:
        """Every rank's ``vector`` (all the same length), in rank order."""
        if self.world_size == 1:
            return [list(map(int, vector))]
        if self._stream is None:
            return self._gather(vector)
        with torch.cuda.stream(self._stream):
            return self._gather(vector)

    def _gather(self, vector: Sequence[int]) -> list[list[int]]:
        mine = torch.tensor(list(vector), dtype=torch.int64, device=self.device)  # 1D
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return torch.stack(out).cpu().tolist()  # (world, len)

    def fail_together(self, statuses: Sequence[int], error: BaseException | None,
                      what: str) -> None:
        """Raise ``LoaderStepError`` on every rank when any of ``statuses`` (one per rank, as
        gathered) is non-zero ([Note: a rank that fails while loading]); ``error``: this
        rank's own failure (None if it has none). Collective only when some rank failed."""
        if not any(statuses):
            return
        mine = None if error is None else f"{type(error).__name__}: {error}"
        messages = [mine]
        if self.world_size > 1:
            messages = [None] * self.world_size
            dist.all_gather_object(messages, mine, group=self.group)
        rank, message = next(((r, m) for r, m in enumerate(messages) if m is not None),
                             (None, "no message"))
        raise LoaderStepError(f"{what} failed on rank {rank}: {message}") from error

    def agree(self, error: BaseException | None, what: str) -> None:
        """Collective: raise on every rank if ``error`` is set on any (one status all-gather)."""
        statuses = [row[0] for row in self.gather([0 if error is None else 1])]
        self.fail_together(statuses, error, what)
