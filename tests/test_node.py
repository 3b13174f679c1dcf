"""Two real node agents (torch prefill, MLX decode) as processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nodes import TOKEN, NodeProcess, generate_sync, request
from reference import prompt_ids, reference_generate
from test_cli import _Recorder

from exo_split.cli.main import main

pytestmark = pytest.mark.timeout(600)

FAMILIES = ("llama", "qwen3")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def pairs(checkpoint, tmp_path_factory):
    """family -> (prefill node, decode node), started once per module."""
    work = tmp_path_factory.mktemp("nodes")
    started = {}
    for family in FAMILIES:
        ckpt = checkpoint(family, num_hidden_layers=6)
        started[family] = (NodeProcess(ckpt, "torch", work), NodeProcess(ckpt, "mlx", work))
    try:
        for t, m in started.values():
            t.wait_ready()
            m.wait_ready()
        yield started
    finally:
        for t, m in started.values():
            t.stop()
            m.stop()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [None, 128])
def test_split_over_the_network_matches_transformers(pairs, checkpoint, family, chunk):
    t, m = pairs[family]
    ckpt = checkpoint(family, num_hidden_layers=6)
    for n in (1, 300, 2000):
        ids = prompt_ids(n, seed=n)
        done = generate_sync(
            m.url,
            {"token_ids": ids, "max_tokens": NEW_TOKENS, "prefill_peer": t.addr, "chunk": chunk},
        )
        assert done["report"]["fallback"] is None, done["report"]["fallback"]
        assert done["report"]["mode"] == "overlap"
        assert done["tokens"] == reference_generate(ckpt, ids, NEW_TOKENS), (family, n, chunk)
        layers = done["report"]["layers"]
        n_chunks = 1 if chunk is None or n <= chunk else -(-n // chunk)
        assert len(layers) == 6 * n_chunks


def test_an_mlx_prefill_node_streams_its_own_chunks(pairs, checkpoint, tmp_path):
    """MLX prefills in chunks of 2,048 even when none is asked for, and the last position
    alone (its logits are the only ones computed): the plan its HELLO announces says so, the
    frames follow it, and the tokens are transformers'."""
    _, m = pairs["llama"]
    ckpt = checkpoint("llama", num_hidden_layers=6)
    mlx_prefill = NodeProcess(ckpt, "mlx", tmp_path).wait_ready()
    try:
        ids = prompt_ids(2100, seed=21)
        for chunk, n_chunks in ((None, 3), (700, 4)):
            body = {"token_ids": ids, "max_tokens": 6, "prefill_peer": mlx_prefill.addr,
                    "chunk": chunk, "fallback": "none"}  # fmt: skip
            done = generate_sync(m.url, body)
            assert done["tokens"] == reference_generate(ckpt, ids, 6), chunk
            layers = done["report"]["layers"]
            assert len(layers) == 6 * n_chunks
            assert sum(p["n_tokens"] for p in layers) == 6 * 2100
    finally:
        mlx_prefill.stop()


def test_layers_sent_as_head_ranges_are_assembled_on_both_decode_backends(checkpoint, tmp_path):
    """A prefill node whose frames carry head ranges (as the workers of a tensor-parallel
    engine hold a layer's KV heads: 4 heads as 2 ranges, the test hook of docs/vllm.md):
    the MLX decode node lands each range in its cache, the torch one assembles each token
    range before injecting it; both give transformers' tokens, and exactly the KV of a whole
    layer moved."""
    from exo_split.report.text import prefill_text

    ckpt = checkpoint("llama", num_hidden_layers=4, num_key_value_heads=4)
    env = {"EXO_SPLIT_TEST_HEAD_RANGES": "2"}
    nodes = [NodeProcess(ckpt, "torch", tmp_path, env=env), NodeProcess(ckpt, "mlx", tmp_path),
             NodeProcess(ckpt, "torch", tmp_path)]  # fmt: skip
    try:
        prefill, *decoders = (n.wait_ready() for n in nodes)
        for n, chunk in ((1, None), (300, 128), (1000, None)):
            ids = prompt_ids(n, seed=n)
            want = reference_generate(ckpt, ids, 6)
            for d in decoders:
                body = {"token_ids": ids, "max_tokens": 6, "prefill_peer": prefill.addr,
                        "chunk": chunk, "fallback": "none"}  # fmt: skip
                done = generate_sync(d.url, body)
                assert done["tokens"] == want, (d.info.get("backend"), n, chunk)
                report = done["report"]
                assert report["timeline"]["prefill"]["head_ranges"] == 2
                assert "KV heads in 2 ranges" in prefill_text(report["timeline"]["prefill"])
                assert report["kv_bytes"] == n * 4 * 2 * 4 * 16 * 4  # layers x K,V x heads x dim
    finally:
        for node in nodes:
            node.stop()


