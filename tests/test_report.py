"""Figures of the timing report on hand-made timelines with known answers.

The reference timeline: the prefill clock reads 100 s more than the decode clock; the request
round trip has 2 ms one-way delays and 1 ms on the prefill node, so offset = 100 s and the
uncertainty is 2 ms. Prefill starts at 10 ms (decode clock), each of L layers takes 10 ms to
compute, and each piece spends 10 ms on the wire and 1 ms to inject.
"""

import json
import math
from dataclasses import replace

import pytest

from exo_split.report import (
    SCHEMA,
    ClockSync,
    LayerTiming,
    Timeline,
    build_report,
    clock_offset,
    compare,
    hidden_fraction,
    ideal_pipelined_time,
    load,
    load_comparison,
    load_report,
    measured_ideal,
    overlap_efficiency,
    percentile,
    to_json,
    wire_intervals,
)
from exo_split.report.text import render_comparison, render_terminal

OFFSET = 100.0  # prefill clock = decode clock + OFFSET
SYNC = ClockSync(
    decode_sent=0.0, prefill_received=100.002, prefill_replied=100.003, decode_replied=0.005
)
MB = 1_000_000
# 18 gaps of 10 ms, one of 20 ms, one of 50 ms: 21 tokens over 250 ms.
ITL = [0.010] * 18 + [0.020, 0.050]


def tokens(first: float) -> tuple[float, ...]:
    times = [first]
    for gap in ITL:
        times.append(times[-1] + gap)
    return tuple(times)


def overlap_timeline(n_layers: int = 4, **overrides) -> Timeline:
    """Each piece is sent as soon as computed: [sent, received] = [10(i+2), 10(i+3)] ms."""
    pieces = tuple(
        LayerTiming(
            layer=i,
            token_start=0,
            n_tokens=1000,
            nbytes=MB,
            compute_done=OFFSET + 0.010 * (i + 2),
            sent=OFFSET + 0.010 * (i + 2),
            received=0.010 * (i + 3),
            injected=0.010 * (i + 3) + 0.001,
        )
        for i in range(n_layers)
    )
    fields = dict(
        mode="overlap",
        prompt_tokens=1000,
        n_layers=n_layers,
        client_sent=0.0,
        prefill_start=OFFSET + 0.010,
        prefill_end=OFFSET + 0.010 * (n_layers + 1),
        layers=pieces,
        clock=SYNC,
        first_token=0.080,
        token_times=tokens(0.080),
    )
    return Timeline(**{**fields, **overrides})


def sequential_timeline() -> Timeline:
    """Same compute; the pieces go out back to back only after prefill ends at 50 ms."""
    pieces = tuple(
        LayerTiming(i, 0, 1000, MB, OFFSET + 0.010 * (i + 2), OFFSET + 0.050 + 0.010 * i,
                    0.060 + 0.010 * i, 0.061 + 0.010 * i)
        for i in range(4)
    )  # fmt: skip
    return overlap_timeline(mode="sequential", layers=pieces, first_token=0.120,
                            token_times=tokens(0.120))  # fmt: skip


def local_timeline(**overrides) -> Timeline:
    fields = dict(
        mode="local",
        prompt_tokens=1000,
        n_layers=4,
        client_sent=0.0,
        prefill_start=0.010,
        prefill_end=0.150,
        layers=(),
        clock=None,
        first_token=0.160,
        token_times=tokens(0.160),
    )
    return Timeline(**{**fields, **overrides})


# ---- clock ---------------------------------------------------------------------------------


def test_clock_offset_and_uncertainty():
    offset, uncertainty = clock_offset(SYNC)
    assert offset == pytest.approx(100.0)
    assert uncertainty == pytest.approx(0.002)


def test_asymmetric_delay_shifts_offset_within_uncertainty():
    # 1 ms out, 3 ms back: the true offset (100 s) lies within offset ± uncertainty.
    offset, uncertainty = clock_offset(ClockSync(0.0, 100.001, 100.002, 0.005))
    assert offset == pytest.approx(99.999)
    assert uncertainty == pytest.approx(0.002)
    assert abs(offset - 100.0) <= uncertainty


def _piece(send_start: float, received: float) -> LayerTiming:
    return LayerTiming(0, 0, 1, MB, send_start, send_start, received, received, send_start)


