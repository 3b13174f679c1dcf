"""Latent attention (MLA: DeepSeek-V3): what both libraries cache per position (the
normalized latent and the roped key all heads share), the order of the roped key's
dimensions between them, K and V of their own widths on the wire (sans-IO), and two nodes
over loopback: both directions, chunks, several requests in one decode batch, a second turn
from the prefix caches. Checked against transformers on a tiny random checkpoint."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from exo_split import layers
from exo_split.errors import ProtocolError
from exo_split.fidelity import FLOAT32_LOGIT_BOUND, run_check
from exo_split.spec import load_spec
from exo_split.transport import wire
from exo_split.transport.decoder import FrameDecoder

ARCH = "deepseek_v3"
LATENT, ROPE = 32, 8  # tests/checkpoints.py: kv_lora_rank, qk_rope_head_dim


def test_the_cache_description_is_what_transformers_and_mlx_lm_hold(checkpoint):
    """One "head" per layer: K the latent (kv_lora_rank wide), V the roped key
    (qk_rope_head_dim wide), in both libraries' caches after a prompt; the numbers agree
    once transformers' order of the rotated dimensions is undone (layers.latent_key_order),
    and our torch backend's pieces are in the wire's (mlx-lm's) order."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from exo_split.backends import load_backend

    ckpt = checkpoint(ARCH)
    spec = load_spec(ckpt)
    assert (spec.n_kv_heads, spec.head_dim, spec.v_dim) == (1, LATENT, ROPE)
    assert layers.is_latent(spec) and spec.layer_bytes_per_token(4) == (LATENT + ROPE) * 4
    order = layers.latent_key_order(spec)
    assert order.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]

    ids = list(np.random.default_rng(2).integers(0, 512, 29))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    theirs = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=theirs, use_cache=True)
    mlx = load_backend("mlx", ckpt).export(load_backend("mlx", ckpt).prefill(ids, chunk=8).cache)
    ours = load_backend("torch", ckpt)
    torch_pieces = ours.export(ours.prefill(ids, chunk=8).cache)
    for layer in range(spec.n_layers):
        t_k = theirs.layers[layer].keys[0].numpy()  # [1, T, 32]
        t_v = theirs.layers[layer].values[0].numpy()  # [1, T, 8], transformers' order
        m, p = mlx[layer], torch_pieces[layer]
        assert t_k.shape == m.k.shape == p.k.shape == (1, len(ids), LATENT)
        assert t_v.shape == m.v.shape == p.v.shape == (1, len(ids), ROPE)
        assert np.abs(m.k - t_k).max() < 1e-4
        assert np.abs(m.v[..., order] - t_v).max() < 1e-4
        assert np.abs(m.v - t_v).max() > 1e-2  # the orders do differ
        assert np.abs(p.v - m.v).max() < 1e-4 and np.abs(p.k - m.k).max() < 1e-4


def test_the_wire_carries_k_and_v_of_their_own_widths():
    """A latent layer's LAYER payload is K ([1, n, 32]) then V ([1, n, 8]): the decoder
    splits it there and refuses a payload sized as if V were as wide as K."""
    stream = wire.StreamSpec(2, 1, LATENT, wire.WireDtype.float32, 5, v_dim=ROPE)
    assert stream.bytes_per_token == (LATENT + ROPE) * 4
    plan = wire.Plan((5,), stream.frame_tokens(), 2)
    k = np.arange(5 * LATENT, dtype=np.float32).reshape(1, 5, LATENT)
    v = -np.arange(5 * ROPE, dtype=np.float32).reshape(1, 5, ROPE)
    dec = FrameDecoder(stream)
    hello = {"plan": plan.to_json()}
    frames = dec.feed(wire.frame_bytes(wire.encode_hello(hello)))
    frames += dec.feed(wire.frame_bytes(wire.encode_layer(0, 0, 5, wire.WireDtype.float32, k, v)))
    layer = frames[-1]
    assert np.array_equal(np.frombuffer(layer.k, np.float32).reshape(k.shape), k)
    assert np.array_equal(np.frombuffer(layer.v, np.float32).reshape(v.shape), v)
    wide = np.zeros((1, 5, LATENT), np.float32)  # V as wide as K: the other model's shape
    with pytest.raises(ProtocolError, match=r"1 heads x 5 tokens x \(32 \+ 8\) dims"):
        dec.feed(wire.frame_bytes(wire.encode_layer(1, 0, 5, wire.WireDtype.float32, k, wide)))


def test_the_rope_order_is_what_keeps_the_handoff_exact(checkpoint, monkeypatch):
    """With the roped key sent in transformers' order (no reordering on the torch side),
    the pairings across libraries leave the float32 bound by far; with it, every pairing is
    within it."""
    from exo_split.backends import torch_backend

    ckpt = checkpoint(ARCH)
    report = run_check(ckpt, max_tokens=6)
    assert report.passed, [p.reason for p in report.failing]
    monkeypatch.setattr(torch_backend, "latent_key_order", lambda spec: np.arange(spec.v_dim))
    broken = run_check(ckpt, max_tokens=6)
    by_name = {p.name: p for p in broken.pairings}
    for name in ("torch->mlx", "mlx->torch"):
        worst = max(
            r.max_logit_diff / max(1.0, r.reference_logit_max) for r in by_name[name].prompts
        )
        assert worst > 10 * FLOAT32_LOGIT_BOUND, (name, worst)
    assert by_name["torch->torch"].agrees_with_reference  # each side alone stays right


