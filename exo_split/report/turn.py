"""One turn of a conversation, read from the decode node's report document (the `done`
event's `report`, docs/metrics.md): where the prefill ran, the KV moved, the prefix reused,
and the one line `exo-split chat` prints after each reply.

Works on the JSON document, not on HandoffReport: the prefix figures (`prefix`, with
decode_cached_tokens, prefill_cached_tokens, computed_tokens) come from nodes that reuse
prefixes; a node that does not sends none, and every figure missing here reads as unknown.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exo_split.report.text import fmt_bytes

PREFIX_KEYS = ("decode_cached_tokens", "prefill_cached_tokens", "computed_tokens")


def prefix_of(report: Mapping[str, Any]) -> dict[str, int | None]:
    """The report's prefix figures; None for each one the node did not send."""
    prefix = report.get("prefix")
    prefix = prefix if isinstance(prefix, Mapping) else {}
    return {
        k: v if isinstance(v, int) else None for k, v in ((k, prefix.get(k)) for k in PREFIX_KEYS)
    }


def prefilled_where(report: Mapping[str, Any]) -> str:
    """ "remote", "local", or "local (fallback)" when the prefill peer failed."""
    if report.get("mode") in ("overlap", "sequential"):
        return "remote"
    return "local (fallback)" if report.get("fallback") else "local"


def moved_range(report: Mapping[str, Any]) -> tuple[int, int] | None:
    """The prompt positions [start, end) whose KV travelled, from layer 0's pieces; None when
    nothing travelled (a local prefill)."""
    pieces = [p for p in report.get("layers") or () if p.get("layer") == 0]
    if report.get("mode") not in ("overlap", "sequential") or not pieces:
        return None
    return (min(p["token_start"] for p in pieces),
            max(p["token_start"] + p["n_tokens"] for p in pieces))  # fmt: skip


def _count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def turn_line(report: Mapping[str, Any], *, turn: int, ttft_s: float | None) -> str:
    """`[turn 2] prompt 1,640 tok · TTFT 0.31 s · 48 tok, 18.4 tok/s · prefill local ·
    KV 0 B moved · cached decode 1,580 / prefill 0 · computed 60` ('?' where unknown)."""
    ttft = ttft_s if ttft_s is not None else report.get("ttft_s")
    parts = [
        f"[turn {turn}] prompt {_count(report.get('prompt_tokens'))} tok",
        "TTFT ?" if ttft is None else f"TTFT {ttft:.3f} s",
    ]
    generated, tps = report.get("generated_tokens"), report.get("decode_tokens_per_s")
    itl = report.get("itl_p50_s")
    speed = f", {tps:.1f} tok/s" if tps else f", ITL {itl * 1e3:.1f} ms" if itl else ""
    parts.append(f"{_count(generated)} tok{speed}")
    parts.append(f"prefill {prefilled_where(report)}")
    kv = report.get("kv_bytes")
    parts.append("KV ? moved" if not isinstance(kv, int) else f"KV {fmt_bytes(kv)} moved")
    p = prefix_of(report)
    parts.append(
        f"cached decode {_count(p['decode_cached_tokens'])} / "
        f"prefill {_count(p['prefill_cached_tokens'])}"
    )
    parts.append(f"computed {_count(p['computed_tokens'])}")
    return " · ".join(parts)