def test_a_piece_on_the_wire_raises_the_lower_bound_of_the_offset():
    # Round trip: the offset lies in [99.998, 100.002]. A piece whose first byte left at
    # prefill 100.0205 and arrived at decode 0.021 proves offset >= 99.9995.
    sync = ClockSync(0.0, 100.002, 100.003, 0.005)
    offset, uncertainty = clock_offset(sync, [_piece(100.0205, 0.021)])
    assert offset == pytest.approx((99.9995 + 100.002) / 2)
    assert uncertainty == pytest.approx((100.002 - 99.9995) / 2)
    # Pieces without send_start, or ones that bound nothing new, change nothing.
    no_start = replace(_piece(100.0205, 0.021), send_start=None)
    assert clock_offset(sync, [no_start]) == pytest.approx(clock_offset(sync))
    assert clock_offset(sync, [_piece(100.010, 0.021)]) == pytest.approx(clock_offset(sync))


def test_contradictory_stamps_show_up_as_uncertainty():
    # The request says offset <= 100.002, a piece says offset >= 100.010: no offset fits
    # both (drifting clocks, a stamp taken late); the gap is reported, not hidden.
    sync = ClockSync(0.0, 100.002, 100.003, 0.005)
    offset, uncertainty = clock_offset(sync, [_piece(100.031, 0.021)])
    assert offset == pytest.approx(100.006)
    assert uncertainty == pytest.approx(0.004)


def test_a_late_hello_does_not_squeeze_fast_pieces_to_nothing():
    """A busy decode loop read HELLO 8 ms late (true offset 100 s, sub-ms loopback pieces):
    the round-trip midpoint alone maps every piece to end before it starts, so no wire time
    and no hidden fraction; the pieces' own bounds keep them in causal order."""
    sync = ClockSync(0.0, 100.0001, 100.0002, 0.0083)
    pieces = tuple(
        LayerTiming(i, 0, 1000, MB, OFFSET + 0.010 * (i + 2), OFFSET + 0.010 * (i + 2) + 2e-4,
                    0.010 * (i + 2) + 3e-4, 0.010 * (i + 2) + 5e-4,
                    send_start=OFFSET + 0.010 * (i + 2) + 1e-4)
        for i in range(4)
    )  # fmt: skip
    naive, _ = clock_offset(sync)
    assert all(p.send_start - naive > p.received for p in pieces)  # the failure mode
    r = build_report(overlap_timeline(layers=pieces, clock=sync))
    assert abs(r.clock_offset_s - OFFSET) <= r.clock_uncertainty_s
    assert all(p.send_start <= p.received for p in r.pieces)
    assert r.wire_time_s > 0
    assert r.hidden_fraction == pytest.approx(0.75)  # the last piece leaves after prefill_end


def test_every_prefill_stamp_is_mapped_to_the_decode_clock():
    r = build_report(overlap_timeline())
    assert r.clock_offset_s == pytest.approx(100.0)
    assert r.clock_uncertainty_s == pytest.approx(0.002)
    assert r.prefill_start == pytest.approx(0.010)
    assert r.prefill_end == pytest.approx(0.050)
    assert [p.compute_done for p in r.pieces] == pytest.approx([0.020, 0.030, 0.040, 0.050])
    assert [p.sent for p in r.pieces] == pytest.approx([0.020, 0.030, 0.040, 0.050])
    assert [p.received for p in r.pieces] == pytest.approx([0.030, 0.040, 0.050, 0.060])


def test_shared_clock_without_sync_is_not_shifted():
    tl = overlap_timeline(clock=None)
    tl = overlap_timeline(
        clock=None,
        prefill_start=0.010,
        prefill_end=0.050,
        layers=tuple(
            LayerTiming(p.layer, 0, 1000, MB, p.compute_done - OFFSET, p.sent - OFFSET,
                        p.received, p.injected)
            for p in tl.layers
        ),
    )  # fmt: skip
    r = build_report(tl)
    assert r.clock_offset_s == 0.0 and r.clock_uncertainty_s is None
    assert r.exposed_handoff_s == pytest.approx(0.011)


# ---- request figures -------------------------------------------------------------------------


