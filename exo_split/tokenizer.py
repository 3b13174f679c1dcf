"""Prompt text <-> token ids, from a checkpoint's tokenizer.json (no torch, no mlx).

`detokenize` is the name for ids -> text here: "decode" is a phase of generation.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

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

    def token_text(self, token_id: int) -> str:
        """One token's own text, control tokens included (a log-probability's label)."""
        return self._tok.decode([token_id], skip_special_tokens=False)


class TextStream:
    """Incremental detokenization: feed ids one by one, get the new text each time.

    O(1) per token (tokenizers' DecodeStream keeps a short window of ids), where decoding
    every id so far each time costs O(n) per token. The pieces join to exactly what
    `detokenize` gives for all the ids, except that an incomplete UTF-8 character at the very
    end is held back: `finish(full_text)` returns that tail once the ids are complete.
    DecodeStream refuses byte tokens that form invalid UTF-8 inside the text (a byte-fallback
    vocabulary under random weights emits them): from there on this stream decodes every id
    so far for each token instead.
    """

    def __init__(self, codec: TextCodec, *, specials: bool = False):
        """`specials`: keep control tokens' text (a tool call's marker may be one, as
        Mistral's [TOOL_CALLS] is); `detokenize` drops them."""
        self._codec, self._skip = codec, not specials
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=self._skip)
        self._ids: list[int] = []
        self._emitted = 0  # characters handed out so far

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._codec._tok, token_id) or ""
            except Exception:  # tokenizers raises its own untyped error here
                self._stream = None
            else:
                self._emitted += len(piece)
                return piece
        text = self._codec._tok.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return ""
        piece, self._emitted = text[self._emitted :], len(text)
        return piece

    def finish(self, full_text: str) -> str:
        """What `push` held back, given `detokenize` of every id pushed."""
        tail, self._emitted = full_text[self._emitted :], len(full_text)
        return tail


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
