"""The torch prefill's device path, on the device `EXO_SPLIT_TEST_DEVICE` names (default cpu).

CI runs these on the CPU; `scripts/cuda-check` runs them with EXO_SPLIT_TEST_DEVICE=cuda on a
machine with an NVIDIA GPU, where the per-layer copies go through a side stream, events and
pinned host memory. A requested device that is not there is a failure, never a skip.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import numpy as np
import pytest
import torch
from reference import prompt_ids, reference_generate, reference_logits

from exo_split.backends import Cancelled, load_backend
from exo_split.handoff import split_generate
from exo_split.kv import LayerKV, itemsize

DEVICE = os.environ.get("EXO_SPLIT_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def device():
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.fail(f"EXO_SPLIT_TEST_DEVICE={DEVICE} but torch sees no CUDA GPU")
    return DEVICE


@pytest.mark.parametrize("chunk", [None, 64])
def test_pieces_come_in_order_and_equal_the_device_cache(llama, device, chunk):
    backend = load_backend("torch", llama, device=device)
    assert backend.device == torch.device(device).type
    ids = prompt_ids(150, seed=21)
    pieces = []

    def on_layer(kv: LayerKV) -> None:
        # A copy of the bytes as handed over: a piece handed on before its device-to-host
        # copy completed would differ from the cache; compared later, it would not.
        pieces.append(LayerKV(kv.layer, kv.token_start, kv.k.copy(), kv.v.copy(), kv.dtype))
        if kv.release is not None:  # copied: the producer may reuse its staging buffer now
            kv.release()

    if backend.device == "cuda":
        # Hold the compute stream back (~0.1 s of GPU spinning) so that each layer's copy
        # lands long after its update() call returns: an early hand-over would see it empty.
        torch.cuda._sleep(200_000_000)
    done = backend.prefill(ids, chunk=chunk, on_layer=on_layer)
    n, layers = 150, backend.spec.n_layers
    starts = [0] if chunk is None else list(range(0, n, chunk))
    assert [(p.layer, p.token_start) for p in pieces] == [
        (i, s) for s in starts for i in range(layers)
    ]
    for kv in backend.export(done.cache):
        mine = [p for p in pieces if p.layer == kv.layer]
        np.testing.assert_array_equal(np.concatenate([p.k for p in mine], axis=1), kv.k)
        np.testing.assert_array_equal(np.concatenate([p.v for p in mine], axis=1), kv.v)


def test_float32_split_from_the_device_equals_transformers(llama, device):
    prefill = load_backend("torch", llama, device=device)
    decode = load_backend("mlx", llama)
    ids = prompt_ids(300, seed=22)
    got = split_generate(prefill, decode, ids, max_tokens=12, chunk=128).tokens
    assert got == reference_generate(llama, ids, 12)


def test_bfloat16_split_from_the_device_agrees_with_transformers(llama, device):
    prefill = load_backend("torch", llama, dtype="bfloat16", device=device)
    decode = load_backend("mlx", llama, dtype="bfloat16")
    ids, forced = prompt_ids(200, seed=23), prompt_ids(33, seed=24)[1:]
    ref = reference_logits(llama, ids + forced, "bfloat16").numpy()[len(ids) - 1 :][:32]
    cache = decode.new_cache(len(ids) + 32)
    done = prefill.prefill(ids, on_layer=lambda kv: decode.inject(cache, kv))
    logits = np.stack([done.logits] + [decode.step(cache, t) for t in forced[:-1]])
    top1 = (logits.argmax(-1) == ref.argmax(-1)).mean()
    assert top1 >= 0.9, f"top-1 agreement {top1:.1%}"
    assert np.abs(logits - ref).max() < 0.1 * np.abs(ref).max()


# ---- the staging ring (torch_staging.py): on the CPU with plain copies, on CUDA pinned ----------


def _ring_backend(model_dir, device, *, slots=3, positions=16, dtype="float32"):
    """A torch backend whose ring holds `slots` slots of `positions` positions each; on the CPU
    with copies, the GPU's path (the default CPU path hands out views and needs no ring)."""
    backend = load_backend("torch", model_dir, device=device, dtype=dtype)
    per_token = 2 * backend.spec.n_kv_heads * backend.spec.head_dim * itemsize(dtype)
    backend.set_staging(slots * positions * per_token, slots, copy=True)
    assert backend.ring.bounded and len(backend.ring.slots) == slots
    return backend


class Sender:
    """What the node's sender does with a piece: take its bytes, then release the slot."""

    def __init__(self, ring=None):
        self.ring = ring
        self.got = []  # (layer, start, n, k bytes, v bytes, computed_at, handed at, slot index)

    def __call__(self, kv):
        slot = None if self.ring is None else _slot_of(self.ring, kv.k)
        self.got.append((kv.layer, kv.token_start, kv.n_tokens, kv.k.tobytes(), kv.v.tobytes(),
                         kv.computed_at, time.perf_counter(), slot))  # fmt: skip
        kv.release()


