"""Backends on their own: per-layer emission, chunking, dtypes, export/inject."""

from __future__ import annotations

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
    assert pieces == [(i, s, min(64, 150 - s)) for s in (0, 64, 128) for i in range(n)]


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
