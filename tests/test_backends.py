"""Backends on their own: per-layer emission, chunking, dtypes, export/inject."""

from __future__ import annotations

from itertools import pairwise

import mlx.core as mx
import numpy as np
import pytest
import torch
from reference import prompt_ids, reference_logits

from exo_split.backends import load_backend
from exo_split.backends import mlx_backend as mb
from exo_split.backends import torch_backend as tb
from exo_split.handoff import split_generate
from exo_split.kv import LayerKV


@pytest.mark.parametrize("chunk", [None, 64])
def test_torch_hands_each_layer_on_before_the_next_layer_runs(llama, chunk):
    backend = load_backend("torch", llama)
    events = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, i=i: events.append(("start", i)))
        for i, layer in enumerate(backend.model.model.layers)
    ]
    try:
        backend.prefill(
            prompt_ids(150), chunk=chunk, on_layer=lambda kv: events.append(("kv", kv.layer))
        )
    finally:
        for h in hooks:
            h.remove()
    n_layers = backend.spec.n_layers
    n_chunks = 1 if chunk is None else 3
    # Per chunk: layer i starts, its KV is handed on, then layer i+1 starts.
    expected = [(e, i) for _ in range(n_chunks) for i in range(n_layers) for e in ("start", "kv")]
    assert events == expected


def test_mlx_hands_each_layer_on_in_order(llama):
    backend = load_backend("mlx", llama)
    pieces = []
    backend.prefill(
        prompt_ids(150),
        chunk=64,
        on_layer=lambda kv: pieces.append((kv.layer, kv.token_start, kv.n_tokens)),
    )
    n = backend.spec.n_layers
    # Chunks of 64 over the first 149 positions, then the last one alone (mlx-lm's own model
    # computes the logits of that position only, head included): the plan says so.
    chunks = [(0, 64), (64, 64), (128, 21), (149, 1)]
    assert backend.prefill_chunks(150, 64) == tuple(c for _, c in chunks)
    assert pieces == [(i, s, c) for s, c in chunks for i in range(n)]


@pytest.mark.parametrize("name", ["torch", "mlx"])
def test_chunked_prefill_gives_the_same_kv_and_logits(llama, name):
    backend = load_backend(name, llama)
    ids = prompt_ids(300, seed=1)
    whole = backend.prefill(ids)
    chunked = backend.prefill(ids, chunk=97)
    np.testing.assert_allclose(chunked.logits, whole.logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(backend.export(whole.cache), backend.export(chunked.cache), strict=True):
        assert a.k.shape == (backend.spec.n_kv_heads, 300, backend.spec.head_dim)
        np.testing.assert_allclose(a.k, b.k, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(a.v, b.v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["torch", "mlx"])
def test_streamed_pieces_equal_the_exported_cache(llama, name):
    backend = load_backend(name, llama)
    ids = prompt_ids(130, seed=2)
    pieces: dict[int, list[LayerKV]] = {}
    done = backend.prefill(
        ids, chunk=50, on_layer=lambda kv: pieces.setdefault(kv.layer, []).append(kv)
    )
    for kv in backend.export(done.cache):
        k = np.concatenate([p.k for p in pieces[kv.layer]], axis=1)
        v = np.concatenate([p.v for p in pieces[kv.layer]], axis=1)
        np.testing.assert_array_equal(k, kv.k)
        np.testing.assert_array_equal(v, kv.v)


def test_bfloat16_conversion_is_bit_exact_both_ways():
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(2, 33, 16, generator=g) * 10).to(torch.bfloat16)
    words = tb.to_numpy(t)
    assert words.dtype == np.uint16
    m = mb.from_numpy(words, "bfloat16")
    assert m.dtype == mx.bfloat16
    back = tb.from_numpy(mb.to_numpy(m), "bfloat16")
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))
    # mlx -> torch: an MLX bf16 array survives the trip to torch bit for bit too.
    a = (mx.random.normal((2, 5, 8), key=mx.random.key(1)) * 7).astype(mx.bfloat16)
    t2 = tb.from_numpy(mb.to_numpy(a), "bfloat16")
    assert np.array_equal(tb.to_numpy(t2), np.array(a.view(mx.uint16)))
    # float32 values agree with each framework's own bf16 -> f32 conversion
    np.testing.assert_array_equal(np.array(m.astype(mx.float32)), t.float().numpy())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_torch_to_mlx_teacher_forced_agreement(checkpoint, family):
    """bf16 kernels differ by ~1 ulp, so exact sequences can part at near-ties: check
    teacher-forced top-1 agreement with the float32 reference over 40 steps."""
    model_dir = checkpoint(family)
    t = load_backend("torch", model_dir, dtype="bfloat16")
    m = load_backend("mlx", model_dir, dtype="bfloat16")
    ids = prompt_ids(200, seed=7)
    forced = prompt_ids(41, seed=8)[1:]
    # The reference runs the same weights in the same dtype (transformers, bfloat16).
    ref = reference_logits(model_dir, ids + forced, "bfloat16").numpy()[len(ids) - 1 :]
    cache = m.new_cache(len(ids) + 41)
    done = t.prefill(ids, on_layer=lambda kv: m.inject(cache, kv))
    logits = [done.logits] + [m.step(cache, tok) for tok in forced[:-1]]
    logits = np.stack(logits)
    top1 = (logits.argmax(-1) == ref[:40].argmax(-1)).mean()
    err = np.abs(logits - ref[:40]).max()
    print(f"{family} bf16 torch->mlx: top-1 agreement {top1:.1%}, max |logit err| {err:.3f}")
    assert top1 >= 0.9, f"top-1 agreement {top1:.1%} (max logit error {err:.3f})"
    assert err < 0.1 * np.abs(ref).max()


