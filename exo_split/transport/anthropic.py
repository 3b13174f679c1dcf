"""The JSON of the Anthropic Messages API (POST /v1/messages, POST /v1/messages/count_tokens):
request bodies in, messages, stream events and errors out. The handlers are in
node/anthropic.py.

A request is translated into the OpenAI API's (transport/openai.py) and checked there, so
both APIs share one meaning for every option: system -> a system message; text blocks ->
content; tool_use blocks -> an assistant turn's tool_calls; tool_result blocks -> tool
messages; tools' input_schema -> parameters; tool_choice auto / any / tool / none ->
auto / required / the named function / none (disable_parallel_tool_use ->
parallel_tool_calls false); stop_sequences -> stop. metadata is accepted (it changes
nothing); thinking, images and documents are refused, never ignored.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from exo_split.transport.openai import CompletionRequest, OpenAIError
from exo_split.transport.tools import ToolCall

# Fields that change nothing in the output (metadata.user_id, the caller's own bookkeeping).
_IGNORED = ("metadata", "service_tier", "container", "mcp_servers")
_MAPPED = (
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "exo_split",
)  # fmt: skip; exo_split: our own options, as in the OpenAI API
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_request_error")


def error_body(status: int, code: str | None, message: str) -> dict:
    """Anthropic's error object; its type follows the status as Anthropic's own do."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
            429: "rate_limit_error", 503: "overloaded_error"}.get(status, "api_error")  # fmt: skip
    return {"type": "error", "error": {"type": kind, "message": message}}


def to_openai(body: Any, *, counting: bool = False) -> CompletionRequest:
    """A Messages request as the OpenAI API's chat request (OpenAIError(400) if malformed)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - set(_MAPPED) - set(_IGNORED))
    if unknown:
        raise _bad(f"{unknown[0]} is not supported by exo-split", unknown[0])
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict)
                                     and thinking.get("type") == "disabled"):  # fmt: skip
        raise _bad("extended thinking is not supported by exo-split", "thinking")
    max_tokens = body.get("max_tokens")
    if not counting and max_tokens is None:
        raise _bad("max_tokens is required", "max_tokens")
    out: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    if not counting:
        out["max_tokens"] = max_tokens
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k"), ("stop", "stop_sequences"),
                         ("stream", "stream"), ("exo_split", "exo_split")):  # fmt: skip
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    if isinstance(out.get("temperature"), int | float) and not 0 <= out["temperature"] <= 1:
        raise _bad("temperature must be in [0, 1]", "temperature")
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
        out |= _tool_choice(body.get("tool_choice"))
    elif body.get("tool_choice") not in (None, {"type": "auto"}, {"type": "none"}):
        raise _bad("tool_choice needs tools", "tool_choice")
    return CompletionRequest.from_json(out, chat=True)


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role must be user or assistant", f"{where}.role")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _bad(f"{where}.content must be a string or a list of blocks", f"{where}.content")
        texts, calls = [], []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_use(block, at))
            elif kind == "tool_result" and role == "user":
                out.append(_tool_result(block, at))
            else:
                raise _bad(f"{at}: a {kind!r} block is not supported here (text, tool_use in "
                           "assistant turns, tool_result in user turns)", at)  # fmt: skip
        if calls:
            out.append({"role": "assistant", "content": "".join(texts) or None,
                        "tool_calls": calls})  # fmt: skip
        elif texts or not blocks:
            out.append({"role": role, "content": "".join(texts)})
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        for b in content
    ):
        return "".join(b["text"] for b in content)
    raise _bad(f"{where} must be a string or a list of text blocks", where)


def _tool_use(block: dict, at: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise _bad(f"{at}: a tool_use block needs an id and a name", at)
    if not isinstance(block.get("input"), dict):
        raise _bad(f"{at}.input must be an object", f"{at}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}  # fmt: skip


def _tool_result(block: dict, at: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise _bad(f"{at}.tool_use_id is required", f"{at}.tool_use_id")
    content = block.get("content", "")
    text = _text(content, f"{at}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or "name" not in tool:
            raise _bad(f"tools[{i}] must be an object with a name", f"tools[{i}]")
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"tools[{i}]: server tools ({tool['type']}) are not supported",
                       f"tools[{i}].type")  # fmt: skip
        fn = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> dict:
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise _bad("tool_choice.type must be auto, any, tool or none", "tool_choice")
    out = {"tool_choice": mapped}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


# ---- responses ----


def new_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": call.name,
            "input": call.arguments}  # fmt: skip


def usage(use: dict | None) -> dict:
    """Anthropic's usage from the OpenAI one (transport/openai.usage): `input_tokens` are the
    prompt positions computed for this request, `cache_read_input_tokens` those a prefix
    cache served (their sum is the whole prompt, as count_tokens counts it); nothing is
    written to a cache at a price, so `cache_creation_input_tokens` is 0."""
    use = use or {}
    prompt = use.get("prompt_tokens", 0)
    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": use.get("completion_tokens", 0)}  # fmt: skip


def message(msg_id: str, model: str, content: list[dict], stop_reason: str | None,
            stop_sequence: str | None, use: dict | None) -> dict:  # fmt: skip
    """A Messages API message; `use`: the OpenAI usage (None: nothing counted yet)."""
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(use)}  # fmt: skip


def event(kind: str, **fields) -> bytes:
    """One server-sent event of the stream: its name, and the JSON with the same type."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()
