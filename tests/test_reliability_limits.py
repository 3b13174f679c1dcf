"""Limits and KV memory, with both real backends served in this process (aiohttp on
127.0.0.1): prompt tokens, concurrent requests and KV bytes are refused before any work with
a clear 413/503 (never an out-of-memory); the decode side's MLX memory, measured with
mx.get_active_memory(), returns exactly to idle after a burst, a fallback and a cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
from fakes import FakePrefillPeer, fake_identity, replay
from nodes import TOKEN
from reference import prompt_ids, reference_generate

from exo_split.backends import load_backend
from exo_split.node.decode import Coordinator
from exo_split.node.routes import NodeState, make_app
from exo_split.tokenizer import TextCodec
from exo_split.transport.client import Timeouts
from exo_split.transport.datalink import Listener
from exo_split.transport.limits import Limits, decode_kv_bytes
from exo_split.transport.tls import secure_url

pytestmark = pytest.mark.timeout(300)
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
TIMEOUTS = Timeouts(connect=1.0, first_frame=3.0, idle=2.0, total=20.0)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def backends(ckpt):
    """name -> (backend, its compute thread): loaded once, on the thread that runs them."""
    out = {}
    for name in ("torch", "mlx"):
        executor = ThreadPoolExecutor(1, thread_name_prefix=f"compute-{name}")
        out[name] = (executor.submit(load_backend, name, ckpt).result(), executor)
    yield out
    for _, executor in out.values():
        executor.shutdown()


@pytest.fixture(scope="module")
def fake():
    peer = FakePrefillPeer()
    yield peer
    peer.close()


@contextlib.asynccontextmanager
async def serving(backends, ckpt, name: str, limits: Limits | None = None, peer: str | None = None):
    """A node's app on 127.0.0.1 (as node/agent.py runs it); yields (url, state)."""
    limits = limits or Limits()
    backend, executor = backends[name]
    session: list[aiohttp.ClientSession] = []

    def get_session() -> aiohttp.ClientSession:
        if not session:
            session.append(aiohttp.ClientSession())
        return session[0]

    async def choose_peer(req, n):
        return (req.prefill_peer and f"http://{req.prefill_peer}") or peer, None

    coordinator = Coordinator(backend, TextCodec(ckpt), executor, token=TOKEN, timeouts=TIMEOUTS,
                              session=get_session, choose_peer=choose_peer)  # fmt: skip
    state = NodeState(node_id=name, spec=backend.spec, backend=backend, executor=executor,
                      token=TOKEN, limits=limits, coordinator=coordinator,
                      info={"fingerprint": backend.spec.fingerprint}, timeouts=TIMEOUTS)  # fmt: skip
    # To peers over TLS, as nodes do; /v1/prefill served in cleartext too (the tests' posts)
    state.identity, state.insecure_transport = fake_identity(), True
    coordinator.link = lambda url: secure_url(url, True)
    listener = Listener(make_app(state), state.tickets, shutdown_timeout=1.0,
                        identity=state.identity)  # fmt: skip
    port = await listener.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        await listener.stop()
        if session:
            await session[0].close()


async def post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, list]:
    async with s.post(url, json=body, headers=HEADERS) as resp:
        raw = await resp.read()
        if resp.status != 200:
            return resp.status, dict(resp.headers), [json.loads(raw)]
        return 200, dict(resp.headers), [json.loads(x) for x in raw.splitlines() if x.strip()]


