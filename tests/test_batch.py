"""The decode batch (backends/mlx_batch.py through node/decode.py): requests that decode at
the same time share one forward per step, each with its own sampling, log-probabilities and
adjustments, and each request's tokens equal its solo run's. Rows join and leave mid-batch;
a cancelled row leaves at once; a join the ledger has no room for waits; the ledger gets its
bytes back. Asserted by tokens, shapes, counts and the order of events, never by a clock.
In process, with a real MLX backend on the tiny Llama; through the OpenAI API in
test_concurrency.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from exo_split.node.decode import Coordinator
from exo_split.tokenizer import TextCodec
from exo_split.transport.client import Timeouts
from exo_split.transport.limits import KVLedger
from exo_split.transport.messages import GenerateRequest

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def backend(mlx_llama):
    return mlx_llama


@pytest.fixture()
def coordinator(backend, llama, compute):
    async def local(req, n):
        return None, None

    co = Coordinator(backend, TextCodec(llama), compute, token=None, timeouts=Timeouts(),
                     session=lambda: None, choose_peer=local)  # fmt: skip
    co.ledger = KVLedger(2**34)
    co.count_in(co.ledger)
    return co


class Forwards:
    """The model, counting its forwards by batch size."""

    def __init__(self, model):
        self.model, self.args, self.sizes = model, model.args, []

    def __call__(self, tokens, cache=None):
        self.sizes.append(tokens.shape[0])
        return self.model(tokens, cache=cache)


def _body(i: int, **extra) -> dict:
    ids = [(17 * i + 5 * k) % 500 + 3 for k in range(12 + 9 * i)]
    return {"token_ids": ids, "max_tokens": 30 + 7 * i, "ignore_eos": True, **extra}


BODIES = [
    _body(0),
    _body(1, sampling={"temperature": 0.8, "seed": 11}),
    _body(2, logprobs=3),
    _body(3, sampling={"temperature": 0.9, "top_p": 0.8, "seed": 5}),
    _body(4, adjust={"presence": 0.7, "bias": {9: 3.0}}),
]


def _request(body: dict) -> GenerateRequest:
    """/v1/generate's fields, plus the OpenAI layer's logprobs and adjust."""
    extra = {k: body[k] for k in ("logprobs", "adjust") if k in body}
    plain = {k: v for k, v in body.items() if k not in extra}
    return dataclasses.replace(GenerateRequest.from_json(plain), **extra)


async def _gen(co, body, log=None, who=None, **kw):
    async def emit(event):
        if log is not None and event["type"] == "token":
            log.append((who, "token"))

    done = await co.generate(_request(body), emit, arrived=0.0, **kw)
    if log is not None:
        log.append((who, "done"))
    return done


def test_requests_at_once_share_each_step_and_equal_their_solo_runs(coordinator):
    co = coordinator

    async def go():
        solo = [await _gen(co, b) for b in BODIES]
        co.batch.batcher.model = forwards = Forwards(co.batch.batcher.model)
        together = await asyncio.gather(*[_gen(co, b) for b in BODIES])
        return solo, together, forwards

    solo, together, forwards = asyncio.run(go())
    for s, t in zip(solo, together, strict=True):
        assert t["tokens"] == s["tokens"]
        assert (
            t["report"]["timeline"]["decode"]["steps"] == s["report"]["timeline"]["decode"]["steps"]
        )
    assert [s["report"]["timeline"]["decode"]["batch"]["max"] for s in solo] == [1] * 5
    assert all(t["report"]["timeline"]["decode"]["batch"]["max"] >= 2 for t in together)
    assert all(t["report"]["timeline"]["decode"]["queue_wait_s"] >= 0 for t in together)
    # One forward per step for all of them, not one per sequence: fewer forwards than the
    # tokens they decoded, and forwards of up to all five at once.
    decoded = sum(t["report"]["timeline"]["decode"]["steps"] for t in together)
    assert max(forwards.sizes) == 5 and len(forwards.sizes) < decoded / 2
    assert co.ledger.held == 0 and co.batch.batcher.describe()["rows"] == 0


def test_logprobs_beside_others_equal_the_solo_run(coordinator):
    co = coordinator
    body = BODIES[2]

    async def collect(b):
        events = []

        async def emit(event):
            if event["type"] == "token":
                events.append(event)

        await co.generate(_request(b), emit, arrived=0.0)
        return events

    async def go():
        solo = await collect(body)
        both = await asyncio.gather(collect(body), _gen(co, BODIES[0]), _gen(co, BODIES[3]))
        return solo, both[0]

    solo, beside = asyncio.run(go())
    assert [e["id"] for e in beside] == [e["id"] for e in solo]
    for a, b in zip(solo, beside, strict=True):
        assert abs(a["logprob"] - b["logprob"]) < 1e-4
        assert [i for i, _ in a["top_logprobs"]] == [i for i, _ in b["top_logprobs"]]


def test_a_row_joins_mid_batch_and_its_slot_is_compacted_once_it_leaves(coordinator):
    """B arrives while A decodes, shares A's steps, finishes first; while A still decodes the
    batch comes to hold A alone (B's slot compacted away, its bytes back in the ledger)."""
    co = coordinator
    seen: list[dict] = []
    log: list[tuple[str, str]] = []
    long = dict(_body(0), max_tokens=160)

    async def go():
        solo_b = await _gen(co, BODIES[1])
        a = asyncio.ensure_future(_gen(co, long, log, "A"))
        for _ in range(20_000):  # until A has some tokens (bounded)
            if log.count(("A", "token")) >= 5:
                break
            await asyncio.sleep(0.002)
        b = await _gen(co, BODIES[1], log, "B")
        for _ in range(20_000):  # until B's slot is compacted away, or A ends (bounded)
            d = co.batch.batcher.describe()
            if (d["rows"], d["dead_rows"]) == (1, 0) or a.done():
                break
            await asyncio.sleep(0.002)
        seen.append(d | {"a_done": a.done()})
        return solo_b, b, await a

    solo_b, b, a = asyncio.run(go())
    assert b["tokens"] == solo_b["tokens"]
    assert b["report"]["timeline"]["decode"]["batch"]["min"] == 2  # every step beside A
    assert log.index(("B", "done")) < log.index(("A", "done"))
    assert seen[0]["rows"] == 1 and seen[0]["dead_rows"] == 0 and not seen[0]["a_done"]
    spread = a["report"]["timeline"]["decode"]["batch"]
    assert spread["min"] == 1 and spread["max"] == 2  # alone, then beside B, then alone
    assert co.ledger.held == 0


def test_a_cancelled_row_leaves_at_once_and_the_others_go_on(coordinator, compute):
    co = coordinator
    log: list[tuple[str, str]] = []
    long = dict(_body(0), max_tokens=120)

    async def go():
        solo = await _gen(co, long)
        a = asyncio.ensure_future(_gen(co, long, log, "A"))
        b = asyncio.ensure_future(_gen(co, dict(_body(3), max_tokens=400), log, "B"))
        for _ in range(20_000):
            if log.count(("B", "token")) >= 5 and log.count(("A", "token")) >= 5:
                break
            await asyncio.sleep(0.002)
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        cancelled_at = log.count(("A", "token"))
        left = co.batch.batcher.describe()
        return solo, await a, cancelled_at, left

    solo, a, cancelled_at, left = asyncio.run(go())
    assert a["tokens"] == solo["tokens"]  # the batch went on, undisturbed
    assert cancelled_at < len(a["tokens"])  # B left while A still decoded
    assert left["rows"] == 1  # once the cancel returned, B's row was out
    assert compute.submit(lambda: "free").result(timeout=5) == "free"
    assert co.ledger.held == 0


def test_a_join_the_ledger_has_no_room_for_waits_until_a_row_leaves(coordinator):
    """With no room to copy the batch, B (arriving while A decodes) gets its first token (the
    prefill's) but decodes only once A has left, alone, to the same tokens."""
    co = coordinator
    co.batch.batcher.take = lambda n: False
    log: list[tuple[str, str]] = []
    long = dict(_body(0), max_tokens=60)

    async def go():
        solo_b = await _gen(co, BODIES[1])
        a = asyncio.ensure_future(_gen(co, long, log, "A"))
        for _ in range(20_000):
            if log.count(("A", "token")) >= 5:
                break
            await asyncio.sleep(0.002)
        b = await _gen(co, BODIES[1], log, "B")
        return solo_b, b, await a

    solo_b, b, a = asyncio.run(go())
    assert b["tokens"] == solo_b["tokens"]
    b_tokens = [i for i, e in enumerate(log) if e == ("B", "token")]
    assert b_tokens[1] > log.index(("A", "done"))  # its decode began after A's end
    # Its report says it waited to join: longer than A's last tokens took to come.
    a_times = a["report"]["timeline"]["token_times"]
    waited = b["report"]["timeline"]["decode"]["queue_wait_s"]
    assert waited > a_times[-1] - a_times[-5] > 0
    assert b["report"]["timeline"]["decode"]["batch"]["max"] == 1


def test_a_failing_step_ends_every_row_with_the_error_and_the_node_goes_on(coordinator):
    co = coordinator
    real = co.batch.batcher.model
    calls = [0]

    class Breaks(Forwards):
        def __call__(self, tokens, cache=None):
            calls[0] += 1
            if calls[0] == 12:
                raise RuntimeError("the device went away")
            return self.model(tokens, cache=cache)

    async def go():
        co.batch.batcher.model = Breaks(real)
        results = await asyncio.gather(*[_gen(co, b) for b in BODIES[:3]], return_exceptions=True)
        co.batch.batcher.model = real
        again = await _gen(co, BODIES[0])
        return results, again

    results, again = asyncio.run(go())
    assert all(isinstance(r, RuntimeError) and "went away" in str(r) for r in results)
    assert len(again["tokens"]) == BODIES[0]["max_tokens"]
    assert co.batch.batcher.describe()["rows"] == 0 and co.ledger.held == 0


def test_a_row_that_asks_to_stop_before_its_first_step_leaves_cleanly(coordinator):
    """until() true at the first token: the row never steps, its cache is not lost."""
    co = coordinator

    async def go():
        return await _gen(co, BODIES[0], until=lambda: True)

    done = asyncio.run(go())
    assert done["stopped_by"] == "until" and len(done["tokens"]) == 1
    assert co.batch.batcher.describe()["rows"] == 0


def test_a_local_prefill_beside_decodes_is_sliced_to_about_a_quarter_second(
    coordinator, monkeypatch
):
    """While others decode, a local prefill runs in slices of SLICE_S at the node's learned
    prefill speed (within [MIN_SLICE, LOCAL_SLICE]); alone, in LOCAL_SLICE ones. Either way
    the answer is the same."""
    co = coordinator
    co.local_speed = lambda: 10.0  # tok/s: 2.5 positions a slice, so MIN_SLICE (32)
    body = dict(_body(9), max_tokens=4)  # a 93-token prompt
    calls = []
    real = co.backend.prefill

    def counted(ids, **kw):
        calls.append(len(ids))
        return real(ids, **kw)

    monkeypatch.setattr(co.backend, "prefill", counted)
    log: list[tuple[str, str]] = []

    async def go():
        alone = await _gen(co, body)
        solo_calls = list(calls)
        a = asyncio.ensure_future(_gen(co, dict(_body(0), max_tokens=200), log, "A"))
        for _ in range(20_000):
            if log.count(("A", "token")) >= 3:
                break
            await asyncio.sleep(0.002)
        calls.clear()
        beside = await _gen(co, body)
        return alone, solo_calls, list(calls), beside, await a

    alone, solo_calls, beside_calls, beside, a = asyncio.run(go())
    assert solo_calls == [93]  # nothing else decoding: one job
    assert beside_calls == [32, 64, 93]  # beside A: 32-position jobs
    assert beside["tokens"] == alone["tokens"]
    assert len(a["tokens"]) == 200
    co.local_speed = lambda: 1000.0
    assert co._slice() == 512  # idle now: whole slices


def test_the_local_slice_is_the_users_to_choose():
    """`--local-slice` bounds a job; `--local-slice-ms` sizes it while others decode (0:
    always the bound); nonsense is refused by name, not a traceback."""
    import pytest

    from exo_split.cli.node import slicing
    from exo_split.errors import ExoSplitError

    assert slicing(512, 250).positions(1000.0, busy=True) == 250
    assert slicing(512, 250).positions(1000.0, busy=False) == 512
    assert slicing(512, 250).positions(None, busy=True) == 512  # speed not known yet
    assert slicing(512, 2000).positions(1000.0, busy=True) == 512  # within the bound
    assert slicing(512, 0).positions(1000.0, busy=True) == 512
    assert slicing(100, 250).positions(10.0, busy=True) == 32  # at least 32 positions
    assert slicing(16, 250).positions(10.0, busy=True) == 16  # ... unless the bound is less
    with pytest.raises(ExoSplitError, match="--local-slice must be >= 1"):
        slicing(0, 250)
    with pytest.raises(ExoSplitError, match="--local-slice-ms >= 0"):
        slicing(512, -1)


def test_a_joiner_waiting_for_room_that_is_cancelled_leaves_without_waiting_for_the_batch(
    coordinator,
):
    co = coordinator
    co.batch.batcher.take = lambda n: False
    log: list[tuple[str, str]] = []
    long = dict(_body(0), max_tokens=150)

    async def go():
        a = asyncio.ensure_future(_gen(co, long, log, "A"))
        for _ in range(20_000):
            if log.count(("A", "token")) >= 5:
                break
            await asyncio.sleep(0.002)
        b = asyncio.ensure_future(_gen(co, BODIES[1], log, "B"))
        for _ in range(20_000):  # B's first token (the prefill's) is out; it waits to join
            if co.batch.batcher.describe()["joining"] == 1 or a.done():
                break
            await asyncio.sleep(0.002)
        waiting = co.batch.batcher.describe()["joining"]
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        a_done_then = a.done()
        return waiting, a_done_then, await a

    waiting, a_done_then, a = asyncio.run(go())
    assert waiting == 1 and not a_done_then  # B left while A still decoded
    assert len(a["tokens"]) == 150
    after = co.batch.batcher.describe()
    assert after["rows"] == 0 and after["joining"] == 0


def test_a_receiving_cache_is_allocated_between_the_batchs_steps(coordinator, backend, compute,
                                                                  monkeypatch):  # fmt: skip
    """A new cache for a prompt to be received (node/remote.py's _new_cache): on an idle node
    in one job; while a row decodes, a layer per job (PART_BYTES made tiny) with at least one
    of the batch's steps between any two, so no row waits for the whole allocation. Either way
    it is the cache new_cache makes."""
    from exo_split.node import remote

    co = coordinator
    monkeypatch.setattr(remote, "PART_BYTES", 1)
    parts, at = backend.new_cache_parts, []

    def counted(capacity, **kw):  # each part notes the batch's step count as it runs
        cache, jobs = parts(capacity, **kw)
        return cache, [lambda j=j: (at.append(co.batch.batcher.steps), j()) for j in jobs]

    monkeypatch.setattr(backend, "new_cache_parts", counted)
    run, jobs = co._run, []

    async def counted_run(fn, *args, **kw):  # the compute jobs the coordinator submits
        jobs.append(fn)
        return await run(fn, *args, **kw)

    monkeypatch.setattr(co, "_run", counted_run)
    log: list[tuple[str, str]] = []

    async def go():
        idle = await co._new_cache(300)
        assert len(jobs) == 1  # nobody to wait: one job
        at.clear()
        a = asyncio.ensure_future(_gen(co, dict(_body(0), max_tokens=200), log, "A"))
        for _ in range(20_000):  # until A decodes in the batch (bounded)
            if log.count(("A", "token")) >= 3:
                break
            await asyncio.sleep(0.002)
        before = len(jobs)
        busy = await co._new_cache(300)
        assert len(jobs) - before == 1 + backend.spec.n_layers  # the layers' own jobs
        return idle, busy, a.done(), await a

    idle, busy, a_done, a = asyncio.run(go())
    assert not a_done and len(a["tokens"]) == 200
    assert len(at) == backend.spec.n_layers > 1
    assert all(x < y for x, y in zip(at, at[1:], strict=False)), at  # a step between each two
    ref = compute.submit(backend.new_cache, 300).result()

    def shape(cache):
        return [(c.keys.shape, c.values.shape, c.keys.dtype, c.offset) for c in cache]

    assert shape(idle) == shape(busy) == shape(ref)


@pytest.mark.parametrize("staged", ["every layer", "three buffers"])
def test_a_joiners_batch_cache_is_staged_while_it_prefills_and_the_join_writes_into_it(
        coordinator, monkeypatch, staged):  # fmt: skip
    """B, arriving while A decodes, is expected by the batch: while B's prefill waits (held
    here until the staging is done, or has three buffers and is stopped there), the batch
    cache for A and B is allocated a buffer after each of A's steps (STAGE_BYTES made tiny);
    B's join writes both rows into those very buffers (allocating the rest, if any), and
    both decode to their solo runs' tokens. A request expected and then gone (cancelled
    before it joined) gets its staged bytes back to the ledger at the next step."""
    from exo_split.backends import mlx_batch_cache

    co, batcher = coordinator, coordinator.batch.batcher
    monkeypatch.setattr(mlx_batch_cache, "STAGE_BYTES", 1)
    n_layers = len(co.backend.new_cache(8))
    want = 2 * n_layers if staged == "every layer" else 3
    grow = mlx_batch_cache.Staged.grow
    monkeypatch.setattr(mlx_batch_cache.Staged, "grow", lambda st, cache, take: (
        grow(st, cache, take) if len(st.arrays) < want else 0))  # fmt: skip
    log: list[tuple[str, str]] = []
    long, b_body = dict(_body(0), max_tokens=200), dict(_body(2), max_tokens=40)
    run, staged_at, steps_at = co._run, [], []

    async def held_run(fn, *args, **kw):  # B's prefill waits until its batch cache is staged
        if getattr(fn, "__name__", "") == "_prefill_slice" and log.count(("A", "token")) > 0:
            for _ in range(20_000):  # (bounded)
                if batcher._staged and len(batcher._staged.arrays) == want or a_done():
                    break
                await asyncio.sleep(0.002)
            staged_at.append(batcher.describe())
            staged_at.append(list(batcher._staged.arrays))
        return await run(fn, *args, **kw)

    def a_done():
        return bool(log.count(("A", "done")))

    async def go():
        solo_a, solo_b = await _gen(co, long), await _gen(co, b_body)
        a = asyncio.ensure_future(_gen(co, long, log, "A"))
        for _ in range(20_000):  # until A decodes (bounded)
            if log.count(("A", "token")) >= 3:
                break
            await asyncio.sleep(0.002)
        monkeypatch.setattr(co, "_run", held_run)
        b = asyncio.ensure_future(_gen(co, b_body, log, "B"))
        for _ in range(20_000):  # until B decodes beside A (bounded)
            if log.count(("B", "token")) >= 3 or b.done():
                break
            await asyncio.sleep(0.002)
        joined = [x for c in batcher.cache for x in (c.keys, c.values)]
        b = await b
        for _ in range(20_000):  # until B's slot is compacted away (bounded)
            d = batcher.describe()
            if (d["rows"], d["dead_rows"]) == (1, 0) or a.done():
                break
            await asyncio.sleep(0.002)
        # Expected, then gone before joining: its staged layers go back at the next steps.
        extra = batcher.extra
        ticket = batcher.expect(50, 20)
        for _ in range(20_000):  # (bounded)
            if batcher.describe()["staged_layers"] >= 1 or a.done():
                break
            await asyncio.sleep(0.002)
        grown = batcher.extra
        batcher.unexpect(ticket)
        steps_at.append(batcher.steps)
        for _ in range(20_000):  # (bounded)
            if batcher.describe()["staged_layers"] == 0 or a.done():
                break
            await asyncio.sleep(0.002)
        steps_at.append(batcher.steps)
        after = (batcher.extra, a.done())
        return solo_a, solo_b, await a, b, joined, extra, grown, after

    solo_a, solo_b, a, b, joined, extra, grown, after = asyncio.run(go())
    assert a["tokens"] == solo_a["tokens"] and b["tokens"] == solo_b["tokens"]
    described, buffers = staged_at[0], staged_at[1]
    assert described["staged_layers"] == want // 2 and described["expected"] == 1
    assert len(buffers) == want and len(joined) == 2 * n_layers
    assert all(x is buf for x, buf in zip(joined, buffers, strict=False))  # the staged ones
    assert not any(x is buf for x in joined[want:] for buf in buffers)  # the rest its own
    assert joined[0].shape[0] == 2  # A's row and B's
    assert b["report"]["timeline"]["decode"]["batch"]["max"] == 2
    assert grown > extra and after == (extra, False)  # staged, then given back, A still going
    assert steps_at[1] > steps_at[0]
    assert batcher.describe()["expected"] == 0 and co.ledger.held == 0
