"""The HTTP face of a node agent (aiohttp): routes, auth, limits, and error mapping.

Handlers are thin: they validate, map errors to statuses, and hand the work to the prefill
pipeline (prefill.py) or the coordinator (coordinator.py). Before a 200 an error is an HTTP
status with a JSON body {code, message}; after it, an in-band ERROR frame (prefill) or an
`error` event (generate).

Admission happens before the 200, in this order: token (401), body and model (400/409/413),
concurrency (503 + Retry-After), KV bytes (503 + Retry-After, or 413 if the request could never
fit). aiohttp does not cancel a handler whose client went away, and a request that is
computing writes nothing for a while, so every streaming handler also watches its connection
and cancels its work when the client drops (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from exo_split.auth import bearer, token_matches
from exo_split.coordinator import Coordinator, GenerateRequest
from exo_split.errors import ExoSplitError, IncompatiblePeer, PromptTooLong
from exo_split.handoff import check_request
from exo_split.limits import (
    PREFILL_QUEUE_DEPTH,
    KVLedger,
    Limits,
    Refused,
    decode_kv_bytes,
    prefill_kv_bytes,
)
from exo_split.prefill import (
    PrefillRequest,
    Progress,
    clock,
    error_frame,
    stream_prefill,
    write_frame,
)
from exo_split.spec import ModelSpec, require_compatible
from exo_split.transport.client import FRAMES_CONTENT_TYPE, Timeouts

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.02  # how often a streaming handler checks that its client is still there
HEARTBEAT_S = 5.0  # a generate stream silent this long gets a heartbeat event (a long prefill)


@dataclass
class NodeState:
    """What the handlers need from the node agent."""

    node_id: str
    spec: ModelSpec
    backend: Any
    executor: Any
    token: str = field(repr=False)
    limits: Limits
    coordinator: Coordinator
    info: dict
    busy: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # counters shown in /v1/info
    timeouts: Timeouts = field(default_factory=Timeouts)
    die_after_layer: int | None = None  # test hook, docs/reliability.md
    ledger: KVLedger = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = KVLedger(self.limits.max_kv_bytes, self.limits.retry_after_s)

    def count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1


STATE = web.AppKey("state", NodeState)


def _error(status: int, code: str, message: str, **headers) -> web.Response:
    return web.json_response({"code": code, "message": message}, status=status, headers=headers)


def _refusal_response(exc: Refused) -> web.Response:
    headers = {"Retry-After": str(exc.retry_after)} if exc.status == 503 else {}
    return _error(exc.status, exc.code, str(exc), **headers)


@web.middleware
async def _auth(request: web.Request, handler):
    if request.path == "/v1/health":
        return await handler(request)
    state = request.app[STATE]
    if not token_matches(bearer(request.headers.get("Authorization")), state.token):
        log.info("refused %s %s from %s: missing or wrong token", request.method,
                 request.path, request.remote)  # fmt: skip
        return _error(
            401, "unauthorized", "missing or wrong token", **{"WWW-Authenticate": "Bearer"}
        )
    try:
        return await handler(request)
    except Refused as exc:  # raised before the 200 by _Slot and KVLedger.hold
        return _refusal_response(exc)


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise web.HTTPBadRequest(
            text=json.dumps({"code": "bad_request", "message": f"body is not JSON: {exc}"}),
            content_type="application/json",
        ) from exc


class _Slot:
    """Admission control: at most `limit` requests of one kind at once, else 503."""

    def __init__(self, state: NodeState, kind: str):
        self.state, self.kind = state, kind

    def __enter__(self):
        busy, limits = self.state.busy, self.state.limits
        if busy.get(self.kind, 0) >= limits.max_concurrent:
            self.state.count("refused_busy")
            raise Refused(
                503,
                "busy",
                f"{self.kind} queue is full ({limits.max_concurrent} in progress)",
                retry_after=limits.retry_after_s,
            )
        busy[self.kind] = busy.get(self.kind, 0) + 1
        return self

    def __exit__(self, *exc):
        self.state.busy[self.kind] -= 1


class ClientGone(ConnectionError):
    """The client closed its connection, or read nothing for the idle timeout."""


def _connected(request: web.Request) -> bool:
    transport = request.transport
    return transport is not None and not transport.is_closing()


def _hang_up(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


async def _while_connected(
    request: web.Request,
    work: Awaitable,
    on_lost: Callable[[], None],
    tick: Callable[[], Awaitable[None]] | None = None,
):
    """Await `work`; if the client's connection drops first, call `on_lost`, cancel the work,
    wait for it to unwind, and raise ClientGone. `tick` runs at every check meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            lost = not task.done() and not _connected(request)
            if not lost and tick is not None and not task.done():
                try:
                    await tick()
                except ConnectionError:
                    lost = True
            if lost:
                on_lost()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ClientGone("the client closed the connection")
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    return task.result()


