"""The decode side of a split: pull the KV from a prefill peer straight into the decode cache,
decode, and account for every moment (the Timeline of report/timeline.py).

The KV stream lands in the preallocated cache as it arrives (node/receive.py: the socket
writes into the cache's memory; a frame's CRC is checked on a worker thread as the next one
arrives). All backend work runs on the node's single compute thread. If the peer fails
before END (dies, stalls, sends garbage, runs another model) the partial KV is discarded and
the prompt prefilled locally, unless the request says `fallback: none`.

After the handoff the whole decode is one job on the compute thread (`Backend.decode`), its
tokens reaching the event loop in batches (node/tokens.py); each token's text comes from an
incremental detokenizer. The decode stops after an end-of-turn token, at max_tokens, when
the caller's `until` says so (stop strings), or when the request is cancelled (the client
left); the `done` event says which of the first three (`stopped_by`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

import aiohttp

from exo_split.backends.base import Backend, Constraint, DecodeStats, Prefilled
from exo_split.chat import ChatTemplate
from exo_split.errors import (
    AuthError,
    BadCheckpoint,
    IncompatiblePeer,
    PeerUnavailable,
    ProtocolError,
)
from exo_split.layers import recurrent_layers
from exo_split.node.choices import Choice, Emit, EmitMany, Other, Shared, all_of, token_event
from exo_split.node.grammar import BadGrammar, GrammarConstraint, Grammars
from exo_split.node.prefill import forget_frames, wait_through_cancel
from exo_split.node.prefix import Checkout, PrefixCache, prefix_report
from exo_split.node.receive import STAGED_FRAMES
from exo_split.node.remote import RemotePull
from exo_split.node.slicing import Slicing
from exo_split.node.timing import Remote, build_timeline, decode_info
from exo_split.node.tokens import Batch, BatchDriver, decode_events
from exo_split.report import build_report, to_json
from exo_split.sampling import Adjust, sample
from exo_split.spec import ModelSpec, check_request, check_token_ids
from exo_split.tokenizer import TextCodec, TextStream
from exo_split.transport import wire
from exo_split.transport.client import Timeouts
from exo_split.transport.limits import KVLedger, Refused, decode_kv_bytes
from exo_split.transport.messages import GenerateRequest

log = logging.getLogger(__name__)
clock = time.perf_counter
PEER_FAILURES = (PeerUnavailable, ProtocolError, IncompatiblePeer, AuthError)


class Coordinator(RemotePull):
    def __init__(
        self,
        backend: Backend,
        codec: TextCodec,
        executor: Executor,
        *,
        token: str | None,
        timeouts: Timeouts,
        session: Callable[[], aiohttp.ClientSession],
        choose_peer: Callable[[GenerateRequest, int], Awaitable[tuple[str | None, dict | None]]],
        chat: ChatTemplate | None = None,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        prefix: PrefixCache | None = None,
        grammars: Grammars | None = None,
        slicing: Slicing | None = None,
    ):
        self.slicing = slicing or Slicing()  # a local prefill's jobs (node/slicing.py)
        self.grammars = grammars  # compiles requests' output formats (None: cannot)
        self.chat = chat  # the checkpoint's chat template; None: it has none
        self.prefix = prefix  # finished requests' KV, reused by the next turn (None: off)
        self.backend = backend
        self.spec: ModelSpec = backend.spec
        self.codec = codec
        self.executor = executor
        self.token = token
        self.link: Callable[[str], str] = lambda url: url  # a peer's URL as we reach it (TLS)
        self.timeouts = timeouts
        self.session = session
        self.choose_peer = choose_peer
        self.max_frame_bytes = max_frame_bytes
        # This node's prefill speed (tok/s, learned from what it serves; None: not known):
        # while others decode, a local prefill's slices are sized by it (`slicing`).
        self.local_speed: Callable[[], float | None] = lambda: None
        self._turn: tuple | None = None  # (event loop, the lock local prefills take turns by)
        batcher = backend.batcher() if hasattr(backend, "batcher") else None
        self.batch = BatchDriver(executor, batcher) if batcher is not None else None
        self.ledger: KVLedger | None = None  # the node's (count_in)

    def count_in(self, ledger) -> None:
        """Count the decode batch's padding and copies, and a local prefill's sliding layers,
        in the node's KV ledger."""
        self.ledger = ledger
        if self.batch is not None:
            b = self.batch.batcher
            b.take, b.give, b.force = ledger.take, ledger.give, ledger.force

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    def kv_need(self, prompt_len: int, max_tokens: int, *, local: bool = False) -> int:
        """The KV bytes a request holds at most (the ledger's reservation): the cache at
        full capacity, plus staged frames when the backend cannot be received into. A
        received cache keeps only the window of a sliding layer (backend.window_keep); a
        local prefill (`local`) keeps every position, and takes the difference when it runs
        (`_hold_local`). A node that only prefills (vllm) refuses here, before any work."""
        if getattr(self.backend, "prefill_only", False):
            raise Refused(409, "prefill_only", "this node runs vLLM as a prefill engine and does "
                          "not generate: send requests to the decode node, which reaches it")  # fmt: skip
        direct = hasattr(self.backend, "receive_views")
        staging = 0 if direct else STAGED_FRAMES * self.max_frame_bytes
        keep = () if local else getattr(self.backend, "window_keep", ())
        return decode_kv_bytes(self.spec, self.backend.dtype, prompt_len, max_tokens,
                               staging=staging, keep=keep)  # fmt: skip

    def _hold_local(self, prompt_len: int, max_tokens: int, copies: int, held: list) -> None:
        """A local prefill of a model with sliding layers keeps the whole prompt in them:
        reserve what that adds to the request's (windowed) reservation, or refuse (503)."""
        extra = copies * (self.kv_need(prompt_len, max_tokens, local=True)
                          - self.kv_need(prompt_len, max_tokens))  # fmt: skip
        if extra <= 0 or self.ledger is None:
            return
        if not self.ledger.take(extra):
            raise Refused(503, "busy", f"a local prefill of {prompt_len} tokens keeps every "
                          f"position in the sliding layers: {extra / 2**20:.1f} MiB more KV "
                          "than this node has free", retry_after=self.ledger.retry_after_s)  # fmt: skip
        held[0] += extra

    @contextlib.contextmanager
    def reusing(self, req: GenerateRequest, ids: list[int]) -> Iterator[Checkout | None]:
        """This request's share of the prefix cache, looked up before its KV is admitted (enter
        this before the ledger's hold): an entry it takes leaves the cache, so the ledger
        neither counts it twice nor evicts it to make room for this very request. Pass it to
        `generate`; a refused request gives it back on the way out."""
        on = self.prefix is not None and req.prefix_cache
        checkout = self.prefix.checkout(ids, req.scope) if on else None
        try:
            yield checkout
        finally:
            if checkout is not None and self.prefix is not None:
                self.prefix.cancel(checkout)  # nothing once generate has used it

    async def tokenize_off_loop(self, req: GenerateRequest) -> list[int]:
        """`tokenize` on a thread of its own: rendering a template and tokenizing a body of
        up to 8 MiB takes long enough to stall every KV stream and heartbeat the event loop
        serves (issue 18, L6); nor does it queue behind the compute thread's decode."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_TEXT_THREAD, self.tokenize, req)

    async def constrain(self, grammar: dict) -> GrammarConstraint:
        """A request's grammar compiled (off the event loop), or BadGrammar (its 400)."""
        if self.grammars is None:
            raise BadGrammar("this node cannot constrain its output (no grammar engine)")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_TEXT_THREAD, self.grammars.compile, grammar)

    def tokenize(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids (chat messages through the chat template), checked against
        the vocabulary and the context."""
        if req.messages is not None:
            if self.chat is None:
                raise BadCheckpoint(
                    f"this node's model ({self.spec.name}) has no chat template: chat needs an "
                    "instruct checkpoint",
                    hint="send a raw prompt instead",
                )
            ids = self.chat.token_ids(req.messages, req.tools)
        elif req.token_ids is not None:
            ids = list(req.token_ids)
        else:
            ids = self.codec.tokenize(req.prompt)
        check_token_ids(self.spec, ids)
        check_request(self.spec, len(ids), req.max_tokens)
        return ids

    async def generate(
        self,
        req: GenerateRequest,
        emit: Emit,
        *,
        arrived: float,
        prompt_ids: list[int] | None = None,
        emit_many: EmitMany | None = None,
        until: Callable[[], bool] | None = None,
        checkout: Checkout | None = None,
        constraint: Constraint | None = None,
        others: Sequence[Other] = (),
    ) -> dict:
        """Run one request, emitting token events; returns the final `done` event.

        `constraint`: the request's grammar (node/grammar.py), which masks every pick. Its
        first token is the decode loop's too: the prefill (remote or local) covers the
        prompt but its last position, which the loop computes itself under the mask.

        `checkout`: its share of the prefix cache (`reusing`), if looked up already.

        `prompt_ids`: the request's ids when the caller has already tokenized it.
        `emit_many`, if given, takes each batch of token events in one call (one write);
        without it every event goes through `emit`. `until` is asked after each token's event
        has been emitted (then through `emit`, one by one): True ends the generation there,
        as an end-of-turn token would, and the `done` event still comes.

        `others`: more choices of the same prompt (the OpenAI API's `n`), each (emit, until,
        constraint): the prompt is prefilled once, all but its last position, and each choice
        decodes from a copy of that KV, choice i with the seed plus i; their `done` events
        are this one's `others`, in order.

        Cancelling it (the client went away) closes the stream from the prefill peer, which
        stops that prefill, stops a local prefill at its next layer or the decode at its next
        step, and returns once the compute thread has let go of this request's KV.
        """
        stop = threading.Event()
        ids = list(prompt_ids) if prompt_ids is not None else None
        choices = [self._choice(req, emit, emit_many, until, constraint)]
        for i, (emit_i, until_i, constraint_i) in enumerate(others, start=1):
            sampling = dataclasses.replace(req.sampling, seed=req.sampling.seed + i)
            req_i = dataclasses.replace(req, sampling=sampling, prefix_cache=False)
            choices.append(self._choice(req_i, emit_i, None, until_i, constraint_i))
        local_kv = [0]  # what a local prefill added to the request's reservation
        try:
            ids = ids if ids is not None else await self.tokenize_off_loop(req)
            return await self._generate(req, ids, choices, arrived, stop, checkout, local_kv)
        except BaseException as exc:
            forget_frames(exc)  # the request's KV must not outlive it in a traceback
            if isinstance(exc, asyncio.CancelledError):
                stop.set()
                await wait_through_cancel(asyncio.ensure_future(self._run(_nothing)))
            raise
        finally:
            if local_kv[0] and self.ledger is not None:
                self.ledger.give(local_kv[0])
            for c in choices:
                if c.ticket is not None:
                    self.batch.batcher.unexpect(c.ticket)

    def _choice(self, req, emit, emit_many, until, constraint) -> Choice:
        lps = [] if req.logprobs is not None else None  # each token's, from the decode loop
        return Choice(req, emit, emit_many, until, constraint, lps, TextStream(self.codec))

    async def _generate(
        self,
        req: GenerateRequest,
        ids: list[int],
        choices: list[Choice],
        arrived: float,
        stop: threading.Event,
        checkout: Checkout | None,
        local_kv: list,
    ) -> dict:
        main, emit = choices[0], choices[0].emit
        for c in choices:
            c.adjust = self._adjust(c.req, ids)  # penalties, logit_bias, min_tokens
        # A mask, logprobs, adjusted logits or several choices: the decode loop picks the
        # first token too, and the prefill computes the prompt but its last position.
        own = len(choices) > 1 or any(
            c.constraint is not None or c.lps is not None or c.adjust is not None for c in choices
        )
        pre = ids[:-1] if own else ids  # what the prefill computes
        capacity = len(ids) + req.max_tokens

        async def emit_token(token: int) -> None:
            main.ended = not await self._emit_tokens(main, [(token, clock())])

        # The longest prefix this node holds: [0, m) is not prefilled again, nor sent.
        reuse = self.prefix if req.prefix_cache else None
        held, m = None, 0
        if reuse is not None:
            checkout = checkout or reuse.checkout(ids, req.scope)
            try:
                held = await self._run(reuse.materialize, checkout, capacity=capacity)
            finally:
                reuse.cancel(checkout)  # nothing once materialized; else the entry comes back
            m = checkout.cached if held is not None else 0
        remote, fallback, cache = None, None, None
        peer, decision = None, None
        if len(pre) > m:
            peer, decision = await self.choose_peer(req, len(pre) - m)  # the uncached suffix
        else:  # constrained, and nothing to prefill: one token, or all but the last cached
            cache = held if held is not None else await self._new_cache(capacity)
        first_token = _ignore if own else emit_token
        if self.batch is not None and self.batch.batcher.busy:  # its batch cache, meanwhile
            for c in choices:
                c.ticket = self.batch.batcher.expect(len(ids), req.max_tokens)
        if peer is not None:
            remote = Remote()
            try:
                cache = await self._remote_with_retries(
                    peer, req, pre, capacity, remote, emit, first_token, held, m
                )
            except PEER_FAILURES as exc:
                if req.fallback == "none":
                    failure = copy.copy(exc)  # same class and fields, a message that says why
                    failure.args = (f"remote prefill failed and fallback is none: {exc}",)
                    raise failure from exc
                forget_frames(exc)  # the partial KV goes now, before the local prefill
                if held is not None:  # what arrived past our own prefix is dropped
                    await self._run(self.backend.trim, held, m)
                fallback = f"local prefill: {exc}"
                log.warning("prefill peer failed, prefilling locally: %s", str(exc))
                await emit({"type": "fallback", "reason": str(exc)})
        local_start = clock()
        if cache is None:
            self._hold_local(len(ids), req.max_tokens, len(choices), local_kv)
            done = None
            # In slices (`_slice`), each a job of its own: the compute thread
            # runs other requests' decode slices between them (node/tokens.py).
            end = m
            async with self._prefill_turn():  # one local prefill at a time, FIFO
                local_start = clock()  # (its turn: the wait for it is not prefill time)
                while end < len(pre):
                    end, done = await self._run(self._prefill_slice, pre, end, held, req.chunk,
                                                capacity, stop)  # fmt: skip
                    held = done.cache
            cache, logits, done = done.cache, done.logits, None
            if not main.tokens and not own:
                await emit_token(sample(logits, req.sampling, 0)[0])
        local_end = clock()
        held = None
        shared = Shared(ids, own, remote, fallback, decision, arrived, (local_start, local_end), m)
        caches = [cache] + [await self._run(self.backend.fork, cache, len(pre), capacity)
                            for _ in choices[1:]]  # fmt: skip
        del cache
        runs = [self._decode_choice(c, [caches.pop(0)], shared, stop, reuse if c is main else None)
                for c in choices]  # fmt: skip
        dones = await all_of(runs)
        if len(dones) > 1:
            dones[0]["others"] = dones[1:]
        return dones[0]

    def _prefill_turn(self) -> asyncio.Lock:
        """Local prefills take turns (FIFO): between two decode steps runs one slice of one
        prefill, not one of each waiting (with 8 arriving at once, decodes stalled 7 slices)."""
        loop = asyncio.get_running_loop()
        if self._turn is None or self._turn[0] is not loop:
            self._turn = (loop, asyncio.Lock())
        return self._turn[1]

    def _prefill_slice(self, pre, start, held, chunk, capacity, stop) -> tuple[int, Prefilled]:
        """On the compute thread: the next slice of a local prefill, sized as it starts (the
        batch may have begun decoding while it queued)."""
        end = min(len(pre), start + self._slice())
        kept = {"cache": held} if held is not None else {}
        return end, self.backend.prefill(pre[:end], chunk=chunk, capacity=capacity,
                                         should_stop=stop.is_set, **kept)  # fmt: skip

    def _slice(self) -> int:
        """Positions for the next job of a local prefill (node/slicing.py)."""
        busy = self.batch is not None and self.batch.batcher.busy
        return self.slicing.positions(self.local_speed(), busy)

    async def _decode_choice(self, c: Choice, box: list, shared: Shared, stop, reuse) -> dict:
        """One choice's decode after the prefill, and its `done` event (the cache in `box`
        is its own, taken out of it)."""
        ids, req, stats = shared.ids, c.req, DecodeStats()
        hybrid = reuse is not None and recurrent_layers(self.spec)  # a turn boundary's states
        snap = await self._run(self.backend.snapshot, box[0]) if hybrid else []  # (prefix.py)
        if not c.ended:
            first = (ids[-1], 0) if shared.own else (c.tokens[0], 1)
            need = self.kv_need(len(ids), req.max_tokens)
            done, cache = await self._decode(box, first, req, stop, stats, c, need,
                                             reuse is not None)  # fmt: skip
            c.ended = not done
        else:
            cache = box.pop()
        if reuse is not None and cache is not None:
            await self._keep(reuse, cache, ids + c.tokens, req.scope, snap)
        del cache
        tokens = c.tokens
        stopped_by = (
            "until" if c.ended
            else "end_of_turn" if tokens[-1] in self._stop_ids(req)
            or (c.constraint is not None and c.constraint.done)
            else "max_tokens"
        )  # fmt: skip
        remote, fallback, m = shared.remote, shared.fallback, shared.cached
        timeline = build_timeline(self.spec.n_layers, ids, remote, fallback, shared.decision,
                                  shared.arrived, shared.local, c.times, req)  # fmt: skip
        k = remote.hello.get("prefill_cached_tokens", 0) if remote and remote.hello else 0
        prefix = prefix_report(m, k, len(ids) - (m if fallback or remote is None else k))
        engine = remote.hello.get("engine") if remote and remote.hello and not fallback else None
        timeline = dataclasses.replace(
            timeline, decode=decode_info(self.backend, stats, stopped_by), prefix=prefix,
            prefill=engine if isinstance(engine, dict) else None,
        )  # fmt: skip
        report = to_json(build_report(timeline))
        text = self.codec.detokenize(tokens)
        return {
            "type": "done",
            "tokens": tokens,
            "text": text,
            "tail": c.stream.finish(text),
            "prompt_tokens": len(ids),
            "cached_tokens": len(ids) - prefix["computed_tokens"],  # reused, not computed
            "stopped_by": stopped_by,
            "finish_reason": "length" if stopped_by == "max_tokens" else "stop",
            "report": report,
        }

    async def _emit_tokens(self, c: Choice, batch: Batch) -> bool:
        """Record and emit these tokens; False once `until` has ended the generation (the
        tokens after that one are dropped)."""
        if c.until is None and c.emit_many is not None:
            events = []
            for token, at in batch:
                c.tokens.append(token)
                c.times.append(at)
                events.append(token_event(token, c.stream, c.lps, len(c.tokens) - 1))
            await c.emit_many(events)
            return True
        for token, at in batch:
            c.tokens.append(token)
            c.times.append(at)
            await c.emit(token_event(token, c.stream, c.lps, len(c.tokens) - 1))
            if c.until is not None and c.until():
                return False
        return True

    async def _keep(self, reuse: PrefixCache, cache, tokens, scope: str, snap: list) -> None:
        """Hand a finished request's cache to the prefix cache: it covers the prompt and the
        tokens fed back in (a stop or `until` may leave one more computed: trimmed)."""
        n = min(await self._run(self.backend.cache_len, cache), len(tokens))
        await self._run(self.backend.trim, cache, n)
        reuse.put(tokens[:n], cache, scope, [snap] if snap else ())

    async def _decode(self, box, first, req, stop, stats, c: Choice, need,
                      keep) -> tuple[bool, object]:  # fmt: skip
        """Decode choice `c` from `first` (token, step) on the cache `box` holds (taken out
        of it): in the node's batch where the backend has one, else as compute jobs of its
        own. (False if `until` ended it, the cache after: None if it went with the batch and
        not `keep`.)"""
        constraint, lps, adjust = c.constraint, c.lps, c.adjust
        cache = box.pop()
        kw = {} if lps is None else {"logprobs": lps, "top_logprobs": req.logprobs}
        if self.batch is not None:
            row = self.batch.batcher.row(
                cache, first[0], start=first[1], max_tokens=req.max_tokens,
                sampling=req.sampling, stop_ids=self._stop_ids(req), stats=stats,
                constraint=constraint, adjust=adjust, reserved=need, keep_cache=keep,
                should_stop=stop.is_set, ticket=c.ticket, **kw,
            )  # fmt: skip
            del cache
            kept: list = []
            ok = True
            async with contextlib.aclosing(self.batch.rows(row, kept)) as batches:
                del row
                async for batch in batches:
                    if not await self._emit_tokens(c, batch):
                        ok = False
                        break
            return ok, kept[0] if kept else None  # kept: once the row has left

        def steps(should_stop: Callable[[], bool]):
            return self.backend.decode(
                cache, first[0], start=first[1], max_tokens=req.max_tokens,
                sampling=req.sampling, stop_ids=self._stop_ids(req),
                should_stop=lambda: should_stop() or stop.is_set(), stats=stats,
                constraint=constraint, adjust=adjust, **kw,
            )  # fmt: skip

        async with contextlib.aclosing(decode_events(self.executor, steps)) as batches:
            async for batch in batches:
                if not await self._emit_tokens(c, batch):
                    return False, cache
        return True, cache

    def _adjust(self, req: GenerateRequest, ids: list[int]) -> Adjust | None:
        kw = {"eos_ids": self.codec.eos_ids, "prompt": tuple(ids), **(req.adjust or {})}
        return Adjust(self.spec.vocab_size, **kw) if req.adjust else None

    def _stop_ids(self, req: GenerateRequest) -> frozenset[int]:
        return frozenset() if req.ignore_eos else self.codec.eos_ids


# Text work of every request (templates, tokenizers), one at a time, off the event loop.
_TEXT_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exo-text")


async def _ignore(token: int) -> None:
    """A constrained request's first token is the decode loop's, not the prefill's."""


def _nothing() -> None:
    """Run on the compute thread as a barrier: when it returns, earlier jobs have finished."""
