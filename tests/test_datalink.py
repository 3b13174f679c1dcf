"""The KV data connection end to end in this process, with a fake backend where a real one
would be slow: one port for HTTP and KV streams, tickets, the prefill node's bytes in flight,
pieces cut into bounded frames (and assembled across parts), an END of 8,192 pieces, and the
receiver writing straight into a cache-shaped destination.

The real backends and node processes are in test_reliability*.py, test_node.py, test_load.py
and test_memory.py; these tests pin the transport's own rules with nothing else in the way.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
import pytest
from fakes import fake_identity
from nodes import TOKEN

from exo_split import PROTOCOL_VERSION
from exo_split.backends.base import Cancelled, Prefilled
from exo_split.errors import ProtocolError
from exo_split.kv import LayerKV, chunk_sizes, storage_dtype
from exo_split.node import prefill as prefill_module
from exo_split.node.prefill import Progress, stream_prefill
from exo_split.node.routes import NodeState, make_app
from exo_split.spec import ModelSpec
from exo_split.transport import wire
from exo_split.transport.client import Timeouts, kv_stream
from exo_split.transport.datalink import TICKET, TICKET_MAGIC, DataConnection, Listener
from exo_split.transport.limits import Limits
from exo_split.transport.messages import PrefillRequest
from exo_split.transport.server import ClientGone
from exo_split.transport.stamps import parse_end
from exo_split.transport.tls import secure_url

pytestmark = pytest.mark.timeout(120)
TIMEOUTS = Timeouts(connect=2.0, first_frame=10.0, idle=5.0, total=60.0)


class SourceBackend:
    """A prefill backend without a model: per (chunk, layer) piece, deterministic KV made
    from its position, handed over in `parts` consecutive token ranges (a staging ring
    smaller than a piece does that). Counts every `release`."""

    name, device = "fake", "cpu"

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, parts: int = 1,
                 dtype: str = "float16", delay: float = 0.0):  # fmt: skip
        self.spec = ModelSpec("llama", n_layers, n_kv_heads, n_kv_heads, head_dim, 64, 128, 512,
                              1e-5, 1e4, max_position_embeddings=65_536)  # fmt: skip
        self.dtype, self.parts, self.delay = dtype, parts, delay
        self.released = 0
        self.handed = 0

    @staticmethod
    def kv(layer: int, start: int, n: int, heads: int, dim: int, dtype=np.float16) -> np.ndarray:
        pos = np.arange(start, start + n, dtype=np.float32)[None, :, None]
        values = layer * 1000 + pos + np.arange(heads)[:, None, None] * 0.25
        return np.broadcast_to(values + np.arange(dim) * 0.01, (heads, n, dim)).astype(dtype)

    def _release(self) -> None:
        self.released += 1

    def prefill(self, token_ids, *, chunk=None, on_layer=None, should_stop=None, capacity=None):
        n, h, d = len(token_ids), self.spec.n_kv_heads, self.spec.head_dim
        for start, size in zip(np.cumsum((0, *chunk_sizes(n, chunk)))[:-1],
                               chunk_sizes(n, chunk), strict=True):  # fmt: skip
            for layer in range(self.spec.n_layers):
                if should_stop is not None and should_stop():
                    raise Cancelled(f"cancelled at layer {layer}")
                time.sleep(self.delay)
                bounds = np.linspace(start, start + size, self.parts + 1).astype(int)
                for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                    if b > a and on_layer is not None:
                        k = self.kv(layer, int(a), int(b - a), h, d, storage_dtype(self.dtype))
                        self.handed += 1
                        on_layer(LayerKV(layer, int(a), k, -k, self.dtype,
                                         release=self._release))  # fmt: skip
        logits = np.zeros(self.spec.vocab_size, np.float32)
        logits[7] = 1.0
        return Prefilled(cache=n, logits=logits)  # the "cache": how many positions it holds

    def stream_kv(self, cache, on_layer, *, chunk=None, should_stop=None):
        """After the prefill: each layer whole, in `parts` parts (as torch's staging does)."""
        self.prefill(range(cache), chunk=None, on_layer=on_layer, should_stop=should_stop)


class Cache:
    """The receiving side's destination: per layer K and V [heads, capacity, dims]."""

    def __init__(self, spec: ModelSpec, capacity: int):
        shape = (spec.n_kv_heads, capacity, spec.head_dim)
        self.k = [np.zeros(shape, np.float16) for _ in range(spec.n_layers)]
        self.v = [np.zeros(shape, np.float16) for _ in range(spec.n_layers)]

    def blocks(self, layer, start, n):
        return [memoryview(a[layer][h, start : start + n]).cast("B")
                for a in (self.k, self.v) for h in range(a[layer].shape[0])]  # fmt: skip


@contextlib.asynccontextmanager
async def prefill_node(backend, limits: Limits | None = None, timeouts: Timeouts = TIMEOUTS):
    executor = ThreadPoolExecutor(1)
    state = NodeState(
        node_id="fake", spec=backend.spec, backend=backend, executor=executor, token=TOKEN,
        limits=limits or Limits(), coordinator=None,
        info={"fingerprint": backend.spec.fingerprint}, timeouts=timeouts,
    )  # fmt: skip
    # TLS and cleartext, as a node started with --insecure-transport serves them: the KV
    # streams below go over TLS (as nodes talk by default), the raw probes in cleartext
    state.identity, state.insecure_transport = fake_identity(), True
    listener = Listener(make_app(state), state.tickets, shutdown_timeout=1.0,
                        identity=state.identity)  # fmt: skip
    port = await listener.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        await listener.stop()
        executor.shutdown()


def tls(url: str) -> str:
    return secure_url(url, True)


def body(spec: ModelSpec, n: int, **extra) -> dict:
    ids = tuple(3 + i % 500 for i in range(n))
    return PrefillRequest(request_id="t", token_ids=ids, spec=spec.to_dict(),
                          fingerprint=spec.fingerprint, **extra).to_json()  # fmt: skip


async def pull(url: str, spec: ModelSpec, n: int, dest, max_frame_bytes: int, **extra):
    stream_spec = wire.StreamSpec(spec.n_layers, spec.n_kv_heads, spec.head_dim,
                                  wire.WireDtype.float16, n, max_frame_bytes)  # fmt: skip
    frames = []
    async with aiohttp.ClientSession() as session:
        req = body(spec, n, max_frame_bytes=max_frame_bytes, **extra)
        async for frame in kv_stream(
            session, tls(url), TOKEN, req, stream_spec, TIMEOUTS, dest=dest
        ):
            frames.append(frame)
    return frames


def check_cache(cache: Cache, spec: ModelSpec, n: int) -> None:
    for layer in range(spec.n_layers):
        want = SourceBackend.kv(layer, 0, n, spec.n_kv_heads, spec.head_dim)
        assert np.array_equal(cache.k[layer][:, :n], want)
        assert np.array_equal(cache.v[layer][:, :n], -want)


# ---- one port: HTTP and KV streams ----------------------------------------------------------


def test_one_port_serves_http_and_refuses_unknown_tickets():
    backend = SourceBackend(2, 1, 4)

    async def run():
        async with prefill_node(backend) as (url, state), aiohttp.ClientSession() as s:
            async with s.get(f"{url}/v1/health") as resp:  # HTTP, sniffed and handed over
                assert resp.status == 200 and await resp.json() == {"ok": True}
            host, port = url.removeprefix("http://").split(":")
            outcomes = []
            for hello in (
                TICKET.pack(TICKET_MAGIC, PROTOCOL_VERSION, b"\1" * 32),  # never issued
                TICKET.pack(TICKET_MAGIC, PROTOCOL_VERSION + 1, b"\1" * 32),  # wrong version
            ):
                reader, writer = await asyncio.open_connection(host, int(port))
                for i in range(0, len(hello), 7):  # in pieces: the sniffer must not mind
                    writer.write(hello[i : i + 7])
                    await writer.drain()
                outcomes.append(await asyncio.wait_for(reader.read(), 5))
                writer.close()
            async with s.get(f"{url}/v1/health") as resp:  # still serving
                assert resp.status == 200
            return outcomes

    assert asyncio.run(run()) == [b"", b""]  # closed without a byte: nothing to learn


def test_an_unredeemed_ticket_expires_and_frees_the_request():
    backend = SourceBackend(2, 1, 4)
    timeouts = Timeouts(connect=0.3, first_frame=5.0, idle=5.0, total=10.0)

    async def run():
        async with (
            prefill_node(backend, timeouts=timeouts) as (url, state),
            aiohttp.ClientSession() as s,
        ):
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with s.post(f"{url}/v1/prefill", json=body(backend.spec, 16),
                              headers=headers) as resp:  # fmt: skip
                answer = await resp.json()
            assert resp.status == 200 and answer["protocol"] == PROTOCOL_VERSION
            assert state.ledger.held > 0 and state.busy["prefill"] == 1
            for _ in range(100):
                if state.stats.get("tickets_expired"):
                    break
                await asyncio.sleep(0.02)
            # the ticket cannot be used any more
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            ticket = bytes.fromhex(answer["ticket"])
            writer.write(TICKET.pack(TICKET_MAGIC, PROTOCOL_VERSION, ticket))
            late = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return dict(state.stats), state.ledger.held, state.busy["prefill"], late

    stats, held, busy, late = asyncio.run(run())
    assert stats == {"tickets_expired": 1} and held == 0 and busy == 0 and late == b""
    assert backend.handed == 0  # no work was done


# ---- frames: bounded, assembled across parts, into the destination --------------------------


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_pieces_travel_as_bounded_frames_straight_into_the_cache(parts, overlap):
    """8 KV heads x 16 dims x float16 = 512 B a position; frames of at most 1,536 B = 3
    positions; chunks of 8 (or whole layers without overlap); pieces handed over in 3 uneven
    parts: every frame is the plan's, and the cache holds exactly the source's KV."""
    backend = SourceBackend(3, 8, 16, parts=parts)
    n, frame_bytes = 20, 3 * 512

    async def run():
        async with prefill_node(backend) as (url, state):
            cache = Cache(backend.spec, 32)
            frames = await pull(url, backend.spec, n, cache, frame_bytes, chunk=8,
                                overlap=overlap)  # fmt: skip
            return cache, frames, state

    cache, frames, state = asyncio.run(run())
    check_cache(cache, backend.spec, n)
    layers = [f for f in frames if f.kind is wire.Kind.LAYER]
    chunks = chunk_sizes(n, 8) if overlap else (n,)
    plan = wire.Plan(chunks, 3, 3)
    assert [(f.header.layer, f.header.token_start, f.header.n_tokens) for f in layers] == [
        (layer, s, m) for _, layer, s, m in plan.frames()
    ]
    assert all(f.header.payload_len <= frame_bytes for f in layers)
    assert sum(f.last for f in layers) == plan.n_pieces
    assert backend.released == backend.handed > 0
    assert state.ledger.held == 0 and state.stats["prefills"] == 1


def test_end_with_8192_pieces_arrives_and_is_accepted():
    """32 layers x 32,768 tokens in chunks of 128: 8,192 pieces (one KV head of 2 dims, so
    the KV itself is small). In protocol 1 END's JSON outgrew its 1 MiB cap here, after all
    the KV had been sent."""
    backend = SourceBackend(32, 1, 2)
    n = 32_768

    async def run():
        async with prefill_node(backend, Limits(max_prompt_tokens=n)) as (url, _):
            cache = Cache(backend.spec, n)
            return cache, await pull(url, backend.spec, n, cache, 1 << 20, chunk=128)

    cache, frames = asyncio.run(run())
    end = frames[-1]
    assert end.kind is wire.Kind.END
    stamps = parse_end(end.obj, 8192)
    assert all(len(v) == 8192 for v in stamps.values())
    assert all(a <= b for a, b in zip(stamps["send_start"], stamps["sent"], strict=True))
    assert end.header.payload_len < wire.MAX_JSON_PAYLOAD
    check_cache(cache, backend.spec, n)


# ---- the prefill node's memory: bytes in flight ---------------------------------------------


class _Watch(asyncio.Protocol):
    def __init__(self) -> None:
        self.conn: DataConnection | None = None

    def eof_received(self) -> bool:
        if self.conn is not None:
            self.conn.peer_left("closed")
        return False


async def _slow_pair(reader) -> tuple[DataConnection, threading.Thread]:
    """A socketpair with 16 KiB socket buffers: our end a DataConnection (told when the far
    end closes), the far end read by `reader(sock)` on a thread of its own (started)."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    for sock in (ours, theirs):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    thread = threading.Thread(target=reader, args=(theirs,))
    thread.start()
    watch = _Watch()
    transport, _ = await loop.connect_accepted_socket(lambda: watch, ours)
    watch.conn = DataConnection(transport)
    return watch.conn, thread


@pytest.mark.parametrize("convert", [True, False], ids=["converted copies", "views"])
def test_bytes_in_flight_are_bounded_while_the_receiver_is_slow(convert, monkeypatch):
    """16 pieces of 64 KiB, an in-flight limit of 128 KiB, socket buffers of 16 KiB, and a
    receiver that reads nothing until either the budget makes the compute thread wait or the
    compute is over. Pieces converted to the wire dtype (float32 -> float16) are our copies:
    the compute thread waits for the wire with at most the limit handed over, and has not
    finished. Pieces that are the backend's own memory (views of its cache) cost nothing more:
    the compute finishes while the receiver has read nothing. Every piece is released once
    its frames are sent. Nothing is timed: the events say who moved first."""
    backend = SourceBackend(4, 8, 32, dtype="float32" if convert else "float16")
    n, limit, piece = 256, 128 << 10, 64 << 10  # chunks of 64 positions of 1 KiB (float16)
    got = bytearray()
    go = threading.Event()  # the receiver may read
    first: dict = {}  # what let the receiver go, and where the compute was then

    def let_go(why: str) -> None:
        if not go.is_set():
            first.update(why=why, handed=backend.handed, received=len(got))
            go.set()

    class Watched(prefill_module.InFlight):
        def acquire(self, nbytes: int) -> None:
            if self.held and self.held + nbytes > self.limit:
                let_go("the budget made the compute wait")
            super().acquire(nbytes)

    monkeypatch.setattr(prefill_module, "InFlight", Watched)

    def reader(sock: socket.socket) -> None:
        go.wait(60)  # a guard against a hang, not a measurement: `first` says what happened
        sock.settimeout(10)
        while chunk := sock.recv(64 << 10):
            got.extend(chunk)

    async def run():
        conn, thread = await _slow_pair(reader)
        progress = Progress()
        req = PrefillRequest(request_id="t", token_ids=tuple(range(n)), chunk=64,
                             dtype="float16")  # fmt: skip
        prefill = backend.prefill

        def prefill_then_let_go(*a, **kw):
            done = prefill(*a, **kw)
            let_go("the compute finished")
            return done

        backend.prefill = prefill_then_let_go
        try:
            with ThreadPoolExecutor(1) as executor:
                await stream_prefill(backend, executor, req, conn, hello={}, timeout=30.0,
                                     inflight_bytes=limit, progress=progress)  # fmt: skip
        finally:
            go.set()
        conn.close()
        await asyncio.to_thread(thread.join, 30)
        return progress

    progress = asyncio.run(run())
    assert backend.handed == 16 and backend.released == 16
    assert progress.sent == 16
    assert len(got) > 16 * piece  # everything went, frames and all
    assert first["received"] == 0
    if convert:
        assert first["why"] == "the budget made the compute wait"
        assert first["handed"] < 16  # it waited before the last piece, not after it
        assert piece <= progress.inflight_peak <= limit, progress.inflight_peak
    else:
        assert first == {"why": "the compute finished", "handed": 16, "received": 0}
        assert progress.inflight_peak == 0


def test_a_receiver_that_leaves_stops_the_prefill_and_frees_every_piece():
    backend = SourceBackend(8, 8, 32, delay=0.02)
    n = 512

    async def run():
        async with prefill_node(backend) as (url, state):
            spec = wire.StreamSpec(8, 8, 32, wire.WireDtype.float16, n)
            async with aiohttp.ClientSession() as session:
                stream = kv_stream(session, tls(url), TOKEN, body(backend.spec, n, chunk=64), spec,
                                   TIMEOUTS)  # fmt: skip
                async with contextlib.aclosing(stream):
                    async for frame in stream:
                        if frame.kind is wire.Kind.LAYER and frame.header.layer == 2:
                            break  # the decode node goes away
            for _ in range(200):
                if state.stats.get("prefills_cancelled"):
                    break
                await asyncio.sleep(0.02)
            return dict(state.stats), state.ledger.held

    stats, held = asyncio.run(run())
    assert stats["prefills_cancelled"] == 1 and held == 0
    cancel = stats["last_cancel"]
    assert cancel["pieces_computed"] - cancel["pieces_at_cancel"] <= 1
    assert cancel["pieces_computed"] < cancel["pieces_total"]
    assert backend.released == backend.handed  # nothing stranded


def test_a_peer_that_answers_the_data_connection_with_http_is_refused():
    """A plain HTTP server (say, a node of protocol 1 behind a proxy) answers 200 with a
    ticket-shaped body but reads the data connection as HTTP: its reply is not a frame."""

    async def run():
        async def answer(request):
            return aiohttp.web.json_response({"protocol": PROTOCOL_VERSION, "ticket": "00" * 32})

        async def hello(request):  # it holds the token: the data connection is what fails
            from exo_split.transport.auth import new_nonce, server_proof

            ns = new_nonce()
            proof = server_proof(TOKEN, request.query["nonce"], ns)
            return aiohttp.web.json_response({"nonce": ns, "proof": proof})

        app = aiohttp.web.Application()
        app.router.add_post("/v1/prefill", answer)
        app.router.add_get("/v1/hello", hello)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        spec = wire.StreamSpec(2, 1, 4, wire.WireDtype.float16, 4)
        try:
            async with aiohttp.ClientSession() as session:
                stream = kv_stream(session, f"http://127.0.0.1:{port}", TOKEN, {}, spec, TIMEOUTS)
                async for _ in stream:
                    pass
        finally:
            await runner.cleanup()

    with pytest.raises(ProtocolError, match="bad magic: expected b'EXOS', got b'HTTP'"):
        asyncio.run(run())


def test_a_staging_ring_smaller_than_one_frame_still_streams(llama):
    """Issue 18, M2: the real torch backend copying into a ring of 3 slots of 16 positions
    (the GPU's path, on the CPU) while the decode side accepts 16 MiB frames. A frame waits
    for all its parts and each part holds a slot, so a 300-position frame used to wait for a
    slot its own parts held until the slot timeout. Frames are now capped at what the ring
    can fill (2 slots' worth) and the KV arrives whole, equal to the backend's own."""
    from exo_split.backends import load_backend

    backend = load_backend("torch", llama)
    spec, n = backend.spec, 300
    per = 2 * spec.n_kv_heads * spec.head_dim * 4
    backend.set_staging(3 * 16 * per, 3, copy=True)
    backend.slot_timeout = 5.0  # a stall fails in seconds, not the default 10 minutes
    assert backend.frame_positions_limit() == 32

    class Dest:
        k = [
            np.zeros((spec.n_kv_heads, n, spec.head_dim), np.float32) for _ in range(spec.n_layers)
        ]
        v = [
            np.zeros((spec.n_kv_heads, n, spec.head_dim), np.float32) for _ in range(spec.n_layers)
        ]

        def blocks(self, layer, start, m):
            return [memoryview(a[layer][h, start : start + m]).cast("B")
                    for a in (self.k, self.v) for h in range(spec.n_kv_heads)]  # fmt: skip

    async def run():
        async with prefill_node(backend) as (url, state):
            stream = wire.StreamSpec(spec.n_layers, spec.n_kv_heads, spec.head_dim,
                                     wire.WireDtype.float32, n, 16 << 20)  # fmt: skip
            req = body(spec, n, max_frame_bytes=16 << 20)
            async with aiohttp.ClientSession() as session:
                return [f async for f in kv_stream(session, tls(url), TOKEN, req, stream, TIMEOUTS,
                                                   dest=dest)]  # fmt: skip

    dest = Dest()
    frames = asyncio.run(run())
    layers = [f for f in frames if f.kind is wire.Kind.LAYER]
    assert frames[-1].kind is wire.Kind.END and max(f.header.n_tokens for f in layers) == 32
    ids = [3 + i % 500 for i in range(n)]
    alone = load_backend("torch", llama)
    for kv in alone.export(alone.prefill(ids).cache):
        np.testing.assert_array_equal(dest.k[kv.layer], kv.k[:, :n])
        np.testing.assert_array_equal(dest.v[kv.layer], kv.v[:, :n])
    assert backend.ring.in_use == 0


def test_a_copying_ring_needs_two_slots(llama):
    from exo_split.backends import load_backend
    from exo_split.errors import ExoSplitError

    with pytest.raises(ExoSplitError, match="needs at least 2"):
        load_backend("torch", llama).set_staging(1 << 20, 1, copy=True)


def test_a_receiver_gone_before_the_stream_takes_no_prefix_entry(llama):
    """Issue 18, L5: a data connection that closed between its ticket and the stream (its
    descriptor already -1) used to fail after the prefix checkout: a taken entry was lost and
    a copied one stayed pinned, never evictable. Now the socket comes first: ClientGone, and
    the entry is still there, unpinned."""
    from exo_split.backends import load_backend
    from exo_split.node.prefix import PrefixCache
    from exo_split.transport.server import ClientGone

    backend = load_backend("torch", llama)
    prefix = PrefixCache(backend, limit_bytes=1 << 30)
    ids = [3 + i % 500 for i in range(64)]
    prefix.put(ids, backend.prefill(ids).cache)

    class Closed:  # a DataConnection whose transport has gone
        lost = threading.Event()
        on_lost: list = []

        def socket(self, timeout):
            raise ConnectionAbortedError("the data connection closed before the stream began")

    req = PrefillRequest(request_id="t", token_ids=(*ids, 9, 9, 9))
    with ThreadPoolExecutor(1) as executor, pytest.raises(ClientGone, match="left before"):
        asyncio.run(stream_prefill(backend, executor, req, Closed(), hello={}, prefix=prefix))
    assert (
        len(prefix) == 1 and prefix._entries[0].pins == 0 and prefix._entries[0].cache is not None
    )
    assert prefix.checkout([*ids, 9, 9, 9]).how == "take"  # still there to be taken


def test_a_closed_transport_gives_no_socket():
    from exo_split.transport.datalink import DataConnection

    class Transport:
        def get_extra_info(self, name):
            return None  # what asyncio answers once the socket is gone

        def is_closing(self):
            return True

    with pytest.raises(ConnectionAbortedError, match="closed before the stream began"):
        DataConnection(Transport()).socket(1.0)


def test_a_ticket_is_redeemed_only_from_the_address_that_asked_for_it():
    """Issue 18, L8: a ticket read off the wire is no use from another address, and such an
    attempt does not burn it for its owner."""
    from exo_split.transport.datalink import Tickets

    async def run():
        tickets = Tickets()
        t = tickets.issue("10.0.0.7")
        assert tickets.redeem(t.value, "10.0.0.99") is None
        assert tickets.redeem(t.value, None) is None
        assert len(tickets) == 1
        assert tickets.redeem(t.value, "10.0.0.7") is t and len(tickets) == 0
        assert tickets.redeem(t.value, "10.0.0.7") is None  # single use

    asyncio.run(run())


def test_a_probe_reader_that_stops_reading_is_cut_off(monkeypatch):
    """Issue 18, L8: GET /v1/probe of 64 MiB read by nobody ends within its write timeout
    (here 1 s) instead of holding the handler for as long as the reader likes."""
    from exo_split.transport import server

    monkeypatch.setattr(server, "PROBE_WRITE_TIMEOUT_S", 1.0)
    backend = SourceBackend(2, 1, 4)

    async def run():
        async with prefill_node(backend) as (url, state):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"GET /v1/probe?bytes={64 << 20} HTTP/1.1\r\nHost: x\r\n"
                         f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())  # fmt: skip
            await writer.drain()
            await asyncio.sleep(3)  # read nothing meanwhile: the socket buffers fill
            got = 0
            while chunk := await asyncio.wait_for(reader.read(1 << 20), 10):
                got += len(chunk)
            writer.close()
            async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/health") as resp:
                return got, resp.status

    got, status = asyncio.run(run())
    assert got < 64 << 20 and status == 200  # cut off, and the node serves on


def _ring_stream(llama, n, reader, *, deadline=600.0, slot_timeout=30.0, during=None,
                 ended=None):  # fmt: skip
    """stream_prefill with the real torch backend copying into a ring of 2 slots of 16
    positions (the GPU's path, on the CPU), over a socketpair with 16 KiB buffers whose far
    end `reader(sock)` reads. `during(executor)` runs once the prefill is submitted;
    `ended()` once the stream has ended, before the reader's thread is joined."""
    from exo_split.backends import load_backend

    backend = load_backend("torch", llama)
    spec = backend.spec
    backend.set_staging(2 * 16 * 2 * spec.n_kv_heads * spec.head_dim * 4, 2, copy=True)
    backend.slot_timeout = slot_timeout

    async def run():
        conn, thread = await _slow_pair(reader)
        req = PrefillRequest(request_id="t", token_ids=tuple(3 + i % 500 for i in range(n)))
        try:
            with ThreadPoolExecutor(1) as executor:
                streaming = asyncio.ensure_future(stream_prefill(
                    backend, executor, req, conn, hello={}, timeout=30.0, deadline=deadline))  # fmt: skip
                if during is not None:
                    await asyncio.sleep(0)  # the prefill's job is queued first
                    during(executor)
                try:
                    return await streaming, backend
                finally:
                    conn.close()
        finally:
            if ended is not None:
                ended()
            await asyncio.to_thread(thread.join, 60)

    return asyncio.run(run())


def test_the_prefill_nodes_compute_thread_is_free_while_the_receiver_reads_slowly(llama):
    """Issue 19: the forward ends, then the ring's stager still waits for the wire. The
    compute thread does not wait with it: a job queued behind the prefill runs while the
    receiver has read nothing (it reads only once that job ran), and the stream then arrives
    whole (an END and every layer's bytes)."""
    ran = threading.Event()
    got = bytearray()
    seen = {}

    def reader(sock):
        ran.wait(20)  # a guard against a hang: `seen` says what happened
        seen["received_when_the_job_ran"] = len(got)
        seen["job_ran"] = ran.is_set()
        sock.settimeout(30)
        while chunk := sock.recv(64 << 10):
            got.extend(chunk)

    end, backend = _ring_stream(llama, 300, reader, during=lambda ex: ex.submit(ran.set))
    assert seen == {"received_when_the_job_ran": 0, "job_ran": True}
    spec = backend.spec
    kv = 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * 4 * 300
    assert len(got) > kv and end["prefill_end"] >= end["prefill_start"]
    assert backend.ring.in_use == 0


def test_a_receiver_that_never_takes_the_stream_is_cut_off_at_the_total_deadline(llama):
    """A receiver that reads nothing at all (its socket open): the whole stream's deadline
    ends the request with ClientGone naming it, well before the slot timeout, and the ring
    is whole again."""
    stop = threading.Event()

    def reader(sock):
        stop.wait(120)  # reads nothing, holds the socket open
        sock.close()

    with pytest.raises(ClientGone, match="had not taken the whole stream 1 s after it began"):
        try:
            _ring_stream(llama, 300, reader, deadline=1.0, slot_timeout=300.0, ended=stop.set)
        finally:
            stop.set()
