"""The OpenAI-compatible API of the decode node: POST /v1/chat/completions, POST
/v1/completions (streaming as server-sent events, or one JSON response) and GET /v1/models.

A request runs through node/api.py like every chat API's; this module gives OpenAI's shapes
(transport/openai.py): chunks with deltas, tool calls streamed as the name and then the
arguments, the report in an `exo_split` field.
"""

from __future__ import annotations

import dataclasses
import json
import time

from aiohttp import web

from exo_split.node.api import Run, serve, unknown_model
from exo_split.transport.openai import (
    CompletionRequest,
    OpenAIError,
    Reply,
    error_body,
    logprobs_block,
    model_card,
    models_list,
)
from exo_split.transport.server import STATE, error_shape, shaped_errors


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
        return _error(unknown_model(name, state.model_id))
    return web.json_response(model_card(state.model_id, state.started))


@shaped_errors(_openai_error)
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


def _complete(request: web.Request, *, chat: bool):
    def parse(body) -> CompletionRequest:
        return CompletionRequest.from_json(body, chat=chat)

    kind = "chat_completions" if chat else "completions"
    return serve(request, parse, _OpenAIRun, kind, _error)


@shaped_errors(_openai_error)
async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


def _error(exc: OpenAIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


class _OpenAIRun(Run):
    """One choice's shapes; the first choice's run also sends its `peers`' ends (n > 1)."""

    def __init__(self, request, state, req: CompletionRequest, convention=None, index=0):
        super().__init__(request, state, req, convention, index)
        self.reply = Reply.new(req.chat, int(time.time()), req.model, state.spec.fingerprint)

    async def start(self) -> None:
        for peer in self.peers:  # one stream, one id for every choice
            peer.write, peer.reply = self.write, dataclasses.replace(self.reply, index=peer.index)
        for run in (self, *self.peers):
            if self.req.chat:
                await run._send(run.reply.chunk("", **run._usage_null()))  # the role

    async def piece(self, text: str) -> None:
        await self._send(
            self.reply.chunk(text, logprobs=self._new_logprobs(), **self._usage_null())
        )

    def _new_logprobs(self, upto: int | None = None) -> dict | None:
        """The logprobs of the tokens streamed since the last chunk that carried some."""
        if self.req.logprobs is None:
            return None
        upto = len(self.lps) if upto is None else upto
        offset = sum(len(t) for t in self.texts[: self.lps_sent])  # where the first starts
        new, self.lps_sent = self.lps[self.lps_sent : upto], max(self.lps_sent, upto)
        return logprobs_block(self.req.chat, new, offset)

    async def end(self, text: str, reason: str, use: dict, done: dict, calls: list) -> None:
        report = {"exo_split": {"report": done["report"]}}
        await self._end_choice(text, reason, done, calls, {} if self.req.include_usage else report)
        for peer, d in zip(self.peers, done.get("others", []), strict=True):
            t, r, u = peer.final(d)
            use = _plus(use, u)
            await peer._end_choice(t, r, d, peer.calls(r), {"exo_split": {"report": d["report"]}})
        if self.req.include_usage:
            await self._send(self.reply.usage_chunk(use, **report))
        await self.write(b"data: [DONE]\n\n")

    async def _end_choice(self, text: str, reason: str, done: dict, calls: list,
                          extra: dict) -> None:  # fmt: skip
        """What is left of one choice's text, its calls, its finish_reason (with `extra`)."""
        rest = text[len(self.sent) :] if text.startswith(self.sent) else ""
        kept = len(self.kept_logprobs(text, done))
        if rest or (self.req.logprobs is not None and self.lps_sent < kept):
            await self._send(self.reply.chunk(rest, logprobs=self._new_logprobs(kept),
                                              **self._usage_null()))  # fmt: skip
        for i, call in enumerate(calls):  # the name first, then the arguments
            whole = call.to_openai(i)
            args, whole["function"]["arguments"] = whole["function"]["arguments"], ""
            for delta in (whole, {"index": i, "function": {"arguments": args}}):
                await self._send(self.reply.chunk(tool_calls=[delta], **self._usage_null()))
        await self._send(self.reply.chunk(None, reason, **self._usage_null(), **extra))

    def response(self, text: str, reason: str, use: dict, done: dict, calls: list) -> dict:
        out = self._response(text, reason, use, done, calls)
        for peer, d in zip(self.peers, done.get("others", []), strict=True):
            peer.reply = dataclasses.replace(self.reply, index=peer.index)
            t, r, u = peer.final(d)
            out["choices"] += peer._response(t, r, u, d, peer.calls(r))["choices"]
            out["usage"] = _plus(out["usage"], u)
            out["exo_split"].setdefault("choices", [done["report"]]).append(d["report"])
        return out

    def _response(self, text: str, reason: str, use: dict, done: dict, calls: list) -> dict:
        tool_calls = [c.to_openai() for c in calls] or None
        lps = None
        if self.req.logprobs is not None:
            lps = logprobs_block(self.req.chat, self.kept_logprobs(text, done))
        return self.reply.response(text, reason, use, done["report"], tool_calls, lps)

    def failure(self, exc: OpenAIError) -> web.Response:
        return _error(exc)

    async def stream_failure(self, exc: Exception) -> None:
        await self._send(error_body(500, type(exc).__name__, str(exc)))

    def _usage_null(self) -> dict:
        return {"usage": None} if self.req.include_usage else {}

    async def _send(self, obj: dict) -> None:
        await self.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


def _plus(use: dict, more: dict) -> dict:
    """Usage of one more choice of the same prompt: its completion tokens added."""
    n = use["completion_tokens"] + more["completion_tokens"]
    return use | {"completion_tokens": n, "total_tokens": use["prompt_tokens"] + n}


def add_routes(app: web.Application) -> None:
    error_shape(app, "/v1", _openai_error)  # /v1/responses, /v1/embeddings, a wrong method
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
