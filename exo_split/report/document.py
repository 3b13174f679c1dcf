"""The report as a JSON document (docs/metrics.md) and back: `to_json`, `load_report`,
`load_comparison`, `load` (a dict, a saved file, or captured `--json` stdout)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from exo_split.report.figures import build_report, compare
from exo_split.report.timeline import (
    COMPARISON_SCHEMA,
    SCHEMA,
    Comparison,
    HandoffReport,
    LayerTiming,
    Timeline,
    check_schema,
)

# Fields of HandoffReport that are not figures (they are the timeline and its mapped stamps).
_NOT_FIGURES = {"timeline", "t0", "pieces", "prefill_start", "prefill_end", "itl_s"}
_STAMPS = ("compute_done", "sent", "received", "injected")  # LayerTiming's clock stamps


def to_json(obj: HandoffReport | Comparison) -> dict[str, Any]:
    """The documented JSON document (docs/metrics.md); times are seconds since `t0`."""
    if isinstance(obj, Comparison):
        return {
            "schema": COMPARISON_SCHEMA,
            "rows": [asdict(row) for row in obj.rows],
            "t_ideal_s": obj.t_ideal_s,
            "overlap_efficiency": obj.overlap_efficiency,
            "link_gbps": obj.link_gbps,
            "reports": {name: to_json(r) for name, r in obj.reports.items()},
        }
    tl = obj.timeline

    def rel(t: float) -> float:
        return t - obj.t0

    return {
        "schema": SCHEMA,
        "mode": tl.mode,
        "prompt_tokens": tl.prompt_tokens,
        "n_layers": tl.n_layers,
        "generated_tokens": len(tl.token_times),
        "time_origin": "client_sent" if tl.client_sent is not None else "prefill_start",
        **{f.name: getattr(obj, f.name) for f in fields(obj) if f.name not in _NOT_FIGURES},
        "meets_handoff_target": obj.meets_handoff_target,
        "fallback": tl.fallback,
        "decision": tl.decision,
        "prefix": tl.prefix or {},
        "events": {
            "prefill_start": rel(obj.prefill_start),
            "prefill_end": rel(obj.prefill_end),
            "first_token": rel(tl.first_token),
        },
        "layers": [_piece_json(p, rel) for p in obj.pieces],
        "token_times": [rel(t) for t in tl.token_times],
        "timeline": tl.to_dict(),
    }


def _piece_json(p: LayerTiming, rel) -> dict[str, Any]:
    d = {**asdict(p), **{k: rel(getattr(p, k)) for k in _STAMPS}}
    d["send_start"] = None if p.send_start is None else rel(p.send_start)
    return d


def _read(src: str | os.PathLike | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(src, Mapping):
        return _unwrap(src)
    text = Path(src).read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        # Captured `--json` stdout: the last non-empty line is the document.
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            doc = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError) as exc:
            raise ValueError(f"{src}: expected a JSON report (or one as last line)") from exc
    if not isinstance(doc, Mapping):
        raise ValueError(f"{src}: expected a JSON object, got {type(doc).__name__}")
    return _unwrap(doc)


def _unwrap(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """`split-generate --json` prints {tokens, text, prompt_tokens, report}: take the report."""
    if "schema" not in d and isinstance(d.get("report"), Mapping):
        return d["report"]
    return d


def load_report(src: str | os.PathLike | Mapping[str, Any]) -> HandoffReport:
    """A report from to_json() output or a bare Timeline.to_dict(), as a dict or a file."""
    d = _read(src)
    if d.get("schema") == COMPARISON_SCHEMA:
        raise ValueError(f"{COMPARISON_SCHEMA!r} document: load it with load_comparison()")
    return build_report(Timeline.from_dict(d.get("timeline", d)))


def load_comparison(src: str | os.PathLike | Mapping[str, Any]) -> Comparison:
    d = _read(src)
    check_schema(d, COMPARISON_SCHEMA)
    return compare({name: load_report(r) for name, r in d["reports"].items()})


def load(src: str | os.PathLike | Mapping[str, Any]) -> HandoffReport | Comparison:
    """A report or a comparison, whichever the document is."""
    d = _read(src)
    return load_comparison(d) if d.get("schema") == COMPARISON_SCHEMA else load_report(d)
