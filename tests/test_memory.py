"""The decode node's memory, measured: with Llama-3.1-8B's KV geometry (8 KV heads x 128
dims, float32), its peak resident memory during a split request stays within RSS before the
request + 1.15 x the KV + 64 MiB, overlapped and sequential, and the tokens equal
transformers'. The KV lands in the preallocated cache; nothing else the size of a layer is
allocated on the way.

Peak = VmHWM after resetting it (`/proc/PID/clear_refs` = 5) right before the request; both
nodes are processes on 127.0.0.1. Time is not asserted.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nodes import NodeProcess, generate, running
from reference import reference_generate

from exo_split.models.tiny import DEFAULT_CONFIG, build_llama

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

LAYERS, TOKENS, NEW = 4, 4096, 4
GEOMETRY = {  # Llama-3.1-8B's KV: 8 KV heads x head_dim 128 (8 KiB a position a layer, fp32)
    **DEFAULT_CONFIG, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": LAYERS, "num_attention_heads": 8, "num_key_value_heads": 8,
    "head_dim": 128, "eos_token_id": None,
}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_llama(tmp_path_factory.mktemp("kv8x128"), GEOMETRY, seed=8)


@pytest.fixture(scope="module")
def nodes(ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("memory")
    started = {"prefill": NodeProcess(ckpt, "torch", work, "--no-warmup"),
               "decode": NodeProcess(ckpt, "mlx", work, "--no-warmup")}  # fmt: skip
    yield from running(started)


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_peak(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _prompt(n: int) -> list[int]:
    return [1] + [3 + (i * 7919) % 509 for i in range(n - 1)]


def _run(nodes, ids, overlap: bool) -> dict:
    body = {"token_ids": ids, "max_tokens": NEW, "prefill_peer": nodes["prefill"].addr,
            "overlap": overlap, "fallback": "none"}  # fmt: skip
    events = asyncio.run(generate(nodes["decode"].url, body, timeout=300))
    assert events[-1]["type"] == "done", events[-1]
    return events[-1]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
def test_decode_node_peak_memory_is_the_cache_and_little_else(nodes, ckpt, overlap):
    pid = nodes["decode"].proc.pid
    _run(nodes, _prompt(300), overlap)  # warm: kernels and buffers of a first request
    ids = _prompt(TOKENS)
    before = _status(pid, "VmRSS")
    if not _reset_peak(pid):
        pytest.skip("cannot reset the peak RSS of a child process here (/proc/PID/clear_refs)")
    done = _run(nodes, ids, overlap)
    peak = _status(pid, "VmHWM")
    report = done["report"]
    kv = report["kv_bytes"]
    bound = 1.15 * kv + 64 * 2**20
    print(f"{'overlap' if overlap else 'sequential'}: KV {kv / 2**20:.1f} MiB, decode RSS "
          f"before {before / 2**20:.1f} MiB, peak +{(peak - before) / 2**20:.1f} MiB "
          f"({(peak - before) / kv:.2f} x KV; bound {bound / 2**20:.1f} MiB)")  # fmt: skip
    assert kv == 2 * LAYERS * 8 * 128 * 4 * TOKENS
    assert report["fallback"] is None and report["mode"] == ("overlap" if overlap else "sequential")
    assert peak - before <= bound
    if overlap:  # the same tokens as transformers, float32 (once: the reference is slow)
        assert done["tokens"] == reference_generate(ckpt, ids, NEW)