def _overlap_report(pairs, overlap: bool) -> dict:
    t, m = pairs["llama"]
    ids = prompt_ids(2000, seed=11)
    body = {"token_ids": ids, "max_tokens": 2, "prefill_peer": t.addr, "overlap": overlap}
    return generate_sync(m.url, body)["report"]


def test_overlap_is_proven_by_timestamps(pairs):
    """With overlap, layer 0 is received and injected on the decode node before the prefill
    node has finished computing the last layer; with --no-overlap it is not."""
    rep = _overlap_report(pairs, overlap=True)
    slack = rep["clock_uncertainty_s"] or 0.0
    last_compute = max(p["compute_done"] for p in rep["layers"])
    first = rep["layers"][0]
    assert first["layer"] == 0
    assert first["injected"] + slack < last_compute, rep["layers"]
    assert rep["hidden_fraction"] > 0.5

    seq = _overlap_report(pairs, overlap=False)
    assert seq["mode"] == "sequential"
    last_compute = max(p["compute_done"] for p in seq["layers"])
    assert all(p["received"] + slack > last_compute for p in seq["layers"])
    assert all(p["sent"] >= seq["events"]["prefill_end"] - 1e-6 for p in seq["layers"])


def _stats(node) -> dict:
    status, body, _ = asyncio.run(request("GET", f"{node.url}/v1/info"))
    assert status == 200
    return json.loads(body)["stats"]


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_wrong_or_missing_token_is_refused_before_any_work(pairs, token):
    t, m = pairs["llama"]
    before = _stats(t), _stats(m)
    body = {"request_id": "x", "token_ids": [1, 2, 3], "fingerprint": t.info["fingerprint"]}
    for node, path in ((t, "/v1/prefill"), (m, "/v1/generate"), (t, "/v1/info")):
        status, raw, _ = asyncio.run(request("POST" if "info" not in path else "GET",
                                             node.url + path, token=token, json=body))  # fmt: skip
        assert status == 401, raw
        assert TOKEN not in raw.decode()
    assert (_stats(t), _stats(m)) == before  # neither node counted a prefill or a generate
    status, _, _ = asyncio.run(request("GET", f"{t.url}/v1/health", token=None))
    assert status == 200


