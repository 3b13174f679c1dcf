"""Head ranges: a layer's KV heads in the ranges a tensor-parallel prefill holds them.

With tensor parallelism each worker of the prefill engine holds a range of every layer's KV
heads. Its frames carry that range (wire.HEADS), the plan announces the ranges, and the
decode node lands each range's heads where they belong in its cache: the layer is assembled
when the last range is in. Sans-IO: ints and byte views only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from exo_split.errors import ProtocolError

MAX_RANGE_HEADS = 255  # a range's heads, and its first head, fit a byte of the header
MAX_LAYERS = 0x10000  # ... whose layer index then fits 16 bits


def even_ranges(n_heads: int, parts: int) -> tuple[tuple[int, int], ...]:
    """`n_heads` KV heads cut into `parts` equal ranges, as a tensor-parallel engine shards
    them: (first head, heads) each. ValueError unless `parts` (>= 2) divides `n_heads`."""
    if parts < 2 or n_heads % parts or n_heads // parts > MAX_RANGE_HEADS:
        raise ValueError(f"{n_heads} KV heads cannot be cut into {parts} equal ranges")
    size = n_heads // parts
    return tuple((i * size, size) for i in range(parts))


def parse_ranges(heads: Any, n_heads: int, n_layers: int) -> tuple[tuple[int, int], ...]:
    """A HELLO plan's `heads`: [] (absent: whole layers), or [first, count] pairs covering
    the `n_heads` KV heads in order, two at least; ProtocolError otherwise."""
    if heads == []:
        return ()
    ok = isinstance(heads, list) and len(heads) >= 2 and n_layers <= MAX_LAYERS
    ok = ok and all(isinstance(h, list) and len(h) == 2 and all(_is_int(x) for x in h)
                    for h in heads)  # fmt: skip
    ok = ok and all(1 <= n <= MAX_RANGE_HEADS and 0 <= a <= MAX_RANGE_HEADS for a, n in heads)
    firsts = [sum(n for _, n in heads[:i]) for i in range(len(heads))] if ok else []
    ok = ok and [a for a, _ in heads] == firsts and sum(n for _, n in heads) == n_heads
    if not ok:
        raise ProtocolError(f"HELLO plan heads: expected absent, or >= 2 [first, count] ranges "
                            f"covering the {n_heads} KV heads in order, got {heads}")  # fmt: skip
    return tuple((a, n) for a, n in heads)


def range_bytes(heads: tuple[int, int], n_heads: int, k_len: int, v_len: int):
    """Byte ranges of one head range's part of a whole layer's payload (K of all heads, `k_len`
    bytes, then V, `v_len`): its K heads, then its V heads, each contiguous."""
    first, count = heads
    k, v = k_len // n_heads, v_len // n_heads
    return ((first * k, (first + count) * k), (k_len + first * v, k_len + (first + count) * v))


def sub_views(blocks: Sequence[memoryview], ranges) -> list[memoryview]:
    """Views of the byte `ranges` (in order) of the concatenation of `blocks`."""
    out: list[memoryview] = []
    for a, b in ranges:
        at = 0
        for block in blocks:
            lo, hi = max(a, at), min(b, at + len(block))
            if lo < hi:
                out.append(block[lo - at : hi - at])
            at += len(block)
            if at >= b:
                break
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
