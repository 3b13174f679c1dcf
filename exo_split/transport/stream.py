"""The receiving side of a KV data connection: frames into the decoder's buffers, events out.

In cleartext the event loop reads (`PlainStream`, an asyncio BufferedProtocol: the kernel
copies straight into the decode cache). Over TLS a thread of the stream's own reads
(`TlsStream`: a blocking TLS socket whose `recv_into` decrypts straight into the decode
cache with the GIL released; asyncio's TLS would copy every byte twice more on the event
loop). Both put complete frames, and how the stream ended (`Bad`, `Eof`, `Lost`), on
`events`, for `transport/client.py`'s `_frames`, which owns every timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from dataclasses import dataclass

from exo_split import PROTOCOL_VERSION
from exo_split.errors import ProtocolError, UntrustedPeer
from exo_split.transport import wire
from exo_split.transport.datalink import TICKET, TICKET_MAGIC
from exo_split.transport.decoder import Frame, FrameDecoder
from exo_split.transport.tls import DATA_TLS_MAGIC, client_context, fingerprint_of

DELIVER_BYTES = 1 << 20  # a TLS stream reports progress (and its frames) at least this often


@dataclass(frozen=True)
class Bad:  # the stream broke a rule
    exc: ProtocolError


@dataclass(frozen=True)
class Eof:  # the peer closed; exc: what was missing
    exc: ProtocolError | None


@dataclass(frozen=True)
class Lost:  # the connection failed (reset, ...)
    exc: Exception | None


class _Events:
    """What both receivers share: the event queue, the idle clock and the pending bytes of
    frames that carry their own payload (no Destination), at most `max_pending` of them."""

    def __init__(self, decoder: FrameDecoder, ticket: bytes, max_pending: int):
        self.decoder, self.ticket, self.max_pending = decoder, ticket, max_pending
        self.events: asyncio.Queue = asyncio.Queue()
        self.last_data = asyncio.get_running_loop().time()
        self.bytes = self.pending = 0
        self.ended = False

    def _put(self, frames: list[Frame], nbytes: int) -> None:
        self.last_data = asyncio.get_running_loop().time()
        self.bytes += nbytes
        for frame in frames:
            self.events.put_nowait(frame)

    def _end(self, item) -> None:
        if not self.ended:
            self.ended = True
            self.events.put_nowait(item)

    @staticmethod
    def _payload(frames: list[Frame]) -> int:
        return sum(len(f.payload or b"") for f in frames if f.kind is wire.Kind.LAYER)


class PlainStream(_Events, asyncio.BufferedProtocol):
    """A cleartext stream, read by the event loop straight into the decoder's buffers (the
    decode cache itself when the decoder has a Destination): the kernel copies, nothing else
    does. Reading pauses while more than `max_pending` bytes of payload wait."""

    def __init__(self, decoder: FrameDecoder, ticket: bytes, max_pending: int):
        super().__init__(decoder, ticket, max_pending)
        self.transport: asyncio.Transport | None = None
        self.paused = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(TICKET.pack(TICKET_MAGIC, PROTOCOL_VERSION, self.ticket))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        assert self.transport is not None
        try:
            frames = self.decoder.buffer_updated(nbytes)
        except ProtocolError as exc:
            self._end(Bad(exc))
            self.transport.abort()
            return
        self.pending += self._payload(frames)
        self._put(frames, nbytes)
        if self.pending > self.max_pending and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def taken(self, frame: Frame) -> None:
        self.pending -= self._payload([frame])
        if self.paused and self.pending <= self.max_pending and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        try:
            self.decoder.eof()
            self._end(Eof(None))
        except ProtocolError as exc:
            self._end(Eof(exc))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(Lost(exc))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class TlsStream(_Events):
    """A TLS stream: `connect` (blocking: run it off the loop) sends DATA_TLS_MAGIC, runs the
    handshake, checks the certificate against `pin` (the fingerprint the POST was pinned
    to) and sends the ticket inside TLS; `start` then reads on a thread of its own."""

    def __init__(self, decoder: FrameDecoder, ticket: bytes, max_pending: int):
        super().__init__(decoder, ticket, max_pending)
        self.loop = asyncio.get_running_loop()
        self.sock: ssl.SSLSocket | None = None
        self._room = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def connect(self, host: str, port: int, pin: str, timeout: float, peer: str) -> None:
        raw = socket.create_connection((host, port), timeout=timeout)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.sendall(DATA_TLS_MAGIC)
            # A FIN without TLS's close_notify is a cut, not an end (Lost, not Eof): TLS 1.3
            # says so, and it tells a reset peer from one that closed the stream early.
            sock = client_context().wrap_socket(raw, do_handshake_on_connect=False,
                                                suppress_ragged_eofs=False)  # fmt: skip
            sock.do_handshake()
        except BaseException:
            raw.close()
            raise
        if fingerprint_of(sock) != pin:
            sock.close()
            raise UntrustedPeer(
                f"{peer}: the KV data connection's certificate is not the one its proof covered",
                hint="something between the nodes answers for the peer",
            )
        sock.sendall(TICKET.pack(TICKET_MAGIC, PROTOCOL_VERSION, self.ticket))
        sock.settimeout(None)  # the stream's timeouts are the loop's (_frames); close() wakes it
        with self._room:
            if not self._closed:
                self.sock, sock = sock, None
        if sock is not None:  # closed while we connected (a timeout, a cancel)
            sock.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-tls-rx", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.sock is not None
        try:
            while not self._closed:
                with self._room:
                    while self.pending > self.max_pending and not self._closed:
                        self._room.wait()
                buf, got, n = self.decoder.get_buffer(), 0, 1
                while got < len(buf) and got < DELIVER_BYTES:  # one decoder call per block
                    n = self.sock.recv_into(buf[got:])
                    if not n:
                        break
                    got += n
                frames = self.decoder.buffer_updated(got) if got else []
                with self._room:
                    self.pending += self._payload(frames)
                self.loop.call_soon_threadsafe(self._put, frames, got)
                if got < len(buf) and not n:  # the peer closed (or sent close_notify)
                    self._eof()
                    return
        except ProtocolError as exc:
            self.loop.call_soon_threadsafe(self._end, Bad(exc))
        except (OSError, ValueError) as exc:  # ssl.SSLError (a tampered record), a reset
            if not self._closed:
                self.loop.call_soon_threadsafe(self._end, Lost(exc))

    def _eof(self) -> None:
        try:
            self.decoder.eof()
            item = Eof(None)
        except ProtocolError as exc:
            item = Eof(exc)
        self.loop.call_soon_threadsafe(self._end, item)

    def taken(self, frame: Frame) -> None:
        with self._room:
            self.pending -= self._payload([frame])
            self._room.notify()

    def close(self) -> None:
        """Stop reading (wakes a blocked recv) and close; the thread ends at once."""
        with self._room:
            self._closed = True
            self._room.notify()
        if self.sock is not None:
            with contextlib.suppress(OSError):  # the socket's, not TLS's (the thread reads)
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
            if self._thread is not None:
                self._thread.join(timeout=10)
            self.sock.close()
