"""What the decode node records of a remote prefill as it happens, and the request's
`Timeline` (report/timeline.py) built from it once the request is done."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

from exo_split.report import ClockSync, LayerTiming, Timeline


class Piece(NamedTuple):
    """What the report needs of a received piece (its bytes are freed once injected)."""

    layer: int
    token_start: int
    n_tokens: int
    nbytes: int


@dataclass
class Remote:
    """What a remote prefill delivered (or how far it got)."""

    first_token: int | None = None
    first_token_at: float | None = None
    hello: dict | None = None
    hello_at: float | None = None
    sent_at: float = 0.0
    end: dict | None = None
    received: list[tuple[Piece, float]] = field(default_factory=list)
    injected: list[float] = field(default_factory=list)
    stamps: dict[str, list[float]] = field(default_factory=dict)  # END's, per piece


def build_timeline(
    n_layers: int, ids, remote: Remote | None, fallback, decision, arrived, local, times, req
) -> Timeline:
    """The request's raw Timeline: remote stamps when the handoff succeeded, else the local
    prefill's (with what arrived before a failure, drawn)."""
    common = dict(
        prompt_tokens=len(ids),
        n_layers=n_layers,
        client_sent=arrived,
        first_token=times[0],
        token_times=tuple(times),
        fallback=fallback,
        decision=decision,
    )
    if remote is None or fallback is not None:
        layers = ()
        if remote is not None:  # draw what arrived before the failure
            layers = tuple(
                LayerTiming(kv.layer, kv.token_start, kv.n_tokens, kv.nbytes, t, t, t, inj)
                for (kv, t), inj in zip(remote.received, remote.injected, strict=False)
            )
        return Timeline(
            mode="local", prefill_start=local[0], prefill_end=local[1], layers=layers,
            clock=None, **common,
        )  # fmt: skip
    end, hello, stamps = remote.end, remote.hello, remote.stamps
    layers = tuple(
        LayerTiming(
            kv.layer,
            kv.token_start,
            kv.n_tokens,
            kv.nbytes,
            compute_done,
            sent,
            received,
            injected,
            send_start=send_start,
        )  # fmt: skip
        for (kv, received), injected, compute_done, send_start, sent in zip(
            remote.received,
            remote.injected,
            stamps["compute_done"],
            stamps["send_start"],
            stamps["sent"],
            strict=True,
        )  # fmt: skip
    )
    sync = ClockSync(
        decode_sent=remote.sent_at,
        prefill_received=hello["prefill_received"],
        prefill_replied=hello["prefill_replied"],
        decode_replied=remote.hello_at,
    )
    return Timeline(
        mode="overlap" if req.overlap else "sequential",
        prefill_start=end["prefill_start"], prefill_end=end["prefill_end"],
        layers=layers, clock=sync, **common,
    )  # fmt: skip


def decode_info(backend, stats, stopped_by: str) -> dict:
    """The report's account of the decode side: what ran, how the picks went (a DecodeStats),
    why it ended."""
    quant = getattr(backend, "quantization", None)
    return {
        "backend": backend.name,
        "device": backend.device,
        "dtype": backend.dtype,
        "quantization": quant.to_dict() if quant is not None else None,
        "steps": stats.steps,
        "host_checked": stats.checked,
        "host_corrected": stats.corrected,
        "stopped_by": stopped_by,
        # How many sequences shared its steps (None: decoded alone, by a loop that does not
        # batch: torch, or a model with sliding layers).
        "batch": _spread(stats.sizes),
        "queue_wait_s": stats.queue_wait_s,  # batched: its KV ready -> its first step queued
    }


def _spread(sizes: list[int]) -> dict | None:
    if not sizes:
        return None
    return {"min": min(sizes), "median": statistics.median(sizes), "max": max(sizes)}
