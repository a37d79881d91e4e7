"""The hardware a rank profiles on: its device, its host and the machines of the world.

``local_device_name`` (the device name a profile records), ``device_capacity_bytes`` (memory
capacity C_i: the GPU's memory, or the host's RAM divided between the ranks on it),
``local_world_size`` (ranks on this host: ``$LOCAL_WORLD_SIZE``, else by hostname) and
``machine_layout`` (machine per rank, RAM per machine); with them the small helpers the
profiler's modules share: ``sync_device``, ``rank_and_world_size``, ``all_gather_objects``.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Any, Iterator

import torch
import torch.distributed as dist

from hf_cephalo.units import GIB

__all__ = ["local_device_name", "device_capacity_bytes", "local_world_size", "machine_layout",
           "sync_device", "rank_and_world_size", "all_gather_objects", "preserved_rng"]


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_and_world_size(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def all_gather_objects(obj: Any, group, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def machine_layout(group: dist.ProcessGroup | None = None) -> tuple[list[int], list[float]]:
    """(machine index per rank, RAM bytes per machine): ranks with one hostname share a machine.

    One ``all_gather_object`` (a collective on every rank of ``group``) when a process group
    with world size > 1 exists.
    """
    import socket

    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 16 * GIB
    _, world_size = rank_and_world_size(group)
    entries = all_gather_objects((socket.gethostname(), ram), group, world_size)
    hosts = list(dict.fromkeys(h for h, _ in entries))
    rams = {h: r for h, r in entries}
    return [hosts.index(h) for h, _ in entries], [rams[h] for h in hosts]


def local_device_name(device: torch.device | str) -> str:
    """``torch.cuda.get_device_name`` for CUDA, else the device type (e.g. ``"cpu"``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def device_capacity_bytes(device: torch.device | str, local_world_size: int = 1) -> float:
    """Memory capacity C_i of one rank in bytes.

    CUDA: the device's total memory (device properties). CPU: physical RAM divided by
    ``local_world_size``, the number of ranks on this host, which share the RAM (16 GiB if the
    RAM cannot be read). Raises ValueError if ``local_world_size`` < 1.
    """
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) \
            or local_world_size < 1:
        raise ValueError(f"local_world_size = {local_world_size!r}: need an integer >= 1")
    device = torch.device(device)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 16 * GIB
    return ram / local_world_size


def local_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks on this host: ``$LOCAL_WORLD_SIZE`` (set by torchrun / accelerate launch), else
    the number of ranks whose hostname equals this rank's (one ``all_gather_object``, a
    collective on every rank of ``group``); 1 without a process group.

    Raises ValueError for a ``LOCAL_WORLD_SIZE`` that is not a positive integer.
    """
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is not None:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE={env!r}: need a positive integer (the number of "
                             "ranks on this host), or unset it")
        return value
    _, world_size = rank_and_world_size(group)
    if world_size == 1:
        return 1
    import socket

    host = socket.gethostname()
    return sum(h == host for h in all_gather_objects(host, group, world_size))


@contextlib.contextmanager
def preserved_rng(device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the body without moving the caller's random streams: torch's CPU generator (and
    ``device``'s, a CUDA device), Python's ``random`` and NumPy's global state are as they were
    on exit. Measuring runs the units in train mode (dropout) a number of times that depends on
    timing and on the profile cache; without this a seeded run trained differently depending on
    whether it profiled at start."""
    import numpy as np

    device = torch.device(device)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)

