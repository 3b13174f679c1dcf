"""Tool calls and structured output in the OpenAI API (no framework; the handlers are in
node/openai.py, the grammar engine in node/grammar.py).

- `check_tools` / `check_tool_choice` / `check_response_format`: the request's fields, checked,
  with OpenAIError-ready (message, param) errors as `BadTools`.
- A `Convention` is how a checkpoint's chat template writes a tool call (read from the
  template's text): Hermes / Qwen `<tool_call>{json}</tool_call>`, Llama 3.x's bare JSON with
  "parameters", Mistral's `[TOOL_CALLS][{...}]`. It parses the model's output into OpenAI's
  `tool_calls` and builds the grammar (llguidance's JSON form) that forces a call when
  tool_choice is "required" or names a function.
- `ToolStream` splits streamed text into content pieces and whole tool calls.

Constrained JSON is written in one canonical form (", " and ": " separators, no other
whitespace): a model cannot spend its tokens on blank space, and the output parses the same
everywhere.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from exo_split.transport.stops import overlap

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class BadTools(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# ---- the request's fields ----


def check_tools(tools: Any) -> tuple[dict, ...]:
    """OpenAI's `tools` as [{"type": "function", "function": {name, description?,
    parameters?}}], checked; each function's parameters default to any object."""
    if not isinstance(tools, list) or not tools:
        raise BadTools("tools must be a non-empty list of functions", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadTools(f"{where} must be {{'type': 'function', 'function': ...}}", where)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadTools(f"{where}.function must be an object with a name", where)
        name = fn["name"]
        if not NAME.match(name):
            raise BadTools(f"{where}.function.name {name!r} must match [A-Za-z0-9_-]{{1,64}}",
                           f"{where}.function.name")  # fmt: skip
        if name in names:
            raise BadTools(f"two tools are named {name!r}", f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadTools(f"{where}.function.parameters must be a JSON schema object",
                           f"{where}.function.parameters")  # fmt: skip
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise BadTools(f"{where}.function.description must be a string",
                           f"{where}.function.description")  # fmt: skip
        function = {"name": name, "parameters": params}
        if desc is not None:
            function["description"] = desc
        out.append({"type": "function", "function": function})
    return tuple(out)


def check_tool_choice(choice: Any, tools: tuple[dict, ...]) -> str | dict:
    """ "auto" | "none" | "required" | the tool a named choice names (its dict)."""
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise BadTools("tool_choice must be auto, none, required or "
                       "{'type': 'function', 'function': {'name': ...}}", "tool_choice")  # fmt: skip
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool
    raise BadTools(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")


def check_response_format(fmt: Any) -> dict | None:
    """The JSON schema a response_format asks for (json_object: any object); None: text."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadTools("response_format.json_schema.schema must be a JSON schema object",
                           "response_format.json_schema.schema")  # fmt: skip
        return schema
    raise BadTools("response_format.type must be text, json_object or json_schema",
                   "response_format.type")  # fmt: skip


def json_grammar(schema: dict) -> dict:
    """llguidance's grammar for one JSON value of `schema`, in the canonical form."""
    return {"grammars": [{"json_schema": _styled(schema)}]}


def _styled(schema: dict) -> dict:
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


# ---- conventions ----


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
               "function": {"name": self.name,
                            "arguments": json.dumps(self.arguments, ensure_ascii=False)}}  # fmt: skip
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class Convention:
    """How one family of chat templates writes tool calls."""

    name: str
    start: str  # the text that opens a call (or the calls)
    end: str  # the text that closes one call ("" when the output's end does)
    args_key: str  # "arguments" or "parameters"
    separator: str  # between parallel calls ("" when only one call is allowed)

    def parse(self, text: str, tools: tuple[dict, ...]) -> tuple[str, list[ToolCall]]:
        """(the content before the calls, the calls); ([text], []) when the text holds no
        well-formed call of a declared tool: then it is all content, as vLLM answers."""
        if self.start:
            at = text.find(self.start)
            if at < 0:
                return text, []
            content, rest = text[:at].strip(), text[at + len(self.start) :]
        else:  # Llama 3: the call is the whole output, a JSON object
            content, rest = "", text.strip().removeprefix("<|python_tag|>")
            if not rest.startswith("{"):
                return text, []
        calls = self._calls(rest)
        names = {t["function"]["name"] for t in tools}
        if not calls or any(c.name not in names for c in calls):
            return text, []
        return content, calls

    def _calls(self, rest: str) -> list[ToolCall]:
        if self.name == "mistral":
            objs = _loads(rest.strip())
            objs = objs if isinstance(objs, list) else None
        elif self.end:
            pieces = [p.split(self.end, 1)[0] for p in rest.split(self.start)]
            objs = [_loads(p.strip()) for p in pieces]
        else:
            objs = [_loads(p.strip()) for p in rest.split(";")]
        calls = []
        for obj in objs or [None]:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return []
            args = obj.get(self.args_key, obj.get("arguments", {}))
            args = _loads(args) if isinstance(args, str) else args
            if not isinstance(args, dict):
                return []
            calls.append(ToolCall(obj["name"], args))
        return calls

    def grammar(self, tools: tuple[dict, ...], choice: str | dict, parallel: bool) -> dict:
        """The grammar that makes the output one call (several with `parallel`) of `choice`'s
        tool, or of any tool when choice is "required"."""
        chosen = tools if choice == "required" else (choice,)
        options = [self._call_schema(t["function"]) for t in chosen]
        obj = options[0] if len(options) == 1 else {"anyOf": options}
        if self.name == "mistral":
            array = {"type": "array", "items": obj, "minItems": 1}
            array |= {} if parallel else {"maxItems": 1}
            lark = f"start: {_lit(self.start)} %json {json.dumps(_styled(array))}"
        else:
            call = f"{_lit(self.start)} %json {json.dumps(_styled(obj))} {_lit(self.end)}"
            many = parallel and self.separator
            lark = f"start: call ({_lit(self.separator)} call)*\n" if many else "start: call\n"
            lark += f"call: {call}"
        return {"grammars": [{"lark_grammar": lark}]}

    def _call_schema(self, fn: dict) -> dict:
        return {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, self.args_key: fn["parameters"]},
            "required": ["name", self.args_key],
            "additionalProperties": False,
        }


HERMES = Convention("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", "\n")
LLAMA3 = Convention("llama3", "", "", "parameters", "")
MISTRAL = Convention("mistral", "[TOOL_CALLS]", "", "arguments", "")


def convention_of(template: str) -> Convention | None:
    """The convention a chat template's text writes tool calls in; None: none we know."""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return None


def _lit(text: str) -> str:
    return json.dumps(text) if text else '""'


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


# ---- streaming ----


class ToolStream:
    """Streamed text in; content pieces out at once, and the text from the first call's
    opening on held back (the calls are parsed whole when they are complete, at the end).
    Text that may be the start of the opening is held until the next piece says."""

    def __init__(self, convention: Convention):
        self.start = convention.start
        self.held = ""
        self.in_call = False
        self.content = False  # content released: a Llama 3 call can no longer start

    def push(self, piece: str) -> str:
        """The content this piece releases."""
        if self.in_call:
            self.held += piece
            return ""
        text = self.held + piece
        if not self.start:  # Llama 3: a call is the whole output, opening with "{"
            lead = text.lstrip()
            if self.content or (lead and not lead.startswith(("{", "<|python_tag|>"))):
                self.content, self.held = True, ""
                return text
            self.held, self.in_call = text, bool(lead)
            return ""
        at = text.find(self.start)
        if at >= 0:
            self.in_call, self.held = True, text[at:]
            return text[:at]
        keep = overlap(text, self.start)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]
