"""LayerKV: one piece of one layer's KV cache on the host, and how a dtype becomes bytes.

numpy only. numpy has no bfloat16, so bfloat16 travels as raw 16-bit words (uint16) and is
reinterpreted with `.view` on the other side: conversions are bit-exact by construction.
Layout of K and V: `[n_kv_heads, n_tokens, head_dim]`, row-major, keys already rotated (a
latent layer's V is narrower than its K: layers.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

DTYPES = ("float32", "float16", "bfloat16")
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds `name` bit for bit (bfloat16 -> uint16 words)."""
    try:
        return np.dtype(_STORAGE[name])
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(DTYPES)}") from None


def itemsize(name: str) -> int:
    return storage_dtype(name).itemsize


def window_floor(keep: Sequence[int | None], layer: int, prompt_len: int, start: int = 0) -> int:
    """The first prompt position a layer's KV is sent and kept from: `start`, or for a layer
    that keeps only its last `keep[layer]` positions (a sliding window), the later of the two."""
    k = keep[layer] if keep else None
    return start if k is None else max(start, prompt_len - k)


def chunk_sizes(n_tokens: int, chunk: int | None) -> tuple[int, ...]:
    """How a prompt is split for prefill: `chunk` positions at a time (the last one shorter),
    or all at once. A backend that splits otherwise says so with `prefill_chunks`."""
    step = chunk or n_tokens
    return tuple(min(step, n_tokens - s) for s in range(0, n_tokens, step))


def streamed_chunks(cached: int, compute: tuple[int, ...], start: int) -> tuple[int, ...]:
    """The plan's chunks when the prefill computes `compute` (sizes) from position `cached`
    and streams from `start`: the cached [start, cached) first if the receiver lacks it, then
    each computed chunk's part at or after `start`."""
    out = [cached - start] if start < cached else []
    at = cached
    for size in compute:
        if at + size > start:
            out.append(at + size - max(at, start))
        at += size
    return tuple(out)


def bf16_words_from_float32(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest even), returned as uint16 words."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(np.uint16)


def float32_from_bf16_words(words: np.ndarray) -> np.ndarray:
    return (np.asarray(words, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class LayerKV:
    """K and V of one layer for prompt positions [token_start, token_start + n_tokens).

    `computed_at`: the producer's `time.perf_counter()` when the piece was computed (on CUDA
    from events; None means "now", i.e. when the consumer sees it). `release`: call once when
    the piece's bytes are no longer needed (after they are on the wire); on CUDA it frees a
    pinned staging slot; None when the piece is a plain view with nothing to give back.
    """

    layer: int
    token_start: int
    k: np.ndarray  # [n_kv_heads, n_tokens, head_dim], storage dtype
    v: np.ndarray  # [n_kv_heads, n_tokens, v_dim], k's dtype (v_dim: head_dim but in MLA)
    dtype: str  # "float32" | "float16" | "bfloat16"
    computed_at: float | None = None
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.k.shape[:2] != self.v.shape[:2] or self.k.ndim != 3 or self.v.ndim != 3:
            raise ValueError(
                f"K {self.k.shape} and V {self.v.shape} must both be [heads, tokens, dim]"
            )
        if self.k.dtype != storage_dtype(self.dtype) or self.v.dtype != self.k.dtype:
            raise ValueError(f"K/V stored as {self.k.dtype}/{self.v.dtype}, expected {self.dtype}")

    @property
    def n_tokens(self) -> int:
        return self.k.shape[1]

    def since(self, position: int) -> LayerKV | None:
        """The piece from `position` on (views, the same `release`); None if it ends before."""
        cut = position - self.token_start
        if cut <= 0:
            return self
        if cut >= self.n_tokens:
            return None
        return dataclasses.replace(self, token_start=position, k=self.k[:, cut:], v=self.v[:, cut:])

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def buffers(self) -> tuple[memoryview, memoryview]:
        """Byte views of K and V (copies only if the arrays are not C-contiguous)."""
        k = np.ascontiguousarray(self.k)
        v = np.ascontiguousarray(self.v)
        return memoryview(k).cast("B"), memoryview(v).cast("B")

    @classmethod
    def from_bytes(
        cls,
        layer: int,
        token_start: int,
        n_tokens: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: str,
        k: bytes | bytearray | memoryview,
        v: bytes | bytearray | memoryview,
        v_dim: int | None = None,
    ) -> LayerKV:
        """Views over received bytes, no copy (V `v_dim` wide; None: `head_dim`)."""
        sd = storage_dtype(dtype)
        return cls(
            layer,
            token_start,
            np.frombuffer(k, dtype=sd).reshape(n_kv_heads, n_tokens, head_dim),
            np.frombuffer(v, dtype=sd).reshape(n_kv_heads, n_tokens, v_dim or head_dim),
            dtype,
        )

    def astype(self, dtype: str) -> LayerKV:
        """Convert to another wire dtype (float32 <-> float16 <-> bfloat16)."""
        if dtype == self.dtype:
            return self
        k, v = (_to_float32(x, self.dtype) for x in (self.k, self.v))
        return LayerKV(
            self.layer,
            self.token_start,
            _from_float32(k, dtype),
            _from_float32(v, dtype),
            dtype,
            self.computed_at,
            self.release,
        )


def _to_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    return float32_from_bf16_words(x) if dtype == "bfloat16" else x.astype(np.float32)


def _from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_words_from_float32(x) if dtype == "bfloat16" else x.astype(storage_dtype(dtype))
