"""The timing report as terminal text: the figures table, the per-layer timeline (fits 100
columns) and the side-by-side comparison. Pure functions of report/timeline.py's HandoffReport."""

from __future__ import annotations

import io
import json
import math
import textwrap
from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from exo_split.report import (
    Comparison,
    ComparisonRow,
    HandoffReport,
    Timeline,
    piece_starts,
    time_span,
    wire_intervals,
)

# ---- terminal ---------------------------------------------------------------------------------


def fmt_ms(s: float | None, digits: int = 1) -> str:
    return "—" if s is None else f"{s * 1e3:,.{digits}f} ms"


def fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def render_rich(renderable: Any, width: int) -> str:
    """A rich renderable as plain text (no colour), lines right-stripped."""
    console = Console(
        file=io.StringIO(), width=width, color_system=None, highlight=False, emoji=False
    )
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.file.getvalue().strip("\n").splitlines())


def figure_pairs(r: HandoffReport) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(request figures, handoff figures) as (name, formatted value) pairs, for tables."""
    itl = " / ".join(_fmt(x and x * 1e3, ",.1f") for x in (r.itl_p50_s, r.itl_p95_s, r.itl_p99_s))
    tokens = len(r.timeline.token_times)
    unc = "" if r.clock_uncertainty_s is None else f" ± {fmt_ms(r.clock_uncertainty_s, 2)}"
    request = [
        ("TTFT", f"{fmt_ms(r.ttft_s)} ({r.ttft_source or 'not measured'})"),
        ("prefill compute", f"{fmt_ms(r.prefill_compute_s)}"),
        ("prefill speed", _fmt(r.prefill_tokens_per_s, ",.0f", " tok/s")),
        ("decode", f"{_fmt(r.decode_tokens_per_s, ',.1f', ' tok/s')}, {tokens} tokens"),
        ("ITL p50/p95/p99", f"{itl} ms"),
        ("clock offset", f"{r.clock_offset_s:+.4f} s{unc}"),
    ]
    if not r.pieces:
        return request, [("KV handoff", "none (local prefill)")]
    met = {True: "met", False: "missed", None: ""}[r.meets_handoff_target]
    target = f" (≤ {fmt_ms(r.handoff_target_s)}: {met})" if met else ""
    handoff = [
        ("KV bytes", fmt_bytes(r.kv_bytes)),
        ("wire time", f"{fmt_ms(r.wire_time_s)} (sum)"),
        ("transfer span", f"{fmt_ms(r.transfer_span_s)}, {_fmt(r.achieved_gbps, '.2f', ' GB/s')}"),
        ("one layer on wire", f"{fmt_ms(r.layer_wire_s)} (median)"),
        ("exposed handoff", fmt_ms(r.exposed_handoff_s) + target),
        ("hidden fraction", _fmt(r.hidden_fraction, ".1%")),
    ]
    return request, handoff


# Keys of policy.Decision shown in their own words below, or left to the JSON report.
_DECISION_SHOWN = {"choice", "reason", "estimates", "break_even_tokens", "measured", "peer"}
_DECISION_JSON_ONLY = {"figures", "decided_in_s", "mode", "prompt_tokens"}


def decision_text(decision: Mapping[str, Any]) -> str:
    """One line: what was chosen and why, both TTFT estimates, the break-even and, after the
    run, the measured TTFT. Every input is in the JSON report (`decision`)."""
    d = decision
    parts = []
    if "choice" in d:
        parts.append(f"{d['choice']} prefill" + (f" ({d['reason']})" if d.get("reason") else ""))
    est = d.get("estimates") or {}
    if est.get("local_ttft_s") is not None or est.get("remote_ttft_s") is not None:
        parts.append(
            f"estimated TTFT local {fmt_ms(est.get('local_ttft_s'))}, "
            f"remote {fmt_ms(est.get('remote_ttft_s'))}"
        )
    if d.get("break_even_tokens") is not None:
        parts.append(f"break-even {d['break_even_tokens']:,.0f} tokens")
    measured = d.get("measured") or {}
    if measured.get("ttft_s") is not None:
        parts.append(f"measured TTFT {fmt_ms(measured['ttft_s'])} ({measured.get('ran')})")
    if isinstance(d.get("peer"), Mapping) and d["peer"].get("url"):
        parts.append(f"peer {d['peer']['url']}")
    for k, v in d.items():  # anything else a caller put in
        if k not in _DECISION_SHOWN | _DECISION_JSON_ONLY:
            parts.append(f"{k}={v if isinstance(v, str) else json.dumps(v)}")
    return "; ".join(parts)


def decode_text(decode: Mapping[str, Any]) -> str:
    """One line: what decoded (backend, device, dtype, weights), how the sampled picks went,
    and why the decode stopped."""
    q = decode.get("quantization")
    weights = (
        f"{q['bits']}-bit {q['mode']} weights (groups of {q['group_size']})"
        if isinstance(q, Mapping)
        else "full-precision weights"
    )
    parts = [f"{decode.get('backend')} on {decode.get('device')}, {decode.get('dtype')}, {weights}"]
    if decode.get("host_checked"):
        parts.append(
            f"{decode['host_checked']} of {decode.get('steps')} sampled picks redone by the host "
            f"rule, {decode.get('host_corrected', 0)} changed"
        )
    if decode.get("stopped_by"):
        parts.append(f"stopped by {str(decode['stopped_by']).replace('_', ' ')}")
    return "; ".join(parts)


def prefill_text(prefill: Mapping[str, Any]) -> str:
    """One line: what prefilled, as the prefill node's HELLO said (backend, device, dtype,
    the weights' quantization, a quantized KV cache, the head ranges its frames carried)."""
    q = prefill.get("quantization")
    weights = f"{q} weights" if q else "full-precision weights"
    cache = f", {c} KV cache" if (c := prefill.get("kv_cache")) else ""
    ranges = prefill.get("head_ranges") or 1
    heads = f", KV heads in {ranges} ranges (tensor-parallel)" if ranges > 1 else ""
    return (f"{prefill.get('backend')} on {prefill.get('device')}, {prefill.get('dtype')}, "
            f"{weights}{cache}{heads}")  # fmt: skip