class _Writer:
    """resp.write, bounded: a client that stops reading cannot hold the handler forever."""

    def __init__(self, resp: web.StreamResponse, timeout: float):
        self.resp, self.timeout = resp, timeout
        self.last = asyncio.get_running_loop().time()

    async def __call__(self, data) -> None:
        try:
            await asyncio.wait_for(self.resp.write(data), self.timeout)
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise ClientGone(f"the client read nothing for {self.timeout:g} s") from exc
        self.last = asyncio.get_running_loop().time()

    def silent_for(self) -> float:
        return asyncio.get_running_loop().time() - self.last


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


PROBE_MAX_BYTES = 64 * 1024 * 1024
_PROBE_CHUNK = memoryview(bytes(1024 * 1024))


async def probe(request: web.Request) -> web.StreamResponse:
    """GET /v1/probe?bytes=N: N zero bytes, so a decode node can time the link (capabilities.py)."""
    try:
        n = int(request.query.get("bytes", "0"))
    except ValueError:
        n = -1
    if not 0 <= n <= PROBE_MAX_BYTES:
        return _error(400, "bad_request", f"bytes must be 0..{PROBE_MAX_BYTES}")
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = n
    await resp.prepare(request)
    while n > 0:
        piece = _PROBE_CHUNK[: min(n, len(_PROBE_CHUNK))]
        await resp.write(piece)
        n -= len(piece)
    await resp.write_eof()
    return resp


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = {
        **state.stats,
        "active": {kind: n for kind, n in state.busy.items() if n},
        "kv_bytes_held": state.ledger.held,
        "kv_bytes_peak": state.ledger.peak,
        "kv_bytes_limit": state.ledger.limit,
    }
    return web.json_response({**state.info, "stats": stats})


