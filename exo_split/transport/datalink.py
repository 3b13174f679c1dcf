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
import collections
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
from typing import Any

from aiohttp import web

from exo_split import PROTOCOL_VERSION
from exo_split.transport.tls import (
    DATA_TLS_MAGIC,
    TLS_RECORD,
    Identity,
    ServerHandshake,
    TlsSender,
)
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

    def discard(self, ticket: Ticket) -> None:
        self._open.pop(hashlib.sha256(ticket.value).digest(), None)

    def __len__(self) -> int:
        return len(self._open)


class DataConnection:
    """A redeemed data connection, as the prefill handler sees it. The event loop keeps
    reading it only to notice the receiver leaving (`lost`); the sender writes through
    `socket()`, a duplicate of the descriptor for a blocking thread."""

    def __init__(self, transport: asyncio.Transport, tls: ServerHandshake | None = None):
        self.transport = transport
        self.tls = tls  # a TLS data connection: its SSL object, the send thread's from here
        self.lost = asyncio.Event()
        self.why = ""
        self.on_lost: list[Callable[[], None]] = []

    def socket(self, timeout: float) -> socket.socket | TlsSender:
        """A blocking socket of our own (a dup) for the send threads; over TLS, one that
        encrypts (`TlsSender`). ConnectionError when the connection closed before we got
        here (its descriptor is then -1)."""
        raw = self.transport.get_extra_info("socket")
        fd = raw.fileno() if raw is not None else -1
        if fd < 0 or self.transport.is_closing():
            raise ConnectionAbortedError("the data connection closed before the stream began")
        sock = socket.socket(fileno=os.dup(fd))
        sock.settimeout(timeout)
        if self.tls is not None:
            return TlsSender(sock, self.tls.sslobj, self.tls.outgoing)
        return sock

    def write(self, data: bytes) -> None:
        """Send `data` from the event loop (tests' fake peers; nodes send with `socket`)."""
        if self.tls is not None:
            self.tls.sslobj.write(data)
            data = self.tls.outgoing.read()
        self.transport.write(data)

    def peer_left(self, why: str) -> None:
        if not self.lost.is_set():
            self.why = why
            self.lost.set()
            for callback in self.on_lost:
                callback()

    def close(self) -> None:
        self.transport.close()

    async def finish(self, wait: float) -> None:
        """Close after the stream's last frame. Over TLS the receiver closes first (for at most
        `wait` s): a FIN that comes with records it has not read yet makes asyncio's TLS on
        the receiving side drop them (CPython 3.11-3.13 sslproto: its flush at EOF reads
        one buffer), and it reads into the cache a block at a time."""
        if self.tls is not None:
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(self.lost.wait(), wait)
        self.close()

    def abort(self) -> None:
        self.transport.abort()


