"""The decode batch's cache (backends/mlx_batch.py): its layout, and building the next one
ahead of a join.

The layout is mlx-lm's `BatchKVCache`, built here with room for every row's remaining steps
(so it never grows, and never copies itself, while it steps): each row's KV right-aligned at
the longest row's length, the left padding masked out (and zero: a masked position still
multiplies its value by a zero weight).

A join (or a compaction) builds a new batch cache and copies the rows' KV into it. Most of
that copy's time is the new buffers' first touch (zeroing fresh pages): 63-66 ms of one step
for a 4K-token joiner beside one row of the demo model on this CPU, a stall for every row.
So while a request the node expects (`Expected`) is still prefilling, the batch's next cache
is allocated ahead (`Staged`: zeros, a buffer or a few after each step, `STAGE_BYTES`), and
the join writes the rows into those very buffers (MLX updates an array in place when nothing
else holds it): a copy of the KV only, 5-10 ms there. A join that comes before the staging is
done uses what is staged and allocates the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

SLOT_STEP = KVCache.step  # the batch cache's positions, rounded up to this
# The next batch cache's allocation after a step, ahead of a join (at least one buffer: a
# layer's keys or values). Small: each byte's first touch is a step's delay for every row.
STAGE_BYTES = 4 << 20


@dataclass(eq=False)
class Expected:
    """A request that will join (Batcher.expect): its prompt's positions, its max_tokens."""

    positions: int
    max_tokens: int


@dataclass(eq=False)
class Staged:
    """The next batch cache's buffers for `rows` rows of `slots` positions, allocated ahead:
    zeros, each layer's keys then values (`arrays`); `bytes` taken from the ledger."""

    rows: int
    slots: int
    arrays: list = field(default_factory=list)
    bytes: int = 0

    def complete(self, n_layers: int) -> bool:
        return len(self.arrays) == 2 * n_layers

    def grow(self, cache: list, take: Callable[[int], bool]) -> int:
        """Allocate up to STAGE_BYTES more (at least one buffer), shaped as the batch `cache`
        (per layer: a KVCache or BatchKVCache) for these rows and slots, each buffer's bytes
        taken first (`take`; none more when it refuses). Returns the bytes added."""
        done = 0
        while not self.complete(len(cache)) and done < STAGE_BYTES:
            layer, which = divmod(len(self.arrays), 2)
            like = (cache[layer].keys, cache[layer].values)[which]  # (MLA: values narrower)
            _, heads, _, dim = like.shape
            buf = mx.zeros((self.rows, heads, self.slots, dim), like.dtype)
            if not take(buf.nbytes):
                break  # no room now: at a later step
            mx.eval(buf)
            self.arrays.append(buf)
            self.bytes += buf.nbytes
            done += buf.nbytes
        return done

    def take_layers(self, n_layers: int) -> list:
        """Per layer (keys, values), handed over: this holds none of them after (so MLX may
        write into them in place). Not staged yet: None (a join that comes before the
        staging is done allocates the rest itself)."""
        arrays, self.arrays = self.arrays, []
        arrays += [None] * (2 * n_layers - len(arrays))
        return [(arrays[i], arrays[i + 1]) for i in range(0, 2 * n_layers, 2)]


def slots_for(need: int) -> int:
    return -(-need // SLOT_STEP) * SLOT_STEP


def own_len(cache: list) -> int:
    return min(c.offset for c in cache)


def position_bytes(layer: KVCache, n_layers: int) -> int:
    k, v = layer.keys, layer.values
    return n_layers * k.shape[1] * (k.shape[3] + v.shape[3]) * k.dtype.size


def batch_layer(parts: list[tuple], longest: int, slots: int,
                into: tuple | None = None) -> BatchKVCache:  # fmt: skip
    """One layer's batch cache: each row's n positions right-aligned at `longest`, in
    `slots` positions (`into`: its (keys, values) zeros, staged, or None). `parts`: (a source layer,
    its row, n); a source is a row's own KVCache (row 0) or the previous batch's
    BatchKVCache."""
    first = parts[0][0]
    _, heads, _, dim = first.keys.shape
    shape = (len(parts), heads, slots, dim)
    keys, values = into or (None, None)
    if keys is None:
        keys = mx.zeros(shape, first.keys.dtype)
    if values is None:
        values = mx.zeros((*shape[:3], first.values.shape[3]), first.values.dtype)  # MLA
    pads = []
    for row, (src, i, n) in enumerate(parts):
        end = src._idx if isinstance(src, BatchKVCache) else src.offset
        a = longest - n
        keys[row : row + 1, :, a:longest] = src.keys[i : i + 1, :, end - n : end]
        values[row : row + 1, :, a:longest] = src.values[i : i + 1, :, end - n : end]
        pads.append(a)
    cache = BatchKVCache(pads)
    cache.keys, cache.values = keys, values
    cache.offset = cache.offset + longest
    cache._idx = longest
    return cache