def _slot_of(ring, a: np.ndarray) -> int:
    """The ring slot whose memory holds all of `a`."""
    lo = a.ctypes.data
    for i, slot in enumerate(ring.slots):
        base = slot.data_ptr()
        if base <= lo and lo + 2 * a.nbytes <= base + ring.slot_bytes:
            return i
    raise AssertionError(f"piece at {lo:#x} is in no slot of the ring")


def _assert_pieces_equal_the_cache(backend, cache, got, n):
    """Per layer, the pieces tile [0, n) in order and are the cache's bytes, bit for bit."""
    for kv in backend.export(cache):
        mine = [g for g in got if g[0] == kv.layer]
        assert [g[1] for g in mine] == list(np.cumsum([0] + [g[2] for g in mine[:-1]]))
        assert sum(g[2] for g in mine) == n
        for g in mine:
            s, e = g[1], g[1] + g[2]
            assert g[3] == np.ascontiguousarray(kv.k[:, s:e]).tobytes(), (kv.layer, s)
            assert g[4] == np.ascontiguousarray(kv.v[:, s:e]).tobytes(), (kv.layer, s)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_ring_is_allocated_once_and_reused_across_layers_and_requests(llama, device, dtype):
    backend = _ring_backend(llama, device, slots=3, positions=16, dtype=dtype)
    ring = backend.ring
    host_bytes, allocations = ring.host_bytes, ring.allocations
    calls = []
    alloc = backend.ops.alloc
    backend.ops.alloc = lambda nbytes: calls.append(nbytes) or alloc(nbytes)
    used = []
    for seed in (31, 32):  # two requests on the same ring
        sender = Sender(ring)
        ids = prompt_ids(150, seed=seed)
        done = backend.prefill(ids, chunk=64, on_layer=sender)
        _assert_pieces_equal_the_cache(backend, done.cache, sender.got, 150)
        # 3 layers x chunks of 64/64/22 positions, in pieces of <= 16: 30 pieces, 3 slots.
        assert len(sender.got) == 3 * (4 + 4 + 2)
        assert max(g[2] for g in sender.got) == 16
        used.append([g[7] for g in sender.got])
    assert calls == [], "no staging memory is allocated during a prefill"
    assert (
        (ring.host_bytes, ring.allocations) == (host_bytes, allocations) == (3 * ring.slot_bytes, 3)
    )
    assert ring.in_use == 0 and ring.in_use_max <= 3
    for slots in used:  # every slot serves many pieces, of several layers, in each request
        assert set(slots) == {0, 1, 2}
        assert all(slots.count(i) >= 5 for i in range(3))


def test_pieces_come_in_order_with_ordered_compute_stamps(llama, device):
    backend = _ring_backend(llama, device, slots=2, positions=20)
    sender = Sender(backend.ring)
    t0 = time.perf_counter()
    done = backend.prefill(prompt_ids(100, seed=33), chunk=50, on_layer=sender)
    t1 = time.perf_counter()
    order = [(g[0], g[1]) for g in sender.got]
    layers = backend.spec.n_layers
    assert order == [(i, s) for c in (0, 50) for i in range(layers) for s in (c, c + 20, c + 40)]
    stamps = [g[5] for g in sender.got]
    assert stamps == sorted(stamps), "compute_done stamps out of order"
    assert t0 <= stamps[0] and stamps[-1] <= done.computed_at <= t1
    # A piece is handed on only after the KV it holds was computed.
    assert all(at <= handed for _, _, _, _, _, at, handed, _ in sender.got)
    # The pieces of one (chunk, layer) share the stamp of that layer's write.
    assert len(set(stamps)) == 2 * layers


def test_the_forward_finishes_while_the_consumer_reads_nothing(llama, device):
    """The compute thread never waits for the network: with a ring of 2 slots and a consumer
    that takes nothing until the forward has run its output head, all layers still compute."""
    backend = _ring_backend(llama, device, slots=2, positions=8)
    ring = backend.ring
    inbox: queue.Queue = queue.Queue()
    head_ran = threading.Event()
    at_head = {}

    def on_head(module, args, output):
        # Let the stager catch up: it fills the ring, then waits for a slot.
        deadline = time.monotonic() + 60
        while ring.in_use < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        at_head.update(in_use=ring.in_use, handed=inbox.qsize(), consumed=len(sender.got))
        head_ran.set()

    sender = Sender(ring)

    def consumer():  # reads nothing until the forward is over
        head_ran.wait(300)
        while (kv := inbox.get()) is not None:
            sender(kv)

    reader = threading.Thread(target=consumer)
    reader.start()
    hook = backend.model.lm_head.register_forward_hook(on_head)
    try:
        done = backend.prefill(prompt_ids(120, seed=34), on_layer=inbox.put)
    finally:
        hook.remove()
        inbox.put(None)
        reader.join(300)
    assert head_ran.is_set()
    # Had the compute thread waited for a slot, it would never have reached the head: the
    # consumer started only then. There, the ring was full and nothing had been consumed.
    assert at_head == {"in_use": 2, "handed": 2, "consumed": 0}
    assert len(sender.got) == backend.spec.n_layers * 15  # 120 positions in pieces of 8
    _assert_pieces_equal_the_cache(backend, done.cache, sender.got, 120)
    assert ring.in_use == 0


