"""The OpenAI-compatible API of the decode node: POST /v1/chat/completions, POST
/v1/completions (streaming as server-sent events, or one JSON response) and GET /v1/models.

A request runs exactly like POST /v1/generate: the same token, admission (Slot, KV ledger),
coordinator (remote or local prefill, fallback) and cancellation (a client that leaves
cancels the work on both nodes); only the shapes differ (transport/openai.py). Stop strings
are applied here, to the text the decode loop streams: when one appears the loop is told to
end (`until`), so the response still carries its report.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from exo_split.errors import ExoSplitError, PromptTooLong
from exo_split.node.prefill import clock
from exo_split.spec import check_request
from exo_split.transport.openai import (
    DEFAULT_MAX_TOKENS,
    CompletionRequest,
    OpenAIError,
    Reply,
    StopStrings,
    cut_at_stop,
    error_body,
    model_card,
    models_list,
    usage,
)
from exo_split.transport.server import (
    HEARTBEAT_S,
    STATE,
    ClientGone,
    Slot,
    Writer,
    error_shape,
    finish,
    hang_up,
    shaped_errors,
    while_connected,
)

log = logging.getLogger(__name__)


def _openai_error(status: int, code: str, message: str) -> dict:
    return error_body(status, code, message)


@shaped_errors(_openai_error)
async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(models_list(state.model_id, state.started))


@shaped_errors(_openai_error)
async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name != state.model_id:
        return _error(_unknown_model(name, state.model_id))
    return web.json_response(model_card(state.model_id, state.started))


@shaped_errors(_openai_error)
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


@shaped_errors(_openai_error)
async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


def _error(exc: OpenAIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def _unknown_model(name: str, served: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"the model {name!r} does not exist: this node serves {served!r} (GET /v1/models)",
        param="model",
        code="model_not_found",
    )


async def _complete(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = clock()
    try:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"the body is not JSON: {exc}", code="invalid_json") from exc
        req = CompletionRequest.from_json(body, chat=chat)
        if req.model != state.model_id:
            raise _unknown_model(req.model, state.model_id)
        ids, max_tokens = await _admit(state, req)
    except OpenAIError as exc:
        return _error(exc)
    gen = req.generate_request(max_tokens)
    need = state.coordinator.kv_need(len(ids), max_tokens)
    with (
        state.coordinator.reusing(gen, ids) as checkout,
        Slot(state, "generate"),
        state.ledger.hold(need, "this request"),
    ):
        state.count("chat_completions" if chat else "completions")
        reply = Reply.new(chat, int(time.time()), req.model, state.spec.fingerprint)
        run = _Run(request, state, req, reply)

        def work():
            return state.coordinator.generate(
                gen, run.emit, arrived=arrived, prompt_ids=ids, until=lambda: run.stops.hit,
                checkout=checkout,
            )  # fmt: skip

        return await (run.stream(work) if req.stream else run.respond(work))


async def _admit(state, req: CompletionRequest) -> tuple[list[int], int]:
    """The prompt's ids and the tokens to generate, or OpenAIError(400) with the numbers."""
    try:
        ids = await state.coordinator.tokenize_off_loop(req.generate_request(1))
        context = state.spec.max_position_embeddings
        max_tokens = req.max_tokens or max(1, min(DEFAULT_MAX_TOKENS, context - len(ids)))
        check_request(state.spec, len(ids), max_tokens)
    except PromptTooLong as exc:
        raise OpenAIError(400, str(exc), param=_prompt_param(req),
                          code="context_length_exceeded") from exc  # fmt: skip
    except ExoSplitError as exc:  # malformed messages, a model without a chat template ...
        raise OpenAIError(400, str(exc), param=getattr(exc, "param", None) or _prompt_param(req),
                          code="invalid_value") from exc  # fmt: skip
    if len(ids) > state.limits.max_prompt_tokens:
        raise OpenAIError(
            400,
            f"{len(ids)} prompt tokens exceed this node's limit of "
            f"{state.limits.max_prompt_tokens} (--max-prompt-tokens)",
            param=_prompt_param(req),
            code="context_length_exceeded",
        )
    return ids, max_tokens


