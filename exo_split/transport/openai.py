"""The JSON of the OpenAI-compatible endpoints (no aiohttp, no framework): request bodies in,
responses, stream chunks and errors out. The handlers are in node/openai.py.

- POST /v1/chat/completions (messages, through the model's chat template) and
  POST /v1/completions (a raw prompt), streaming (SSE) or not; GET /v1/models.
- Options: max_tokens (max_completion_tokens), temperature, top_p, seed, stop, stream,
  stream_options.include_usage, ignore_eos, tools / tool_choice / parallel_tool_calls and
  response_format (transport/tools.py). Options that would change the output and that
  exo-split does not implement (best_of, top_k, ...) are refused, not ignored. n (up to 8)
  choices decode side by side, choice i with the seed plus i. Penalties,
  logit_bias and min_tokens change the logits before the rule (sampling.Adjust). logprobs
  (top_logprobs up to 20) come from the decode loop, first token included.
- Without a seed, a random one is drawn per request, as OpenAI samples without one.
- exo-split's own options travel in an "exo_split" object (the openai client's extra_body):
  {"prefill": "auto|remote|local", "prefill_peer": "HOST:PORT", "fallback": "local|none"}.
- Every error is {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from exo_split.errors import BadMessages
from exo_split.sampling import MAX_TOP_LOGPROBS, Sampling
from exo_split.transport.messages import GenerateRequest, check_messages, lone_surrogate
from exo_split.transport.stops import parse_stops
from exo_split.transport.tools import (
    BadTools,
    check_response_format,
    check_tool_choice,
    check_tools,
)

DEFAULT_MAX_TOKENS = 512  # when the request names none (capped by the context left)
MAX_CHOICES = 8  # n: choices decode side by side in the node's batch
# Options we refuse unless they have their neutral value: (name, is it neutral?, why not).
# Each would change the output; none is ever ignored (docs/api.md lists every field).
_SAMPLER = (
    "exo-split's one sampling rule (sampling.py) has temperature, top_p, penalties "
    "and logit_bias only"
)
_UNSUPPORTED = (
    ("best_of", lambda v: v in (None, 1), "no server-side ranking of choices: send n"),
    ("echo", lambda v: v in (None, False), "not implemented"),
    ("suffix", lambda v: v in (None, ""), "no fill-in-the-middle"),
    ("top_k", lambda v: v in (None, 0, -1), _SAMPLER),
    ("min_p", lambda v: v in (None, 0), _SAMPLER),
    ("functions", lambda v: not v, "the legacy function API: send tools"),
    ("modalities", lambda v: v in (None, ["text"]), "text is the only output"),
    ("audio", lambda v: not v, "text is the only output"),
    ("prediction", lambda v: not v, "no predicted outputs"),
    ("web_search_options", lambda v: not v, "no web search"),
    ("reasoning_effort", lambda v: v is None, "not implemented"),
)


class OpenAIError(Exception):
    """An error answered in OpenAI's shape, with its HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return error_body(self.status, self.code, str(self), param=self.param)


