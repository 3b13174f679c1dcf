"""The HTTP plumbing every node endpoint shares (aiohttp): auth, admission, error shapes, and
streaming a response to a client that may go away.

The endpoints themselves live with the node's roles (node/routes.py); this module knows
tokens, limits and connections, not models. Before a 200 an error is an HTTP status with a
JSON body {code, message}. aiohttp does not cancel a handler whose client went away, and a
request that is computing writes nothing for a while, so `while_connected` watches the
connection and cancels the work when the client drops (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from exo_split.transport.auth import (
    NONCE_HEX,
    Nonces,
    bearer,
    client_proof,
    is_nonce,
    parse_proof,
    server_proof,
    token_matches,
)
from exo_split.transport.client import Timeouts
from exo_split.transport.datalink import Tickets
from exo_split.transport.keys import KeyRing
from exo_split.transport.limits import KVLedger, Limits, Refused
from exo_split.transport.tls import Identity

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024  # a request body larger is refused (413)
DISCONNECT_POLL_S = 0.02  # how often a streaming handler checks that its client is still there
PROBE_MAX_BYTES = 64 * 1024 * 1024
PROBE_WRITE_TIMEOUT_S = 30.0  # 64 MiB at 20 Mbit/s; a probe is a few MiB
_PROBE_CHUNK = memoryview(bytes(1024 * 1024))


@dataclass(kw_only=True)
class ServerState:
    """What the shared plumbing needs: the token, the limits and their bookkeeping."""

    token: str = field(repr=False)
    limits: Limits
    timeouts: Timeouts = field(default_factory=Timeouts)
    busy: dict = field(default_factory=dict)  # requests in progress, by kind
    stats: dict = field(default_factory=dict)  # counters shown in /v1/info
    tickets: Tickets = field(default_factory=Tickets)  # admitted prefills' data connections
    nonces: Nonces = field(default_factory=Nonces)  # handed out by /v1/hello (peer proofs)
    keys: KeyRing = field(default_factory=lambda: KeyRing(None))  # clients' own API keys
    identity: Identity | None = None  # the node's TLS certificate (transport/tls.py)
    insecure_transport: bool = False  # serve /v1/prefill in cleartext too (a trusted cable)
    ledger: KVLedger = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = KVLedger(self.limits.max_kv_bytes, self.limits.retry_after_s)

    def count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1


STATE = web.AppKey("state", ServerState)
# Answered without a token. /health as vLLM and mlx_lm.server answer it (guidellm checks it).
PUBLIC_PATHS = frozenset({"/v1/health", "/health", "/v1/hello"})
HEARTBEAT_S = 5.0  # a stream silent this long gets a heartbeat (a long prefill)

ErrorBody = Callable[[int, str, str], Any]  # (status, code, message) -> the JSON error body


def native_error_body(status: int, code: str, message: str) -> dict:
    return {"code": code, "message": message}


def error(
    status: int, code: str, message: str, *, body: ErrorBody = native_error_body, **headers
) -> web.Response:
    return web.json_response(body(status, code, message), status=status, headers=headers)


def shaped_errors(body: ErrorBody):
    """Decorate a handler whose errors take another JSON shape (the OpenAI API's): the
    middleware's refusals (401, 413, 503) on its route use `body` too."""

    def mark(handler):
        handler.error_body = body
        return handler

    return mark


# The error shape of requests no route takes (a 404, a 405), by path prefix, longest first:
# the OpenAI API's and the Anthropic API's clients read their own shape there too.
ERROR_SHAPES = web.AppKey("error_shapes", list)


def error_shape(app: web.Application, prefix: str, body: ErrorBody) -> None:
    """Answer errors on paths under `prefix` that no handler claims in `body`'s shape."""
    app[ERROR_SHAPES].append((prefix, body))
    app[ERROR_SHAPES].sort(key=lambda entry: -len(entry[0]))


def _error_body_of(request: web.Request) -> ErrorBody:
    shaped = getattr(request.match_info.handler, "error_body", None)
    if shaped is not None:
        return shaped
    if getattr(request.match_info, "http_exception", None) is None:
        return native_error_body  # a handler of ours that takes the native shape
    for prefix, body in request.app.get(ERROR_SHAPES, ()):
        if request.path == prefix or request.path.startswith(prefix.rstrip("/") + "/"):
            return body
    return native_error_body


_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
               413: "request_too_large"}  # fmt: skip