def _teacher_forced(backend, ids, forced):
    """Logits of `backend` alone at the last prompt position and after each forced token."""
    done = backend.prefill(ids, capacity=len(ids) + len(forced))
    return np.stack([done.logits] + [backend.step(done.cache, t) for t in forced[:-1]])


def test_bfloat16_split_agrees_with_each_backend_alone(llama):
    """In bf16 the backends differ by about one ulp, so the split's greedy sequence is checked
    against each backend alone, teacher-forced: at every step the split's token is that
    backend's own greedy pick, or a near-tie for it (within 2% of the logit range)."""
    t = load_backend("torch", llama, dtype="bfloat16")
    m = load_backend("mlx", llama, dtype="bfloat16")
    ids = prompt_ids(100, seed=9)
    split = split_generate(t, m, ids, max_tokens=8).tokens
    assert len(split) == 8
    for backend in (t, m):
        logits = _teacher_forced(backend, ids, split)
        picks = logits.argmax(-1)
        chosen = logits[np.arange(len(split)), split]
        gap = logits.max(-1) - chosen  # 0 where the backend alone picks the split's token
        scale = logits.max() - logits.min()
        assert (picks == split).mean() >= 7 / 8, (backend.name, picks.tolist(), split)
        assert gap.max() <= 0.02 * scale, (backend.name, gap.tolist(), float(scale))


def test_mlx_inject_fills_the_preallocated_cache_without_reallocating(llama):
    m = load_backend("mlx", llama)
    t = load_backend("torch", llama)
    ids = prompt_ids(40)
    cache = m.new_cache(40 + 10)
    before = [id(c.keys) for c in cache]
    capacity = cache[0].keys.shape[2]
    done = t.prefill(ids, chunk=16, on_layer=lambda kv: m.inject(cache, kv))
    assert m.cache_len(cache) == 40
    sent = t.export(done.cache)
    # Every layer's injected K and V are the pieces' bytes, at their positions (float32 both
    # sides: exact).
    for got, want in zip(m.export(cache), sent, strict=True):
        assert (got.layer, got.k.shape) == (want.layer, want.k.shape)
        np.testing.assert_array_equal(got.k, want.k)
        np.testing.assert_array_equal(got.v, want.v)
    for _ in range(10):
        m.step(cache, 5)
    assert cache[0].keys.shape[2] == capacity >= 50
    assert [id(c.keys) for c in cache] == before  # written in place, never replaced
    for got, want in zip(m.export(cache), sent, strict=True):  # the steps wrote after them
        np.testing.assert_array_equal(got.k[:, :40], want.k)
        np.testing.assert_array_equal(got.v[:, :40], want.v)
    # ... and they are what MLX computes itself (torch and MLX differ by rounding only).
    np.testing.assert_allclose(m.export(m.prefill(ids).cache)[0].k, sent[0].k, rtol=1e-4, atol=1e-4)


def test_mlx_inject_refuses_a_gap(llama):
    m = load_backend("mlx", llama)
    cache = m.new_cache(20)
    k = np.zeros((m.spec.n_kv_heads, 4, m.spec.head_dim), np.float32)
    with pytest.raises(ValueError, match="starts at 4, cache at 0"):
        m.inject(cache, LayerKV(0, 4, k, k, "float32"))


def test_a_device_torch_cannot_use_is_one_clear_error(llama):
    from exo_split.errors import ExoSplitError

    with pytest.raises(ExoSplitError, match="unknown torch device 'metal'"):
        load_backend("torch", llama, device="metal")
    if not torch.cuda.is_available():
        with pytest.raises(ExoSplitError, match="sees no CUDA GPU"):
            load_backend("torch", llama, device="cuda")


def test_torch_pieces_on_the_cpu_are_views_of_the_cache(llama):
    """The CPU needs no staging: a piece is the cache's own memory, handed on at once."""
    backend = load_backend("torch", llama)
    assert not backend.ring.bounded and backend.ring.host_bytes == 0
    pieces = []
    done = backend.prefill(prompt_ids(100, seed=3), chunk=40, on_layer=pieces.append)
    for kv in pieces:
        buffer = done.cache.layers[kv.layer].buffers[0][0].numpy()
        assert np.shares_memory(kv.k, buffer)
        np.testing.assert_array_equal(
            kv.k, buffer[:, kv.token_start : kv.token_start + kv.n_tokens]
        )


