"""The benchmark's real-size points: Llama-3.1-8B's KV geometry (8 KV heads x 128), layers of
16-128 MiB, on the same two namespaces as the rest of the benchmark.

Per prompt length, repeated, the measurements of one repeat made back to back (their order
alternating between repeats, so the shared machine's load drifts over both alike):

- unshaped veth: a sequential request (the KV sent after the prefill), then a plain TCP socket
  moving the same bytes over the same veth: the transport's rate against the socket's;
- veth shaped to 10 Gbit/s (tbf): a sequential request and the plain socket again (the
  transfer as a share of the shaped rate and of the socket on the same link), and an
  overlapped request: T_ovl (prefill start -> last layer injected) against T_ideal, the
  pipelined bound for the sequential run's per-layer compute at the socket's rate;
- every request: the decode node's peak resident memory (VmHWM, reset before each request)
  against its resident memory before the request + the KV bytes;
- once per length, after the measurements: transformers' greedy tokens (float32, in this
  process, while the nodes are idle) against the tokens every request generated.

Ratios are taken within a repeat and their median reported; the load average is recorded,
since the box is shared.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any

MiB = 2**20
SCALE_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 32768,
}
QUICK_SCALE_CONFIG = {**SCALE_CONFIG, "num_hidden_layers": 2, "max_position_embeddings": 4096}
# float32 KV of 8 x 128 is 8 KiB per position per layer: layers of 16, 32, 64 and 128 MiB.
SCALE_LENGTHS = (2048, 4096, 8192, 16384)
QUICK_SCALE_LENGTHS = (512,)
SHAPED_BITS = 10 * 10**9
# A 16K-token CPU prefill sends nothing for minutes in sequential mode.
NODE_ARGS = ["--idle-timeout", "3600", "--first-frame-timeout", "3600", "--prefill-timeout", "7200"]
MAX_TOKENS = 4
# Issue 10's acceptance.
TARGET_VS_PLAIN, GOAL_VS_PLAIN, TARGET_VS_SHAPED = 0.60, 0.85, 0.85
MEMORY_FACTOR, MEMORY_SLACK = 1.15, 64 * MiB
# Llama-3.1-8B: 32 layers, 8 KV heads x 128, bfloat16; EXO's case is an 8,192-token prompt.
LLAMA_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128, "itemsize": 2, "tokens": 8192}


@dataclass
class Sample:
    """One request of a scale point, with what was measured next to it."""

    run: Any  # figures.Run
    memory: dict  # rss_before, peak (bytes) of the decode node
    plain_gbps: float | None = None  # the plain socket, same bytes, same link, same repeat


@dataclass
class ScalePoint:
    prompt_tokens: int
    samples: dict[str, list[Sample]] = field(
        default_factory=lambda: {"unshaped": [], "shaped_sequential": [], "shaped_overlap": []}
    )
    reference: list[int] | None = None  # transformers' greedy tokens, float32


def reference_tokens(model_dir, token_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy generate() on the checkpoint in float32: the independent
    reference the split's tokens must equal (DESIGN §3's fidelity bar)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([token_ids]), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(token_ids) :].tolist()


def measure(bench, lengths: tuple[int, ...], repeats: int) -> tuple[list[ScalePoint], list]:
    """Every point, interleaved: per repeat, per length, unshaped then shaped."""
    lab = bench.lab
    points = {n: ScalePoint(n) for n in lengths}
    loads = [os.getloadavg()]

    def request(n: int, mode: str) -> Sample:
        lab.reset_peak()
        before = lab.decode_memory()["rss"]
        run = bench.generate(n, mode, MAX_TOKENS)
        return Sample(run, {"rss_before": before, "peak": lab.decode_memory()["peak"]})

    def sequential_and_socket(n: int, rep: int) -> Sample:
        first_socket = rep % 2 == 1
        nbytes = bench.kv_bytes(n)
        plain = bench.plain(nbytes) if first_socket else None
        sample = request(n, "sequential")
        sample.plain_gbps = plain if first_socket else bench.plain(sample.run.report.kv_bytes)
        return sample

    bench.progress("real-size KV: warming up")
    lab.shape(None)
    for mode in ("sequential", "overlap"):
        bench.generate(min(lengths), mode, MAX_TOKENS)
    for rep in range(repeats):
        for n in lengths:
            if bench.out_of_time(f"real-size {n} tokens, repeat {rep + 1}"):
                continue
            bench.progress(f"real-size KV: {n:,} tokens, repeat {rep + 1} of {repeats}")
            pt = points[n]
            lab.shape(None)
            pt.samples["unshaped"].append(sequential_and_socket(n, rep))
            lab.shape(SHAPED_BITS)
            bench.plain(16 * MiB)  # a first transfer through the fresh qdisc
            for mode in ("sequential", "overlap") if rep % 2 == 0 else ("overlap", "sequential"):
                if mode == "sequential":
                    pt.samples["shaped_sequential"].append(sequential_and_socket(n, rep))
                else:
                    pt.samples["shaped_overlap"].append(request(n, "overlap"))
            loads.append(os.getloadavg())
    lab.shape(None)
    measured = [p for p in points.values() if p.samples["unshaped"]]
    from exo_split.bench.prompts import prompt_ids

    for pt in measured:  # after the timed part: this process computes, the nodes are idle
        bench.progress(f"real-size KV: transformers' tokens for {pt.prompt_tokens:,} tokens")
        ids = prompt_ids(pt.prompt_tokens, bench.vocab)
        pt.reference = reference_tokens(lab.model, ids, MAX_TOKENS)
    return measured, loads


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def point_figures(pt: ScalePoint) -> dict:
    from exo_split.report import measured_ideal, median_inject_s

    un, seq, ovl = (pt.samples[k] for k in ("unshaped", "shaped_sequential", "shaped_overlap"))
    kv = un[0].run.report.kv_bytes
    layers = len({p.layer for p in un[0].run.report.pieces})
    shaped_gbps = SHAPED_BITS / 8 / 1e9
    shaped_plain = _median([s.plain_gbps for s in seq])
    inject = _median([median_inject_s(s.run.report) for s in ovl])
    ideal = [measured_ideal(s.run.report, shaped_plain * 1e9, inject) for s in seq]
    t_ovl = [s.run.report.prefill_to_injected_s for s in ovl]
    everything = un + seq + ovl
    growth = [s.memory["peak"] - s.memory["rss_before"] for s in everything]
    bound = MEMORY_FACTOR * kv + MEMORY_SLACK
    tokens = {tuple(s.run.tokens) for s in everything}
    return {
        "prompt_tokens": pt.prompt_tokens,
        "layers": layers,
        "layer_bytes": kv / layers,
        "kv_bytes": kv,
        "unshaped": {
            "transport_gbps": _median([s.run.report.achieved_gbps for s in un]),
            "plain_gbps": _median([s.plain_gbps for s in un]),
            "transport_vs_plain_runs": [s.run.report.achieved_gbps / s.plain_gbps for s in un],
            "transport_vs_plain": _median([s.run.report.achieved_gbps / s.plain_gbps for s in un]),
        },
        "shaped": {
            "rate_gbit": SHAPED_BITS / 1e9,
            "transport_gbps": _median([s.run.report.achieved_gbps for s in seq]),
            "plain_gbps": shaped_plain,
            "transport_vs_rate": _median([s.run.report.achieved_gbps / shaped_gbps for s in seq]),
            "plain_vs_rate": shaped_plain / shaped_gbps if shaped_plain else None,
            "transport_vs_plain": _median([s.run.report.achieved_gbps / s.plain_gbps for s in seq]),
            "ttft_overlap_s": _median([s.run.report.ttft_s for s in ovl]),
            "ttft_sequential_s": _median([s.run.report.ttft_s for s in seq]),
            "prefill_compute_s": _median([s.run.report.prefill_compute_s for s in seq]),
            "t_overlap_s": _median(t_ovl),
            "t_ideal_s": _median(ideal),
            "overlap_vs_ideal_runs": [a / b for a, b in zip(t_ovl, ideal, strict=False)],
            "overlap_vs_ideal": _median([a / b for a, b in zip(t_ovl, ideal, strict=False)]),
            "exposed_handoff_s": _median([s.run.report.exposed_handoff_s for s in ovl]),
            "layer_wire_s": _median([s.run.report.layer_wire_s for s in ovl]),
            "hidden_fraction": _median([s.run.report.hidden_fraction for s in ovl]),
        },
        "decode_memory": {
            "rss_before": _median([s.memory["rss_before"] for s in everything]),
            "peak_growth": _median(growth),
            "peak_growth_max": max(growth),
            "growth_vs_kv": _median([g / kv for g in growth]),
            "bound_growth": bound,
            "within_bound": all(g <= bound for g in growth),
        },
        "same_tokens": len(tokens) == 1,
        "reference_tokens": pt.reference,
        "same_as_transformers": None if pt.reference is None else tokens == {tuple(pt.reference)},
        "runs": len(un),
    }


def llama_8b(points: list[dict]) -> dict | None:
    """What the largest point's shares of the link mean for Llama-3.1-8B at 8K on 10 GbE."""
    if not points:
        return None
    p = max(points, key=lambda p: p["prompt_tokens"])
    m = LLAMA_8B
    layer = 2 * m["kv_heads"] * m["head_dim"] * m["itemsize"] * m["tokens"]
    share = p["shaped"]["transport_vs_rate"]
    rate = SHAPED_BITS / 8 * share if share else None
    return {
        "kv_bytes": layer * m["layers"],
        "layer_bytes": layer,
        "from_prompt_tokens": p["prompt_tokens"],
        "link_share": share,
        "sequential_transfer_s": layer * m["layers"] / rate if rate else None,
        "last_layer_s": layer / rate if rate else None,
    }


