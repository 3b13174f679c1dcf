"""What the decode node's chat APIs share (OpenAI's in node/openai.py, Anthropic's in
node/anthropic.py): a request checked into a CompletionRequest runs exactly like POST
/v1/generate: the same token, admission (Slot, KV ledger), coordinator (remote or local
prefill, fallback) and cancellation (a client that leaves cancels the work on both nodes);
only the shapes differ. Stop strings are applied here, to the text the decode loop streams:
when one appears the loop is told to end (`until`), so the response still carries its
report. Tool calls are parsed here (transport/tools.py), and a request whose output must
follow a grammar gets its constraint compiled before the 200 (node/grammar.py).

`Run` is one request's way through; an API subclasses it with its shapes (`start`,
`piece`, `end`, `response`, `failure`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from exo_split.errors import ExoSplitError, PromptTooLong
from exo_split.node.grammar import BadGrammar
from exo_split.node.prefill import clock
from exo_split.spec import check_request
from exo_split.tokenizer import TextStream
from exo_split.transport.keys import scope_of
from exo_split.transport.openai import (
    DEFAULT_MAX_TOKENS,
    CompletionRequest,
    OpenAIError,
    usage,
)
from exo_split.transport.server import (
    CLIENT,
    HEARTBEAT_S,
    STATE,
    ClientGone,
    Slot,
    Writer,
    finish,
    hang_up,
    while_connected,
)
from exo_split.transport.stops import StopStrings, cut_at_stop
from exo_split.transport.tools import Convention, ToolStream, convention_of, json_grammar

log = logging.getLogger(__name__)


async def serve(
    request: web.Request,
    parse: Callable[[Any], CompletionRequest],
    make_run: Callable[..., Run],
    kind: str,
    error: Callable[[OpenAIError], web.Response],
) -> web.StreamResponse:
    """Check the body (`parse`), admit it, run it through `make_run`'s Run; every error
    before the 200 through `error`, in the API's shape."""
    state = request.app[STATE]
    arrived = clock()
    try:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"the body is not JSON: {exc}", code="invalid_json") from exc
        req = parse(body)
        if req.model != state.model_id:
            raise unknown_model(req.model, state.model_id)
        convention = _convention(state, req)
        ids, max_tokens = await _admit(state, req)
        constraints = [await _constraint(state, req, convention) for _ in range(req.n)]
    except OpenAIError as exc:
        return error(exc)
    scope = scope_of(state.token, request.get(CLIENT, ""))  # each key's prefixes its own
    gen = dataclasses.replace(req.generate_request(max_tokens), scope=scope)
    need = req.n * state.coordinator.kv_need(len(ids), max_tokens)  # each choice its cache
    with (
        state.coordinator.reusing(gen, ids) as checkout,
        Slot(state, "generate"),
        state.ledger.hold(need, "this request"),
    ):
        state.count(kind)
        run = make_run(request, state, req, convention)
        run.peers = [make_run(request, state, req, convention, index=i) for i in range(1, req.n)]
        others = [(p.emit, p.stopped, c) for p, c in zip(run.peers, constraints[1:], strict=True)]

        def work():
            return state.coordinator.generate(
                gen, run.emit, arrived=arrived, prompt_ids=ids, until=run.stopped,
                checkout=checkout, constraint=constraints[0], others=others,
            )  # fmt: skip

        return await (run.stream(work) if req.stream else run.respond(work))


def unknown_model(name: str, served: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"the model {name!r} does not exist: this node serves {served!r} (GET /v1/models)",
        param="model",
        code="model_not_found",
    )


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
    bias = (req.adjust or {}).get("bias", {})
    if any(t >= state.spec.vocab_size for t in bias):
        raise OpenAIError(400, f"logit_bias names token {max(bias)}: the vocabulary has "
                          f"{state.spec.vocab_size}", param="logit_bias", code="invalid_value")  # fmt: skip
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


