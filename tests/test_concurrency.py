"""A request that arrives while others decode is served beside them (node/tokens.py's decode
slices), not after them: asserted by the order of the stream events, never by a clock.

Local prefill (a node in this process) and remote prefill (two real nodes: the newcomer's
KV streams in while the first request keeps decoding), each newcomer's text equal to its
solo run.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from nodes import TOKEN, node_pair, request, tiny_decode_node

pytestmark = pytest.mark.timeout(300)

LONG = 240  # the first request's tokens: far more than the newcomers need to start
# ... when they come through the prefill node (its TLS handshake, its forward in another
# process, the stream): a loaded 2-core CI box once took longer than 240 of A's steps
REMOTE_LONG = 1500


async def _stream(client, prompt, n, log, who, extra=None):
    """Stream a completion, logging (who, "token") per chunk with text and (who, "done")."""
    text = ""
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True, **(extra or {})})  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
            log.append((who, "token"))
    log.append((who, "done"))
    return text


async def _scenario(url, extra=None, long=LONG):
    """A decodes LONG tokens; once A has streamed some, B and C arrive. Returns the event log
    and the texts, then each newcomer's solo text."""
    log: list[tuple[str, str]] = []
    prompts = {"A": list(range(3, 40)), "B": list(range(50, 90)), "C": list(range(100, 130))}
    async with openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0) as c:
        a = asyncio.ensure_future(_stream(c, prompts["A"], long, log, "A", extra))
        for _ in range(20_000):  # until A has streamed a few tokens (bounded)
            if sum(1 for who, _ in log if who == "A") >= 5 or a.done():
                break
            await asyncio.sleep(0.005)
        b = asyncio.ensure_future(_stream(c, prompts["B"], 8, log, "B", extra))
        cc = asyncio.ensure_future(_stream(c, prompts["C"], 8, log, "C", extra))
        texts = dict(zip("ABC", await asyncio.gather(a, b, cc), strict=True))
        solo = {w: await _stream(c, prompts[w], 8, [], w, extra) for w in "BC"}
    return log, texts, solo


def _check(log, texts, solo):
    a_done = log.index(("A", "done"))
    for who in "BC":
        first = log.index((who, "token"))
        assert first < a_done, f"{who} waited for A to finish"
        assert log.index((who, "done")) < a_done  # B and C finish while A still decodes
        assert texts[who] == solo[who]  # beside A, the same text as alone
    assert sum(1 for w, k in log if w == "A" and k == "token") > 20


def test_newcomers_decode_beside_a_long_request_local_prefill(llama):
    async def go():
        async with tiny_decode_node(llama) as url:
            return await _scenario(url)

    _check(*asyncio.run(go()))


def test_newcomers_kv_streams_in_while_a_long_request_decodes(llama, tmp_path):
    with node_pair(llama, tmp_path, "tiny") as (prefill, decode):
        remote = {"exo_split": {"prefill": "remote", "prefill_peer": prefill.addr,
                                "fallback": "none"}}  # fmt: skip
        _check(*asyncio.run(_scenario(f"{decode.url}/v1", remote, REMOTE_LONG)))


def test_a_local_prefill_in_slices_equals_transformers(llama, monkeypatch):
    """A local prefill runs as jobs of at most `--local-slice` positions (each a point where
    other requests' decode steps run): made small here, a 700-token prompt takes 11 of them,
    and the answer still equals transformers' greedy answer on the same weights."""
    from reference import reference_generate

    from exo_split.node import decode
    from exo_split.node.slicing import Slicing
    from exo_split.tokenizer import TextCodec

    jobs = []
    real = decode.Coordinator._prefill_slice

    def counted(self, pre, start, *args):
        end, done = real(self, pre, start, *args)
        jobs.append((start, end))
        return end, done

    monkeypatch.setattr(decode.Coordinator, "_prefill_slice", counted)
    prompt = [3 + (i * 11) % 500 for i in range(700)]
    jobs_of_64 = Slicing(max_tokens=64)

    async def go():
        async with tiny_decode_node(llama, slicing=jobs_of_64) as url, openai.AsyncOpenAI(
            base_url=url, api_key=TOKEN, max_retries=0
        ) as c:  # fmt: skip
            r = await c.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                           temperature=0)  # fmt: skip
            return r.choices[0].text

    assert asyncio.run(go()) == TextCodec(llama).detokenize(reference_generate(llama, prompt, 6))
    assert jobs == [(i, min(i + 64, 700)) for i in range(0, 700, 64)]  # 11 jobs


