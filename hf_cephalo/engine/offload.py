"""Boundary-activation stash (CPU: kept in place; CUDA: async offload to pinned memory) and the
CUDA side streams of the engine (docs/engine.md, "Schedule (per step)", **CUDA**).

``ActivationStash`` keeps or offloads each microbatch's boundary tensors and decides where the
host waits; ``CudaStreams`` holds the side streams. The invariants are the Notes below.
"""

# [Note: CUDA streams]
# Three streams: compute (current), all-gather and offload. A tensor allocated on one stream and
# used on another is ``record_stream``-ed on the other before its last reference goes (pinned
# host copies excepted: the caching host allocator records their copy's event itself), so no
# block is handed out again while another stream may still use it. Every cross-stream read waits
# on an event recorded after its producer: the all-gather stream waits for the compute stream
# before each collective, the compute stream waits on the collective's event before reading its
# output; offload copies wait for the compute stream, and a reload is waited on only when read
# (``get`` / ``pop``). Collectives run with ``async_op=False`` on the all-gather stream and the
# compute stream's own collectives come after it waited for every side-stream event, so each
# rank's GPU runs its collectives in the one order every rank issues them. On CPU none of this
# exists. Each stream's duties, the live tensor and why: docs/engine.md, "CUDA streams".

# [Note: host waits for the compute stream]
# The host runs ahead of the GPU. Blocks used on one stream only are reused in stream order
# however far ahead it runs; blocks also used on another stream (``record_stream``) return to the
# pool only once the event recorded at their free completed, so they pile up with the host's
# lead. The host therefore waits once per unit (``one_unit_in_flight``: gathered units stay at
# two, current + prefetched, plus the root, as the planner counts them), and with activation
# offload once per microbatch instead (``one_microbatch_in_flight``: one microbatch in flight,
# paper §3.3, which also bounds the queue at unit boundaries). The schedule calls both; the
# stash decides which block. Every wait is counted in ``CollectiveStats.host_syncs``; CPU: no
# streams, no waits. Which blocks are which, and the sync counts: docs/engine.md, "Host waits
# for the compute stream".

from __future__ import annotations

from typing import NamedTuple

import torch

from . import collectives as C


class _Stashed(NamedTuple):
    tensor: torch.Tensor           # CPU pinned copy (offloaded) or the original tensor
    event: object | None           # CUDA event recorded after the copy was issued
    device: torch.device | None    # where to reload it; None = kept in place