def error_body(status: int, code: str | None, message: str, *, param: str | None = None) -> dict:
    """OpenAI's error object; the type follows the status as OpenAI's own errors do."""
    kind = {401: "authentication_error", 404: "invalid_request_error"}.get(status)
    kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class CompletionRequest:
    """A chat (`messages`) or completion (`prompt` text or `token_ids`) request, checked."""

    chat: bool
    model: str
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS, within the context left
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # decode to max_tokens past end-of-turn tokens (benchmarks)
    # Tool calling and structured output (transport/tools.py): the checked tools, the choice
    # ("auto", "none", "required" or the named tool), and the schema response_format asks for.
    tools: tuple[dict, ...] | None = None
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    schema: dict | None = None
    logprobs: int | None = None  # None: none; n: each token's log-probability and n more
    adjust: dict | None = None  # penalties, logit_bias, min_tokens (sampling.Adjust)
    n: int = 1  # choices of the one prompt; choice i samples with the seed plus i
    # exo-split's own options, in the body's "exo_split" object (the openai client's
    # extra_body): where to prefill, as POST /v1/generate takes them.
    split: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Any, *, chat: bool) -> CompletionRequest:
        """Check a request body; OpenAIError(400) names the parameter that is wrong."""
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        if (bad := lone_surrogate(body)) is not None:
            raise _bad(bad[1], bad[0] or None, "invalid_unicode")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _bad("model is required: the id GET /v1/models lists", "model", "missing")
        for name, neutral, why in _UNSUPPORTED:
            if name in body and not _is_neutral(neutral, body[name]):
                raise _bad(
                    f"{name}={body[name]!r} is not supported by exo-split: {why}",
                    name,
                    "unsupported_parameter",
                )
        _check_tool_choice(body)
        try:
            fields: dict[str, Any] = _tool_fields(body, chat)
        except BadTools as exc:
            raise _bad(str(exc), exc.param) from exc
        if chat:
            try:
                fields["messages"] = tuple(check_messages(body.get("messages")))
            except BadMessages as exc:
                raise _bad(str(exc), exc.param) from exc
        else:
            fields |= _prompt(body.get("prompt"))
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise _bad(f"stream must be true or false, got {stream!r}", "stream")
        if options and not stream:
            raise _bad("stream_options is only allowed with stream: true", "stream_options")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise _bad(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos")
        return cls(
            chat=chat,
            model=model,
            max_tokens=_max_tokens(body),
            sampling=_sampling(body),
            stop=parse_stops(body.get("stop"), _bad),
            stream=stream,
            include_usage=stream and bool(options.get("include_usage")),
            ignore_eos=ignore_eos,
            logprobs=_logprobs(body, chat),
            adjust=_adjust(body),
            n=_choices(body),
            split=_split_options(body.get("exo_split")),
            **fields,
        )

    @property
    def calls_tools(self) -> bool:
        """Whether the model is told about tools and its output parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_call(self) -> bool:
        return bool(self.tools) and self.tool_choice not in ("auto", "none")

    def generate_request(self, max_tokens: int) -> GenerateRequest:
        """What the decode node runs: the node picks the prefill peer (prefill: auto)."""
        return GenerateRequest(
            prompt=self.prompt,
            token_ids=self.token_ids,
            messages=self.messages,
            max_tokens=max_tokens,
            sampling=self.sampling,
            ignore_eos=self.ignore_eos,
            tools=self.tools if self.calls_tools else None,
            logprobs=self.logprobs,
            adjust=self.adjust,
            **self.split,
        )


def _choices(body: dict) -> int:
    n = body.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= MAX_CHOICES):
        raise _bad(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", "n")
    return n or 1


def _adjust(body: dict) -> dict | None:
    """presence_penalty, frequency_penalty (-2..2), repetition_penalty (> 0), logit_bias
    ({token id: -100..100}, at most 300) and min_tokens, as sampling.Adjust takes them."""
    out: dict[str, Any] = {}
    for name, key in (("presence_penalty", "presence"), ("frequency_penalty", "frequency")):
        value = _number(body, name, 0.0, -2.0, 2.0)
        if value:
            out[key] = value
    rep = _number(body, "repetition_penalty", 1.0, 0.0, 10.0)
    if rep == 0:
        raise _bad("repetition_penalty must be above 0", "repetition_penalty")
    if rep != 1.0:
        out["repetition"] = rep
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict) or len(bias) > 300:
            raise _bad("logit_bias must map at most 300 token ids to biases", "logit_bias")
        out["bias"] = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isdigit()) or not (
                isinstance(value, int | float) and not isinstance(value, bool)
                and -100 <= value <= 100
            ):  # fmt: skip
                raise _bad(f"logit_bias[{key!r}] must map a token id to a number in "
                           "[-100, 100]", "logit_bias")  # fmt: skip
            out["bias"][int(key)] = float(value)
    least = body.get("min_tokens")
    if least is not None and (not _is_int(least) or least < 0):
        raise _bad("min_tokens must be a non-negative integer", "min_tokens")
    if least:
        out["min_tokens"] = least
    return out or None


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: logprobs true (with top_logprobs alternatives, up to 20); completions: logprobs
    is the number of alternatives (up to 5, as OpenAI's legacy endpoint)."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if value not in (None, True, False):
            raise _bad(f"logprobs must be true or false, got {value!r}", "logprobs")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise _bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                       "top_logprobs")  # fmt: skip
        if top and not value:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if value else None
    if top is not None:
        raise _bad("top_logprobs is a chat option: completions take logprobs=N", "top_logprobs")
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= 5:
        raise _bad("logprobs must be an integer in [0, 5]", "logprobs")
    return value


def _is_neutral(neutral, value: Any) -> bool:
    try:
        return bool(neutral(value))
    except (AttributeError, TypeError):  # e.g. response_format that is not an object
        return False


def _check_tool_choice(body: dict) -> None:
    """tool_choice without tools can only say what no tools means ("none", "auto")."""
    choice = body.get("tool_choice")
    if not body.get("tools") and choice not in (None, "none", "auto"):
        raise _bad(f"tool_choice={choice!r} needs tools", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be true or false", "parallel_tool_calls")


def _tool_fields(body: dict, chat: bool) -> dict:
    out: dict[str, Any] = {}
    if body.get("tools"):
        if not chat:
            raise BadTools("tools need /v1/chat/completions", "tools")
        out["tools"] = check_tools(body["tools"])
        out["tool_choice"] = check_tool_choice(body.get("tool_choice"), out["tools"])
        out["parallel_tool_calls"] = body.get("parallel_tool_calls", True)
    schema = check_response_format(body.get("response_format"))
    if schema is not None:
        if out.get("tool_choice") not in (None, "auto", "none"):
            raise BadTools("response_format and a required tool call cannot both constrain "
                           "the output", "response_format")  # fmt: skip
        out["schema"] = schema
    return out


SPLIT_OPTIONS = {"prefill": ("auto", "remote", "local"), "fallback": ("local", "none")}


def _split_options(options: Any) -> dict[str, Any]:
    """{"prefill": auto|remote|local, "prefill_peer": "host:port", "fallback": local|none,
    "prefix_cache": true|false}."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise _bad("exo_split must be an object", "exo_split")
    out: dict[str, Any] = {}
    for name, value in options.items():
        if (
            name in SPLIT_OPTIONS
            and value in SPLIT_OPTIONS[name]
            or name == "prefill_peer"
            and isinstance(value, str)
            or name == "prefix_cache"
            and isinstance(value, bool)
        ):
            out[name] = value
        else:
            allowed = ", ".join(f"{k}: {'|'.join(v)}" for k, v in SPLIT_OPTIONS.items())
            raise _bad(
                f"exo_split.{name}={value!r} is not an option ({allowed}; prefill_peer: "
                "HOST:PORT; prefix_cache: true|false)",
                f"exo_split.{name}",
            )
    return out


def _prompt(prompt: Any) -> dict:
    """A completion prompt: a string, a list of token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return {"token_ids": tuple(prompt)}
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise _bad(f"one prompt per request, got {len(prompt)}", "prompt")
    raise _bad("prompt must be a string or a non-empty list of token ids", "prompt")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _max_tokens(body: dict) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    name = name or "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise _bad(f"{name} must be a positive integer, got {value!r}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", name)
    return float(value)


def _sampling(body: dict) -> Sampling:
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad(f"seed must be an integer, got {seed!r}", "seed")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise _bad("top_p must be above 0", "top_p")
    return Sampling(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),  # OpenAI's default: 1
        top_p=top_p,
        seed=secrets.randbits(63) if seed is None else seed % 2**64,
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt positions whose KV a prefix cache (the
    decode node's or the prefill node's) held, so they were not computed."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class Reply:
    """What every response and chunk of one request shares."""

    chat: bool
    id: str
    created: int
    model: str
    fingerprint: str
    index: int = 0  # the choice (n > 1)

    @classmethod
    def new(cls, chat: bool, created: int, model: str, fingerprint: str) -> Reply:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat, f"{prefix}-{secrets.token_hex(12)}", created, model, fingerprint)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}  # fmt: skip

    def response(self, text: str, finish_reason: str, use: dict, report: dict,
                 tool_calls: list[dict] | None = None, logprobs: dict | None = None) -> dict:  # fmt: skip
        """The whole (non-streaming) response; with tool calls, content is null if empty."""
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
            choice = {"index": self.index, "message": message}
        else:
            choice = {"index": self.index, "text": text}
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        head = self._head("chat.completion" if self.chat else "text_completion")
        return head | {"choices": [choice], "usage": use, "exo_split": {"report": report}}

    def chunk(self, text: str | None = None, finish_reason: str | None = None,
              tool_calls: list[dict] | None = None, logprobs: dict | None = None,
              **extra) -> dict:  # fmt: skip
        """One stream chunk: new text, tool call deltas, or the end (finish_reason); `extra`
        adds fields."""
        if self.chat:
            delta = {} if text is None else {"content": text}
            if tool_calls:
                delta = {"tool_calls": tool_calls}
            if text == "" and finish_reason is None:  # the first chunk names the role
                delta = {"role": "assistant", "content": ""}
            choice = {"index": self.index, "delta": delta}
        else:
            choice = {"index": self.index, "text": text or ""}
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return head | {"choices": [choice]} | extra

    def usage_chunk(self, use: dict, **extra) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return head | {"choices": [], "usage": use} | extra


def logprobs_block(chat: bool, entries: list[tuple[str, float, list[tuple[str, float]]]],
                   offset: int = 0) -> dict:  # fmt: skip
    """OpenAI's logprobs of some tokens, each (its text, its log-probability, the top
    alternatives as (text, lp)): chat's {"content": [...]}, or the completions endpoint's
    parallel lists (`offset`: where the first token's text starts in the answer)."""
    if chat:

        def one(t, lp):
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace"))}

        return {"content": [one(t, lp) | {"top_logprobs": [one(a, b) for a, b in top]}
                            for t, lp, top in entries]}  # fmt: skip
    offsets, at = [], offset
    for t, _, _ in entries:
        offsets.append(at)
        at += len(t)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}  # fmt: skip


def models_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model_id, created)]}


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "exo-split"}
