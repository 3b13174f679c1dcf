"""Prompt text <-> token ids, from a checkpoint's tokenizer.json (no torch, no mlx).

`detokenize` is the name for ids -> text here: "decode" is a phase of generation.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from exo_split.errors import BadCheckpoint


class TextCodec:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir)
        try:
            self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises its own untyped errors
            raise BadCheckpoint(f"cannot load {path / 'tokenizer.json'}: {exc}") from exc
        self.eos_ids = frozenset(_eos_ids(path))

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class TextStream:
    """Incremental detokenization: feed ids one by one, get the new text each time."""

    def __init__(self, codec: TextCodec):
        self._codec = codec
        self._ids: list[int] = []
        self._text = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._codec.detokenize(self._ids)
        # Hold back an incomplete UTF-8 sequence until the next token completes it.
        if text.endswith("\ufffd"):
            return ""
        new, self._text = text[len(self._text) :], text
        return new


def _eos_ids(path: Path) -> list[int]:
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if not f.is_file():
            continue
        try:
            eos = json.loads(f.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            continue
        if eos is None:
            continue
        return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
    return []
