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
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from exo_split.backends.base import Backend, Cancelled
from exo_split.kv import DTYPES, LayerKV
from exo_split.sampling import Sampling, sample
from exo_split.transport import wire

log = logging.getLogger(__name__)

Write = Callable[[Any], Awaitable[None]]
clock = time.perf_counter
_DONE = object()


@dataclass(frozen=True)
class PrefillRequest:
    """The body of POST /v1/prefill."""

    request_id: str
    token_ids: tuple[int, ...]
    sampling: Sampling = field(default_factory=Sampling)
    spec: dict | None = None  # the decode side's ModelSpec.to_dict()
    fingerprint: str = ""
    overlap: bool = True
    chunk: int | None = None
    dtype: str | None = None  # the KV dtype the decode side wants on the wire

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "token_ids": list(self.token_ids),
            "sampling": self.sampling.to_dict(),
            "spec": self.spec,
            "fingerprint": self.fingerprint,
            "start_pos": 0,
            "overlap": self.overlap,
            "chunk": self.chunk,
            "dtype": self.dtype,
        }

    @classmethod
    def from_json(cls, body: Any, *, max_tokens: int) -> PrefillRequest:
        """Validate a request body; ValueError says what is wrong."""
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids:
            raise ValueError("token_ids must be a non-empty list of integers")
        if len(ids) > max_tokens:
            raise ValueError(f"{len(ids)} prompt tokens exceed this node's limit of {max_tokens}")
        if not all(isinstance(t, int) and 0 <= t < 2**31 for t in ids):
            raise ValueError("token_ids must be non-negative integers")
        if body.get("start_pos", 0) != 0:
            raise ValueError("start_pos other than 0 (prefix reuse) is not supported")
        chunk = body.get("chunk")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        spec = body.get("spec")
        if spec is not None and not isinstance(spec, dict):
            raise ValueError("spec must be an object")
        dtype = body.get("dtype")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return cls(
            dtype=dtype,
            request_id=str(body.get("request_id", ""))[:64],
            token_ids=tuple(ids),
            sampling=Sampling.from_dict(body.get("sampling")),
            spec=spec,
            fingerprint=str(body.get("fingerprint", "")),
            overlap=bool(body.get("overlap", True)),
            chunk=chunk,
        )


async def write_frame(write: Write, parts: list) -> None:
    for part in parts:
        await write(part)


async def stream_prefill(
    backend: Backend,
    executor: Executor,
    req: PrefillRequest,
    write: Write,
    *,
    hello: dict,
    queue_depth: int = 4,
    put_timeout: float = 120.0,
    cancel: threading.Event | None = None,
) -> dict:
    """Run the prefill and write HELLO, LAYER..., TOKEN, END through `write`.

    Returns the END record. If `write` fails (the client went away) the prefill is cancelled
    at the next layer or chunk and the error re-raised.
    """
    loop = asyncio.get_running_loop()
    cancel = cancel or threading.Event()
    queue: asyncio.Queue = asyncio.Queue(maxsize=queue_depth)
    held: list[tuple[LayerKV, float]] = []

    def put(item) -> None:  # compute thread
        if req.overlap or item is _DONE:
            asyncio.run_coroutine_threadsafe(queue.put(item), loop).result(put_timeout)
        else:
            held.append(item)

    def work():  # compute thread
        try:
            t0 = clock()
            done = backend.prefill(
                req.token_ids,
                chunk=req.chunk,
                on_layer=lambda kv: put((kv.astype(dtype.name), clock())),
                should_stop=cancel.is_set,
            )
            t1 = clock()
            for item in held:
                asyncio.run_coroutine_threadsafe(queue.put(item), loop).result(put_timeout)
            done.cache = None  # the prefill side keeps no KV once it is on the wire
            return t0, t1, sample(done.logits, req.sampling, 0)
        finally:
            put(_DONE)

    dtype = wire.WireDtype.from_name(req.dtype or backend.dtype)
    hello = {**hello, "dtype": dtype.name, "prefill_replied": clock()}
    await write_frame(write, wire.encode_hello(hello))
    job = loop.run_in_executor(executor, work)
    pieces: list[dict] = []
    try:
        while (item := await queue.get()) is not _DONE:
            kv, done_at = item
            k, v = kv.buffers()
            await write_frame(
                write, wire.encode_layer(kv.layer, kv.token_start, kv.n_tokens, dtype, k, v)
            )
            pieces.append(
                {
                    "layer": kv.layer,
                    "token_start": kv.token_start,
                    "n_tokens": kv.n_tokens,
                    "nbytes": kv.nbytes,
                    "compute_done": done_at,
                    "sent": clock(),
                }
            )
    except BaseException:
        cancel.set()
        await _drain(queue)
        await asyncio.gather(job, return_exceptions=True)
        raise
    t0, t1, (token, logprob) = await job
    await write_frame(write, wire.encode_token(token, logprob))
    end = {"prefill_start": t0, "prefill_end": t1, "pieces": pieces, "overlap": req.overlap}
    await write_frame(write, wire.encode_end(end))
    return end


async def _drain(queue: asyncio.Queue) -> None:
    """Unblock the compute thread after a failed send: take pieces until it finishes."""
    while True:
        try:
            item = await asyncio.wait_for(queue.get(), timeout=30)
        except (TimeoutError, asyncio.TimeoutError):
            return
        if item is _DONE:
            return


def error_frame(exc: BaseException) -> list:
    code = "cancelled" if isinstance(exc, Cancelled) else type(exc).__name__
    return wire.encode_error(code, str(exc) or code)
