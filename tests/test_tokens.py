"""The decode node after the handoff (node/tokens.py, the decode half of node/decode.py): one
compute job, tokens in batches, the reasons a generation stops, and an early stop. In
process, with a real MLX backend; the network half is test_node.py's."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import numpy as np
import pytest

from exo_split.node.decode import Coordinator
from exo_split.node.tokens import decode_events
from exo_split.sampling import GREEDY, Sampling
from exo_split.tokenizer import TextCodec
from exo_split.transport.client import Timeouts
from exo_split.transport.messages import GenerateRequest


@pytest.fixture(scope="module")
def backend(mlx_llama):
    return mlx_llama


def _cache(backend, compute, n_prompt=20, capacity=200):
    ids = np.random.default_rng(n_prompt).integers(3, 512, n_prompt).tolist()
    return compute.submit(lambda: backend.prefill(ids, capacity=capacity).cache).result()


def _direct(backend, compute, n, sampling=GREEDY):
    cache = _cache(backend, compute)
    return compute.submit(
        lambda: list(backend.decode(cache, 5, max_tokens=n, sampling=sampling))
    ).result()


def test_a_slow_consumer_gets_the_tokens_in_fewer_batches_in_order(backend, compute):
    """A consumer that reads nothing after its first batch until the decode has produced
    every token (an ordering, not a sleep) gets all the rest in one batch: the decode never
    waited for it, and the pipe coalesced."""
    n = 40
    cache = _cache(backend, compute)
    finished = threading.Event()

    async def consume():
        batches = []

        def steps(stop):
            yield from backend.decode(cache, 5, max_tokens=n, sampling=GREEDY, should_stop=stop)
            finished.set()  # after the last token was handed to the pipe

        async with contextlib.aclosing(decode_events(compute, steps)) as events:
            async for batch in events:
                batches.append(batch)
                if len(batches) == 1:  # a client that stops reading for a while
                    loop = asyncio.get_running_loop()
                    assert await loop.run_in_executor(None, finished.wait, 60)
        return batches

    batches = asyncio.run(consume())
    assert [t for b in batches for t, _ in b] == _direct(backend, compute, n)
    assert len(batches) == 2  # the first, then everything produced meanwhile
    stamps = [at for b in batches for _, at in b]
    assert stamps == sorted(stamps)  # stamped on the compute thread as produced


def test_leaving_early_stops_the_job_and_waits_for_it(backend, compute):
    n = 180
    cache = _cache(backend, compute)
    seen = []

    async def consume():
        def steps(stop):
            return backend.decode(cache, 5, max_tokens=n, sampling=GREEDY, should_stop=stop)

        async with contextlib.aclosing(decode_events(compute, steps)) as events:
            async for batch in events:
                seen.extend(batch)
                if len(seen) >= 5:
                    raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(consume())
    # The job has returned (the executor's one thread is free at once), the in-flight step
    # finished, and far fewer than n steps ran.
    offset = compute.submit(lambda: cache[0].offset).result(timeout=5)
    assert 20 + len(seen) <= offset < 20 + n - 1


def test_an_error_in_the_decode_reaches_the_consumer(compute):
    def steps(stop):
        yield 1
        raise ValueError("the device is on fire")

    async def consume():
        async for _ in decode_events(compute, steps):
            pass

    with pytest.raises(ValueError, match="on fire"):
        asyncio.run(consume())


# ---- the coordinator: what a generation reports ---------------------------------------------


@pytest.fixture(scope="module")
def coordinator(backend, llama, compute):
    async def local(req, n):
        return None, None

    return Coordinator(backend, TextCodec(llama), compute, token=None, timeouts=Timeouts(),
                       session=lambda: None, choose_peer=local)  # fmt: skip


def _generate(coordinator, body, **kwargs):
    events: list[dict] = []
    writes: list[list[dict]] = []

    async def emit(event):
        events.append(event)

    async def emit_many(batch):
        writes.append(batch)
        events.extend(batch)

    async def run():
        many = emit_many if kwargs.pop("batched", False) else None
        return await coordinator.generate(GenerateRequest.from_json(body), emit, arrived=0.0,
                                          emit_many=many, **kwargs)  # fmt: skip

    done = asyncio.run(run())
    return done, events, writes


def test_done_says_why_the_decode_stopped(coordinator, monkeypatch):
    body = {"token_ids": [1, 7, 9, 11], "max_tokens": 12}
    done, events, writes = _generate(coordinator, body, batched=True)
    assert done["stopped_by"] == "max_tokens" and len(done["tokens"]) == 12
    assert [e["id"] for e in events if e["type"] == "token"] == done["tokens"]
    assert writes and all(len(w) >= 1 for w in writes)
    text = "".join(e["text"] for e in events if e["type"] == "token") + done["tail"]
    assert text == done["text"]
    decode = done["report"]["timeline"]["decode"]
    assert decode["backend"] == "mlx" and decode["quantization"] is None
    assert decode["steps"] == 11 and decode["stopped_by"] == "max_tokens"
    # An end-of-turn token ends it there (this checkpoint has none: pretend token 6 is one).
    eot = done["tokens"][5]
    monkeypatch.setattr(coordinator.codec, "eos_ids", frozenset({eot}))
    done2, _, _ = _generate(coordinator, body)
    assert done2["stopped_by"] == "end_of_turn"
    assert done2["tokens"] == done["tokens"][: done["tokens"].index(eot) + 1]


def test_until_ends_the_generation_at_that_token_and_done_still_comes(coordinator):
    body = {"token_ids": [1, 7, 9, 11], "max_tokens": 40, "sampling": {"temperature": 0.8}}
    full, _, _ = _generate(coordinator, body)
    seen: list[int] = []

    def until():  # asked after each emitted token: count them as a consumer would
        seen.append(1)
        return len(seen) >= 7

    done, events, _ = _generate(coordinator, body, until=until)
    assert done["stopped_by"] == "until" and done["tokens"] == full["tokens"][:7]
    # Nothing past that token reached the client either.
    assert [e["id"] for e in events if e["type"] == "token"] == full["tokens"][:7]
    assert done["report"]["generated_tokens"] == 7


def test_a_cancelled_generation_frees_the_compute_thread(coordinator, compute):
    body = {"token_ids": [1, 7, 9, 11], "max_tokens": 150}
    started = threading.Event()

    async def run():
        async def emit(event):
            if event["type"] == "token":
                started.set()

        task = asyncio.ensure_future(
            coordinator.generate(GenerateRequest.from_json(body), emit, arrived=0.0)
        )
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert compute.submit(lambda: "free").result(timeout=5) == "free"


def test_sampled_requests_report_the_host_checks(coordinator):
    body = {"token_ids": [1, 7, 9, 11], "max_tokens": 30,
            "sampling": Sampling(1.5, seed=3).to_dict()}  # fmt: skip
    done, _, _ = _generate(coordinator, body)
    decode = done["report"]["timeline"]["decode"]
    assert decode["steps"] == 29
    assert 0 <= decode["host_corrected"] <= decode["host_checked"] <= 29
