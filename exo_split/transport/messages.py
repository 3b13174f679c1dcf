"""The JSON bodies of the two node-to-node requests: POST /v1/prefill and POST /v1/generate,
and the chat messages a generate (or an OpenAI chat request) may carry: text only, with the
roles system, developer (read as system), user and assistant; content a string or a list of
text parts, as OpenAI's clients send it. A malformed conversation is a BadMessages naming the
message and the field, before any chat template runs.

Frozen dataclasses with `from_json`, which validates a body and raises ValueError (or
PromptTooLong) saying what is wrong, and `to_json`. No framework imports.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from exo_split.errors import BadMessages, PromptTooLong
from exo_split.kv import DTYPES
from exo_split.sampling import Sampling


@dataclass(frozen=True)
class PrefillRequest:
    """The body of POST /v1/prefill."""

    request_id: str
    token_ids: tuple[int, ...]
    sampling: Sampling = field(default_factory=Sampling)
    spec: dict | None = None  # the decode side's ModelSpec.to_dict()
    fingerprint: str = ""
    overlap: bool = True
    chunk: int | None = None
    dtype: str | None = None  # the KV dtype the decode side wants on the wire
    max_frame_bytes: int | None = None  # the largest LAYER payload the decode side accepts
    # Positions [0, start) the decode side already holds: only [start, n) is streamed.
    start: int = 0
    prefix_cache: bool = True  # False: neither reuse nor keep a prefix on the prefill node
    # Per layer, the last prompt positions the decode side keeps (sliding windows; None: all);
    # empty: every position of every layer. The prefill node checks it against its spec.
    keep: tuple[int | None, ...] = ()
    # The prefix-cache scope of the client behind it (transport/keys.py; "": the shared
    # token's): the prefill node reuses and keeps prefixes within it only.
    scope: str = ""

    def to_json(self) -> dict:
        return (
            {
                "request_id": self.request_id,
                "token_ids": list(self.token_ids),
                "sampling": self.sampling.to_dict(),
                "spec": self.spec,
                "fingerprint": self.fingerprint,
                "start_pos": 0,
                "overlap": self.overlap,
                "chunk": self.chunk,
                "dtype": self.dtype,
                "max_frame_bytes": self.max_frame_bytes,
                "start": self.start,
                "prefix_cache": self.prefix_cache,
            }
            | ({"keep": list(self.keep)} if self.keep else {})
            | ({"scope": self.scope} if self.scope else {})
        )

    @classmethod
    def from_json(cls, body: Any, *, max_tokens: int) -> PrefillRequest:
        """Validate a request body; ValueError says what is wrong."""
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids:
            raise ValueError("token_ids must be a non-empty list of integers")
        if len(ids) > max_tokens:
            raise PromptTooLong(
                f"{len(ids)} prompt tokens exceed this node's limit of {max_tokens} "
                "(--max-prompt-tokens)"
            )
        if not all(isinstance(t, int) and 0 <= t < 2**31 for t in ids):
            raise ValueError("token_ids must be non-negative integers")
        if body.get("start_pos", 0) != 0:
            raise ValueError("start_pos other than 0 (prefix reuse) is not supported")
        chunk = body.get("chunk")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        start = body.get("start", 0)
        if not isinstance(start, int) or not 0 <= start < len(ids):
            raise ValueError(f"start must be an integer in [0, {len(ids)}), got {start!r}")
        spec = body.get("spec")
        if spec is not None and not isinstance(spec, dict):
            raise ValueError("spec must be an object")
        dtype = body.get("dtype")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        frame = body.get("max_frame_bytes")
        if frame is not None and (not isinstance(frame, int) or frame < 1):
            raise ValueError(f"max_frame_bytes must be a positive integer, got {frame!r}")
        keep = body.get("keep", [])
        if not isinstance(keep, list) or not all(
            k is None or (type(k) is int and k >= 1) for k in keep
        ):
            raise ValueError(f"keep must be a list of positive integers or nulls, got {keep!r}")
        scope = body.get("scope", "")
        if not isinstance(scope, str) or len(scope) > 64:
            raise ValueError("scope must be a string of at most 64 characters")
        return cls(
            scope=scope,
            keep=tuple(keep),
            max_frame_bytes=frame,
            dtype=dtype,
            request_id=str(body.get("request_id", ""))[:64],
            token_ids=tuple(ids),
            sampling=Sampling.from_dict(body.get("sampling")),
            spec=spec,
            fingerprint=str(body.get("fingerprint", "")),
            overlap=bool(body.get("overlap", True)),
            chunk=chunk,
            start=start,
            prefix_cache=_flag(body, "prefix_cache"),
        )


@dataclass(frozen=True)
class GenerateRequest:
    """The body of POST /v1/generate."""

    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    # Chat messages [{"role", "content"}], rendered by the decode node's chat template.
    messages: tuple[dict[str, Any], ...] | None = None
    max_tokens: int = 64
    sampling: Sampling = field(default_factory=Sampling)
    prefill_peer: str | None = None  # "http://host:port"; None: the node's choice
    prefill: str = "auto"  # auto | remote | local
    overlap: bool = True
    chunk: int | None = None
    fallback: str = "local"  # local | none
    prefix_cache: bool = True  # False: this request neither reuses nor keeps a prefix
    ignore_eos: bool = False  # True: end-of-turn tokens do not end it (max_tokens does)
    tools: tuple[dict, ...] | None = None  # for the chat template (transport/tools.py)
    logprobs: int | None = None  # each token's log-probability and this many alternatives
    # Penalties, logit_bias, min_tokens (sampling.Adjust's keyword arguments, token ids as
    # ints); None: the logits as the model gives them.
    adjust: dict | None = None
    scope: str = ""  # the client's prefix-cache scope, set by the node (never by the body)

    @classmethod
    def from_json(cls, body: Any) -> GenerateRequest:
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        if (bad := lone_surrogate(body)) is not None:
            raise ValueError(bad[1])
        prompt, ids, messages = body.get("prompt"), body.get("token_ids"), body.get("messages")
        if sum(x is not None for x in (prompt, ids, messages)) != 1:
            raise ValueError("give exactly one of prompt (text), token_ids or messages (chat)")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        if ids is not None and not (
            isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids)
        ):
            raise ValueError("token_ids must be a list of non-negative integers")
        max_tokens = body.get("max_tokens", 64)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        prefill = body.get("prefill", "auto")
        if prefill not in ("auto", "remote", "local"):
            raise ValueError(f"prefill must be auto, remote or local, got {prefill!r}")
        fallback = body.get("fallback", "local")
        if fallback not in ("local", "none"):
            raise ValueError(f"fallback must be local or none, got {fallback!r}")
        chunk = body.get("chunk")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        return cls(
            prompt=prompt,
            token_ids=tuple(ids) if ids is not None else None,
            messages=tuple(check_messages(messages)) if messages is not None else None,
            max_tokens=max_tokens,
            sampling=Sampling.from_dict(body.get("sampling")),
            prefill_peer=body.get("prefill_peer") or None,
            prefill=prefill,
            overlap=bool(body.get("overlap", True)),
            chunk=chunk,
            fallback=fallback,
            prefix_cache=_flag(body, "prefix_cache"),
            ignore_eos=_flag(body, "ignore_eos", default=False),
        )


def _flag(body: dict, name: str, default: bool = True) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


# ---- chat messages (a /v1/generate body's `messages`, and the OpenAI API's) ----

CHAT_ROLES = ("system", "user", "assistant", "tool")
_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as [{"role", "content"}] with text content, as chat templates take them;
    an assistant turn may carry `tool_calls` (content then may be null), each as
    {"id", "type": "function", "function": {"name", "arguments": <object>}} (the JSON string
    OpenAI sends is parsed: templates write it out), and a `tool` turn (a result) carries
    `tool_call_id` and the function's `name`. BadMessages if malformed."""
    if not isinstance(messages, list) or not messages:
        raise BadMessages(f"messages must be a non-empty list, got {_kind(messages)}")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool call id -> the function it called
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadMessages(f"{where} must be an object, got {_kind(m)}", param=where)
        role = _ALIASES.get(m.get("role"), m.get("role"))
        if role not in CHAT_ROLES:
            raise BadMessages(
                f"{where}.role must be one of system, developer, user, assistant, tool; got "
                f"{m.get('role')!r}",
                param=f"{where}.role",
            )
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls:
            msg = {"role": role, "content": "" if m.get("content") is None
                   else _text(m.get("content"), f"{where}.content")}  # fmt: skip
            msg["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls", names)
        else:
            msg = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise BadMessages(f"{where}.tool_call_id is required: the id of the call this "
                                  "answers", param=f"{where}.tool_call_id")  # fmt: skip
            msg["tool_call_id"] = call_id
            name = m.get("name") or names.get(call_id)
            if isinstance(name, str):
                msg["name"] = name
        out.append(msg)
    return out


