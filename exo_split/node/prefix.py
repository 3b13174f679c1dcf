"""A node's prefix cache: the KV of finished requests, kept by token sequence, bounded in bytes,
least recently used first out.

Knows token ids, byte counts and opaque cache objects; the tensor work goes through four
backend methods (`trim`, `reserve`, `fork`, `cache_nbytes`), run on the compute thread.

Ownership, the one rule: an entry in the cache is idle, and a cache object has exactly one
owner at a time, the prefix cache or one request. A request that continues an entry (its
prompt covers all of the entry but a few positions, at most `take_slack` and a quarter: a
re-rendered end of the last assistant turn) *takes* it: out of the cache, trimmed to the
common prefix, extended in place, no copy. A request that shares only the start of a longer entry (another branch of
a conversation, a shared document) *copies* positions [0, m) into a cache of its own, and the
entry stays. The last prompt position is always computed: its logits pick the first token.

A model with recurrent layers (layers.py) cannot cut a state back to a shorter prefix: its
entry serves a prompt that continues all of it, or one that continues it up to one of its
*snapshots* (its recurrent layers' states at a turn boundary: the end of the prompt, kept by
the decode node while the reply is decoded), which then takes the entry, cut back to the
snapshot, the reply's part dropped (a state cannot be copied out at a shorter length). This
is what a chat's next turn needs when its template renders the last reply otherwise than
it was generated (a reasoning model's thinking dropped from the history).

The node's KV ledger (transport/limits.py) counts `nbytes` and calls `evict` before it
refuses a request, so a cached prefix never stands in the way of work that fits.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

TAKE_SLACK = 64  # positions an entry may lose to trimming and still be taken, not copied
MIN_REUSE = 8  # fewer shared positions (a BOS token, a common system line) are not worth it
DEFAULT_PREFIX_CACHE_BYTES = 2 * 2**30


class CacheOps(Protocol):
    """What the prefix cache needs of a backend (backends/base.py has the contract)."""

    def trim(self, cache: Any, n: int) -> None: ...
    def reserve(self, cache: Any, capacity: int) -> None: ...
    def fork(self, cache: Any, n: int, capacity: int) -> Any: ...
    def cache_nbytes(self, cache: Any) -> int: ...

    # Optional: reuse_floor(cache) -> int, the shortest prefix a cache can serve (a layer
    # that keeps only a window must still hold the window before the next position); and
    # for snapshots, restore(cache, states) (backends/base.py).


@dataclass(eq=False)
class _Entry:
    tokens: np.ndarray  # int32 [length]: the positions the KV covers
    cache: Any
    nbytes: int
    used: int  # LRU tick
    pins: int = 0  # copies in progress read it: not evictable meanwhile
    floor: int = 0  # it serves prefixes of at least this many positions (sliding windows)
    scope: str = ""  # the client it belongs to (transport/keys.py): it serves that one only
    # position -> the recurrent layers' states there (a backend's snapshot), below `floor`
    snapshots: dict[int, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Checkout:
    """A request's share of the prefix cache, decided under the lock (no tensor work yet).
    Settled exactly once, by `materialize` or `cancel`, whichever comes first."""

    how: str  # "take" | "copy" | "none"
    cached: int = 0  # positions [0, cached) of the prompt the request will not compute
    entry: _Entry | None = field(default=None, repr=False)
    settled: bool = False
    snapshot: Any = field(default=None, repr=False)  # the states to restore at `cached`


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    def __init__(self, ops: CacheOps, *, limit_bytes: int, take_slack: int = TAKE_SLACK):
        self.ops, self.limit, self.take_slack = ops, limit_bytes, take_slack
        self._entries: list[_Entry] = []
        self._tick = itertools.count()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.stats = {"lookups": 0, "hits": 0, "taken": 0, "copied": 0, "tokens_reused": 0,
                      "from_snapshots": 0, "evicted": 0, "evicted_bytes": 0}  # fmt: skip

    def __len__(self) -> int:
        return len(self._entries)

    def checkout(self, ids: Sequence[int], scope: str = "") -> Checkout:
        """The best reuse for a prompt among the entries of its client's `scope`: the entry
        with the longest common prefix (the most recent on a tie), taken, or pinned for a
        copy. Bookkeeping only: `materialize` it on the compute thread next, or `cancel` it."""
        want = np.asarray(ids, dtype=np.int32)
        with self._lock:
            self.stats["lookups"] += 1
            best, m = None, 0
            for e in self._entries:
                if e.scope != scope:
                    continue  # another client's: never seen, never timed (issue 18, M6)
                k = min(common_prefix(e.tokens, want), len(want) - 1)  # the last is computed
                if k < e.floor:  # it lacks the window before position k, or the state at k
                    k = max((p for p in e.snapshots if p <= k and not e.pins), default=-1)
                    if k < MIN_REUSE:
                        continue
                if k > m or (k == m and k and best is not None and e.used > best.used):
                    best, m = e, k
            if best is None or m < MIN_REUSE:
                return Checkout("none")
            self.stats["hits"] += 1
            self.stats["tokens_reused"] += m
            best.used = next(self._tick)
            if m < best.floor:  # from a snapshot: the entry is taken, cut back to it
                self._remove(best)
                self.stats["taken"] += 1
                self.stats["from_snapshots"] += 1
                return Checkout("take", m, best, snapshot=best.snapshots[m])
            # Taken only when the request continues the entry (it loses at most a little) and
            # no copy is reading it: a take hands the entry's cache away, and a pinned copy
            # in progress would then fork from nothing (issue 18, M1). Else it is copied.
            continues = len(best.tokens) - m <= min(self.take_slack, len(best.tokens) // 4)
            if continues and not best.pins:
                self._remove(best)
                self.stats["taken"] += 1
                return Checkout("take", m, best)
            best.pins += 1
            self.stats["copied"] += 1
            return Checkout("copy", m, best)

    def materialize(self, co: Checkout, *, capacity: int) -> Any | None:
        """On the compute thread: the request's own cache holding positions [0, co.cached)
        with room for `capacity` (None: nothing reused, or the checkout was cancelled)."""
        if co.entry is None or not self._settle(co):
            return None
        if co.how == "take":
            cache = co.entry.cache
            co.entry.cache = None
            if co.snapshot is not None:
                self.ops.restore(cache, co.snapshot)  # type: ignore[attr-defined]
            else:
                self.ops.trim(cache, co.cached)
            self.ops.reserve(cache, capacity)
            return cache
        try:
            return self.ops.fork(co.entry.cache, co.cached, capacity)
        finally:
            with self._lock:
                co.entry.pins -= 1

    def cancel(self, co: Checkout) -> None:
        """Undo a checkout that was not materialized (a taken entry comes back, a copied one
        is unpinned); nothing once it was. Safe to call on every path out of a request."""
        if co.entry is None or not self._settle(co):
            return
        if co.how == "take":
            e = co.entry
            self.put(e.tokens, e.cache, e.scope, e.snapshots.values())
        else:
            with self._lock:
                co.entry.pins -= 1

    def _settle(self, co: Checkout) -> bool:
        with self._lock:
            first, co.settled = not co.settled, True
            return first

    def put(self, tokens: Sequence[int], cache: Any, scope: str = "",
            snapshots: Iterable[Sequence[Any]] = ()) -> None:  # fmt: skip
        """Keep a finished request's cache (it covers exactly `tokens`); entries that are a
        prefix of it go (it holds all they do). Then evict down to the limit, LRU first.
        `snapshots`: for a model with recurrent layers, their states at earlier positions
        (each a backend's `snapshot`: a list of LayerState, all at one position)."""
        t = np.asarray(tokens, dtype=np.int32)
        floor = getattr(self.ops, "reuse_floor", lambda c: 0)(cache)
        # a snapshot at or past the floor adds nothing: any prefix from there on serves
        at = {s[0].token_start: s for s in snapshots if s}
        kept = {p: s for p, s in at.items() if MIN_REUSE <= p < floor}
        nbytes = self.ops.cache_nbytes(cache) + sum(st.nbytes for s in kept.values() for st in s)
        if not len(t) or nbytes > self.limit:
            return
        with self._lock:
            for e in list(self._entries):
                if (
                    not e.pins
                    and e.scope == scope
                    and len(e.tokens) <= len(t)
                    and common_prefix(e.tokens, t) == len(e.tokens)
                ):
                    self._remove(e)
            self._entries.append(_Entry(t, cache, nbytes, next(self._tick), floor=floor,
                                        scope=scope, snapshots=kept))  # fmt: skip
            self.nbytes += nbytes
            self._evict_locked(self.nbytes - self.limit)

    def evict(self, nbytes: int) -> int:
        """Free at least `nbytes` if idle, unpinned entries hold that much (least recently
        used first); returns the bytes freed."""
        with self._lock:
            return self._evict_locked(nbytes)

    def _evict_locked(self, nbytes: int) -> int:
        freed = 0
        for e in sorted(self._entries, key=lambda e: e.used):
            if freed >= nbytes:
                break
            if e.pins:
                continue
            self._remove(e)
            e.cache = None  # the memory goes with the last reference
            freed += e.nbytes
            self.stats["evicted"] += 1
            self.stats["evicted_bytes"] += e.nbytes
        return freed

    def _remove(self, e: _Entry) -> None:
        self._entries.remove(e)
        self.nbytes -= e.nbytes

    def describe(self) -> dict:
        """For /v1/info: entries (their lengths, most recent last), bytes, limit, counters."""
        with self._lock:
            lengths = [len(e.tokens) for e in sorted(self._entries, key=lambda e: e.used)]
            return {"entries": len(lengths), "bytes": self.nbytes, "limit": self.limit,
                    "tokens": lengths, **self.stats}  # fmt: skip


def prefix_report(decode_cached: int, prefill_cached: int, computed: int) -> dict[str, int]:
    """The report's `prefix` block (docs/metrics.md)."""
    return {
        "decode_cached_tokens": decode_cached,
        "prefill_cached_tokens": prefill_cached,
        "computed_tokens": computed,
    }
