"""In-process split: prefill on backend A, hand the KV and the first token to backend B,
decode on B. No network.

How a request is split between the phases (one rule, here): the prefill side runs every
prompt token and samples generation step 0 from the last position's logits; the decode
side feeds that token in as its first step and samples steps 1, 2, ... (`Backend.decode`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exo_split.backends.base import Backend
from exo_split.kv import window_floor
from exo_split.sampling import GREEDY, Sampling, sample
from exo_split.spec import check_request, require_compatible


def prefill_into(
    prefill: Backend,
    decode: Backend,
    token_ids: Sequence[int],
    *,
    capacity: int,
    chunk: int | None = None,
) -> tuple[Any, np.ndarray]:
    """Prefill on `prefill` and fill `decode`'s cache layer by layer as each is produced.

    Returns (decode's cache, last-position logits). The same backend object keeps its own
    prefill cache (no copy).
    """
    if prefill is decode:
        done = prefill.prefill(token_ids, chunk=chunk, capacity=capacity)
        return done.cache, done.logits
    n, keep = len(token_ids), getattr(decode, "window_keep", ())
    cache = decode.new_cache(capacity, prompt_len=n) if keep else decode.new_cache(capacity)

    def on_layer(kv):
        inside = kv.since(window_floor(keep, kv.layer, n))  # a sliding layer: its window only
        if inside is not None:
            decode.inject(cache, inside.astype(decode.dtype))
        if kv.release is not None:  # the bytes are in the decode cache: the staging slot is free
            kv.release()

    done = prefill.prefill(token_ids, chunk=chunk, on_layer=on_layer)
    return cache, done.logits


@dataclass
class SplitResult:
    tokens: list[int]
    prompt_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)


def split_generate(
    prefill: Backend,
    decode: Backend,
    token_ids: Sequence[int],
    *,
    max_tokens: int,
    sampling: Sampling = GREEDY,
    chunk: int | None = None,
    stop_ids: frozenset[int] = frozenset(),
    on_token: Callable[[int], None] | None = None,
) -> SplitResult:
    """Prefill on `prefill`, inject each layer into `decode`'s cache as it lands, decode there."""
    require_compatible(prefill.spec, decode.spec, what="the decode backend")
    check_request(prefill.spec, len(token_ids), max_tokens)
    t0 = time.perf_counter()
    cache, logits = prefill_into(
        prefill, decode, token_ids, capacity=len(token_ids) + max_tokens, chunk=chunk
    )
    t_prefill = time.perf_counter()
    first, _ = sample(logits, sampling, 0)
    tokens = [first]
    times = [time.perf_counter()]
    if on_token:
        on_token(first)
    for token in decode.decode(
        cache, first, max_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids
    ):
        tokens.append(token)
        times.append(time.perf_counter())
        if on_token:
            on_token(token)
    t_end = time.perf_counter()
    n_decode = len(tokens) - 1
    timings = {
        "prefill_s": t_prefill - t0,
        "ttft_s": times[0] - t0,
        "decode_s": t_end - times[0],
        "total_s": t_end - t0,
        "prefill_tokens_per_s": len(token_ids) / max(t_prefill - t0, 1e-9),
        "decode_tokens_per_s": n_decode / (t_end - times[0]) if n_decode else 0.0,
    }
    return SplitResult(tokens, len(token_ids), timings, [t - t0 for t in times])
