"""The benchmark's figures from its runs (medians per point, the targets) and its card.

Pure functions over the report's HandoffReports and plain numbers; docs/BENCHMARKS.md says what
each figure means.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

SCHEMA = "exo-split.bench/1"
# The targets of issue 4.
TARGET_EFFICIENCY, TARGET_TRANSPORT, TARGET_ITL = 0.9, 0.85, 1.05
TARGET_MIN_TOKENS = 1024  # efficiency, exposed handoff and transport are judged from here on


@dataclass
class Run:
    report: Any  # report.HandoffReport, client TTFT filled in
    tokens: list[int]


@dataclass
class Point:
    """All runs of one (link setting, prompt length)."""

    ratio: float
    prompt_tokens: int
    rate_bits: int
    calibration: dict  # compute_per_layer_s, bytes_per_layer on the unshaped link
    runs: dict[str, list[Run]] = field(default_factory=lambda: {"overlap": [], "sequential": []})
    plain_gbps: list[float] = field(default_factory=list)


def layer_compute_s(r) -> float:
    """Median compute time of one piece of a report (previous piece done -> this one done)."""
    from exo_split.report import piece_starts

    starts = piece_starts(r)
    return statistics.median(p.compute_done - c for p, (c, _) in zip(r.pieces, starts, strict=True))


def _median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def point_figures(pt: Point, local: list[Run] | None) -> dict:
    """The medians of one point. T_ideal per sequential run (compute never stalled there) at
    the plain socket's rate on this link, with the overlapped runs' inject time. The overlap
    efficiency is the median over the pairs of runs made back to back (load drifts between
    pairs more than within one), next to the efficiency of the medians."""
    from exo_split.report import measured_ideal, median_inject_s, overlap_efficiency

    ovl = [r.report for r in pt.runs["overlap"]]
    seq = [r.report for r in pt.runs["sequential"]]
    link = _median(pt.plain_gbps)
    t_ovl = _median([r.prefill_to_injected_s for r in ovl])
    t_seq = _median([r.prefill_to_injected_s for r in seq])
    inject = _median([median_inject_s(r) for r in ovl])
    ideals = [measured_ideal(r, link * 1e9, inject) for r in seq]
    t_ideal = _median(ideals)
    paired = [
        overlap_efficiency(b.prefill_to_injected_s, a.prefill_to_injected_s, ideal)
        for a, b, ideal in zip(ovl, seq, ideals, strict=True)
    ]
    # Diagnostic: the bound for the overlapped runs' own compute times, which are slower than the
    # sequential runs' where sending competes for the prefill node's CPU. Meaningful on a
    # compute-bound link only: on a slow one they also hold the stalls of a full send queue.
    own = [measured_ideal(r, link * 1e9, inject) for r in ovl]
    paired_own = [
        overlap_efficiency(b.prefill_to_injected_s, a.prefill_to_injected_s, ideal)
        for a, b, ideal in zip(ovl, seq, own, strict=True)
    ]
    compute = _median([layer_compute_s(r) for r in seq])
    nbytes = pt.calibration["bytes_per_layer"]
    exposed = _median([r.exposed_handoff_s for r in ovl])
    ideal_exposed = _median([i - r.prefill_compute_s for i, r in zip(ideals, seq, strict=True)])
    target = _median([r.handoff_target_s for r in ovl])
    transport = _median([r.achieved_gbps for r in seq])
    ttft = {
        "overlap": _median([r.ttft_s for r in ovl]),
        "sequential": _median([r.ttft_s for r in seq]),
        "local": _median([r.report.ttft_s for r in local]) if local else None,
    }
    return {
        "ratio": pt.ratio,
        "prompt_tokens": pt.prompt_tokens,
        "calibration": pt.calibration,
        "rate_mbit": pt.rate_bits / 1e6,
        "link_gbps": link,
        "compute_per_layer_s": compute,
        "overlap_compute_per_layer_s": _median([layer_compute_s(r) for r in ovl]),
        "bytes_per_layer": nbytes,
        "transfer_ratio": nbytes / (link * 1e9) / compute if compute else None,
        "prefill_compute_s": {
            "overlap": _median([r.prefill_compute_s for r in ovl]),
            "sequential": _median([r.prefill_compute_s for r in seq]),
        },
        "ttft_s": ttft,
        "speedup_vs_local": {
            k: ttft["local"] / v if ttft["local"] and v else None
            for k, v in ttft.items()
            if k != "local"
        },
        "t_overlap_s": t_ovl,
        "t_sequential_s": t_seq,
        "t_ideal_s": t_ideal,
        "overlap_efficiency": _median(paired),
        "overlap_efficiency_runs": paired,
        "overlap_efficiency_of_medians": overlap_efficiency(t_seq, t_ovl, t_ideal),
        "t_ideal_own_compute_s": _median(own),
        "overlap_efficiency_own_compute": _median(paired_own),
        "exposed_handoff_s": exposed,
        "handoff_target_s": target,
        "meets_handoff_target": exposed <= target,
        "ideal_exposed_s": ideal_exposed,
        "target_reachable": ideal_exposed <= target,  # does the bound itself meet it?
        "hidden_fraction": _median([r.hidden_fraction for r in ovl]),
        "layer_wire_s": _median([r.layer_wire_s for r in ovl]),
        "inject_per_layer_s": inject,
        "transport_gbps": transport,
        "plain_gbps": link,
        "transport_vs_plain": transport / link if transport and link else None,
        "runs": len(ovl),
    }


def itl_figures(n: int, pairs: list[tuple[Run, dict]]) -> dict:
    from exo_split.report import percentile

    split_itl = _median([ours.report.itl_p50_s for ours, _ in pairs])
    gaps = [[b - a for a, b in pairwise(theirs["token_times"])] for _, theirs in pairs]
    mlx_itl = _median([percentile(g, 50) for g in gaps])
    return {
        "prompt_tokens": n,
        "split_itl_p50_s": split_itl,
        "mlx_lm_itl_p50_s": mlx_itl,
        "ratio": split_itl / mlx_itl if split_itl and mlx_itl else None,
        "pair_ratios": [
            ours.report.itl_p50_s / percentile(g, 50)
            for (ours, _), g in zip(pairs, gaps, strict=True)
        ],
        "mlx_lm_ttft_s": _median([theirs["ttft_s"] for _, theirs in pairs]),
        "split_ttft_s": _median([ours.report.ttft_s for ours, _ in pairs]),
        "same_tokens": all(ours.tokens == theirs["tokens"] for ours, theirs in pairs),
        "runs": len(pairs),
        "tokens": len(pairs[0][1]["tokens"]),
    }


def targets(points: list[dict], itl: list[dict]) -> dict:
    big = [p for p in points if p["prompt_tokens"] >= TARGET_MIN_TOKENS]

    def per_link(key: str, worst=min) -> dict[str, float | None]:
        out = {}
        for ratio in sorted({p["ratio"] for p in big}):
            values = [p[key] for p in big if p["ratio"] == ratio and p[key] is not None]
            out[f"{ratio:g}x"] = worst(values) if values else None
        return out

    eff = per_link("overlap_efficiency")
    transport = per_link("transport_vs_plain")
    exposed = {
        f"{ratio:g}x": [
            {"prompt_tokens": p["prompt_tokens"], "exposed_s": p["exposed_handoff_s"],
             "target_s": p["handoff_target_s"], "ideal_s": p["ideal_exposed_s"],
             "met": p["meets_handoff_target"], "reachable": p["target_reachable"]}
            for p in big if p["ratio"] == ratio
        ]
        for ratio in sorted({p["ratio"] for p in big})
    }  # fmt: skip
    itl_ratio = max((i["ratio"] for i in itl if i["ratio"] is not None), default=None)

    def met(values, ok) -> bool | None:  # None: no point to judge
        values = [v for v in values if v is not None]
        return all(ok(v) for v in values) if values else None

    return {
        "min_prompt_tokens": TARGET_MIN_TOKENS,
        "overlap_efficiency": {"target": TARGET_EFFICIENCY, "worst": eff,
                               "met": met(eff.values(), lambda v: v >= TARGET_EFFICIENCY)},
        "exposed_handoff": {"target": "1.5 x layer_wire + 10 ms", "points": exposed,
                            "met": met([x["met"] for v in exposed.values() for x in v], bool)},
        "transport_vs_plain": {"target": TARGET_TRANSPORT, "worst": transport,
                               "met": met(transport.values(), lambda v: v >= TARGET_TRANSPORT)},
        "decode_itl_ratio": {"target": TARGET_ITL, "worst": itl_ratio,
                             "met": met([itl_ratio], lambda v: v <= TARGET_ITL)},
    }  # fmt: skip


def summarize(s, unshaped, local, points, baseline, skipped) -> dict:
    figures = [point_figures(pt, local.get(pt.prompt_tokens)) for pt in points]
    itl = [itl_figures(n, pairs) for n, pairs in baseline.items()]
    return {
        "schema": SCHEMA,
        "quick": s.quick,
        "config": s.config,
        "repeats": s.repeats,
        "max_tokens": s.max_tokens,
        "cpus": None if s.cpus is None else {"prefill": s.cpus[0], "decode": s.cpus[1]},
        "unshaped_gbps": unshaped,
        "local": [
            {
                "prompt_tokens": n,
                "ttft_s": _median([r.report.ttft_s for r in runs]),
                "prefill_compute_s": _median([r.report.prefill_compute_s for r in runs]),
            }
            for n, runs in local.items()
        ],  # fmt: skip
        "points": figures,
        "itl": itl,
        "targets": targets(figures, itl),
        "skipped": skipped,
    }


# ---- the card ---------------------------------------------------------------------------------


def render_itl(itl: list[dict], *, width: int = 120) -> str:
    """The bench model's decode ITL rows: after a handoff vs mlx-lm's own prefill + decode."""
    from rich import box
    from rich.table import Table

    from exo_split.report.text import render_rich

    table = Table(title="decode ITL p50 (ms) after a handoff vs mlx-lm's own",
                  title_justify="left", box=box.SIMPLE_HEAD, min_width=60)  # fmt: skip
    for col in ("tokens", "split", "mlx-lm", "ratio", "same tokens"):
        table.add_column(col, justify="right")
    for i in itl:
        table.add_row(f"{i['prompt_tokens']:,}", _ms(i["split_itl_p50_s"], 2),
                      _ms(i["mlx_lm_itl_p50_s"], 2), _x(i["ratio"], ".3f"),
                      "yes" if i["same_tokens"] else "no")  # fmt: skip
    return render_rich(table, width)


def _ms(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x * 1e3:,.{digits}f}"


def _x(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def render_card(doc: dict, *, width: int = 120) -> str:
    from rich import box
    from rich.table import Table

    from exo_split.report.text import render_rich

    c = doc["config"]
    lines = [
        f"exo-split bench · Llama {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_key_value_heads']} KV heads × {c['head_dim']} · float32 · torch prefill → mlx "
        f"decode · {doc['repeats']} runs per point (medians) · {doc['max_tokens']} new tokens",
        f"cpus: {doc['cpus'] or 'not pinned'} · unshaped veth {doc['unshaped_gbps']:.2f} GB/s",
    ]
    for ratio in sorted({p["ratio"] for p in doc["points"]}):
        table = Table(
            title=f"link: one layer's transfer ≈ {ratio:g} × its compute (tbf rate per length)",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            padding=(0, 1),
            pad_edge=False,
        )
        for col in ("tokens", "Mbit/s", "xfer/cmp", "TTFT ovl", "seq", "local", "T_ideal",
                    "T_ovl", "T_seq", "eff", "exposed", "target", "ideal", "tr/plain"):  # fmt: skip
            table.add_column(col, justify="right", no_wrap=True)
        for p in (p for p in doc["points"] if p["ratio"] == ratio):
            t = p["ttft_s"]
            table.add_row(
                f"{p['prompt_tokens']:,}", f"{p['rate_mbit']:,.0f}", _x(p["transfer_ratio"]),
                _ms(t["overlap"]), _ms(t["sequential"]), _ms(t["local"]), _ms(p["t_ideal_s"]),
                _ms(p["t_overlap_s"]), _ms(p["t_sequential_s"]), _x(p["overlap_efficiency"]),
                _ms(p["exposed_handoff_s"]), _ms(p["handoff_target_s"]), _ms(p["ideal_exposed_s"]),
                _x(p["transport_vs_plain"]),
            )  # fmt: skip
        lines += ["", render_rich(table, width + 40)]  # its natural width: about 125 columns
    if doc["itl"]:
        lines += ["", render_itl(doc["itl"], width=width)]
    t = doc["targets"]
    ok = {True: "met", False: "MISSED", None: "n/a (no such point)"}
    fmt_worst = lambda d: ", ".join(f"{k} {_x(v)}" for k, v in d.items()) or "—"  # noqa: E731
    handoff = "; ".join(
        f"{k}: {sum(x['met'] for x in v)}/{len(v)} met, the bound itself meets it at "
        f"{sum(x['reachable'] for x in v)}/{len(v)}"
        for k, v in t["exposed_handoff"]["points"].items()
    )
    lines += [
        "",
        f"targets (prompts ≥ {t['min_prompt_tokens']:,} tokens):",
        f"  overlap efficiency ≥ {TARGET_EFFICIENCY}: worst "
        f"{fmt_worst(t['overlap_efficiency']['worst'])} — {ok[t['overlap_efficiency']['met']]}",
        f"  exposed handoff ≤ 1.5 × layer wire + 10 ms: {ok[t['exposed_handoff']['met']]}"
        + (f" ({handoff})" if handoff else ""),
        f"  transport ≥ {TARGET_TRANSPORT:.0%} of a plain socket: worst "
        f"{fmt_worst(t['transport_vs_plain']['worst'])} — {ok[t['transport_vs_plain']['met']]}",
        f"  decode ITL ≤ {TARGET_ITL} × mlx-lm: worst {_x(t['decode_itl_ratio']['worst'], '.3f')}"
        f" — {ok[t['decode_itl_ratio']['met']]}",
        "times in ms; T_* = prefill start → last layer injected; eff = (T_seq − T_ovl) / "
        "(T_seq − T_ideal); ideal = the bound's exposed handoff (T_ideal − prefill compute)",
    ]
    if doc["skipped"]:
        lines.append(f"out of time, skipped: {', '.join(doc['skipped'])}")
    return "\n".join(lines)
