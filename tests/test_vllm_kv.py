"""The vLLM connector's request side without vLLM (exo_split/backends/vllm_kv.py): pieces in
plan order whatever vLLM's chunks and cache hit, gathers out of each paged layout, failures
kept off vLLM's forward. The layouts here are written from vLLM's kernels' description; that
they are vLLM's own is checked against transformers in test_vllm.py (vllm_contract.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exo_split.backends import vllm_kv
from exo_split.backends.vllm_kv import Job, gather, layout_of

HEADS, DIM, BS, LAYERS = 2, 32, 32, 3


def _paged(k: np.ndarray, v: np.ndarray, layout: str, blocks: list[int], n_blocks: int = 40):
    """k, v [heads, n, dim] written into a paged tensor of `layout` at `blocks`."""
    n = k.shape[1]
    if layout == "cpu_vec":
        t = torch.full((n_blocks, HEADS, BS, 2 * DIM), float("nan"))
        halves = t.view(n_blocks, HEADS, 2 * BS, DIM)
    else:
        shape = (2, n_blocks, BS, HEADS, DIM) if layout == "nhd" else (2, n_blocks, HEADS, BS, DIM)
        t = torch.full(shape, float("nan"))
    for pos in range(n):
        b, o = blocks[pos // BS], pos % BS
        for h in range(HEADS):
            kk, vv = torch.from_numpy(k[h, pos]), torch.from_numpy(v[h, pos])
            if layout == "cpu_vec":  # K transposed per (block, head): [dim, block_size]
                halves[b, h, :BS].reshape(DIM, BS)[:, o] = kk
                halves[b, h, BS + o] = vv
            elif layout == "nhd":
                t[0, b, o, h], t[1, b, o, h] = kk, vv
            else:
                t[0, b, h, o], t[1, b, h, o] = kk, vv
    return t


def _kv(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((HEADS, n, DIM)).astype(np.float32),
         rng.standard_normal((HEADS, n, DIM)).astype(np.float32))
        for _ in range(LAYERS)
    ]  # fmt: skip


@pytest.mark.parametrize("layout", ["cpu_vec", "nhd", "hnd"])
def test_gather_reads_each_layout_at_any_range(layout):
    (k, v), *_ = _kv(100, 0)
    blocks = [7, 3, 30, 12]  # not in order: the request's block table decides
    t = _paged(k, v, layout, blocks)
    for a, b in ((0, 100), (37, 64), (31, 33), (96, 100)):
        gk, gv = gather(t, layout, blocks, BS, a, b)
        np.testing.assert_array_equal(gk.numpy(), k[:, a:b])
        np.testing.assert_array_equal(gv.numpy(), v[:, a:b])


def _pieces(n: int, start: int, chunk: int):
    out, at = [], 0
    while at < n:
        size = min(chunk, n - at)
        if at + size > start:
            lo = max(at, start)
            out += [(layer, lo, at + size - lo) for layer in range(LAYERS)]
        at += size
    return out


def test_pieces_follow_the_plan_whatever_vllm_chunks_and_had_cached():
    """Plan: chunks of 64 from 0, positions [37, 200) wanted. vLLM had [0, 96) cached and
    computes [96, 160), then [160, 200): a piece goes as soon as its layer holds it all, the
    cached positions read from the blocks like the computed ones."""
    n, start = 200, 37
    kvs = _kv(n, 1)
    blocks = [5, 9, 1, 20, 2, 11, 8]
    tensors = [_paged(k, v, "cpu_vec", blocks) for k, v in kvs]
    got, at_save = [], []
    job = Job(_pieces(n, start, 64), got.append, "float32", layout="cpu_vec")
    for a, b in ((96, 160), (160, 200)):
        for layer in range(LAYERS):
            job.layer_saved(layer, tensors[layer], blocks, a, b, BS)
            at_save.append(len(got))
    assert job.error is None and job.done
    assert [(p.layer, p.token_start, p.n_tokens) for p in got] == _pieces(n, start, 64)
    # layer 0's first hook already holds [37, 64) and [64, 128), but its [64, 128) comes
    # after [37, 64) of every layer: it goes at layer 2's hook, with layers 1's and 2's
    assert at_save[:3] == [1, 2, 6]
    for p in got:
        k, v = kvs[p.layer]
        np.testing.assert_array_equal(p.k, k[:, p.token_start : p.token_start + p.n_tokens])
        np.testing.assert_array_equal(p.v, v[:, p.token_start : p.token_start + p.n_tokens])


def test_a_failure_or_a_stop_is_kept_off_vllms_forward():
    kvs = _kv(64, 2)
    blocks = [0, 1]
    t = _paged(*kvs[0], "cpu_vec", blocks)

    def boom(piece):
        raise OSError("the wire is gone")

    job = Job(_pieces(64, 0, 64), boom, "float32", layout="cpu_vec")
    job.layer_saved(0, t, blocks, 0, 64, BS)  # does not raise
    assert isinstance(job.error, OSError) and not job.done
    job.layer_saved(1, t, blocks, 0, 64, BS)  # a failed job takes nothing more
    assert job.next_piece == 0

    stopped = Job(_pieces(64, 0, 64), lambda p: None, "float32", lambda: True, "cpu_vec")
    stopped.layer_saved(0, t, blocks, 0, 64, BS)
    assert isinstance(stopped.error, vllm_kv.Cancelled) and stopped.next_piece == 0


def test_pieces_are_stored_in_the_decode_nodes_dtype():
    kvs = _kv(32, 3)
    t = _paged(*kvs[0], "cpu_vec", [4]).to(torch.bfloat16)
    got = []
    Job([(0, 0, 32)], got.append, "bfloat16", layout="cpu_vec").layer_saved(0, t, [4], 0, 32, BS)
    assert got[0].k.dtype == np.uint16  # kv.py's storage of bfloat16: raw 16-bit words
    back = torch.from_numpy(got[0].k.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_allclose(back, kvs[0][0], rtol=1e-2, atol=1e-2)


def test_layouts_other_than_the_checked_ones_are_refused_by_name():
    assert layout_of("CPU_ATTN", "vec", (40, 2, 32, 64), 2, 32) == "cpu_vec"
    assert layout_of("FLASH_ATTN", None, (2, 40, 16, 2, 32), 2, 32) == "nhd"
    assert layout_of("FLASHINFER", None, (2, 40, 2, 16, 32), 2, 32) == "hnd"
    with pytest.raises(ValueError, match="'amx' kernels"):
        layout_of("CPU_ATTN", "amx", (40, 2, 32, 64), 2, 32)
    with pytest.raises(ValueError, match="as float8_e4m3fn .kv_cache_dtype auto."):
        layout_of("CPU_ATTN", "vec", (40, 2, 32, 64), 2, 32, "float8_e4m3fn")
    with pytest.raises(ValueError, match="kv_cache_dtype int8"):  # another quantized cache
        layout_of("CPU_ATTN", "vec", (40, 2, 32, 64), 2, 32, "int8", "int8")
    # an fp8 cache: the same layouts, in bytes (CPU) or float8 (CUDA)
    assert layout_of("CPU_ATTN", "vec", (40, 2, 32, 64), 2, 32, "uint8", "fp8") == "cpu_vec"
    assert layout_of("FLASH_ATTN", None, (2, 40, 16, 2, 32), 2, 32, "float8_e5m2",
                     "fp8_e5m2") == "nhd"  # fmt: skip
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e5m2"):  # not the format it says
        layout_of("FLASH_ATTN", None, (2, 40, 16, 2, 32), 2, 32, "float8_e4m3fn", "fp8_e5m2")
    with pytest.raises(ValueError, match="TRITON_ATTN attention keeps its KV as"):
        layout_of("TRITON_ATTN", None, (2, 40, 16, 2, 32), 2, 32)


@pytest.mark.parametrize("layout", ["cpu_vec", "nhd"])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_cache_is_read_as_its_values_times_its_scales(layout, fmt):
    """vLLM's fp8 KV cache keeps value / scale as float8 bytes: a gather hands on the value
    (float8's numbers times the scale) in the engine's dtype, and a Job sends it as such."""
    (k, v), *_ = _kv(70, 3)
    ks, vs = 0.5, 2.0
    qk, qv = (torch.from_numpy(x / s).to(fmt) for x, s in ((k, ks), (v, vs)))
    blocks = [9, 2, 5]
    paged = _paged(qk.float().numpy(), qv.float().numpy(), layout, blocks).to(fmt)
    raw = paged.view(torch.uint8)  # the CPU build's cache tensor: bytes
    dq = vllm_kv.Dequant(fmt, ks, vs)
    want_k, want_v = qk.float().numpy() * ks, qv.float().numpy() * vs
    for a, b in ((0, 70), (20, 45)):
        gk, gv = gather(raw, layout, blocks, BS, a, b, dequant=dq)
        assert gk.dtype == torch.float32
        np.testing.assert_array_equal(gk.numpy(), want_k[:, a:b])
        np.testing.assert_array_equal(gv.numpy(), want_v[:, a:b])
    # within the format's precision of what was stored, not its bytes read as numbers
    tol = 2.0**-3 if fmt == torch.float8_e4m3fn else 2.0**-2
    assert np.abs(want_k - k).max() <= tol * np.abs(k).max()
    got = []
    job = Job([(0, 0, 70)], got.append, "bfloat16", layout=layout, dequant={0: dq})
    job.layer_saved(0, raw, blocks, 0, 70, BS)
    assert job.error is None and got[0].k.dtype == np.uint16  # bfloat16's words
    back = torch.from_numpy(got[0].v.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_allclose(back, want_v, rtol=1e-2)
