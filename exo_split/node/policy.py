"""Who prefills: estimate the time to first token (TTFT) of a remote prefill and of a local
one from measured figures, and pick the faster. Pure arithmetic: no I/O, no clock.

    local   TTFT = n / P_local
    remote  TTFT = rtt + overhead + pipeline(compute = n / P_peer, transfer = n * b / B)

n prompt tokens, P prefill tokens/s, b KV bytes per token (all layers, wire dtype), B link
bytes/s, rtt the request round trip, overhead what else a remote prefill costs per request
(learned from the last real one: 0 until then). With overlap, layer l's KV travels while layer l+1
computes: the slower phase sets the pace and only one layer's worth (1/L) of the faster one
is exposed, `max(compute + transfer / L, compute / L + transfer)`; without overlap it is
`compute + transfer`. Both estimates are linear in n and only the remote one has an
intercept (rtt), so there is one break-even length:

    n* = (rtt + overhead) / (1 / P_local - k)        k = remote seconds per token

Below n* local wins; above it remote wins. If k >= 1 / P_local (slow link or slow peer) the
remote never wins, whatever the length. What the model leaves out (inject time of the last
layer, the first decode step, prefill speed falling as attention grows) is in
docs/discovery.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from exo_split.kv import itemsize
from exo_split.layers import recurrent_layers
from exo_split.spec import ModelSpec

# Used when a figure is missing: the fixed threshold public systems ship with (EXO and
# NVIDIA Dynamo both prefill remotely from 1,000 prompt tokens).
FIXED_THRESHOLD_TOKENS = 1000
MODES = ("auto", "remote", "local")


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V bytes of one prompt token over all layers, as they go on the wire."""
    return 2 * n_layers * n_kv_heads * head_dim * itemsize(dtype)


def handoff_bytes_per_token(spec: ModelSpec, dtype: str) -> int:
    """What one more prompt position adds to a handoff: the K and V of the attention layers
    (a recurrent layer's state is one size at every length; a latent layer's V is narrower
    than its K: layers.py)."""
    attention = spec.n_layers - len(recurrent_layers(spec))
    return attention * spec.layer_bytes_per_token(itemsize(dtype))


@dataclass(frozen=True)
class Figures:
    """What the estimate is made from. None = not measured."""

    local_prefill_tps: float | None  # the decode node's own prefill speed
    peer_prefill_tps: float | None  # the prefill peer's advertised speed
    link_bytes_per_s: float | None  # decode node <- prefill peer
    round_trip_s: float | None  # request -> first byte of the answer, small payload
    kv_bytes_per_token: int
    n_layers: int
    overlap: bool = True
    overhead_s: float = 0.0  # per remote request beyond the round trip (learned)

    @property
    def fixed_s(self) -> float:
        """The remote estimate's intercept: what a 0-token prompt would cost."""
        return (self.round_trip_s or 0.0) + self.overhead_s

    def missing(self) -> list[str]:
        names = ("local_prefill_tps", "peer_prefill_tps", "link_bytes_per_s", "round_trip_s")
        return [n for n in names if not _positive(getattr(self, n), allow_zero=n == "round_trip_s")]


def _positive(x: float | None, *, allow_zero: bool = False) -> bool:
    return x is not None and math.isfinite(x) and (x >= 0 if allow_zero else x > 0)


def remote_seconds_per_token(f: Figures) -> float:
    """k: what one more prompt token adds to the remote TTFT."""
    compute = 1.0 / f.peer_prefill_tps  # type: ignore[operator]
    transfer = f.kv_bytes_per_token / f.link_bytes_per_s  # type: ignore[operator]
    if not f.overlap:
        return compute + transfer
    layers = max(f.n_layers, 1)
    return max(compute + transfer / layers, compute / layers + transfer)


def local_ttft(n: int, f: Figures) -> float:
    return n / f.local_prefill_tps  # type: ignore[operator]


def remote_ttft(n: int, f: Figures) -> float:
    return f.fixed_s + n * remote_seconds_per_token(f)


def break_even_tokens(f: Figures) -> float | None:
    """The prompt length from which remote prefill is faster; None: never (see module doc)."""
    gain = 1.0 / f.local_prefill_tps - remote_seconds_per_token(f)  # type: ignore[operator]
    if gain <= 0:
        return None
    return f.fixed_s / gain