def summarize(points: list[ScalePoint], loads: list, config: dict, repeats: int) -> dict:
    figures = [point_figures(p) for p in points]
    big = [f for f in figures if f["prompt_tokens"] >= 4096] or figures

    def worst(get) -> float | None:
        values = [get(f) for f in big if get(f) is not None]
        return min(values) if values else None

    vs_plain = worst(lambda f: f["unshaped"]["transport_vs_plain"])
    vs_rate = worst(lambda f: f["shaped"]["transport_vs_rate"])
    return {
        "config": config,
        "repeats": repeats,
        "max_tokens": MAX_TOKENS,
        "load_average": {
            "start": loads[0],
            "end": loads[-1],
            "max_1min": max(x[0] for x in loads),
        },  # fmt: skip
        "points": figures,
        "targets": {
            "from_prompt_tokens": min(f["prompt_tokens"] for f in big) if big else None,
            "transport_vs_plain": {
                "target": TARGET_VS_PLAIN,
                "goal": GOAL_VS_PLAIN,
                "worst": vs_plain,
                "met": None if vs_plain is None else vs_plain >= TARGET_VS_PLAIN,
            },
            "transport_vs_shaped_rate": {
                "target": TARGET_VS_SHAPED,
                "worst": vs_rate,
                "met": None if vs_rate is None else vs_rate >= TARGET_VS_SHAPED,
            },
            "decode_memory": {
                "bound": f"RSS before + {MEMORY_FACTOR} x KV + 64 MiB",
                "met": all(f["decode_memory"]["within_bound"] for f in figures),
            },
            "same_tokens": all(f["same_tokens"] for f in figures),
            "same_as_transformers": all(f["same_as_transformers"] for f in figures),
        },  # fmt: skip
        "llama_8b_10gbe": llama_8b(figures),
    }