def prefix_text(prefix: Mapping[str, Any], kv_bytes: int) -> str:
    """One line: what prefix reuse saved on each node, what was computed and what moved."""
    moved = f"{kv_bytes / 2**20:,.1f} MiB of KV moved" if kv_bytes else "no KV moved"
    return (
        f"{prefix.get('decode_cached_tokens', 0):,} tokens cached on the decode node, "
        f"{prefix.get('prefill_cached_tokens', 0):,} on the prefill node; "
        f"{prefix.get('computed_tokens', 0):,} computed; {moved}"
    )


def _notes(tl: Timeline, width: int, kv_bytes: int = 0) -> list[str]:
    notes = []
    if tl.prefix:
        line = f"prefix: {prefix_text(tl.prefix, kv_bytes)}"
        notes.append(textwrap.fill(line, width, subsequent_indent="  "))
    if tl.prefill:
        notes.append(
            textwrap.fill(f"prefill: {prefill_text(tl.prefill)}", width, subsequent_indent="  ")
        )
    if tl.decode:
        notes.append(
            textwrap.fill(f"decode: {decode_text(tl.decode)}", width, subsequent_indent="  ")
        )
    if tl.fallback:
        notes.append(textwrap.fill(f"fallback: {tl.fallback}", width, subsequent_indent="  "))
    if tl.decision:
        notes.append(
            textwrap.fill(f"decision: {decision_text(tl.decision)}", width, subsequent_indent="  ")
        )
    return notes


def render_terminal(report: HandoffReport, *, width: int = 100) -> str:
    """Figures table, fallback/decision notes and the per-layer text timeline."""
    tl = report.timeline
    table = Table(
        title=f"exo-split · {tl.mode} · {tl.prompt_tokens:,} prompt tokens · {tl.n_layers} layers",
        title_justify="left",
        box=None,
        show_header=False,
    )
    for _ in range(2):
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
    left, right = figure_pairs(report)
    for i in range(max(len(left), len(right))):
        cells = [
            *(left[i] if i < len(left) else ("", "")),
            *(right[i] if i < len(right) else ("", "")),
        ]
        table.add_row(*(Text(c) for c in cells))
    return "\n".join(
        [
            render_rich(table, width),
            *_notes(tl, width, report.kv_bytes),
            render_text_timeline(report, width=width),
        ]
    )


MAX_TEXT_ROWS = 40
COMPUTE, QUEUED, WIRE, INJECT, PREFILL_DONE = "█", "·", "─", "▪", "┆"


