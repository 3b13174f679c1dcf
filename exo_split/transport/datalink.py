"""The KV data connection, server side: one TCP port serves both HTTP and raw KV streams.

The decode node's `POST /v1/prefill` (authenticated, checked) is answered with a one-time
ticket; the decode node then opens a second TCP connection to the same port and sends
`TICKET_MAGIC`, the protocol version and the ticket (40 bytes). `Sniffer` reads the first
bytes of every accepted connection: anything else is handed to aiohttp, unchanged, so users
open no second port and discovery is unchanged. A redeemed ticket hands the connection to
the waiting prefill handler, whose `FrameSender` writes the frames from two threads (a CRC
stage and a sendmsg stage) so neither the event loop nor the compute thread copies a byte.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import logging
import os
import queue
import secrets
import socket
import ssl
import struct
import threading
import time
import weakref
from asyncio import sslproto
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import web

from exo_split import PROTOCOL_VERSION
from exo_split.transport.accept import Acceptor, stranger_caps
from exo_split.transport.limits import Guard
from exo_split.transport.tls import DATA_TLS_MAGIC, TLS_RECORD, Identity
from exo_split.transport.wire import Buffer, WireDtype, layer_frame

log = logging.getLogger(__name__)
clock = time.perf_counter

TICKET_MAGIC = b"EXOD"
KEEPALIVE_S = 15.0  # an idle HTTP connection is closed after this (aiohttp's default: 75 s)
TICKET = struct.Struct("<4sI32s")  # magic, protocol version, the one-time ticket
IOV_MAX = 512  # buffers per sendmsg (Linux and macOS allow 1024)


@dataclass(eq=False)
class Ticket:
    """One admitted prefill's claim on a data connection: single use, short-lived."""

    value: bytes = field(repr=False)
    future: asyncio.Future = field(repr=False)
    address: str | None = None  # who asked for it: only a connection from there redeems it
    tls: bool = False  # asked for over TLS: only a TLS data connection redeems it

    @property
    def hex(self) -> str:
        return self.value.hex()


class Tickets:
    """The tickets a node has issued and not yet seen redeemed. Looked up by a hash of the
    ticket and confirmed in constant time, so a guess learns nothing from timing."""

    def __init__(self) -> None:
        self._open: dict[bytes, Ticket] = {}

    def issue(self, address: str | None = None, tls: bool = False) -> Ticket:
        value = secrets.token_bytes(32)
        ticket = Ticket(value, asyncio.get_running_loop().create_future(), address, tls)
        self._open[hashlib.sha256(value).digest()] = ticket
        return ticket

    def redeem(self, value: bytes, address: str | None = None, tls: bool = False
               ) -> Ticket | None:  # fmt: skip
        """The ticket, used up; None for an unknown one, or one presented from another
        address than the one it was issued to (issue 18, L8: a ticket seen on the wire is
        no use elsewhere, and it stays open for its owner), or in cleartext when it was
        asked for over TLS."""
        key = hashlib.sha256(value).digest()
        ticket = self._open.get(key)
        if ticket is None or not hmac.compare_digest(ticket.value, value):
            return None
        if (ticket.address is not None and ticket.address != address) or ticket.tls != tls:
            return None
        del self._open[key]
        return ticket

    def waiting_for(self, address: str | None) -> int:
        """Unredeemed TLS tickets that a data connection from `address` could redeem."""
        return sum(t.tls and t.address in (None, address) for t in self._open.values())

    def discard(self, ticket: Ticket) -> None:
        self._open.pop(hashlib.sha256(ticket.value).digest(), None)

    def __len__(self) -> int:
        return len(self._open)


