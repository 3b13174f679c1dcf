"""Hybrid models (recurrent layers beside attention: Qwen3-Next's gated delta net): the
state description against what both libraries hold, the state frame on the wire (sans-IO),
the state's part in fidelity, and two nodes over loopback in both directions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from exo_split import layers
from exo_split.errors import ProtocolError
from exo_split.fidelity import FLOAT32_LOGIT_BOUND, run_check
from exo_split.spec import load_spec
from exo_split.transport import wire
from exo_split.transport.decoder import FrameDecoder

ARCH = "qwen3_next"


def _stream_spec(spec, n: int, dtype: str = "float32") -> wire.StreamSpec:
    return wire.StreamSpec(spec.n_layers, spec.n_kv_heads, spec.head_dim,
                           wire.WireDtype.from_name(dtype), n,
                           state_bytes=layers.state_bytes(spec, dtype))  # fmt: skip


def test_the_state_description_is_what_transformers_and_mlx_lm_hold(checkpoint):
    """After a prompt, transformers' cache and mlx-lm's hold the state arrays layers.py
    describes (in their own layouts), and the two hold the same numbers."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from exo_split.backends import load_backend

    ckpt = checkpoint(ARCH)
    spec = load_spec(ckpt)
    conv, rec = layers.state_arrays(spec)
    assert layers.recurrent_layers(spec) == (0, 2)
    assert (conv.shape, conv.follows_kv) == ((2, 2 * 2 * 16 + 4 * 16), True)
    assert (rec.shape, rec.follows_kv) == ((4, 16, 16), False)
    assert layers.state_bytes(spec, "bfloat16") == (2 * 128 * 2 + 4 * 16 * 16 * 4, 0) * 2

    ids = list(np.random.default_rng(1).integers(0, 512, 37))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    mlx = load_backend("mlx", ckpt)
    done = mlx.prefill(ids, chunk=16)
    for layer in layers.recurrent_layers(spec):
        theirs = cache.layers[layer]
        t_conv = theirs.conv_states[0][0, :, -conv.shape[0] :].T.numpy()  # [K - 1, conv_dim]
        t_rec = theirs.recurrent_states[0][0].transpose(-1, -2).numpy()  # [Hv, Dv, Dk]
        ours = mlx.export(done.cache)[layer]
        assert isinstance(ours, layers.LayerState) and ours.token_start == len(ids)
        assert [a.shape for a in ours.arrays] == [conv.shape, rec.shape]
        assert np.abs(ours.arrays[0] - t_conv).max() < 1e-4
        assert np.abs(ours.arrays[1] - t_rec).max() < 1e-4


def test_a_state_piece_converts_only_what_follows_the_kv_dtype():
    conv = np.arange(6, dtype=np.float32).reshape(2, 3)
    rec = np.full((1, 2, 2), 0.1, np.float32)
    described = (
        layers.StateArray("conv", (2, 3), True),
        layers.StateArray("rec", (1, 2, 2), False),
    )
    st = layers.new_state(4, 9, described, "float32", [conv, rec])
    bf = st.astype("bfloat16")
    assert bf.arrays[0].dtype == np.uint16 and bf.arrays[1] is rec
    back = layers.LayerState.from_bytes(4, 9, described, "bfloat16", b"".join(bf.buffers()))
    assert back.astype("float32").arrays[0].tolist() == conv.tolist()
    with pytest.raises(ValueError, match="expected"):
        layers.LayerState.from_bytes(4, 9, described, "bfloat16", b"".join(bf.buffers()) + b"x")
    with pytest.raises(ValueError, match="expected"):
        layers.new_state(4, 9, described, "float32", [conv, rec.astype(np.float16)])


