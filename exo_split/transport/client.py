"""Client side of the protocol: node info, the KV stream (POST /v1/prefill, then the data
connection its ticket admits), the generate stream.

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
from urllib.parse import urlsplit

import aiohttp

from exo_split import PROTOCOL_VERSION
from exo_split.errors import (
    AuthError,
    ExoSplitError,
    IncompatiblePeer,
    PeerBusy,
    PeerUnavailable,
    ProtocolError,
)
from exo_split.transport import wire
from exo_split.transport.datalink import TICKET
from exo_split.transport.decoder import Destination, Frame, FrameDecoder, NoCrc, ThreadCrc
from exo_split.transport.peer import client_errors, peer_headers
from exo_split.transport.stream import Bad, Eof, Lost, PlainStream, TlsStream


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


async def fetch_info(
    session: aiohttp.ClientSession, base_url: str, token: str | None, *, timeout: float = 5.0
) -> dict[str, Any]:
    """GET /v1/info of a node."""
    auth = await peer_headers(session, base_url, token, "GET", "/v1/info", timeout=timeout)
    with client_errors(base_url, "GET /v1/info"):
        async with session.get(
            f"{base_url}/v1/info", **auth, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            await _raise_for_status(resp, base_url)
            info = await resp.json()
    if not isinstance(info, dict) or "fingerprint" not in info:
        raise PeerUnavailable(f"{base_url} did not answer like an exo-split node")
    return info


def _ticket(answer: Any, peer: str) -> bytes:
    ok = isinstance(answer, dict) and answer.get("protocol") == PROTOCOL_VERSION
    value = answer.get("ticket") if ok else None
    try:
        ticket = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        ticket = b""
    if len(ticket) != TICKET.size - 8:
        raise ProtocolError(
            f"{peer}: POST /v1/prefill answered 200 without a protocol {PROTOCOL_VERSION} "
            f"ticket: got {str(answer)[:200]}"
        )
    return ticket


async def kv_stream(
    session: aiohttp.ClientSession,
    base_url: str,
    token: str | None,
    body: dict,
    spec: wire.StreamSpec,
    timeouts: Timeouts,
    *,
    dest: Destination | None = None,
    max_pending: int = wire.DEFAULT_MAX_FRAME_BYTES,
) -> AsyncIterator[Frame]:
    """POST /v1/prefill, open the KV data connection its ticket admits, and yield each
    checked frame (LAYER frames once their CRC matched) until END.

    LAYER payloads land in `dest` (the decode cache) when given. Raises PeerUnavailable
    (died, stalled, refused; PeerBusy for a 503), ProtocolError (garbage), IncompatiblePeer
    or AuthError, each within the timeouts: connect (the POST and the data connection),
    first_frame (POST sent -> HELLO), idle (the longest silence once bytes flow) and total
    (POST sent -> END). Closing the generator closes the connection, which is how the
    prefill node learns to stop.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    hello_by, deadline = start + timeouts.first_frame, start + timeouts.total
    timeout = aiohttp.ClientTimeout(
        total=None, connect=timeouts.connect, sock_connect=timeouts.connect
    )
    data = json.dumps(body).encode()
    auth = await asyncio.wait_for(
        peer_headers(session, base_url, token, "POST", "/v1/prefill", data,
                     timeout=timeouts.connect),
        timeout=timeouts.first_frame,
    )  # fmt: skip
    auth["headers"]["Content-Type"] = "application/json"
    with client_errors(base_url, "POST /v1/prefill"):
        resp = await asyncio.wait_for(
            session.post(f"{base_url}/v1/prefill", data=data, **auth, timeout=timeout),
            timeout=timeouts.first_frame,
        )
        try:
            await _raise_for_status(resp, base_url)
            wait = max(hello_by - loop.time(), 0.001)
            answer = await asyncio.wait_for(resp.json(content_type=None), timeout=wait)
        except ValueError as exc:
            raise ProtocolError(f"{base_url}: POST /v1/prefill answered 200 with {exc}") from exc
        finally:
            resp.release()
    pin = auth.get("ssl")  # over https: the certificate's fingerprint the POST was pinned to
    crc = ThreadCrc() if pin is None else NoCrc()
    decoder, ticket = FrameDecoder(spec, dest=dest, crc=crc), _ticket(answer, base_url)
    stream = (PlainStream if pin is None else TlsStream)(decoder, ticket, max_pending)
    url = urlsplit(base_url)
    try:
        with client_errors(base_url, "the KV data connection"):
            if isinstance(stream, TlsStream):
                await asyncio.wait_for(
                    asyncio.to_thread(stream.connect, url.hostname, url.port,
                                      pin.fingerprint.hex(), timeouts.connect, base_url),
                    timeouts.connect + 1,
                )  # fmt: skip
                stream.start()
            else:
                await asyncio.wait_for(
                    loop.create_connection(lambda: stream, url.hostname, url.port),
                    timeouts.connect,
                )
        async for frame in _frames(stream, base_url, timeouts, hello_by, deadline):
            yield frame
    finally:
        stream.close()
        crc.close()


async def _frames(proto: PlainStream | TlsStream, peer: str, timeouts: Timeouts, hello_by: float,
                  deadline: float) -> AsyncIterator[Frame]:  # fmt: skip
    loop, n = asyncio.get_running_loop(), 0
    while True:
        limits = [(deadline, "total")]
        limits.append((hello_by, "hello") if n == 0 else (proto.last_data + timeouts.idle, "idle"))
        until, why = min(limits)
        try:
            item = await asyncio.wait_for(proto.events.get(), max(until - loop.time(), 0))
        except (asyncio.TimeoutError, TimeoutError) as exc:
            if loop.time() < until:  # data came meanwhile: the idle clock moved
                continue
            if why == "total":
                raise PeerUnavailable(
                    f"{peer} did not finish the prefill within {timeouts.total:g} s "
                    f"(after {n} frames)"
                ) from exc
            if why == "hello":
                raise PeerUnavailable(
                    f"{peer} stalled: no HELLO within {timeouts.first_frame:g} s"
                ) from exc
            raise PeerUnavailable(
                f"{peer} stalled: no data for {timeouts.idle:g} s after {n} frames"
            ) from exc
        if isinstance(item, Bad):
            raise ProtocolError(f"{peer}: {item.exc}") from item.exc
        if isinstance(item, Eof):
            raise PeerUnavailable(f"{peer} closed the stream: {item.exc or 'EOF after END'}")
        if isinstance(item, Lost):
            why = type(item.exc).__name__ if item.exc else "closed"
            raise PeerUnavailable(
                f"{peer} closed the stream: connection lost after {n} frames ({why})"
            )
        n += 1
        proto.taken(item)
        if item.crc is not None:
            try:
                item.verify(await asyncio.wrap_future(item.crc))
            except ProtocolError as exc:
                raise ProtocolError(f"{peer}: {exc}") from exc
        if item.kind is wire.Kind.ERROR:
            obj = item.obj or {}
            raise PeerUnavailable(
                f"{peer} failed the prefill: {obj.get('code')}: {obj.get('message')}"
            )
        yield item
        if item.kind is wire.Kind.END:
            return


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
    data = json.dumps(body).encode()
    auth = await peer_headers(session, base_url, token, "POST", "/v1/generate", data,
                              timeout=timeouts.connect)  # fmt: skip
    auth["headers"]["Content-Type"] = "application/json"
    with client_errors(base_url, "POST /v1/generate"):
        async with session.post(
            f"{base_url}/v1/generate", data=data, **auth, timeout=timeout
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
