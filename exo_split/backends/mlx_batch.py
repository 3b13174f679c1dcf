"""Continuous batching on MLX: every sequence decoding on the node steps in one graph.

A `Batcher` holds the node's decoding sequences (`Row`s). Each step is one forward of the
model over all of them ([B, 1] tokens on one batch cache), then each row's pick on its row
of the logits (mlx_decode.Picker: its sampling rule, mask, adjustments, log-probabilities),
all queued before the previous step's tokens are read back in one transfer of 8 bytes per
row: the pipelined loop of mlx_decode.decode_steps, for B rows. A row joins at the next step
once its KV is in, and leaves when it ends, is cancelled, or its client goes.

The batch cache is mlx-lm's `BatchKVCache` layout (backends/mlx_batch_cache.py). One row
alone runs on its own cache, exactly as the solo loop does (the float32 fidelity checks hold
there).

Memory, counted in the node's KV ledger (transport/limits.py) beside the requests' own
reservations: the batch cache's padding beyond them (`extra`), and, while a join copies the
batch into a new one, both copies. A join that does not fit waits for a later step.

While a request the node `expect`s is still prefilling (remote or local), the next batch
cache (the live rows, the joining and the expected ones, with room for their steps) is
allocated ahead, a little after each step, counted in the ledger like the batch's padding;
the join then writes the rows into those buffers: a copy of the KV, not a fresh cache's
first touch (mlx_batch_cache.Staged). Staged buffers that no longer fit (a row left, another
is expected, the rows grew past them) go back, and are staged again. A row
that leaves hands its KV back at once (a copy of its own positions, when it asked for them:
the prefix cache), and its slot goes dead (fed a dummy token, its logits unread): its bytes
move from the request's reservation to the batch's `extra`, and at the next step the batch
is compacted without it (one copy, as a join makes) if the ledger has room for the copy,
else at a later step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from exo_split.backends.base import Constraint, DecodeStats, take
from exo_split.backends.mlx_batch_cache import (
    SLOT_STEP,
    Expected,
    Staged,
    batch_layer,
    own_len,
    position_bytes,
    slots_for,
)
from exo_split.backends.mlx_decode import (
    CLEAR_EVERY,
    Picker,
    _settle,
    _Step,
    decode_stream,
    vocab_size,
)
from exo_split.sampling import Adjust, Sampling

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Row:
    """One sequence. `cache`: its KV (prompt, plus the positions before `first_token` when
    `start` is 0); `on_token` gets each token as it is final, on the compute thread;
    `on_done(cache, error)` once the row has left (`cache`: its KV, when `keep_cache`)."""

    cache: list | None
    first_token: int
    start: int
    max_tokens: int
    picker: Picker
    stop_ids: frozenset[int]
    should_stop: Callable[[], bool] | None = None
    on_token: Callable[[int], None] | None = None
    on_done: Callable[[list | None, BaseException | None], None] | None = None
    reserved: int = 0  # the KV bytes its request holds in the ledger
    keep_cache: bool = False
    ticket: Expected | None = None  # its `expect`, consumed as it enters the batch
    # The loop's state: the step in flight (queued, not read), the one queued after it,
    # the token that step is fed; `ended` once no more tokens will be read.
    st: _Step | None = None
    next: _Step | None = None
    feed: mx.array | None = None
    ended: bool = False
    joined_at: float = 0.0  # when `join` was called (perf_counter)


class Batcher:
    """The batch of one node's model (see the module docstring). `join` from any thread;
    `run` on the compute thread only."""

    def __init__(self, model, new_layer: Callable[[int], KVCache]):
        self.model = model
        self.new_layer = new_layer  # layer i of the backend's own cache type (a row's KV out)
        self.take: Callable[[int], bool] = lambda n: True  # the ledger's, once it has one
        self.give: Callable[[int], None] = lambda n: None
        self.force: Callable[[int], None] = lambda n: None  # held now, given back just after
        self._lock = threading.Lock()
        self._joining: list[Row] = []
        self._expected: list[Expected] = []
        self._staged: Staged | None = None  # the next batch cache, allocated ahead
        self.rows: list[Row] = []  # the batch cache's rows, in order (dead ones included)
        self.cache: list | None = None  # per layer: a lone row's own KVCache or a BatchKVCache
        self.pads: list[int] = []  # each row's left padding
        self.extra = 0  # ledger bytes the batch holds beyond its live rows' reservations
        self.steps = 0
        self.peak = 0

    # ---- from any thread ----

    def row(self, cache: list, first_token: int, *, start: int, max_tokens: int,
            sampling: Sampling, stop_ids: frozenset[int], stats: DecodeStats,
            constraint: Constraint | None = None, adjust: Adjust | None = None,
            logprobs: list | None = None, top_logprobs: int = 0, **kw) -> Row:  # fmt: skip
        """A row for `join`, with decode_steps's arguments (`kw`: Row's reserved, keep_cache,
        should_stop); the caller sets on_token and on_done."""
        picker = Picker(vocab_size(self.model), sampling, constraint=constraint,
                        adjust=adjust, logprobs=logprobs, top_logprobs=top_logprobs,
                        stats=stats)  # fmt: skip
        return Row(cache, first_token, start, max_tokens, picker, stop_ids, **kw)

    def join(self, row: Row) -> None:
        row.joined_at = time.perf_counter()
        with self._lock:
            self._joining.append(row)

    def expect(self, positions: int, max_tokens: int) -> Expected:
        """A request that will join once prefilled: its batch cache is staged meanwhile.
        Its row carries the ticket (Row.ticket); `unexpect` it when the request ends."""
        e = Expected(positions, max_tokens)
        with self._lock:
            self._expected.append(e)
        return e

    def unexpect(self, e: Expected) -> None:
        with self._lock:
            if e in self._expected:
                self._expected.remove(e)

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self.rows or self._joining)

    def describe(self) -> dict:
        live = [r for r in self.rows if not r.ended]
        with self._lock:
            waiting, expected = len(self._joining), len(self._expected)
        staged = len(self._staged.arrays) // 2 if self._staged else 0  # (whole layers)
        return {"rows": len(live), "dead_rows": len(self.rows) - len(live), "joining": waiting,
                "expected": expected, "staged_layers": staged, "steps": self.steps,
                "peak_rows": self.peak, "extra_kv_bytes": self.extra}  # fmt: skip

    # ---- on the compute thread ----

    def run(self, should_yield: Callable[[], bool]) -> None:
        """Step until no row is left, or until `should_yield()` after a step (other jobs wait
        for the thread; the step queued meanwhile stays in flight). An error in a step ends
        every row with it."""
        try:
            while self.busy:
                with mx.stream(decode_stream()):
                    self._step()
                if should_yield():
                    return
        except Exception as exc:  # each row's consumer gets it; the node goes on
            log.exception("a batched decode step failed")
            self.fail(exc)

    def _step(self) -> None:
        stopping = [r for r in self.rows if not r.ended and r.st is not None and r.should_stop()]
        for r in stopping:
            r.ended = True
        if stopping:
            self._leave(stopping)
        self._admit()
        live = [r for r in self.rows if not r.ended]
        if not live:
            self._drop_all()
            return
        feeds = self._build_inputs()
        if any(f is not None for f in feeds):
            self._queue(feeds)
        reading = [r for r in live if r.st is not None]
        if reading:
            self._read(reading)
        for r in self.rows:
            r.st, r.next = r.next, None
            if r.st is not None and r.st.out is None:
                r.picker.pick(r.st)  # its mask needed the token just taken
        self.steps += 1
        if self.steps % CLEAR_EVERY == 0:
            mx.clear_cache()
        self._stage()

    def _build_inputs(self) -> list[mx.array]:
        """Each row's next token: the step in flight's pick (lazy), a joiner's first token;
        None for a dead row and a row whose last step is in flight."""
        feeds = []
        for r in self.rows:
            if r.ended:
                feeds.append(None)
            elif r.st is None:
                feeds.append(r.feed)
            elif r.st.step + 1 < r.max_tokens:
                feeds.append(r.st.out[:, 0])
            else:
                feeds.append(None)
        return feeds

    def _queue(self, feeds: list[mx.array | None]) -> None:
        """Queue one forward of every row (a row without a feed rides along on a dummy, its
        logits unread) and each fed live row's pick."""
        tokens = mx.concatenate([f if f is not None else mx.zeros((1,), mx.int32) for f in feeds])
        logits = self.model(tokens[:, None], cache=self.cache)[:, -1, :]
        for i, (r, f) in enumerate(zip(self.rows, feeds, strict=True)):
            if r.ended or f is None:
                continue
            step = r.start if r.st is None else r.st.step + 1
            r.next = r.picker.start(step, logits[i : i + 1])
            r.feed = f
            if r.picker.stats.queue_wait_s is None:
                r.picker.stats.queue_wait_s = time.perf_counter() - r.joined_at

    def _read(self, rows: list[Row]) -> None:
        """Read the steps in flight (one transfer), redo the host's picks, hand the tokens on."""
        out = mx.concatenate([r.st.out for r in rows]).tolist()
        tokens, redo = [], False
        for r, (graph_token, flagged) in zip(rows, out, strict=True):
            token = r.picker.settle(r.st, graph_token, flagged)
            if token != graph_token and r.next is not None:
                r.feed, redo = mx.array([token], mx.int32), True
            tokens.append(token)
        if redo:  # a queued step ran on a graph token the host overruled: undo, queue again
            for r in self.rows:
                if r.next is not None:
                    _settle(r.next)
            for c in self.cache:
                c.trim(1)
            self._queue([r.feed if r.next is not None else None for r in self.rows])
        size = sum(1 for r in self.rows if not r.ended)
        self.peak = max(self.peak, size)
        for r, token in zip(rows, tokens, strict=True):
            r.picker.accept(r.st, token)
            r.picker.stats.sizes.append(size)
            r.on_token(token)
            if r.next is None or token in r.stop_ids or r.picker.finished:
                r.ended = True
        if any(r.ended for r in rows):
            self._leave([r for r in rows if r.ended])

    def _admit(self) -> None:
        if self.rows and all(r.ended for r in self.rows):
            self._drop_all()
        with self._lock:
            joining, self._joining = self._joining, []
        ready = []
        for r in joining:
            if r.feed is None and r.start > 0:  # (a joiner that waited for room took it)
                take(r.first_token, r.picker.constraint, r.picker.adjust)
            if (r.max_tokens <= r.start or (r.start > 0 and r.first_token in r.stop_ids)
                    or r.should_stop()):  # fmt: skip
                r.ended = True
                self._entered([r])
                self._done(r, r.cache if r.keep_cache else None)
                continue
            r.feed = mx.array([r.first_token], mx.int32)
            ready.append(r)
        dead = any(r.ended for r in self.rows)
        if not ready and not dead:
            return
        if not ready:  # rows left: compact the batch (their memory back) if the copy fits
            self._compose([])
            return
        if not self.rows and len(ready) == 1:  # alone: on its own cache, as the solo loop
            self.rows, self.cache, self.pads = ready, ready[0].cache, [0]
            ready[0].cache = None
            self._entered(ready)
            return
        if self._compose(ready):
            return
        if not self.rows:  # no room for a batch of them: the first alone, on its own cache
            self.rows, self.cache, self.pads = ready[:1], ready[0].cache, [0]
            ready[0].cache, ready = None, ready[1:]
            self._entered(self.rows)
        with self._lock:  # no room to copy the batch now: at a later step
            self._joining[:0] = ready

    # ---- the batch cache ----

    def _lengths(self) -> list[int]:
        idx = self._idx()
        return [idx - p for p in self.pads]

    def _idx(self) -> int:
        c = self.cache[0]
        return c._idx if isinstance(c, BatchKVCache) else c.offset

    def _compose(self, joiners: list[Row]) -> bool:
        """A new batch cache of the live rows and `joiners` (dead slots dropped), if the
        ledger has room for the copy; False (nothing changed) if not."""
        live = [r for r in self.rows if not r.ended]
        if not live and not joiners:
            return True
        old_lengths = self._lengths() if self.rows else []
        lengths = [old_lengths[i] for i, r in enumerate(self.rows) if not r.ended]
        lengths += [own_len(r.cache) for r in joiners]
        rows = live + joiners
        longest = max(lengths)
        # Room for every row's remaining steps, plus the one computed past the last.
        need = max(longest + r.max_tokens - _next_step(r) + 1 for r in rows)
        slots, staged = slots_for(need), self._staged
        if staged is not None and not (staged.rows == len(rows) and staged.slots >= need):
            self._unstage()  # (no help to this batch; one that is only begun still is)
            staged = None
        if staged is not None:  # its bytes are in self.extra already
            slots = staged.slots
        per = position_bytes(self.cache[0] if self.cache else joiners[0].cache[0],
                              len(self.cache or joiners[0].cache))  # fmt: skip
        old_bytes = len(self.rows) * self._slots() * per if self.rows else 0
        new_bytes = len(rows) * slots * per
        reserved = sum(r.reserved for r in rows)
        steady = max(0, new_bytes - reserved)
        # While the copy is made: the old batch, the new one, and the joiners' own caches.
        transient = max(steady, old_bytes + new_bytes + self._own_bytes(joiners, per) - reserved)
        if transient > self.extra and not self.take(transient - self.extra):
            return False
        self.extra = max(self.extra, transient)
        sources = [(self.cache, i, old_lengths[i]) for i, r in enumerate(self.rows)
                   if not r.ended]  # fmt: skip
        sources += [(r.cache, 0, n) for r, n in zip(joiners, lengths[len(live) :], strict=True)]
        n_layers = len(sources[0][0])
        bufs, self._staged = (staged.take_layers(n_layers) if staged else None), None
        new = []
        for layer in range(n_layers):
            into = None
            if bufs is not None:  # (only the graph holds them then: MLX writes in place)
                into, bufs[layer] = bufs[layer], None
            new.append(batch_layer([(src[layer], i, n) for src, i, n in sources], longest,
                                   slots, into))  # fmt: skip
            del into
        mx.eval([(c.keys, c.values) for c in new])
        for r in joiners:
            r.cache = None  # its own copy goes
        self._entered(joiners)
        self.rows, self.cache = rows, new
        self.pads = [longest - n for n in lengths]
        self.give(self.extra - steady)
        self.extra = steady
        return True

    def _entered(self, rows: list[Row]) -> None:
        """These rows are in the batch (or ended before it): their tickets are used."""
        with self._lock:
            for r in rows:
                if r.ticket in self._expected:
                    self._expected.remove(r.ticket)

    def _stage(self) -> None:
        """After a step: while a request is expected, allocate the batch cache its join
        will need (live rows, joiners and expected ones; room for their steps, plus a
        SLOT_STEP for the rows' growth meanwhile), up to STAGE_BYTES more of it (at least one
        buffer; none if the ledger has no room). Staged buffers that no longer fit (other
        rows, too few slots, or more than 4 SLOT_STEPs too many) go back."""
        with self._lock:
            expected = list(self._expected)
            joining = [r for r in self._joining if r.ticket not in expected]
        live = [r for r in self.rows if not r.ended]
        if not expected or not live:
            self._unstage()
            return
        lengths = [n for n, r in zip(self._lengths(), self.rows, strict=True) if not r.ended]
        lengths += [own_len(r.cache) for r in joining if r.cache is not None]
        longest = max(lengths + [e.positions for e in expected])
        need = max([longest + r.max_tokens - _next_step(r) + 1 for r in live + joining]
                   + [longest + e.max_tokens + 1 for e in expected])  # fmt: skip
        rows = len(live) + len(joining) + len(expected)
        staged = self._staged
        if staged is not None and (
            staged.rows != rows or not need <= staged.slots <= need + 4 * SLOT_STEP
        ):
            self._unstage()
        if self._staged is None:
            self._staged = Staged(rows, slots_for(need + SLOT_STEP))
        self.extra += self._staged.grow(self.cache, self.take)

    def _unstage(self) -> None:
        if self._staged is not None:
            self.give(self._staged.bytes)
            self.extra -= self._staged.bytes
            self._staged = None

    def _slots(self) -> int:
        return self.cache[0].keys.shape[2]

    def _own_bytes(self, joiners: list[Row], per: int) -> int:
        return sum(r.cache[0].keys.shape[2] * per for r in joiners)

    def _leave(self, rows: list[Row]) -> None:
        """Rows end: their KV out (if wanted), their slots dead, their bytes the batch's; the
        batch gone if no row is left (its ledger bytes given back before anyone hears)."""
        kept = [(r, self._take_out(r)) for r in rows]
        if all(r.ended for r in self.rows):
            self._drop_all()
        for r, cache in kept:
            self._done(r, cache)

    def _take_out(self, r: Row) -> list | None:
        i = self.rows.index(r)
        kept = None
        if r.keep_cache:
            if isinstance(self.cache[0], BatchKVCache):
                p, idx = self.pads[i], self._idx()
                kept = [self._own(j, c.keys[i : i + 1, :, p:idx], c.values[i : i + 1, :, p:idx])
                        for j, c in enumerate(self.cache)]  # fmt: skip
            else:
                kept = self.cache
        for st in (r.st, r.next):
            if st is not None:
                _settle(st)  # still writing into the cache: let it finish
        if kept is not None:
            mx.eval([(c.keys, c.values) for c in kept])
        if isinstance(self.cache[0], BatchKVCache):  # its reservation goes with its request
            more = r.reserved
            self.force(more)
            self.extra += more
        r.next = None
        return kept

    def _own(self, layer: int, keys: mx.array, values: mx.array) -> KVCache:
        c = self.new_layer(layer)
        c.keys, c.values, c.offset = mx.contiguous(keys), mx.contiguous(values), keys.shape[2]
        return c

    def _drop_all(self) -> None:
        for r in self.rows:
            for st in (r.st, r.next):
                if st is not None:
                    _settle(st)
        self.rows, self.cache, self.pads, self._staged = [], None, [], None
        self.give(self.extra)
        self.extra = 0
        mx.clear_cache()  # the batch's buffers (each compose's shape its own) go back

    def _done(self, r: Row, cache: list | None) -> None:
        r.cache = None
        try:
            r.on_done(cache, None)
        except Exception:  # the row's consumer must not end the others
            log.exception("a decode row's on_done failed")

    def fail(self, exc: BaseException) -> None:
        """End every row (and every joiner) with `exc`."""
        with self._lock:
            joining, self._joining = self._joining, []
        for r in self.rows + joining:
            if not r.ended or r in joining:
                r.on_done(None, exc)
            r.ended = True
        self.rows, self.cache, self.pads, self._staged = [], None, [], None
        self.give(self.extra)
        self.extra = 0


def _next_step(r: Row) -> int:
    if r.st is None:
        return r.start
    return r.st.step + 1
