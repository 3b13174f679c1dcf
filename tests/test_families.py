"""The model families beyond Llama/Mistral/Qwen2/Qwen3 (families.py): each one's fields read
as transformers reads them, handed to mlx-lm field by field, and a float32 `exo-split check`
against transformers on a tiny random checkpoint built with transformers' own config class
(tokens identical, logits bounded); refusals for what mlx-lm's modules cannot run."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers
from checkpoints import MORE_FAMILIES, WINDOW

from exo_split import families
from exo_split.errors import BadCheckpoint
from exo_split.fidelity import FLOAT32_LOGIT_BOUND, run_check
from exo_split.spec import differences, load_spec, spec_from_config

NEW = sorted(MORE_FAMILIES)
_CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "mixtral": transformers.MixtralConfig,
    "phi3": transformers.Phi3Config,
    "glm4": transformers.Glm4Config,
    "glm4_moe": transformers.Glm4MoeConfig,
    "gpt_oss": transformers.GptOssConfig,
    "granitemoehybrid": transformers.GraniteMoeHybridConfig,
    "qwen3_next": transformers.Qwen3NextConfig,
    "qwen3_5_text": transformers.Qwen3_5TextConfig,
    "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
    "smollm3": transformers.SmolLM3Config,
    "granite": transformers.GraniteConfig,
    "cohere": transformers.CohereConfig,
    "cohere2": transformers.Cohere2Config,
    "deepseek_v3": transformers.DeepseekV3Config,
    "glm4_moe_lite": transformers.Glm4MoeLiteConfig,
    "gemma3_text": transformers.Gemma3TextConfig,
}


def test_every_family_has_a_test_checkpoint():
    assert set(families.FAMILIES) == {"llama", "mistral", "qwen2", "qwen3", *NEW}


@pytest.mark.parametrize("arch", sorted(_CONFIG_CLASSES))
def test_our_defaults_are_transformers_defaults(arch):
    """A config.json that omits a field means transformers' default: ours must be the same,
    or the two sides would run different maths from one file."""
    hf = json.loads(_CONFIG_CLASSES[arch]().to_json_string())
    rope = hf.get("rope_parameters") or {}
    for key, ours in families.FAMILIES[arch].fields.items():
        if key in ("layer_types", "no_rope_layers", "mamba_d_head", "mlp_layer_types"):
            continue  # derived from the layer count or other fields (tested below)
        if key == "rope_local_base_freq":
            theirs = rope["sliding_attention"]["rope_theta"]
        elif key in families.ROPE_FIELDS:
            theirs = rope.get(key, hf.get(key))
        else:
            theirs = hf[key]
        theirs = tuple(theirs) if isinstance(theirs, list) else theirs
        if key == "time_step_limit":  # ours as strings; transformers writes inf as a dict
            theirs = tuple(str(float(x["__float__"] if isinstance(x, dict) else x)) for x in theirs)
        assert ours == theirs, f"{arch}.{key}: ours {ours!r}, transformers {theirs!r}"


@pytest.mark.parametrize("arch", NEW)
def test_the_family_fields_reach_mlx_lm(arch, checkpoint):
    """Field by field: every fingerprinted field arrives in mlx-lm's ModelArgs with the
    checkpoint's (non-default) value, under mlx-lm's name."""
    from exo_split.backends import load_backend

    ckpt = checkpoint(arch)
    spec = load_spec(ckpt)
    model = load_backend("mlx", ckpt).model
    args = model.language_model.args if hasattr(model.args, "text_config") else model.args
    fam = families.FAMILIES[arch]
    assert {k for k, _ in spec.extras} == set(fam.fields) - {"layer_types"}, arch
    for key, value in spec.extras:
        got = getattr(args, fam.mlx_names.get(key, key))
        got = tuple(got) if isinstance(got, list) else got
        value = fam.mlx_value(key, value) if fam.mlx_value else value
        assert got == value, f"{arch}.{key}: mlx-lm has {got!r}, the spec {value!r}"
    assert args.rope_theta == spec.rope_theta
    if fam.mlx_layer_names:
        assert tuple(args.layer_types) == tuple(fam.mlx_layer_names[t] for t in spec.layer_types)
    elif fam.recurrent:
        period = families.window_pattern(spec.layer_types, families.LINEAR)
        assert args.full_attention_interval == period and period in (2, 4)
    elif spec.layer_types:
        if fam.mlx_pattern:
            assert args.sliding_window_pattern == families.window_pattern(spec.layer_types)
        else:
            assert tuple(args.layer_types) == spec.layer_types
        assert args.sliding_window == WINDOW


@pytest.mark.slow
@pytest.mark.parametrize("arch", NEW)
def test_check_passes_in_float32_with_bounded_logits(arch, checkpoint):
    ckpt = checkpoint(arch)
    report = run_check(ckpt, max_tokens=8)
    assert report.passed, [p.reason for p in report.failing]
    spec = load_spec(ckpt)
    if spec.layer_types and spec.sliding_window:  # a window per typed layer: below, past it
        expected = (1, 40, 3 * WINDOW, 300)
    else:
        expected = (1, 40, WINDOW - 8) if spec.window_limit else (1, 40, 300)
    assert report.prompt_lengths == tuple(sorted(expected))
    assert [p.name for p in report.pairings][0] == "torch->mlx"
    for p in report.pairings:
        assert p.agrees_with_reference, (arch, p.name)
        for r in p.prompts:
            bound = FLOAT32_LOGIT_BOUND * max(1.0, r.reference_logit_max)
            assert r.first_logit_diff <= bound and r.max_logit_diff <= bound, (arch, p.name, r)


def test_a_family_field_is_in_the_fingerprint_and_named_when_it_differs():
    base = json.loads(MORE_FAMILIES["cohere"]().to_json_string())
    a = spec_from_config(base)
    b = spec_from_config({**base, "logit_scale": 0.25})
    assert a.fingerprint != b.fingerprint
    assert differences(a, b) == ["cohere.logit_scale: 0.3 != 0.25"]
    # The wire's copy (JSON, lists) reads back as the same spec.
    again = type(a).from_dict(json.loads(json.dumps(a.to_dict())))
    assert again == a and again.fingerprint == a.fingerprint


def test_layer_types_and_the_local_rope_are_read_from_transformers_5_configs():
    spec = spec_from_config(json.loads(MORE_FAMILIES["gemma3_text"]().to_json_string()))
    assert spec.layer_types == ("sliding_attention", "full_attention") * 2
    assert spec.sliding_window == WINDOW
    assert spec.rope_theta == 300000.0 and spec.extra("rope_local_base_freq") == 5000.0
    assert spec.extra("query_pre_attn_scalar") == 24
    # An older file: no layer_types, only the pattern (gemma3's default of 6).
    old = json.loads(transformers.Gemma3TextConfig(num_hidden_layers=12).to_json_string())
    del old["layer_types"]
    types = spec_from_config(old).layer_types
    assert types == (("sliding_attention",) * 5 + ("full_attention",)) * 2


@pytest.mark.parametrize(
    ("arch", "change", "message"),
    [
        ("gemma3_text", {"final_logit_softcapping": 30.0}, "does not apply final_logit_softcapping"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, "does not apply attn_logit_softcapping"),
        ("cohere2", {"layer_types": ["sliding_attention", "full_attention", "full_attention",
                                     "sliding_attention"]}, "repeating window pattern"),
        ("olmo3", {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
         "sliding layers' rope theta"),
        ("olmo3", {"layer_types": ["sliding_attention"] * 3}, "must name 4 layers"),
        ("phi3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
         "unsupported rope type 'dynamic'"),
        ("qwen3_moe", {"model_type": "gemma2"}, "unsupported architecture 'gemma2'"),
        ("deepseek_v3", {"rope_interleave": False}, "rotates the latent key's dimensions in interleaved pairs"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "by scoring_func 'sigmoid' only, not 'softmax'"),
        ("deepseek_v3", {"topk_method": "greedy"}, "by topk_method 'noaux_tc' only"),
        ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq 1"),
        ("glm4_moe_lite", {"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]},
         "dense layers first, then experts"),
        ("gpt_oss", {"swiglu_limit": 5.0}, "fixes swiglu_limit at 7.0; this checkpoint has 5.0"),
        ("gpt_oss", {"attention_bias": False}, "always adds attention biases"),
        ("gpt_oss", {"tie_word_embeddings": True}, "output head of its own"),
        ("gpt_oss", {"layer_types": ["full_attention"] * 4}, "both sliding and full layers"),
    ],
)  # fmt: skip
def test_what_mlx_lm_cannot_run_is_refused_with_the_reason(arch, change, message):
    config = json.loads(MORE_FAMILIES[arch]().to_json_string()) | change
    with pytest.raises(BadCheckpoint, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec_from_config(config)


def test_a_refused_checkpoint_is_refused_before_any_backend_loads(checkpoint, tmp_path):
    from exo_split.backends import load_backend

    copy = shutil.copytree(checkpoint("gemma3_text"), tmp_path / "softcapped")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"final_logit_softcapping": 30.0}))
    for name in ("torch", "mlx"):
        with pytest.raises(BadCheckpoint, match="final_logit_softcapping"):
            load_backend(name, copy)


@pytest.mark.parametrize("arch", ["gemma3_text", "cohere2", "olmo3", "gpt_oss"])
def test_past_the_window_the_window_matters(arch, checkpoint, tmp_path):
    """The check above is sensitive to the window: at 3x the window, the same weights
    without it (every layer full) give logits far outside the bound, so a side that ignored
    the window would fail it."""
    import numpy as np

    from exo_split.models.reference import Reference

    ckpt = checkpoint(arch)
    wide = shutil.copytree(ckpt, tmp_path / "no-window")
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(config | {"sliding_window": 4096}))
    ids = list(np.random.default_rng(3).integers(0, 512, 3 * WINDOW))
    forced = [5, 6]
    windowed = Reference(ckpt, frozenset()).teacher_forced_logits(ids, forced)
    full = Reference(wide, frozenset()).teacher_forced_logits(ids, forced)
    bound = FLOAT32_LOGIT_BOUND * max(1.0, float(np.abs(windowed).max()))
    assert float(np.abs(windowed - full).max()) > 100 * bound


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3_text", "gpt_oss"])
def test_two_nodes_of_a_new_family_match_transformers(arch, checkpoint, tmp_path):
    """A mixture of experts and a model with sliding layers (prompts below the window and
    past it, chunks that cross it) through a torch prefill node and an MLX decode node. A
    sliding layer's KV travels only for the window's last W - 1 positions: the report's
    pieces and kv_bytes say exactly that."""
    from nodes import NodeProcess, generate_sync
    from reference import prompt_ids, reference_generate

    ckpt = checkpoint(arch)
    spec = load_spec(ckpt)
    per_position = 2 * spec.n_kv_heads * spec.head_dim * 4  # K and V, float32
    t, m = NodeProcess(ckpt, "torch", tmp_path), NodeProcess(ckpt, "mlx", tmp_path)
    try:
        t.wait_ready()
        m.wait_ready()
        for n, chunk in ((1, None), (40, None), (3 * WINDOW, None), (3 * WINDOW, 48), (1000, 300)):
            ids = prompt_ids(n, seed=n)
            body = {"token_ids": ids, "max_tokens": 10, "prefill_peer": t.addr, "chunk": chunk,
                    "fallback": "none"}  # fmt: skip
            done = generate_sync(m.url, body)
            report = done["report"]
            assert report["fallback"] is None and report["mode"] == "overlap", (n, report)
            assert done["tokens"] == reference_generate(ckpt, ids, 10), (arch, n, chunk)
            sent = sum(min(n, k) if k else n for k in spec.window_keep or [None] * spec.n_layers)
            assert sum(p["n_tokens"] for p in report["layers"]) == sent
            assert report["kv_bytes"] == sent * per_position
            if arch == "gemma3_text" and n == 1000:  # 2 full layers, 2 of the window's 63
                assert sent == 2 * 1000 + 2 * (WINDOW - 1)
        if arch == "gemma3_text":  # the ledger reserved what the received cache keeps
            keep = spec.window_keep
            held = sum(1010 - (max(0, 1000 - k) if k else 0) for k in keep) * per_position
            assert _stats(m)["kv_bytes_peak"] == held  # the largest request: n = 1,000
            assert held < spec.n_layers * 1010 * per_position
            # a local prefill keeps every position of its sliding layers: it takes the rest
            ids = prompt_ids(1000, seed=5)
            body = {"token_ids": ids, "max_tokens": 10, "prefill": "local"}
            assert generate_sync(m.url, body)["tokens"] == reference_generate(ckpt, ids, 10)
            after = _stats(m)
            assert after["kv_bytes_peak"] == spec.n_layers * 1010 * per_position
            assert after["kv_bytes_held"] == 0
            _a_window_fits_where_the_whole_prompt_does_not(ckpt, t, held, tmp_path)
    finally:
        t.stop()
        m.stop()


def _a_window_fits_where_the_whole_prompt_does_not(ckpt, prefill, held, tmp_path) -> None:
    """A decode node with room for the windowed cache only: the handoff is admitted and
    runs; the same prompt prefilled locally is refused in-band (busy), nothing held after."""
    import asyncio

    from nodes import NodeProcess, generate, generate_sync
    from reference import prompt_ids, reference_generate

    small = NodeProcess(ckpt, "mlx", tmp_path, "--max-kv-bytes", str(held + 4096)).wait_ready()
    try:
        ids = prompt_ids(1000, seed=6)
        remote = {"token_ids": ids, "max_tokens": 10, "prefill_peer": prefill.addr,
                  "fallback": "none"}  # fmt: skip
        assert generate_sync(small.url, remote)["tokens"] == reference_generate(ckpt, ids, 10)
        local = {"token_ids": ids, "max_tokens": 10, "prefill": "local"}
        last = asyncio.run(generate(small.url, local))[-1]
        assert last["type"] == "error" and last["code"] == "Refused", last
        assert "keeps every position in the sliding layers" in last["message"]
        assert _stats(small)["kv_bytes_held"] == 0
    finally:
        small.stop()


def _stats(node) -> dict:
    import asyncio

    from nodes import request

    status, raw, _ = asyncio.run(request("GET", f"{node.url}/v1/info"))
    assert status == 200
    return json.loads(raw)["stats"]


def test_gemmas_embedding_scale_is_transformers_in_every_dtype(checkpoint, monkeypatch):
    """hidden 80: sqrt(80) = 8.944 is 8.9375 in bfloat16, the factor mlx-lm always uses.
    The MLX backend rescales the lookups so float32 is transformers' float32; without it
    the same check fails on the logit bound (its tokens still agree)."""
    from exo_split.backends import mlx_adapt, mlx_backend

    ckpt = checkpoint("gemma3_text", hidden_size=80)
    assert run_check(ckpt, max_tokens=8).passed
    bf16 = mlx_backend.load(ckpt, dtype="bfloat16")
    assert not isinstance(bf16.model.model.embed_tokens, mlx_adapt._RescaledEmbedding)
    monkeypatch.setattr(mlx_backend, "exact_embedding_scale", lambda *a: None)
    report = run_check(ckpt, max_tokens=8)
    assert not report.passed
    assert {p.name for p in report.failing} == {"torch->mlx", "mlx->torch", "mlx->mlx"}
    assert all(p.reason.startswith("greedy tokens agree but logits differ") for p in report.failing)


def test_a_sliding_layer_keeps_only_its_window_and_reuse_respects_it(checkpoint):
    """In process, torch prefill -> MLX cache: a sliding layer holds the prompt's last W - 1
    positions only (its memory says so), decoding from it gives transformers' tokens, and a
    prefix cache serves it only to prompts that keep the window before their next position:
    a continuation resumes on it (local prefill on top of the window) with transformers'
    tokens, a prompt sharing less is computed afresh."""
    from reference import prompt_ids, reference_generate

    from exo_split.backends import load_backend
    from exo_split.handoff import prefill_into
    from exo_split.node.prefix import PrefixCache
    from exo_split.sampling import GREEDY, sample

    ckpt = checkpoint("gemma3_text")
    torch_b, mlx_b = load_backend("torch", ckpt), load_backend("mlx", ckpt)
    spec, n, room = mlx_b.spec, 1000, 10
    ids = prompt_ids(n, seed=11)
    cache, logits = prefill_into(torch_b, mlx_b, ids, capacity=n + room)
    floor = n - (WINDOW - 1)
    assert [c.base for c in cache] == [floor if k else 0 for k in spec.window_keep]
    per_slot = 2 * spec.n_kv_heads * spec.head_dim * 4
    slots = [256 if k else 1024 for k in spec.window_keep]  # mlx-lm's steps of 256
    assert mlx_b.cache_nbytes(cache) == sum(slots) * per_slot
    first = sample(logits, GREEDY, 0)[0]
    tokens = [first, *mlx_b.decode(cache, first, max_tokens=room, sampling=GREEDY)]
    assert len(tokens) == room and tokens == reference_generate(ckpt, ids, room)

    held = ids + tokens[:-1]  # what the cache covers after decoding
    prefix = PrefixCache(mlx_b, limit_bytes=1 << 30)
    prefix.put(held, cache)
    assert prefix._entries[0].floor == n  # the window before position n is still there
    assert prefix.checkout(ids[:500] + [7] * 20).how == "none"  # shares 500 < the floor
    more = held + prompt_ids(30, seed=12)[1:]
    co = prefix.checkout(more)
    assert (co.how, co.cached) == ("take", len(held))
    resumed = prefix.materialize(co, capacity=len(more) + 6)
    done = mlx_b.prefill(more, cache=resumed)
    first = sample(done.logits, GREEDY, 0)[0]
    again = [first, *mlx_b.decode(done.cache, first, max_tokens=6, sampling=GREEDY)]
    assert len(again) == 6 and again == reference_generate(ckpt, more, 6)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3_text", "granite", "deepseek_v3"])
def test_a_quantized_copy_decodes_the_full_precision_handoff(arch, checkpoint, tmp_path):
    """mlx-community's layout (an mlx_lm.convert 8-bit copy) on the decode side of a MoE, a
    sliding-window, a scaled-logits and a latent-attention family (its absorbed projections
    quantized): the check's quantized bar (teacher-forced
    top-1 agreement with mlx-lm running the copy alone) holds, and the copy is the same model
    (fingerprint) as the full-precision prefill side."""
    from mlx_lm.convert import convert

    from exo_split.backends.mlx_backend import _mlx_config

    ckpt = checkpoint(arch)
    # mlx_lm.convert reads config.json by itself, and a transformers-5 one lacks what its
    # ModelArgs want (rope_theta at the top, qwen3_moe's num_experts): mlx-community's files
    # carry both layouts, so the copy converted here does too.
    both = shutil.copytree(ckpt, tmp_path / "both-layouts")
    config = json.loads((both / "config.json").read_text())
    (both / "config.json").write_text(json.dumps(config | _mlx_config(load_spec(ckpt))))
    q8 = tmp_path / "q8"
    convert(str(both), str(q8), quantize=True, q_bits=8, q_group_size=32)
    assert load_spec(q8).fingerprint == load_spec(ckpt).fingerprint
    report = run_check(ckpt, q8, max_tokens=8)
    assert report.decode_quantization["bits"] == 8
    assert report.passed, [p.reason for p in report.failing]
    assert [p.name for p in report.pairings] == ["torch->mlx", "mlx->mlx"]


@pytest.mark.parametrize("arch", sorted(families.REFUSED))
def test_a_refused_family_says_why(arch):
    """Families both libraries implement but exo-split cannot run yet say why, not only
    'unsupported' (README, Limitations)."""
    assert arch not in families.FAMILIES
    config = json.loads(MORE_FAMILIES["qwen3_moe"]().to_json_string()) | {"model_type": arch}
    with pytest.raises(BadCheckpoint) as refused:
        spec_from_config(config)
    message = str(refused.value)
    assert message.startswith(f"unsupported architecture {arch!r}: ")
    assert families.REFUSED[arch] in message and "exo-split supports llama" in message


@pytest.mark.parametrize(
    ("dims", "base", "factor", "original"),
    [(64, 150000.0, 32.0, 4096), (16, 50000.0, 8.0, 512), (128, 1e6, 4.0, 32768)],
)
def test_our_yarn_frequencies_are_mlx_lms_and_truncating_changes_them(dims, base, factor, original):
    """yarn_freqs (what the MLX backend gives a `truncate: false` checkpoint) computes mlx-lm's
    own frequencies when truncating, and other ones when not (gpt-oss's 64 dims: by 76%)."""
    import numpy as np
    from mlx_lm.models.rope_utils import YarnRoPE

    from exo_split.backends.mlx_adapt import yarn_freqs

    theirs = np.array(YarnRoPE(dims, base=base, scaling_factor=factor,
                               original_max_position_embeddings=original)._freqs)  # fmt: skip
    ours = yarn_freqs(dims, base, factor, original)
    assert np.allclose(ours, theirs, rtol=1e-6, atol=0)
    untruncated = yarn_freqs(dims, base, factor, original, truncate=False)
    assert np.abs(untruncated / ours - 1).max() > 0.01


def test_gpt_oss_untruncated_yarn_is_what_keeps_the_check_passing(checkpoint, monkeypatch):
    """Without the untruncated frequencies (mlx-lm's own YaRN), the decode on the MLX side
    leaves the float32 bound: the fix is what makes gpt-oss's rotation transformers'."""
    from exo_split.backends import mlx_backend

    ckpt = checkpoint("gpt_oss")
    assert load_spec(ckpt).rope_scaling and dict(load_spec(ckpt).rope_scaling)["truncate"] is False
    monkeypatch.setattr(mlx_backend, "untruncated_yarn", lambda model, spec: 0)
    report = run_check(ckpt, max_tokens=8)
    worst = max(r.max_logit_diff / max(1.0, r.reference_logit_max)
                for p in report.pairings if p.name == "torch->mlx" for r in p.prompts)  # fmt: skip
    assert worst > 10 * FLOAT32_LOGIT_BOUND