async def prefill(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    received = clock()
    body = await _json_body(request)
    try:
        req = PrefillRequest.from_json(body, max_tokens=state.limits.max_prompt_tokens)
        if req.spec is not None:
            require_compatible(state.spec, _peer_spec(req.spec), what="the decode node")
        elif req.fingerprint != state.spec.fingerprint:
            raise IncompatiblePeer(
                f"fingerprint {req.fingerprint!r} != this node's {state.spec.fingerprint!r}"
            )
        check_request(state.spec, len(req.token_ids), 1)
    except IncompatiblePeer as exc:
        return _error(409, "incompatible", str(exc))
    except PromptTooLong as exc:
        return _error(413, "too_long", str(exc))
    except (ValueError, TypeError, ExoSplitError) as exc:
        return _error(400, "bad_request", str(exc))
    need = prefill_kv_bytes(state.spec, state.backend.dtype, req)
    with _Slot(state, "prefill"), state.ledger.hold(need, "this prefill"):
        resp = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
        await resp.prepare(request)
        hello = {
            "node_id": state.node_id,
            "spec": state.spec.to_dict(),
            "fingerprint": state.spec.fingerprint,
            "request_id": req.request_id,
            "prefill_received": received,
        }
        progress = Progress()
        write = _Writer(resp, state.timeouts.idle)
        state.count("prefills")
        work = stream_prefill(
            state.backend,
            state.executor,
            req,
            write,
            hello=hello,
            queue_depth=PREFILL_QUEUE_DEPTH,
            put_timeout=state.timeouts.idle,
            progress=progress,
            die_after_layer=state.die_after_layer,
        )
        try:
            await _while_connected(request, work, on_lost=progress.cancel)
        except ConnectionError as exc:
            state.count("prefills_cancelled")
            state.stats["last_cancel"] = progress.summary()
            log.info("prefill %s: client went away (%s); cancelled", req.request_id, exc)
            _hang_up(request)
            return resp
        except Exception as exc:  # an in-band ERROR: the status is already 200
            log.warning("prefill %s failed: %s", req.request_id, exc)
            try:
                await write_frame(write, error_frame(exc))
            except ConnectionError:
                _hang_up(request)
                return resp
        await _finish(request, resp, state.timeouts.idle)
        return resp


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = clock()
    body = await _json_body(request)
    try:
        req = GenerateRequest.from_json(body)
        ids = state.coordinator.tokenize(req)  # refuse what cannot run before the 200
        if len(ids) > state.limits.max_prompt_tokens:
            raise PromptTooLong(
                f"{len(ids)} prompt tokens exceed this node's limit of "
                f"{state.limits.max_prompt_tokens} (--max-prompt-tokens)"
            )
    except PromptTooLong as exc:
        return _error(413, "too_long", str(exc))
    except (ValueError, ExoSplitError) as exc:
        return _error(400, "bad_request", str(exc))
    need = decode_kv_bytes(state.spec, state.backend.dtype, len(ids), req.max_tokens)
    with _Slot(state, "generate"), state.ledger.hold(need, "this request"):
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        write = _Writer(resp, state.timeouts.idle)

        async def emit(event: dict) -> None:
            await write(json.dumps(event).encode() + b"\n")

        async def heartbeat() -> None:
            """Keeps the client's idle timeout for a dead node, not a long local prefill."""
            if write.silent_for() >= HEARTBEAT_S:
                await emit({"type": "heartbeat"})

        state.count("generates")
        try:
            work = state.coordinator.generate(req, emit, arrived=arrived)
            done = await _while_connected(request, work, on_lost=lambda: None, tick=heartbeat)
            if done["report"].get("fallback"):
                state.count("fallbacks")
            await emit(done)
        except ConnectionError as exc:
            state.count("generates_cancelled")
            log.info("generate: client went away (%s); request cancelled", exc)
            _hang_up(request)
            return resp
        except ExoSplitError as exc:
            state.count("failed")
            event = {"type": "error", "code": type(exc).__name__, "message": str(exc)}
            if exc.hint:
                event["hint"] = exc.hint
            await _emit_last(request, emit, event)
        except Exception as exc:
            state.count("failed")
            log.exception("generate failed")
            message = f"{type(exc).__name__}: {exc}"
            await _emit_last(
                request, emit, {"type": "error", "code": "internal", "message": message}
            )
        await _finish(request, resp, state.timeouts.idle)
        return resp


async def _emit_last(request: web.Request, emit, event: dict) -> None:
    try:
        await emit(event)
    except ConnectionError:
        _hang_up(request)


async def _finish(request: web.Request, resp: web.StreamResponse, timeout: float) -> None:
    try:
        await asyncio.wait_for(resp.write_eof(), timeout)
    except (ConnectionError, asyncio.TimeoutError, TimeoutError):
        _hang_up(request)


def _peer_spec(d: dict) -> ModelSpec:
    try:
        return ModelSpec.from_dict(d)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"malformed model spec: {exc}") from exc


def make_app(state: NodeState) -> web.Application:
    app = web.Application(middlewares=[_auth], client_max_size=8 * 1024 * 1024)
    app[STATE] = state
    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/info", info)
    app.router.add_get("/v1/probe", probe)
    app.router.add_post("/v1/prefill", prefill)
    app.router.add_post("/v1/generate", generate)
    return app


__all__ = ["NodeState", "STATE", "make_app"]