def _prompt_param(req: CompletionRequest) -> str:
    return "messages" if req.chat else "prompt"


class _Run:
    """One request's way through the coordinator: its text events through the stop strings,
    to the client as chunks (streaming) or gathered for one response."""

    def __init__(self, request: web.Request, state, req: CompletionRequest, reply: Reply):
        self.request, self.state, self.req, self.reply = request, state, req, reply
        self.stops = StopStrings(req.stop)
        self.sent = ""  # text streamed so far
        self.write: Writer | None = None

    async def emit(self, event: dict) -> None:
        if event.get("type") != "token":
            return
        piece = self.stops.push(event.get("text", ""))
        if piece and self.write is not None:
            self.sent += piece
            await self._send(self.reply.chunk(piece, **self._usage_null()))

    def _final(self, done: dict) -> tuple[str, str, dict]:
        """The answer's text, finish_reason and usage, from the coordinator's `done`."""
        text = done["text"]
        cut = cut_at_stop(text, self.req.stop)
        stopped = cut is not None or self.stops.hit
        text = text[:cut] if cut is not None else text
        reason = "stop" if stopped or done.get("finish_reason") == "stop" else "length"
        return text, reason, usage(done["prompt_tokens"], len(done["tokens"]))

    async def respond(self, work: Callable[[], Awaitable[dict]]) -> web.StreamResponse:
        try:
            done = await while_connected(self.request, work(), on_lost=lambda: None)
        except ConnectionError as exc:
            return self._gone(exc)
        except Exception as exc:
            self.state.count("failed")
            if not isinstance(exc, ExoSplitError):
                log.exception("completion failed")
            return _error(OpenAIError(500, str(exc), code=type(exc).__name__))
        text, reason, use = self._final(done)
        return web.json_response(self.reply.response(text, reason, use, done["report"]))

    async def stream(self, work: Callable[[], Awaitable[dict]]) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(self.request)
        self.write = Writer(resp, self.state.timeouts.idle)

        async def heartbeat() -> None:  # an SSE comment: clients skip it, proxies see bytes
            if self.write.silent_for() >= HEARTBEAT_S:
                await self.write(b": keep-alive\n\n")

        try:
            if self.req.chat:
                await self._send(self.reply.chunk("", **self._usage_null()))  # the role
            done = await while_connected(self.request, work(), on_lost=lambda: None, tick=heartbeat)
            text, reason, use = self._final(done)
            if text.startswith(self.sent) and len(text) > len(self.sent):
                await self._send(self.reply.chunk(text[len(self.sent) :], **self._usage_null()))
            report = {"exo_split": {"report": done["report"]}}
            if self.req.include_usage:
                await self._send(self.reply.chunk(None, reason, usage=None))
                await self._send(self.reply.usage_chunk(use, **report))
            else:
                await self._send(self.reply.chunk(None, reason, **report))
            await self.write(b"data: [DONE]\n\n")
        except ConnectionError as exc:
            return self._gone(exc, resp)
        except Exception as exc:  # after the 200: the error travels in the stream
            self.state.count("failed")
            if not isinstance(exc, ExoSplitError):
                log.exception("completion failed")
            body = error_body(500, type(exc).__name__, str(exc))
            try:
                await self._send(body)
            except ConnectionError:
                return self._gone(ClientGone("the client left during the error"), resp)
        await finish(self.request, resp, self.state.timeouts.idle)
        return resp

    def _usage_null(self) -> dict:
        return {"usage": None} if self.req.include_usage else {}

    async def _send(self, obj: dict) -> None:
        await self.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _gone(self, exc: Exception, resp: web.StreamResponse | None = None):
        self.state.count("completions_cancelled")
        log.info("completion: client went away (%s); request cancelled", exc)
        hang_up(self.request)
        return resp if resp is not None else web.Response(status=499)


def add_routes(app: web.Application) -> None:
    error_shape(app, "/v1", _openai_error)  # /v1/responses, /v1/embeddings, a wrong method
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