def test_percentile_is_nearest_rank():
    assert percentile([0.010] * 18 + [0.020, 0.050], 50) == 0.010
    assert percentile([0.010] * 18 + [0.020, 0.050], 95) == 0.020
    assert percentile([0.010] * 18 + [0.020, 0.050], 99) == 0.050
    assert percentile([3, 1, 2, 4], 50) == 2
    assert percentile([7], 99) == 7
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="percentile"):
        percentile([1], 0)


def test_ttft_itl_and_speeds():
    r = build_report(overlap_timeline())
    assert r.ttft_s == pytest.approx(0.080) and r.ttft_source == "decode node"
    assert r.itl_s == pytest.approx(ITL)
    assert r.itl_p50_s == pytest.approx(0.010)
    assert r.itl_p95_s == pytest.approx(0.020)
    assert r.itl_p99_s == pytest.approx(0.050)
    assert r.decode_tokens_per_s == pytest.approx(20 / 0.250)
    assert r.prefill_compute_s == pytest.approx(0.040)
    assert r.prefill_tokens_per_s == pytest.approx(25_000)


def test_client_ttft_wins_over_decode_side_ttft():
    r = build_report(overlap_timeline(client_ttft_s=0.085))
    assert r.ttft_s == 0.085 and r.ttft_source == "client"
    r = build_report(overlap_timeline(client_sent=None))
    assert r.ttft_s is None and r.ttft_source is None
    assert r.t0 == pytest.approx(0.010)  # no request stamp: times count from prefill start


def test_single_token_has_no_itl():
    r = build_report(overlap_timeline(token_times=(0.080,)))
    assert r.itl_s == () and r.itl_p50_s is None and r.decode_tokens_per_s is None


# ---- handoff figures -------------------------------------------------------------------------


def test_fully_overlapped_handoff():
    r = build_report(overlap_timeline())
    assert r.kv_bytes == 4 * MB
    assert r.wire_time_s == pytest.approx(0.040)
    assert r.transfer_span_s == pytest.approx(0.040)
    assert r.achieved_gbps == pytest.approx(0.1)
    assert r.layer_wire_s == pytest.approx(0.010)
    assert r.exposed_handoff_s == pytest.approx(0.011)  # last layer's wire + inject
    assert r.handoff_target_s == pytest.approx(1.5 * 0.010 + 0.010)
    assert r.meets_handoff_target is True
    assert r.hidden_fraction == pytest.approx(3 / 4)  # (L-1)/L
    assert r.prefill_to_injected_s == pytest.approx(0.051)


@pytest.mark.parametrize("n_layers", [2, 8, 32])
def test_hidden_fraction_of_full_overlap_is_l_minus_1_over_l(n_layers):
    r = build_report(overlap_timeline(n_layers))
    assert r.hidden_fraction == pytest.approx((n_layers - 1) / n_layers)
    assert r.exposed_handoff_s == pytest.approx(0.011)


def test_sequential_handoff_hides_nothing():
    r = build_report(sequential_timeline())
    assert r.hidden_fraction == 0.0
    assert r.exposed_handoff_s == pytest.approx(0.041)
    assert r.transfer_span_s == pytest.approx(0.040)
    assert r.achieved_gbps == pytest.approx(0.1)
    assert r.meets_handoff_target is False


def link_bound_timeline(**overrides) -> Timeline:
    """The link is slower than compute: 20 ms per piece. Pieces are computed at 20, 30, 40,
    50 ms and handed to the socket at once (send_start); the socket buffer takes each whole
    piece within 1 ms (sent), but they arrive 20 ms apart: at 40, 60, 80, 100 ms."""
    pieces = tuple(
        LayerTiming(i, 0, 1000, MB, OFFSET + 0.010 * (i + 2), OFFSET + 0.010 * (i + 2) + 0.001,
                    0.040 + 0.020 * i, 0.041 + 0.020 * i, send_start=OFFSET + 0.010 * (i + 2))
        for i in range(4)
    )  # fmt: skip
    return overlap_timeline(layers=pieces, **overrides)


