"""The prefill side of a split: compute the prompt's KV and put each layer on the wire as soon
as it exists, while later layers are still computing.

The pipeline: the backend's prefill runs on the node's compute thread; its per-layer callback
(any thread: the compute thread on CPU, a stager on CUDA) hands each piece to `_Frames`,
which cuts it into the Plan's LAYER frames (views of the piece, no copies) for the
FrameSender's CRC and send threads. Host memory stays bounded in bytes: the backend's pieces
are views of its cache (no memory of their own) or slots of its fixed staging ring (CUDA,
released once their frames are sent); a piece converted to another wire dtype is a copy of
ours, and those wait in the callback while `InFlight` bytes exceed the budget. With
`overlap=False` the KV goes out after the whole prefill (`stream_kv`), one layer at a time
(the baseline that shows what overlap buys). Knows bytes and a backend, not HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from exo_split.backends.base import Backend, Cancelled
from exo_split.kv import LayerKV, chunk_sizes, streamed_chunks
from exo_split.layers import recurrent_layers
from exo_split.node.prefix import Checkout, PrefixCache
from exo_split.sampling import sample
from exo_split.transport import wire
from exo_split.transport.datalink import DataConnection, FrameSender
from exo_split.transport.messages import PrefillRequest
from exo_split.transport.server import ClientGone
from exo_split.transport.stamps import end_record

log = logging.getLogger(__name__)
clock = time.perf_counter
DEFAULT_INFLIGHT_BYTES = 64 << 20


@dataclass
class Progress:
    """One prefill's progress and its stop signal.

    The compute thread polls `cancelled` between layers (and while it waits for the wire).
    `cancel()` remembers how many pieces existed when the stop was asked for, so /v1/info can
    show (and a test can check) that the prefill stopped within one layer or chunk.
    """

    total: int = 0  # pieces this prefill computes: layers x chunks
    computed: int = 0
    sent: int = 0
    at_cancel: int | None = None  # `computed` when cancel() was called
    cancelled_at: float | None = None
    stopped_at: float | None = None  # when the compute thread let go of the request
    inflight_peak: int = 0  # the most KV bytes handed to the sender and not yet on the wire
    tokens: int = 0  # prompt positions this prefill computes (not reused from the prefix cache)
    _event: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        if not self._event.is_set():
            self.at_cancel, self.cancelled_at = self.computed, clock()
            self._event.set()

    def summary(self) -> dict:
        stopped = None
        if self.stopped_at is not None and self.cancelled_at is not None:
            stopped = max(0.0, self.stopped_at - self.cancelled_at)
        return {
            "pieces_total": self.total,
            "pieces_computed": self.computed,
            "pieces_sent": self.sent,
            "pieces_at_cancel": self.at_cancel,
            "stopped_after_s": stopped,
        }


class InFlight:
    """Bytes of our own copies (pieces converted to the wire dtype) handed to the sender and
    not yet on the wire, bounded: `acquire` waits while they exceed `limit` (a piece bigger
    than the limit goes when nothing else waits), and raises Cancelled if the prefill is
    cancelled meanwhile."""

    def __init__(self, limit: int, progress: Progress):
        self.limit, self.progress = limit, progress
        self.held = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            while self.held and self.held + nbytes > self.limit:
                if self.progress.cancelled:
                    raise Cancelled("prefill cancelled while waiting for the wire")
                self._cond.wait(0.05)
            self.held += nbytes
            self.progress.inflight_peak = max(self.progress.inflight_peak, self.held)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()


class _Part:
    """A LayerKV handed over by the backend, until the frames that read it are on the wire."""

    def __init__(self, kv: LayerKV, on_free: Callable[[_Part], None]):
        self.kv, self.on_free = kv, on_free
        self.end = kv.token_start + kv.n_tokens
        self.freed = False

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            self.on_free(self)
            if self.kv.release is not None:
                self.kv.release()
            self.kv = None  # type: ignore[assignment]  # the bytes may go now


class _Frames:
    """Cuts the backend's pieces into the Plan's LAYER frames and hands them to the sender.

    Pieces must come in plan order; a (chunk, layer) piece may arrive as several LayerKVs of
    consecutive token ranges (the frames then take byte views from each). A part is freed
    (budget back, `release()` called) once the frame holding its last position is sent."""

    def __init__(self, plan: wire.Plan, dtype: wire.WireDtype, sender: FrameSender,
                 budget: InFlight, progress: Progress, die_after_layer: int | None):  # fmt: skip
        self.plan, self.dtype, self.sender = plan, dtype, sender
        self.budget, self.progress, self.die_after_layer = budget, progress, die_after_layer
        self.stamps = {k: [0.0] * plan.n_pieces for k in wire.END_STAMPS}
        self._pieces = enumerate(plan.pieces())
        self._piece: tuple[int, int, int, int] | None = None  # (index, layer, start, n)
        self._pos = self._frame_start = 0
        self._parts: list[_Part] = []
        self._lock = threading.Lock()

    def add(self, kv: LayerKV, computed_at: float) -> None:
        """One piece (or part of one), on the thread that computed it. What lies before its
        layer's floor (outside a sliding window the receiver keeps) is dropped here."""
        inside = kv.since(self.plan.floor(kv.layer))
        if inside is None:
            if kv.release is not None:
                kv.release()
            return
        kv = inside
        if self._piece is None or self._pos == self._piece[2] + self._piece[3]:
            index, (layer, start, n) = next(self._pieces, (None, (None, 0, 0)))
            if index is None:
                raise RuntimeError(f"the backend produced {_describe(kv)} after the last piece")
            self._piece, self._pos, self._frame_start = (index, layer, start, n), start, start
        index, layer, start, n = self._piece
        if (kv.layer, kv.token_start) != (layer, self._pos) or kv.token_start + kv.n_tokens > (
            start + n
        ):
            raise RuntimeError(f"the backend produced {_describe(kv)} where the plan expects "
                               f"LAYER {layer} tokens [{self._pos}, {start + n})")  # fmt: skip
        wire_kv = kv.astype(self.dtype.name)
        if wire_kv is kv:  # the backend's memory (a view of its cache, or a staging slot)
            self._parts.append(_Part(kv, lambda p: None))
        else:  # a converted copy, ours: bounded by the in-flight budget
            if kv.release is not None:
                kv.release()  # the original's bytes are not needed any more
            kv = dataclasses.replace(wire_kv, release=None)
            self.budget.acquire(kv.nbytes)
            self._parts.append(_Part(kv, lambda p: self.budget.release(p.kv.nbytes)))
        self._pos = kv.token_start + kv.n_tokens
        self.stamps["compute_done"][index] = computed_at
        if n == 0:  # a recurrent layer's state: one frame, its arrays whole
            self._send(index, layer, start, 0, last=True)
        while self._frame_start < self._pos:
            s, m = self._frame_start, min(self.plan.frame_tokens, start + n - self._frame_start)
            if s + m > self._pos:
                break  # the rest of this frame is still to come
            self._send(index, layer, s, m, last=s + m == start + n)
            self._frame_start = s + m

    def _send(self, index: int, layer: int, s: int, m: int, last: bool) -> None:
        parts = [p for p in self._parts if p.end > s and p.kv.token_start < s + m]
        if m == 0:
            parts = [p for p in self._parts if p.kv.n_tokens == 0 and p.kv.layer == layer]
            blocks = list(parts[0].kv.buffers())
        ranges = self.plan.heads if m else ()  # a tensor-parallel plan: a frame per range
        done_with = [p for p in parts if p.end <= s + m]
        self._parts = [p for p in self._parts if p not in done_with]
        assert self._piece is not None
        for g, heads in enumerate(ranges or [None]):
            if m:
                a, count = heads or (0, parts[0].kv.k.shape[0])
                blocks = [
                    _block(getattr(p.kv, which), h, max(s, p.kv.token_start) - p.kv.token_start,
                           min(s + m, p.end) - p.kv.token_start)
                    for which in ("k", "v")
                    for h in range(a, a + count)
                    for p in parts
                ]  # fmt: skip
            final = g == max(0, len(ranges) - 1)  # the piece's last frame frees its parts
            first = s == self._piece[2] and g == 0
            done = self._done(index, layer, first, last and final, done_with if final else [])
            self.sender.put_layer(layer, s, m, self.dtype, blocks, done, heads)

    def _done(self, index: int, layer: int, first: bool, last: bool, done_with: list):
        """The send thread's callback of one frame: its piece's stamps, and the parts it was
        the last reader of freed."""

        def done(send_start: float, sent: float, ok: bool) -> None:
            if first:
                self.stamps["send_start"][index] = send_start
            if last:
                self.stamps["sent"][index] = sent
                if ok:
                    self.progress.sent += 1
            with self._lock:
                for p in done_with:
                    p.free()
            if ok and first and layer == self.die_after_layer:
                _die(layer)

        return done

    def drop(self) -> None:
        """Free what no frame will ever read (the stream ended early). Call after the
        sender has stopped, so no `done` runs concurrently."""
        with self._lock:
            for p in self._parts:
                p.free()
            self._parts = []


