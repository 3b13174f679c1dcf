"""The Anthropic Messages API of the decode node: POST /v1/messages (streaming with
Anthropic's event sequence, or one message) and POST /v1/messages/count_tokens, so that an
Anthropic client (Claude Code with ANTHROPIC_BASE_URL and ANTHROPIC_MODEL) talks to it.

The body is translated into the OpenAI API's request (transport/anthropic.py) and runs through
node/api.py like every chat API's: the same admission, prefix caches, grammar for a required
tool call and cancellation. Auth takes `x-api-key` or `Authorization: Bearer` (the
middleware's); errors come as {"type": "error", "error": {"type", "message"}}.

Stream: message_start, ping, then per content block content_block_start / _delta (text_delta,
or input_json_delta with a tool's input) / _stop, then message_delta (stop_reason,
stop_sequence, usage) and message_stop; an error after the 200 is an `error` event.
"""

from __future__ import annotations

import json

from aiohttp import web

from exo_split.node.api import Run, serve
from exo_split.transport.anthropic import (
    STOP_REASONS,
    error_body,
    event,
    message,
    new_id,
    to_openai,
    tool_use_block,
    usage,
)
from exo_split.transport.openai import CompletionRequest, OpenAIError
from exo_split.transport.server import STATE, error_shape, shaped_errors


def _anthropic_error(status: int, code: str, message: str) -> dict:
    return error_body(status, code, message)


def _error(exc: OpenAIError) -> web.Response:
    return web.json_response(error_body(exc.status, exc.code, str(exc)), status=exc.status)


@shaped_errors(_anthropic_error)
async def messages(request: web.Request) -> web.StreamResponse:
    return await serve(request, to_openai, _MessagesRun, "messages", _error)


@shaped_errors(_anthropic_error)
async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"the body is not JSON: {exc}") from exc
        req = to_openai(body, counting=True)
        if req.model != state.model_id:
            raise OpenAIError(404, f"the model {req.model!r} does not exist: this node serves "
                              f"{state.model_id!r}")  # fmt: skip
        try:
            ids = await state.coordinator.tokenize_off_loop(req.generate_request(1))
        except (ValueError, TypeError) as exc:  # BadMessages, a template's refusal
            raise OpenAIError(400, str(exc)) from exc
    except OpenAIError as exc:
        return _error(exc)
    return web.json_response({"input_tokens": len(ids)})


class _MessagesRun(Run):
    keepalive = event("ping")

    def __init__(self, request, state, req: CompletionRequest, convention=None):
        super().__init__(request, state, req, convention)
        self.id = new_id()
        self.blocks = 0  # content blocks opened so far
        self.text_open = False

    def _stop(self, text: str, reason: str, done: dict) -> tuple[str, str | None]:
        """(Anthropic's stop_reason, the stop sequence that ended it or None)."""
        full = done["text"]
        hit = [s for s in self.req.stop if full.find(s) == len(text)] if reason == "stop" else []
        if hit:
            return "stop_sequence", max(hit, key=len)
        return STOP_REASONS.get(reason, "end_turn"), None

    def _content(self, text: str, calls: list) -> list[dict]:
        blocks = [{"type": "text", "text": text}] if text or not calls else []
        return blocks + [tool_use_block(c) for c in calls]

    async def start(self) -> None:
        head = message(self.id, self.req.model, [], None, None, None)
        await self.write(event("message_start", message=head))
        await self.write(event("ping"))

    async def piece(self, text: str) -> None:
        if not self.text_open:
            await self.write(event("content_block_start", index=self.blocks,
                                   content_block={"type": "text", "text": ""}))  # fmt: skip
            self.text_open = True
            self.blocks += 1
        await self.write(event("content_block_delta", index=self.blocks - 1,
                               delta={"type": "text_delta", "text": text}))  # fmt: skip

    async def end(self, text: str, reason: str, use: dict, done: dict, calls: list) -> None:
        if text.startswith(self.sent) and len(text) > len(self.sent):
            await self.piece(text[len(self.sent) :])
        if self.text_open:
            await self.write(event("content_block_stop", index=self.blocks - 1))
        for call in calls:
            block = tool_use_block(call)
            start = {**block, "input": {}}
            await self.write(event("content_block_start", index=self.blocks, content_block=start))
            partial = json.dumps(block["input"], ensure_ascii=False)
            await self.write(event("content_block_delta", index=self.blocks,
                                   delta={"type": "input_json_delta", "partial_json": partial}))  # fmt: skip
            await self.write(event("content_block_stop", index=self.blocks))
            self.blocks += 1
        stop_reason, stop_sequence = self._stop(text, reason, done)
        await self.write(event(
            "message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            usage=usage(use),
            exo_split={"report": done["report"]},
        ))  # fmt: skip
        await self.write(event("message_stop"))

    def response(self, text: str, reason: str, use: dict, done: dict, calls: list) -> dict:
        stop_reason, stop_sequence = self._stop(text, reason, done)
        out = message(self.id, self.req.model, self._content(text, calls), stop_reason,
                      stop_sequence, use)  # fmt: skip
        return out | {"exo_split": {"report": done["report"]}}

    def failure(self, exc: OpenAIError) -> web.Response:
        return _error(exc)

    async def stream_failure(self, exc: Exception) -> None:
        await self.write(event("error", error=error_body(500, None, str(exc))["error"]))


def add_routes(app: web.Application) -> None:
    error_shape(app, "/v1/messages", _anthropic_error)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
