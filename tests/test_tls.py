"""Node-to-node TLS (issue 18): what a machine between the nodes can read, alter or pretend.

A prefill node (torch, started with --insecure-transport so it serves TLS and cleartext) and
two decode nodes (MLX): one as users start it (TLS to peers), one with --insecure-transport
(the cleartext control arm). Between a decode node and the prefill node the tests put a relay
on 127.0.0.1 that forwards bytes and keeps a copy of both directions (a passive capture),
optionally flipping one byte (tampering); or a relay that terminates TLS with a certificate
of its own and speaks TLS to the real node (a machine that answers for the peer). Every
request's tokens are checked against transformers on the same weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
from dataclasses import dataclass, field

import pytest
from fakes import fake_identity, split_frames
from nodes import TOKEN, NodeProcess, generate_sync, request, running
from reference import prompt_ids, reference_generate

from exo_split.transport import wire
from exo_split.transport.datalink import Tickets
from exo_split.transport.tls import DATA_TLS_MAGIC, client_context

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

NEW = 6
IDS = prompt_ids(300, seed=18)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", num_hidden_layers=6)


@pytest.fixture(scope="module")
def nodes(ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("tls")
    started = {
        "prefill": NodeProcess(ckpt, "torch", work, "--insecure-transport"),
        "decode": NodeProcess(ckpt, "mlx", work),
        "plain": NodeProcess(ckpt, "mlx", work, "--insecure-transport"),
    }
    yield from running(started)


@pytest.fixture(scope="module")
def want(ckpt) -> list[int]:
    return reference_generate(ckpt, IDS, NEW)


# ---- relays --------------------------------------------------------------------------------


@dataclass
class Seen:
    """One relayed connection: what the client sent, what the server sent."""

    up: bytearray = field(default_factory=bytearray)
    down: bytearray = field(default_factory=bytearray)

    @property
    def data_tls(self) -> bool:
        return self.up[:4] == DATA_TLS_MAGIC


class Relay:
    """127.0.0.1:port -> the target's port, bytes forwarded as they come and kept. `flip`:
    (direction, offset, which) flips byte `offset` of that direction ("up" or "down") on
    connections for which which(seen) is true. `mitm`: terminate TLS with this context and
    speak TLS (unverified) to the target, keeping the plaintext."""

    def __init__(self, target_port: int, *, flip=None, mitm: ssl.SSLContext | None = None):
        self.target_port, self.flip, self.mitm = target_port, flip, mitm
        self.seen: list[Seen] = []
        self.flipped = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.mitm)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer) -> None:
        seen = Seen()
        self.seen.append(seen)
        try:
            up_r, up_w = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", self.target_port,
                                        ssl=client_context() if self.mitm else None), 10)  # fmt: skip
        except (OSError, asyncio.TimeoutError):
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_w, seen, "up"),
                             self._pipe(up_r, writer, seen, "down"), return_exceptions=True)  # fmt: skip

    async def _pipe(self, reader, writer, seen: Seen, direction: str) -> None:
        got = getattr(seen, direction)
        try:
            for _ in range(100_000):  # bounded: a request is a few hundred KB
                chunk = await asyncio.wait_for(reader.read(65536), 60)
                if not chunk:
                    break
                start = len(got)
                got += chunk
                chunk = self._tamper(seen, direction, start, bytearray(chunk))
                writer.write(chunk)
                await writer.drain()
        except (OSError, asyncio.TimeoutError, ssl.SSLError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def _tamper(self, seen: Seen, direction: str, start: int, chunk: bytearray) -> bytes:
        if self.flip is not None:
            where, offset, which = self.flip
            if where == direction and start <= offset < start + len(chunk) and which(seen):
                chunk[offset - start] ^= 0x40
                self.flipped += 1
        return bytes(chunk)

    def close(self) -> None:
        async def stop():
            self._server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def everything(self) -> bytes:
        return b"".join(bytes(s.up) + bytes(s.down) for s in self.seen)


@contextlib.contextmanager
def relay(port: int, **kw):
    r = Relay(port, **kw)
    try:
        yield r
    finally:
        r.close()


def _split(node, relay_: Relay) -> dict:
    body = {"token_ids": IDS, "max_tokens": NEW, "prefill_peer": relay_.addr,
            "prefix_cache": False}  # fmt: skip
    return generate_sync(node.url, body)


def _kv_sample(capture: Relay) -> bytes:
    """256 bytes from the middle of the first LAYER frame's payload of a cleartext stream."""
    data = next(s for s in capture.seen if s.up[:4] == b"EXOD")
    for frame in split_frames(bytes(data.down)):
        header = wire.FrameHeader.unpack(frame)
        if header.kind == wire.Kind.LAYER:
            mid = wire.HEADER_SIZE + header.payload_len // 2
            return frame[mid : mid + 256]
    raise AssertionError("no LAYER frame in the cleartext capture")