class DataConnection:
    """A redeemed data connection, as the prefill handler sees it. The event loop keeps
    reading it only to notice the receiver leaving (`lost`); the sender writes through
    `socket()`, a duplicate of the descriptor for a blocking thread."""

    def __init__(self, transport: asyncio.Transport, tls: ssl.SSLSocket | None = None):
        self.transport = transport
        self.tls = tls  # a TLS data connection: its TLS socket (blocking), the send thread's
        self.lost = asyncio.Event()
        self.why = ""
        self.on_lost: list[Callable[[], None]] = []

    def socket(self, timeout: float) -> socket.socket:
        """A blocking socket of our own (a dup) for the send threads; over TLS, the TLS
        socket the handshake made (`ssl.SSLSocket`, used by one thread). ConnectionError
        when the connection closed before we got here (its descriptor is then -1)."""
        raw = self.transport.get_extra_info("socket")
        fd = raw.fileno() if raw is not None else -1
        if fd < 0 or self.transport.is_closing():
            raise ConnectionAbortedError("the data connection closed before the stream began")
        if self.tls is not None:
            self.tls.settimeout(timeout)
            return self.tls
        sock = socket.socket(fileno=os.dup(fd))
        sock.settimeout(timeout)
        return sock

    async def send(self, data: bytes) -> None:
        """Send `data` from the event loop (tests' fake peers; nodes send with `socket`)."""
        if self.tls is None:
            self.transport.write(data)
            return
        await asyncio.get_running_loop().run_in_executor(None, self.tls.sendall, data)

    def peer_left(self, why: str) -> None:
        if not self.lost.is_set():
            self.why = why
            self.lost.set()
            for callback in self.on_lost:
                callback()

    def close(self) -> None:
        """Close now; over TLS with TLS's own end (close_notify), so the receiver tells this
        end from a cut (a reset, a FIN alone)."""
        if self.tls is not None:
            with contextlib.suppress(OSError, ValueError):  # SSLWantReadError: sent, not acked
                self.tls.setblocking(False)
                self.tls.unwrap()
            self.tls.close()
        self.transport.close()

    async def finish(self, wait: float) -> None:
        """Close after the stream's last frame; over TLS after the receiver has closed its
        end (for at most `wait` s), so a receiver never meets the end of the connection
        with records still unread."""
        if self.tls is not None:
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(self.lost.wait(), wait)
        self.close()

    def abort(self) -> None:
        if self.tls is not None:
            self.tls.close()
        self.transport.abort()