def test_partially_overlapped_handoff():
    # On the wire (FIFO: a piece starts once the one ahead has arrived): [20,40] [40,60]
    # [60,80] [80,100] ms; prefill ends at 50 ms.
    r = build_report(link_bound_timeline())
    assert r.hidden_fraction == pytest.approx(30 / 80)
    assert r.wire_time_s == pytest.approx(0.080)
    assert r.transfer_span_s == pytest.approx(0.080)
    assert r.achieved_gbps == pytest.approx(4 * MB / 0.080 / 1e9)
    assert r.layer_wire_s == pytest.approx(0.020)
    assert r.exposed_handoff_s == pytest.approx(0.051)


def flat(pairs) -> list[float]:
    return [t for pair in pairs for t in pair]


def test_wire_intervals_are_fifo():
    def piece(sent, received, send_start=None):
        return LayerTiming(0, 0, 1, 1, 0.0, sent, received, received, send_start)

    # Without send_start a piece is on the wire from its last byte handed over (sent), and
    # never before the piece ahead of it arrived; order is arrival order, whatever the input.
    pieces = [piece(0.030, 0.060), piece(0.010, 0.040), piece(0.070, 0.075)]
    assert flat(wire_intervals(pieces)) == pytest.approx([0.040, 0.060, 0.010, 0.040,
                                                          0.070, 0.075])  # fmt: skip
    # With send_start the piece's whole transmission counts, still FIFO.
    pieces = [piece(0.035, 0.040, 0.020), piece(0.045, 0.070, 0.030)]
    assert flat(wire_intervals(pieces)) == pytest.approx([0.020, 0.040, 0.040, 0.070])
    # Clock error can put the start after the arrival: the interval is empty, not negative.
    assert flat(wire_intervals([piece(0.050, 0.040, 0.045)])) == pytest.approx([0.040, 0.040])
    assert wire_intervals([]) == []


def test_send_start_counts_the_whole_transmission():
    """`sent` alone undercounts a big piece: the socket buffer took it late, so
    received - sent is only the buffer's drain. send_start recovers the full 20 ms."""
    tl = link_bound_timeline()
    late = tuple(replace(p, sent=OFFSET + (p.received - 0.005)) for p in tl.layers)
    without = build_report(replace(tl, layers=tuple(replace(p, send_start=None) for p in late)))
    honest = build_report(replace(tl, layers=late))
    assert without.layer_wire_s == pytest.approx(0.005)
    assert honest.layer_wire_s == pytest.approx(0.020)
    assert honest.transfer_span_s == pytest.approx(0.080)
    assert honest.pieces[0].send_start == pytest.approx(0.020)  # mapped to the decode clock


def test_hidden_fraction_merges_intervals():
    assert hidden_fraction([(0, 2), (1, 3), (5, 6)], 2.5) == pytest.approx(2.5 / 4)
    assert hidden_fraction([(5, 6)], 10) == 1.0
    assert hidden_fraction([], 1) is None


