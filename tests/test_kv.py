from __future__ import annotations

import numpy as np
import pytest
import torch

from exo_split.kv import LayerKV, bf16_words_from_float32, float32_from_bf16_words, storage_dtype
from exo_split.sampling import Sampling, sample


def test_bf16_rounding_matches_torch():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 100
    ours = bf16_words_from_float32(x.numpy())
    theirs = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(
        float32_from_bf16_words(ours), x.to(torch.bfloat16).float().numpy()
    )


def test_layer_kv_bytes_round_trip_without_copies():
    k = np.arange(2 * 3 * 4, dtype=np.float16).reshape(2, 3, 4)  # [H, T, D]
    v = -k
    kv = LayerKV(1, 10, k, v, "float16")
    kb, vb = kv.buffers()
    back = LayerKV.from_bytes(1, 10, 3, 2, 4, "float16", kb, vb)
    assert (back.layer, back.token_start, back.n_tokens, back.dtype) == (1, 10, 3, "float16")
    assert back.k.shape == back.v.shape == (2, 3, 4)
    np.testing.assert_array_equal(back.k, k)
    np.testing.assert_array_equal(back.v, v)
    assert np.shares_memory(back.k, k) and np.shares_memory(back.v, v)
    assert kv.nbytes == 2 * k.nbytes and kv.n_tokens == 3


@pytest.mark.parametrize(
    "src,dst",
    [
        ("float32", "bfloat16"),
        ("float32", "float16"),
        ("bfloat16", "float32"),
        ("float16", "bfloat16"),
    ],
)
def test_astype_between_wire_dtypes(src, dst):
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    a = LayerKV(0, 0, x, x, "float32").astype(src)
    b = a.astype(dst)
    assert b.k.dtype == storage_dtype(dst)
    back = b.astype("float32").k
    np.testing.assert_allclose(back, x, atol=0.02)


def test_layer_kv_refuses_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="must both be"):
        LayerKV(0, 0, np.zeros((2, 3, 4), np.float32), np.zeros((2, 4, 4), np.float32), "float32")
    with pytest.raises(ValueError, match="expected bfloat16"):
        LayerKV(0, 0, np.zeros((1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32), "bfloat16")
    with pytest.raises(ValueError, match="unknown dtype"):
        storage_dtype("int8")


def test_sampling_greedy_and_seeded():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    assert sample(logits, Sampling(), 0)[0] == 1
    s = Sampling(temperature=1.0, seed=7)
    draws = [sample(logits, s, step)[0] for step in range(200)]
    assert draws == [sample(logits, s, step)[0] for step in range(200)]
    counts = np.bincount(draws, minlength=4) / 200
    p = np.exp(logits) / np.exp(logits).sum()
    np.testing.assert_allclose(counts, p, atol=0.1)
    token, logp = sample(logits, Sampling(), 0)
    assert logp == pytest.approx(float(np.log(p[1])), rel=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        Sampling.from_dict({"temperature": -1})


def test_top_p_keeps_only_the_nucleus_and_one_means_off():
    logits = np.log(np.array([0.05, 0.5, 0.3, 0.15], np.float32))
    # Nucleus of 0.7: 0.5 (mass before it 0) and 0.3 (mass before it 0.5 < 0.7); not 0.15.
    s = Sampling(temperature=1.0, seed=3, top_p=0.7)
    draws = [sample(logits, s, step)[0] for step in range(400)]
    counts = np.bincount(draws, minlength=4) / 400
    np.testing.assert_allclose(counts, [0, 0.5 / 0.8, 0.3 / 0.8, 0], atol=0.07)
    assert set(draws) == {1, 2}
    # A tiny top_p is greedy; top_p = 1 is exactly the plain temperature rule.
    tiny = Sampling(temperature=1.0, seed=3, top_p=1e-6)
    assert {sample(logits, tiny, step)[0] for step in range(50)} == {1}
    plain, full = Sampling(temperature=1.0, seed=9), Sampling(temperature=1.0, seed=9, top_p=1.0)
    assert [sample(logits, plain, i)[0] for i in range(100)] == [
        sample(logits, full, i)[0] for i in range(100)
    ]
    with pytest.raises(ValueError, match="top_p"):
        Sampling.from_dict({"temperature": 1, "top_p": 0})
    assert Sampling.from_dict(s.to_dict()) == s


def test_layer_kv_carries_its_stamp_and_release_through_astype():
    released = []
    k = np.ones((2, 3, 4), dtype=np.float32)
    kv = LayerKV(0, 0, k, k, "float32", computed_at=1.5, release=lambda: released.append(1))
    assert LayerKV(0, 0, k, k, "float32").computed_at is None
    assert LayerKV(0, 0, k, k, "float32").release is None
    half = kv.astype("bfloat16")
    assert half.computed_at == 1.5
    half.release()
    assert released == [1]
