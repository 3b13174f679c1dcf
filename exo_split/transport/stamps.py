"""END's per-piece stamps: the prefill node's compute and send times of every piece, as
columns of integer microseconds (docs/protocol.md, docs/metrics.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from exo_split.transport.wire import END_STAMPS, _is_int, _require


def end_record(
    prefill_start: float, prefill_end: float, overlap: bool, stamps: dict[str, Sequence[float]]
) -> dict[str, Any]:
    """The END object: per-piece stamps (END_STAMPS, prefill clock) as columns of integer
    microseconds after `prefill_start`, so 8,192 pieces take about 0.2 MB."""
    origin = prefill_start
    pieces = {k: [round((t - origin) * 1e6) for t in stamps[k]] for k in END_STAMPS}
    return {"prefill_start": prefill_start, "prefill_end": prefill_end, "overlap": overlap,
            "pieces": pieces}  # fmt: skip


def parse_end(obj: dict[str, Any], n_pieces: int) -> dict[str, list[float]]:
    """END's per-piece stamps as seconds on the prefill clock; ProtocolError unless END
    carries `prefill_start`/`prefill_end` and one integer stamp of each kind per piece."""
    origin = obj.get("prefill_start")
    ok = all(_is_number(obj.get(k)) for k in ("prefill_start", "prefill_end"))
    pieces = obj.get("pieces")
    ok = ok and isinstance(pieces, dict)
    ok = ok and all(
        isinstance(pieces.get(k), list)
        and len(pieces[k]) == n_pieces
        and all(_is_int(x) and abs(x) < 2**53 for x in pieces[k])
        for k in END_STAMPS
    )
    _require(ok, "END", f"prefill_start/prefill_end and {n_pieces} integer "
             f"{'/'.join(END_STAMPS)} stamps", _shape(obj))  # fmt: skip
    return {k: [origin + x / 1e6 for x in pieces[k]] for k in END_STAMPS}


def _is_number(x: object) -> bool:
    if _is_int(x):
        return abs(x) < 2**53  # type: ignore[arg-type]
    return isinstance(x, float) and math.isfinite(x)


def _shape(obj: dict) -> str:
    pieces = obj.get("pieces")
    if isinstance(pieces, dict):
        lens = {k: len(v) if isinstance(v, list) else type(v).__name__ for k, v in pieces.items()}
        return f"keys {sorted(map(str, obj))}, pieces {lens}"
    return f"keys {sorted(map(str, obj))}"