class Run:
    """One request's way through the coordinator: its text through the stop strings (and the
    tool-call parser), to the client as stream events or gathered for one response. The
    API's subclass gives the shapes."""

    keepalive = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see bytes

    def __init__(self, request: web.Request, state, req: CompletionRequest,
                 convention: Convention | None = None, index: int = 0):  # fmt: skip
        self.request, self.state, self.req, self.index = request, state, req, index
        self.peers: list[Run] = []  # the other choices (n > 1): the API's shapes send them
        self.stops = StopStrings(req.stop)
        self.sent = ""  # text streamed so far
        self.write: Writer | None = None
        self.tools = _Tools(state, req, convention) if convention is not None else None
        self.lps: list[tuple[str, float, list]] = []  # per token: (text, lp, top), if asked
        self.lps_sent = 0  # of those, how many went out in the stream
        self.texts: list[str] = []  # each token's text as streamed (where a stop cuts)

    # ---- the API's shapes ----

    async def start(self) -> None:
        """The stream's opening events."""

    async def piece(self, text: str) -> None:
        """Stream new answer text."""

    async def end(self, text: str, reason: str, use: dict, done: dict, calls: list) -> None:
        """The stream's closing events: what is left of the text, the calls, the reason."""

    def response(self, text: str, reason: str, use: dict, done: dict, calls: list) -> dict:
        raise NotImplementedError

    def failure(self, exc: OpenAIError) -> web.Response:
        """An error before the stream, in the API's shape."""
        raise NotImplementedError

    async def stream_failure(self, exc: Exception) -> None:
        """An error after the 200: it travels in the stream."""

    # ---- the run ----

    def stopped(self) -> bool:
        """Whether a stop string has ended this choice's text (the decode's `until`)."""
        return self.stops.hit

    async def emit(self, event: dict) -> None:
        if event.get("type") != "token":
            return
        text = event.get("text", "") if self.tools is None else self.tools.push(event["id"])
        self.texts.append(text)
        if "logprob" in event:
            label = self.state.coordinator.codec.token_text
            top = [(label(i), lp) for i, lp in event["top_logprobs"]]
            self.lps.append((label(event["id"]), event["logprob"], top))
        piece = self.stops.push(text)
        if piece and self.write is not None:
            self.sent += piece
            await self.piece(piece)

    def final(self, done: dict) -> tuple[str, str, dict]:
        """The answer's text, finish_reason (OpenAI's words) and usage, from `done`."""
        text = done["text"] if self.tools is None else self.tools.finish(done)
        cut = cut_at_stop(text, self.req.stop)
        stopped = cut is not None or self.stops.hit
        text = text[:cut] if cut is not None else text
        reason = "stop" if stopped or done.get("finish_reason") == "stop" else "length"
        if self.tools is not None and self.tools.calls and not stopped:
            reason = "tool_calls"
        return text, reason, usage(done["prompt_tokens"], len(done["tokens"]),
                                   done.get("cached_tokens", 0))  # fmt: skip

    def kept_logprobs(self, text: str, done: dict) -> list:
        """The log-probabilities of the tokens whose text the answer keeps (a stop string
        cuts the rest away)."""
        if self.tools is not None or len(text) >= len(done["text"]):
            return self.lps
        n, at = 0, 0
        while n < len(self.lps) and n < len(self.texts) and at < len(text):
            at += len(self.texts[n])
            n += 1
        return self.lps[:n]

    def calls(self, reason: str) -> list:
        """The answer's ToolCalls (when it ends in them)."""
        return self.tools.calls if self.tools is not None and reason == "tool_calls" else []

    async def respond(self, work: Callable[[], Awaitable[dict]]) -> web.StreamResponse:
        try:
            done = await while_connected(self.request, work(), on_lost=lambda: None)
        except ConnectionError as exc:
            return self._gone(exc)
        except Exception as exc:
            self.state.count("failed")
            if not isinstance(exc, ExoSplitError):
                log.exception("completion failed")
            return self.failure(OpenAIError(500, str(exc), code=type(exc).__name__))
        text, reason, use = self.final(done)
        return web.json_response(self.response(text, reason, use, done, self.calls(reason)))

    async def stream(self, work: Callable[[], Awaitable[dict]]) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(self.request)
        self.write = Writer(resp, self.state.timeouts.idle)

        async def heartbeat() -> None:
            if self.write.silent_for() >= HEARTBEAT_S:
                await self.write(self.keepalive)

        try:
            await self.start()
            done = await while_connected(self.request, work(), on_lost=lambda: None, tick=heartbeat)
            text, reason, use = self.final(done)
            await self.end(text, reason, use, done, self.calls(reason))
        except ConnectionError as exc:
            return self._gone(exc, resp)
        except Exception as exc:  # after the 200: the error travels in the stream
            self.state.count("failed")
            if not isinstance(exc, ExoSplitError):
                log.exception("completion failed")
            try:
                await self.stream_failure(exc)
            except ConnectionError:
                return self._gone(ClientGone("the client left during the error"), resp)
        await finish(self.request, resp, self.state.timeouts.idle)
        return resp

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
        self.text = TextStream(state.coordinator.codec, specials=True)
        self.stream = ToolStream(convention)
        self.calls: list = []

    def push(self, token: int) -> str:
        """The content this token releases."""
        return "" if token in self.eos else self.stream.push(self.text.push(token))

    def finish(self, done: dict) -> str:
        """The content of the whole answer; `calls` holds its tool calls."""
        ids = [t for t in done["tokens"] if t not in self.eos]
        content, self.calls = self.convention.parse(self.chat.raw_text(ids), self.tools)
        return content if self.calls else done["text"]