def test_a_dropped_piece_gives_its_slot_back(llama, device):
    """A consumer that drops pieces without release() (an error path) does not shrink the ring:
    the slot comes back when the last view of its memory is gone."""
    backend = _ring_backend(llama, device, slots=2, positions=16)
    seen = []
    backend.prefill(prompt_ids(100, seed=35), on_layer=lambda kv: seen.append(kv.n_tokens))
    assert sum(seen) == backend.spec.n_layers * 100
    assert backend.ring.in_use == 0


def test_a_consumer_holding_every_slot_fails_the_prefill_clearly(llama, device):
    backend = _ring_backend(llama, device, slots=2, positions=16)
    backend.slot_timeout = 0.5
    held = []
    with pytest.raises(Cancelled, match="no staging slot came back .* holds all 2"):
        backend.prefill(prompt_ids(100, seed=36), on_layer=held.append)
    held.clear()
    assert backend.ring.in_use == 0
    sender = Sender(backend.ring)  # the ring is whole again: the next request runs
    backend.prefill(prompt_ids(40, seed=36), on_layer=sender)
    assert sum(g[2] for g in sender.got) == backend.spec.n_layers * 40


def test_cancelling_stops_the_prefill_at_the_next_layer(llama, device):
    """Bound: should_stop is polled as each layer writes its KV; on CUDA the compute thread is
    then at most `run_ahead` pieces ahead of the device, and the prefill returns once that work
    is done. Nothing of the layer that saw the stop, or later, is handed on."""
    backend = _ring_backend(llama, device, slots=2, positions=16)
    layers = backend.model.model.layers
    started, stop = [], threading.Event()

    def pre(i):
        def hook(module, args):
            started.append(i)
            if i == 1 and len(started) > len(layers):  # layer 1 of the second chunk
                stop.set()

        return hook

    hooks = [layer.register_forward_pre_hook(pre(i)) for i, layer in enumerate(layers)]
    sender = Sender(backend.ring)
    try:
        with pytest.raises(Cancelled, match="cancelled at layer 1"):
            backend.prefill(prompt_ids(150, seed=37), chunk=64, on_layer=sender,
                            should_stop=stop.is_set)  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    n = len(layers)
    assert started == [*range(n), 0, 1], "no layer starts after the one that saw the stop"
    handed = {(g[0], g[1] // 64) for g in sender.got}
    assert handed <= {(i, 0) for i in range(n)} | {(0, 1)}
    assert backend.ring.in_use == 0  # every slot is back for the next request


def test_stream_kv_pushes_the_cache_through_the_ring_after_the_prefill(llama, device):
    backend = _ring_backend(llama, device, slots=2, positions=24)
    done = backend.prefill(prompt_ids(100, seed=38), chunk=50)
    sender = Sender(backend.ring)
    backend.stream_kv(done.cache, sender, chunk=40)
    layers = backend.spec.n_layers
    expected = [(i, s) for c in (0, 40, 80) for i in range(layers)
                for s in range(c, min(c + 40, 100), 24)]  # fmt: skip
    assert [(g[0], g[1]) for g in sender.got] == expected
    _assert_pieces_equal_the_cache(backend, done.cache, sender.got, 100)
    # Stamps are the prefill's: the piece holding positions < 50 was computed with chunk 0.
    marks = {(m.layer, m.start): m.at for m in done.cache.marks}
    for layer, start, n, _, _, at, _, _ in sender.got:
        assert at == marks[(layer, 0 if start + n <= 50 else 50)]
    assert backend.ring.in_use_max <= 2 and backend.ring.in_use == 0


def test_the_device_overlap_check_streams_every_byte_through_the_ring(device):
    """`python -m exo_split.bench.device` (scripts/cuda-check's second step), small: every KV
    byte crosses the paced loopback link through a ring allocated once; no timing is judged."""
    from exo_split.bench.device import render, run

    doc = run(device, tokens=256, rate_gbit=10.0, repeats=1, small=True)
    assert doc["device"] == torch.device(device).type
    assert doc["kv_bytes"] == 256 * 2 * 2 * 8 * 128 * 4  # tokens x layers x K,V x 8 x 128 x fp32
    ring = doc["ring"]
    assert ring["allocations"] == ring["slots"] and ring["in_use_max"] <= ring["slots"]
    assert ring["host_bytes"] == ring["slots"] * ring["slot_bytes"]
    assert doc["last_byte_s"] > 0 and doc["ideal_s"] > 0
    assert "pipelined bound" in render(doc)
