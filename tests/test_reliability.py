"""Dying and misbehaving prefill peers, hostile streams and cancellation, end to end.

Real node agents as processes on 127.0.0.1: a torch prefill node, an MLX decode node with
short timeouts, and torch prefill nodes that SIGKILL themselves after layer k (the
EXO_SPLIT_TEST_DIE_AFTER_LAYER hook). A fake prefill peer in this process (tests/fakes.py)
cuts, stalls, corrupts and replays mutated streams. Every failure must end in a local
prefill whose tokens equal transformers', within the configured timeouts, with the report
saying "fallback: local prefill: <reason>"; `fallback: none` must fail clearly instead.
docs/reliability.md maps each case here to its failure mode.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
from fakes import (
    FakePrefillPeer,
    bad_ticket,
    black_hole,
    frame_offsets,
    hang,
    mutate_stream,
    proxy,
    replace_json,
    replay,
    split_frames,
    status,
    with_crc,
)
from nodes import TOKEN, NodeProcess, generate, open_kv_stream, request, running
from reference import prompt_ids, reference_generate

from exo_split.report import load_report
from exo_split.report.text import render_terminal
from exo_split.transport import wire

pytestmark = pytest.mark.timeout(300)

LAYERS = 6
KILL_AT = (0, 2, LAYERS - 1)
NEW_TOKENS = 8
# The decode node's timeouts, short so that the stall cases are quick.
CONNECT, FIRST_FRAME, IDLE, TOTAL = 1.0, 3.0, 2.0, 20.0
TIMEOUT_FLAGS = ("--connect-timeout", str(CONNECT), "--first-frame-timeout", str(FIRST_FRAME),
                 "--idle-timeout", str(IDLE), "--prefill-timeout", str(TOTAL))  # fmt: skip
SLACK = 3.0  # seconds allowed beyond a timeout for the local prefill, decode and scheduling
PROMPT = prompt_ids(300, seed=7)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def nodes(ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("reliability")
    started = {
        # serves TLS and cleartext: the fake records its stream in cleartext (real CRCs)
        "prefill": NodeProcess(ckpt, "torch", work, "--insecure-transport"),
        "decode": NodeProcess(ckpt, "mlx", work, *TIMEOUT_FLAGS),  # to peers over TLS
        "decode_plain": NodeProcess(ckpt, "mlx", work, *TIMEOUT_FLAGS, "--insecure-transport"),
    }
    for k in KILL_AT:
        env = {"EXO_SPLIT_TEST_DIE_AFTER_LAYER": str(k)}
        started[f"die{k}"] = NodeProcess(ckpt, "torch", work, env=env)
    env = {"EXO_SPLIT_TEST_DIE_AFTER_LAYER": "2"}
    started["die_beside"] = NodeProcess(ckpt, "torch", work, env=env)
    yield from running(started)


@pytest.fixture(scope="module")
def fake():
    peer = FakePrefillPeer()
    yield peer
    peer.close()


@pytest.fixture
def plan(fake):
    fake.plans.clear()
    fake.default = None
    fake.served.clear()
    return fake


@pytest.fixture(scope="module")
def expected(ckpt):
    return reference_generate(ckpt, PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module")
def captured(nodes, fake, expected) -> bytes:
    """The real prefill node's stream for PROMPT, recorded through the fake acting as proxy."""
    record: list[bytes] = []
    fake.plans.append(proxy(nodes["prefill"].url, record))
    done = _done(_generate(nodes["decode"], {"prefill_peer": fake.addr})[0])
    assert done["report"]["fallback"] is None and done["tokens"] == expected
    return record[0]


def _generate(node, extra: dict, ids=PROMPT, timeout: float = 60) -> tuple[list[dict], float]:
    body = {"token_ids": ids, "max_tokens": NEW_TOKENS, **extra}
    t0 = time.monotonic()
    events = asyncio.run(generate(node.url, body, timeout=timeout))
    return events, time.monotonic() - t0


def _done(events: list[dict]) -> dict:
    assert events[-1]["type"] == "done", events[-1]
    return events[-1]


def stats(node) -> dict:
    code, body, _ = asyncio.run(request("GET", f"{node.url}/v1/info"))
    assert code == 200
    return json.loads(body)["stats"]


