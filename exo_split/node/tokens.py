"""The decode loop, run as one job on the compute thread, delivered to the event loop in
batches of tokens.

One job for the whole decode, not one thread hop per token: waking the event loop costs
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
    """Run `steps(should_stop)` (a Backend.decode generator) as one job on `executor` and
    yield its tokens in batches. Leaving early (the consumer stops iterating, or is
    cancelled) makes should_stop() true, and this returns only once the job has: the compute
    thread has let go of the cache, and the in-flight step has finished writing into it."""
    loop = asyncio.get_running_loop()
    pipe = TokenPipe(loop)
    stop = threading.Event()

    def job() -> None:
        try:
            for token in steps(stop.is_set):
                pipe.put(token, clock())
        except BaseException as exc:  # handed to the consumer, raised there
            pipe.close(exc)
        else:
            pipe.close()

    done = asyncio.ensure_future(loop.run_in_executor(executor, job))
    try:
        async for batch in pipe.batches():
            yield batch
    finally:
        stop.set()
        await wait_through_cancel(done)