# ---- tests ---------------------------------------------------------------------------------


def test_a_passive_capture_holds_neither_token_nor_prompt_nor_kv(nodes, want):
    prefill = nodes["prefill"]
    prompt = json.dumps(IDS[:12])[1:-1].encode()  # how the prompt travels: JSON token ids
    # The control arm: the same request in cleartext shows the prompt and the KV on the wire.
    with relay(prefill.info["port"]) as plain:
        done = _split(nodes["plain"], plain)
    assert done["report"]["fallback"] is None and done["tokens"] == want
    sample = _kv_sample(plain)
    assert prompt in plain.everything() and sample in plain.everything()
    with relay(prefill.info["port"]) as tls:
        done = _split(nodes["decode"], tls)
    assert done["report"]["fallback"] is None and done["tokens"] == want
    assert any(s.data_tls for s in tls.seen), "the KV did not come over a TLS data connection"
    captured = tls.everything()
    assert len(captured) > done["report"]["kv_bytes"]  # the whole KV passed through the relay
    for secret in (TOKEN.encode(), prompt, sample, b"token_ids", b"/v1/prefill"):
        assert secret not in captured, secret[:40]


@pytest.mark.parametrize(
    "flip",
    [
        ("down", 4000, lambda s: s.data_tls),  # inside the KV stream, past the handshake
        ("up", 900, lambda s: not s.data_tls),  # inside a request (the POST's body)
    ],
    ids=["kv-stream", "control"],
)
def test_a_flipped_byte_fails_closed_and_the_request_runs_locally(nodes, want, flip):
    decode, prefill = nodes["decode"], nodes["prefill"]
    with relay(prefill.info["port"], flip=flip) as tampering:
        done = _split(decode, tampering)
    assert tampering.flipped >= 1
    assert done["report"]["fallback"] is not None  # the stream was refused, not trusted
    assert done["tokens"] == want  # and the reply is still right: prefilled locally
    # The node goes on: the next request, straight to the peer, runs split.
    again = generate_sync(decode.url, {"token_ids": IDS, "max_tokens": NEW,
                                       "prefill_peer": prefill.addr, "prefix_cache": False})  # fmt: skip
    assert again["report"]["fallback"] is None and again["tokens"] == want


def test_a_relay_with_its_own_certificate_gets_nothing_but_a_nonce(nodes, want):
    """It relays GET /v1/hello to the real node (whose proof covers the real certificate);
    the decode node then pins the POST to that certificate, which the relay cannot show."""
    mitm = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    mitm.load_cert_chain(fake_identity().path)
    with relay(nodes["prefill"].info["port"], mitm=mitm) as rogue:
        done = _split(nodes["decode"], rogue)
    assert done["tokens"] == want
    assert "certificate" in (done["report"]["fallback"] or ""), done["report"]["fallback"]
    heard = rogue.everything()
    assert b"GET /v1/hello?nonce=" in heard
    assert b"POST" not in heard and json.dumps(IDS[:12])[1:-1].encode() not in heard


def test_info_names_the_certificate_and_how_the_node_reaches_its_peers(nodes):
    cert = nodes["decode"].log().split("sha256 ")[1][:16]
    decode, plain = nodes["decode"].info["tls"], nodes["plain"].info["tls"]
    assert decode["cert_sha256"].startswith(cert) and decode["to_peers"] is True
    assert plain["to_peers"] is False and plain["cert_sha256"] == decode["cert_sha256"]


