"""The tensor-parallel relay (backends/vllm_relay.py) without vLLM: worker links sending
their heads over a real Unix socket, the node's job putting pieces together in plan order,
and each way a worker can fail it. tests/test_vllm.py runs it with vLLM's real workers."""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from exo_split.backends.vllm_relay import Relay, RelayError, RelayJob, WorkerLink, parallel_size
from exo_split.errors import ExoSplitError
from exo_split.kv import LayerKV, bf16_words_from_float32

PIECES = [(layer, start, n) for start, n in ((0, 5), (5, 3)) for layer in range(3)]
HEADS, DIM = 4, 8


def _full(layer: int, start: int, n: int, dtype: str = "float32"):
    """A piece's K and V of all heads, values naming layer, position, head and dim."""
    rng = np.random.default_rng(layer * 1000 + start)
    k, v = (rng.standard_normal((HEADS, n, DIM)).astype(np.float32) for _ in range(2))
    if dtype == "bfloat16":
        return bf16_words_from_float32(k), bf16_words_from_float32(v)
    return k, v


def _part(rank: int, ranks: int, layer: int, start: int, n: int, dtype: str = "float32"):
    size = HEADS // ranks
    k, v = _full(layer, start, n, dtype)
    return LayerKV(layer, start, k[rank * size : (rank + 1) * size].copy(),
                   v[rank * size : (rank + 1) * size].copy(), dtype)  # fmt: skip


@pytest.fixture
def relay():
    r = Relay()
    yield r
    r.close()


def _job(ranks: int = 2, dtype: str = "float32"):
    got: list[LayerKV] = []
    return RelayJob(list(PIECES), ranks, got.append, dtype), got


def test_a_job_hands_on_pieces_in_plan_order_whatever_order_the_workers_send_them():
    job, got = _job()
    # worker 1 runs ahead through every piece; worker 0 then sends its own backwards
    for layer, start, n in PIECES:
        job.add(1, layer, start, *(x for x in _kv(_part(1, 2, layer, start, n))))
    assert got == [] and not job.done
    for layer, start, n in reversed(PIECES):
        job.add(0, layer, start, *_kv(_part(0, 2, layer, start, n)))
    assert job.done and job.error is None
    assert [(kv.layer, kv.token_start, kv.n_tokens) for kv in got] == PIECES
    for kv in got:
        k, v = _full(kv.layer, kv.token_start, kv.n_tokens)
        np.testing.assert_array_equal(kv.k, k)  # heads in rank order
        np.testing.assert_array_equal(kv.v, v)


def _kv(kv: LayerKV):
    return kv.k, kv.v


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_worker_links_over_the_socket_give_the_whole_layers(relay, dtype):
    job, got = _job(dtype=dtype)
    relay.register("j", job)
    links = [WorkerLink(relay.path, rank) for rank in (0, 1)]
    threads = [threading.Thread(target=lambda r=r: [links[r].send("j", _part(r, 2, *p, dtype))
                                                    for p in PIECES]) for r in (0, 1)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert job.wait(30), job.error
    assert [(kv.layer, kv.token_start) for kv in got] == [(a, b) for a, b, _ in PIECES]
    for kv in got:
        k, v = _full(kv.layer, kv.token_start, kv.n_tokens, dtype)
        np.testing.assert_array_equal(kv.k, k)
        np.testing.assert_array_equal(kv.v, v)
    per_token = 2 * HEADS * DIM * (4 if dtype == "float32" else 2)
    assert relay.received_bytes == per_token * sum(n for _, _, n in PIECES)


def test_a_workers_error_fails_the_job_with_its_words(relay):
    job, _ = _job()
    relay.register("j", job)
    WorkerLink(relay.path, 1).fail("j", "vLLM's CPU attention uses the 'amx' kernels")
    job.wait(30)
    assert isinstance(job.error, RelayError)
    assert "vLLM worker 1: vLLM's CPU attention uses the 'amx' kernels" in str(job.error)


def test_pieces_of_a_job_no_longer_waited_for_are_dropped(relay):
    job, got = _job()
    relay.register("j", job)
    link = WorkerLink(relay.path, 0)
    link.send("gone", _part(0, 2, *PIECES[0]))  # a cancelled job's late piece
    for p in PIECES:
        link.send("j", _part(0, 2, *p))
        job.add(1, *p[:2], *_kv(_part(1, 2, *p)))
    assert job.wait(30) and job.error is None and len(got) == len(PIECES)


def _raw(relay: Relay, data: bytes, close: bool) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(relay.path)
    s.sendall(data)
    if close:
        s.close()
    return s


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "closed its connection"),  # a worker process that died
        (struct.pack("<I", 1 << 30), "a header of 1073741824 bytes"),
        (struct.pack("<I", 5) + b"{oops", "cannot read"),
        (struct.pack("<I", 40) + b'{"job": "j", "rank": 0, "layer"', "closed"),
    ],
)  # fmt: skip
def test_a_worker_connection_that_closes_or_sends_garbage_fails_the_waiting_jobs(relay, data, why):
    job, _ = _job()
    relay.register("j", job)
    _raw(relay, data, close=True)
    job.wait(30)
    assert isinstance(job.error, RelayError) and why in str(job.error), job.error
    assert "while a prefill waited on it" in str(job.error)


def test_a_wrong_rank_or_a_piece_sent_twice_fails_the_job():
    job, _ = _job()
    job.add(2, *PIECES[0][:2], *_kv(_part(0, 2, *PIECES[0])))
    assert "worker 2 of 2" in str(job.error)
    job, _ = _job()
    for _ in range(2):
        job.add(0, *PIECES[0][:2], *_kv(_part(0, 2, *PIECES[0])))
    assert "worker 0 sent layer 0 at 0 twice" in str(job.error)


def test_waiting_ends_at_its_timeout_or_when_told_to_stop():
    job, _ = _job()
    assert job.wait(0.05) is False and job.error is None
    assert job.wait(30, stop=lambda: True) is False


def test_a_link_that_cannot_reach_the_relay_says_so_and_raises_nothing(tmp_path):
    link = WorkerLink(str(tmp_path / "nowhere.sock"), 0)
    link.send("j", _part(0, 2, *PIECES[0]))  # the forward's thread: never raises
    link._thread.join(30)
    assert link.broken is not None


def test_a_tensor_parallel_size_must_give_each_worker_its_own_heads(llama):
    """The node refuses, before vLLM starts, workers that would share (replicate) KV heads."""
    from exo_split.spec import load_spec

    spec = load_spec(llama)  # 2 KV heads
    assert parallel_size(spec, {}) == 1 and parallel_size(spec, {"tensor_parallel_size": 2}) == 2
    with pytest.raises(ExoSplitError, match="tensor_parallel_size 3 does not divide") as info:
        parallel_size(spec, {"tensor_parallel_size": 3})
    assert info.value.hint == "a tensor_parallel_size that divides the KV heads"