def test_layer_wire_time_sums_the_chunks_of_a_layer():
    pieces = tuple(
        LayerTiming(layer, chunk * 500, 500, MB // 2, OFFSET + t, OFFSET + t, t + 0.005, t + 0.006)
        for layer in range(2)
        for chunk in range(2)
        for t in [0.020 + 0.010 * (2 * chunk + layer)]
    )
    r = build_report(overlap_timeline(n_layers=2, layers=pieces, prefill_end=OFFSET + 0.050))
    assert r.layer_wire_s == pytest.approx(0.010)
    assert r.kv_bytes == 2 * MB


def test_local_mode_has_no_handoff_figures():
    r = build_report(local_timeline())
    assert r.clock_offset_s == 0.0
    assert r.kv_bytes == 0
    assert r.exposed_handoff_s is None and r.hidden_fraction is None and r.wire_time_s is None
    assert r.meets_handoff_target is None
    assert r.prefill_compute_s == pytest.approx(0.140)
    assert r.ttft_s == pytest.approx(0.160)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'pipelined'"):
        overlap_timeline(mode="pipelined")


# ---- T_ideal, overlap efficiency, comparison -------------------------------------------------


def test_ideal_pipelined_time_compute_bound():
    # 10 ms compute per layer, 1 ms per layer on a 1 GB/s link: only the last transfer shows.
    assert ideal_pipelined_time([0.010] * 4, [MB] * 4, 1e9) == pytest.approx(0.041)
    assert ideal_pipelined_time([0.010] * 4, [MB] * 4, 1e9, 0.0005) == pytest.approx(0.0415)


def test_ideal_pipelined_time_link_bound():
    # 1 ms compute, 10 ms transfer per layer: the link is busy from the first layer on.
    assert ideal_pipelined_time([0.001] * 4, [10 * MB] * 4, 1e9) == pytest.approx(0.041)


def test_ideal_pipelined_time_inject_bound_and_edges():
    assert ideal_pipelined_time([0.001] * 2, [MB] * 2, 1e9, 0.020) == pytest.approx(0.042)
    assert ideal_pipelined_time([], [], 1e9) == 0.0
    with pytest.raises(ValueError, match="2 compute times but 1 byte counts"):
        ideal_pipelined_time([0.1, 0.1], [MB], 1e9)
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        ideal_pipelined_time([0.1], [MB], 0)


def test_overlap_efficiency():
    assert overlap_efficiency(1.0, 0.6, 0.5) == pytest.approx(0.8)
    assert overlap_efficiency(1.0, 1.0, 0.5) == 0.0
    assert overlap_efficiency(1.0, 0.8, 1.0) is None  # nothing to hide
    assert overlap_efficiency(1.0, 0.8, 1.2) is None


def reports() -> dict:
    return {
        "overlap": build_report(overlap_timeline()),
        "sequential": build_report(sequential_timeline()),
        "local": build_report(local_timeline()),
    }


def test_compare_ratios_and_efficiency():
    c = compare(reports())
    rows = {row.name: row for row in c.rows}
    assert rows["overlap"].speedup_vs_local == pytest.approx(0.160 / 0.080)
    assert rows["sequential"].speedup_vs_local == pytest.approx(0.160 / 0.120)
    assert rows["local"].speedup_vs_local == pytest.approx(1.0)
    assert rows["overlap"].exposed_handoff_s == pytest.approx(0.011)
    assert rows["local"].exposed_handoff_s is None
    # Link rate from the sequential run (0.1 GB/s = 10 ms per piece), 1 ms inject: the overlap
    # run reached the pipelined bound.
    assert c.t_ideal_s == pytest.approx(0.051)
    assert c.overlap_efficiency == pytest.approx((0.081 - 0.051) / (0.081 - 0.051))


def test_compare_without_local_or_sequential():
    c = compare({"overlap": build_report(overlap_timeline())})
    assert c.rows[0].speedup_vs_local is None
    assert c.t_ideal_s is None and c.overlap_efficiency is None


# ---- JSON ------------------------------------------------------------------------------------


def test_timeline_dict_round_trip():
    tl = overlap_timeline(fallback="x", decision={"role": "split", "est": {"ttft_s": 0.1}})
    d = json.loads(json.dumps(tl.to_dict()))
    assert d["schema"] == SCHEMA
    assert Timeline.from_dict(d) == tl
    assert Timeline.from_dict(local_timeline().to_dict()) == local_timeline()


def test_timeline_from_dict_names_what_is_wrong():
    with pytest.raises(ValueError, match="exo-split.report/1"):
        Timeline.from_dict({"schema": "something/2"})
    d = overlap_timeline().to_dict()
    del d["first_token"]
    with pytest.raises(ValueError, match="first_token"):
        Timeline.from_dict(d)


def test_to_json_schema():
    r = build_report(overlap_timeline(decision={"role": "split"}))
    doc = json.loads(json.dumps(to_json(r), allow_nan=False))
    assert doc["schema"] == SCHEMA and doc["time_origin"] == "client_sent"
    assert doc["ttft_s"] == pytest.approx(0.080)
    assert doc["prefill_compute_s"] == pytest.approx(0.040)
    assert doc["kv_bytes"] == 4 * MB
    assert doc["itl_p99_s"] == pytest.approx(0.050)
    assert doc["exposed_handoff_s"] == pytest.approx(0.011)
    assert doc["hidden_fraction"] == pytest.approx(0.75)
    assert doc["clock_offset_s"] == pytest.approx(100.0)
    assert doc["clock_uncertainty_s"] == pytest.approx(0.002)
    assert doc["meets_handoff_target"] is True
    assert doc["fallback"] is None and doc["decision"] == {"role": "split"}
    assert doc["events"]["prefill_end"] == pytest.approx(0.050)
    first = doc["layers"][0]
    assert list(first) == [
        "layer", "token_start", "n_tokens", "nbytes", "compute_done", "sent", "received",
        "injected", "send_start",
    ]  # fmt: skip
    assert first["send_start"] is None  # not stamped by this (older) peer
    assert [first[k] for k in ("compute_done", "sent", "received", "injected")] == pytest.approx(
        [0.020, 0.020, 0.030, 0.031]
    )
    assert doc["token_times"][0] == pytest.approx(0.080)
    assert doc["timeline"] == json.loads(json.dumps(r.timeline.to_dict()))


def test_times_count_from_prefill_start_without_a_request_stamp():
    doc = to_json(build_report(overlap_timeline(client_sent=None)))
    assert doc["time_origin"] == "prefill_start"
    assert doc["layers"][0]["compute_done"] == pytest.approx(0.010)


def test_load_report_round_trip(tmp_path):
    r = build_report(overlap_timeline(fallback=None, decision={"role": "split"}))
    text = json.dumps(to_json(r))
    assert load_report(json.loads(text)) == r
    path = tmp_path / "report.json"
    path.write_text(text)
    assert load_report(path) == r
    assert load_report(str(path)) == r
    # Captured `--json` stdout: the document is the last line.
    path.write_text("some tokens\nmore tokens\n" + text + "\n")
    assert load_report(path) == r
    assert load_report(r.timeline.to_dict()) == r  # a bare timeline works too
    path.write_text("no json here\n")
    with pytest.raises(ValueError, match="expected a JSON report"):
        load_report(path)


def test_load_comparison_round_trip(tmp_path):
    c = compare(reports())
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(to_json(c), allow_nan=False))
    assert load_comparison(path) == c
    with pytest.raises(ValueError, match="load_comparison"):
        load_report(path)