class Sniffer(asyncio.BufferedProtocol):
    """The first protocol of every accepted connection. It reads at most 4 bytes to tell a
    data connection (TICKET_MAGIC) from HTTP; HTTP goes to aiohttp's protocol with those
    bytes, a data connection reads its ticket and goes to the handler waiting for it."""

    def __init__(self, http: Callable[[], asyncio.Protocol], tickets: Tickets,
                 guard: Guard, identity: Identity | None = None):  # fmt: skip
        self.http, self.tickets, self.guard = http, tickets, guard
        self.identity = identity  # None: no TLS on this port
        self.transport: asyncio.Transport | None = None
        self.conn: DataConnection | None = None
        self.handshake: ServerHandshake | None = None  # a TLS data connection's, until redeemed
        self._buf = bytearray(TICKET.size)
        self._n = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.guard.arrived(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.conn is not None:  # the receiver sends nothing after its ticket
            return memoryview(self._buf)
        if self.handshake is not None:
            return memoryview(self._tls_buf)
        want = len(TICKET_MAGIC) if self._n < len(TICKET_MAGIC) else TICKET.size
        return memoryview(self._buf)[self._n : want]

    def buffer_updated(self, nbytes: int) -> None:
        assert self.transport is not None
        if self.conn is not None:
            self.conn.peer_left("the receiver sent data on the KV stream")
            self.transport.abort()
            return
        if self.handshake is not None:
            self._tls_data(bytes(self._tls_buf[:nbytes]))
            return
        self._n += nbytes
        head = bytes(self._buf[: min(self._n, len(TICKET_MAGIC))])
        if head[:1] == bytes([TLS_RECORD]) and self.identity is not None:
            self._to_https()
        elif head == DATA_TLS_MAGIC and self.identity is not None:
            self.handshake = ServerHandshake(self.identity.context, TICKET.size)
            self._tls_buf = bytearray(16384)
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
        buf = tls.get_buffer(self._n)
        buf[: self._n] = self._buf[: self._n]
        tls.buffer_updated(self._n)

    def _tls_data(self, data: bytes) -> None:
        """A TLS data connection's handshake, then its ticket (inside TLS)."""
        assert self.transport is not None and self.handshake is not None
        try:
            out = self.handshake.feed(data)
        except ssl.SSLError as exc:
            log.info("refused a data connection: TLS handshake failed (%s)", exc.reason)
            self.transport.abort()
            return
        if out:
            self.transport.write(out)
        if self.handshake.complete:
            self._redeem(self.handshake.data[: TICKET.size], tls=True)

    def _redeem(self, raw: bytes, *, tls: bool) -> None:
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
            self.transport.abort()
            return
        self.conn = DataConnection(self.transport, self.handshake if tls else None)
        self.handshake = None
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

    def arrived(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        addr = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        same = [k for k, (a, _, _) in self._waiting.items() if a == addr]
        if len(same) >= self.per_address:
            self._close(same[0])
        if len(self._waiting) >= self.total:
            self._close(next(iter(self._waiting)))
        key = _key(transport)
        timer = asyncio.get_running_loop().call_later(self.deadline, self._close, key)
        self._waiting[key] = (addr, timer, transport)

    def identified(self, transport) -> None:
        entry = self._waiting.pop(_key(transport), None)
        if entry is not None:
            entry[1].cancel()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _close(self, key) -> None:
        entry = self._waiting.pop(key, None)
        if entry is None:
            return
        _, timer, transport = entry
        timer.cancel()
        if not transport.is_closing():
            self.closed += 1
            transport.abort()


def _key(transport) -> Any:
    sock = transport.get_extra_info("socket")
    return sock if sock is not None else transport


class Listener:
    """An aiohttp app and the KV data connections, served on one TCP port."""

    def __init__(self, app: web.Application, tickets: Tickets, *, sniff_timeout: float = 30.0,
                 shutdown_timeout: float = 5.0, keepalive: float = KEEPALIVE_S,
                 guard: Guard | None = None, identity: Identity | None = None):  # fmt: skip
        # `sniff_timeout`: how long a connection may take to send a whole HTTP request's
        # head or its ticket; `keepalive`: how long an idle HTTP connection stays open.
        self.guard = guard or Guard(sniff_timeout)
        app.middlewares.append(self._identify)  # a whole request arrived: not a stranger
        self.runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout,
                                    keepalive_timeout=keepalive)  # fmt: skip
        self.tickets = tickets
        self.identity = identity  # the node's TLS certificate; None: cleartext only
        self.server: asyncio.Server | None = None
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
        self.server = await asyncio.get_running_loop().create_server(
            lambda: self._sniffer(http), host, port,
            reuse_address=True, backlog=128,
        )  # fmt: skip
        return self.server.sockets[0].getsockname()[1]

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
                  blocks: Sequence[memoryview], done: Done | None = None) -> None:  # fmt: skip
        """A LAYER frame from `blocks` (views, not copies: keep them unchanged until `done`)."""
        self._crc_q.put(("layer", (layer, token_start, n_tokens, dtype, blocks), done))

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
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a sendmsg blocked on the peer
        self._crc_q.put(("stop", None, None))
        for t in self._threads:
            t.join(timeout=30)
        self.sock.close()

    def _crc_stage(self) -> None:
        while True:
            op, arg, done = item = self._crc_q.get()
            if op == "layer":
                item = ("frame", None, done)  # dropped if the stream has failed
                if self.error is None:
                    try:
                        item = ("frame", layer_frame(*arg), done)
                    except Exception as exc:  # a frame that cannot be encoded fails the stream
                        self._fail(exc)
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