def test_a_node_serves_prefill_over_tls_only_unless_told(nodes):
    body = {"token_ids": [1, 2, 3]}
    code, raw, _ = asyncio.run(request("POST", f"{nodes['decode'].url}/v1/prefill", json=body))
    assert code == 403 and json.loads(raw)["code"] == "tls_required"
    assert "--insecure-transport" in json.loads(raw)["message"]
    # --insecure-transport: the same request gets as far as checking its body
    code, raw, _ = asyncio.run(request("POST", f"{nodes['plain'].url}/v1/prefill", json=body))
    assert code == 409 and "fingerprint" in json.loads(raw)["message"], raw


def test_a_ticket_asked_for_over_tls_is_refused_in_cleartext():
    async def run():
        tickets = Tickets()
        ticket = tickets.issue("127.0.0.1", tls=True)
        assert tickets.redeem(ticket.value, "127.0.0.1", tls=False) is None  # and stays open
        assert tickets.redeem(ticket.value, "127.0.0.1", tls=True) is ticket
        assert tickets.redeem(ticket.value, "127.0.0.1", tls=True) is None  # used up

    asyncio.run(run())


def test_the_openai_client_reaches_a_node_over_tls_trusting_its_certificate(nodes):
    """docs/api.md: the client-facing API answers TLS on the same port; a client trusts the
    node's own certificate file (node-cert.pem, beside the token)."""
    import openai

    cert = nodes["decode"].log().split("TLS certificate ")[1].split(" ")[0]
    ctx = ssl.create_default_context(cafile=cert)
    ctx.check_hostname = False  # the certificate names no host: it is trusted as itself
    client = openai.OpenAI(base_url=f"https://{nodes['decode'].addr}/v1", api_key=TOKEN,
                           http_client=openai.DefaultHttpxClient(verify=ctx))  # fmt: skip
    models = client.models.list()
    assert [m.id for m in models.data] == [nodes["decode"].info["openai"]["model"]]
    # A client that checks certificates against the system's CAs refuses it.
    strict = openai.OpenAI(base_url=f"https://{nodes['decode'].addr}/v1", api_key=TOKEN,
                           max_retries=0)  # fmt: skip
    with pytest.raises(openai.APIConnectionError):
        strict.models.list()


def test_a_tls_data_handshake_starts_only_for_an_address_holding_a_ticket():
    """Each TLS data connection's handshake runs on a thread: only as many start for an
    address as it holds unredeemed TLS tickets (admitted prefills); a stranger's is closed
    at once, and a handshake the guard gives up on is cut with its connection."""
    from aiohttp import web

    from exo_split.transport.datalink import Listener
    from exo_split.transport.limits import Guard

    async def closed(reader) -> bool:
        return await asyncio.wait_for(reader.read(1), 5) == b""

    async def run():
        tickets, guard = Tickets(), Guard(1.0)
        listener = Listener(web.Application(), tickets, guard=guard,
                            identity=fake_identity())  # fmt: skip
        port = await listener.start("127.0.0.1", 0)
        try:
            stranger = await asyncio.open_connection("127.0.0.1", port)
            stranger[1].write(DATA_TLS_MAGIC)  # no ticket for this address: no thread
            assert await closed(stranger[0]) and guard.handshakes() == 0
            tickets.issue("127.0.0.1", tls=True)
            conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            for _, writer in conns:  # and no ClientHello: each would hang in its handshake
                writer.write(DATA_TLS_MAGIC)
            assert await closed(conns[1][0]) and await closed(conns[2][0])  # one ticket
            assert guard.handshakes("127.0.0.1") == 1
            assert await closed(conns[0][0])  # the guard's deadline (1 s) cut it
            for _ in range(100):  # its thread woke and ended
                if guard.handshakes() == 0:
                    break
                await asyncio.sleep(0.02)
            assert guard.handshakes() == 0
            for _, writer in (stranger, *conns):
                writer.close()
        finally:
            await listener.stop()

    asyncio.run(run())