def test_token_ids_outside_the_vocabulary_are_refused_before_any_work(pairs):
    """On CUDA an id past the embedding is a device-side assert that poisons the process:
    both endpoints answer 400 before anything is admitted or computed."""
    t, m = pairs["llama"]
    before_t, before_m = _stats(t), _stats(m)
    vocab = t.info["spec"]["vocab_size"]
    spec = t.info["spec"]
    status, raw, _ = asyncio.run(request("GET", f"{m.url}/v1/models"))
    model = json.loads(raw)["data"][0]["id"]
    for bad in (vocab, 2**31 - 1):
        prefill_body = {"request_id": "v", "token_ids": [1, 5, bad], "spec": spec,
                        "fingerprint": spec["fingerprint"]}  # fmt: skip
        status, raw, _ = asyncio.run(request("POST", f"{t.tls_url}/v1/prefill", json=prefill_body))
        assert status == 400, raw
        message = json.loads(raw)["message"]
        assert f"token id {bad} is outside the vocabulary (ids 0..{vocab - 1})" == message
        gen_body = {"token_ids": [1, 5, bad], "max_tokens": 2, "prefill_peer": t.addr}
        status, raw, _ = asyncio.run(request("POST", f"{m.url}/v1/generate", json=gen_body))
        assert status == 400, raw
        assert json.loads(raw)["message"] == message
        # the OpenAI API takes a prompt of token ids too: the same check, in OpenAI's shape
        completion = {"model": model, "prompt": [1, 5, bad], "max_tokens": 2}
        status, raw, _ = asyncio.run(request("POST", f"{m.url}/v1/completions", json=completion))
        assert status == 400, raw
        assert json.loads(raw)["error"]["message"] == message
    # a negative id is not an id at all: refused as malformed, on every endpoint
    for node, path, ids_body in (
        (t, "/v1/prefill", {"request_id": "n", "token_ids": [1, -1], "spec": spec,
                            "fingerprint": spec["fingerprint"]}),
        (m, "/v1/generate", {"token_ids": [1, -1], "max_tokens": 2, "prefill_peer": t.addr}),
        (m, "/v1/completions", {"model": model, "prompt": [1, -1], "max_tokens": 2}),
    ):  # fmt: skip
        base = node.tls_url if path == "/v1/prefill" else node.url  # node-to-node: TLS only
        status, raw, _ = asyncio.run(request("POST", base + path, json=ids_body))
        assert status == 400, (path, raw)
        assert "non-negative" in raw.decode() or "list of token ids" in raw.decode(), raw
    # no work: nothing counted (no prefill, no generate, no ticket), nothing held at any
    # moment (the KV peak), nothing in progress on either node
    assert _stats(t) == before_t and _stats(m) == before_m
    assert _stats(t)["kv_bytes_peak"] == before_t["kv_bytes_peak"]
    assert _stats(t)["active"] == {} and _stats(m)["active"] == {}