class Sniffer(asyncio.BufferedProtocol):
    """The first protocol of every accepted connection. It reads at most 4 bytes to tell a
    data connection (TICKET_MAGIC; DATA_TLS_MAGIC and TLS) from HTTPS (a TLS record) and
    HTTP; HTTP(S) goes to aiohttp's protocol with those bytes, a data connection reads its
    ticket and goes to the handler waiting for it."""

    def __init__(self, http: Callable[[], asyncio.Protocol], tickets: Tickets,
                 guard: Guard, identity: Identity | None = None):  # fmt: skip
        self.http, self.tickets, self.guard = http, tickets, guard
        self.identity = identity  # None: no TLS on this port
        self.transport: asyncio.Transport | None = None
        self.conn: DataConnection | None = None
        self._buf = bytearray(TICKET.size)
        self._n = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.guard.arrived(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.conn is not None:  # the receiver sends nothing after its ticket
            return memoryview(self._buf)
        want = len(TICKET_MAGIC) if self._n < len(TICKET_MAGIC) else TICKET.size
        return memoryview(self._buf)[self._n : want]

    def buffer_updated(self, nbytes: int) -> None:
        assert self.transport is not None
        if self.conn is not None:
            self.conn.peer_left("the receiver sent data on the KV stream")
            self.transport.abort()
            return
        self._n += nbytes
        head = bytes(self._buf[: min(self._n, len(TICKET_MAGIC))])
        if head[:1] == bytes([TLS_RECORD]) and self.identity is not None:
            self._to_https()
        elif head == DATA_TLS_MAGIC and self.identity is not None:
            self._start_tls_data()
        elif not (TICKET_MAGIC.startswith(head) or DATA_TLS_MAGIC.startswith(head)):
            self._to_http()
        elif head == TICKET_MAGIC and self._n == TICKET.size:
            self._redeem(bytes(self._buf), tls=False)
        elif head not in (TICKET_MAGIC, *(DATA_TLS_MAGIC[:i] for i in range(1, 4))):
            self._to_http()  # 'EXOT' on a port without TLS, or 'EXOx'

    def _to_http(self) -> None:
        assert self.transport is not None
        # Still unidentified: the guard's deadline holds until aiohttp has a whole request.
        proto, transport = self.http(), self.transport
        self.transport = None  # aiohttp's from here on
        transport.set_protocol(proto)
        proto.connection_made(transport)
        proto.data_received(bytes(self._buf[: self._n]))

    def _to_https(self) -> None:
        """HTTP over TLS: asyncio's TLS, then aiohttp, given the bytes read so far."""
        assert self.transport is not None and self.identity is not None
        proto, transport = self.http(), self.transport
        self.transport = None
        tls = sslproto.SSLProtocol(
            asyncio.get_running_loop(), proto, self.identity.context, None, server_side=True,
            ssl_handshake_timeout=self.guard.deadline,
        )  # fmt: skip
        transport.set_protocol(tls)
        tls.connection_made(transport)
        if isinstance(tls, asyncio.BufferedProtocol):  # Python >= 3.11's sslproto
            buf = tls.get_buffer(self._n)
            buf[: self._n] = self._buf[: self._n]
            tls.buffer_updated(self._n)
        else:  # 3.10's
            tls.data_received(bytes(self._buf[: self._n]))

    def _start_tls_data(self) -> None:
        """A TLS data connection: the event loop stops reading it, and a thread runs the
        handshake and reads the ticket on a blocking TLS socket over a duplicate of its
        descriptor (the send thread then writes through that socket: OpenSSL encrypts
        straight from the KV, no copy on the event loop). Bounded by the guard's deadline."""
        assert self.transport is not None and self.identity is not None
        peer = self.transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else None
        if self.guard.handshakes(address) >= self.tickets.waiting_for(address):
            # Nobody there was admitted (or each admitted one already has its handshake):
            # a stranger starts no thread here.
            log.info("refused a TLS data connection from %s: no ticket waits for it", address)
            self.transport.abort()
            return
        self.transport.pause_reading()
        raw = self.transport.get_extra_info("socket")
        sock = socket.socket(fileno=os.dup(raw.fileno()))
        sock.settimeout(self.guard.deadline)
        self.guard.handshake_started(self.transport, sock)
        loop = asyncio.get_running_loop()
        context = self.identity.context

        def handshake() -> None:
            try:
                tls = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                tls.do_handshake()
                ticket = bytearray()
                while len(ticket) < TICKET.size:
                    chunk = tls.recv(TICKET.size - len(ticket))
                    if not chunk:
                        raise ConnectionError("closed before its ticket")
                    ticket += chunk
            except (OSError, ValueError) as exc:  # ssl.SSLError, a timeout, a reset
                sock.close()
                loop.call_soon_threadsafe(self._tls_failed, exc)
                return
            loop.call_soon_threadsafe(self._tls_ready, tls, bytes(ticket))

        threading.Thread(target=handshake, name="kv-tls-accept", daemon=True).start()

    def _tls_failed(self, exc: BaseException) -> None:
        if self.transport is not None:
            self.guard.handshake_done(self.transport)
        log.info("refused a data connection: TLS handshake failed (%s)", exc)
        if self.transport is not None:
            self.transport.abort()

    def _tls_ready(self, tls: ssl.SSLSocket, ticket: bytes) -> None:
        if self.transport is not None:
            self.guard.handshake_done(self.transport)
        if self.transport is None or self.transport.is_closing():  # the guard gave up on it
            tls.close()
            return
        self.transport.resume_reading()  # only to notice the receiver leaving
        self._redeem(ticket, tls=True, sock=tls)

    def _redeem(self, raw: bytes, *, tls: bool, sock: ssl.SSLSocket | None = None) -> None:
        assert self.transport is not None
        self.guard.identified(self.transport)
        magic, version, value = TICKET.unpack(raw)
        peer = self.transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else None
        ok = magic == TICKET_MAGIC and version == PROTOCOL_VERSION
        ticket = self.tickets.redeem(value, address, tls) if ok else None
        if ticket is None or ticket.future.done():
            log.info("refused a data connection: %s", "unknown or used ticket" if ok
                     else f"protocol version {version}")  # fmt: skip
            if sock is not None:
                sock.close()
            self.transport.abort()
            return
        self.conn = DataConnection(self.transport, sock)
        ticket.future.set_result(self.conn)

    def eof_received(self) -> bool:
        if self.conn is not None:
            self.conn.peer_left("the receiver closed the KV stream")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.guard.identified(self.transport)  # gone: nothing to watch any more
        if self.conn is not None:
            self.conn.peer_left(f"the KV stream was lost ({exc or 'closed'})")


class Listener:
    """An aiohttp app and the KV data connections, served on one TCP port."""

    def __init__(self, app: web.Application, tickets: Tickets, *, sniff_timeout: float = 30.0,
                 shutdown_timeout: float = 5.0, keepalive: float = KEEPALIVE_S,
                 guard: Guard | None = None, identity: Identity | None = None):  # fmt: skip
        # `sniff_timeout`: how long a connection may take to send a whole HTTP request's
        # head or its ticket; `keepalive`: how long an idle HTTP connection stays open.
        per_address, total = stranger_caps()
        self.guard = guard or Guard(sniff_timeout, per_address=per_address, total=total)
        app.middlewares.append(self._identify)  # a whole request arrived: not a stranger
        self.runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout,
                                    keepalive_timeout=keepalive)  # fmt: skip
        self.tickets = tickets
        self.identity = identity  # the node's TLS certificate; None: cleartext only
        self.server: Acceptor | None = None
        self._sniffers: weakref.WeakSet[Sniffer] = weakref.WeakSet()

    @web.middleware
    async def _identify(self, request: web.Request, handler):
        if request.transport is not None:
            self.guard.identified(request.transport)
        return await handler(request)

    def _sniffer(self, http: Callable[[], asyncio.Protocol]) -> Sniffer:
        sniffer = Sniffer(http, self.tickets, self.guard, self.identity)
        self._sniffers.add(sniffer)
        return sniffer

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (useful with port 0)."""
        await self.runner.setup()
        http = self.runner.server
        assert http is not None
        self.server = Acceptor(lambda: self._sniffer(http))
        return await self.server.start(host, port)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        await self.runner.cleanup()  # ends HTTP connections; handlers end their KV streams
        for sniffer in list(self._sniffers):  # connections that never said what they were
            if sniffer.conn is None and sniffer.transport is not None:
                sniffer.transport.abort()


# ---- sending -----------------------------------------------------------------------------

Done = Callable[[float, float, bool], None]  # (send_start, sent, ok): a LAYER frame's fate


class FrameSender:
    """Writes frames in order to a data connection from two threads: `kv-crc` computes each
    LAYER frame's CRC (running at most `ahead` frames ahead of the wire), `kv-send` writes
    header + payload blocks with sendmsg. `put` and `put_layer` may be called from any one
    thread at a time and never wait for the network.

    A send that fails or times out (the receiver left or stopped reading for `timeout`)
    calls `on_error` once; every frame not yet sent is then dropped, its `done` called with
    ok=False so its memory can go."""

    def __init__(self, sock: socket.socket, *, on_error: Callable[[BaseException], None],
                 ahead: int = 2):  # fmt: skip
        self.sock, self.on_error = sock, on_error
        self._tls = isinstance(sock, ssl.SSLSocket)  # no sendmsg: sendall, part by part
        self.error: BaseException | None = None
        self.bytes_sent = 0
        self._crc_q: queue.SimpleQueue = queue.SimpleQueue()
        self._send_q: queue.Queue = queue.Queue(maxsize=ahead)
        self._threads = [
            threading.Thread(target=self._crc_stage, name="kv-crc-tx", daemon=True),
            threading.Thread(target=self._send_stage, name="kv-send", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def put(self, parts: list[Buffer]) -> None:
        """A complete frame (header and payload), e.g. wire.encode_hello(...)."""
        self._crc_q.put(("frame", parts, None))

    def put_layer(self, layer: int, token_start: int, n_tokens: int, dtype: WireDtype,
                  blocks: Sequence[memoryview], done: Done | None = None,
                  heads: tuple[int, int] | None = None) -> None:  # fmt: skip
        """A LAYER frame from `blocks` (views, not copies: keep them unchanged until `done`);
        `heads`: the head range it carries (wire.HEADS), None: all heads."""
        self._crc_q.put(("layer", (layer, token_start, n_tokens, dtype, blocks, heads), done))

    async def flush(self) -> None:
        """Wait until every frame put so far is on the wire; raise the send error if any."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._crc_q.put(("flush", fut, None))
        await asyncio.wrap_future(fut)

    def close(self, *, abort: bool = False) -> None:
        """Stop both threads (after the frames put so far, unless `abort`) and close this
        side's descriptor."""
        if abort:
            self._fail(ConnectionAbortedError("the KV stream was closed"), notify=False)
            with contextlib.suppress(OSError):  # wakes a send blocked on the peer (the
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # socket's, not TLS's)
        self._crc_q.put(("stop", None, None))
        for t in self._threads:
            t.join(timeout=30)
        self.sock.close()

    def _crc_stage(self) -> None:
        while True:
            op, arg, done = item = self._crc_q.get()
            if op in ("layer", "frame"):
                parts = None  # dropped if the stream has failed
                if self.error is None:
                    try:
                        # over TLS: CRC 0, TLS authenticates the frame (decoder.NoCrc)
                        parts = (
                            layer_frame(*arg[:5], 0 if self._tls else None, arg[5])
                            if op == "layer"
                            else arg
                        )
                    except Exception as exc:  # a frame that cannot be encoded
                        parts = None
                        self._fail(exc)
                item = ("frame", parts, done)
            self._send_q.put(item)
            if op == "stop":
                return

    def _send_stage(self) -> None:
        while True:
            op, arg, done = self._send_q.get()
            if op == "stop":
                return
            if op == "flush":
                if self.error is None:
                    arg.set_result(None)
                else:
                    arg.set_exception(self.error)
                continue
            start = clock()
            ok = False
            if arg is not None and self.error is None:
                try:
                    self._sendmsg_all(arg)
                    ok = True
                except OSError as exc:  # TimeoutError, BrokenPipeError, ConnectionResetError
                    self._fail(exc)
            if done is not None:
                try:
                    done(start, clock(), ok)
                except Exception:  # bookkeeping must not stop the sender
                    log.exception("a sent frame's callback failed")

    def _sendmsg_all(self, parts: list[Buffer]) -> None:
        bufs = [memoryview(p).cast("B") for p in parts if len(p)]
        if self._tls:
            for buf in bufs:
                self.sock.sendall(buf)
                self.bytes_sent += len(buf)
            return
        while bufs:
            n = self.sock.sendmsg(bufs[:IOV_MAX])
            self.bytes_sent += n
            while n:
                if n >= len(bufs[0]):
                    n -= len(bufs.pop(0))
                else:
                    bufs[0] = bufs[0][n:]
                    n = 0

    def _fail(self, exc: BaseException, notify: bool = True) -> None:
        if self.error is None:
            self.error = exc
            if notify:
                self.on_error(exc)
