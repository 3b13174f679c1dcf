"""The torch prefill's device path, on the device `EXO_SPLIT_TEST_DEVICE` names (default cpu).

CI runs these on the CPU; `scripts/cuda-check` runs them with EXO_SPLIT_TEST_DEVICE=cuda on a
machine with an NVIDIA GPU, where the per-layer copies go through a side stream, events and
pinned host memory. A requested device that is not there is a failure, never a skip.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from reference import prompt_ids, reference_generate, reference_logits

from exo_split.backends import load_backend
from exo_split.handoff import split_generate
from exo_split.kv import LayerKV

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