def test_8_clients_at_once_through_the_openai_client_equal_their_solo_runs(llama):
    """Eight clients (half streaming) released together: each text equals its solo run's,
    and they shared the node's decode steps (the batch held several at once)."""

    async def ask(c, i, stream):
        prompt = [3 + (i * 37 + k * 13) % 500 for k in range(10 + 3 * i)]
        kw = {"model": "tiny", "prompt": prompt, "max_tokens": 16 + i, "temperature": 0.7,
              "seed": 100 + i, "extra_body": {"ignore_eos": True}}  # fmt: skip
        if not stream:
            return (await c.completions.create(**kw)).choices[0].text
        text = ""
        async for chunk in await c.completions.create(stream=True, **kw):
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def go():
        async with tiny_decode_node(llama) as url, openai.AsyncOpenAI(
            base_url=url, api_key=TOKEN, max_retries=0
        ) as c:  # fmt: skip
            solo = [await ask(c, i, False) for i in range(8)]
            together = await asyncio.gather(*[ask(c, i, i % 2 == 1) for i in range(8)])
            code, body, _ = await request("GET", f"{url}/info", token=TOKEN)
            return solo, together, json.loads(body)["stats"]["batch"]

    solo, together, batch = asyncio.run(go())
    assert together == solo
    assert batch["peak_rows"] >= 4 and batch["rows"] == 0 and batch["extra_kv_bytes"] == 0


def test_a_burst_of_more_clients_than_8_is_admitted_by_bytes_not_refused_by_count(llama):
    """Twelve clients at once (more than EXO's batch of 8), none retrying: a node with its
    default limits admits them all (its KV budget holds them), each answer whole; the batch
    held more than 8 of them at once. Admission refuses by KV bytes (tests/test_batch.py,
    tests/test_reliability_limits.py), the count is only a guard on the queue's length."""
    from exo_split.transport.limits import Limits

    async def ask(c, i):
        prompt = [3 + (i * 41 + k * 7) % 500 for k in range(12)]
        r = await c.completions.create(model="tiny", prompt=prompt, max_tokens=200,
                                       temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        return r.usage.completion_tokens

    async def go():
        async with tiny_decode_node(llama) as url, openai.AsyncOpenAI(
            base_url=url, api_key=TOKEN, max_retries=0
        ) as c:  # fmt: skip
            done = await asyncio.gather(*[ask(c, i) for i in range(12)])
            code, body, _ = await request("GET", f"{url}/info", token=TOKEN)
            return done, json.loads(body)["stats"]["batch"]

    assert Limits().max_concurrent >= 12
    done, batch = asyncio.run(go())
    assert done == [200] * 12
    assert batch["peak_rows"] > 8 and batch["rows"] == 0


def test_n_choices_share_one_prompt_each_equal_to_a_solo_run_with_its_seed(llama):
    """n = 3 (streaming and not): choice i is the solo answer with the seed plus i, the
    usage counts every choice's tokens once, the prompt once; n = 9 is refused."""
    prompt = [3 + (k * 29) % 500 for k in range(40)]
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.9,
          "extra_body": {"ignore_eos": True}}  # fmt: skip

    async def go():
        async with tiny_decode_node(llama) as url, openai.AsyncOpenAI(
            base_url=url, api_key=TOKEN, max_retries=0
        ) as c:  # fmt: skip
            solo = [(await c.completions.create(seed=7 + i, **kw)).choices[0].text
                    for i in range(3)]  # fmt: skip
            whole = await c.completions.create(seed=7, n=3, **kw)
            streamed, reasons = ["", "", ""], {}
            async for chunk in await c.completions.create(seed=7, n=3, stream=True, **kw):
                for ch in chunk.choices:
                    streamed[ch.index] += ch.text
                    if ch.finish_reason:
                        reasons[ch.index] = ch.finish_reason
            with pytest.raises(openai.BadRequestError) as refused:
                await c.completions.create(seed=7, n=9, **kw)
            return solo, whole, streamed, reasons, refused.value

    solo, whole, streamed, reasons, refused = asyncio.run(go())
    assert [ch.index for ch in whole.choices] == [0, 1, 2]
    assert [ch.text for ch in whole.choices] == solo == streamed
    assert len(set(solo)) > 1  # the seeds differ, and so do the answers
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert whole.usage.prompt_tokens == 40 and whole.usage.completion_tokens == 36
    assert refused.status_code == 400 and refused.body["param"] == "n"


def test_a_request_arriving_while_7_others_decode_finishes_before_any_of_them(llama):
    """Seven long streams decode; an eighth request arrives once each has a few tokens: its
    first token and its end come before any of the seven ends (it joined their steps, it
    did not queue behind them), with its solo text."""
    log: list[tuple[str, str]] = []

    async def go():
        async with tiny_decode_node(llama) as url, openai.AsyncOpenAI(
            base_url=url, api_key=TOKEN, max_retries=0
        ) as c:  # fmt: skip
            longs = [asyncio.ensure_future(_stream(c, [3 + (i * 7 + k) % 500 for k in range(20)],
                                                   LONG, log, f"L{i}"))
                     for i in range(7)]  # fmt: skip
            for _ in range(40_000):  # until each has streamed a few tokens (bounded)
                if all(log.count((f"L{i}", "token")) >= 3 for i in range(7)):
                    break
                await asyncio.sleep(0.005)
            late = await _stream(c, list(range(60, 100)), 8, log, "N")
            await asyncio.gather(*longs)
            solo = await _stream(c, list(range(60, 100)), 8, [], "N")
        return late, solo

    late, solo = asyncio.run(go())
    first_long_end = min(log.index((f"L{i}", "done")) for i in range(7))
    assert log.index(("N", "token")) < log.index(("N", "done")) < first_long_end
    assert late == solo
