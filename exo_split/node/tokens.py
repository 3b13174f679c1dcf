"""The decode loop, run on the compute thread in slices (`decode_events`), delivered to the
event loop in batches of tokens.

One job for as long as nothing else needs the compute thread, not one thread hop per token: waking the event loop costs
more than a Metal decode step's margin. The job stamps each token as it is produced (the
report's ITL is the decode's, not the client's) and puts it into a `TokenPipe`, which wakes
the event loop only when no wake-up is already pending: a consumer that keeps up gets one
token per batch, a slow one (a client reading slowly) gets everything produced meanwhile
in one batch, and the decode never waits for it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor

from exo_split.node.prefill import wait_through_cancel

clock = time.perf_counter
Batch = list[tuple[int, float]]  # (token id, time.perf_counter() when it was produced)


class TokenPipe:
    """Tokens from the compute thread to one asyncio consumer, batched."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: Batch = []
        self._wake = asyncio.Event()
        self._wake_pending = False
        self._closed = False
        self._error: BaseException | None = None

    def put(self, token: int, at: float) -> None:
        """From the producing thread."""
        with self._lock:
            self._items.append((token, at))
            if self._wake_pending:
                return
            self._wake_pending = True
        self._loop.call_soon_threadsafe(self._wake.set)

    def close(self, error: BaseException | None = None) -> None:
        """From the producing thread, last: no more tokens (or the error that ended them)."""
        with self._lock:
            self._closed, self._error = True, error
            self._wake_pending = True
        self._loop.call_soon_threadsafe(self._wake.set)

    async def batches(self) -> AsyncIterator[Batch]:
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._lock:
                items, self._items = self._items, []
                self._wake_pending = False
                closed, error = self._closed, self._error
            if items:
                yield items
            if closed:
                if error is not None:
                    raise error
                return


async def decode_events(
    executor: Executor, steps: Callable[[Callable[[], bool]], Iterator[int]]
) -> AsyncIterator[Batch]:
    """Run `steps(should_stop)` (a Backend.decode generator) on `executor` and yield its
    tokens in batches. Leaving early (the consumer stops iterating, or is cancelled) makes
    should_stop() true, and this returns only once the generator has ended: the compute
    thread has let go of the cache, and the in-flight step has finished writing into it.

    The generator runs in slices: one job for as long as the compute thread has nothing
    else queued, and after each token as soon as it has (another request's KV landing, its
    prefill, its own decode slice), the job ends and the next slice goes to the back of the
    queue. So a request that arrives while others decode gets the compute thread within one
    step of each of them, instead of after they finish; while nothing else waits a decode
    is one job, with no thread hop per token."""
    loop = asyncio.get_running_loop()
    pipe = TokenPipe(loop)
    stop = threading.Event()
    gen: list[Iterator[int]] = []

    def run_slice() -> bool:
        """True once the generator is done (or failed)."""
        try:
            if not gen:
                gen.append(iter(steps(stop.is_set)))
            for token in gen[0]:
                pipe.put(token, clock())
                if others_waiting(executor) and not stop.is_set():
                    return False  # give the thread up; the generator waits, suspended
        except BaseException as exc:  # handed to the consumer, raised there
            pipe.close(exc)
        else:
            pipe.close()
        gen.clear()
        return True

    async def drive() -> None:
        try:
            while not await loop.run_in_executor(executor, run_slice):
                pass
        except BaseException as exc:  # the executor refused a slice (it is shutting down)
            pipe.close(exc)
            raise

    done = asyncio.ensure_future(drive())
    try:
        async for batch in pipe.batches():
            yield batch
    finally:
        stop.set()
        await wait_through_cancel(done)


def others_waiting(executor: Executor) -> bool:
    """Whether jobs wait for the compute thread (a one-worker ThreadPoolExecutor's queue:
    the submitted jobs that have not started)."""
    queue = getattr(executor, "_work_queue", None)
    return queue is not None and not queue.empty()


class BatchDriver:
    """Runs a backend's decode batch (backends/mlx_batch.py's Batcher) on the compute thread
    for as long as it has rows, as slices like `decode_events`': one job while nothing else
    waits for the thread, and after any step as soon as something does. Each request is a
    row: `rows(make_row)` joins it and yields its tokens in batches."""

    def __init__(self, executor: Executor, batcher):
        self.executor, self.batcher = executor, batcher
        self._task: asyncio.Future | None = None

    async def rows(self, row, kept: list) -> AsyncIterator[Batch]:
        """Join `row` (Batcher.row's, its own should_stop optional) and yield its tokens.
        Leaving early (the consumer stops iterating, or is cancelled) makes should_stop()
        true, and this returns only once the row has left the batch (its KV no longer
        written). The row's KV, when it asked to keep it, is appended to `kept` as it
        leaves."""
        loop = asyncio.get_running_loop()
        pipe = TokenPipe(loop)
        stop = threading.Event()
        left = asyncio.Event()

        def on_done(cache, error) -> None:  # on the compute thread
            kept.append(cache)
            pipe.close(error)
            loop.call_soon_threadsafe(left.set)

        own = row.should_stop
        row.should_stop = stop.is_set if own is None else lambda: stop.is_set() or own()
        row.on_token, row.on_done = (lambda token: pipe.put(token, clock())), on_done
        self.batcher.join(row)
        del row
        self._drive(loop)
        try:
            async for batch in pipe.batches():
                yield batch
        finally:
            stop.set()
            await wait_through_cancel(asyncio.ensure_future(left.wait()))

    def _drive(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run(loop))

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        batcher = self.batcher
        try:
            while batcher.busy:
                await loop.run_in_executor(self.executor, batcher.run,
                                           lambda: others_waiting(self.executor))  # fmt: skip
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the executor refused a slice (it is shutting down)
            batcher.fail(exc)
            raise
