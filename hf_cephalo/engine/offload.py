"""Boundary-activation stash (CPU: kept in place; CUDA: async offload to pinned memory) and the
CUDA side streams of the engine.

[Note: CUDA streams]
Three streams: the compute (current) stream, an all-gather stream and an offload stream.
* Lifetimes: a tensor allocated on one stream and used on another is ``record_stream``-ed on the
  other before its last reference goes, so the caching allocator hands its block out again only
  after that stream passed the point of the free. This covers the all-gather input (the local
  shard itself, no copy), the reduce-scatter input (the unit's (Nt,) gradient, or zeros, made
  on the compute stream), the collectives' outputs (allocated on the all-gather stream, read on
  the compute stream; the all-gather's own-slice copy of the gloo path runs on the all-gather
  stream too), the offloaded source tensor and the reloaded copy.
* All-gather: the gathered output is allocated on the all-gather stream after it waited for the
  compute stream (the optimizer may have just written the local shard); the compute stream waits
  on an event recorded after the collective before it reads the output.
  Reduce-scatter mirrors this (input produced on compute, collective on the all-gather stream).
* Collectives run with ``async_op=False`` under the all-gather stream: the collective is ordered
  on that stream (NCCL launches it there, or on the process group's own stream joined to it
  both ways), so the event recorded after it marks its end. The all-gather stream waits for the
  compute stream before each collective, and the compute stream's own collectives (item count,
  loss sum) come after it waited for every side-stream event, so each rank's GPU runs its
  collectives in the one order every rank issues them. The stream has high
  priority, like FSDP2's communication streams, so its kernels are not queued behind compute.
* Offload: a boundary activation produced on the compute stream is copied to pinned CPU memory
  on the offload stream after it waited for the compute stream. The pinned copy needs no
  ``record_stream``: a ``non_blocking`` copy to or from pinned memory of the caching host
  allocator records an event on the copying stream, and the block is not reused before that
  event completed, so dropping the CPU copy (``pop``) while its copy back is in flight is safe.
  ``wait_offload`` blocks the host until the copy out finished; the copy back does not need it
  (it is ordered after the copy out on the offload stream).
* Reload: ``start_reload(key)`` prefetches the next microbatch's tensor back to the GPU on the
  offload stream while the current microbatch computes. The compute stream waits on the
  reload's event only when it reads the tensor (``get``/``pop``).
* Live tensor: the most recently offloaded tensor keeps its device copy until the next stash
  write. When the schedule reads exactly that key next (every boundary with one microbatch),
  ``get``/``pop`` return the device copy: no host wait for the copy out, no copy back. The
  device holds at most one such boundary tensor beyond what it would hold after a reload.
* One microbatch in flight: the schedule synchronizes the compute stream after each
  microbatch (``one_microbatch_in_flight``), so the host never queues the next microbatch's
  kernels and allocations while the current one runs. Without this the caching allocator
  holds blocks of several microbatches at once and fragments (the paper's fix, §3.3). It waits
  for the compute stream only: a prefetched all-gather or an offload copy issued before it
  keeps running.
On CPU none of this exists: collectives are waited on directly and the stash keeps tensors.
"""

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
        """On CUDA, wait until the compute stream finished the current microbatch (see
        [Note: CUDA streams]); nothing on CPU, where every op is synchronous."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def clear(self) -> None:
        self._store.clear()
        self._reloads.clear()
        self._live = None

    def __len__(self) -> int:
        return len(self._store)


class CudaStreams:
    """The engine's CUDA side streams; see [Note: CUDA streams]."""

    def __init__(self, device: torch.device):
        self.device = device
        self.all_gather_stream = torch.cuda.Stream(device, priority=-1)  # high priority
        self.offload_stream = torch.cuda.Stream(device)

    def all_gather(self, unit) -> C.AllGatherResult:
        """The unit's all-gather on the all-gather stream (the same ``all_gather_shards`` as on
        CPU); the (N,) output is allocated there."""
        compute = torch.cuda.current_stream(self.device)
        send = unit.local  # last written on the compute stream (optimizer step, load)
        self.all_gather_stream.wait_stream(compute)
        with torch.cuda.stream(self.all_gather_stream):
            result = C.all_gather_shards(send, unit.numel_per_rank, unit.rank, unit.group,
                                         unit.stats, async_op=False)
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
