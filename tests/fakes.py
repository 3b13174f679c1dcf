"""Misbehaving prefill peers for reliability tests, and the mutations of a frame stream.

`FakePrefillPeer` is a server on 127.0.0.1, in a thread of the test process, that speaks the
node's control plane (aiohttp, POST /v1/prefill answered with a ticket) and data plane (the
KV data connection on the same port, transport/datalink.py) and does what its current `plan`
says: forward to a real prefill node and record the bytes (`proxy`), replay bytes on the data
connection and then close, cut, reset or stall (`replay`), answer with a status (`status`),
never answer (`hang`), or hand out a ticket it never honours (`bad_ticket`). A real prefill
node (a separate process) is what the decode node talks to in the kill tests; the fake is for
what a real node would not do on purpose.

`mutate_stream` is the one mutation engine behind both the in-process 50,000-frame run and the
streams sent to a live decode node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import threading
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from nodes import TOKEN, open_kv_stream

from exo_split import PROTOCOL_VERSION
from exo_split.transport import wire
from exo_split.transport.auth import Nonces, client_proof, parse_proof, server_proof
from exo_split.transport.datalink import DataConnection, Listener, Tickets
from exo_split.transport.server import over_tls
from exo_split.transport.tls import load_identity

TICKETS = web.AppKey("tickets", Tickets)

# ---- the fake peer -------------------------------------------------------------------------


def fake_identity():
    """A TLS certificate of the fakes' own (made once per test session, in its temp dir)."""
    import tempfile
    from pathlib import Path

    global _IDENTITY
    if _IDENTITY is None:
        _IDENTITY = load_identity(Path(tempfile.mkdtemp(prefix="exo-split-fake-tls-")))[0]
    return _IDENTITY


_IDENTITY = None


@dataclass
class Served:
    """What the fake saw of one request."""

    body: dict
    sent: int = 0  # bytes written
    closed_by_client: float | None = None  # loop time the client hung up (stall plans)
    started: float = 0.0


class FakePrefillPeer:
    def __init__(self, token: str = TOKEN):
        self.token = token
        self.identity = fake_identity()
        self.nonces = Nonces()
        self.plans: deque[Callable] = deque()  # one per request, in order; else `default`
        self.default: Callable | None = None
        self.served: list[Served] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._listener: Listener | None = None
        self.port = self._call(self._start())

    def _call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_get("/v1/hello", self._hello)
        app.router.add_post("/v1/prefill", self._prefill)
        app[TICKETS] = Tickets()
        self._listener = Listener(app, app[TICKETS], shutdown_timeout=0.5,
                                  identity=self.identity)  # fmt: skip
        return await self._listener.start("127.0.0.1", 0)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._listener.stop(), timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _hello(self, request: web.Request) -> web.Response:
        """The peer proof a node gives (transport/auth.py): this fake holds the token."""
        nc, ns = request.query.get("nonce", ""), self.nonces.issue()
        cert = self.identity.fingerprint if over_tls(request) else ""
        proof = server_proof(self.token, nc, ns, cert)
        return web.json_response({"nonce": ns, "cert": cert, "proof": proof})

    async def _authorized(self, request: web.Request) -> bool:
        proof = parse_proof(request.headers.get("Authorization"))
        if proof is None:
            return request.headers.get("Authorization") == f"Bearer {self.token}"
        body = await request.read()
        want = client_proof(self.token, proof["nc"], proof["ns"], request.method,
                            request.raw_path, body)  # fmt: skip
        return self.nonces.take(proof["ns"]) and proof["mac"] == want

    async def _prefill(self, request: web.Request) -> web.StreamResponse:
        if not await self._authorized(request):
            return web.json_response({"code": "unauthorized", "message": "no"}, status=401)
        served = Served(await request.json(), started=asyncio.get_running_loop().time())
        self.served.append(served)
        plan = self.plans.popleft() if self.plans else self.default
        assert plan is not None, "the fake prefill peer has no plan"
        return await plan(request, served)


async def _admit(request: web.Request, ticket_hex: str | None = None):
    """Answer 200 with a ticket (or `ticket_hex`, which nobody issued), as a node does; then
    the data connection that redeems it, or None."""
    tickets = request.app[TICKETS]
    ticket = tickets.issue(tls=over_tls(request))
    answer = {"protocol": PROTOCOL_VERSION, "ticket": ticket_hex or ticket.hex, "expires_s": 10}
    resp = web.json_response(answer)
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    try:
        return resp, await asyncio.wait_for(asyncio.shield(ticket.future), 10)
    except (asyncio.TimeoutError, TimeoutError):
        return resp, None
    finally:
        tickets.discard(ticket)


