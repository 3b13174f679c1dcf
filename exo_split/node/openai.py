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
from exo_split.node.grammar import BadGrammar
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
from exo_split.transport.tools import Convention, ToolStream, convention_of, json_grammar

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
        convention = _convention(state, req)
        ids, max_tokens = await _admit(state, req)
        constraint = await _constraint(state, req, convention)
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
        run = _Run(request, state, req, reply, convention)

        def work():
            return state.coordinator.generate(
                gen, run.emit, arrived=arrived, prompt_ids=ids, until=lambda: run.stops.hit,
                checkout=checkout, constraint=constraint,
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


def _convention(state, req: CompletionRequest) -> Convention | None:
    """How this checkpoint writes tool calls, when the request calls tools; else None."""
    if not req.calls_tools:
        return None
    chat = state.coordinator.chat
    convention = convention_of(chat.source) if chat is not None and chat.supports_tools else None
    if chat is not None and chat.supports_tools and convention is None:
        raise OpenAIError(400, "this model's chat template writes tool calls in a form exo-split "
                          "cannot parse (it knows <tool_call> JSON, Llama 3's JSON and Mistral's "
                          "[TOOL_CALLS])", param="tools", code="unsupported_parameter")  # fmt: skip
    return convention  # no template, or one without tools: _admit's tokenizing says so


async def _constraint(state, req: CompletionRequest, convention: Convention | None):
    """The grammar the request's output must follow, compiled; None: free text."""
    if req.schema is not None:
        grammar, param = json_grammar(req.schema), "response_format"
    elif req.forces_call and convention is not None:
        grammar, param = (
            convention.grammar(req.tools, req.tool_choice, req.parallel_tool_calls),
            "tools",
        )
    else:
        return None
    try:
        return await state.coordinator.constrain(grammar)
    except BadGrammar as exc:
        raise OpenAIError(400, str(exc), param=param, code="invalid_value") from exc


def _prompt_param(req: CompletionRequest) -> str:
    return "messages" if req.chat else "prompt"


class _Run:
    """One request's way through the coordinator: its text events through the stop strings,
    to the client as chunks (streaming) or gathered for one response."""

    def __init__(self, request: web.Request, state, req: CompletionRequest, reply: Reply,
                 convention: Convention | None = None):  # fmt: skip
        self.request, self.state, self.req, self.reply = request, state, req, reply
        self.stops = StopStrings(req.stop)
        self.sent = ""  # text streamed so far
        self.write: Writer | None = None
        self.tools = _Tools(state, req, convention) if convention is not None else None

    async def emit(self, event: dict) -> None:
        if event.get("type") != "token":
            return
        text = event.get("text", "") if self.tools is None else self.tools.push(event["id"])
        piece = self.stops.push(text)
        if piece and self.write is not None:
            self.sent += piece
            await self._send(self.reply.chunk(piece, **self._usage_null()))

    def _final(self, done: dict) -> tuple[str, str, dict]:
        """The answer's text, finish_reason and usage, from the coordinator's `done`."""
        text = done["text"] if self.tools is None else self.tools.finish(done)
        cut = cut_at_stop(text, self.req.stop)
        stopped = cut is not None or self.stops.hit
        text = text[:cut] if cut is not None else text
        reason = "stop" if stopped or done.get("finish_reason") == "stop" else "length"
        if self.tools is not None and self.tools.calls and not stopped:
            reason = "tool_calls"
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
        calls = self._calls(reason)
        calls = [c.to_openai() for c in calls] if calls else None
        return web.json_response(self.reply.response(text, reason, use, done["report"], calls))

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
            for i, call in enumerate(self._calls(reason)):  # the name first, then the arguments
                whole = call.to_openai(i)
                args, whole["function"]["arguments"] = whole["function"]["arguments"], ""
                for delta in (whole, {"index": i, "function": {"arguments": args}}):
                    await self._send(self.reply.chunk(tool_calls=[delta], **self._usage_null()))
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

    def _calls(self, reason: str) -> list:
        return self.tools.calls if self.tools is not None and reason == "tool_calls" else []

    def _usage_null(self) -> dict:
        return {"usage": None} if self.req.include_usage else {}

    async def _send(self, obj: dict) -> None:
        await self.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _gone(self, exc: Exception, resp: web.StreamResponse | None = None):
        self.state.count("completions_cancelled")
        log.info("completion: client went away (%s); request cancelled", exc)
        hang_up(self.request)
        return resp if resp is not None else web.Response(status=499)


class _Tools:
    """A tool-calling request's output: the raw text (control tokens kept: a call's marker
    may be one), content released as it streams, the calls parsed at the end."""

    def __init__(self, state, req: CompletionRequest, convention: Convention):
        self.chat, self.convention, self.tools = state.coordinator.chat, convention, req.tools
        self.eos = state.coordinator.codec.eos_ids
        self.ids: list[int] = []
        self.raw = ""
        self.stream = ToolStream(convention)
        self.calls: list = []

    def push(self, token: int) -> str:
        """The content this token releases."""
        if token in self.eos:
            return ""
        self.ids.append(token)
        text = self.chat.raw_text(self.ids)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return ""
        piece, self.raw = text[len(self.raw) :], text
        return self.stream.push(piece)

    def finish(self, done: dict) -> str:
        """The content of the whole answer; `calls` holds its tool calls."""
        ids = [t for t in done["tokens"] if t not in self.eos]
        content, self.calls = self.convention.parse(self.chat.raw_text(ids), self.tools)
        return content if self.calls else done["text"]


def add_routes(app: web.Application) -> None:
    error_shape(app, "/v1", _openai_error)  # /v1/responses, /v1/embeddings, a wrong method
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