def test_incompatible_fingerprint_fails_before_any_layer_frame(pairs, checkpoint, tmp_path):
    t, _ = pairs["llama"]
    other = tmp_path / "other"
    shutil.copytree(checkpoint("llama", num_hidden_layers=6), other)
    config = json.loads((other / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 12345.0
    (other / "config.json").write_text(json.dumps(config))
    m2 = NodeProcess(other, "mlx", tmp_path).wait_ready()
    try:
        before = _stats(t)
        events = asyncio.run(_events(m2.url, {"token_ids": [1, 5, 9], "max_tokens": 3,
                                               "prefill_peer": t.addr, "fallback": "none"}))  # fmt: skip
        assert events[-1]["type"] == "error"
        assert "(here != the decode node): rope_theta: 50000.0 != 12345.0" in events[-1]["message"]
        assert not any(e["type"] == "token" for e in events)
        assert _stats(t) == before  # refused before any prefill ran
        # With the default fallback the request still completes, locally, and says why.
        done = generate_sync(m2.url, {"token_ids": [1, 5, 9], "max_tokens": 3,
                                      "prefill_peer": t.addr})  # fmt: skip
        assert done["report"]["mode"] == "local"
        assert "rope_theta" in done["report"]["fallback"]
    finally:
        m2.stop()


async def _events(url, body):
    from nodes import generate

    return await generate(url, body)


def test_prefill_endpoint_answers_409_naming_fields(pairs, checkpoint):
    from exo_split.spec import load_spec

    t, _ = pairs["llama"]
    spec = load_spec(checkpoint("qwen3", num_hidden_layers=6)).to_dict()
    body = {
        "request_id": "r",
        "token_ids": [1, 2],
        "spec": spec,
        "fingerprint": spec["fingerprint"],
    }
    status, raw, _ = asyncio.run(request("POST", f"{t.tls_url}/v1/prefill", json=body))
    assert status == 409
    assert "architecture: 'llama' != 'qwen3'" in json.loads(raw)["message"]
    assert not raw.startswith(b"EXOS")


def test_split_generate_cli_streams_and_ends_with_json(pairs, checkpoint, monkeypatch, capsys):
    t, m = pairs["llama"]
    from exo_split.tokenizer import TextCodec

    ckpt = checkpoint("llama", num_hidden_layers=6)
    from exo_split.models.tiny import sample_prompt

    prompt = sample_prompt(120, seed=4)
    env = {"EXO_SPLIT_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"}
    args = ["split-generate", "--prompt", prompt, "--max-tokens", "8", "--decode-peer", m.addr,
            "--prefill-peer", t.addr]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "exo_split", *args, "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    ids = TextCodec(ckpt).tokenize(prompt)
    assert doc["tokens"] == reference_generate(ckpt, ids, 8)
    rep = doc["report"]
    assert rep["ttft_source"] == "client" and rep["ttft_s"] > 0
    assert rep["prefill_compute_s"] > 0 and rep["kv_bytes"] > 0
    assert [p["layer"] for p in rep["layers"]] == list(range(6))
    for key in ("compute_done", "sent", "received", "injected"):
        assert all(key in p for p in rep["layers"])
    # Without --json the text streams: one write and flush of stdout per token as it arrives
    # (in process, so the writes can be seen one by one), then the report card on stderr.
    monkeypatch.setenv("EXO_SPLIT_TOKEN", TOKEN)
    monkeypatch.delenv("EXO_SPLIT_PEERS", raising=False)
    stdout = _Recorder()
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(args) == 0
    writes = [i for i, (kind, _) in enumerate(stdout.events) if kind == "write"]
    assert len(writes) >= 8, "one write per token, not the text at the end"
    assert all(stdout.events[i + 1][0] == "flush" for i in writes)
    assert stdout.text().strip() == doc["text"].strip()
    err = capsys.readouterr().err
    assert "exposed handoff" in err and "TTFT" in err


SMOKE = Path(__file__).resolve().parents[1] / "scripts" / "smoke-two-machines"


def _smoke(decode, prefill, token=TOKEN):
    env = {"EXO_SPLIT_TOKEN": token, "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(SMOKE), decode.addr, prefill.addr, "--prompt-tokens", "300",
           "--max-tokens", "4"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_two_machine_smoke_script_passes_on_a_good_pair_and_says_what_is_wrong(pairs):
    t, m = pairs["llama"]
    good = _smoke(m, t)
    assert good.returncode == 0, good.stdout + good.stderr
    checks = [line.split(": ", 1)[0] for line in good.stdout.splitlines()]
    assert checks == [
        f"ok   decode node at {m.url}",
        f"ok   prefill node at {t.url}",
        "ok   same model on both",
        "ok   split request",
        "ok   KV streamed from the prefill node",
    ], good.stdout
    # A failed check stops the script before it sends a request.
    bad_token = _smoke(m, t, token="not-the-token")
    assert bad_token.returncode == 1
    # Neither node can prove it holds this token: nothing token-bound is sent to either.
    assert bad_token.stdout.count("does not hold this token") == 2, bad_token.stdout
    assert "split request" not in bad_token.stdout
    other_model = _smoke(m, pairs["qwen3"][0])
    assert other_model.returncode == 1
    assert "FAIL same model on both" in other_model.stdout
    assert "split request" not in other_model.stdout


def test_a_ready_node_has_frozen_its_start_up_objects_out_of_the_collectors_reach(pairs):
    """A full collection of what a node loads (transformers, MLX, the model) takes ~150 ms:
    a stall in every stream of the node. Once ready, both kinds of node have frozen those
    objects (gc.freeze), so a later collection scans only what requests made; after a
    split the collector has still run (it is frozen out of, not off)."""
    import asyncio
    import json

    from nodes import request

    t, m = pairs["llama"]
    generate_sync(m.url, {"token_ids": prompt_ids(300, seed=9), "max_tokens": 4,
                          "prefill_peer": t.addr})  # fmt: skip
    for node in (t, m):
        status, raw, _ = asyncio.run(request("GET", f"{node.url}/v1/info"))
        assert status == 200
        gc_stats = json.loads(raw)["stats"]["gc"]
        assert gc_stats["frozen"] > 10_000, gc_stats
        assert len(gc_stats["collections"]) == 3 and gc_stats["collections"][0] > 0