@dataclass(frozen=True)
class Decision:
    """The choice and everything it was made from; `to_dict` goes into the report."""

    choice: str  # "remote" | "local"
    reason: str
    mode: str  # what was asked: auto | remote | local
    prompt_tokens: int
    local_ttft_s: float | None = None
    remote_ttft_s: float | None = None
    break_even_tokens: float | None = None  # None: remote never wins, or figures unknown
    figures: Figures | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["estimates"] = {"local_ttft_s": d.pop("local_ttft_s"),
                          "remote_ttft_s": d.pop("remote_ttft_s")}  # fmt: skip
        return d


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def decide(n: int, f: Figures | None, *, mode: str = "auto") -> Decision:
    """Remote or local prefill for an n-token prompt. `f` None: no usable prefill peer.

    `mode` "remote"/"local" forces the choice (estimates are still computed when they can
    be, so the report shows what was given up); "auto" picks the smaller estimate, or uses
    FIXED_THRESHOLD_TOKENS when a figure is missing.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if n < 1:
        raise ValueError(f"a prompt has at least one token, got {n}")
    if f is None:
        if mode == "remote":
            raise ValueError("remote prefill asked for, but there is no prefill peer")
        why = "requested" if mode == "local" else "no prefill peer serving this model"
        return Decision("local", why, mode, n)
    missing = f.missing()
    estimates: dict[str, Any] = {"figures": f}
    if not missing:
        estimates |= dict(
            local_ttft_s=local_ttft(n, f),
            remote_ttft_s=remote_ttft(n, f),
            break_even_tokens=break_even_tokens(f),
        )
    decision = Decision("local", "", mode, n, **estimates)
    if mode != "auto":
        return replace(decision, choice=mode, reason="requested")
    if missing:
        choice = "remote" if n >= FIXED_THRESHOLD_TOKENS else "local"
        reason = (
            f"{', '.join(missing)} unknown: fixed threshold of {FIXED_THRESHOLD_TOKENS} "
            f"prompt tokens ({n} {'>=' if choice == 'remote' else '<'} threshold)"
        )
        return replace(decision, choice=choice, reason=reason)
    local, remote = decision.local_ttft_s, decision.remote_ttft_s
    choice = "remote" if remote < local else "local"  # type: ignore[operator]
    faster, slower = sorted((local, remote))  # type: ignore[type-var]
    be = decision.break_even_tokens
    where = "remote never wins" if be is None else f"break-even at {be:.0f} tokens"
    reason = f"{choice} prefill estimated faster ({_fmt_ms(faster)} vs {_fmt_ms(slower)}); {where}"
    return replace(decision, choice=choice, reason=reason)


# ---- the link, learned from probes and from real transfers -------------------------------


@dataclass(frozen=True)
class LinkEstimate:
    """Decode node <- prefill peer. `source`: "probe" or "transfer"."""

    bytes_per_s: float
    round_trip_s: float
    source: str
    overhead_s: float = 0.0
    samples: int = 1


def link_from_report(
    old: LinkEstimate | None, report: dict[str, Any], *, decision_s: float = 0.0
) -> LinkEstimate | None:
    """Update the link estimate from a finished remote prefill's report (report.to_json).

    kv_bytes / transfer_span is the link speed only when the link was the bottleneck (the
    transfer took at least as long as the compute, or no overlap). When compute was the
    bottleneck the wire waited for layers, so the figure is a lower bound: it can raise the
    estimate, never lower it. The round trip comes from the clock sync (± half of it); the
    overhead is the rest of the TTFT that is neither compute, exposed handoff, round trip
    nor the `decision_s` spent choosing (a probe, say), averaged with the previous figure.
    """
    if report.get("mode") not in ("overlap", "sequential") or report.get("fallback"):
        return old
    kv_bytes, span = report.get("kv_bytes"), report.get("transfer_span_s")
    if not kv_bytes or not span or span <= 0:
        return old
    sample = kv_bytes / span
    compute = report.get("prefill_compute_s") or 0.0
    link_bound = report["mode"] == "sequential" or span >= compute
    half_rtt = report.get("clock_uncertainty_s")
    rtt = 2 * half_rtt if half_rtt is not None else (old.round_trip_s if old else 0.0)
    overhead = None
    ttft, exposed = report.get("ttft_s"), report.get("exposed_handoff_s")
    if ttft is not None and report["mode"] == "overlap":
        overhead = max(0.0, ttft - decision_s - compute - max(exposed or 0.0, 0.0) - rtt)
    if old is None:
        return LinkEstimate(sample, rtt, "transfer", overhead or 0.0)
    bps = sample if link_bound else max(old.bytes_per_s, sample)
    if overhead is None:
        overhead = old.overhead_s
    elif old.source == "transfer":
        overhead = (overhead + old.overhead_s) / 2
    return LinkEstimate(bps, rtt, "transfer", overhead, old.samples + 1)


def figures_for(
    *,
    local_prefill_tps: float | None,
    peer_prefill_tps: float | None,
    link: LinkEstimate | None,
    kv_bytes_per_token: int,
    n_layers: int,
    overlap: bool = True,
) -> Figures:
    return Figures(
        local_prefill_tps=local_prefill_tps,
        peer_prefill_tps=peer_prefill_tps,
        link_bytes_per_s=link.bytes_per_s if link else None,
        round_trip_s=link.round_trip_s if link else None,
        kv_bytes_per_token=kv_bytes_per_token,
        n_layers=n_layers,
        overlap=overlap,
        overhead_s=link.overhead_s if link else 0.0,
    )


def with_outcome(decision: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """The decision dict plus what actually happened (a new dict; the input is untouched)."""
    estimates = decision.get("estimates") or {}
    ran = "local" if report.get("mode") == "local" else "remote"
    estimated = estimates.get(f"{ran}_ttft_s")
    measured = report.get("ttft_s")
    return {
        **decision,
        "measured": {
            "ran": ran,
            "ttft_s": measured,
            "estimated_ttft_s": estimated,
            "prefill_compute_s": report.get("prefill_compute_s"),
            "fallback": report.get("fallback"),
        },
    }