# ---- terminal --------------------------------------------------------------------------------


def assert_fits(text: str, width: int = 100) -> None:
    too_wide = [line for line in text.splitlines() if len(line) > width]
    assert not too_wide, too_wide


def test_render_terminal_four_layers():
    text = render_terminal(build_report(overlap_timeline(decision={"role": "split [why]"})))
    assert_fits(text)
    for figure in ("80.0 ms", "11.0 ms", "75.0%", "4.00 MB", "0.10 GB/s", "25,000 tok/s",
                   "10.0 / 20.0 / 50.0 ms", "80.0 tok/s", "± 2.00 ms", "met"):  # fmt: skip
        assert figure in text, figure
    assert "decision: role=split [why]" in text  # brackets are not taken as rich markup
    rows = [line for line in text.splitlines() if line.startswith("L")]
    assert [row.split()[0] for row in rows] == ["L0", "L1", "L2", "L3"]
    for glyph in "█─▪┆":
        assert glyph in text
    # Layer 3 is computed last: its compute bar starts right of layer 0's.
    assert rows[3].index("█") > rows[0].index("█")


def test_render_terminal_eighty_layers_buckets_rows():
    text = render_terminal(build_report(overlap_timeline(80)))
    assert_fits(text)
    rows = [line for line in text.splitlines() if line.startswith("L")]
    assert len(rows) == 40
    assert rows[0].split()[0] == "L0-1" and rows[-1].split()[0] == "L78-79"
    assert "2 layers per row" in text


@pytest.mark.parametrize("width", [80, 120])
def test_render_terminal_other_widths(width):
    assert_fits(render_terminal(build_report(overlap_timeline(8)), width=width), width)


def test_render_terminal_local_mode():
    text = render_terminal(build_report(local_timeline()))
    assert_fits(text)
    assert "none (local prefill)" in text
    assert "no KV pieces" in text


def test_render_terminal_shows_fallback():
    # Two layers arrived before the peer died; the decode node then prefilled locally.
    partial = overlap_timeline().layers[:2]
    reason = "local prefill: peer died after layer 1 (connection reset)"
    tl = local_timeline(layers=partial, clock=SYNC, fallback=reason)
    r = build_report(tl)
    assert r.exposed_handoff_s is None and r.kv_bytes == 2 * MB
    text = render_terminal(r)
    assert_fits(text)
    assert f"fallback: {reason}" in text.replace("\n  ", " ")
    assert sum(line.startswith("L") for line in text.splitlines()) == 4