def test_the_plan_sends_each_state_once_in_the_last_chunk_in_layer_order(checkpoint):
    spec = load_spec(checkpoint(ARCH))
    sspec = _stream_spec(spec, 100)
    assert sspec.states == (0, 2)
    plan = wire.Plan((60, 40), 32, spec.n_layers, 0, (), sspec.states)
    assert list(plan.pieces()) == [(1, 0, 60), (3, 0, 60),
                                   (0, 100, 0), (1, 60, 40), (2, 100, 0), (3, 60, 40)]  # fmt: skip
    frames = list(plan.frames())
    assert [f for f in frames if f[3] == 0] == [(2, 0, 100, 0), (4, 2, 100, 0)]
    assert wire.Plan.from_json(plan.to_json(), sspec) == plan
    with pytest.raises(ProtocolError, match="HELLO plan states"):
        wire.Plan.from_json({**plan.to_json(), "states": [0]}, sspec)
    with pytest.raises(ProtocolError, match="HELLO plan states"):
        wire.Plan.from_json({k: v for k, v in plan.to_json().items() if k != "states"}, sspec)
    # a stream that starts later (the decode node holds a prefix): the state still comes
    later = wire.Plan((60,), 32, spec.n_layers, 40, (), sspec.states)
    assert list(later.pieces()) == [(0, 100, 0), (1, 40, 60), (2, 100, 0), (3, 40, 60)]


def _frames_of(spec, plan, n: int, state_payload: bytes) -> list[bytes]:
    out = [wire.frame_bytes(wire.encode_hello({"plan": plan.to_json()}))]
    per = 2 * spec.n_kv_heads * spec.head_dim * 4
    for _, layer, start, m in plan.frames():
        blocks = [memoryview(state_payload if m == 0 else bytes(m * per))]
        out.append(wire.frame_bytes(wire.layer_frame(layer, start, m, wire.WireDtype.float32,
                                                     blocks)))  # fmt: skip
    return out


def test_the_decoder_takes_a_state_frame_of_its_size_and_refuses_another(checkpoint):
    spec = load_spec(checkpoint(ARCH))
    n = 20
    sspec = _stream_spec(spec, n)
    plan = wire.Plan((n,), 64, spec.n_layers, 0, (), sspec.states)
    size = sspec.state_bytes[0]
    good = _frames_of(spec, plan, n, bytes(size))
    dec = FrameDecoder(sspec)
    got = [f for data in good for f in dec.feed(data)]
    states = [f for f in got if f.kind is wire.Kind.LAYER and f.header.n_tokens == 0]
    assert [f.header.layer for f in states] == [0, 2] and all(f.last for f in states)
    assert all(len(f.payload) == size and f.k is None for f in states)
    assert states[0].header.describe() == "LAYER 0 state after 20 tokens"

    short = _frames_of(spec, plan, n, bytes(size - 4))
    dec = FrameDecoder(sspec)
    dec.feed(short[0])
    with pytest.raises(
        ProtocolError, match=f"wrong payload_len on LAYER 0 state after 20 tokens: expected {size}"
    ):
        dec.feed(short[1])
    # KV where the plan wants layer 0's state: refused by its header, before any payload
    kv = wire.frame_bytes(wire.layer_frame(0, 0, n, wire.WireDtype.float32,
                                           [memoryview(bytes(n * 2 * 2 * 32 * 4))]))  # fmt: skip
    dec = FrameDecoder(sspec)
    dec.feed(good[0])
    with pytest.raises(ProtocolError, match="expected its state after 20 tokens, got LAYER 0 t"):
        dec.feed(kv[: wire.HEADER_SIZE])


def test_the_state_is_what_keeps_the_decode_exact(checkpoint, monkeypatch):
    """All four pairings pass within the float32 bound; with the received state dropped (the
    decode cache left at zeros) the torch->mlx decode leaves the bound by far."""
    from exo_split.backends.mlx_backend import MLXBackend

    ckpt = checkpoint(ARCH)
    report = run_check(ckpt, max_tokens=8)
    assert report.passed, [p.reason for p in report.failing]
    assert {p.name for p in report.pairings} == {"torch->mlx", "mlx->torch", "torch->torch",
                                                  "mlx->mlx"}  # fmt: skip
    inject = MLXBackend.inject

    def without_states(self, cache, kv):
        if not isinstance(kv, layers.LayerState):
            inject(self, cache, kv)

    monkeypatch.setattr(MLXBackend, "inject", without_states)
    report = run_check(ckpt, max_tokens=8)
    worst = max(r.max_logit_diff / max(1.0, r.reference_logit_max)
                for p in report.pairings if p.name == "torch->mlx" for r in p.prompts)  # fmt: skip
    assert worst > 10 * FLOAT32_LOGIT_BOUND