def _tool_calls(calls: Any, where: str, names: dict[str, str]) -> list[dict]:
    if not isinstance(calls, list):
        raise BadMessages(f"{where} must be a list", param=where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadMessages(f"{at} must be {{'id', 'type': 'function', 'function': "
                              "{'name', 'arguments'}}", param=at)  # fmt: skip
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise BadMessages(f"{at}.function.arguments is not JSON: {exc}",
                                  param=f"{at}.function.arguments") from exc  # fmt: skip
        if not isinstance(args, dict):
            raise BadMessages(f"{at}.function.arguments must be a JSON object",
                              param=f"{at}.function.arguments")  # fmt: skip
        call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{j}"
        names[call_id] = fn["name"]
        out.append({"id": call_id, "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})  # fmt: skip
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else _kind(part)
                raise BadMessages(
                    f"{where}[{j}] must be a text part ({{'type': 'text', 'text': ...}}), got "
                    f"{kind!r}: only text content is supported",
                    param=f"{where}[{j}]",
                )
            if not isinstance(part.get("text"), str):
                raise BadMessages(f"{where}[{j}].text must be a string", param=f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise BadMessages(
        f"{where} must be a string or a non-empty list of text parts, got {_kind(content)}",
        param=where,
    )


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# ---- text that is not Unicode ----

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(body: Any) -> tuple[str, str] | None:
    """Where a parsed JSON body holds a string that is not valid Unicode (a lone UTF-16
    surrogate escape such as "\\ud83d": what a JavaScript client sends for a cut emoji):
    (its place, a message saying so); None if every string is valid. Such text cannot be encoded or
    tokenized, so it is refused before anything runs. Walks the body without recursion."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, dict):
            todo += [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
            todo += [(f"{where} (a key)", k) for k in value if isinstance(k, str)]
        elif isinstance(value, list):
            todo += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, str) and (m := _SURROGATE.search(value)):
            return where, (
                f"{where or 'the body'} is not valid Unicode: a lone surrogate "
                f"\\u{ord(m.group()):04x} at character {m.start()} (send UTF-8 text, or an "
                "escaped pair for a character outside the BMP)"
            )
    return None
