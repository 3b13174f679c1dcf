"""The prefix cache (node/prefix.py): take vs copy, the last position always computed, LRU
eviction under a byte limit, the ledger evicting before it refuses; resumed prefills in both
backends equal to whole ones; the plan of a stream that starts past the decode node's prefix."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from reference import prompt_ids

from exo_split.node.prefill import streamed_chunks
from exo_split.node.prefix import PrefixCache
from exo_split.transport import wire
from exo_split.transport.limits import KVLedger, Refused

BYTES_PER_POSITION = 10
TOL = 1e-4


class FakeCache:
    """Stores the token id at each position, so what a request reuses can be checked."""

    def __init__(self, capacity: int):
        self.data = np.zeros(capacity, dtype=np.int64)
        self.length = 0


class FakeOps:
    def __init__(self):
        self.forks = 0

    def trim(self, c, n):
        assert n <= c.length
        c.length = n

    def reserve(self, c, capacity):
        if len(c.data) < capacity:
            c.data = np.concatenate([c.data, np.zeros(capacity - len(c.data), np.int64)])

    def fork(self, c, n, capacity):
        self.forks += 1
        out = FakeCache(max(capacity, n))
        out.data[:n] = c.data[:n]
        out.length = n
        return out

    def cache_nbytes(self, c):
        return len(c.data) * BYTES_PER_POSITION


def run(pc: PrefixCache, ids, reply=(), capacity=None):
    """One request: reuse what the cache has, 'compute' the rest, keep prompt + reply."""
    co = pc.checkout(ids)
    capacity = capacity or len(ids) + len(reply)
    cache = pc.materialize(co, capacity=capacity) or FakeCache(capacity)
    assert (cache.data[: co.cached] == np.asarray(ids[: co.cached])).all()
    held = list(ids) + list(reply)
    cache.data[co.cached : len(held)] = held[co.cached :]
    cache.length = len(held)
    pc.put(held, cache)
    return co, cache


def test_a_continuing_turn_takes_the_entry_without_a_copy():
    ops = FakeOps()
    pc = PrefixCache(ops, limit_bytes=10**9)
    turn1 = list(range(100))
    _, c1 = run(pc, turn1, reply=[7, 8, 9], capacity=200)
    co, c2 = run(pc, [*turn1, 7, 8, 9, 50, 51])
    assert (co.how, co.cached) == ("take", 103) and c2 is c1 and ops.forks == 0
    assert len(pc) == 1  # the new entry replaced the one it extends


def test_the_last_prompt_position_is_always_computed():
    pc = PrefixCache(FakeOps(), limit_bytes=10**9)
    run(pc, list(range(50)), reply=[1, 2])
    co = pc.checkout(list(range(50)))  # the same prompt again (a regenerate)
    assert (co.how, co.cached) == ("take", 49)


def test_a_re_rendered_last_turn_is_trimmed_to_the_common_prefix():
    pc = PrefixCache(FakeOps(), limit_bytes=10**9)
    run(pc, list(range(60)), reply=[500, 501, 502])
    co, cache = run(pc, [*range(60), 500, 999, 42])  # the template rendered the reply otherwise
    assert (co.how, co.cached) == ("take", 61)
    assert cache.data[:63].tolist() == [*range(60), 500, 999, 42] and cache.length == 63


def test_a_branch_copies_the_shared_part_and_the_entry_stays():
    ops = FakeOps()
    pc = PrefixCache(ops, limit_bytes=10**9)
    doc = list(range(300))
    run(pc, doc, reply=[1] * 10)
    co, _ = run(pc, [*doc[:200], 5, 6, 7])  # shares 200 of 310 positions: more than the slack
    assert (co.how, co.cached, ops.forks) == ("copy", 200, 1)
    assert len(pc) == 2 and pc.describe()["tokens"] == [310, 203]


def test_a_checkout_is_settled_once_whichever_comes_first():
    pc = PrefixCache(FakeOps(), limit_bytes=10**9)
    run(pc, list(range(100)))
    co = pc.checkout([*range(100), 1])
    assert pc.materialize(co, capacity=200) is not None
    pc.cancel(co)  # every path out of a request cancels: nothing happens once materialized
    assert len(pc) == 0
    co = pc.checkout(list(range(40)))  # none: the entry is the request's now
    run(pc, list(range(300)))
    co = pc.checkout([*range(100), 7])  # a copy: the entry is pinned
    pc.cancel(co)
    assert pc.materialize(co, capacity=200) is None  # the request was refused meanwhile
    assert pc.evict(10**9) > 0 and len(pc) == 0  # unpinned exactly once


class RecurrentOps(FakeOps):
    """A hybrid model's cache: its state is that of its whole length (reuse_floor), so only
    a snapshot serves a shorter prefix; `restore` puts one back and cuts the KV to it."""

    def __init__(self):
        super().__init__()
        self.restored: list[int] = []

    def reuse_floor(self, c):
        return c.length

    def fork(self, c, n, capacity):
        raise AssertionError("a recurrent layer's state cannot be copied at a shorter length")

    def restore(self, c, states):
        self.restored.append(states[0].token_start)
        c.length = states[0].token_start


def _snapshot(position: int, nbytes: int = 1000):
    from exo_split.layers import LayerState

    return [LayerState(0, position, (np.zeros(nbytes, np.uint8),), (False,), "float32")]


def test_a_hybrids_next_turn_reuses_the_prompts_snapshot_when_the_reply_is_rendered_otherwise():
    """The reply as the next turn's template renders it differs from what was generated (a
    reasoning model's thinking dropped): the entry's own end is no use, its snapshot at the
    end of the prompt is. The entry is taken (the reply's part dropped), its state restored
    there; a prompt sharing less than the snapshot, or another client's, reuses nothing."""
    ops = RecurrentOps()
    pc = PrefixCache(ops, limit_bytes=10**9)
    prompt, reply = list(range(100)), [700 + i for i in range(90)]  # a reply past the slack
    cache = FakeCache(300)
    cache.data[:190] = prompt + reply
    cache.length = 189  # its last token was never fed
    pc.put((prompt + reply)[:189], cache, "", [_snapshot(100), _snapshot(4), _snapshot(189)])
    assert pc.nbytes == 300 * BYTES_PER_POSITION + 1000  # one snapshot kept: at 100
    assert pc.checkout([*prompt[:60], 1, 2]).how == "none"  # short of the snapshot
    assert pc.checkout([*prompt, 5], "another client").how == "none"
    second = [*prompt, 9, 9, 9, 41]  # the reply rendered otherwise, then a new user turn
    co = pc.checkout(second)
    assert (co.how, co.cached) == ("take", 100) and len(pc) == 0
    pc.cancel(co)  # refused meanwhile: the entry comes back, its snapshot with it
    assert len(pc) == 1 and pc.nbytes == 300 * BYTES_PER_POSITION + 1000
    co = pc.checkout(second)
    got = pc.materialize(co, capacity=260)
    assert got is cache and ops.restored == [100] and got.length == 100 and ops.forks == 0
    assert pc.stats["from_snapshots"] == 2
    # the whole entry still serves a prompt that continues all of it, without a snapshot
    cache.length = 189
    pc.put((prompt + reply)[:189], cache, "")
    co = pc.checkout([*prompt, *reply, 3])
    assert (co.how, co.cached, co.snapshot) == ("take", 189, None)


def test_nothing_shared_reuses_nothing():
    pc = PrefixCache(FakeOps(), limit_bytes=10**9)
    run(pc, [1, 2, 3])
    assert pc.checkout([9, 9, 9]).how == "none"


def test_least_recently_used_entries_go_first_when_the_limit_is_passed():
    pc = PrefixCache(FakeOps(), limit_bytes=500 * BYTES_PER_POSITION)
    a, b, c = ([k * 1000 + i for i in range(200)] for k in (1, 2, 3))
    run(pc, a)
    run(pc, b)
    pc.cancel(pc.checkout(a[:50]))  # a is used again (a copy, cancelled): b is now the oldest
    run(pc, c)  # 600 positions > 500: b goes
    d = pc.describe()
    assert d["entries"] == 2 and d["evicted"] == 1 and d["bytes"] <= d["limit"]
    assert pc.checkout(b).how == "none" and pc.checkout(a).cached == 199


def test_an_entry_larger_than_the_limit_is_not_kept():
    pc = PrefixCache(FakeOps(), limit_bytes=50 * BYTES_PER_POSITION)
    run(pc, list(range(60)))
    assert len(pc) == 0 and pc.nbytes == 0


def test_the_ledger_evicts_the_prefix_cache_before_it_refuses():
    pc = PrefixCache(FakeOps(), limit_bytes=800 * BYTES_PER_POSITION)
    ledger = KVLedger(limit=1000 * BYTES_PER_POSITION)
    ledger.caches.append(pc)
    for k in range(4):
        run(pc, [k * 1000 + i for i in range(200)])
    assert pc.nbytes == 800 * BYTES_PER_POSITION
    # 500 positions of work: 300 of cache must go (the two least recent entries), no refusal.
    with ledger.hold(500 * BYTES_PER_POSITION, "a request"):
        assert pc.nbytes == 400 * BYTES_PER_POSITION and len(pc) == 2
        assert ledger.held + ledger.cached <= ledger.limit
        assert pc.checkout([i for i in range(200)]).how == "none"  # the oldest went first
        # What can never fit is still refused, and work already held is never evicted.
        with pytest.raises(Refused) as exc, ledger.hold(600 * BYTES_PER_POSITION, "another"):
            pass
        assert exc.value.status == 503
    assert ledger.held == 0 and ledger.peak <= ledger.limit


def test_streamed_chunks_cover_start_to_n():
    # The prefill node holds 100, the decode node 60: [60, 100) from the cache, then computed.
    assert streamed_chunks(100, (50, 50), 60) == (40, 50, 50)
    # The decode node holds more than the prefill node: [100, 130) computed, not sent.
    assert streamed_chunks(100, (50, 50), 130) == (20, 50)
    assert streamed_chunks(0, (128, 72), 0) == (128, 72)
    for cached, compute, start in ((100, (50, 50), 60), (100, (50, 50), 130), (7, (1,), 7)):
        assert start + sum(streamed_chunks(cached, compute, start)) == cached + sum(compute)


def test_a_plan_past_the_decode_nodes_prefix_round_trips_and_is_checked():
    spec = wire.StreamSpec(2, 1, 4, wire.WireDtype.float32, 100, start=60)
    plan = wire.Plan((40,), 16, 2, start=60)
    again = wire.Plan.from_json(plan.to_json(), spec)
    assert again == plan
    assert list(again.pieces()) == [(0, 60, 40), (1, 60, 40)]
    with pytest.raises(Exception, match="start"):
        wire.Plan.from_json(wire.Plan((100,), 16, 2).to_json(), spec)  # a peer that ignored it


# ---- both backends: a resumed prefill is the whole prefill -------------------------------


@pytest.fixture(scope="module")
def backends(llama):
    from exo_split.backends import mlx_backend, torch_backend

    return {
        "torch": torch_backend.load(llama, dtype="float32", device="cpu"),
        "mlx": mlx_backend.load(llama, dtype="float32", device="cpu"),
    }


@pytest.mark.parametrize("name", ["torch", "mlx"])
@pytest.mark.parametrize(("cached", "emit_from"), [(70, 70), (70, 30), (70, 100), (119, 119)])
def test_a_resumed_prefill_equals_the_whole_one(backends, name, cached, emit_from):
    b = backends[name]
    ids = prompt_ids(120, seed=5)
    whole = b.prefill(ids)
    other = b.prefill([*ids[:cached], 9, 9, 9, 9])  # a longer cache that diverged: trimmed
    b.trim(other.cache, cached)
    pieces = []
    done = b.prefill(ids, cache=other.cache, emit_from=emit_from, chunk=32,
                     on_layer=lambda kv: pieces.append((kv.layer, kv.token_start, kv.k.copy())))  # fmt: skip
    # Equal up to float32 rounding: a suffix's matmuls have other shapes than the whole's.
    assert np.abs(done.logits - whole.logits).max() < TOL
    assert b.cache_len(done.cache) == 120
    ref = {kv.layer: kv.k for kv in b.export(whole.cache)}
    for layer in range(b.spec.n_layers):
        mine = [(s, k) for lay, s, k in pieces if lay == layer]
        at = emit_from
        for s, k in mine:
            assert s == at
            assert np.abs(k - ref[layer][:, s : s + k.shape[1]]).max() < TOL
            at += k.shape[1]
        assert at == 120


@pytest.mark.parametrize("name", ["torch", "mlx"])
def test_fork_reserve_and_nbytes(backends, name):
    b = backends[name]
    ids = prompt_ids(40, seed=6)
    done = b.prefill(ids)
    copy = b.fork(done.cache, 30, 64)
    assert b.cache_len(copy) == 30 and b.cache_nbytes(copy) >= b.cache_nbytes(done.cache)
    b.reserve(done.cache, 300)
    assert b.cache_len(done.cache) == 40
    resumed = b.prefill([*ids[:30], 7, 8], cache=copy)
    direct = b.prefill([*ids[:30], 7, 8])
    assert np.abs(resumed.logits - direct.logits).max() < TOL


def test_the_renderings_show_the_prefix_block():
    from test_report import local_timeline

    from exo_split.report import build_report, load_report, to_json
    from exo_split.report.html import render_html
    from exo_split.report.text import render_terminal

    prefix = {"decode_cached_tokens": 3412, "prefill_cached_tokens": 0, "computed_tokens": 57}
    report = build_report(replace(local_timeline(), prefix=prefix))
    doc = to_json(report)
    assert doc["prefix"] == prefix and doc["kv_bytes"] == 0
    assert load_report(doc).timeline.prefix == prefix
    line = "prefix: 3,412 tokens cached on the decode node, 0 on the prefill node; 57 computed"
    assert line in render_terminal(report, width=200) and "no KV moved" in render_html(report)


@pytest.mark.parametrize("name", ["mlx", "torch"])
def test_the_coordinator_judges_the_uncached_suffix_and_a_refused_request_gives_back(llama, name):
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from reference import reference_generate

    from exo_split.backends import load_backend
    from exo_split.node.decode import Coordinator
    from exo_split.tokenizer import TextCodec
    from exo_split.transport.client import Timeouts
    from exo_split.transport.messages import GenerateRequest

    compute = ThreadPoolExecutor(max_workers=1)
    backend = compute.submit(load_backend, name, llama, device="cpu").result()
    prefix = PrefixCache(backend, limit_bytes=64 * 2**20)
    asked = []

    async def choose(req, n):
        asked.append(n)
        return None, None

    coordinator = Coordinator(backend, TextCodec(llama), compute, token=None, timeouts=Timeouts(),
                              session=lambda: None, choose_peer=choose, prefix=prefix)  # fmt: skip

    async def emit(event):
        pass

    def generate(ids):
        req = GenerateRequest.from_json({"token_ids": ids, "max_tokens": 6})
        return asyncio.run(coordinator.generate(req, emit, arrived=0.0))

    try:
        first = prompt_ids(80, seed=7)
        done = generate(first)
        ids = first + done["tokens"] + prompt_ids(11, seed=8)[1:]
        done = generate(ids)
        assert asked == [80, len(ids) - 85]  # the policy saw the uncached suffix only
        assert done["report"]["prefix"] == {"decode_cached_tokens": 85, "prefill_cached_tokens": 0,
                                            "computed_tokens": len(ids) - 85}  # fmt: skip
        assert done["tokens"] == reference_generate(llama, ids, 6)
        # A request refused after its checkout (by the ledger, say) gives the entry back.
        again = GenerateRequest.from_json({"token_ids": ids + [5, 6], "max_tokens": 6})
        with pytest.raises(RuntimeError), coordinator.reusing(again, list(again.token_ids)) as co:
            assert co.how == "take" and len(prefix) == 0
            raise RuntimeError("refused")
        assert len(prefix) == 1 and prefix.checkout(ids + [5, 6]).cached == len(ids)
    finally:
        compute.submit(backend.close).result()
        compute.shutdown()


def test_a_take_never_takes_an_entry_a_copy_is_reading():
    """Issue 18, M1: request A checks out a copy of an entry (pinned, its fork not yet
    run); request B, which continues the entry, arrives meanwhile. B must copy too, not take
    the entry's cache away from under A's fork (that was a 500: fork of None)."""
    ops = FakeOps()
    pc = PrefixCache(ops, limit_bytes=10**9)
    turn1 = list(range(100))
    run(pc, turn1, reply=[7, 8, 9], capacity=200)
    a = pc.checkout(turn1[:60] + [999] * 10)  # shares 60: a copy
    assert a.how == "copy" and a.entry.pins == 1
    b = pc.checkout([*turn1, 7, 8, 9, 50])  # continues the entry: would be a take
    assert b.how == "copy"
    forked_a = pc.materialize(a, capacity=80)
    forked_b = pc.materialize(b, capacity=120)
    assert (forked_a.data[:60] == turn1[:60]).all()
    assert (forked_b.data[:103] == [*turn1, 7, 8, 9]).all()
    assert ops.forks == 2 and len(pc) == 1 and pc._entries[0].pins == 0
    later = pc.checkout([*turn1, 7, 8, 9, 50])  # nothing reads it now: taken again
    assert later.how == "take"