async def _wait_for_hangup(conn: DataConnection, served: Served, limit: float = 60.0) -> None:
    with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
        await asyncio.wait_for(conn.lost.wait(), limit)
        served.closed_by_client = asyncio.get_running_loop().time()


def replay(
    data: bytes, *, upto: int | None = None, then: str = "close", piece: int = 65536
) -> Callable:
    """Send data[:upto] on the data connection; then "close" (clean end), "reset" (RST) or
    "stall" (keep the connection open, send nothing, until the client hangs up)."""

    async def plan(request: web.Request, served: Served) -> web.StreamResponse:
        resp, conn = await _admit(request)
        if conn is None:
            return resp
        out = data[:upto] if upto is not None else data
        for i in range(0, len(out), piece):
            if conn.lost.is_set():
                break
            await conn.send(out[i : i + piece])
            served.sent += len(out[i : i + piece])
            await asyncio.sleep(0)
        if then == "stall":
            await _wait_for_hangup(conn, served)
        elif then == "reset":
            await asyncio.sleep(0.05)
            sock = conn.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.abort()
            return resp
        if upto is None:
            await conn.finish(10)  # a whole stream ends as a node ends it
        else:
            conn.close()
        return resp

    return plan


def proxy(real_url: str, record: list[bytes]) -> Callable:
    """Forward the request to a real prefill node and its KV stream back as it comes; keep a
    copy."""

    async def plan(request: web.Request, served: Served) -> web.StreamResponse:
        resp, conn = await _admit(request)
        if conn is None:
            return resp
        # The client's proof is bound to this fake's nonce: the proxy speaks for itself. In
        # cleartext (the real node needs --insecure-transport): the record keeps real CRCs.
        code, reader, writer = await open_kv_stream(real_url, served.body, tls=False)
        assert code == 200, reader
        got = bytearray()
        while not _ends_with_end(got) and (chunk := await reader.read(65536)):
            got += chunk
            await conn.send(chunk)
        writer.close()
        record.append(bytes(got))
        await conn.finish(10)  # as a node ends a whole stream: after the receiver
        return resp

    return plan


def _ends_with_end(data: bytes) -> bool:
    """Whether `data` is whole frames, the last of them END (a node then waits for us)."""
    i, kind = 0, None
    while i + wire.HEADER_SIZE <= len(data):
        header = wire.FrameHeader.unpack(data[i : i + wire.HEADER_SIZE])
        i += wire.HEADER_SIZE + header.payload_len
        kind = header.kind
    return i == len(data) and kind is wire.Kind.END


def bad_ticket() -> Callable:
    """Answer 200 with a ticket this peer never issued: its data connection is refused."""

    async def plan(request: web.Request, served: Served) -> web.StreamResponse:
        resp, _ = await _admit(request, ticket_hex="ab" * 32)
        return resp

    return plan


def status(code: int, message: str = "", headers: dict | None = None) -> Callable:
    async def plan(request: web.Request, served: Served) -> web.Response:
        body = {"code": str(code), "message": message}
        return web.json_response(body, status=code, headers=headers or {})

    return plan


def hang() -> Callable:
    """Accept the request and never answer (no status line) until the client hangs up."""

    async def plan(request: web.Request, served: Served) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        while loop.time() < end:
            if request.transport is None or request.transport.is_closing():
                served.closed_by_client = loop.time()
                break
            await asyncio.sleep(0.01)
        return web.Response()

    return plan


@contextlib.contextmanager
def black_hole():
    """A 127.0.0.1 port whose accept queue is full: a connect there never completes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        fillers.append(s)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        for s in (*fillers, srv):
            s.close()


# ---- frame streams -------------------------------------------------------------------------


def split_frames(data: bytes) -> list[bytes]:
    """A valid stream cut into its frames (header + payload each)."""
    out, i = [], 0
    while i < len(data):
        header = wire.FrameHeader.unpack(data[i : i + wire.HEADER_SIZE])
        end = i + wire.HEADER_SIZE + header.payload_len
        out.append(data[i:end])
        i = end
    return out


def frame_offsets(data: bytes) -> list[tuple[wire.FrameHeader, int]]:
    """(header, offset of the frame) for each frame of a valid stream."""
    out, i = [], 0
    for frame in split_frames(data):
        out.append((wire.FrameHeader.unpack(frame), i))
        i += len(frame)
    return out


def with_crc(frame: bytes) -> bytes:
    """Recompute a frame's CRC (for edits that must get past the CRC check)."""
    header, payload = frame[: wire.HEADER_SIZE], frame[wire.HEADER_SIZE :]
    return header[:28] + struct.pack("<I", zlib.crc32(payload)) + payload


