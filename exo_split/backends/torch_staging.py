"""The torch prefill's path from the device KV cache to `on_layer`: on CUDA through a fixed
ring of pinned host buffers, on the CPU through the same code with plain copies or views.

    compute thread (the forward)         stager thread (inline on the CPU)     sender
    ----------------------------         ---------------------------------     ------
    layer l writes its K/V into a        job = jobs.get()                       frames from
    preallocated buffer (fixed address   per token range of <= one slot:        the piece,
    for the request), then the hook:       slot = ring.acquire()  <- waits for  then
      ev = event on the compute stream                               the net   kv.release()
      wait for the event of the piece      side stream waits for ev, copies
        run_ahead back (the device)          K/V[l][:, s:e] into the slot
      jobs.put(l, s, n, ev)                on_layer(LayerKV(..., computed_at=t(ev),
                                                             release=frees the slot))

- Pinned bytes are the ring's, allocated once per node (cudaHostAlloc synchronizes the device:
  never inside a forward) and reused by every layer and request.
- The compute thread waits for the device only (to stay `run_ahead` pieces ahead of it, which
  bounds how much queued device work a cancellation leaves), never for the network: a full ring
  stalls the stager thread, and the KV it has not copied yet stays in the device cache.
- `computed_at` comes from the event recorded on the compute stream right after the layer
  wrote its K/V, mapped to host time through one synchronized reference event per request.
- A slot comes back when the consumer calls `release()`, or, failing that, when the last view
  of the piece's memory is gone (a piece dropped on an error path must not shrink the ring).

The CPU ops stamp with the host clock and stage either by copying into the ring (what the tests
run, to exercise the ring as a GPU does) or as zero-copy views of the cache with an unbounded
ring, run inline on the compute thread (the default: the cache already holds the bytes).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from exo_split.backends.base import Cancelled, OnLayer
from exo_split.kv import LayerKV, storage_dtype

log = logging.getLogger(__name__)
clock = time.perf_counter

MiB = 2**20
DEFAULT_STAGING_BYTES = 64 * MiB
DEFAULT_STAGING_SLOTS = 4
DEFAULT_RUN_AHEAD = 2  # pieces of device work the compute thread may queue ahead
DEFAULT_SLOT_TIMEOUT_S = 600.0  # backstop: a consumer that holds every slot and never lets go


# ---- the ring --------------------------------------------------------------------------------


class StagingRing:
    """`n_slots` host buffers of `slot_bytes` each, allocated once and shared by every request of
    a node. `slots=None`: no buffers and no bound (zero-copy pieces need no staging memory); the
    ring then only counts the pieces in flight."""

    def __init__(self, n_slots: int | None, slot_bytes: int, alloc: Callable[[int], Any] | None):
        if n_slots is not None and (n_slots < 1 or slot_bytes < 1):
            raise ValueError(f"a staging ring needs >= 1 slot of >= 1 byte, got {n_slots} x {slot_bytes}")  # fmt: skip
        self.n_slots, self.slot_bytes = n_slots, slot_bytes
        count = n_slots or 0
        self.slots = [alloc(slot_bytes) if alloc else None for _ in range(count)]
        self.allocations = count if alloc else 0  # never grows after this: the tests check it
        self.host_bytes = count * slot_bytes if alloc else 0
        self._free = collections.deque(range(count))  # FIFO: every slot takes its turn
        self._cv = threading.Condition()
        self.in_use = 0
        self.in_use_max = 0
        self.acquired = 0

    @property
    def bounded(self) -> bool:
        return self.n_slots is not None

    def acquire(self, stop: Callable[[], bool], timeout: float) -> int | None:
        """A free slot's index (None for an unbounded ring); waits while every slot is in use."""
        deadline = clock() + timeout
        with self._cv:
            while self.bounded and not self._free:
                if stop():
                    raise Cancelled("cancelled while waiting for a staging slot")
                if clock() > deadline:
                    raise Cancelled(
                        f"no staging slot came back for {timeout:g} s: the consumer holds all "
                        f"{self.n_slots} (it must call kv.release() or drop the piece)"
                    )
                self._cv.wait(0.05)
            slot = self._free.popleft() if self.bounded else None
            self.acquired += 1
            self.in_use += 1
            self.in_use_max = max(self.in_use_max, self.in_use)
            return slot

    def release(self, slot: int | None) -> None:
        with self._cv:
            if slot is not None:
                self._free.append(slot)
            self.in_use -= 1
            self._cv.notify()


