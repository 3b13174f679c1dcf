"""One self-contained HTML page for a report or a comparison: figures and an SVG timeline.

No external resources (inline CSS and SVG, no scripts) and every text goes through html.escape,
so the page can be mailed around or opened offline. Times on the page are ms since the report's
`t0` (request arrival at the decode node, else prefill start), all on the decode node's clock.
"""

from __future__ import annotations

import math
from html import escape

from exo_split.report import Comparison, HandoffReport, piece_starts, time_span, wire_intervals
from exo_split.report.text import (
    COMPARISON_COLUMNS,
    comparison_cells,
    decision_text,
    decode_text,
    figure_pairs,
    fmt_bytes,
    fmt_ms,
    prefill_text,
    prefix_text,
)

WIDTH, LEFT, RIGHT = 1120, 70, 20  # px: whole SVG, label gutter, right margin
COLORS = {
    "compute": "#4c78a8",
    "queued": "#c9ccd1",
    "wire": "#f58518",
    "inject": "#2ca02c",
    "prefill": "#d62728",
    "token": "#7b4fa0",
}
CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 12px; } h2 { font-size: 17px; margin: 28px 0 8px; }
table { border-collapse: collapse; margin: 8px 0; }
td, th { padding: 3px 14px 3px 0; text-align: left; vertical-align: top; }
td.k { font-weight: 600; color: #555; } td.v { font-variant-numeric: tabular-nums; }
p.note { margin: 4px 0; padding: 6px 10px; background: #f4f4f6; border-left: 3px solid #999; }
p.note.fallback { border-color: #d62728; background: #fdf0f0; }
svg { display: block; margin: 8px 0; } svg text { font: 11px system-ui, sans-serif; fill: #333; }
.legend span { display: inline-block; margin-right: 16px; }
.legend i { display: inline-block; width: 12px; height: 10px; margin-right: 5px; }
"""


def _nice_step(span_ms: float, max_ticks: int = 10) -> float:
    raw = max(span_ms, 1e-9) / max_ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _axis(x_of, t_from: float, t_to: float, y: float, height: float) -> list[str]:
    """Ticks every nice step (ms), with a faint grid line down `height` px."""
    step = _nice_step(t_to - t_from)
    out = []
    for i in range(math.ceil(t_from / step), math.floor(t_to / step) + 1):
        x = x_of(i * step)
        out.append(f'<line x1="{x:.2f}" x2="{x:.2f}" y1="{y}" y2="{y + height}" stroke="#eee"/>')
        out.append(f'<text x="{x:.2f}" y="{y - 4}" text-anchor="middle">{i * step:g}</text>')
    return out


def _axis_ms(r: HandoffReport) -> tuple[float, float]:
    """The layer rows' time axis, ms since t0: prefill start to last injected or first token."""
    start, end = time_span(r)
    return (start - r.t0) * 1e3, (max(end, r.timeline.first_token) - r.t0) * 1e3


def _timeline_svg(
    r: HandoffReport, axis: tuple[float, float] | None = None, tokens_to: float | None = None
) -> str:
    tl, pieces = r.timeline, r.pieces
    ms = lambda t: (t - r.t0) * 1e3  # noqa: E731 - decode clock -> ms since t0
    t_from, t_to = axis or _axis_ms(r)
    scale = (WIDTH - LEFT - RIGHT) / (t_to - t_from) if t_to > t_from else 0.0
    n_rows = max(tl.n_layers, max((p.layer + 1 for p in pieces), default=0)) if pieces else 0
    row_h = 16 if n_rows <= 64 else 13
    lane = (row_h - 4) / 3
    top = 34
    rows_bottom = top + row_h * (n_rows + (tl.mode == "local"))

    def x_of(t_ms: float) -> float:
        return LEFT + (t_ms - t_from) * scale

    def bar(cls: str, a: float, b: float, y: float, title: str) -> str:
        """A lane rect from decode-clock time a to b (at least 1.5 px wide, so it shows)."""
        x, w = x_of(ms(a)), max((b - a) * 1e3 * scale, 1.5)
        return (
            f'<rect class="{cls}" x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{lane:.2f}" '
            f'fill="{COLORS[cls]}"><title>{escape(title)}</title></rect>'
        )

    out = _axis(x_of, t_from, t_to, top - 6, rows_bottom - top + 6)
    out.append(f'<text x="{LEFT}" y="12">ms since {escape(_origin(r))} (decode clock)</text>')
    rows: dict[int, list[str]] = {layer: [] for layer in range(n_rows)}
    starts, wires = piece_starts(r), wire_intervals(pieces)
    for p, (compute_from, inject_from), (on_wire, _) in zip(pieces, starts, wires, strict=True):
        y = top + p.layer * row_h + 2
        what = f"layer {p.layer}, tokens {p.token_start}–{p.token_start + p.n_tokens - 1}"
        wire = p.received - on_wire
        rate = f", {p.nbytes / wire / 1e9:.2f} GB/s" if wire > 0 else ""
        socket = f"{ms(p.send_start):.3f}–" if p.send_start is not None else "last byte at "
        rows[p.layer] += [
            bar("compute", compute_from, p.compute_done, y,
                f"{what}: compute {fmt_ms(p.compute_done - compute_from, 3)}, "
                f"done at {ms(p.compute_done):.3f} ms"),
            bar("queued", p.compute_done, on_wire, y + lane,
                f"{what}: computed → on the wire {fmt_ms(on_wire - p.compute_done, 3)}"),
            bar("wire", on_wire, p.received, y + lane,
                f"{what}: {fmt_bytes(p.nbytes)} sent {ms(on_wire):.3f} ms → received "
                f"{ms(p.received):.3f} ms, {fmt_ms(wire, 3)} on the wire{rate}; handed to the "
                f"socket {socket}{ms(p.sent):.3f} ms"),
            bar("inject", inject_from, p.injected, y + 2 * lane,
                f"{what}: injected at {ms(p.injected):.3f} ms "
                f"(took {fmt_ms(p.injected - inject_from, 3)})"),
        ]  # fmt: skip
    for layer, rects in rows.items():
        y = top + layer * row_h
        shade = f'<rect x="0" y="{y}" width="{WIDTH}" height="{row_h}" fill="#f3f4f7"/>'
        out.append(
            f'<g class="layer-row" data-layer="{layer}">{shade if layer % 2 else ""}'
            f'<text x="{LEFT - 8}" y="{y + row_h - 4}" text-anchor="end">L{layer}</text>'
            f"{''.join(rects)}</g>"
        )
    if tl.mode == "local":
        y = top + n_rows * row_h
        out.append(
            f'<g class="local-prefill"><text x="{LEFT - 8}" y="{y + row_h - 4}" '
            f'text-anchor="end">local</text>'
            + bar("compute", r.prefill_start, r.prefill_end, y + 2 + lane,
                  f"local prefill {fmt_ms(r.prefill_end - r.prefill_start, 3)}")
            + "</g>"
        )  # fmt: skip
    markers = (
        (r.prefill_end, "prefill", "prefill done", 12),
        (tl.first_token, "token", "first token", 24),
    )
    for t, color, label, dy in markers:
        x = x_of(ms(t))
        anchor = "end" if x > WIDTH - 120 else "start"
        out.append(
            f'<line x1="{x:.2f}" x2="{x:.2f}" y1="{top - 4}" y2="{rows_bottom + dy - 10}" '
            f'stroke="{COLORS[color]}" stroke-dasharray="4 3"><title>{label} at '
            f'{ms(t):.3f} ms</title></line><text x="{x:.2f}" y="{rows_bottom + dy}" '
            f'text-anchor="{anchor}" style="fill:{COLORS[color]}">{label}</text>'
        )
    token_top = rows_bottom + 56
    out += _tokens_row(r, ms, token_top, tokens_to)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{token_top + 30}">'
        f"{''.join(out)}</svg>"
    )


def _tokens_row(r: HandoffReport, ms, top: float, t_to: float | None) -> list[str]:
    """Decode tokens as ticks on their own axis (they usually run long past the handoff)."""
    times = [ms(t) for t in r.timeline.token_times]
    t_from = min([0.0, *times])
    t_to = max([t_from + 1e-3, *times, t_to or 0.0])
    scale = (WIDTH - LEFT - RIGHT) / (t_to - t_from)
    x_of = lambda t: LEFT + (t - t_from) * scale  # noqa: E731
    out = [f'<g class="tokens"><text x="{LEFT - 8}" y="{top + 12}" text-anchor="end">tokens</text>']
    out += _axis(x_of, t_from, t_to, top, 18)
    start, end = time_span(r)
    a, b = x_of(ms(start)), x_of(ms(end))
    out.append(
        f'<rect x="{a:.2f}" y="{top}" width="{max(b - a, 1):.2f}" height="18" fill="#fbe3cc">'
        "<title>prefill + handoff window</title></rect>"
    )
    for i, t in enumerate(times):
        gap = f", ITL {t - times[i - 1]:.3f} ms" if i else ""
        out.append(
            f'<line class="token" x1="{x_of(t):.2f}" x2="{x_of(t):.2f}" y1="{top}" y2="{top + 18}" '
            f'stroke="{COLORS["token"]}" stroke-width="1.5"><title>token {i} at {t:.3f} ms{gap}'
            "</title></line>"
        )
    out.append("</g>")
    return out


def _last_token_ms(r: HandoffReport) -> float:
    return (max(r.timeline.token_times, default=r.timeline.first_token) - r.t0) * 1e3


def _origin(r: HandoffReport) -> str:
    return "request arrived" if r.timeline.client_sent is not None else "prefill start"


def _figures_table(r: HandoffReport) -> str:
    left, right = figure_pairs(r)
    rows = []
    for i in range(max(len(left), len(right))):
        cells = [
            *(left[i] if i < len(left) else ("", "")),
            *(right[i] if i < len(right) else ("", "")),
        ]
        rows.append(
            "<tr>"
            + "".join(f'<td class="{"kv"[j % 2]}">{escape(c)}</td>' for j, c in enumerate(cells))
            + "</tr>"
        )
    return f'<table class="figures">{"".join(rows)}</table>'


def _legend() -> str:
    items = [
        ("compute", "compute (previous piece done → this piece done)"),
        ("queued", "computed → on the wire"),
        ("wire", "on the wire → received"),
        ("inject", "inject"),
        ("prefill", "prefill done (dashed)"),
        ("token", "tokens / first token"),
    ]
    spans = "".join(
        f'<span><i style="background:{COLORS[k]}"></i>{escape(v)}</span>' for k, v in items
    )
    return f'<p class="legend">{spans}</p>'


def _section(
    r: HandoffReport,
    heading: str,
    axis: tuple[float, float] | None = None,
    tokens_to: float | None = None,
) -> str:
    tl = r.timeline
    parts = [f"<h2>{escape(heading)}</h2>", _figures_table(r)]
    if tl.fallback:
        parts.append(f'<p class="note fallback">fallback: {escape(tl.fallback)}</p>')
    if tl.decision:
        parts.append(f'<p class="note">decision: {escape(decision_text(tl.decision))}</p>')
    if tl.prefill:
        parts.append(f'<p class="note">prefill: {escape(prefill_text(tl.prefill))}</p>')
    if tl.decode:
        parts.append(f'<p class="note">decode: {escape(decode_text(tl.decode))}</p>')
    if tl.prefix:
        parts.append(f'<p class="note">prefix: {escape(prefix_text(tl.prefix, r.kv_bytes))}</p>')
    parts += [_timeline_svg(r, axis, tokens_to), _legend()]
    return f'<section class="report" data-mode="{escape(tl.mode)}">{"".join(parts)}</section>'


def _comparison_table(c: Comparison) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in COMPARISON_COLUMNS)
    rows = [
        "<tr>"
        + "".join(f"<td>{escape(v)}</td>" for v in (row.name, *comparison_cells(row)))
        + "</tr>"
        for row in c.rows
    ]
    note = ""
    if c.t_ideal_s is not None:
        eff = "—" if c.overlap_efficiency is None else f"{c.overlap_efficiency:.1%}"
        link = "" if c.link_gbps is None else f" at the sequential run's {c.link_gbps:.3f} GB/s"
        note = (
            f'<p class="note">overlap efficiency {eff}: T_ideal {escape(fmt_ms(c.t_ideal_s))} '
            f"(prefill start → last layer injected{link})</p>"
        )
    return f'<table class="comparison"><tr>{head}</tr>{"".join(rows)}</table>{note}'


def render_html(obj: HandoffReport | Comparison) -> str:
    """The whole page as one string."""
    if isinstance(obj, Comparison):
        title = "exo-split comparison"
        # One axis for all runs, so their timelines line up.
        spans = [_axis_ms(r) for r in obj.reports.values()]
        axis = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None
        tokens_to = max((_last_token_ms(r) for r in obj.reports.values()), default=None)
        sections = (_section(r, name, axis, tokens_to) for name, r in obj.reports.items())
        body = _comparison_table(obj) + "".join(sections)
    else:
        tl = obj.timeline
        title = f"exo-split report · {tl.mode} · {tl.prompt_tokens:,} prompt tokens"
        body = _section(obj, f"{tl.mode}: {tl.n_layers} layers")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>"
        f"<body><h1>{escape(title)}</h1>{body}</body></html>\n"
    )
