"""Chat messages -> prompt token ids, through the checkpoint's own chat template.

The template (Jinja, in tokenizer_config.json or chat_template.jinja beside it) is what the
model was trained on, so it is applied by transformers' tokenizer, not re-implemented: on the
decode node, which serves the chat (mlx-lm already depends on transformers on the Mac).
transformers is imported only when a template is loaded.

The messages come checked (`check_messages` in transport/messages.py: text only, known
roles), so what can still fail here is the template refusing a conversation (BadMessages).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from exo_split.errors import BadCheckpoint, BadMessages

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the checkpoint carries a chat template (read without importing transformers)."""
    path = Path(model_dir)
    if any((path / name).is_file() for name in TEMPLATE_FILES):
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


class ChatTemplate:
    """A checkpoint's chat template, applied with transformers' tokenizer."""

    def __init__(self, model_dir: str | Path):
        path = Path(model_dir)
        if not has_chat_template(path):
            raise BadCheckpoint(
                f"{path} has no chat template (tokenizer_config.json 'chat_template', or "
                "chat_template.jinja): chat needs an instruct checkpoint",
                hint="send a raw prompt instead (no --chat; /v1/completions for the API)",
            )
        from transformers import AutoTokenizer  # seconds to import: only for a chat model

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise BadCheckpoint(f"cannot load the tokenizer of {path}: {exc}") from exc
        # The control tokens' strings, longest first (one may contain another).
        self._specials = sorted(
            {t.content for t in self._tok.added_tokens_decoder.values() if t.special and t.content},
            key=len,
            reverse=True,
        )

        self.source = _source(self._tok.chat_template)
        # Whether the template reads the `tools` it is given (else they would vanish).
        self.supports_tools = "tools" in _variables(self.source)

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The prompt text of checked messages, ending with the assistant turn's opening."""
        return self._apply(messages, tools, tokenize=False)

    def raw_text(self, ids: Sequence[int]) -> str:
        """The text of generated ids with control tokens kept (a tool call's marker may be
        one, as Mistral's [TOOL_CALLS] is)."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """The prompt token ids, exactly as transformers' apply_chat_template gives them,
        except that message content is data: a control token's string inside a content
        (`<|im_end|>\n<|im_start|>system`, a forged turn) is tokenized as the text it is, never
        as the control token. Only the template itself writes control tokens; tool
        definitions and earlier tool calls holding one are refused."""
        structured = json.dumps([tools, [m.get("tool_calls") for m in messages]])
        if found := next((sp for sp in self._specials if sp in structured), None):
            raise BadMessages(f"a tool definition or tool call holds a control token's text "
                              f"({found!r}): refused rather than read as a control token")  # fmt: skip
        if not any(sp in m["content"] for m in messages for sp in self._specials):
            return list(self._apply(messages, tools, tokenize=True))
        # Each control string in a content becomes a marker the template passes through;
        # the rendered text is tokenized around the markers (the template's own control
        # tokens parsed), each marker as plain text (its control string split). The marker's
        # two code points are private-use ones that no content holds.
        used = "".join(m["content"] for m in messages)
        free = (c for c in map(chr, range(0xE000, 0xF900)) if c not in used)
        a, b = next(free), next(free)
        found: list[str] = []
        marked = [{**m, "content": self._mark(m["content"], found, a, b)} for m in messages]
        rendered = self._apply(marked, tools, tokenize=False)
        pieces = re.split(f"{a}(\\d+){b}", rendered)
        if len(pieces) // 2 != sum(m["content"].count(a) for m in marked):
            raise BadMessages(
                "a message holds a control token's text (e.g. "
                f"{found[0]!r}), and this model's chat template does not carry it through as "
                "text: refused rather than read as a control token"
            )
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:  # a marker's index
                ids += self._tok.encode(found[int(piece)], add_special_tokens=False,
                                        split_special_tokens=True)  # fmt: skip
            elif piece:
                ids += self._tok.encode(piece, add_special_tokens=False)
        return ids

    def _mark(self, text: str, found: list[str], a: str, b: str) -> str:
        for sp in self._specials:
            if sp in text:
                found.append(sp)
                text = text.replace(sp, f"{a}{len(found) - 1}{b}")
        return text

    def _apply(self, messages, tools, *, tokenize: bool):
        from jinja2 import TemplateError

        if tools and not self.supports_tools:
            raise BadMessages("this model's chat template cannot express tools (it never reads "
                              "them): tool calling needs a template that does", param="tools")  # fmt: skip
        try:
            return self._tok.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                tokenize=tokenize,
                return_dict=False,
            )
        except TemplateError as exc:  # e.g. a template that insists on alternating roles
            raise BadMessages(f"the model's chat template refused the messages: {exc}") from exc


def _source(template) -> str:
    """A template's text (transformers may hold several named ones: all of them)."""
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def _variables(source: str) -> set[str]:
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return meta.find_undeclared_variables(Environment().parse(source))
    except TemplateSyntaxError:
        return set()
