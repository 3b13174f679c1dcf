"""The contract every backend implements. Backends know token ids and KV, never text.

A backend holds one loaded model. Per request it creates a cache object (its own type),
fills it by `prefill` or by `inject`, and advances it one token at a time with `step`.
Logits leave a backend as float32 numpy arrays, so sampling is the same rule everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from exo_split.kv import LayerKV
from exo_split.spec import ModelSpec

OnLayer = Callable[[LayerKV], None]


@dataclass
class Prefilled:
    cache: Any  # the backend's cache object, holding prompt KV
    logits: np.ndarray  # float32 [vocab] at the last prompt position
    # time.perf_counter() when the forward ended (device time on a GPU); prefill() itself
    # returns only once every piece was handed to on_layer, which can be later.
    computed_at: float | None = None


class Backend(Protocol):
    name: str  # "torch" | "mlx"
    device: str  # "cpu" | "cuda" | "metal" ...
    dtype: str  # "float32" | "float16" | "bfloat16"
    spec: ModelSpec

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        chunk: int | None = None,
        on_layer: OnLayer | None = None,
        should_stop: Callable[[], bool] | None = None,
        capacity: int | None = None,
    ) -> Prefilled:
        """Run the prompt; hand each (chunk, layer) KV piece to `on_layer` as soon as that
        layer has produced it (host memory, storage dtype of kv.py), chunk-major, then layer,
        then consecutive token ranges (a backend may split a chunk's layer into several).

        `on_layer` may be called from any thread (the compute thread, or a staging thread on
        CUDA) and must not block on the network; a piece with `release` holds a slot of the
        node's staging ring until release() is called (or the piece is dropped). Returns once
        every piece was handed on. `should_stop` is polled as each layer writes its KV: when it
        returns True the prefill raises `Cancelled` (the bound per backend: docs/reliability.md).
        """
        ...

    def stream_kv(
        self,
        cache: Any,
        on_layer: OnLayer,
        *,
        chunk: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """Hand an existing cache's KV (after a prefill) to `on_layer` the way `prefill` does:
        chunk-major in ranges of `chunk` positions (None: whole layers), then layer. For the
        sequential mode: staging memory stays bounded as during an overlapped prefill."""
        ...

    def new_cache(self, capacity: int) -> Any:
        """An empty cache with room for `capacity` positions."""
        ...

    def inject(self, cache: Any, kv: LayerKV) -> None:
        """Write one received piece into the cache (pieces of a layer arrive in order)."""
        ...

    def step(self, cache: Any, token_id: int) -> np.ndarray:
        """Feed one token at the next position; float32 logits [vocab] for the position after."""
        ...

    def export(self, cache: Any) -> list[LayerKV]:
        """The cache's KV, one LayerKV per layer."""
        ...

    def cache_len(self, cache: Any) -> int: ...


class Cancelled(Exception):
    """A prefill was stopped by its `should_stop` callback."""