class ActivationStash:
    """Per-(stage, microbatch) store of boundary tensors (activations and boundary gradients).

    ``start_offload(key, t)`` / ``wait_offload(key)`` is the named async pair: on CUDA with
    ``offload=True`` the tensor is copied to pinned CPU memory on the offload stream; ``pop`` /
    ``get`` return it on the original device; ``start_reload`` prefetches it there ahead of use.
    """

    def __init__(self, offload: bool, streams: "CudaStreams | None", stats=None):
        self.offload = bool(offload and streams is not None)
        self.streams = streams
        self.stats = stats
        self._store: dict[tuple, _Stashed] = {}
        self._reloads: dict[tuple, tuple[torch.Tensor, object]] = {}  # key -> (GPU copy, event)
        self._device_bytes = self._host_bytes = 0
        self._live: tuple[tuple, torch.Tensor] | None = None  # see [Note: CUDA streams]

    def _account(self, item: _Stashed, sign: int) -> None:
        nbytes = sign * item.tensor.numel() * item.tensor.element_size()
        if item.device is None:
            self._device_bytes += nbytes
        else:
            self._host_bytes += nbytes
        if self.stats is not None and sign > 0:
            self.stats.peak_stash_device_bytes = max(self.stats.peak_stash_device_bytes,
                                                     self._device_bytes)
            self.stats.peak_stash_host_bytes = max(self.stats.peak_stash_host_bytes,
                                                   self._host_bytes)

    def _set_live(self, live: tuple[tuple, torch.Tensor] | None) -> None:
        """Replace the live device copy (None: drop it), keeping the device-bytes account."""
        for entry, sign in ((self._live, -1), (live, +1)):
            if entry is not None:
                self._account(_Stashed(entry[1], None, None), sign)
        self._live = live

    def _is_live(self, key: tuple) -> bool:
        return self._live is not None and self._live[0] == key

    def _put(self, key: tuple, item: _Stashed) -> None:
        self._set_live(None)
        self._reloads.pop(key, None)  # a prefetch of the value this one replaces is stale
        self._store[key] = item
        self._account(item, +1)

    def start_offload(self, key: tuple, t: torch.Tensor, keep: bool = False) -> None:
        """Stash ``t`` under ``key``; ``keep=True`` keeps it on its device (the schedule reads
        it next, so a copy out and straight back would only cost bandwidth)."""
        t = t.detach()
        if keep or not self._offloadable(t):
            self._put(key, _Stashed(t, None, None))
            return
        cpu, event = self._copy_out(t)
        self._put(key, _Stashed(cpu, event, t.device))
        self._set_live((key, t))

    def _offloadable(self, t: torch.Tensor) -> bool:
        return self.offload and t.device.type == "cuda"

    def _copy_out(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        """(pinned host copy, event after the copy) issued on the offload stream."""
        stream = self.streams.offload_stream
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            cpu = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            cpu.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        t.record_stream(stream)
        return cpu, event

    def wait_offload(self, key: tuple) -> None:
        """Block the host until ``key``'s copy out finished (no-op when kept in place or live)."""
        item = self._store.get(key)
        if item is not None and item.event is not None and not self._is_live(key):
            item.event.synchronize()

    def start_reload(self, key: tuple) -> None:
        """Prefetch: start copying an offloaded tensor back to its device (no-op when the tensor
        was kept in place, is still live on the device, is unknown, or is already being
        reloaded)."""
        item = self._store.get(key)
        if item is not None and item.device is not None and key not in self._reloads \
                and not self._is_live(key):
            self._reloads[key] = self._issue_reload(item)

    def pop(self, key: tuple) -> torch.Tensor:
        item = self._store.pop(key)
        self._account(item, -1)
        out = self._load(key, item)
        if self._is_live(key):
            self._set_live(None)
        return out

    def get(self, key: tuple) -> torch.Tensor:
        return self._load(key, self._store[key])

    def _issue_reload(self, item: _Stashed) -> tuple[torch.Tensor, object]:
        # Same stream as the copy out: ordered after it without a host wait.
        with torch.cuda.stream(self.streams.offload_stream):
            gpu = item.tensor.to(item.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.streams.offload_stream)
        return gpu, done

    def _load(self, key: tuple, item: _Stashed) -> torch.Tensor:
        if item.device is None:
            return item.tensor
        if self._is_live(key):
            self._reloads.pop(key, None)
            return self._live[1]  # produced on the compute stream: no wait
        gpu, done = self._reloads.pop(key, None) or self._issue_reload(item)
        self._wait_reload(gpu, done, item.device)
        return gpu

    def _wait_reload(self, gpu: torch.Tensor, done, device: torch.device) -> None:
        """The compute stream waits for the copy back; the copy is recorded on it."""
        compute = torch.cuda.current_stream(device)
        compute.wait_event(done)
        gpu.record_stream(compute)

    def one_microbatch_in_flight(self, device: torch.device) -> None:
        """Before a microbatch: on CUDA with offload, wait until the compute stream finished
        the previous one; otherwise nothing. See [Note: host waits for the compute stream]."""
        if self.offload and self._is_cuda(device):
            self._host_wait(device)

    def one_unit_in_flight(self, device: torch.device) -> None:
        """Before a unit (its wait and its successor's prefetch): on CUDA without offload, wait
        until the compute stream finished the previous unit; with offload the per-microbatch
        wait already bounds the queue. See [Note: host waits for the compute stream]."""
        if not self.offload and self._is_cuda(device):
            self._host_wait(device)

    @staticmethod
    def _is_cuda(device: torch.device) -> bool:
        return device.type == "cuda"

    def _host_wait(self, device: torch.device) -> None:
        host_wait(device, self.stats)

    def clear(self) -> None:
        self._store.clear()
        self._reloads.clear()
        self._live = None

    def __len__(self) -> int:
        return len(self._store)


def host_wait(device: torch.device, stats=None) -> None:
    """Block the host until ``device``'s compute (current) stream finished everything queued
    on it (CUDA only), counted in ``stats.host_syncs``. See [Note: host waits for the compute
    stream]."""
    if stats is not None:
        stats.host_syncs += 1
    torch.cuda.current_stream(device).synchronize()


class CudaStreams:
    """The engine's CUDA side streams; see [Note: CUDA streams]."""

    def __init__(self, device: torch.device):
        self.device = device
        self.all_gather_stream = torch.cuda.Stream(device, priority=-1)  # high priority
        self.offload_stream = torch.cuda.Stream(device)

    def all_gather(self, unit, part) -> C.AllGatherResult:
        """The all-gather of one part of ``unit`` (``flat_param.UnitPart``) on the all-gather
        stream (the same ``all_gather_shards`` as on CPU); the output is allocated there."""
        compute = torch.cuda.current_stream(self.device)
        send = part.local  # last written on the compute stream (optimizer step, load)
        self.all_gather_stream.wait_stream(compute)
        with torch.cuda.stream(self.all_gather_stream):
            # a low param_dtype's cast copy is made and used on this stream only
            result = C.all_gather_shards(unit.send_buffer(part), part.numel_per_rank, unit.rank,
                                         unit.group, unit.stats, async_op=False)
            event = torch.cuda.Event()
            event.record(self.all_gather_stream)
        send.record_stream(self.all_gather_stream)
        return C.AllGatherResult(result.output, _EventWork(event))

    def wait_all_gather(self, result: C.AllGatherResult) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(result.work.event)
        result.output.record_stream(compute)

    def reduce_scatter(self, unit, grad: torch.Tensor) -> C.ReduceScatterResult:
        """The unit's reduce-scatter of ``grad`` (Nt,) (produced on the compute stream) on the
        all-gather stream (the same ``reduce_scatter_shards`` as on CPU)."""
        compute = torch.cuda.current_stream(self.device)
        self.all_gather_stream.wait_stream(compute)
        with torch.cuda.stream(self.all_gather_stream):
            result = C.reduce_scatter_shards(grad, unit.trainable_per_rank, unit.rank,
                                             unit.group, unit.stats, async_op=False,
                                             use_all_reduce=unit.use_all_reduce)
            event = torch.cuda.Event()
            event.record(self.all_gather_stream)
        grad.record_stream(self.all_gather_stream)
        return C.ReduceScatterResult(result.output, _EventWork(event), result.full)

    def wait_reduce_scatter(self, result: C.ReduceScatterResult) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(result.work.event)
        result.output.record_stream(compute)


class _EventWork:
    """A completed-on-stream collective: ``event`` marks its end on the side stream."""

    def __init__(self, event):
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()