class _Lease:
    """One piece's hold on a ring slot: freed by `release()` (the sender, once the bytes are on
    the wire) or when every array viewing the piece's memory is gone, whichever comes first."""

    def __init__(self, ring: StagingRing, slot: int | None, owners: list[np.ndarray]):
        self._ring, self._slot = ring, slot
        self._lock = threading.RLock()  # a finalizer may run inside, on this thread
        self._alive = len(owners)
        self._freed = False
        self._finalizers = [weakref.finalize(o, self._owner_gone) for o in owners]

    def _owner_gone(self) -> None:
        with self._lock:
            self._alive -= 1
            last = self._alive == 0
        if last and self._free():
            log.debug("staging slot %s came back without release(): piece dropped", self._slot)

    def release(self) -> None:
        self._free()

    def _free(self) -> bool:
        with self._lock:
            if self._freed:
                return False
            self._freed = True
        for f in self._finalizers:
            f.detach()
        self._ring.release(self._slot)
        return True


# ---- device operations: the only place the CPU and CUDA differ ----------------------------------


class _HostClock:
    """CPU work is done when the call returns: an event is the host time it was recorded."""

    def record(self) -> float:
        return clock()

    def wait(self, event: float) -> None:
        pass

    def seconds(self, event: float) -> float:
        return event


class CpuOps:
    """Stamps from the host clock; staging by copying into the slot (`copy=True`: the ring
    exercised as on a GPU) or as zero-copy views of the cache (`copy=False`)."""

    def __init__(self, *, copy: bool = False):
        self.copy = copy

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def begin(self) -> _HostClock:
        return _HostClock()

    def drain(self) -> None:
        pass

    def adopt(self, buffer: torch.Tensor) -> None:
        pass

    def stage(self, slot, k: torch.Tensor, v: torch.Tensor, after, dtype: str):
        """K and V ([H, n, D] views of the cache) as host arrays in `dtype`'s storage type:
        (owners, k, v), where every array of the piece views one of the owners."""
        if not self.copy:
            k_root, v_root = _host_view(k), _host_view(v)
            sd = storage_dtype(dtype)
            return [k_root, v_root], k_root.view(sd), v_root.view(sd)
        dst = _slot_views(slot, k, v)
        for d, src in zip(dst, (k, v), strict=True):
            d.copy_(src)
        return _piece_arrays(slot, k, v, dtype)


class _CudaClock:
    """Timing events on the compute stream, mapped to host time through one reference event
    recorded and synchronized when the request began."""

    def __init__(self, device: torch.device):
        self.device = device
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record(torch.cuda.current_stream(device))
        self.ref.synchronize()
        self.ref_host = clock()

    def record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))  # the calling (compute) thread's stream
        return ev

    def wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()  # the device, never the network; releases the GIL

    def seconds(self, event: torch.cuda.Event) -> float:
        """Host time of a completed event."""
        return self.ref_host + self.ref.elapsed_time(event) / 1e3


class CudaOps:
    """Pinned slots, one side stream for the device-to-host copies, timing events for stamps."""

    copy = True

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device=device)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def begin(self) -> _CudaClock:
        return _CudaClock(self.device)

    def drain(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def adopt(self, buffer: torch.Tensor) -> None:
        # The side stream reads the cache: the allocator must not hand its memory to another
        # tensor before those reads are done, whenever the cache is freed.
        buffer.record_stream(self.side)

    def stage(self, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, after, dtype: str):
        dst = _slot_views(slot, k, v)
        with torch.cuda.stream(self.side):
            self.side.wait_event(after)  # the compute stream has written this KV
            for d, src in zip(dst, (k, v), strict=True):
                for h in range(src.shape[0]):  # each head's rows are contiguous: plain DMA
                    d[h].copy_(src[h], non_blocking=True)
            done = self.side.record_event()
        done.synchronize()  # the stager waits for its own copy; nobody else does
        return _piece_arrays(slot, k, v, dtype)


def _host_view(t: torch.Tensor) -> np.ndarray:
    """A host tensor as a numpy array over the same memory (bfloat16 as int16 words)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _slot_views(slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """K's place at the slot's start, V's right after it (a latent layer's V is narrower)."""
    n, m = k.numel() * k.element_size(), v.numel() * v.element_size()
    return [slot[:n].view(k.dtype).view(k.shape), slot[n : n + m].view(v.dtype).view(v.shape)]


def _piece_arrays(slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: str):
    """(owners, k, v) over the first |k| + |v| bytes of a slot: K then V, the wire's order."""
    n, m = k.numel() * k.element_size(), v.numel() * v.element_size()
    root = slot[: n + m].numpy()  # a new array per piece: the lease watches it
    sd = storage_dtype(dtype)
    return (
        [root],
        root[:n].view(sd).reshape(tuple(k.shape)),
        root[n:].view(sd).reshape(tuple(v.shape)),
    )


