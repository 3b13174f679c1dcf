"""What exo-split's connector needs of vLLM, checked in the vLLM environment (test_vllm.py
runs it there): prints one JSON line of findings, the test asserts them.

  python tests/vllm_contract.py CHECKPOINT [--device cuda --dtype bfloat16]

Exits 1, naming what broke, when one of them does not hold (float32: errors below 1e-4;
float16/bfloat16: below 5% of the largest reference value); scripts/cuda-check runs it on a
GPU too.

- hooks: save_kv_layer once per layer, in layer order, for each of vLLM's chunks;
- layout: K/V gathered from the paged cache equal transformers' cache (the reference of
  this environment: transformers < 5.20, as vLLM pins);
- the first token's raw logits (logprobs=-1, raw_logits) equal transformers';
- a prefix hit: the repeated prompt computes only its tail, and the cached positions are
  still read from vLLM's blocks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

BUDGET = 256


def main(ckpt: str, device: str | None = None, dtype: str = "float32") -> int:
    os.environ["EXO_SPLIT_VLLM_ARGS"] = json.dumps(
        {"kv_cache_memory_bytes": 128 << 20, "max_num_batched_tokens": BUDGET}
    )
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from exo_split.backends import load_backend
    from exo_split.backends import vllm_kv as conn

    backend = load_backend("vllm", ckpt, device=device, dtype=dtype)
    n_layers = backend.spec.n_layers
    g = torch.Generator().manual_seed(0)
    ids = [1] + torch.randint(3, backend.spec.vocab_size, (599,), generator=g).tolist()
    saves: list = []
    real_job = conn.Job

    def recording_job(*args, **kwargs):  # the hooks' (layer, start, end), as vLLM called them
        job = real_job(*args, **kwargs)
        saves.append(job.saves)
        return job

    conn.Job = recording_job
    pieces: list = []
    done = backend.prefill(ids, on_layer=pieces.append)
    hit: list = []
    before = backend.counts["prefix_hit_tokens"]
    backend.prefill(ids, on_layer=hit.append)
    cached = backend.counts["prefix_hit_tokens"] - before
    conn.Job = real_job
    # Through the staging ring (the GPU's path; on the CPU with plain memory): 4 slots of 32
    # positions, each released by the consumer once copied, as the frame sender does.
    per_position = (
        2 * backend.spec.n_kv_heads * backend.spec.head_dim * (4 if dtype == "float32" else 2)
    )
    ring = backend.set_staging(4 * 32 * per_position, 4, copy=True)
    staged: list = []

    def consume(kv) -> None:
        staged.append(dataclasses.replace(kv, k=kv.k.copy(), v=kv.v.copy(), release=None))
        kv.release()

    g2 = torch.Generator().manual_seed(1)
    ids2 = [1] + torch.randint(3, backend.spec.vocab_size, (599,), generator=g2).tolist()
    backend.prefill(ids2, on_layer=consume)
    ring_ok = ring.allocations == 4 and ring.in_use_max <= 4 and ring.in_use == 0
    backend.set_staging()

    # the reference in the engine's dtype, on the CPU
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.float(), layer.values.float()
    out.logits = out.logits.float()

    def errors(got: list) -> tuple[float, float]:
        k_err = v_err = 0.0
        for layer in range(n_layers):
            k = _float32(np.concatenate([p.k for p in got if p.layer == layer], axis=1), dtype)
            v = _float32(np.concatenate([p.v for p in got if p.layer == layer], axis=1), dtype)
            k_err = max(k_err, float(np.abs(k - cache.layers[layer].keys[0].numpy()).max()))
            v_err = max(v_err, float(np.abs(v - cache.layers[layer].values[0].numpy()).max()))
        return k_err, v_err

    k_err, v_err = errors(pieces)
    hit_k, hit_v = errors(hit)
    with torch.inference_mode():
        cache = model(torch.tensor([ids2]), use_cache=True).past_key_values
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.float(), layer.values.float()
    staged_k, staged_v = errors(staged)
    chunks = [(a, min(a + BUDGET, len(ids))) for a in range(0, len(ids), BUDGET)]
    expected = [[layer, a, b] for a, b in chunks for layer in range(n_layers)]
    tail = [[layer, cached, len(ids)] for layer in range(n_layers)]
    found = {
        "vllm": backend.describe()["version"],
        "device": backend.device,
        "dtype": dtype,
        "hooks": [list(s) for s in saves[0]],
        "expected_hooks": expected,
        "hit_hooks_are_the_tail": [list(s) for s in saves[1]] == tail,
        "k_err": k_err,
        "v_err": v_err,
        "logit_err": float(np.abs(done.logits - out.logits[0, -1].numpy()).max()),
        "hit_cached": cached,
        "hit_k_err": max(hit_k, hit_v),
        "pieces": len(pieces),
        "staged_pieces": len(staged),
        "staged_err": max(staged_k, staged_v),
        "ring_ok": ring_ok,
    }  # fmt: skip
    scale = max(float(out.logits.abs().max()), 1.0)
    bound = 1e-4 if dtype == "float32" else 0.05 * scale
    broken = [name for name, ok in (
        ("hook order", found["hooks"] == found["expected_hooks"]),
        ("paged layout (K)", k_err < bound),
        ("paged layout (V)", v_err < bound),
        ("raw logits", found["logit_err"] < bound),
        ("a prefix hit computes only the tail", found["hit_hooks_are_the_tail"]),
        ("a prefix hit's cached positions read from the blocks", max(hit_k, hit_v) < bound),
        ("pieces through the staging ring", max(staged_k, staged_v) < bound),
        ("the ring: 4 slots allocated once, all given back", ring_ok),
        ("pieces of one slot each", len(staged) > len(pieces)),
    ) if not ok]  # fmt: skip
    found["broken"] = broken
    print(json.dumps(found))
    backend.close()
    return 1 if broken else 0


def _float32(x, dtype: str):
    import numpy as np

    from exo_split.kv import float32_from_bf16_words

    return float32_from_bf16_words(x) if dtype == "bfloat16" else x.astype(np.float32)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--device")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    sys.exit(main(a.checkpoint, a.device, a.dtype))
