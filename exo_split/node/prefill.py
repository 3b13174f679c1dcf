"""The prefill side of a split: compute the prompt's KV and put each layer on the wire as soon
as it exists, while later layers are still computing.

The pipeline: the backend's prefill runs on the node's compute thread; its per-layer callback
puts each piece into a bounded asyncio queue (blocking the compute thread when the sender falls
behind, so host memory stays bounded); the sender coroutine writes LAYER frames from the
pieces' memory. With `overlap=False` every piece is held until the whole prefill is done (the
baseline that shows what overlap buys). Knows bytes and a backend, not HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from exo_split.backends.base import Backend, Cancelled
from exo_split.kv import LayerKV
from exo_split.sampling import sample
from exo_split.transport import wire
from exo_split.transport.messages import PrefillRequest

log = logging.getLogger(__name__)

Write = Callable[[Any], Awaitable[None]]
clock = time.perf_counter
_DONE = object()


async def write_frame(write: Write, parts: list) -> None:
    for part in parts:
        await write(part)


@dataclass
class Progress:
    """One prefill's progress and its stop signal.

    The compute thread polls `cancelled` between layers (and while it waits for the sender).
    `cancel()` remembers how many pieces existed when the stop was asked for, so /v1/info can
    show (and a test can check) that the prefill stopped within one layer or chunk.
    """

    total: int = 0  # pieces this prefill produces: layers x chunks
    computed: int = 0
    sent: int = 0
    at_cancel: int | None = None  # `computed` when cancel() was called
    cancelled_at: float | None = None
    stopped_at: float | None = None  # when the compute thread let go of the request
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


async def stream_prefill(
    backend: Backend,
    executor: Executor,
    req: PrefillRequest,
    write: Write,
    *,
    hello: dict,
    queue_depth: int = 4,
    put_timeout: float = 60.0,
    progress: Progress | None = None,
    die_after_layer: int | None = None,
) -> dict:
    """Run the prefill and write HELLO, LAYER..., TOKEN, END through `write`.

    Returns the END record. If `write` fails or this coroutine is cancelled (the client went
    away), the compute thread stops at the next layer or chunk, and this returns only once it
    has let go of the request's KV; then the error is re-raised. `put_timeout`: the longest
    the compute thread waits for the sender to take a piece (a receiver that stopped
    reading). `die_after_layer` is a test hook (docs/reliability.md): SIGKILL this process
    once that layer's first piece is on the wire.
    """
    loop = asyncio.get_running_loop()
    progress = progress or Progress()
    step = req.chunk or len(req.token_ids)
    progress.total = backend.spec.n_layers * -(-len(req.token_ids) // step)
    queue: asyncio.Queue = asyncio.Queue()  # unbounded; `slots` bounds the pieces in it
    slots = threading.Semaphore(queue_depth)
    held: list[tuple[LayerKV, float]] = []

    def hand_over(item) -> None:  # compute thread
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def put(item) -> None:  # compute thread: block while the sender is behind
        deadline = clock() + put_timeout
        while not slots.acquire(timeout=0.05):
            if progress.cancelled:
                raise Cancelled("prefill cancelled while waiting for the sender")
            if clock() > deadline:
                raise Cancelled(f"the receiver took nothing for {put_timeout:g} s")
        hand_over(item)

    def on_layer(kv: LayerKV) -> None:  # compute thread
        progress.computed += 1
        item = (kv.astype(dtype.name), clock())
        if req.overlap:
            put(item)
        else:
            held.append(item)

    def work():  # compute thread
        try:
            t0 = clock()
            done = backend.prefill(
                req.token_ids,
                chunk=req.chunk,
                on_layer=on_layer,
                should_stop=lambda: progress.cancelled,
            )
            t1 = clock()
            done.cache = None  # the prefill side keeps no KV once it is on the wire
            while held:
                put(held.pop(0))
            return t0, t1, sample(done.logits, req.sampling, 0)
        finally:
            held.clear()
            progress.stopped_at = clock()
            hand_over(_DONE)

    dtype = wire.WireDtype.from_name(req.dtype or backend.dtype)
    hello = {**hello, "dtype": dtype.name, "prefill_replied": clock()}
    await write_frame(write, wire.encode_hello(hello))
    computing = executor.submit(work)
    job = asyncio.wrap_future(computing)
    pieces: list[dict] = []
    try:
        while (item := await queue.get()) is not _DONE:
            kv, done_at = item
            k, v = kv.buffers()
            frame = wire.encode_layer(kv.layer, kv.token_start, kv.n_tokens, dtype, k, v)
            send_start = clock()  # first byte handed over; `sent` is the last
            await write_frame(write, frame)
            pieces.append(
                {
                    "layer": kv.layer,
                    "token_start": kv.token_start,
                    "n_tokens": kv.n_tokens,
                    "nbytes": kv.nbytes,
                    "compute_done": done_at,
                    "send_start": send_start,
                    "sent": clock(),
                }
            )
            del item, kv, k, v, frame  # the piece's memory goes before the next one comes
            slots.release()
            progress.sent += 1
            if die_after_layer is not None and pieces[-1]["layer"] == die_after_layer:
                await _die(die_after_layer)
    except BaseException:
        progress.cancel()
        if computing.cancel():  # it had not started: it never will
            progress.stopped_at = clock()
        else:  # running: it stops at the next layer or chunk
            await wait_through_cancel(job)
            if not job.cancelled():
                forget_frames(job.exception())
        raise
    t0, t1, (token, logprob) = await job
    await write_frame(write, wire.encode_token(token, logprob))
    end = {"prefill_start": t0, "prefill_end": t1, "pieces": pieces, "overlap": req.overlap}
    await write_frame(write, wire.encode_end(end))
    return end


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


async def _die(layer: int) -> None:
    """The EXO_SPLIT_TEST_DIE_AFTER_LAYER hook: a prefill node killed mid-stream."""
    log.warning("test hook: SIGKILL after layer %d", layer)
    await asyncio.sleep(0.2)  # let the kernel take the frame already written
    os.kill(os.getpid(), signal.SIGKILL)


def error_frame(exc: BaseException) -> list:
    code = "cancelled" if isinstance(exc, Cancelled) else type(exc).__name__
    return wire.encode_error(code, str(exc) or code)