# ---- the stager ------------------------------------------------------------------------------


@dataclass
class _Job:
    layer: int
    start: int
    n: int
    event: Any  # on the compute stream, after this KV was written
    keys: torch.Tensor  # the layer's buffers when the job was made (a later growth copies them)
    values: torch.Tensor
    computed_at: float | None  # None: the event's time
    base: int = 0  # the position the buffers' first row holds (vLLM's gathered pieces)


class Stager:
    """One request's pieces: jobs from the compute thread (or `stream_kv`) -> ring slots ->
    `on_layer`. With a bounded ring the staging runs on its own thread, so that only that
    thread ever waits for a slot; with an unbounded one it runs inline."""

    def __init__(self, ring: StagingRing, ops, clock, on_layer: OnLayer, dtype: str, *,
                 piece_tokens: int | None, should_stop: Callable[[], bool] | None,
                 slot_timeout: float = DEFAULT_SLOT_TIMEOUT_S):  # fmt: skip
        self.ring, self.ops, self.clock, self.on_layer = ring, ops, clock, on_layer
        self.dtype = dtype
        self.piece_tokens = piece_tokens
        self.should_stop = should_stop
        self.slot_timeout = slot_timeout
        self.error: BaseException | None = None
        self.pieces = 0
        self._aborted = False
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        if ring.bounded:
            self._thread = threading.Thread(target=self._run, name="kv-stager", daemon=True)
            self._thread.start()

    def put_ready(self, piece) -> None:
        """A piece already on the host (a recurrent layer's state): to `on_layer` in its turn,
        after the jobs put before it."""
        if self.error is not None:
            raise self.error
        if self._thread is not None:
            self._jobs.put(piece)
        else:
            self.on_layer(piece)

    def put(self, layer: int, start: int, n: int, event, buffers, computed_at=None,
            base: int = 0) -> None:  # fmt: skip
        if self.error is not None:
            raise self.error
        job = _Job(layer, start, n, event, *buffers, computed_at, base)
        if self._thread is not None:
            self._jobs.put(job)
        else:
            self._stage(job)

    @property
    def threaded(self) -> bool:
        """Whether pieces are staged on a thread of their own (a bounded ring)."""
        return self._thread is not None

    def finish(self) -> None:
        """No more jobs; returns once every piece was handed to on_layer (re-raises its error)."""
        self._close()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop staging (the request failed or was cancelled); pieces already handed on stay
        with their consumer."""
        self._aborted = True
        self._close()

    def _close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()

    def _stopped(self) -> bool:
        return self._aborted or (self.should_stop is not None and self.should_stop())

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self.error is not None or self._aborted:
                continue  # drain to the end marker
            try:
                if isinstance(job, _Job):
                    self._stage(job)
                else:
                    self.on_layer(job)
            except BaseException as exc:  # re-raised on the compute thread
                self.error = exc

    def _stage(self, job: _Job) -> None:
        step = self.piece_tokens or job.n
        for s in range(job.start, job.start + job.n, step):
            e = min(s + step, job.start + job.n)
            if self._stopped():
                raise Cancelled(f"prefill cancelled while staging layer {job.layer}")
            slot = self.ring.acquire(self._stopped, self.slot_timeout)
            try:
                buf = self.ring.slots[slot] if slot is not None else None
                a, b = s - job.base, e - job.base
                owners, k, v = self.ops.stage(
                    buf, job.keys[0, :, a:b], job.values[0, :, a:b], job.event, self.dtype
                )
            except BaseException:
                self.ring.release(slot)
                raise
            lease = _Lease(self.ring, slot, owners)
            at = job.computed_at if job.computed_at is not None else self.clock.seconds(job.event)
            kv = LayerKV(job.layer, s, k, v, self.dtype, at, lease.release)
            del owners, k, v, lease  # the piece alone holds the slot's memory now
            self.pieces += 1
            self.on_layer(kv)
            del kv  # not held here while waiting for the next slot
