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
        layer has produced it (host memory, storage dtype of kv.py). `should_stop` is polled
        between layers: when it returns True the prefill raises `Cancelled`."""
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