def test_torch_compute_thread_stays_run_ahead_pieces_ahead_of_the_device(llama):
    """The run-ahead bound's bookkeeping, with a clock that logs: after recording piece p's
    event, the compute thread waits for piece p - run_ahead's (on CUDA: an event synchronize,
    the device, never the network)."""
    backend = load_backend("torch", llama)
    log = []

    class LoggingClock:
        n = 0

        def record(self):
            self.n += 1
            log.append(("record", self.n))
            return self.n

        def wait(self, event):
            log.append(("wait", event))

        def seconds(self, event):
            return float(event)

    backend.ops.begin = LoggingClock
    backend.prefill(prompt_ids(150, seed=4), chunk=64)
    pieces = 3 * backend.spec.n_layers
    expected = []
    for p in range(1, pieces + 1):
        expected.append(("record", p))
        if p > backend.run_ahead:
            expected.append(("wait", p - backend.run_ahead))
    assert log == [*expected, ("record", pieces + 1)]  # + the forward's end


def test_mlx_prefills_in_chunks_by_default_with_the_same_kv_and_logits(llama, monkeypatch):
    backend = load_backend("mlx", llama)
    ids = prompt_ids(150, seed=5)
    full = np.array(backend.model(mx.array([ids]))[0, -1])  # every position's logits, then one
    monkeypatch.setattr(mb, "PREFILL_CHUNK", 64)
    pieces = []
    done = backend.prefill(ids, on_layer=pieces.append)
    n = backend.spec.n_layers
    assert [(p.layer, p.token_start) for p in pieces] == [
        (i, s) for s in (0, 64, 128, 149) for i in range(n)
    ]
    np.testing.assert_allclose(done.logits, full, rtol=1e-4, atol=1e-4)
    assert done.computed_at >= max(p.computed_at for p in pieces)
    t = load_backend("torch", llama)
    whole = t.export(t.prefill(ids).cache)
    for kv, ref in zip(backend.export(done.cache), whole, strict=True):
        np.testing.assert_allclose(kv.k, ref.k, rtol=1e-4, atol=1e-4)


def test_mlx_prefill_never_holds_logits_for_every_position(checkpoint):
    """A 1,024-token prompt with a 32K vocabulary: [T, vocab] float32 logits would be 134 MB;
    the prefill's peak is a fraction of that (only the last position reaches the head)."""
    backend = load_backend("mlx", checkpoint("llama", vocab_size=32768))
    ids = prompt_ids(1024, seed=6)
    full_logits = len(ids) * backend.spec.vocab_size * 4
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    done = backend.prefill(ids)
    peak = mx.get_peak_memory() - base
    assert done.logits.shape == (backend.spec.vocab_size,)
    assert peak < full_logits / 4, f"peak {peak:,} B against {full_logits:,} B of logits"


def test_mlx_local_prefill_runs_layer_by_layer_so_a_stop_is_bounded(llama):
    """Without on_layer (a local or fallback prefill), each layer is still evaluated as it is
    reached: between two polls of should_stop the evaluated memory grows by at least one
    layer's K/V, so the poll that says stop comes within one layer of one chunk of the work,
    not after one lazy graph of the whole prompt has run."""
    backend = load_backend("mlx", llama)
    ids = prompt_ids(600, seed=7)
    kv_bytes = 2 * backend.spec.n_kv_heads * backend.spec.head_dim * 4 * len(ids)
    memory = []

    def should_stop():
        memory.append(mx.get_active_memory())
        return len(memory) == backend.spec.n_layers  # stop at the last layer

    with pytest.raises(mb.Cancelled, match=f"cancelled at layer {backend.spec.n_layers - 1}"):
        backend.prefill(ids, should_stop=should_stop)
    assert all(b - a >= kv_bytes for a, b in pairwise(memory)), memory


def test_mlx_stream_kv_hands_on_views_of_the_cache_with_the_prefill_stamps(llama):
    backend = load_backend("mlx", llama)
    done = backend.prefill(prompt_ids(130, seed=8), chunk=50, capacity=140)
    pieces = []
    backend.stream_kv(done.cache, pieces.append, chunk=60)
    n = backend.spec.n_layers
    assert [(p.layer, p.token_start, p.n_tokens) for p in pieces] == [
        (i, s, min(60, 130 - s)) for s in (0, 60, 120) for i in range(n)
    ]
    # A piece's stamp is when the prefill computed its last position (chunks of 50 there,
    # the last position alone).
    computed = {(i, e): t for i, c in enumerate(done.cache) for e, t in c.computed}
    ends = (50, 100, 129, 130)
    for p in pieces:
        end = next(e for e in ends if e >= p.token_start + p.n_tokens)
        assert p.computed_at == computed[(p.layer, end)]
        assert np.shares_memory(p.k, np.array(done.cache[p.layer].keys, copy=False))
    for kv in backend.export(done.cache):
        mine = [p for p in pieces if p.layer == kv.layer]
        np.testing.assert_array_equal(np.concatenate([p.k for p in mine], axis=1), kv.k)
        np.testing.assert_array_equal(np.concatenate([p.v for p in mine], axis=1), kv.v)