async def until(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_prompt_over_the_limit_is_refused_before_any_work(backends, ckpt):
    async def run():
        limits = Limits(max_prompt_tokens=64)
        async with (
            serving(backends, ckpt, "mlx", limits) as (decode, d_state),
            serving(backends, ckpt, "torch", limits) as (prefill, p_state),
            aiohttp.ClientSession() as s,
        ):
            spec = p_state.spec.to_dict()
            gen = await post(
                s, f"{decode}/v1/generate", {"token_ids": [1] * 65, "prefill": "local"}
            )
            pre = await post(s, f"{prefill}/v1/prefill", {"token_ids": [1] * 65, "spec": spec})
            ok = await post(s, f"{decode}/v1/generate", {"token_ids": [1] * 64, "max_tokens": 2,
                                                          "prefill": "local"})  # fmt: skip
            return gen, pre, ok, d_state.stats, p_state.stats

    gen, pre, ok, d_stats, p_stats = asyncio.run(run())
    assert gen[0] == 413
    assert (
        gen[2][0]["message"]
        == "65 prompt tokens exceed this node's limit of 64 (--max-prompt-tokens)"
    )
    assert pre[0] == 413
    assert "65 prompt tokens exceed this node's limit of 64" in pre[2][0]["message"]
    assert ok[0] == 200 and ok[2][-1]["type"] == "done"
    assert d_stats.get("generates") == 1 and "prefills" not in p_stats  # refused: no work


def test_concurrency_and_kv_limits_answer_503_or_413_before_any_work(backends, ckpt, fake):
    """A request that holds its slot and its KV (its prefill peer stalls) makes the next one
    wait: 503 + Retry-After for a full queue or a full KV budget; 413 for a request that could
    never fit the budget."""
    backend = backends["mlx"][0]
    ids = prompt_ids(200, seed=1)
    one = decode_kv_bytes(backend.spec, backend.dtype, len(ids), 4)
    fake.default = replay(b"", then="stall")

    async def run(limits: Limits, second: dict):
        async with (
            serving(backends, ckpt, "mlx", limits) as (decode, state),
            aiohttp.ClientSession() as s,
        ):
            body = {"token_ids": ids, "max_tokens": 4, "prefill_peer": fake.addr}
            first = asyncio.ensure_future(post(s, f"{decode}/v1/generate", body))
            await until(lambda: state.ledger.held == one)
            answer = await post(s, f"{decode}/v1/generate", {**body, **second})
            first.cancel()
            await until(lambda: state.ledger.held == 0 and not any(state.busy.values()))
            return answer, dict(state.stats)

    # Queue full: one request in progress, the limit is 1.
    (code, headers, [payload]), stats = asyncio.run(run(Limits(max_concurrent=1), {}))
    assert (code, headers["Retry-After"], payload["code"]) == (503, "1", "busy")
    assert payload["message"] == "generate queue is full (1 in progress)"
    assert stats == {"generates": 1, "refused_busy": 1, "generates_cancelled": 1}
    # KV budget full: room for one such request, not two.
    (code, headers, [payload]), _ = asyncio.run(run(Limits(max_kv_bytes=one + one // 2), {}))
    assert (code, headers["Retry-After"], payload["code"]) == (503, "1", "busy")
    assert "of KV;" in payload["message"] and "held by requests in progress" in payload["message"]
    # A request bigger than the whole budget: 413, however idle the node.
    big = {"token_ids": prompt_ids(2000, seed=2)}
    (code, _, [payload]), _ = asyncio.run(run(Limits(max_kv_bytes=2 * one), big))
    assert (code, payload["code"]) == (413, "too_much_kv")
    assert "more than this node's limit of" in payload["message"]
    assert "(--max-kv-bytes)" in payload["message"]


def test_decode_kv_memory_returns_to_idle(backends, ckpt, fake):
    """Measured, not counted: MLX's active memory on the decode side is back to its idle
    level after a burst of 8 split requests, after a fallback, and after a cancellation."""
    import mlx.core as mx

    mlx_thread = backends["mlx"][1]
    prompts = [prompt_ids(n, seed=n) for n in (50, 100, 200, 300, 400, 500, 700, 900)]
    want = [reference_generate(ckpt, ids, 4) for ids in prompts]

    async def run():
        async with (
            serving(backends, ckpt, "torch") as (prefill, p_state),
            serving(backends, ckpt, "mlx", peer=prefill) as (decode, d_state),
            aiohttp.ClientSession() as s,
        ):

            async def active() -> int:
                """MLX frees asynchronously: settle the compute thread's stream, then read."""
                await asyncio.get_running_loop().run_in_executor(mlx_thread, mx.synchronize)
                return mx.get_active_memory()

            async def gen(ids, **extra):
                body = {"token_ids": ids, "max_tokens": 4, **extra}
                code, _, events = await post(s, f"{decode}/v1/generate", body)
                assert code == 200 and events[-1]["type"] == "done", events[-1]
                return events[-1]

            # warm-up, both ways: whatever MLX keeps after a first request of each kind
            await gen(prompts[0])
            await gen(prompts[0], prefill="local")
            idle = await active()
            dones = await asyncio.gather(*(gen(ids) for ids in prompts))
            assert [d["tokens"] for d in dones] == want
            assert all(d["report"]["fallback"] is None for d in dones)
            after_burst = await active()
            peak = d_state.ledger.peak
            fake.default = replay(b"EXOS garbage")
            fell = await gen(prompts[3], prefill_peer=fake.addr)
            assert fell["report"]["fallback"] and fell["tokens"] == want[3]
            after_fallback = await active()
            body = {"token_ids": prompt_ids(3000, seed=9), "max_tokens": 4, "chunk": 16}
            resp = await s.post(f"{decode}/v1/generate", json=body, headers=HEADERS)
            await resp.content.readline()  # the first progress event: KV is arriving
            resp.close()
            await until(lambda: d_state.stats.get("generates_cancelled") == 1)
            await until(lambda: p_state.stats.get("prefills_cancelled") == 1)
            after_cancel = await active()
            return idle, after_burst, after_fallback, after_cancel, peak, d_state, p_state

    idle, burst, fallback, cancel, peak, d_state, p_state = asyncio.run(run())
    print(f"decode MLX active memory: idle {idle}, after burst {burst}, after fallback "
          f"{fallback}, after cancel {cancel} bytes; ledger peak {peak}")  # fmt: skip
    assert burst == fallback == cancel == idle
    assert peak > 0 and d_state.ledger.held == 0 and p_state.ledger.held == 0
    assert (
        p_state.stats["last_cancel"]["pieces_computed"]
        < p_state.stats["last_cancel"]["pieces_total"]
    )


def test_a_silent_generate_stream_gets_heartbeats(backends, ckpt, monkeypatch):
    """While a long prefill runs, the decode node writes a heartbeat event every HEARTBEAT_S
    of silence, so a client's idle timeout (60 s in split-generate) bounds a dead node, not a
    long local prefill."""
    from exo_split.node import routes

    monkeypatch.setattr(routes, "HEARTBEAT_S", 0.05)

    async def run():
        async with (
            serving(backends, ckpt, "mlx") as (decode, _),
            aiohttp.ClientSession() as s,
        ):
            body = {"token_ids": prompt_ids(3000, seed=4), "max_tokens": 2, "prefill": "local",
                    "chunk": 16}  # fmt: skip
            return await post(s, f"{decode}/v1/generate", body)

    code, _, events = asyncio.run(run())
    kinds = [e["type"] for e in events]
    assert code == 200 and kinds[-1] == "done"
    first_token = kinds.index("token")
    assert "heartbeat" in kinds[:first_token], kinds


# ---- strangers on the port: descriptors are bounded (issue 18, H2) ---------------------------


@pytest.mark.timeout(300)
def test_300_idle_connections_cannot_starve_a_node_of_descriptors(ckpt, tmp_path):
    """The prefill node runs under RLIMIT_NOFILE=256 (macOS's default soft limit; the MLX
    node cannot be the one: mlx-lm raises its own soft limit to 2048 at import); 300
    connections arrive that never send a request (a quarter each: nothing; one byte, which
    hands them to HTTP; a TLS record's first byte, which starts HTTPS; a TLS data connection's
    magic, refused at once: no ticket waits for that address). Its /v1/health and a real
    split request through it (over TLS) still answer, and every one of the 300 is closed, by
    the per-address cap (oldest first), the ticket rule or the header deadline, without the
    test closing any."""
    import socket

    from nodes import NodeProcess, generate_sync, request

    t = NodeProcess(ckpt, "torch", tmp_path, "--header-timeout", "3",
                    prefix=["prlimit", "--nofile=256:256"])  # fmt: skip
    m = NodeProcess(ckpt, "mlx", tmp_path)
    socks: list[socket.socket] = []
    try:
        t.wait_ready(), m.wait_ready()
        port = t.info["port"]
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 4:
                s.sendall([b"G", b"\x16", b"EXOT"][i % 4 - 1])
            socks.append(s)
        status, body, _ = asyncio.run(request("GET", t.url + "/v1/health"))
        assert status == 200, body
        ids = prompt_ids(40, seed=5)
        done = generate_sync(m.url, {"token_ids": ids, "max_tokens": 6, "prefill_peer": t.addr,
                                     "fallback": "none"})  # fmt: skip
        assert done["tokens"] == reference_generate(ckpt, ids, 6)
        closed = 0
        for s in socks:
            s.settimeout(15)  # bounds the wait: the deadline is 3 s
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
        assert closed == 300
        assert t.proc.poll() is None and "Too many open files" not in t.log()
    finally:
        for s in socks:
            s.close()
        t.stop(), m.stop()


def test_tokenizing_runs_off_the_event_loop(backends, ckpt):
    """Issue 18, L6: a request whose tokenization is still running (here held on an event,
    as a big body's rendering would be) does not stall the node: /v1/health is answered
    meanwhile, and the request completes once tokenization is let go."""
    import threading

    async def run():
        async with serving(backends, ckpt, "mlx") as (url, state), aiohttp.ClientSession() as s:
            coordinator = state.coordinator
            real, started, release = (
                coordinator.codec.tokenize,
                threading.Event(),
                threading.Event(),
            )

            def slow_tokenize(text):
                started.set()
                assert release.wait(30), "never released"
                return real(text)

            coordinator.codec.tokenize = slow_tokenize
            body = {"prompt": "ba be bi bo", "max_tokens": 2, "prefill": "local"}
            gen = asyncio.create_task(post(s, url + "/v1/generate", body))
            await until(started.is_set)
            async with s.get(url + "/v1/health") as resp:  # answered while tokenizing
                health = resp.status
            assert not gen.done()
            release.set()
            status, _, events = await gen
            coordinator.codec.tokenize = real
            return health, status, events

    health, status, events = asyncio.run(run())
    assert health == 200 and status == 200 and events[-1]["type"] == "done"