def test_render_comparison():
    text = render_comparison(compare(reports()))
    assert_fits(text)
    for figure in ("overlap", "sequential", "local", "2.00×", "1.33×", "11.0 ms", "100.0%"):
        assert figure in text, figure
    assert not math.isnan(compare(reports()).overlap_efficiency)


def test_send_start_round_trips_and_is_relative_in_json(tmp_path):
    r = build_report(link_bound_timeline())
    doc = json.loads(json.dumps(to_json(r)))
    assert [p["send_start"] for p in doc["layers"]] == pytest.approx([0.020, 0.030, 0.040, 0.050])
    assert Timeline.from_dict(doc["timeline"]) == r.timeline
    assert load_report(doc) == r
    # A timeline from before the stamp existed still loads: send_start defaults to None.
    old = overlap_timeline().to_dict()
    for piece in old["layers"]:
        del piece["send_start"]
    assert load_report(old) == build_report(overlap_timeline())


def test_load_accepts_split_generate_json_output(tmp_path):
    r = build_report(overlap_timeline())
    out = {"tokens": [1, 2], "text": "x", "prompt_tokens": 1000, "report": to_json(r)}
    path = tmp_path / "run.json"
    path.write_text("streamed text\n" + json.dumps(out) + "\n")
    assert load_report(path) == r
    assert load(path) == r
    c = compare(reports())
    path.write_text(json.dumps({**out, "same_tokens": True, "report": to_json(c)}))
    assert load(path) == c
    assert load_comparison(path) == c


def test_compare_names_the_link_rate_it_assumed():
    c = compare(reports())
    assert c.link_gbps == pytest.approx(0.1)
    assert to_json(c)["link_gbps"] == pytest.approx(0.1)
    assert "0.100 GB/s" in render_comparison(c)
    assert compare({"local": build_report(local_timeline())}).link_gbps is None


def test_text_timeline_draws_the_whole_transmission():
    tl = link_bound_timeline()
    late = tuple(replace(p, sent=OFFSET + (p.received - 0.005)) for p in tl.layers)
    without = replace(tl, layers=tuple(replace(p, send_start=None) for p in late))

    def wire_cells(timeline) -> int:
        text = render_terminal(build_report(timeline))
        return next(line for line in text.splitlines() if line.startswith("L0")).count("─")

    # Layer 0 is on the wire 20 of the 100 ms axis with send_start, 5 ms without.
    assert wire_cells(replace(tl, layers=late)) > 3 * wire_cells(without)


def test_t_ideal_takes_compute_times_from_the_sequential_run():
    """A slow link fills the overlapped run's send queue, which blocks its compute thread: its
    pieces are 20 ms apart instead of 10. The bound must not count those stalls as compute."""
    stalled = tuple(
        replace(p, compute_done=OFFSET + 0.010 + 0.020 * (p.layer + 1))
        for p in link_bound_timeline().layers
    )
    ovl = build_report(replace(link_bound_timeline(), layers=stalled, prefill_end=OFFSET + 0.090))
    c = compare({"overlap": ovl, "sequential": build_report(sequential_timeline())})
    # Sequential compute (10 ms per layer), its link rate (10 ms per piece), 1 ms inject.
    assert c.t_ideal_s == pytest.approx(0.051)
    assert measured_ideal(ovl, 1e8) == pytest.approx(0.091)  # the stalled run's own: too high


def test_decision_line_is_short_and_says_what_was_chosen_and_why():
    from exo_split.report.text import decision_text

    decision = {
        "choice": "local",
        "reason": "estimated faster",
        "mode": "auto",
        "prompt_tokens": 300,
        "figures": {"local_prefill_tps": 1300.0, "link_bytes_per_s": 1.25e9},
        "estimates": {"local_ttft_s": 0.2, "remote_ttft_s": 0.35},
        "break_even_tokens": 1234.4,
        "decided_in_s": 0.0001,
        "measured": {"ran": "local", "ttft_s": 0.21},
    }
    line = decision_text(decision)
    assert line == (
        "local prefill (estimated faster); estimated TTFT local 200.0 ms, remote 350.0 ms; "
        "break-even 1,234 tokens; measured TTFT 210.0 ms (local)"
    )
    assert "link_bytes_per_s" not in line  # inputs stay in the JSON report