@web.middleware
async def http_errors(request: web.Request, handler):
    """aiohttp's own errors (no route: 404, wrong method: 405, a body over client_max_size:
    413) in the JSON shape of the path's API instead of plain text. Errors a handler already
    shaped as JSON pass through."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        message = {
            404: f"no such endpoint: {request.method} {request.path}",
            405: f"{request.method} is not allowed on {request.path} "
            f"(allowed: {exc.headers.get('Allow', '')})",
        }.get(exc.status, exc.text or exc.reason)
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        code = _HTTP_CODES.get(exc.status, "error")
        return error(exc.status, code, message, body=_error_body_of(request), **headers)


def refusal_response(exc: Refused, body: ErrorBody = native_error_body) -> web.Response:
    headers = {"Retry-After": str(exc.retry_after)} if exc.status == 503 else {}
    return error(exc.status, exc.code, str(exc), body=body, **headers)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    """Every path but PUBLIC_PATHS needs the token; a Refused before the 200 becomes 413/503."""
    if request.path in PUBLIC_PATHS:
        return await handler(request)
    state = request.app[STATE]
    if not await _authorized(request, state):
        log.info("refused %s %s from %s: missing or wrong token", request.method,
                 request.path, request.remote)  # fmt: skip
        return error(
            401,
            "unauthorized",
            "missing or wrong token",
            body=_error_body_of(request),
            **{"WWW-Authenticate": "Bearer"},
        )
    try:
        return await handler(request)
    except Refused as exc:  # raised before the 200 by Slot and KVLedger.hold
        return refusal_response(exc, _error_body_of(request))


# Paths a client API key opens (transport/keys.py); the rest take the shared token alone.
CLIENT_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages",
                "/v1/generate")  # fmt: skip
# request[CLIENT]: "" for the shared token, else the key's name (RequestKey: aiohttp >= 3.12)
CLIENT = web.RequestKey("client", str) if hasattr(web, "RequestKey") else "exo_split.client"


async def _authorized(request: web.Request, state: ServerState) -> bool:
    """A peer's proof (ExoProof: a MAC over a nonce this node handed out and the request
    itself), a client's `Bearer <token>` (or `x-api-key: <token>`, Anthropic's header), or,
    on CLIENT_PATHS, a client's own key. Sets request[CLIENT]."""
    header = request.headers.get("Authorization")
    proof = parse_proof(header)
    if proof is not None:
        if not state.nonces.take(proof["ns"]):  # unknown, used or stale
            return False
        body = await request.read()
        want = client_proof(state.token, proof["nc"], proof["ns"], request.method,
                            request.raw_path, body)  # fmt: skip
        request[CLIENT] = ""
        return hmac.compare_digest(proof["mac"], want)
    presented = bearer(header) if header is not None else request.headers.get("x-api-key")
    if token_matches(presented, state.token):
        request[CLIENT] = ""
        return True
    if request.path.startswith(CLIENT_PATHS) and (name := state.keys.match(presented)):
        request[CLIENT] = name
        return True
    return False


async def hello(request: web.Request) -> web.Response:
    """GET /v1/hello?nonce=NC: this node's proof that it holds the token, over the caller's
    nonce and a fresh one of its own (transport/auth.py). Public: it discloses nothing."""
    state = request.app[STATE]
    nc = request.query.get("nonce", "")
    if not is_nonce(nc):
        return error(400, "bad_request", f"nonce must be {NONCE_HEX} lowercase hex digits")
    ns = state.nonces.issue()
    cert = state.identity.fingerprint if over_tls(request) and state.identity else ""
    proof = server_proof(state.token, nc, ns, cert)
    return web.json_response({"nonce": ns, "cert": cert, "proof": proof})


def over_tls(request: web.Request) -> bool:
    return request.transport is not None and (
        request.transport.get_extra_info("ssl_object") is not None
    )


async def json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise web.HTTPBadRequest(
            text=json.dumps({"code": "bad_request", "message": f"body is not JSON: {exc}"}),
            content_type="application/json",
        ) from exc


class Slot:
    """Admission control: at most `limits.max_concurrent` requests of one kind at once, else
    a 503 Refused."""

    def __init__(self, state: ServerState, kind: str):
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


def connected(request: web.Request) -> bool:
    transport = request.transport
    return transport is not None and not transport.is_closing()


def hang_up(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


async def while_connected(
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
            lost = not task.done() and not connected(request)
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


class Writer:
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


async def finish(request: web.Request, resp: web.StreamResponse, timeout: float) -> None:
    """End a streamed response; a client that does not take the end is hung up on."""
    try:
        await asyncio.wait_for(resp.write_eof(), timeout)
    except (ConnectionError, asyncio.TimeoutError, TimeoutError):
        hang_up(request)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def probe(request: web.Request) -> web.StreamResponse:
    """GET /v1/probe?bytes=N: N zero bytes, so a decode node can time the link
    (node/capabilities.py)."""
    try:
        n = int(request.query.get("bytes", "0"))
    except ValueError:
        n = -1
    if not 0 <= n <= PROBE_MAX_BYTES:
        return error(400, "bad_request", f"bytes must be 0..{PROBE_MAX_BYTES}")
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = n
    await resp.prepare(request)

    async def send(n: int) -> None:
        while n > 0:
            piece = _PROBE_CHUNK[: min(n, len(_PROBE_CHUNK))]
            await resp.write(piece)
            n -= len(piece)
        await resp.write_eof()

    try:  # a reader that stops reading holds the handler no longer than this (issue 18, L8)
        await asyncio.wait_for(send(n), PROBE_WRITE_TIMEOUT_S)
    except (asyncio.TimeoutError, TimeoutError):
        log.info("GET /v1/probe: the reader took over %g s; closed", PROBE_WRITE_TIMEOUT_S)
        if request.transport is not None:
            request.transport.abort()
    return resp


def base_app(state: ServerState) -> web.Application:
    """An app with the token check, /v1/health and /v1/probe; the node adds its endpoints."""
    app = web.Application(
        middlewares=[http_errors, auth_middleware], client_max_size=MAX_BODY_BYTES
    )
    app[STATE] = state
    app[ERROR_SHAPES] = []
    app.router.add_get("/v1/health", health)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/hello", hello)
    app.router.add_get("/v1/probe", probe)
    return app
