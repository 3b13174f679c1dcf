"""Concurrent load: 8 split requests at once against one prefill node and one decode node.

Every response must equal its solo run; a prefill node at its queue limit answers 503 with
Retry-After, and the decode node then falls back (default) or asks again (--busy-wait); after
each burst the KV held on both nodes returns to its idle level. Node agents are processes on
127.0.0.1; "KV held" is the nodes' own ledger in /v1/info, cross-checked with the processes'
resident memory (the decode side's MLX memory is measured exactly in
test_reliability_limits.py).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from nodes import TOKEN, NodeProcess, generate, open_kv_stream, request, running
from reference import prompt_ids, reference_generate

from exo_split.transport.tls import client_context

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

LAYERS = 6
NEW_TOKENS = 8
PROMPTS = [prompt_ids(n, seed=100 + i) for i, n in enumerate((60, 150, 300, 450, 600, 800, 1000, 1200))]  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def nodes(ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("load")
    started = {
        # glibc gives each new thread (TLS handshakes, stagers) an arena of its own, whose pages
        # RSS keeps: two arenas make the prefill node's RSS, checked below, a measure of it.
        "prefill": NodeProcess(ckpt, "torch", work, env={"MALLOC_ARENA_MAX": "2"}),
        "decode": NodeProcess(ckpt, "mlx", work),
        "prefill_2": NodeProcess(ckpt, "torch", work, "--max-concurrent", "2"),
        "decode_waits": NodeProcess(ckpt, "mlx", work, "--busy-wait", "30"),
    }
    yield from running(started)


@pytest.fixture(scope="module")
def solo(nodes, ckpt) -> list[list[int]]:
    """Each prompt run alone through the split; it must equal transformers."""
    out = []
    for ids in PROMPTS:
        done = _done(asyncio.run(generate(nodes["decode"].url, _body(nodes["prefill"], ids))))
        assert done["report"]["fallback"] is None
        assert done["tokens"] == reference_generate(ckpt, ids, NEW_TOKENS)
        out.append(done["tokens"])
    return out


def _body(prefill, ids) -> dict:
    return {"token_ids": ids, "max_tokens": NEW_TOKENS, "prefill_peer": prefill.addr}


def _done(events: list[dict]) -> dict:
    assert events[-1]["type"] == "done", events[-1]
    return events[-1]


def burst(decode, prefill) -> tuple[list[dict], float]:
    async def all_at_once():
        return await asyncio.gather(*(generate(decode.url, _body(prefill, ids)) for ids in PROMPTS))

    t0 = time.monotonic()
    results = asyncio.run(all_at_once())
    return [_done(events) for events in results], time.monotonic() - t0


def stats(node) -> dict:
    code, body, _ = asyncio.run(request("GET", f"{node.url}/v1/info"))
    assert code == 200
    return json.loads(body)["stats"]


def rss(node) -> int:
    with open(f"/proc/{node.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def wait_idle(*nodes_, timeout: float = 120.0) -> None:
    """Until the nodes hold no KV and run nothing. The bound only keeps a stuck node from
    hanging the suite (it is not a timing claim): generous, for a loaded CI box."""
    deadline = time.monotonic() + timeout
    for node in nodes_:
        while (s := stats(node))["kv_bytes_held"] or s["active"]:
            assert time.monotonic() < deadline, s
            time.sleep(0.02)


def test_8_concurrent_requests_each_equal_their_solo_run(nodes, solo):
    prefill, decode = nodes["prefill"], nodes["decode"]
    wait_idle(prefill, decode)
    # The solo runs went through these two nodes one at a time: the ledger's running peak is
    # now the largest single request's KV. Only requests held at once can raise it.
    solo_peak = {n: stats(nodes[n])["kv_bytes_peak"] for n in ("prefill", "decode")}
    assert all(solo_peak.values()), solo_peak
    after = []
    for round_ in range(2):  # twice: memory that leaked per request would show as growth
        dones, elapsed = burst(decode, prefill)
        for done, want in zip(dones, solo, strict=True):
            assert done["report"]["fallback"] is None
            assert done["tokens"] == want
        wait_idle(prefill, decode)
        # The prefill node's resident memory (torch on the CPU has no allocator account); the
        # decode node's MLX allocator's account of live arrays (its RSS also holds heap pages
        # the C allocator kept from a burst's larger batch: they vary with how rows joined).
        after.append({"prefill": rss(prefill), "decode": stats(decode)["memory"]["active"]})
        peak = {n: stats(nodes[n])["kv_bytes_peak"] for n in ("prefill", "decode")}
        print(f"burst {round_}: 8 requests in {elapsed:.2f} s; MiB after (RSS, MLX active): "
              + ", ".join(f"{n} {after[-1][n] / 2**20:.1f}" for n in after[-1])
              + f"; KV peak held (ledger) {peak}, solo {solo_peak}")  # fmt: skip
    # Both nodes held the KV of several requests at once, and none after the bursts.
    s_p, s_d = stats(prefill), stats(decode)
    assert s_p["kv_bytes_held"] == 0 and s_d["kv_bytes_held"] == 0
    assert s_p["kv_bytes_peak"] > solo_peak["prefill"], (s_p, solo_peak)
    assert s_d["kv_bytes_peak"] > solo_peak["decode"], (s_d, solo_peak)
    # Memory settles: the second burst adds less than half of one burst's KV, so a node that
    # kept each request's KV would fail (allocator caches fill in the first burst).
    burst_kv = sum(d["report"]["kv_bytes"] for d in dones)
    growth = {n: after[1][n] - after[0][n] for n in after[0]}
    assert all(g < burst_kv / 2 for g in growth.values()), (growth, burst_kv)


def test_prefill_node_at_its_limit_answers_503_with_retry_after(nodes):
    prefill = nodes["prefill_2"]
    spec = prefill.info["spec"]
    body = {"token_ids": prompt_ids(4000, seed=1), "spec": spec, "fingerprint": spec["fingerprint"],
            "chunk": 16}  # fmt: skip
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def fill_then_ask():
        held = [await open_kv_stream(prefill.url, body) for _ in range(2)]
        for code, reader, _ in held:  # both admitted and streaming: the node is at its limit
            assert code == 200 and (await reader.readexactly(32))[:4] == b"EXOS"
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{prefill.tls_url}/v1/prefill", json=body, headers=headers, ssl=client_context()
            ) as third,
        ):
            answer = third.status, dict(third.headers), await third.json()
        for _, _, writer in held:
            writer.close()
        return answer

    code, headers_, payload = asyncio.run(fill_then_ask())
    assert code == 503
    assert headers_["Retry-After"] == "1"
    assert payload == {"code": "busy", "message": "prefill queue is full (2 in progress)"}
    wait_idle(prefill)
    assert stats(prefill)["refused_busy"] >= 1


def test_burst_against_a_full_prefill_node_falls_back_locally(nodes, solo):
    prefill, decode = nodes["prefill_2"], nodes["decode"]
    before = stats(prefill).get("refused_busy", 0)
    dones, elapsed = burst(decode, prefill)
    assert [d["tokens"] for d in dones] == solo
    fell = [d["report"]["fallback"] for d in dones if d["report"]["fallback"]]
    assert fell, "8 requests against a node that admits 2: some must have been refused"
    assert all("busy (503, retry after 1 s)" in f for f in fell), fell
    assert stats(prefill)["refused_busy"] - before == len(fell)
    print(f"limit 2, no busy-wait: {len(fell)} of 8 fell back, burst took {elapsed:.2f} s")
    wait_idle(prefill, decode)


def test_burst_with_busy_wait_retries_after_retry_after(nodes, solo):
    prefill, decode = nodes["prefill_2"], nodes["decode_waits"]
    before = stats(prefill).get("refused_busy", 0)
    dones, elapsed = burst(decode, prefill)
    assert [d["tokens"] for d in dones] == solo
    assert all(d["report"]["fallback"] is None for d in dones)
    refused = stats(prefill)["refused_busy"] - before
    print(f"limit 2, --busy-wait 30: all 8 remote, {refused} refusals retried, "
          f"burst took {elapsed:.2f} s")  # fmt: skip
    assert refused >= 1
    wait_idle(prefill, decode)