def replace_json(frame: bytes, edit: Callable[[dict], dict]) -> bytes:
    """A HELLO/END frame with its JSON edited, length and CRC made right again."""
    header = wire.FrameHeader.unpack(frame)
    obj = edit(json.loads(frame[wire.HEADER_SIZE :]))
    return wire.frame_bytes(wire._encode_json(header.kind, obj))


# Header fields: (offset, size) in the 32-byte header (wire.py's byte table).
FIELDS = {
    "magic": (0, 4),
    "version": (4, 1),
    "kind": (5, 1),
    "dtype": (6, 1),
    "flags": (7, 1),
    "layer": (8, 4),
    "token_start": (12, 4),
    "n_tokens": (16, 4),
    "payload_len": (20, 8),
    "crc32": (28, 4),
}
INTERESTING = (0, 1, 2, 3, 4, 5, 6, 0x7F, 0x80, 0xFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1,
               2**63, 2**64 - 1, 100 * 2**30)  # fmt: skip
OPS = ("flip", "byte", "field", "truncate", "extend", "duplicate", "drop", "swap", "garbage",
       "splice")  # fmt: skip


@dataclass
class Mutation:
    frame: int
    ops: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"frame {self.frame}: {', '.join(self.ops)}"


def mutate_stream(
    frames: list[bytes], rng: random.Random, n_ops: int = 0
) -> tuple[bytes, Mutation]:
    """Apply 1-3 mutations (or `n_ops`) to one randomly chosen frame of a valid stream."""
    frames = list(frames)
    i = rng.randrange(len(frames))
    m = Mutation(i)
    for _ in range(n_ops or rng.choice((1, 1, 1, 2, 3))):
        if not frames:
            break
        i = min(i, len(frames) - 1)
        frame = bytearray(frames[i])
        op = rng.choice(OPS)
        if op == "flip" and frame:
            pos = rng.randrange(
                min(len(frame), wire.HEADER_SIZE) if rng.random() < 0.5 else len(frame)
            )
            frame[pos] ^= 1 << rng.randrange(8)
            m.ops.append(f"flip bit at {pos}")
        elif op == "byte" and frame:
            pos = rng.randrange(len(frame))
            frame[pos] = rng.randrange(256)
            m.ops.append(f"byte {pos}={frame[pos]}")
        elif op == "field" and len(frame) >= wire.HEADER_SIZE:
            name = rng.choice(list(FIELDS))
            off, size = FIELDS[name]
            old = int.from_bytes(frame[off : off + size], "little")
            value = rng.choice((*INTERESTING, old + 1, old - 1, old ^ 1)) % (1 << (8 * size))
            frame[off : off + size] = value.to_bytes(size, "little")
            m.ops.append(f"{name}={value}")
        elif op == "truncate":
            cut = rng.randrange(len(frame) + 1)
            del frame[cut:]
            m.ops.append(f"truncate at {cut}")
        elif op == "extend":
            extra = rng.randbytes(rng.choice((1, 4, 31, 32, 33, 200)))
            frame += extra
            m.ops.append(f"extend by {len(extra)}")
        elif op == "duplicate":
            frames.insert(i, bytes(frame))
            m.ops.append("duplicate")
        elif op == "drop":
            del frames[i]
            m.ops.append("drop")
            continue
        elif op == "swap" and i + 1 < len(frames):
            frames[i], frames[i + 1] = frames[i + 1], bytes(frame)
            m.ops.append("swap with next")
            continue
        elif op == "garbage":
            frame = bytearray(rng.randbytes(rng.choice((0, 1, 16, 32, 64, 4096))))
            m.ops.append(f"garbage {len(frame)}")
        elif op == "splice":
            other = frames[rng.randrange(len(frames))]
            frame[: wire.HEADER_SIZE] = other[: wire.HEADER_SIZE]
            m.ops.append("splice another header")
        frames[i] = bytes(frame)
    return b"".join(frames), m
