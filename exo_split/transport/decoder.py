"""The receiving end of a frame stream, sans-IO: `FrameDecoder` checks every header against
the stream's Plan before it accepts a byte of payload, and puts LAYER payloads where the
caller says (straight into a decode cache) or into a buffer of exactly the announced size.

Two ways in: `get_buffer()` / `buffer_updated(n)` (an asyncio BufferedProtocol: the kernel
copies into our memory, no intermediate buffer) and `feed(data)` (bytes handed over by
someone else: one copy). The CRC runs inline (`InlineCrc`) or on a worker thread that trails
the receive pointer (`ThreadCrc`); then a LAYER frame's check is a Future the caller awaits.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from exo_split.errors import ProtocolError
from exo_split.transport.heads import range_bytes, sub_views
from exo_split.transport.wire import (
    HEADER_SIZE,
    MAX_JSON_PAYLOAD,
    TOKEN_PAYLOAD,
    Buffer,
    FrameHeader,
    Kind,
    Plan,
    StreamSpec,
    _require,
    check_crc,
    crc32,
    parse_json,
)


class Destination(Protocol):
    def blocks(self, layer: int, token_start: int, n_tokens: int) -> Sequence[memoryview]:
        """Writable byte views whose concatenation receives a LAYER payload (K's heads, then
        V's; n_tokens 0: the layer's state arrays)."""
        ...


@dataclass(frozen=True)
class Frame:
    """A complete, checked frame. LAYER: `piece` is its index in Plan.pieces(), `last` whether
    it completes that piece; `k` and `v` view the payload when the decoder allocated it (no
    Destination); `crc` is the pending check when the CRC runs on a thread. HELLO, END,
    ERROR: `obj`. TOKEN: `token_id` and `logprob`."""

    header: FrameHeader
    payload: bytearray | None = field(default=None, repr=False)
    k: memoryview | None = field(default=None, repr=False)
    v: memoryview | None = field(default=None, repr=False)
    obj: dict[str, Any] | None = None
    token_id: int | None = None
    logprob: float | None = None
    piece: int = -1
    last: bool = False
    crc: concurrent.futures.Future | None = field(default=None, repr=False, compare=False)
    # A head range's frame (a tensor-parallel prefill): `complete` once the last range of its
    # token range is in; without a Destination `k`, `v` and `payload` then hold all heads.
    complete: bool = True

    @property
    def kind(self) -> Kind:
        return self.header.kind

    def verify(self, computed: int | None = None) -> None:
        """Raise ProtocolError unless a threaded CRC matches (waits for it)."""
        if self.crc is not None:
            check_crc(self.header, self.crc.result() if computed is None else computed)


class InlineCrc:
    """CRC-32 of each received range as it lands (still in cache), on the receiving thread."""

    def __init__(self) -> None:
        self._value = 0

    def start(self) -> None:
        self._value = 0

    def update(self, view: memoryview) -> None:
        self._value = crc32(view, self._value)

    def finish(self) -> int:
        return self._value


class NoCrc:
    """Over TLS: LAYER frames' CRC is neither computed nor checked (senders write 0; TLS
    authenticates every byte: a changed byte fails its record before the frame sees it)."""

    def start(self) -> None: ...

    def update(self, view: memoryview) -> None: ...

    def finish(self) -> None:
        return None

    def close(self) -> None: ...


class ThreadCrc:
    """CRC-32 on a worker thread trailing the receive pointer (the CRC releases the GIL, so
    it runs beside the receiving thread). `finish()` returns a Future of the frame's CRC."""

    MIN_BATCH = 1 << 20  # hand the worker at least this much at a time

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self._thread = threading.Thread(target=self._run, name="kv-crc-rx", daemon=True)
        self._thread.start()

    def start(self) -> None:
        self._jobs.put(("start", None))

    def update(self, view: memoryview) -> None:
        self._pending.append(view)
        self._pending_bytes += len(view)
        if self._pending_bytes >= self.MIN_BATCH:
            self._flush()

    def finish(self) -> concurrent.futures.Future:
        self._flush()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put(("finish", fut))
        return fut

    def close(self) -> None:
        """Stop the worker (pending checks still complete first)."""
        self._pending.clear()
        self._jobs.put(("stop", None))
        self._thread.join(timeout=30)

    def _flush(self) -> None:
        if self._pending:
            self._jobs.put(("data", self._pending))
            self._pending, self._pending_bytes = [], 0

    def _run(self) -> None:
        value = 0
        while True:
            op, arg = self._jobs.get()
            if op == "start":
                value = 0
            elif op == "data":
                for view in arg:
                    value = crc32(view, value)
            elif op == "finish":
                arg.set_result(value)
            else:
                return


