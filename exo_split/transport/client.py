"""HTTP client side of the protocol: node info, the prefill frame stream, the generate stream.

Every wait has a timeout; every failure becomes a named error (PeerUnavailable, AuthError,
IncompatiblePeer, ProtocolError) whose message says which peer and what happened.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from exo_split.errors import AuthError, ExoSplitError, IncompatiblePeer, PeerUnavailable
from exo_split.transport import wire

FRAMES_CONTENT_TYPE = "application/x-exo-split-frames"


@dataclass(frozen=True)
class Timeouts:
    """Seconds. All finite by default (docs/reliability.md)."""

    connect: float = 5.0
    first_frame: float = 30.0  # request sent -> HELLO
    idle: float = 60.0  # longest gap between two reads of a frame stream (one layer's compute)

    def to_dict(self) -> dict:
        return {"connect": self.connect, "first_frame": self.first_frame, "idle": self.idle}


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
        retry = resp.headers.get("Retry-After", "?")
        raise PeerUnavailable(f"{peer} is busy (503, retry after {retry} s): {message}")
    if resp.status in (400, 413):
        raise ExoSplitError(f"{peer} rejected the request ({resp.status}): {message}")
    raise PeerUnavailable(f"{peer} answered {resp.status}: {message}")


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
            if isinstance(exc, aiohttp.ClientError | OSError):
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

    Ends after END; raises PeerUnavailable (died, stalled, refused), ProtocolError (garbage),
    IncompatiblePeer or AuthError. Closing the generator closes the connection, which is how
    the prefill node learns to stop.
    """
    decoder = wire.FrameDecoder(spec)
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
        wait, n_frames = timeouts.first_frame, 0
        while not decoder.finished:
            with _client_errors(base_url, "the KV stream"):
                try:
                    chunk = await asyncio.wait_for(resp.content.readany(), timeout=wait)
                except (asyncio.TimeoutError, TimeoutError) as exc:
                    raise PeerUnavailable(
                        f"{base_url} stalled: no data for {wait:g} s after {n_frames} frames"
                    ) from exc
            wait = timeouts.idle
            if not chunk:
                try:
                    decoder.eof()
                except wire.ProtocolError as exc:
                    raise PeerUnavailable(f"{base_url} closed the stream: {exc}") from exc
                return
            for frame in decoder.feed(chunk):
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


def _event(line: bytes, peer: str) -> dict:
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise PeerUnavailable(f"{peer} sent a malformed event: {exc}") from exc
    if not isinstance(event, dict):
        raise PeerUnavailable(f"{peer} sent a malformed event: {line[:80]!r}")
    return event