# ---- the card ---------------------------------------------------------------------------------


def _f(x, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def render(doc: dict, width: int = 120) -> str:
    from rich import box
    from rich.table import Table

    from exo_split.report.text import render_rich

    c, load = doc["config"], doc["load_average"]
    table = Table(
        title=f"real-size KV: Llama-3.1-8B's geometry ({c['num_key_value_heads']} KV heads × "
        f"{c['head_dim']}), {c['num_hidden_layers']} layers, float32 · {doc['repeats']} "
        f"repeats (medians of paired ratios) · load average {load['start'][0]:.1f} → "
        f"{load['end'][0]:.1f} (max {load['max_1min']:.1f})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
    )
    for col in ("tokens", "layer MiB", "tr GB/s", "plain", "tr/plain", "10G: tr GB/s",
                "/rate", "/plain", "plain/rate", "T_ovl s", "T_ideal s", "ovl/ideal",
                "exposed ms", "mem +MB", "/KV", "ok"):  # fmt: skip
        table.add_column(col, justify="right", no_wrap=True)
    for p in doc["points"]:
        u, s, m = p["unshaped"], p["shaped"], p["decode_memory"]
        table.add_row(
            f"{p['prompt_tokens']:,}", f"{p['layer_bytes'] / MiB:.0f}",
            _f(u["transport_gbps"]), _f(u["plain_gbps"]), _f(u["transport_vs_plain"]),
            _f(s["transport_gbps"]), _f(s["transport_vs_rate"]), _f(s["transport_vs_plain"]),
            _f(s["plain_vs_rate"]), _f(s["t_overlap_s"]), _f(s["t_ideal_s"]),
            _f(s["overlap_vs_ideal"], ".3f"),
            _f(None if s["exposed_handoff_s"] is None else s["exposed_handoff_s"] * 1e3, ".0f"),
            f"{m['peak_growth'] / 1e6:,.0f}", _f(m["growth_vs_kv"]),
            "yes" if m["within_bound"] else "NO",
        )  # fmt: skip
    t = doc["targets"]
    ok = {True: "met", False: "MISSED", None: "n/a"}
    lines = [
        render_rich(table, width + 50),
        f"targets (prompts ≥ {t['from_prompt_tokens']:,} tokens): sequential transport ≥ "
        f"{TARGET_VS_PLAIN:.0%} of a plain socket (goal {GOAL_VS_PLAIN:.0%}): worst "
        f"{_f(t['transport_vs_plain']['worst'])} — {ok[t['transport_vs_plain']['met']]}; ≥ "
        f"{TARGET_VS_SHAPED:.0%} of 10 Gbit/s: worst {_f(t['transport_vs_shaped_rate']['worst'])}"
        f" — {ok[t['transport_vs_shaped_rate']['met']]}; decode peak ≤ RSS before + "
        f"{MEMORY_FACTOR} × KV + 64 MiB — {ok[t['decode_memory']['met']]}; same tokens in every "
        f"run: {'yes' if t['same_tokens'] else 'NO'}, equal to transformers (float32): "
        f"{'yes' if t.get('same_as_transformers') else 'NO'}",
    ]
    e = doc["llama_8b_10gbe"]
    if e and e["sequential_transfer_s"]:
        lines.append(
            f"Llama-3.1-8B, 8K prompt, 10 GbE: {e['kv_bytes'] / 2**30:.2f} GiB of bf16 KV in 32 "
            f"layers of {e['layer_bytes'] / MiB:.0f} MiB; at the {e['link_share']:.0%} of the "
            f"link measured at {e['from_prompt_tokens']:,} tokens: {e['sequential_transfer_s']:.2f}"
            f" s sent after the prefill, about {e['last_layer_s'] * 1e3:.0f} ms (the last layer) "
            "left exposed when overlapped"
        )
    lines.append(
        "tr = the KV transport (sequential run: first byte on the wire → last received); plain = "
        "a plain TCP socket, same bytes, same link, same repeat; T_* = prefill start → last "
        "layer injected; mem = decode node peak RSS − RSS before the request"
    )
    return "\n".join(lines)
