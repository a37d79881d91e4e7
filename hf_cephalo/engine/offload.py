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
* Host waits: see [Note: host waits for the compute stream]; the schedule calls
  ``one_microbatch_in_flight`` before every microbatch and ``one_unit_in_flight`` before every
  unit, and the stash decides which of them block the host.
On CPU none of this exists: collectives are waited on directly and the stash keeps tensors.

[Note: host waits for the compute stream]
The host runs ahead of the GPU: it queues kernels and allocations long before the compute
stream executes them. Whether that costs memory depends on the streams a block is used on:
* A block allocated and freed on ONE stream is reused by the caching allocator for the next
  allocation on that stream at once, without waiting: stream order already puts every kernel
  of the new owner after every kernel of the old one. So tensors that live on the compute
  stream only (a unit's activations and recompute, the autograd gradients, the unit's flat
  gradient, boundary tensors a non-offloading stash keeps in place) take the same blocks
  however far ahead the host runs: no host wait protects anything there.
* A block used on another stream (``record_stream``) goes back to the pool only when the event
  recorded at its free has completed on that stream; the allocator checks at allocation time.
  If the host runs ahead, those events are still pending and every new allocation takes a
  fresh block, so such blocks accumulate with the host's lead. Two kinds exist:
  - per UNIT: the gathered buffers (all-gather output, read on the compute stream) and the
    reduce-scatter input/output. Without a wait the host would issue the all-gathers of many
    units before the GPU finished the first, holding them all. The host therefore waits once
    per unit (``one_unit_in_flight``, before the unit's wait and its successor's prefetch), so
    the block of the unit resharded before is free again: gathered units stay at two
    (current + prefetched) plus the root, as the planner counts them.
  - per MICROBATCH, only with activation offload: the source of each copy out (recorded on the
    offload stream), each reloaded copy (allocated on the offload stream, recorded on the
    compute stream) and the pinned host copies (the caching host allocator reuses a block only
    after the copy's event). Here the host waits before every microbatch
    (``one_microbatch_in_flight``: one microbatch in flight, the paper's fragmentation fix,
    §3.3), which also bounds the queue at unit boundaries, so the per-unit wait is skipped.
Without offload the compute stream is therefore synchronized about 2 x L times per step
instead of about (2 L + 3) x l; with offload as before. Every wait is counted in
``CollectiveStats.host_syncs``. CPU: no streams, no waits.
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
