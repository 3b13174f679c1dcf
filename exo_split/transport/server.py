"""The HTTP face of a node agent (aiohttp): routes, auth, limits, and error mapping.

Handlers are thin: they validate, map errors to statuses, and hand the work to the prefill
pipeline (prefill.py) or the coordinator (coordinator.py). Before a 200 an error is an HTTP
status with a JSON body {code, message}; after it, an in-band ERROR frame (prefill) or an
`error` event (generate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from exo_split.auth import bearer, token_matches
from exo_split.coordinator import Coordinator, GenerateRequest
from exo_split.errors import AuthError, ExoSplitError, IncompatiblePeer, PromptTooLong
from exo_split.handoff import check_request
from exo_split.prefill import PrefillRequest, clock, error_frame, stream_prefill, write_frame
from exo_split.spec import ModelSpec, require_compatible
from exo_split.transport.client import FRAMES_CONTENT_TYPE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Per-node limits; each has a safe default (docs/reliability.md)."""

    max_prompt_tokens: int = 32_768
    max_concurrent: int = 8  # requests of each kind in progress (running or queued)
    retry_after_s: int = 1


@dataclass
class NodeState:
    """What the handlers need from the node agent."""

    node_id: str
    spec: ModelSpec
    backend: Any
    executor: Any
    token: str
    limits: Limits
    coordinator: Coordinator
    info: dict
    busy: dict
    stats: dict  # counters shown in /v1/info: what work this node has done


STATE = web.AppKey("state", NodeState)


def _error(status: int, code: str, message: str, **headers) -> web.Response:
    return web.json_response({"code": code, "message": message}, status=status, headers=headers)


@web.middleware
async def _auth(request: web.Request, handler):
    if request.path == "/v1/health":
        return await handler(request)
    state = request.app[STATE]
    if not token_matches(bearer(request.headers.get("Authorization")), state.token):
        return _error(401, "unauthorized", "missing or wrong token")
    return await handler(request)


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
        busy = self.state.busy
        if busy.get(self.kind, 0) >= self.state.limits.max_concurrent:
            raise web.HTTPServiceUnavailable(
                text=json.dumps({"code": "busy", "message": f"{self.kind} queue is full"}),
                content_type="application/json",
                headers={"Retry-After": str(self.state.limits.retry_after_s)},
            )
        busy[self.kind] = busy.get(self.kind, 0) + 1
        return self

    def __exit__(self, *exc):
        self.state.busy[self.kind] -= 1


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({**state.info, "stats": dict(state.stats)})


async def prefill(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    received = clock()
    body = await _json_body(request)
    try:
        req = PrefillRequest.from_json(body, max_tokens=state.limits.max_prompt_tokens)
        if req.spec is not None:
            require_compatible(state.spec, ModelSpec.from_dict(req.spec), what="the decode node")
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
    with _Slot(state, "prefill"):
        resp = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
        await resp.prepare(request)
        hello = {
            "node_id": state.node_id,
            "spec": state.spec.to_dict(),
            "fingerprint": state.spec.fingerprint,
            "request_id": req.request_id,
            "prefill_received": received,
        }
        cancel = threading.Event()
        state.stats["prefills"] = state.stats.get("prefills", 0) + 1
        try:
            await stream_prefill(
                state.backend, state.executor, req, resp.write, hello=hello, cancel=cancel
            )
        except (ConnectionError, asyncio.CancelledError) as exc:
            log.info("prefill %s: client went away (%s); cancelled", req.request_id, exc)
            cancel.set()
            raise
        except Exception as exc:  # an in-band ERROR: the status is already 200
            log.warning("prefill %s failed: %s", req.request_id, exc)
            await write_frame(resp.write, error_frame(exc))
        await resp.write_eof()
        return resp


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = clock()
    body = await _json_body(request)
    try:
        req = GenerateRequest.from_json(body)
        state.coordinator.tokenize(req)  # refuse what cannot run before the 200
    except PromptTooLong as exc:
        return _error(413, "too_long", str(exc))
    except (ValueError, ExoSplitError) as exc:
        return _error(400, "bad_request", str(exc))
    with _Slot(state, "generate"):
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)

        async def emit(event: dict) -> None:
            await resp.write(json.dumps(event).encode() + b"\n")

        state.stats["generates"] = state.stats.get("generates", 0) + 1
        try:
            done = await state.coordinator.generate(req, emit, arrived=arrived)
            await emit(done)
        except (ConnectionError, asyncio.CancelledError):
            log.info("generate: client went away; request abandoned")
            raise
        except ExoSplitError as exc:
            await emit({"type": "error", "code": type(exc).__name__, "message": str(exc)})
        except Exception as exc:
            log.exception("generate failed")
            await emit(
                {"type": "error", "code": "internal", "message": f"{type(exc).__name__}: {exc}"}
            )
        await resp.write_eof()
        return resp


def make_app(state: NodeState) -> web.Application:
    app = web.Application(middlewares=[_auth], client_max_size=8 * 1024 * 1024)
    app[STATE] = state
    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/info", info)
    app.router.add_post("/v1/prefill", prefill)
    app.router.add_post("/v1/generate", generate)
    return app


__all__ = ["AuthError", "Limits", "NodeState", "STATE", "make_app"]
