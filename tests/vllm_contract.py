"""What exo-split's connector needs of vLLM, checked in the vLLM environment (test_vllm.py
runs it there): prints one JSON line of findings, the test asserts them.

  python tests/vllm_contract.py CHECKPOINT

- hooks: save_kv_layer once per layer, in layer order, for each of vLLM's chunks;
- layout: K/V gathered from the paged cache equal transformers' cache (the reference of
  this environment: transformers < 5.20, as vLLM pins);
- the first token's raw logits (logprobs=-1, raw_logits) equal transformers';
- a prefix hit: the repeated prompt computes only its tail, and the cached positions are
  still read from vLLM's blocks.
"""

from __future__ import annotations

import json
import os
import sys

BUDGET = 256


def main(ckpt: str) -> None:
    os.environ["EXO_SPLIT_VLLM_ARGS"] = json.dumps(
        {"kv_cache_memory_bytes": 128 << 20, "max_num_batched_tokens": BUDGET}
    )
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from exo_split.backends import load_backend
    from exo_split.backends import vllm_kv as conn

    backend = load_backend("vllm", ckpt)
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

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values

    def errors(got: list) -> tuple[float, float]:
        k_err = v_err = 0.0
        for layer in range(n_layers):
            k = np.concatenate([p.k for p in got if p.layer == layer], axis=1)
            v = np.concatenate([p.v for p in got if p.layer == layer], axis=1)
            k_err = max(k_err, float(np.abs(k - cache.layers[layer].keys[0].numpy()).max()))
            v_err = max(v_err, float(np.abs(v - cache.layers[layer].values[0].numpy()).max()))
        return k_err, v_err

    k_err, v_err = errors(pieces)
    hit_k, hit_v = errors(hit)
    chunks = [(a, min(a + BUDGET, len(ids))) for a in range(0, len(ids), BUDGET)]
    expected = [[layer, a, b] for a, b in chunks for layer in range(n_layers)]
    tail = [[layer, cached, len(ids)] for layer in range(n_layers)]
    print(json.dumps({
        "vllm": backend.describe()["version"],
        "hooks": [list(s) for s in saves[0]],
        "expected_hooks": expected,
        "hit_hooks_are_the_tail": [list(s) for s in saves[1]] == tail,
        "k_err": k_err,
        "v_err": v_err,
        "logit_err": float(np.abs(done.logits - out.logits[0, -1].numpy()).max()),
        "hit_cached": cached,
        "hit_k_err": max(hit_k, hit_v),
        "pieces": len(pieces),
    }))  # fmt: skip
    backend.close()


if __name__ == "__main__":
    main(sys.argv[1])
