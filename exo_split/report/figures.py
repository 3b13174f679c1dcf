"""The figures of the timing report (docs/metrics.md), computed from a Timeline.

`build_report` maps the prefill node's clock onto the decode node's (the request round trip,
narrowed by each piece's send_start) and computes TTFT, ITL, wire time, exposed handoff,
hidden fraction and the rest; `compare` puts the overlapped, sequential and local runs of one
request side by side. Pure functions over plain numbers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from itertools import pairwise

from exo_split.report.timeline import (
    TARGET_FACTOR,
    TARGET_SLACK_S,
    ClockSync,
    Comparison,
    ComparisonRow,
    HandoffReport,
    LayerTiming,
    Timeline,
)


def clock_offset(sync: ClockSync, pieces: Sequence[LayerTiming] = ()) -> tuple[float, float]:
    """(offset, uncertainty), seconds: prefill time p is decode time p - offset, ± uncertainty.

    The request round trip bounds the offset from both sides: the request arrived after it
    was sent, HELLO arrived after it was sent. Each piece that carries `send_start` raises
    the lower bound (its first byte left before its last byte arrived), which matters when
    the two directions of the round trip were delayed unequally (a busy event loop). The
    estimate is the middle of the bounded interval, the uncertainty half its width.
    """
    high = sync.prefill_received - sync.decode_sent
    low = sync.prefill_replied - sync.decode_replied
    for p in pieces:
        if p.send_start is not None:
            low = max(low, p.send_start - p.received)
    if low > high:  # contradictory stamps: report the contradiction as the uncertainty
        low, high = high, low
    return (low + high) / 2, (high - low) / 2


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile: the smallest sample with at least p% of samples <= it."""
    if not 0 < p <= 100:
        raise ValueError(f"percentile p must be in (0, 100], got {p}")
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p * len(ordered) / 100)) - 1]


def ideal_pipelined_time(
    compute_per_layer: Sequence[float],
    bytes_per_layer: Sequence[int],
    link_bytes_per_s: float,
    inject_per_layer: float = 0.0,
) -> float:
    """Pipelined lower bound, from prefill start to the last layer injected.

    Layer l goes on the link once it is computed and the link has finished layer l-1; it is
    injected once it has arrived and layer l-1 is injected.
    """
    if len(compute_per_layer) != len(bytes_per_layer):
        raise ValueError(
            f"{len(compute_per_layer)} compute times but {len(bytes_per_layer)} byte counts"
        )
    if link_bytes_per_s <= 0:
        raise ValueError(f"link_bytes_per_s must be > 0, got {link_bytes_per_s}")
    computed = link_free = injected = 0.0
    for compute, nbytes in zip(compute_per_layer, bytes_per_layer, strict=True):
        computed += compute
        link_free = max(computed, link_free) + nbytes / link_bytes_per_s
        injected = max(link_free, injected) + inject_per_layer
    return injected


def overlap_efficiency(t_seq: float, t_overlap: float, t_ideal: float) -> float | None:
    """(T_seq - T_overlap) / (T_seq - T_ideal): 1 = all hideable transfer hidden, 0 = none."""
    denominator = t_seq - t_ideal
    return (t_seq - t_overlap) / denominator if denominator > 0 else None


