"""Stop strings (OpenAI's `stop`, Anthropic's `stop_sequences`): where text ends, found as it
streams, holding back what may be the start of one. Also the tool-call parser's marker hold
(transport/tools.py): the same question, whether the text's end may start a string."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_STOPS = 4  # as OpenAI


def parse_stops(stop: Any, bad: Callable[[str, str], Exception]) -> tuple[str, ...]:
    """OpenAI's `stop`: a string or up to MAX_STOPS strings (`bad(message, param)`: the
    error to raise)."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"at most {MAX_STOPS} stop strings, got {len(stops)}", "stop")
    return tuple(s for s in stops if s)


class StopStrings:
    """Text pieces in, text out up to the first stop string to appear (not included).

    Text that could be the start of a stop string is held back until the next piece says
    whether it is one: what comes out equals `cut(whole text)`, piece by piece."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hit = False
        self._held = ""

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        text = self._held + piece
        cut = cut_at_stop(text, self.stops)
        if cut is not None:
            self.hit, self._held = True, ""
            return text[:cut]
        keep = max((overlap(text, s) for s in self.stops), default=0)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]


def cut_at_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the text ends because of a stop string (None: it does not): at the start of the
    first one to be complete as the text grows (the earliest end; on a tie the longest), which
    is where a stream notices it."""
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


def overlap(text: str, stop: str) -> int:
    """The longest end of `text` that starts `stop` (shorter than `stop` itself)."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
