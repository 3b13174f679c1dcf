"""The MLX side's per-layer caches: `StreamingKVCache` (mlx-lm's KVCache, showing each
layer's new K/V to a hook, and holding only a window from `base` on for a sliding layer) and
`StateCache`, a recurrent layer's: mlx-lm's ArraysCache ([conv, recurrent], what
its qwen3_next module reads and replaces each forward) that also knows its layer, the
positions it has consumed (`offset`, as a KVCache's) and how to take back one step.

Preallocated zero arrays are what mlx-lm starts from anyway (its module uses zeros when the
cache holds none), so a fresh cache and a preallocated one compute the same; preallocated,
a received state is written into them in place (node/receive.py), as KV is.

Prefix reuse cannot cut a state back to a shorter prefix: `trim` takes back only the last
step (the pipelined decode loop undoes a step it queued on a token the host then changed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from exo_split.layers import LINEAR, LayerState, StateArray, new_state, state_arrays

_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class StreamingKVCache(KVCache):
    """A KVCache that shows each layer's new K/V to a hook before writing them.

    `computed`: (end position, time) of each piece a prefill wrote, for `stream_kv`.
    `base`: the position slot 0 holds. A sliding layer received from a remote prefill keeps
    only its window: positions [base, offset) in slots [0, offset - base), `offset` staying
    the absolute position (the RoPE offset), and the mask saying which slots each query sees.
    """

    def __init__(self, layer: int, hook: Callable[[int, mx.array, mx.array], None], base: int = 0):
        super().__init__()
        self.layer = layer
        self.hook: Callable | None = hook
        self.computed: list[tuple[int, float]] = []
        self.base = self.offset = base

    def update_and_fetch(self, keys, values):
        if self.hook is not None:
            self.hook(self.layer, keys, values)
        if not self.base:
            return super().update_and_fetch(keys, values)
        self.offset -= self.base  # KVCache's own writing and growth, in slot space
        try:
            return super().update_and_fetch(keys, values)
        finally:
            self.offset += self.base

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if not self.base:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        q = mx.arange(self.offset, self.offset + N)[:, None]  # the queries' positions
        k = mx.arange(self.base, self.offset + N)[None]  # the slots' positions
        mask = k <= q
        return mask & (k > q - window_size) if window_size else mask

    def slots(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """K and V [1, heads, end - start, dim] of positions [start, end) (>= base)."""
        if start < self.base:
            raise ValueError(f"layer {self.layer} keeps positions from {self.base}, not {start}")
        a, b = start - self.base, end - self.base
        return self.keys[:, :, a:b], self.values[:, :, a:b]


def streaming(c: KVCache, layer: int, hook, state_hook=None) -> StreamingKVCache:
    """A cache layer that calls `hook`: the same arrays (no copy) in a StreamingKVCache (a
    recurrent layer's StateCache calls `state_hook`)."""
    if isinstance(c, StateCache):
        c.hook = state_hook
        return c
    if not isinstance(c, StreamingKVCache):
        s = StreamingKVCache(layer, hook)
        s.keys, s.values, s.offset = c.keys, c.values, c.offset
        return s
    c.hook = hook
    return c


class StateCache(ArraysCache):
    def __init__(self, layer: int, hook: Callable[[StateCache], None] | None = None):
        super().__init__(size=2)
        self.layer, self.hook = layer, hook
        self.offset = self.base = 0
        self.computed: list[tuple[int, float]] = []  # as StreamingKVCache's
        self._before: list | None = None  # the arrays before the step now running
        self._undo: tuple[list, int] | None = None  # (arrays, positions) before the last step

    def __setitem__(self, idx, value):
        if self._before is None:
            self._before = list(self.cache)
        self.cache[idx] = value

    def advance(self, n: int) -> None:
        """mlx-lm calls it at the end of the layer's forward, its state replaced."""
        super().advance(n)
        self.offset += n
        self._undo, self._before = (self._before or list(self.cache), n), None
        if self.hook is not None:
            self.hook(self)

    def trim(self, n: int) -> int:
        if n == 0:
            return 0
        if self._undo is None or self._undo[1] != n:
            raise ValueError(f"layer {self.layer} is recurrent: its state cannot be cut back "
                             f"{n} positions, only its last step taken back")  # fmt: skip
        self.cache, self._undo = self._undo[0], None
        self.offset -= n
        return n

    def preallocate(self, described: tuple[StateArray, ...], kv_dtype: str) -> None:
        self.cache = [mx.zeros((1, *a.shape), _MX_DTYPES[a.dtype(kv_dtype)]) for a in described]
        mx.eval(self.cache)

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def is_state(c) -> bool:
    return isinstance(c, StateCache)


def new_layer(spec, layer: int, kv_layer: Callable[[], object], kv_dtype: str,
              hook: Callable[[StateCache], None] | None = None):  # fmt: skip
    """Layer `layer`'s cache: a preallocated StateCache for a recurrent one, else `kv_layer()`."""
    if spec.layer_types and spec.layer_types[layer] == LINEAR:
        c = StateCache(layer, hook)
        c.preallocate(state_arrays(spec), kv_dtype)
        return c
    return kv_layer()


def evaluated(cache: list) -> list:
    """Every array the cache holds, for mx.eval."""
    return [c.arrays if is_state(c) else (c.keys, c.values) for c in cache]


def piece(c: StateCache, spec, kv_dtype: str, host_view, at: float | None) -> LayerState:
    """The layer's state as a piece: zero-copy views of its (evaluated) arrays."""
    mx.eval(c.arrays)
    st = new_state(c.layer, c.offset, state_arrays(spec), kv_dtype,
                   [host_view(a[0]) for a in c.arrays])  # fmt: skip
    return dataclasses.replace(st, computed_at=at)


def views(c: StateCache) -> tuple[np.ndarray, ...]:
    """Writable numpy views of the preallocated arrays (bfloat16 as uint16 words)."""
    out = []
    for a in c.arrays:
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
            mx.eval(a)
        out.append(np.array(a, copy=False)[0])
    return tuple(out)


def inject(c: StateCache, st: LayerState, kv_dtype: str) -> None:
    """A received state, copied in (the copy path)."""
    st = st.astype(kv_dtype)
    arrays = []
    for a, follows in zip(st.arrays, st.follows_kv, strict=True):
        x = mx.array(a)
        arrays.append((x.view(mx.bfloat16) if follows and kv_dtype == "bfloat16" else x)[None])
    c.cache, c.offset = arrays, st.token_start
    c._undo = c._before = None  # a step before this state cannot be taken back
    mx.eval(c.cache)