def _merge(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def hidden_fraction(intervals: Sequence[tuple[float, float]], cut: float) -> float | None:
    """Share of the union of `intervals` that lies before `cut` (None if the union is empty)."""
    merged = _merge(intervals)
    total = sum(end - start for start, end in merged)
    if total <= 0:
        return None
    return sum(max(0.0, min(end, cut) - start) for start, end in merged) / total


def wire_intervals(pieces: Sequence[LayerTiming]) -> list[tuple[float, float]]:
    """[on the wire from, received] of each piece (same clock for all stamps), in input order.

    A piece is on the wire from its first byte handed to the socket (`send_start`; without it,
    the last byte, `sent`), but not before the piece ahead of it on the connection has arrived:
    the stream is FIFO, so the link carries one piece at a time and the intervals never overlap.
    """
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(pieces)
    ahead = -math.inf
    for i in sorted(range(len(pieces)), key=lambda i: pieces[i].received):
        p = pieces[i]
        start = p.send_start if p.send_start is not None else p.sent
        out[i] = (min(max(start, ahead), p.received), p.received)
        ahead = p.received
    return out


def _to_decode_clock(p: LayerTiming, offset: float) -> LayerTiming:
    send_start = None if p.send_start is None else p.send_start - offset
    return replace(
        p, compute_done=p.compute_done - offset, sent=p.sent - offset, send_start=send_start
    )


def _computed(tl: Timeline) -> int:
    """The positions the prefill computed: the prompt, less a reused prefix."""
    computed = (tl.prefix or {}).get("computed_tokens")
    return computed if isinstance(computed, int) and computed > 0 else tl.prompt_tokens


def build_report(tl: Timeline) -> HandoffReport:
    offset, uncertainty = clock_offset(tl.clock, tl.layers) if tl.clock else (0.0, None)
    local = tl.mode == "local"
    shift = 0.0 if local else offset
    pieces = tuple(_to_decode_clock(p, offset) for p in tl.layers)
    prefill_start, prefill_end = tl.prefill_start - shift, tl.prefill_end - shift
    if tl.client_ttft_s is not None:
        ttft, ttft_source = tl.client_ttft_s, "client"
    elif tl.client_sent is not None:
        ttft, ttft_source = tl.first_token - tl.client_sent, "decode node"
    else:
        ttft, ttft_source = None, None
    itl = tuple(b - a for a, b in pairwise(tl.token_times))
    decode_span = sum(itl)
    prefill_s = tl.prefill_end - tl.prefill_start
    wire = span = gbps = layer_wire = exposed = target = hidden = to_injected = None
    kv_bytes = sum(p.nbytes for p in pieces)
    if pieces:
        intervals = wire_intervals(pieces)
        wire = sum(end - start for start, end in intervals)
        span = max(p.received for p in pieces) - min(start for start, _ in intervals)
        gbps = kv_bytes / span / 1e9 if span > 0 else None
        per_layer: dict[int, float] = {}
        for p, (start, end) in zip(pieces, intervals, strict=True):
            per_layer[p.layer] = per_layer.get(p.layer, 0.0) + (end - start)
        layer_wire = statistics.median(per_layer.values())
        if not local:
            last_injected = max(p.injected for p in pieces)
            exposed = last_injected - prefill_end
            target = TARGET_FACTOR * layer_wire + TARGET_SLACK_S
            hidden = hidden_fraction(intervals, prefill_end)
            to_injected = last_injected - prefill_start
    return HandoffReport(
        timeline=tl,
        clock_offset_s=offset,
        clock_uncertainty_s=uncertainty,
        t0=tl.client_sent if tl.client_sent is not None else prefill_start,
        pieces=pieces,
        prefill_start=prefill_start,
        prefill_end=prefill_end,
        ttft_s=ttft,
        ttft_source=ttft_source,
        itl_s=itl,
        itl_p50_s=percentile(itl, 50),
        itl_p95_s=percentile(itl, 95),
        itl_p99_s=percentile(itl, 99),
        decode_tokens_per_s=len(itl) / decode_span if decode_span > 0 else None,
        prefill_compute_s=prefill_s,
        prefill_tokens_per_s=_computed(tl) / prefill_s if prefill_s > 0 else None,
        kv_bytes=kv_bytes,
        wire_time_s=wire,
        transfer_span_s=span,
        achieved_gbps=gbps,
        layer_wire_s=layer_wire,
        exposed_handoff_s=exposed,
        handoff_target_s=target,
        hidden_fraction=hidden,
        prefill_to_injected_s=to_injected,
    )


def piece_starts(report: HandoffReport) -> list[tuple[float, float]]:
    """(compute start, inject start) of each of `report.pieces`, decode clock.

    A piece's compute starts when the previous piece (in compute order) was done, the first one
    at the start of the time axis; its injection once it arrived and the previous injection ended.
    """
    pieces = report.pieces
    compute_from, inject_from = [0.0] * len(pieces), [0.0] * len(pieces)
    before = time_span(report)[0]
    for i in sorted(range(len(pieces)), key=lambda i: pieces[i].compute_done):
        compute_from[i], before = before, pieces[i].compute_done
    before = -math.inf
    for i in sorted(range(len(pieces)), key=lambda i: pieces[i].injected):
        inject_from[i], before = max(pieces[i].received, before), pieces[i].injected
    return list(zip(compute_from, inject_from, strict=True))


def time_span(report: HandoffReport) -> tuple[float, float]:
    """The timeline axis, decode clock: prefill start (or first piece) to last piece injected."""
    pieces = report.pieces
    start = min([report.prefill_start, *(p.compute_done for p in pieces)])
    end = max([report.prefill_end, *(p.injected for p in pieces)])
    return start, end


def piece_compute_s(report: HandoffReport) -> list[float]:
    """Each piece's compute time (previous piece done -> this one done), in `pieces` order."""
    starts = piece_starts(report)
    return [p.compute_done - c for p, (c, _) in zip(report.pieces, starts, strict=True)]


def median_inject_s(report: HandoffReport) -> float:
    """The median time one piece takes to inject (from arrival or the previous injection)."""
    starts = piece_starts(report)
    return statistics.median(
        p.injected - i for p, (_, i) in zip(report.pieces, starts, strict=True)
    )


def measured_ideal(
    report: HandoffReport, link_bytes_per_s: float, inject_per_piece_s: float | None = None
) -> float:
    """T_ideal for the pieces of a run (their measured compute times and bytes) at a link rate
    measured elsewhere; each piece injects in `inject_per_piece_s` (default: the run's median).

    Take the compute times from a sequential run: in an overlapped run on a slow link the
    bounded send queue fills and blocks the compute thread, and those stalls would count as
    compute, raising the bound to meet the run.
    """
    compute = piece_compute_s(report)
    inject = median_inject_s(report) if inject_per_piece_s is None else inject_per_piece_s
    order = sorted(range(len(compute)), key=lambda i: report.pieces[i].compute_done)
    return ideal_pipelined_time(
        [compute[i] for i in order],
        [report.pieces[i].nbytes for i in order],
        link_bytes_per_s,
        inject,
    )


def compare(reports: Mapping[str, HandoffReport]) -> Comparison:
    """Side by side; speedups are relative to the "local" run when there is one."""
    local = reports.get("local")
    base = local.ttft_s if local else None
    rows = tuple(
        ComparisonRow(
            name=name,
            ttft_s=r.ttft_s,
            exposed_handoff_s=r.exposed_handoff_s,
            hidden_fraction=r.hidden_fraction,
            prefill_compute_s=r.prefill_compute_s,
            prefill_to_injected_s=r.prefill_to_injected_s,
            speedup_vs_local=base / r.ttft_s if base and r.ttft_s else None,
            fallback=r.timeline.fallback,
        )
        for name, r in reports.items()
    )
    t_ideal = efficiency = link = None
    ovl, seq = reports.get("overlap"), reports.get("sequential")
    # A sequential run sends back to back, so its achieved rate is the link's rate; and it holds
    # its pieces until the prefill is done, so nothing stalls its compute (measured_ideal).
    if ovl and seq and ovl.pieces and ovl.prefill_to_injected_s is not None and seq.achieved_gbps:
        link = seq.achieved_gbps
        t_ideal = measured_ideal(seq, link * 1e9, median_inject_s(ovl))
        if seq.prefill_to_injected_s is not None:
            efficiency = overlap_efficiency(
                seq.prefill_to_injected_s, ovl.prefill_to_injected_s, t_ideal
            )
    return Comparison(dict(reports), rows, t_ideal, efficiency, link)


# ---- JSON -------------------------------------------------------------------------------------
