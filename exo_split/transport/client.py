"""HTTP client side of the protocol: node info, the prefill frame stream, the generate stream.

Every wait has a timeout; every failure becomes a named error (PeerUnavailable, AuthError,
IncompatiblePeer, ProtocolError) whose message says which peer and what happened.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from exo_split.errors import AuthError, ExoSplitError, IncompatiblePeer, PeerBusy, PeerUnavailable
from exo_split.transport import wire

FRAMES_CONTENT_TYPE = "application/x-exo-split-frames"


@dataclass(frozen=True)
class Timeouts:
    """Seconds. All finite by default (docs/reliability.md)."""

    connect: float = 5.0
    first_frame: float = 30.0  # request sent -> HELLO
    idle: float = 60.0  # longest gap between two reads of a frame stream (one layer's compute)
    total: float = 600.0  # request sent -> END: a peer trickling bytes cannot stretch it
    busy_wait: float = 0.0  # longest total wait for a busy (503) peer; 0: fall back at once

    def __post_init__(self) -> None:
        for name, value in self.to_dict().items():
            if not 0 <= value < float("inf") or (value == 0 and name != "busy_wait"):
                raise ValueError(f"timeout {name} must be a finite number of seconds > 0")

    def to_dict(self) -> dict:
        return {
            "connect": self.connect,
            "first_frame": self.first_frame,
            "idle": self.idle,
            "total": self.total,
            "busy_wait": self.busy_wait,
        }


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def _raise_for_status(resp: aiohttp.ClientResponse, peer: str) -> None:
    if resp.status == 200:
        return
    try:
        body = await asyncio.wait_for(resp.json(content_type=None), timeout=5)
        message = body.get("message", "") if isinstance(body, dict) else str(body)
    except (aiohttp.ClientError, ValueError, asyncio.TimeoutError):
        message = resp.reason or ""
    if resp.status == 401:
        raise AuthError(
            f"{peer} refused the token (401)",
            hint="both machines need the same token: copy the token file or set EXO_SPLIT_TOKEN",
        )
    if resp.status == 409:
        raise IncompatiblePeer(f"{peer}: {message}")
    if resp.status == 503:
        retry = _retry_after(resp.headers.get("Retry-After"))
        raise PeerBusy(
            f"{peer} is busy (503, retry after {retry:g} s): {message}", retry_after=retry
        )
    if resp.status in (400, 413):  # e.g. a prompt over the peer's limit: we may still run it
        raise PeerUnavailable(f"{peer} rejected the request ({resp.status}): {message}")
    raise PeerUnavailable(f"{peer} answered {resp.status}: {message}")


def _retry_after(value: str | None) -> float:
    """Seconds from a Retry-After header (delay-seconds; a date or junk counts as 1 s)."""
    try:
        return min(max(float(value), 0.0), 60.0)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 1.0


def _client_errors(peer: str, what: str):
    """Map transport exceptions to PeerUnavailable with the peer's name."""

    class _Ctx:
        def __enter__(self):
            return self

        def __exit__(self, et, exc, tb):
            if exc is None or isinstance(exc, ExoSplitError):
                return False
            if isinstance(exc, asyncio.TimeoutError | TimeoutError):
                raise PeerUnavailable(f"{peer}: {what} timed out") from exc
            if isinstance(exc, aiohttp.ClientError | OSError | EOFError):
                raise PeerUnavailable(
                    f"{peer}: {what} failed: {exc or type(exc).__name__}"
                ) from exc
            return False

    return _Ctx()


