"""The node's HTTP endpoints: GET /v1/info, POST /v1/prefill (admits a prefill, answers a
ticket, then streams the KV on the data connection the ticket admits) and POST /v1/generate
(NDJSON events), on top of transport/server.py's plumbing; the OpenAI-compatible ones come
from node/openai.py.

Handlers are thin: they validate, map errors to statuses, and hand the work to the prefill
pipeline (node/prefill.py) or the decode coordinator (node/decode.py). Before a 200 an error
is an HTTP status with a JSON body {code, message}; after it, an in-band ERROR frame
(prefill) or an `error` event (generate).

Admission happens before the 200, in this order: token (401), body and model (400/409/413),
concurrency (503 + Retry-After), KV bytes (503 + Retry-After, or 413 if the request could
never fit).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from exo_split import PROTOCOL_VERSION
from exo_split.errors import ExoSplitError, IncompatiblePeer, PromptTooLong
from exo_split.node.anthropic import add_routes as add_anthropic_routes
from exo_split.node.decode import Coordinator
from exo_split.node.openai import add_routes as add_openai_routes
from exo_split.node.prefill import Progress, clock, stream_prefill
from exo_split.node.prefix import PrefixCache
from exo_split.spec import ModelSpec, check_request, check_token_ids, require_compatible
from exo_split.transport.keys import scope_of
from exo_split.transport.limits import prefill_kv_bytes
from exo_split.transport.messages import GenerateRequest, PrefillRequest
from exo_split.transport.server import (
    CLIENT,
    HEARTBEAT_S,
    STATE,
    ClientGone,
    ServerState,
    Slot,
    Writer,
    base_app,
    error,
    error_shape,
    finish,
    hang_up,
    json_body,
    native_error_body,
    over_tls,
    while_connected,
)

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class NodeState(ServerState):
    """What the handlers need from the node agent."""

    node_id: str
    spec: ModelSpec
    backend: Any
    executor: Any
    coordinator: Coordinator
    info: dict
    model_id: str = ""  # the model's name in the OpenAI API (GET /v1/models)
    started: int = 0  # when the node started (Unix seconds): the model's `created`
    die_after_layer: int | None = None  # test hook, docs/reliability.md
    prefix: PrefixCache | None = None  # the node's prefix cache (None: off)
    on_prefilled: Any = None  # (tokens computed, seconds) after each served prefill
    batch: Any = None  # the decode batch (backends/mlx_batch.py's Batcher); None: none


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = {
        **state.stats,
        "active": {kind: n for kind, n in state.busy.items() if n},
        "kv_bytes_held": state.ledger.held,
        "kv_bytes_peak": state.ledger.peak,
        "kv_bytes_limit": state.ledger.limit,
    }
    cache = state.prefix.describe() if state.prefix is not None else _NO_PREFIX_CACHE
    stats["batch"] = state.batch.describe() if state.batch is not None else None
    stats["memory"] = state.backend.memory()
    stats["gc"] = {"frozen": gc.get_freeze_count(),
                   "collections": [g["collections"] for g in gc.get_stats()]}  # fmt: skip
    engine = getattr(state.backend, "describe", None)  # vLLM's own counts
    stats["engine"] = engine() if engine is not None else None
    return web.json_response({**state.info, "stats": stats, "prefix_cache": cache})


_NO_PREFIX_CACHE = {"entries": 0, "bytes": 0, "limit": 0}


async def prefill(request: web.Request) -> web.StreamResponse:
    """Admit a prefill and answer its ticket; then wait for the data connection the ticket
    admits and stream the KV there (docs/protocol.md)."""
    state = request.app[STATE]
    received = clock()
    if not (over_tls(request) or state.insecure_transport):
        return error(403, "tls_required", "node-to-node traffic must be encrypted: this "
                     "prefill node serves /v1/prefill over TLS only (its peers use TLS unless "
                     "started with --insecure-transport; start both nodes with it for "
                     "cleartext on a trusted cable)")  # fmt: skip
    body = await json_body(request)
    try:
        req = PrefillRequest.from_json(body, max_tokens=state.limits.max_prompt_tokens)
        if req.spec is not None:
            require_compatible(state.spec, _peer_spec(req.spec), what="the decode node")
        elif req.fingerprint != state.spec.fingerprint:
            raise IncompatiblePeer(
                f"fingerprint {req.fingerprint!r} != this node's {state.spec.fingerprint!r}"
            )
        check_request(state.spec, len(req.token_ids), 1)
        check_token_ids(state.spec, req.token_ids)
        if req.keep and req.keep != state.spec.window_keep:
            raise ValueError(
                f"keep must be this model's windows {list(state.spec.window_keep) or 'absent'}"
                f", got {list(req.keep)}"
            )
    except IncompatiblePeer as exc:
        return error(409, "incompatible", str(exc))
    except PromptTooLong as exc:
        return error(413, "too_long", str(exc))
    except (ValueError, TypeError, ExoSplitError) as exc:
        return error(400, "bad_request", str(exc))
    limits = state.limits
    streams_kv = hasattr(state.backend, "stream_kv")
    need = prefill_kv_bytes(
        state.spec, state.backend.dtype, req, inflight=limits.max_inflight_bytes,
        streams_kv=streams_kv,
    )  # fmt: skip
    with Slot(state, "prefill"), state.ledger.hold(need, "this prefill"):
        resp, conn = await _admit(request, state)
        if conn is None:
            return resp  # nobody came for the stream
        hello = {
            "node_id": state.node_id,
            "spec": state.spec.to_dict(),
            "fingerprint": state.spec.fingerprint,
            "request_id": req.request_id,
            "prefill_received": received,
            "engine": {"backend": state.backend.name, "device": state.backend.device,
                       "dtype": state.backend.dtype,
                       "quantization": getattr(state.backend, "engine_quantization", None),
                       "head_ranges": len(getattr(state.backend, "head_ranges", ())) or 1,
                       "kv_cache": getattr(state.backend, "kv_cache_dtype", None)},
        }  # fmt: skip
        progress = Progress()
        state.count("prefills")
        try:
            end = await stream_prefill(
                state.backend, state.executor, req, conn, hello=hello,
                timeout=state.timeouts.idle, deadline=state.timeouts.total,
                max_frame_bytes=limits.max_frame_bytes,
                inflight_bytes=limits.max_inflight_bytes, progress=progress,
                die_after_layer=state.die_after_layer, prefix=state.prefix,
            )  # fmt: skip
            await conn.finish(state.timeouts.connect)
            if state.on_prefilled is not None:  # what this node's speed really is (learn.py)
                state.on_prefilled(progress.tokens, end["prefill_end"] - end["prefill_start"])
        except ClientGone as exc:
            state.count("prefills_cancelled")
            state.stats["last_cancel"] = progress.summary()
            log.info("prefill %s: the receiver went away (%s); cancelled", req.request_id, exc)
            conn.abort()
        except Exception as exc:  # sent in-band as an ERROR frame
            log.warning("prefill %s failed: %s", req.request_id, exc)
            await conn.finish(state.timeouts.connect)
        except BaseException:
            conn.abort()
            raise
        finally:
            peak = state.stats.get("inflight_bytes_peak", 0)
            state.stats["inflight_bytes_peak"] = max(peak, progress.inflight_peak)
        return resp


async def _admit(request: web.Request, state: NodeState) -> tuple[web.Response, Any]:
    """Answer 200 with a one-time ticket, then wait (--connect-timeout) for the data
    connection that redeems it: (the answer, the DataConnection or None if none came)."""
    ticket = state.tickets.issue(request.remote, tls=over_tls(request))
    resp = web.json_response(
        {"protocol": PROTOCOL_VERSION, "ticket": ticket.hex, "expires_s": state.timeouts.connect}
    )
    resp.force_close()  # this handler lives on: its connection must not carry another request
    conn = None
    try:
        await resp.prepare(request)
        await resp.write_eof()
        conn = await asyncio.wait_for(asyncio.shield(ticket.future), state.timeouts.connect)
    except (asyncio.TimeoutError, TimeoutError, ConnectionError):
        state.count("tickets_expired")
        log.info("a prefill ticket expired: no data connection within %g s",
                 state.timeouts.connect)  # fmt: skip
    finally:
        state.tickets.discard(ticket)
        if not ticket.future.done():
            ticket.future.cancel()
        elif conn is None and not ticket.future.cancelled():
            ticket.future.result().abort()  # redeemed just as we gave up
    return resp, conn


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = clock()
    body = await json_body(request)
    try:
        req = GenerateRequest.from_json(body)
        req = dataclasses.replace(req, scope=scope_of(state.token, request.get(CLIENT, "")))
        ids = await state.coordinator.tokenize_off_loop(req)  # refused before the 200
        if len(ids) > state.limits.max_prompt_tokens:
            raise PromptTooLong(
                f"{len(ids)} prompt tokens exceed this node's limit of "
                f"{state.limits.max_prompt_tokens} (--max-prompt-tokens)"
            )
    except PromptTooLong as exc:
        return error(413, "too_long", str(exc))
    except (ValueError, ExoSplitError) as exc:
        return error(400, "bad_request", str(exc))
    need = state.coordinator.kv_need(len(ids), req.max_tokens)
    with (
        state.coordinator.reusing(req, ids) as checkout,
        Slot(state, "generate"),
        state.ledger.hold(need, "this request"),
    ):
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        write = Writer(resp, state.timeouts.idle)

        async def emit(event: dict) -> None:
            await write(json.dumps(event).encode() + b"\n")

        async def emit_many(events: list[dict]) -> None:  # the tokens of a batch: one write
            await write(b"".join(json.dumps(e).encode() + b"\n" for e in events))

        async def heartbeat() -> None:
            """Keeps the client's idle timeout for a dead node, not a long local prefill."""
            if write.silent_for() >= HEARTBEAT_S:
                await emit({"type": "heartbeat"})

        state.count("generates")
        try:
            work = state.coordinator.generate(
                req, emit, arrived=arrived, prompt_ids=ids, emit_many=emit_many,
                checkout=checkout,
            )  # fmt: skip
            done = await while_connected(request, work, on_lost=lambda: None, tick=heartbeat)
            if done["report"].get("fallback"):
                state.count("fallbacks")
            await emit(done)
        except ConnectionError as exc:
            state.count("generates_cancelled")
            log.info("generate: client went away (%s); request cancelled", exc)
            hang_up(request)
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
        await finish(request, resp, state.timeouts.idle)
        return resp


async def _emit_last(request: web.Request, emit, event: dict) -> None:
    try:
        await emit(event)
    except ConnectionError:
        hang_up(request)


def _peer_spec(d: dict) -> ModelSpec:
    try:
        return ModelSpec.from_dict(d)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"malformed model spec: {exc}") from exc


def make_app(state: NodeState) -> web.Application:
    app = base_app(state)
    app.router.add_get("/v1/info", info)
    app.router.add_post("/v1/prefill", prefill)
    app.router.add_post("/v1/generate", generate)
    add_openai_routes(app)
    add_anthropic_routes(app)
    for path in ("/v1/info", "/v1/prefill", "/v1/generate", "/v1/probe", "/v1/hello"):
        error_shape(app, path, native_error_body)  # a wrong method on our own endpoints
    return app


__all__ = ["NodeState", "make_app"]
