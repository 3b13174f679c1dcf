"""The remote half of a decode request: pull a prefill peer's KV stream straight into the
decode cache (node/receive.py's sink), retrying a busy peer, checking what it says (HELLO's
spec, END's stamps, the first token) and recording when each piece landed (node/timing.py's
Remote). A mixin of node/decode.py's Coordinator, whose fields it uses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from exo_split.errors import PeerBusy, PeerUnavailable, ProtocolError
from exo_split.layers import state_bytes
from exo_split.node.receive import open_sink
from exo_split.node.timing import Piece, Remote
from exo_split.spec import ModelSpec, require_compatible
from exo_split.transport import wire
from exo_split.transport.client import kv_stream
from exo_split.transport.limits import kv_bytes
from exo_split.transport.messages import PrefillRequest
from exo_split.transport.stamps import parse_end

log = logging.getLogger(__name__)
clock = time.perf_counter
PART_BYTES = 8 << 20  # a receiving cache's allocation per compute job while others decode


class RemotePull:
    async def _remote_with_retries(
        self, peer, req, ids, capacity, remote, emit, emit_token, held=None, start=0
    ):
        """A busy peer (503) is asked again after its Retry-After while the total wait stays
        within `timeouts.busy_wait`, then the PeerBusy goes up like any peer failure."""
        waited = 0.0
        while True:
            try:
                return await self._remote_prefill(
                    peer, req, ids, capacity, remote, emit, emit_token, held, start
                )
            except PeerBusy as exc:
                pause = max(0.0, exc.retry_after)
                if waited + pause > self.timeouts.busy_wait:
                    raise
                log.info("prefill peer %s busy; asking again in %g s", peer, pause)
                await asyncio.sleep(pause)
                waited += pause

    async def _new_cache(self, capacity: int, **kw):
        """backend.new_cache on the compute thread. While others decode in the batch, in
        jobs of about PART_BYTES (whole layers; new_cache_parts) that their steps go on
        between, not in one stall as long as the whole cache's allocation (issue 19: 27 ms
        for 53 MB here, a stall for every row of the batch; ~10x at 8B sizes)."""
        parts = getattr(self.backend, "new_cache_parts", None)
        batch = getattr(self, "batch", None)
        if parts is None or batch is None or not batch.batcher.busy:
            return await self._run(self.backend.new_cache, capacity, **kw)
        cache, jobs = await self._run(parts, capacity, **kw)
        layer = kv_bytes(self.spec, capacity, self.backend.dtype, layers=1)
        per = max(1, PART_BYTES // max(1, layer))
        for i in range(0, len(jobs), per):
            await self._run(_run_all, jobs[i : i + per])
        return cache

    async def _remote_prefill(
        self, peer, req, ids, capacity, remote: Remote, emit, emit_token, held, start
    ):
        """Pull the KV of [start, n) straight into `held` (which holds [0, start)) or a new
        cache; returns it filled. Raises one of PEER_FAILURES; then the partial cache is
        already dropped (a `held` one stays the caller's)."""
        keep = ()  # a fresh cache keeps only the windows of sliding layers; a held one has all
        if held is None:
            keep = getattr(self.backend, "window_keep", ())
            windowed = {"prompt_len": len(ids)} if keep else {}
            held = await self._new_cache(capacity, **windowed)
        sink = await self._run(open_sink, self.backend, held)
        del held
        body = PrefillRequest(
            request_id=uuid.uuid4().hex[:16],
            token_ids=tuple(ids),
            sampling=req.sampling,
            spec=self.spec.to_dict(),
            fingerprint=self.spec.fingerprint,
            overlap=req.overlap,
            chunk=req.chunk,
            dtype=self.backend.dtype,
            max_frame_bytes=self.max_frame_bytes,
            start=start,
            prefix_cache=req.prefix_cache,
            keep=keep,
            scope=req.scope,
        ).to_json()
        spec = wire.StreamSpec(self.spec.n_layers, self.spec.n_kv_heads, self.spec.head_dim,
                               wire.WireDtype.from_name(self.backend.dtype), len(ids),
                               self.max_frame_bytes, start, keep,
                               state_bytes(self.spec, self.backend.dtype),
                               self.spec.value_dim)  # fmt: skip
        pieces: list[tuple[int, int, int]] = []
        try:
            remote.sent_at = clock()
            frames = kv_stream(self.session(), self.link(peer), self.token, body, spec, self.timeouts,
                               dest=sink.dest, max_pending=self.max_frame_bytes)  # fmt: skip
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    now = clock()
                    if frame.kind is wire.Kind.HELLO:
                        remote.hello, remote.hello_at = frame.obj, now
                        self._check_hello(peer, frame.obj)
                        pieces = list(wire.Plan.from_json(frame.obj["plan"], spec).pieces())
                    elif frame.kind is wire.Kind.LAYER:
                        await sink.landed(frame, self._run)
                        if frame.last:  # a whole (chunk, layer) piece is in the cache
                            layer, start, n = pieces[frame.piece]
                            size = spec.layer_payload_len(n) if n else spec.state_bytes[layer]
                            piece = Piece(layer, start, n, size)
                            remote.received.append((piece, now))
                            remote.injected.append(clock())
                            progress = {"type": "progress", "layer": layer,
                                        "layers": self.spec.n_layers, "tokens": start + n,
                                        "of": len(ids)}  # fmt: skip
                            await emit(progress)
                        del frame
                    elif frame.kind is wire.Kind.TOKEN:
                        remote.first_token, remote.first_token_at = frame.token_id, now
                    elif frame.kind is wire.Kind.END:
                        remote.end = frame.obj
            if remote.end is None or remote.first_token is None:
                raise PeerUnavailable(f"{peer} ended the stream without TOKEN and END")
            remote.stamps = _check_end(peer, remote.end, len(pieces))
            if remote.first_token >= self.spec.vocab_size:
                raise ProtocolError(
                    f"{peer}: first token {remote.first_token} is outside the vocabulary"
                )
            cache = await self._run(sink.finish, len(ids))
        except BaseException:
            sink.close()
            sink.cache = None  # the partial KV goes now, before any local prefill
            raise
        await emit_token(remote.first_token)
        return cache

    def _check_hello(self, peer: str, hello: dict | None) -> None:
        if not hello or "spec" not in hello:
            raise ProtocolError(f"{peer}: HELLO carries no model spec")
        if not all(
            isinstance(hello.get(k), int | float) for k in ("prefill_received", "prefill_replied")
        ):
            raise ProtocolError(f"{peer}: HELLO lacks the prefill_received/prefill_replied stamps")
        try:
            theirs = ModelSpec.from_dict(hello["spec"])
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ProtocolError(f"{peer}: HELLO has a malformed spec: {exc}") from exc
        require_compatible(self.spec, theirs, what=f"prefill peer {peer}")


def _run_all(jobs) -> None:
    for job in jobs:
        job()


def _check_end(peer: str, end: dict, n_pieces: int) -> dict[str, list[float]]:
    """END must account for every piece with its stamps (the report is built from them)."""
    try:
        return parse_end(end, n_pieces)
    except ProtocolError as exc:
        raise ProtocolError(f"{peer}: {exc}") from exc
