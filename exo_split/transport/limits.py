"""Admission limits of a node: how many requests, how many prompt tokens, how many KV bytes.

No framework imports: a refusal is a `Refused` error carrying the HTTP status, which the
server turns into 413 (can never fit) or 503 + Retry-After (busy now), always before the 200.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from exo_split.errors import ExoSplitError
from exo_split.kv import itemsize, window_floor
from exo_split.layers import state_bytes
from exo_split.spec import ModelSpec
from exo_split.transport.messages import PrefillRequest
from exo_split.transport.wire import DEFAULT_MAX_FRAME_BYTES

DEFAULT_INFLIGHT_BYTES = 64 << 20


class Refused(ExoSplitError):
    """A request the node will not take now (503) or ever (413)."""

    def __init__(self, status: int, code: str, message: str, retry_after: int = 1):
        super().__init__(message)
        self.status, self.code, self.retry_after = status, code, retry_after


@dataclass(frozen=True)
class Limits:
    """Per-node limits; each has a safe default (docs/reliability.md)."""

    max_prompt_tokens: int = 32_768
    # requests of each kind in progress (running or queued): a guard on the queue's length;
    # memory is bounded by max_kv_bytes (mlx_lm.server batches 32 sequences)
    max_concurrent: int = 32
    max_kv_bytes: int = 8 * 2**30  # KV held for requests in progress, both kinds together
    retry_after_s: int = 1
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # the largest LAYER frame sent or accepted
    max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES  # KV handed to the sender, not yet sent


class Evictable(Protocol):
    """KV kept for reuse (node/prefix.py's PrefixCache): counted, and given up on demand."""

    nbytes: int

    def evict(self, nbytes: int) -> int: ...


class KVLedger:
    """The KV bytes this node holds for requests in progress, plus its prefix caches.

    Each request reserves what it will hold before its 200 (the prefill's cache and pieces in
    flight; the decode cache at full capacity) and releases it when its handler ends, after
    the compute thread has let go. /v1/info shows `kv_bytes_held`; it returns to 0 when idle.
    The prefix caches (`caches`) count against the same limit but never refuse work: what a
    request needs is evicted from them, least recently used first, before it is admitted.
    """

    def __init__(self, limit: int, retry_after_s: int = 1):
        self.limit, self.retry_after_s = limit, retry_after_s
        self.held = self.peak = 0
        self.caches: list[Evictable] = []
        self._lock = threading.Lock()  # `take`/`give` come from the compute thread

    def take(self, nbytes: int) -> bool:
        """Reserve `nbytes` if they fit beside what requests hold, evicting prefix caches
        to make room; False, and nothing held, if not (`hold` makes that a 503). Thread-safe:
        the decode batch takes its padding and the copy a join makes from the compute
        thread (backends/mlx_batch.py)."""
        with self._lock:
            if self.held + nbytes > self.limit:
                return False
            self._evict(nbytes)
            self.held += nbytes
            self.peak = max(self.peak, self.held + self.cached)
            return True

    def force(self, nbytes: int) -> None:
        """Hold `nbytes` that exist already, even past the limit: bytes a request's
        reservation held, moving to the decode batch just before the request gives them back."""
        with self._lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held + self.cached)

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes

    def _evict(self, nbytes: int) -> None:
        over = self.held + self.cached + nbytes - self.limit
        for c in self.caches:
            if over <= 0:
                break
            over -= c.evict(over)

    @property
    def cached(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @contextlib.contextmanager
    def hold(self, nbytes: int, what: str) -> Iterator[None]:
        if nbytes > self.limit:
            raise Refused(
                413,
                "too_much_kv",
                f"{what} needs {_mib(nbytes)} of KV, more than this node's limit of "
                f"{_mib(self.limit)} (--max-kv-bytes)",
            )
        if not self.take(nbytes):
            raise Refused(
                503,
                "busy",
                f"{what} needs {_mib(nbytes)} of KV; {_mib(self.held)} of this node's "
                f"{_mib(self.limit)} are held by requests in progress",
                retry_after=self.retry_after_s,
            )
        try:
            yield
        finally:
            self.give(nbytes)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def kv_bytes(spec: ModelSpec, tokens: int, dtype: str, layers: int | None = None) -> int:
    """K and V bytes of `tokens` positions in `layers` layers (default: all)."""
    n_layers = spec.n_layers if layers is None else layers
    return n_layers * spec.layer_bytes_per_token(itemsize(dtype)) * tokens


def prefill_kv_bytes(
    spec: ModelSpec, backend_dtype: str, req: PrefillRequest, *, inflight: int, streams_kv: bool
) -> int:
    """What a prefill holds at most: its own cache of the whole prompt. The pieces it streams
    are views of that cache (or slots of the node's fixed staging ring, not per request),
    except when they are converted to another wire dtype: those copies wait for the wire up to
    `inflight` bytes, plus the one piece that may exceed it. Without overlap, a backend that
    cannot stream its finished cache (`streams_kv`) exports it whole first."""
    n, wire_dtype = len(req.token_ids), req.dtype or backend_dtype
    cache, all_kv = kv_bytes(spec, n, backend_dtype), kv_bytes(spec, n, wire_dtype)
    if not req.overlap and not streams_kv:
        return cache + all_kv
    if wire_dtype == backend_dtype:
        return cache
    piece = kv_bytes(spec, min(req.chunk or n, n) if req.overlap else n, wire_dtype, layers=1)
    return cache + min(all_kv, inflight + piece)


def decode_kv_bytes(
    spec: ModelSpec, dtype: str, prompt_len: int, max_tokens: int, *, staging: int = 0,
    keep: Sequence[int | None] = (),
) -> int:  # fmt: skip
    """What a generate holds at most: the cache at full capacity (received KV lands in it),
    plus `staging`: received frames waiting to be copied in, for a backend that cannot hand
    out its cache's memory (0 when frames land in the cache itself). `keep`: per layer, the
    prompt's last positions a received cache keeps (the backend's window_keep; empty: all),
    so a sliding layer holds its window and the reply, not the whole prompt. A recurrent
    layer holds its state, of one size at every length (layers.py)."""
    capacity = prompt_len + max_tokens
    states = state_bytes(spec, dtype)
    positions = sum(capacity - window_floor(keep, layer, prompt_len)
                    for layer in range(spec.n_layers) if not (states and states[layer]))  # fmt: skip
    return kv_bytes(spec, positions, dtype, layers=1) + sum(states) + staging


class Guard:
    """Bounds the connections that have not said who they are (no complete HTTP request, no
    valid ticket yet): each is closed `deadline` seconds after it arrived, and at most
    `per_address` of one address and `total` of all wait at once; past those the oldest
    waiting one is closed, so a new client always gets its chance. Without it one byte per
    connection held a descriptor for an hour (issue 18, H2)."""

    def __init__(self, deadline: float, *, per_address: int = 32, total: int = 128):
        self.deadline, self.per_address, self.total = deadline, per_address, total
        # Keyed by the connection's socket: HTTP over TLS identifies itself on the TLS
        # transport, which shares the socket of the TCP transport that arrived.
        self._waiting: collections.OrderedDict[Any, tuple[str, asyncio.TimerHandle, Any]] = (
            collections.OrderedDict()
        )
        self.closed = 0  # connections it closed (deadline or cap), for /v1/info and tests
        # Data connections' TLS handshakes (each on a thread, over a duplicate descriptor;
        # the Sniffer starts one only for an address that holds an unredeemed ticket)
        self._handshaking: collections.OrderedDict[Any, tuple[str, socket.socket]] = (
            collections.OrderedDict()
        )

    def arrived(self, transport) -> None:
        addr = _address(transport)
        same = [k for k, (a, _, _) in self._waiting.items() if a == addr]
        if len(same) >= self.per_address:
            self._close(same[0])
        if len(self._waiting) >= self.total:
            self._close(next(iter(self._waiting)))
        key = _key(transport)
        timer = asyncio.get_running_loop().call_later(self.deadline, self._close, key)
        self._waiting[key] = (addr, timer, transport)

    def handshake_started(self, transport, sock: socket.socket) -> None:
        """`sock` (a duplicate of the connection's descriptor) runs a TLS handshake on a
        thread; when the guard closes the connection it cuts the handshake too (a shutdown
        wakes the thread)."""
        self._handshaking[_key(transport)] = (_address(transport), sock)

    def handshake_done(self, transport) -> None:
        self._handshaking.pop(_key(transport), None)

    def handshakes(self, address: str | None = None) -> int:
        """TLS handshakes running (of `address`; of all)."""
        return sum(address in (None, a) for a, _ in self._handshaking.values())

    def identified(self, transport) -> None:
        entry = self._waiting.pop(_key(transport), None)
        if entry is not None:
            entry[1].cancel()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _close(self, key) -> None:
        handshake = self._handshaking.pop(key, None)
        if handshake is not None:
            with contextlib.suppress(OSError):
                handshake[1].shutdown(socket.SHUT_RDWR)
        entry = self._waiting.pop(key, None)
        if entry is None:
            return
        _, timer, transport = entry
        timer.cancel()
        if not transport.is_closing():
            self.closed += 1
            transport.abort()


def _address(transport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


def _key(transport) -> Any:
    sock = transport.get_extra_info("socket")
    return sock if sock is not None else transport