async def fetch_info(
    session: aiohttp.ClientSession, base_url: str, token: str | None, *, timeout: float = 5.0
) -> dict[str, Any]:
    """GET /v1/info of a node."""
    with _client_errors(base_url, "GET /v1/info"):
        async with session.get(
            f"{base_url}/v1/info",
            headers=auth_headers(token),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            await _raise_for_status(resp, base_url)
            info = await resp.json()
    if not isinstance(info, dict) or "fingerprint" not in info:
        raise PeerUnavailable(f"{base_url} did not answer like an exo-split node")
    return info


async def prefill_frames(
    session: aiohttp.ClientSession,
    base_url: str,
    token: str | None,
    body: dict,
    spec: wire.StreamSpec,
    timeouts: Timeouts,
) -> AsyncIterator[wire.Frame]:
    """POST /v1/prefill and yield each checked frame as it completes.

    Ends after END; raises PeerUnavailable (died, stalled, refused; PeerBusy for a 503),
    ProtocolError (garbage), IncompatiblePeer or AuthError, each within the timeouts: connect,
    first_frame to HELLO, idle between reads, total to END. Closing the generator closes the
    connection, which is how the prefill node learns to stop.
    """
    decoder = wire.FrameDecoder(spec)
    start = asyncio.get_running_loop().time()
    deadline = start + timeouts.total
    timeout = aiohttp.ClientTimeout(
        total=None, connect=timeouts.connect, sock_connect=timeouts.connect
    )
    with _client_errors(base_url, "POST /v1/prefill"):
        resp = await asyncio.wait_for(
            session.post(
                f"{base_url}/v1/prefill", json=body, headers=auth_headers(token), timeout=timeout
            ),
            timeout=timeouts.first_frame,
        )
    try:
        await _raise_for_status(resp, base_url)
        # HELLO is due first_frame after the request went out, headers included
        wait = max(start + timeouts.first_frame - asyncio.get_running_loop().time(), 0.001)
        n_frames = 0
        while not decoder.finished:
            left = deadline - asyncio.get_running_loop().time()
            with _client_errors(base_url, "the KV stream"):
                try:
                    chunk = await asyncio.wait_for(resp.content.readany(), timeout=min(wait, left))
                except (asyncio.TimeoutError, TimeoutError) as exc:
                    if left <= wait:
                        raise PeerUnavailable(
                            f"{base_url} did not finish the prefill within {timeouts.total:g} s "
                            f"(after {n_frames} frames)"
                        ) from exc
                    if n_frames == 0:
                        raise PeerUnavailable(
                            f"{base_url} stalled: no HELLO within {timeouts.first_frame:g} s"
                        ) from exc
                    raise PeerUnavailable(
                        f"{base_url} stalled: no data for {wait:g} s after {n_frames} frames"
                    ) from exc
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as exc:
                    raise PeerUnavailable(
                        f"{base_url} closed the stream: connection lost after {n_frames} frames "
                        f"({type(exc).__name__})"
                    ) from exc
            wait = timeouts.idle
            if not chunk:
                try:
                    decoder.eof()
                except wire.ProtocolError as exc:
                    raise PeerUnavailable(f"{base_url} closed the stream: {exc}") from exc
                return
            try:
                frames = decoder.feed(chunk)
            except wire.ProtocolError as exc:
                raise wire.ProtocolError(f"{base_url}: {exc}") from exc
            for frame in frames:
                n_frames += 1
                if frame.kind is wire.Kind.ERROR:
                    obj = frame.obj or {}
                    raise PeerUnavailable(
                        f"{base_url} failed the prefill: {obj.get('code')}: {obj.get('message')}"
                    )
                yield frame
    finally:
        resp.close()


async def generate_events(
    session: aiohttp.ClientSession,
    base_url: str,
    token: str | None,
    body: dict,
    *,
    timeouts: Timeouts,
) -> AsyncIterator[dict]:
    """POST /v1/generate on the decode node and yield its NDJSON events."""
    timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.connect, sock_read=timeouts.idle)
    with _client_errors(base_url, "POST /v1/generate"):
        async with session.post(
            f"{base_url}/v1/generate", json=body, headers=auth_headers(token), timeout=timeout
        ) as resp:
            await _raise_for_status(resp, base_url)
            pending = b""
            while chunk := await resp.content.readany():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _event(line, base_url)
            if pending.strip():
                yield _event(pending, base_url)


async def run_generate(
    url: str,
    token: str | None,
    body: dict,
    *,
    on_event: Callable[[dict], None],
    t0: float | None = None,
    timeouts: Timeouts | None = None,
) -> tuple[dict, float | None]:
    """One request to a decode node, followed to its end: every event goes to `on_event`.

    Returns (the `done` event, seconds from `t0` to the first token event); an `error` event
    or a stream that ends without `done` raises ExoSplitError."""
    t0 = time.perf_counter() if t0 is None else t0
    ttft = None
    async with aiohttp.ClientSession() as session:
        events = generate_events(session, url, token, body, timeouts=timeouts or Timeouts())
        async for event in events:
            kind = event.get("type")
            if kind == "token" and ttft is None:
                ttft = time.perf_counter() - t0
            if kind == "error":
                raise ExoSplitError(
                    f"the decode node failed the request: {event.get('message')}",
                    hint=event.get("hint"),
                )
            on_event(event)
            if kind == "done":
                return event, ttft
    raise ExoSplitError(f"{url} closed the stream before the request was done")


def _event(line: bytes, peer: str) -> dict:
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise PeerUnavailable(f"{peer} sent a malformed event: {exc}") from exc
    if not isinstance(event, dict):
        raise PeerUnavailable(f"{peer} sent a malformed event: {line[:80]!r}")
    return event
