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

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt text of checked messages, ending with the assistant turn's opening."""
        return self._apply(messages, tokenize=False)

    def token_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt token ids, exactly as transformers' apply_chat_template gives them."""
        return list(self._apply(messages, tokenize=True))

    def _apply(self, messages, *, tokenize: bool):
        from jinja2 import TemplateError

        try:
            return self._tok.apply_chat_template(
                list(messages),
                add_generation_prompt=True,
                tokenize=tokenize,
                return_dict=False,
            )
        except TemplateError as exc:  # e.g. a template that insists on alternating roles
            raise BadMessages(f"the model's chat template refused the messages: {exc}") from exc