def _block(arr: np.ndarray, head: int, a: int, b: int) -> memoryview:
    """Bytes of arr[head, a:b] ([tokens, head_dim] of one head): a view when its rows are
    contiguous, else a copy of this block only."""
    block = arr[head, a:b]
    if not block.flags.c_contiguous:
        block = np.ascontiguousarray(block)
    return memoryview(block).cast("B")


def _describe(kv: LayerKV) -> str:
    return f"LAYER {kv.layer} tokens [{kv.token_start}, {kv.token_start + kv.n_tokens})"


def _from(kv: LayerKV, start: int) -> LayerKV:
    """An exported whole layer from position `start` on."""
    if not start:
        return kv
    return dataclasses.replace(kv, token_start=start, k=kv.k[:, start:], v=kv.v[:, start:])


def prefill_chunks(backend: Backend, n_tokens: int, chunk: int | None) -> tuple[int, ...]:
    """The chunk sizes the backend's prefill emits pieces for (docs/protocol.md, Plan)."""
    own = getattr(backend, "prefill_chunks", None)
    return tuple(own(n_tokens, chunk)) if own is not None else chunk_sizes(n_tokens, chunk)


async def stream_prefill(
    backend: Backend,
    executor: Executor,
    req: PrefillRequest,
    conn: DataConnection,
    *,
    hello: dict,
    timeout: float = 60.0,
    deadline: float = 600.0,
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
    progress: Progress | None = None,
    die_after_layer: int | None = None,
    prefix: PrefixCache | None = None,
) -> dict:
    """Run the prefill and write HELLO, LAYER..., TOKEN, END on the data connection.

    Returns the END record. If the receiver leaves (or reads nothing for `timeout`, or has not
    taken the whole stream `deadline` seconds after it began), the compute thread stops at its
    next layer or chunk, and this raises ClientGone once it has let go of the request's KV.
    The compute thread is free once the forward ends: a torch backend's staging ring goes on
    feeding the wire from its own thread (`background`), awaited here, not there. A failure of the prefill itself goes to the receiver as an
    ERROR frame, then is re-raised. `die_after_layer` is a test hook (docs/reliability.md):
    SIGKILL this process 0.2 s after that layer's first frame is on the wire.
    """
    progress = progress or Progress()
    overdue = clock() + deadline
    n, spec, start = len(req.token_ids), backend.spec, req.start
    dtype = wire.WireDtype.from_name(req.dtype or backend.dtype)
    try:  # before the prefix checkout: a receiver already gone takes nothing with it
        sock = conn.socket(timeout)
    except ConnectionError as exc:
        raise ClientGone(f"the receiver left before the stream began ({exc})") from exc
    # Our own longest cached prefix k: only [k, n) is computed, only [start, n) streamed.
    reuse = prefix if req.prefix_cache else None
    checkout = Checkout("none") if reuse is None else reuse.checkout(req.token_ids, req.scope)
    k = checkout.cached
    progress.tokens = n - k
    compute = prefill_chunks(backend, n - k, req.chunk)
    bytes_per_token = spec.layer_bytes_per_token(dtype.itemsize)
    limit = min(max_frame_bytes, req.max_frame_bytes or max_frame_bytes)
    chunks = streamed_chunks(k, compute, start) if req.overlap else (n - start,)
    frame_tokens = max(1, limit // bytes_per_token)
    ring_limit = getattr(backend, "frame_positions_limit", lambda: None)()
    if ring_limit is not None:  # frames the staging ring can fill (docs/protocol.md)
        frame_tokens = min(frame_tokens, ring_limit)
    # A tensor-parallel engine's workers each hold a range of KV heads: a frame per range.
    heads = getattr(backend, "head_ranges", ())
    plan = wire.Plan(chunks, frame_tokens, spec.n_layers, start, req.keep, recurrent_layers(spec),
                     heads)  # fmt: skip
    progress.total = spec.n_layers * len(compute)
    sender = FrameSender(sock, on_error=lambda exc: progress.cancel())
    conn.on_lost.append(progress.cancel)
    if conn.lost.is_set():  # it left before we listened
        progress.cancel()
    budget = InFlight(inflight_bytes, progress)
    frames = _Frames(plan, dtype, sender, budget, progress, die_after_layer)

    def on_layer(kv: LayerKV) -> None:  # any thread
        progress.computed += 1
        frames.add(kv, kv.computed_at if kv.computed_at is not None else clock())

    def work():  # compute thread
        try:
            t0 = clock()
            cache = reuse.materialize(checkout, capacity=n) if reuse is not None else None
            resume = {"cache": cache, "emit_from": start} if cache is not None or start else {}
            if req.overlap and getattr(backend, "stages_in_background", False):
                resume["background"] = True
            done = backend.prefill(
                req.token_ids,
                chunk=req.chunk,
                on_layer=on_layer if req.overlap else None,
                should_stop=lambda: progress.cancelled,
                **resume,
            )
            cache = resume = None
            t1 = done.computed_at if done.computed_at is not None else clock()
            if not req.overlap:  # the finished cache's KV, layer by layer
                progress.computed = progress.total

                def ship(kv: LayerKV) -> None:
                    frames.add(kv, kv.computed_at if kv.computed_at is not None else t1)

                stream_kv = getattr(backend, "stream_kv", None)
                if stream_kv is not None:
                    since = {"start_pos": start} if start else {}
                    stream_kv(done.cache, ship, should_stop=lambda: progress.cancelled, **since)
                else:
                    for kv in backend.export(done.cache):
                        if progress.cancelled:
                            raise Cancelled("prefill cancelled while sending")
                        ship(_from(kv, start))
            kept[0], done.cache = done.cache if reuse is not None else None, None
            staging[0] = done.staging
            return t0, t1, sample(done.logits, req.sampling, 0)
        finally:
            progress.stopped_at = clock()

    kept: list = [None]  # the finished cache, for the prefix cache once the stream ended
    staging: list = [None]  # pieces the backend still stages after the forward (background)

    async def within(aw, what: str):
        try:
            return await asyncio.wait_for(aw, max(0.0, overdue - clock()))
        except TimeoutError:
            progress.cancel()
            raise _Overdue(f"the receiver had not taken the whole stream {deadline:g} s after "
                           f"it began ({what})") from None  # fmt: skip

    hello = {**hello, "dtype": dtype.name, "plan": plan.to_json(), "prefill_cached_tokens": k,
             "prefill_replied": clock()}  # fmt: skip
    sender.put(wire.encode_hello(hello))
    computing = executor.submit(work)
    job = asyncio.wrap_future(computing)
    ended = False  # END or ERROR is on the wire
    try:
        t0, t1, (token, logprob) = await job
        if staging[0] is not None:  # off the compute thread, which is free for others now
            await within(asyncio.to_thread(staging[0].finish), "staging")
            staging[0] = None
        sender.put(wire.encode_token(token, logprob))
        await within(sender.flush(), "sending")
        end = end_record(t0, t1, req.overlap, frames.stamps)
        sender.put(wire.encode_end(end))
        await within(sender.flush(), "sending")
        ended = True
        if reuse is not None and kept[0] is not None:  # every frame that read it is sent
            reuse.put(req.token_ids, kept[0], req.scope)
        return end
    except BaseException as exc:
        progress.cancel()
        if staging[0] is not None:
            staging[0].abort()
        if computing.cancel():  # it had not started: it never will
            progress.stopped_at = clock()
            if reuse is not None:
                reuse.cancel(checkout)
        else:  # running: it stops at the next layer or chunk
            await wait_through_cancel(job)
            if not job.cancelled():
                forget_frames(job.exception())
        gone = conn.lost.is_set() or sender.error is not None or isinstance(exc, _Overdue)
        if gone:
            why = conn.why or f"the receiver read nothing for {timeout:g} s ({sender.error!r})"
            why = str(exc) if isinstance(exc, _Overdue) else why
            raise ClientGone(why) from exc
        if isinstance(exc, Exception):  # the prefill failed: say so in-band
            sender.put(error_frame(exc))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sender.flush(), timeout)
                ended = True
        raise
    finally:
        sender.close(abort=not ended)
        frames.drop()