def wait_for(node, ok, timeout: float = 10.0) -> dict:
    """Poll the node's stats until ok(stats); return them."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(node)
        if ok(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def assert_idle(node) -> None:
    s = wait_for(node, lambda s: s["kv_bytes_held"] == 0 and not s["active"])
    assert s["kv_bytes_held"] == 0 and s["active"] == {}, s


def assert_fell_back(events, expected, reason: str) -> dict:
    done = _done(events)
    rep = done["report"]
    assert rep["mode"] == "local", rep
    assert rep["fallback"].startswith("local prefill: "), rep["fallback"]
    assert reason in rep["fallback"], rep["fallback"]
    assert [e["reason"] for e in events if e["type"] == "fallback"] == [
        rep["fallback"].removeprefix("local prefill: ")
    ]
    assert done["tokens"] == expected
    assert "fallback: local prefill: " in render_terminal(load_report(rep))
    return rep


# ---- the prefill node dies ------------------------------------------------------------------


@pytest.mark.parametrize("k", KILL_AT)
def test_prefill_node_sigkilled_after_layer_k_falls_back_to_local(nodes, expected, k):
    dying, decode = nodes[f"die{k}"], nodes["decode"]
    events, elapsed = _generate(decode, {"prefill_peer": dying.addr})
    assert dying.proc.wait(10) == -signal.SIGKILL
    rep = assert_fell_back(events, expected, "closed the stream")
    # What arrived before the kill is drawn in the report, then discarded: layers 0..k (the
    # node awaits each frame's write and sleeps 0.2 s before its SIGKILL).
    assert [p["layer"] for p in rep["layers"]] == list(range(k + 1))
    print(f"killed after layer {k}: fallback done in {elapsed:.2f} s ({rep['fallback']})")
    assert_idle(decode)


def test_a_peer_dying_while_others_decode_falls_back_without_disturbing_them(nodes, expected):
    """A long request decodes on the decode node while another's prefill peer dies mid-
    stream: the newcomer falls back, prefills locally and decodes beside it (they share
    batched steps), both with their solo tokens."""
    dying, decode = nodes["die_beside"], nodes["decode"]
    long = {"token_ids": prompt_ids(20, seed=9), "max_tokens": 1500, "ignore_eos": True,
            "prefill": "local"}  # fmt: skip
    alone = _done(asyncio.run(generate(decode.url, long)))

    async def both():
        return await asyncio.gather(
            generate(decode.url, long),
            generate(
                decode.url,
                {"token_ids": PROMPT, "max_tokens": NEW_TOKENS, "prefill_peer": dying.addr},
            ),  # fmt: skip
        )

    a_events, b_events = asyncio.run(both())
    assert dying.proc.wait(10) == -signal.SIGKILL
    assert_fell_back(b_events, expected, "closed the stream")
    a = _done(a_events)
    assert a["tokens"] == alone["tokens"]
    assert a["report"]["timeline"]["decode"]["batch"]["max"] == 2  # B joined A's steps
    assert_idle(decode)


# ---- the fake peer misbehaves ---------------------------------------------------------------


def _offset(data: bytes, layer: int) -> int:
    """Byte offset of the first LAYER frame of `layer`."""
    return next(o for h, o in frame_offsets(data) if h.kind is wire.Kind.LAYER and h.layer == layer)


def _bad_crc(data: bytes) -> bytes:
    off = _offset(data, 2) + wire.HEADER_SIZE + 5
    return data[:off] + bytes([data[off] ^ 0x10]) + data[off + 1 :]


def _wrong_fingerprint(data: bytes) -> bytes:
    frames = split_frames(data)

    def edit(hello: dict) -> dict:
        spec = {**hello["spec"], "rope_theta": 12345.0}
        return {**hello, "spec": spec, "fingerprint": "0123456789abcdef"}

    return replace_json(frames[0], edit) + b"".join(frames[1:])


def _token_outside_vocab(data: bytes) -> bytes:
    frames = split_frames(data)
    i = next(i for i, f in enumerate(frames) if f[5] == wire.Kind.TOKEN)
    frames[i] = with_crc(frames[i][: wire.HEADER_SIZE] + wire.TOKEN_PAYLOAD.pack(10**6, 0.0))
    return b"".join(frames)


def _error_frame(data: bytes) -> bytes:
    frames = split_frames(data)
    return frames[0] + frames[1] + wire.frame_bytes(wire.encode_error("oom", "out of memory"))


# name -> (plan from the captured stream, words of the reason). A stall's reason names the
# timeout that ended it: that, not a clock read by the test, shows the bound held.
MISBEHAVIOUR = {
    "cut between frames": (lambda s: replay(s, upto=_offset(s, 3)), "closed the stream"),
    "cut mid-frame": (lambda s: replay(s, upto=_offset(s, 3) + 100), "mid-frame"),
    "reset mid-frame": (
        lambda s: replay(s, upto=_offset(s, 3) + 100, then="reset"),
        "connection lost after 4 frames",
    ),
    "stall mid-stream": (
        lambda s: replay(s, upto=_offset(s, 3), then="stall"),
        f"stalled: no data for {IDLE:g} s after 4 frames",
    ),
    "stall before HELLO": (
        lambda s: replay(s, upto=0, then="stall"),
        f"no HELLO within {FIRST_FRAME:g} s",
    ),
    "no answer at all": (lambda s: hang(), "POST /v1/prefill timed out"),
    "bad CRC": (lambda s: replay(_bad_crc(s)), "CRC mismatch on LAYER 2"),
    "wrong fingerprint": (lambda s: replay(_wrong_fingerprint(s)), "rope_theta"),
    "garbage": (lambda s: replay(random.Random(1).randbytes(5000)), "bad magic"),
    "ERROR frame": (lambda s: replay(_error_frame(s)), "oom: out of memory"),
    "first token outside vocab": (
        lambda s: replay(_token_outside_vocab(s)),
        "outside the vocabulary",
    ),
    "ticket refused": (lambda s: bad_ticket(), "closed the stream"),
    "200 without a ticket": (
        lambda s: status(200, "no ticket here"),
        "answered 200 without a protocol 2 ticket",
    ),
    "503 busy": (
        lambda s: status(503, "full", {"Retry-After": "1"}),
        "busy (503, retry after 1 s)",
    ),
    "401": (lambda s: status(401, "no"), "refused the token (401)"),
    "500": (lambda s: status(500, "boom"), "answered 500"),
    "413 over its limits": (
        lambda s: status(413, "300 prompt tokens exceed this node's limit of 100"),
        "rejected the request (413): 300 prompt tokens exceed",
    ),
}


# Each misbehaviour over TLS (as nodes talk by default) and in cleartext (--insecure-transport),
# but a bad CRC in cleartext only: over TLS frames carry no CRC, a changed byte fails its TLS
# record instead (tests/test_tls.py).
CASES = [(c, t) for c in MISBEHAVIOUR for t in ("tls", "plain") if (c, t) != ("bad CRC", "tls")]


def _decode(nodes, transport: str):
    return nodes["decode" if transport == "tls" else "decode_plain"]


@pytest.mark.parametrize(("case", "transport"), CASES, ids=[f"{c}-{t}" for c, t in CASES])
def test_misbehaving_peer_falls_back_to_local_prefill(nodes, plan, captured, expected, case,
                                                       transport):  # fmt: skip
    make, reason = MISBEHAVIOUR[case]
    plan.default = make(captured)
    decode = _decode(nodes, transport)
    events, elapsed = _generate(decode, {"prefill_peer": plan.addr})
    rep = assert_fell_back(events, expected, reason)
    print(f"{case}: fallback done in {elapsed:.2f} s ({rep['fallback']})")
    if "stall" in case or "answer" in case:
        # the decode node hung up on the stalled peer: nothing left open there
        deadline = time.monotonic() + 5
        while plan.served[-1].closed_by_client is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert plan.served[-1].closed_by_client is not None
    assert_idle(decode)


def test_unreachable_peer_times_out_on_connect(nodes, expected):
    with black_hole() as addr:
        events, _ = _generate(nodes["decode"], {"prefill_peer": addr})
    # the link probe (its proof) and then the POST each wait at most --connect-timeout
    assert_fell_back(events, expected, "timed out")


NONE_CASES = ("bad CRC", "stall mid-stream", "503 busy", "wrong fingerprint")


@pytest.mark.parametrize("case", NONE_CASES)
def test_fallback_none_fails_the_request_clearly(nodes, plan, captured, case):
    make, reason = MISBEHAVIOUR[case]
    plan.default = make(captured)
    decode = _decode(nodes, "plain" if case == "bad CRC" else "tls")
    events, _ = _generate(decode, {"prefill_peer": plan.addr, "fallback": "none"})
    assert events[-1]["type"] == "error", events[-1]
    message = events[-1]["message"]
    assert message.startswith("remote prefill failed and fallback is none: "), message
    assert reason in message and plan.addr in message
    assert not any(e["type"] in ("token", "fallback", "done") for e in events)
    assert_idle(decode)


def test_split_generate_cli_with_fallback_none_exits_with_the_reason(nodes, plan, captured):
    plan.default = replay(random.Random(2).randbytes(100))
    env = {"EXO_SPLIT_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "exo_split", "split-generate", "--prompt", "a b c", "--max-tokens",
         "4", "--decode-peer", nodes["decode"].addr, "--prefill-peer", plan.addr,
         "--fallback", "none"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "remote prefill failed and fallback is none" in out.stderr
    assert f"{plan.addr}: bad magic" in out.stderr and "Traceback" not in out.stderr
    assert TOKEN not in out.stderr + out.stdout


# ---- hostile streams against the live decode node ----------------------------------------

LIVE_STREAMS = 160


@pytest.mark.slow
def test_mutated_streams_against_a_live_decode_node(nodes, plan, ckpt):
    """The in-process run (test_reliability_frames.py) proves the parser; this sends mutated
    real streams to the running decode node: every request completes with the reference
    tokens (a fallback or a valid parse), within the timeouts, and the node keeps serving,
    holding no KV after (its ledger). The decode side's memory after fallbacks is measured
    exactly (MLX active memory) in test_reliability_limits.py; RSS here could not tell a
    leak of these small requests' KV from noise."""
    ids = prompt_ids(40, seed=3)
    want = reference_generate(ckpt, ids, 4)
    # In cleartext, where the frames' CRCs are the integrity check: over TLS a changed byte
    # never reaches the parser (its record fails, tests/test_tls.py) and LAYER CRCs are 0.
    decode = nodes["decode_plain"]
    record: list[bytes] = []
    plan.plans.append(proxy(nodes["prefill"].url, record))
    body = {"prefill_peer": plan.addr, "chunk": 16}
    first = _done(asyncio.run(generate(decode.url, {"token_ids": ids, "max_tokens": 4, **body})))
    assert first["report"]["fallback"] is None and first["tokens"] == want
    frames = split_frames(record[0])
    rng = random.Random(6)
    mutations = []
    for _ in range(LIVE_STREAMS):
        data, mutation = mutate_stream(frames, rng)
        mutations.append(mutation)
        plan.plans.append(replay(data))

    async def run_all() -> list[tuple[list[dict], float]]:
        out = []
        async with aiohttp.ClientSession() as session:
            for _ in range(LIVE_STREAMS):
                t0 = time.monotonic()
                async with session.post(
                    f"{decode.url}/v1/generate",
                    json={"token_ids": ids, "max_tokens": 4, **body},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                    timeout=aiohttp.ClientTimeout(total=FIRST_FRAME + SLACK),
                ) as resp:
                    lines = (await resp.read()).splitlines()
                out.append(([json.loads(x) for x in lines if x.strip()], time.monotonic() - t0))
        return out

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    fallbacks, slowest = 0, 0.0
    for (events, elapsed), mutation in zip(results, mutations, strict=True):
        done = events[-1]
        assert done["type"] == "done", (str(mutation), done)
        assert done["tokens"] == want, str(mutation)
        fallbacks += done["report"]["fallback"] is not None
        slowest = max(slowest, elapsed)
    print(f"{LIVE_STREAMS} mutated streams in {time.monotonic() - t0:.1f} s: {fallbacks} "
          f"fallbacks, slowest {slowest:.2f} s")  # fmt: skip
    assert fallbacks > LIVE_STREAMS * 0.8
    # ... and it keeps serving, with nothing held
    done = _done(_generate(decode, {"prefill_peer": nodes["prefill"].addr})[0])
    assert done["report"]["fallback"] is None
    assert decode.proc.poll() is None
    assert_idle(decode)