def test_an_mlx_decode_step_taken_back_restores_the_state(checkpoint):
    """The pipelined decode loop undoes a step it queued on a token the host then changed:
    a recurrent layer's state goes back to what it was (the last step only)."""
    import mlx.core as mx

    from exo_split.backends import load_backend
    from exo_split.backends.mlx_cache import is_state

    mlx = load_backend("mlx", checkpoint(ARCH))
    cache = mlx.prefill(list(range(3, 23))).cache
    before = [np.array(c.arrays[1]) for c in cache if is_state(c)]
    mlx.step(cache, 7)
    assert mlx.cache_len(cache) == 21
    for c in cache:
        c.trim(1)
    after = [np.array(c.arrays[1]) for c in cache if is_state(c)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert mlx.cache_len(cache) == 20
    with pytest.raises(ValueError, match="cannot be cut back 1 positions"):
        next(c for c in cache if is_state(c)).trim(1)
    with pytest.raises(ValueError, match="cannot be cut back to a prefix"):
        mlx.fork(cache, 10, 40)
    mx.clear_cache()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", [ARCH, "granitemoehybrid"])
def test_two_nodes_hand_a_hybrid_over_in_both_directions(checkpoint, tmp_path, arch):
    """torch prefill node -> MLX decode node (in place, overlapped and sequential, chunked)
    and MLX prefill -> torch decode (the copy path): tokens are transformers'; each
    recurrent layer's state travels once, after the prompt, and the report counts its bytes."""
    from nodes import NodeProcess, generate_sync
    from reference import prompt_ids, reference_generate

    ckpt = checkpoint(arch)
    spec = load_spec(ckpt)
    per_position = 2 * spec.n_kv_heads * spec.head_dim * 4
    states = layers.state_bytes(spec, "float32")
    recurrent = layers.recurrent_layers(spec)
    attention = spec.n_layers - len(recurrent)
    t, m = NodeProcess(ckpt, "torch", tmp_path), NodeProcess(ckpt, "mlx", tmp_path)
    try:
        t.wait_ready()
        m.wait_ready()
        for n, chunk, overlap in ((1, None, True), (40, None, True), (300, 64, True),
                                  (100, None, False)):  # fmt: skip
            ids = prompt_ids(n, seed=n)
            body = {"token_ids": ids, "max_tokens": 10, "prefill_peer": t.addr, "chunk": chunk,
                    "fallback": "none", "overlap": overlap}  # fmt: skip
            done = generate_sync(m.url, body)
            report = done["report"]
            assert report["fallback"] is None, report
            assert done["tokens"] == reference_generate(ckpt, ids, 10), (n, chunk, overlap)
            pieces = [(p["layer"], p["n_tokens"]) for p in report["layers"]]
            assert [p for p in pieces if p[1] == 0] == [(i, 0) for i in recurrent]
            assert sum(k for _, k in pieces) == attention * n
            assert report["kv_bytes"] == attention * n * per_position + sum(states)
        ids = prompt_ids(120, seed=4)  # the decode node's own prefill and decode
        done = generate_sync(m.url, {"token_ids": ids, "max_tokens": 10, "prefill": "local"})
        assert done["tokens"] == reference_generate(ckpt, ids, 10)
        ids = prompt_ids(50, seed=3)
        body = {"token_ids": ids, "max_tokens": 10, "prefill_peer": m.addr, "fallback": "none"}
        done = generate_sync(t.url, body)
        assert done["report"]["fallback"] is None
        assert done["tokens"] == reference_generate(ckpt, ids, 10)
    finally:
        t.stop()
        m.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hybrid_conversation_reuses_a_prefix_only_where_its_state_is(checkpoint, tmp_path):
    """A recurrent layer's state is that of a cache's whole length: a cached entry serves a
    prompt that continues all of it (the next turn of a chat), on either node, or one that
    continues it up to the end of its prompt (the decode node's snapshot there), and
    nothing else (another branch computes everything). The decode node then receives only the
    positions it lacks, and the prefill node resumes from its own entry's state."""
    from nodes import NodeProcess, generate_sync
    from reference import prompt_ids, reference_generate

    ckpt = checkpoint(ARCH)
    spec = load_spec(ckpt)
    per_position = 2 * spec.n_kv_heads * spec.head_dim * 4
    states = sum(layers.state_bytes(spec, "float32"))
    t = NodeProcess(ckpt, "torch", tmp_path, prefix_cache_bytes="256M")
    m = NodeProcess(ckpt, "mlx", tmp_path, prefix_cache_bytes="256M")

    def turn(ids, **kw):
        body = {"token_ids": ids, "max_tokens": 10, "prefill_peer": t.addr, "fallback": "none",
                **kw}  # fmt: skip
        done = generate_sync(m.url, body)
        assert done["tokens"] == reference_generate(ckpt, ids, 10), kw
        return done["tokens"], done["report"]

    try:
        t.wait_ready()
        m.wait_ready()
        first = prompt_ids(200, seed=7)
        reply, report = turn(first)
        assert report["prefix"]["decode_cached_tokens"] == 0
        # the next turn: the first prompt, the reply, a new message
        second = first + reply + prompt_ids(30, seed=8)
        reply2, report = turn(second, chunk=64)
        held = len(first) + len(reply) - 1  # the decode node's entry: the last token unfed
        assert report["prefix"]["decode_cached_tokens"] == held
        assert report["prefix"]["prefill_cached_tokens"] == len(first)
        assert report["kv_bytes"] == 2 * (len(second) - held) * per_position + states
        # another branch: shares only part of an entry, whose state is of its whole length
        _, report = turn(first[:150] + prompt_ids(40, seed=9))
        assert report["prefix"]["decode_cached_tokens"] == 0
        assert report["prefix"]["prefill_cached_tokens"] == 0
        # the uncached suffix of a turn prefilled by the decode node itself
        third = second + reply2 + prompt_ids(20, seed=10)
        reply3, report = turn(third, prefill="local")
        assert report["prefix"]["decode_cached_tokens"] == len(second) + len(reply2) - 1
        # the next turn with the reply rendered otherwise than it was generated (a template
        # that drops a reasoning model's thinking): reused from the state snapshot the decode
        # node kept at the end of `third`'s prompt (it reused nothing before snapshots)
        fourth = third + [(r + 1) % 512 for r in reply3[:4]] + prompt_ids(15, seed=11)
        _, report = turn(fourth)
        assert report["prefix"]["decode_cached_tokens"] == len(third)
        assert report["kv_bytes"] == 2 * (len(fourth) - len(third)) * per_position + states
    finally:
        t.stop()
        m.stop()


@pytest.mark.parametrize("text", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_a_qwen3_5_vision_language_checkpoint_runs_its_text_model(checkpoint, tmp_path, text):
    """Qwen3.5 as published (the text model under text_config beside a vision tower): the
    spec is its text model's (the fingerprint of the same text model saved on its own), the
    vision weights stay unloaded, and the check passes within the float32 bound."""
    from checkpoints import build_qwen35_vision_language
    from safetensors import safe_open

    from exo_split.backends import load_backend

    ckpt = build_qwen35_vision_language(tmp_path / "qwen3.5-vl", text)
    with safe_open(ckpt / "model.safetensors", "np") as f:
        assert any(k.startswith("model.visual.") for k in f.keys())  # noqa: SIM118
    spec = load_spec(ckpt)
    assert spec.architecture == text
    assert spec.fingerprint == load_spec(checkpoint(text)).fingerprint
    from mlx.utils import tree_flatten

    mlx = load_backend("mlx", ckpt)
    assert not any("visual" in k for k, _ in tree_flatten(mlx.model.parameters()))
    report = run_check(ckpt, max_tokens=8)
    assert report.passed, [p.reason for p in report.failing]
    for p in report.pairings:
        for r in p.prompts:
            assert r.max_logit_diff <= FLOAT32_LOGIT_BOUND * max(1.0, r.reference_logit_max)


def test_granite_hybrids_without_rope_mean_the_same_on_both_sides(checkpoint):
    """transformers rotates a Granite 4.0-H only when position_embedding_type is "rope" (its
    default, None, means none), mlx-lm unless it is "nope": None reaches mlx-lm as "nope",
    and the check passes within the bound; Mamba only (no attention layer) is refused."""
    from exo_split.backends import load_backend
    from exo_split.errors import BadCheckpoint
    from exo_split.spec import spec_from_config

    ckpt = checkpoint("granitemoehybrid", position_embedding_type=None)
    assert load_spec(ckpt).extra("position_embedding_type") is None
    assert load_backend("mlx", ckpt).model.args.position_embedding_type == "nope"
    report = run_check(ckpt, max_tokens=8)
    assert report.passed, [p.reason for p in report.failing]
    config = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(BadCheckpoint, match="without attention layers"):
        spec_from_config({**config, "layer_types": ["linear_attention"] * 4})
