"""The data contract of the timing report: the raw `Timeline` the decode node records, and
the `HandoffReport` / `Comparison` that report/figures.py computes from it.

Plain numbers only (no torch, mlx or aiohttp). The node code fills a `Timeline` with raw clock
stamps: per-piece `compute_done`/`sent` and `prefill_start`/`prefill_end` on the prefill node's
clock (and the optional per-piece `send_start`), everything else on the decode node's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

SCHEMA = "exo-split.report/1"
COMPARISON_SCHEMA = "exo-split.comparison/1"
MODES = ("overlap", "sequential", "local")
# Target: exposed handoff <= 1.5 x one layer's wire time + 10 ms.
TARGET_FACTOR, TARGET_SLACK_S = 1.5, 0.010


@dataclass(frozen=True)
class LayerTiming:
    """One (layer, chunk) piece of KV; a single chunk per layer when prefill is not chunked."""

    layer: int
    token_start: int
    n_tokens: int
    nbytes: int  # K+V payload bytes of this piece
    compute_done: float  # prefill clock
    sent: float  # prefill clock: the piece's last byte handed to the socket
    received: float  # decode clock: the piece's last byte arrived
    injected: float  # decode clock: the piece is in the decode cache
    send_start: float | None = None  # prefill clock: first byte handed to the socket, if known


@dataclass(frozen=True)
class ClockSync:
    """One request round trip, used to map the prefill clock onto the decode clock."""

    decode_sent: float  # decode clock: POST /v1/prefill sent
    prefill_received: float  # prefill clock: request arrived
    prefill_replied: float  # prefill clock: HELLO frame sent
    decode_replied: float  # decode clock: HELLO frame received


@dataclass(frozen=True)
class Timeline:
    """Everything measured for one request (mode "overlap", "sequential" or "local").

    In local mode (including a fallback after a failed peer) prefill_start/prefill_end are
    decode-clock stamps of the local prefill; `layers` may then hold the pieces that arrived
    before the peer failed: they are drawn, but no handoff figure is computed from them.
    """

    mode: str
    prompt_tokens: int
    n_layers: int
    client_sent: float | None  # decode clock: request arrived at the decode node
    prefill_start: float  # prefill clock (decode clock in local mode)
    prefill_end: float  # prefill clock: last layer computed (decode clock in local mode)
    layers: tuple[LayerTiming, ...]
    clock: ClockSync | None  # None: local mode, or both nodes share one clock
    first_token: float  # decode clock
    token_times: tuple[float, ...]  # decode clock: each generated token, first included
    client_ttft_s: float | None = None
    fallback: str | None = None
    decision: dict | None = None
    # The decode side: backend, device, dtype, quantization (its to_dict, or None), steps,
    # host_checked / host_corrected (sampled picks redone by the host rule), stopped_by.
    decode: dict | None = None
    # Prefix reuse: decode_cached_tokens, prefill_cached_tokens, computed_tokens (or None).
    prefix: dict | None = None
    # The prefill node's engine as its HELLO says: backend ("torch", "vllm"), device, dtype,
    # quantization (vLLM's method: "fp8", "awq", ...; None: full precision). None: local.
    prefill: dict | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Timeline.mode must be one of {MODES}, got {self.mode!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [asdict(p) for p in self.layers]
        d["token_times"] = list(self.token_times)
        return {"schema": SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Timeline:
        check_schema(d, SCHEMA)
        try:
            kwargs = {k: v for k, v in d.items() if k != "schema"}
            clock = kwargs.get("clock")
            kwargs["clock"] = ClockSync(**clock) if clock is not None else None
            kwargs["layers"] = tuple(LayerTiming(**p) for p in kwargs["layers"])
            kwargs["token_times"] = tuple(kwargs["token_times"])
            return cls(**kwargs)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad {SCHEMA} timeline: {exc}") from exc


@dataclass(frozen=True)
class HandoffReport:
    """A Timeline plus its figures; every stamp here is on the decode clock (seconds)."""

    timeline: Timeline
    clock_offset_s: float  # prefill time p is decode time p - clock_offset_s
    clock_uncertainty_s: float | None  # ± half the round trip; None without a ClockSync
    t0: float  # time origin of the JSON and the renderings: client_sent, else prefill_start
    pieces: tuple[LayerTiming, ...]  # timeline.layers with all four stamps on the decode clock
    prefill_start: float
    prefill_end: float
    ttft_s: float | None
    ttft_source: str | None  # "client" | "decode node"
    itl_s: tuple[float, ...]
    itl_p50_s: float | None
    itl_p95_s: float | None
    itl_p99_s: float | None
    decode_tokens_per_s: float | None
    prefill_compute_s: float
    prefill_tokens_per_s: float | None
    kv_bytes: int
    wire_time_s: float | None  # sum over pieces of their wire_intervals
    transfer_span_s: float | None  # first piece on the wire -> last piece received
    achieved_gbps: float | None  # kv_bytes / transfer_span_s, decimal GB/s
    layer_wire_s: float | None  # median over layers of the layer's time on the wire
    exposed_handoff_s: float | None  # last piece injected - prefill_end
    handoff_target_s: float | None  # TARGET_FACTOR * layer_wire_s + TARGET_SLACK_S
    hidden_fraction: float | None  # share of the wire intervals before prefill_end
    prefill_to_injected_s: float | None  # prefill_start -> last piece injected

    @property
    def meets_handoff_target(self) -> bool | None:
        if self.exposed_handoff_s is None or self.handoff_target_s is None:
            return None
        return self.exposed_handoff_s <= self.handoff_target_s


@dataclass(frozen=True)
class ComparisonRow:
    name: str
    ttft_s: float | None
    exposed_handoff_s: float | None
    hidden_fraction: float | None
    prefill_compute_s: float
    prefill_to_injected_s: float | None
    speedup_vs_local: float | None  # ttft_local / ttft_s
    fallback: str | None


@dataclass(frozen=True)
class Comparison:
    """The same request run several ways (`--compare`): overlap, sequential, local."""

    reports: dict[str, HandoffReport]
    rows: tuple[ComparisonRow, ...]
    t_ideal_s: float | None  # pipelined lower bound of prefill_to_injected_s for "overlap"
    overlap_efficiency: float | None
    link_gbps: float | None = None  # the link rate T_ideal assumes (the sequential run's)


# ---- figures ----------------------------------------------------------------------------------


def check_schema(d: Mapping[str, Any], expected: str) -> None:
    if d.get("schema") != expected:
        raise ValueError(f"expected a {expected!r} document, got schema {d.get('schema')!r}")
