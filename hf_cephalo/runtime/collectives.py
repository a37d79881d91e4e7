"""The collectives a door needs beside the engine's: agreeing a flag and gathering rows.

Both run on the session's process group (``Session.any_rank`` / ``Session.gather_rows``), so no
door calls ``torch.distributed`` itself. On NCCL the tensors travel on the job's device, on
gloo on the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["any_rank", "gather_rows"]


def _device(group, device: torch.device | str) -> torch.device:
    return torch.device(device) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def any_rank(flag: bool, group, device: torch.device | str) -> bool:
    """Whether ``flag`` is true on some rank of ``group`` (one int32 all-reduce MAX; no
    collective in a world of one). Every rank must call it."""
    if dist.get_world_size(group) == 1:
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.int32, device=_device(group, device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def gather_rows(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows of ``tensor`` concatenated in rank order along dim 0 (a 0-d tensor is
    one row), on ``tensor``'s device; ranks may hold different numbers of rows, 0 included.

    Two all-gathers (shapes, then the tensor padded to the largest). Raises ValueError when
    ranks holding rows disagree on the other dimensions."""
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
    local = tensor.to(_device(group, tensor.device))
    shape = torch.tensor(list(local.shape), dtype=torch.int64, device=local.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    shapes = [[int(n) for n in s.tolist()] for s in shapes]
    if len({tuple(s[1:]) for s in shapes if s[0] > 0}) > 1:
        raise ValueError(f"gather: the ranks' tensors have shapes {shapes}; beyond the rows "
                         "they must agree (pad them with accelerator.pad_across_processes)")
    biggest = [max(s[d] for s in shapes) for d in range(len(shapes[0]))]
    padded = local.new_zeros(biggest)
    padded[tuple(slice(0, n) for n in local.shape)] = local
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    rows = [o[tuple(slice(0, n) for n in s)] for o, s in zip(out, shapes) if s[0] > 0]
    return (torch.cat(rows) if rows else local[:0]).to(tensor.device)