def render_text_timeline(report: HandoffReport, *, width: int = 100) -> str:
    """One row per layer (buckets of layers past MAX_TEXT_ROWS) on a shared time axis."""
    pieces = report.pieces
    if not pieces:
        return "timeline: no KV pieces (the decode node prefilled locally)"
    n_layers = max(report.timeline.n_layers, max(p.layer for p in pieces) + 1)
    per_row = math.ceil(n_layers / MAX_TEXT_ROWS)
    n_rows = math.ceil(n_layers / per_row)
    labels = [
        f"L{i * per_row}" + (f"-{min(n_layers, (i + 1) * per_row) - 1}" if per_row > 1 else "")
        for i in range(n_rows)
    ]
    label_w = max(len(s) for s in labels) + 1
    bar_w = width - label_w
    start, end = time_span(report)
    scale = bar_w / (end - start) if end > start else 0.0
    rows = [[" "] * bar_w for _ in range(n_rows)]

    def draw(row: list[str], a: float, b: float, glyph: str) -> None:
        # Rounding both ends makes back-to-back intervals tile without sharing a cell.
        first = min(bar_w - 1, max(0, round((a - start) * scale)))
        last = min(bar_w, max(first + 1, round((b - start) * scale)))
        row[first:last] = glyph * (last - first)

    starts = piece_starts(report)
    wires = wire_intervals(pieces)
    segments = (  # drawn in this order: later glyphs win where they share a cell
        (QUEUED, lambda p, c, i, w: (p.compute_done, w[0])),
        (COMPUTE, lambda p, c, i, w: (c, p.compute_done)),
        (WIRE, lambda p, c, i, w: w),
        (INJECT, lambda p, c, i, w: (i, p.injected)),
    )
    for glyph, interval in segments:
        for p, (compute_from, inject_from), wire in zip(pieces, starts, wires, strict=True):
            draw(rows[p.layer // per_row], *interval(p, compute_from, inject_from, wire), glyph)
    cut = min(bar_w - 1, max(0, math.floor((report.prefill_end - start) * scale)))
    for row in rows:
        if row[cut] == " ":
            row[cut] = PREFILL_DONE
    lines = [
        label.ljust(label_w) + "".join(row).rstrip()
        for label, row in zip(labels, rows, strict=True)
    ]
    lines += _axis(label_w, bar_w, start - report.t0, end - report.t0, cut)
    origin = "request arrived" if report.timeline.client_sent is not None else "prefill start"
    legend = [
        f"{COMPUTE} compute  {QUEUED} computed→on the wire  {WIRE} on the wire  {INJECT} inject  "
        f"{PREFILL_DONE} prefill done",
        f"axis: ms since {origin}; 1 column = {(end - start) / bar_w * 1e3:.3g} ms"
        + (f"; {per_row} layers per row" if per_row > 1 else ""),
    ]
    return "\n".join([*lines, *(textwrap.fill(s, width) for s in legend)])


def _axis(label_w: int, bar_w: int, t_start: float, t_end: float, mark: int) -> list[str]:
    """A rule with five ticks labelled in ms (at the middle of their column), `mark` on it."""
    rule, text = ["─"] * bar_w, [" "] * bar_w
    for col in (round(i * (bar_w - 1) / 4) for i in range(5)):
        rule[col] = "┬"
        label = f"{(t_start + (t_end - t_start) * (col + 0.5) / bar_w) * 1e3:,.0f}"
        at = min(max(0, col - len(label) // 2), bar_w - len(label))
        text[at : at + len(label)] = label
    rule[mark] = PREFILL_DONE
    return [" " * label_w + "".join(rule), " " * label_w + "".join(text).rstrip()]


# "speedup": the local run's TTFT / this run's; "→ injected": prefill start -> last layer injected.
COMPARISON_COLUMNS = (
    "run", "TTFT", "speedup", "exposed handoff", "hidden", "prefill", "→ injected"
)  # fmt: skip


def comparison_cells(row: ComparisonRow) -> list[str]:
    """The formatted cells of one row, after the name (COMPARISON_COLUMNS)."""
    return [
        fmt_ms(row.ttft_s),
        _fmt(row.speedup_vs_local, ".2f", "×"),
        fmt_ms(row.exposed_handoff_s),
        _fmt(row.hidden_fraction, ".1%"),
        fmt_ms(row.prefill_compute_s),
        fmt_ms(row.prefill_to_injected_s),
    ]


def render_comparison(comparison: Comparison, *, width: int = 100) -> str:
    table = Table(title="exo-split · compare", title_justify="left", box=box.SIMPLE_HEAD)
    for name in COMPARISON_COLUMNS:
        table.add_column(name, justify="left" if name == "run" else "right")
    for row in comparison.rows:
        table.add_row(Text(row.name), *comparison_cells(row))
    lines = [render_rich(table, width), "speedup: the local run's TTFT / the run's; → injected: "
             "prefill start → last layer injected"]  # fmt: skip
    if comparison.t_ideal_s is not None:
        link = _fmt(comparison.link_gbps, ".3f", " GB/s")
        lines.append(
            textwrap.fill(
                f"overlap efficiency {_fmt(comparison.overlap_efficiency, '.1%')}: T_ideal "
                f"{fmt_ms(comparison.t_ideal_s)} (prefill start → last layer injected, at the "
                f"sequential run's {link})",
                width,
            )
        )
    for row in comparison.rows:
        if row.fallback:
            lines.append(textwrap.fill(f"{row.name} fallback: {row.fallback}", width))
    return "\n".join(lines)