def test_glm_flash_norms_the_latent_with_transformers_epsilon(checkpoint, monkeypatch):
    """GLM-4.7-Flash (glm4_moe_lite): mlx-lm normalizes the latent with rms_norm_eps (1e-4
    in the test checkpoint), transformers with 1e-6. The MLX backend sets transformers' on
    those norms: without it the MLX side's logits move many times further from
    transformers'. Its dense-then-experts layer list reaches mlx-lm as a count."""
    import dataclasses

    from exo_split import families
    from exo_split.backends import load_backend

    ckpt = checkpoint("glm4_moe_lite")
    spec = load_spec(ckpt)
    assert spec.extra("mlp_layer_types") == ("dense", "dense", "sparse", "sparse")
    assert load_backend("mlx", ckpt).model.args.first_k_dense_replace == 2

    def worst(report):
        by_name = {p.name: p for p in report.pairings}
        return max(r.max_logit_diff for n in ("torch->mlx", "mlx->mlx") for r in by_name[n].prompts)

    fixed = run_check(ckpt, max_tokens=6)
    assert fixed.passed, [p.reason for p in fixed.failing]
    fam = dataclasses.replace(families.FAMILIES["glm4_moe_lite"], latent_norm_eps=None)
    monkeypatch.setitem(families.FAMILIES, "glm4_moe_lite", fam)
    assert worst(run_check(ckpt, max_tokens=6)) > 5 * worst(fixed)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_hand_latent_attention_over(checkpoint, tmp_path):
    """torch prefill node -> MLX decode node (in place; overlapped, chunked, sequential) and
    MLX prefill -> torch decode (the copy path): transformers' tokens, and the report's
    kv_bytes exactly the latent's and the roped key's (40 floats a position and layer, where
    expanded K/V of 4 heads would be 4 x (24 + 24) + ...); four requests at once share the
    decode batch with their solo tokens; a second turn moves only the new positions."""
    from nodes import NodeProcess, generate, generate_sync
    from reference import prompt_ids, reference_generate

    ckpt = checkpoint(ARCH)
    spec = load_spec(ckpt)
    per_position = spec.n_layers * (LATENT + ROPE) * 4
    t = NodeProcess(ckpt, "torch", tmp_path, prefix_cache_bytes="256M")
    m = NodeProcess(ckpt, "mlx", tmp_path, prefix_cache_bytes="256M")

    def body(ids, **kw):
        return {"token_ids": ids, "max_tokens": 10, "prefill_peer": t.addr, "fallback": "none",
                "prefix_cache": False, **kw}  # fmt: skip

    try:
        t.wait_ready()
        m.wait_ready()
        for n, chunk, overlap in ((1, None, True), (40, None, True), (300, 64, True),
                                  (1000, 300, True), (120, None, False)):  # fmt: skip
            ids = prompt_ids(n, seed=n)
            done = generate_sync(m.url, body(ids, chunk=chunk, overlap=overlap))
            report = done["report"]
            assert report["fallback"] is None, report
            assert done["tokens"] == reference_generate(ckpt, ids, 10), (n, chunk, overlap)
            assert sum(p["n_tokens"] for p in report["layers"]) == spec.n_layers * n
            assert report["kv_bytes"] == n * per_position
        ids = prompt_ids(50, seed=3)  # MLX prefill -> torch decode: the copy path
        done = generate_sync(t.url, {**body(ids), "prefill_peer": m.addr})
        assert done["report"]["fallback"] is None
        assert done["tokens"] == reference_generate(ckpt, ids, 10)

        prompts = [prompt_ids(60 + 30 * i, seed=20 + i) for i in range(4)]

        async def together():
            return await asyncio.gather(*[generate(m.url, body(p, max_tokens=24)) for p in prompts])

        answers = [events[-1] for events in asyncio.run(together())]
        for p, done in zip(prompts, answers, strict=True):
            assert done["type"] == "done" and done["tokens"] == reference_generate(ckpt, p, 24)
        assert max(d["report"]["timeline"]["decode"]["batch"]["max"] for d in answers) > 1

        first = prompt_ids(200, seed=7)  # a conversation: the prefix caches of both nodes
        reply = generate_sync(m.url, body(first, prefix_cache=True))["tokens"]
        second = first + reply + prompt_ids(30, seed=8)
        done = generate_sync(m.url, body(second, prefix_cache=True, chunk=64))
        assert done["tokens"] == reference_generate(ckpt, second, 10)
        held = done["report"]["prefix"]["decode_cached_tokens"]
        assert held == len(first) + len(reply) - 1  # the last token was never fed
        assert done["report"]["prefix"]["prefill_cached_tokens"] >= len(first)
        assert done["report"]["kv_bytes"] == (len(second) - held) * per_position
    finally:
        t.stop()
        m.stop()
