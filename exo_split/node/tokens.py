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
