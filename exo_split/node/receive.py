"""Where received KV goes on the decode node: straight into the preallocated cache.

A backend that can hand out its cache's memory (`receive_views`: writable numpy views of
each layer's K and V, [n_kv_heads, capacity, head_dim]) gets every LAYER payload written in
place by the kernel (recv_into): no buffer per frame, no copy, no conversion, so the decode
node holds the cache and nothing else. The views' addresses are checked when the sink opens
(two independent conversions must alias the same memory) and again before decoding (the
cache must not have moved meanwhile); otherwise, or for a backend without views, each frame
arrives in a buffer of its own and is copied in with `backend.inject` (the copy path).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from exo_split.backends.base import Backend
from exo_split.errors import ProtocolError
from exo_split.kv import LayerKV
from exo_split.layers import LayerState, state_arrays
from exo_split.transport.decoder import Frame

log = logging.getLogger(__name__)
STAGED_FRAMES = 4  # copy path: frames received and not yet injected, at most (about)

Views = list[tuple[np.ndarray, np.ndarray]]


class CacheViews:
    """The decode cache as a transport Destination: a frame's payload is 2 x n_kv_heads
    blocks, each [n_tokens, head_dim] (V's: v_dim) of one head, contiguous in the cache."""

    def __init__(self, views: Views, bases: Sequence[int] | None = None):
        self.views = views
        self.bases = list(bases) if bases is not None else [0] * len(views)

    def blocks(self, layer: int, token_start: int, n_tokens: int) -> Sequence[memoryview]:
        """Where positions [token_start, +n_tokens) of `layer` land: slot = position - base
        (a layer that keeps a window holds it from its base on). n_tokens 0: a recurrent
        layer's state, its arrays whole."""
        if n_tokens == 0:
            return [memoryview(a).cast("B") for a in self.views[layer]]
        k, v = self.views[layer]
        a = token_start - self.bases[layer]
        if a < 0:
            raise ProtocolError(f"layer {layer} holds positions from {self.bases[layer]}, "
                                f"not {token_start}")  # fmt: skip
        return [memoryview(x[h, a : a + n_tokens]).cast("B") for x in (k, v)
                for h in range(x.shape[0])]  # fmt: skip


def _addresses(views: Views) -> list[tuple[int, ...]]:
    return [tuple(a.ctypes.data for a in layer) for layer in views]


def _usable(views: Views | None, again: Views | None) -> bool:
    if not views or again is None or _addresses(views) != _addresses(again):
        return False
    return all(a.flags.writeable and a.flags.c_contiguous for kv in views for a in kv)


class Sink:
    """Receives one stream's KV into `cache` (build it with `open_sink`, on the compute
    thread). `dest` is what the frame decoder writes into (None: the copy path)."""

    def __init__(self, backend: Backend, cache: Any, views: Views | None):
        self.backend, self.cache = backend, cache
        self._views = views
        self.direct = views is not None
        bases = getattr(backend, "receive_bases", None)
        self.dest = None
        if views is not None:
            self.dest = CacheViews(views, bases(cache) if bases is not None else None)

    def staging_bytes(self, max_frame_bytes: int) -> int:
        return 0 if self.direct else STAGED_FRAMES * max_frame_bytes

    async def landed(self, frame: Frame, run: Callable[..., Awaitable[Any]]) -> None:
        """A LAYER frame is complete and its CRC matched. Direct: it is already in place.
        Copy path: inject it (`run` runs a function on the compute thread)."""
        if self.direct or not frame.complete:  # (a head range: once its token range's last)
            return
        h, spec = frame.header, self.backend.spec
        try:
            if h.n_tokens == 0:  # a recurrent layer's state
                st = LayerState.from_bytes(h.layer, h.token_start, state_arrays(spec),
                                           self.backend.dtype, frame.payload)  # fmt: skip
                return await run(self.backend.inject, self.cache, st)
            kv = LayerKV.from_bytes(
                h.layer, h.token_start, h.n_tokens, spec.n_kv_heads, spec.head_dim,
                self.backend.dtype, frame.k, frame.v, spec.v_dim,
            )  # fmt: skip
            await run(self.backend.inject, self.cache, kv)
        except ValueError as exc:  # a piece that does not fit: the peer's fault
            raise ProtocolError(f"cannot inject {h.describe()}: {exc}") from exc

    def finish(self, n_tokens: int) -> Any:
        """Every layer holds the prompt's `n_tokens` positions: the cache, ready to decode.
        Run on the compute thread."""
        if self.direct:
            moved = _addresses(self._views or []) != _addresses(
                self.backend.receive_views(self.cache)  # type: ignore[attr-defined]
            )
            self.close()
            if moved:
                raise ProtocolError("the decode cache moved while KV was received into it")
            self.backend.receive_done(self.cache, n_tokens)  # type: ignore[attr-defined]
        cache, self.cache = self.cache, None
        return cache

    def close(self) -> None:
        """Drop the views: they keep the cache's arrays alive."""
        self._views = None
        if self.dest is not None:
            self.dest.views = []
            self.dest = None


def open_sink(backend: Backend, cache: Any) -> Sink:
    """The direct sink when the backend's views are usable, else the copy path."""
    get = getattr(backend, "receive_views", None)
    views = again = None
    if get is not None:
        views, again = get(cache), get(cache)
        if not _usable(views, again):
            log.warning("the %s cache cannot be received into in place; copying each frame",
                        backend.name)  # fmt: skip
            views = None
    return Sink(backend, cache, views)