class _Overdue(Exception):
    """The whole stream was not on the wire by its deadline."""


async def wait_through_cancel(future: asyncio.Future) -> None:
    """Wait until `future` is done, even if this task is cancelled meanwhile (then re-raise
    the cancellation after): the compute thread must have let go of a request's KV before
    that memory is counted as free. The wait is short: the thread stops at its next layer."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def forget_frames(exc: BaseException | None) -> None:
    """Clear the locals of the finished frames in `exc`'s tracebacks (its cause and context
    too), so a failed request's KV is freed now, not whenever the garbage collector breaks
    the exception <-> traceback <-> frame cycle. Only for exceptions that have left every
    frame they passed through (the current, executing frame is skipped by clear_frames)."""
    pending, seen = [exc], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        pending += [e.__cause__, e.__context__]


def _die(layer: int) -> None:
    """The EXO_SPLIT_TEST_DIE_AFTER_LAYER hook: a prefill node killed mid-stream. Runs on
    the send thread, so nothing more is sent meanwhile."""
    log.warning("test hook: SIGKILL after layer %d", layer)
    time.sleep(0.2)  # let the kernel deliver the frame already written
    os.kill(os.getpid(), signal.SIGKILL)


def error_frame(exc: BaseException) -> list:
    code = "cancelled" if isinstance(exc, Cancelled) else type(exc).__name__
    return wire.encode_error(code, str(exc) or code)