class FrameDecoder:
    """Incremental parser and validator of one frame stream.

    Each header is checked against the spec and the Plan (from HELLO) before its payload is
    accepted, so a header claiming 100 GB costs nothing. After a ProtocolError the decoder
    refuses more input. Call `eof()` when the transport ends.
    """

    def __init__(
        self, spec: StreamSpec, *, dest: Destination | None = None, crc: Any = None
    ) -> None:
        self.spec, self.dest = spec, dest
        self.crc = crc if crc is not None else InlineCrc()
        self.plan: Plan | None = None
        self.layer_frames = 0  # LAYER frames complete
        self._expect: Kind | None = Kind.HELLO  # None once END or ERROR has come
        self._last = "nothing"  # the previous frame, for messages
        self._frames: Any = iter(())
        # (piece, layer, start, n, heads): Plan.wire_frames()
        self._next: tuple[int, int, int, int, tuple[int, int] | None] | None = None
        self._group: bytearray | None = None  # a token range's heads, assembled (no dest)
        self._head = bytearray(HEADER_SIZE)
        self._head_view = memoryview(self._head)
        self._head_filled = 0
        self._header: FrameHeader | None = None  # set while its payload arrives
        self._payload: bytearray | None = None
        self._blocks: Sequence[memoryview] = ()
        self._block = self._filled = self._received = 0
        self._failure: ProtocolError | None = None

    @property
    def done(self) -> bool:
        """END has been received."""
        return self._last == Kind.END.name

    @property
    def finished(self) -> bool:
        """END or ERROR has been received: no more frames may come."""
        return self._expect is None

    def get_buffer(self) -> memoryview:
        """Where the next bytes go (never empty): the header, or the current payload block."""
        self._check_alive()
        if self._header is None:
            return self._head_view[self._head_filled :]
        return self._blocks[self._block][self._filled :]

    def buffer_updated(self, n: int) -> list[Frame]:
        """`n` bytes were written at the start of `get_buffer()`; the frames they complete."""
        self._check_alive()
        try:
            return self._advance(n)
        except ProtocolError as exc:
            self._failure = exc
            raise

    def feed(self, data: Buffer) -> list[Frame]:
        """Bytes that arrived elsewhere: copied once, into `get_buffer()`."""
        self._check_alive()
        view, frames = memoryview(data).cast("B"), []
        while view:
            if self._expect is None and self._header is None and not self._head_filled:
                self._failure = ProtocolError(
                    f"data after {self._last}: expected EOF, got {len(view)} bytes"
                )
                raise self._failure
            buf = self.get_buffer()
            k = min(len(buf), len(view))
            buf[:k] = view[:k]
            frames += self.buffer_updated(k)
            view = view[k:]
        return frames

    def eof(self) -> None:
        """The transport ended: raise ProtocolError unless the stream was complete."""
        self._check_alive()
        if (h := self._header) is not None:
            what = f"stream ended mid-frame in {h.describe()}"
            _require(False, what, f"{h.payload_len} payload bytes", self._received)
        what = "stream ended mid-header"
        _require(not self._head_filled, what, f"{HEADER_SIZE} bytes", self._head_filled)
        expected = self._expecting()
        if self._expect is Kind.LAYER and self.plan is not None:
            expected += f" ({self.layer_frames} of {self.plan.n_frames} LAYER frames received)"
        _require(self._expect is None, f"stream ended after {self._last}", expected, "EOF")

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise ProtocolError(f"stream already failed: {self._failure}")

    def _advance(self, n: int) -> list[Frame]:
        if self._header is None:
            _require(self._expect is not None, f"data after {self._last}", "EOF", f"{n} bytes")
            self._head_filled += n
            if self._head_filled < HEADER_SIZE:
                return []
            self._head_filled = 0
            self._start(FrameHeader.unpack(self._head))
            return [self._finish()] if self._header.payload_len == 0 else []
        block = self._blocks[self._block]
        if self._header.kind is Kind.LAYER:
            self.crc.update(block[self._filled : self._filled + n])
        self._filled += n
        self._received += n
        if self._filled < len(block):
            return []
        self._block, self._filled = self._block + 1, 0
        return [self._finish()] if self._block == len(self._blocks) else []

    def _expecting(self) -> str:
        if self._expect is Kind.LAYER and self._next is not None:
            _, layer, start, n, heads = self._next
            return FrameHeader(Kind.LAYER, layer=layer, token_start=start, n_tokens=n,
                               heads=heads).describe()  # fmt: skip
        return self._expect.name if self._expect is not None else "EOF"

    def _start(self, h: FrameHeader) -> None:
        """Check a header against the stream, then say where its payload goes."""
        if h.kind is not Kind.ERROR:
            twice = " (HELLO twice)" if h.kind is Kind.HELLO and self._last != "nothing" else ""
            what = f"out of order after {self._last}{twice}"
            _require(h.kind is self._expect, what, self._expecting(), h.describe())
        if h.kind is Kind.LAYER:
            self._check_layer(h)
            assert self._next is not None
            _, layer, start, n, heads = self._next
            if heads is not None:  # its part of the token range's payload
                self._blocks = self._range_blocks(layer, start, n, heads)
            elif self.dest is not None:
                self._blocks = self.dest.blocks(layer, start, n)
            else:
                self._payload = bytearray(h.payload_len)
                self._blocks = [memoryview(self._payload)]
            assert sum(len(b) for b in self._blocks) == h.payload_len, "bad Destination"
            self.crc.start()
        else:
            if h.kind is Kind.END and self.plan is not None:
                cap = self.plan.end_cap()
                _require(h.payload_len <= cap, "END", f"payload_len <= {cap}", h.payload_len)
            self._payload = bytearray(h.payload_len)
            self._blocks = [memoryview(self._payload)]
        self._header, self._block, self._filled, self._received = h, 0, 0, 0

    def _range_blocks(self, layer: int, start: int, n: int, heads: tuple[int, int]) -> list:
        """Where a head range's payload goes: its heads' bytes of the token range's whole
        payload, in the Destination or (none) in a buffer the first range allocates."""
        spec = self.spec
        if self.dest is not None:
            whole = self.dest.blocks(layer, start, n)
        else:
            if heads[0] == 0:
                self._group = bytearray(spec.layer_payload_len(n))
            assert self._group is not None
            whole = [memoryview(self._group)]
        k_len = spec.k_payload_len(n)
        where = range_bytes(heads, spec.n_kv_heads, k_len, spec.layer_payload_len(n) - k_len)
        return sub_views(whole, where)

    def _check_layer(self, h: FrameHeader) -> None:
        assert self._next is not None
        spec, (_, layer, start, n, heads) = self.spec, self._next
        what = f"out-of-order layer after {self._last}"
        _require(h.layer == layer, what, f"LAYER {layer}", f"LAYER {h.layer}")
        _require(h.dtype == spec.dtype, f"wrong dtype on LAYER {layer}", spec.dtype.name,
                 h.dtype.name)  # fmt: skip
        got = f"[{h.token_start}, {h.token_start + h.n_tokens})"
        what = f"wrong token range on LAYER {layer} after {self._last}"
        want = f"its state after {start} tokens" if n == 0 else f"[{start}, {start + n})"
        if n == 0 or h.n_tokens == 0:
            got = h.describe()
        _require((h.token_start, h.n_tokens) == (start, n), what, want, got)
        if h.heads != heads:
            what = f"wrong head range on {h.describe()}"
            want = "all heads (flags 0)" if heads is None else f"heads {list(heads)}"
            _require(False, what, want, "all heads" if h.heads is None else list(h.heads))
        if n == 0:
            size = spec.state_bytes[layer]
            what = f"wrong payload_len on {h.describe()}"
            _require(h.payload_len == size, what, f"{size} (its state arrays)", h.payload_len)
            return
        size = spec.layer_payload_len(n, heads and heads[1])
        n_heads = heads[1] if heads else spec.n_kv_heads
        shape = f"2 x {n_heads} heads x {n} tokens x {spec.head_dim} dims"
        if spec.v_width != spec.head_dim:  # a latent layer: K and V of their own widths
            shape = (
                f"{spec.n_kv_heads} heads x {n} tokens x ({spec.head_dim} + {spec.v_width}) dims"
            )
        what = f"wrong payload_len on {h.describe()}"
        _require(h.payload_len == size, what, f"{size} ({shape} x {spec.dtype.name})",
                 h.payload_len)  # fmt: skip

    def _finish(self) -> Frame:
        h, payload = self._header, self._payload
        assert h is not None
        self._header, self._payload, self._blocks = None, None, ()
        self._last = h.describe()
        if h.kind is Kind.LAYER:
            return self._finish_layer(h, payload)
        check_crc(h, crc32(payload or b""))
        if h.kind is Kind.TOKEN:
            self._expect = Kind.END
            token_id, logprob = TOKEN_PAYLOAD.unpack(payload)
            return Frame(h, payload, token_id=token_id, logprob=logprob)
        obj = parse_json(h.kind, payload or b"")
        if h.kind is Kind.HELLO:
            self.plan = Plan.from_json(obj.get("plan"), self.spec)
            self._frames = self.plan.wire_frames()
            self._next = next(self._frames)
            self._expect = Kind.LAYER
        else:  # END or ERROR ends the stream
            self._expect = None
        return Frame(h, payload, obj=obj)

    def _finish_layer(self, h: FrameHeader, payload: bytearray | None) -> Frame:
        assert self._next is not None
        piece = self._next[0]
        computed = self.crc.finish()
        pending = computed if isinstance(computed, concurrent.futures.Future) else None
        if pending is None and computed is not None:  # None: NoCrc, over TLS
            check_crc(h, computed)
        self.layer_frames += 1
        self._next = next(self._frames, None)
        if self._next is None:
            self._expect = Kind.TOKEN
        last = self._next is None or self._next[0] != piece
        complete = h.heads is None or sum(h.heads) == self.spec.n_kv_heads
        if h.heads is not None and complete:  # the token range's heads are all in
            payload, self._group = self._group, None
        k = v = None
        if payload is not None and h.n_tokens:
            view, split = memoryview(payload), self.spec.k_payload_len(h.n_tokens)
            k, v = view[:split], view[split:]
        return Frame(h, payload, k=k, v=v, piece=piece, last=last, crc=pending,
                     complete=complete)  # fmt: skip


def decode_frame(buf: Buffer) -> Frame:
    """Parse exactly one complete frame: header, size, CRC, payload (not stream order)."""
    view = memoryview(buf).cast("B")
    header = FrameHeader.unpack(view)
    size = HEADER_SIZE + header.payload_len
    _require(len(view) == size, f"frame size of {header.describe()}", size, len(view))
    payload = bytearray(view[HEADER_SIZE:])
    check_crc(header, crc32(payload))
    if header.kind is Kind.LAYER and header.n_tokens:
        half = len(payload) // 2
        return Frame(header, payload, k=memoryview(payload)[:half], v=memoryview(payload)[half:])
    if header.kind is Kind.TOKEN:
        token_id, logprob = TOKEN_PAYLOAD.unpack(payload)
        return Frame(header, payload, token_id=token_id, logprob=logprob)
    return Frame(header, payload, obj=parse_json(header.kind, payload))


__all__ = ["MAX_JSON_PAYLOAD", "Destination", "Frame", "FrameDecoder", "InlineCrc", "ThreadCrc",
           "decode_frame"]  # fmt: skip