# ---- cancellation ---------------------------------------------------------------------------

LONG = prompt_ids(4000, seed=5)


async def _leave_kv_stream_after(url: str, body: dict, n_bytes: int) -> float:
    """Open a KV stream, read n bytes of it, then drop the data connection."""
    code, reader, writer = await open_kv_stream(url, body)
    assert code == 200, reader
    await reader.readexactly(n_bytes)
    writer.transport.abort()  # the client goes away mid-stream
    return time.monotonic()


async def _disconnect_after(url: str, path: str, body: dict, n_lines: int | None, n_bytes: int):
    """POST, read until n NDJSON lines (or n bytes) have come, then drop the connection."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            url + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=aiohttp.ClientTimeout(total=60),
        )  # fmt: skip
        assert resp.status == 200, await resp.text()
        got = b""
        while (n_lines is not None and got.count(b"\n") < n_lines) or len(got) < n_bytes:
            chunk = await resp.content.readany()
            assert chunk, "the stream ended before the client could walk away"
            got += chunk
        resp.close()  # the client goes away mid-request
        return time.monotonic()


def _check_stopped_within_one_layer(prefill, before: dict, left_at: float) -> dict:
    s = wait_for(
        prefill, lambda s: s.get("prefills_cancelled", 0) > before.get("prefills_cancelled", 0)
    )
    noticed = time.monotonic() - left_at
    cancel = s["last_cancel"]
    assert s.get("prefills_cancelled", 0) == before.get("prefills_cancelled", 0) + 1, s
    assert cancel["pieces_computed"] - cancel["pieces_at_cancel"] <= 1, cancel
    assert cancel["pieces_computed"] < cancel["pieces_total"], cancel
    assert_idle(prefill)
    print(f"prefill stopped {noticed:.2f} s after the client left: {cancel}")
    return cancel


def test_client_leaving_a_prefill_stream_stops_the_prefill_within_one_layer(nodes):
    prefill = nodes["prefill"]
    before = stats(prefill)
    spec = prefill.info["spec"]
    body = {"request_id": "leaver", "token_ids": LONG, "spec": spec,
            "fingerprint": spec["fingerprint"], "chunk": 16}  # fmt: skip
    left_at = asyncio.run(_leave_kv_stream_after(prefill.url, body, 20_000))
    _check_stopped_within_one_layer(prefill, before, left_at)


def test_client_leaving_the_decode_node_cancels_the_remote_prefill(nodes):
    prefill, decode = nodes["prefill"], nodes["decode"]
    before_p, before_d = stats(prefill), stats(decode)
    body = {"token_ids": LONG, "max_tokens": 4, "prefill_peer": prefill.addr, "chunk": 16}
    left_at = asyncio.run(_disconnect_after(decode.url, "/v1/generate", body, 3, 0))
    _check_stopped_within_one_layer(prefill, before_p, left_at)
    key = "generates_cancelled"
    s = wait_for(decode, lambda s: s.get(key, 0) > before_d.get(key, 0))
    assert s.get(key, 0) == before_d.get(key, 0) + 1, s
    assert_idle(decode)
    # both keep serving
    done = _done(_generate(decode, {"prefill_peer": prefill.addr})[0])
    assert done["report"]["fallback"] is None


def test_client_leaving_a_local_prefill_frees_the_decode_node(nodes):
    decode = nodes["decode"]
    before = stats(decode)
    body = {"token_ids": LONG, "max_tokens": 4, "prefill": "local", "chunk": 16}

    async def leave_early() -> None:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(decode.url + "/v1/generate", json=body,
                                headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
            assert resp.status == 200
            await asyncio.sleep(0.2)  # the local prefill is under way
            resp.close()

    asyncio.run(leave_early())
    key = "generates_cancelled"
    s = wait_for(decode, lambda s: s.get(key, 0) > before.get(key, 0))
    assert s.get(key, 0) == before.get(key, 0) + 1, s
    assert_idle(decode)


# ---- last: nothing above leaked the token -------------------------------------------------


def test_token_never_in_node_logs(nodes):
    for name, node in nodes.items():
        assert TOKEN not in node.log(), name
