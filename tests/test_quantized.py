"""Quantized decode checkpoints: an mlx_lm.convert copy of a checkpoint on the MLX decode
side while the prefill side runs the full-precision original.

The copies are made here, at test time, by mlx_lm.convert itself (what mlx-community
publishes). Random weights make 4-bit meaningless (near-flat logits: any rounding flips the
top token), so fidelity bars use 8-bit on the tiny model and the real SmolLM2 for 4-bit.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from nodes import NodeProcess, generate_sync
from reference import prompt_ids

from exo_split.backends import load_backend
from exo_split.errors import BadCheckpoint
from exo_split.fidelity import Reference, agreement, mlx_lm_alone, teacher_forced_logits
from exo_split.node.capabilities import backend_key
from exo_split.sampling import GREEDY, pick
from exo_split.spec import load_quantization, load_spec


def convert(src, out, bits: int, group: int, dtype: str | None = None):
    from mlx_lm.convert import convert as mlx_convert

    mlx_convert(str(src), str(out), quantize=True, q_bits=bits, q_group_size=group, dtype=dtype)
    return out


@pytest.fixture(scope="module")
def copies(llama, tmp_path_factory):
    """bits -> directory: 4- and 8-bit copies of the tiny Llama (hidden 64: groups of 32), and
    a bfloat16-scaled 4-bit one (mlx-community's layout)."""
    root = tmp_path_factory.mktemp("quantized")
    return {
        4: convert(llama, root / "q4", 4, 32),
        8: convert(llama, root / "q8", 8, 32),
        "bf16": convert(llama, root / "q4-bf16", 4, 32, dtype="bfloat16"),
    }


def test_a_quantized_copy_is_the_same_model_and_says_how_it_is_stored(llama, copies):
    assert load_spec(copies[4]).fingerprint == load_spec(llama).fingerprint
    q = load_quantization(copies[4])
    assert (q.bits, q.group_size, q.mode, q.scales_dtype) == (4, 32, "affine", "float32")
    assert q.quantized > 0 and q.full_precision == 0 and q.tag == "q4g32-affine"
    assert load_quantization(copies["bf16"]).scales_dtype == "bfloat16"
    assert load_quantization(llama) is None


def test_convert_leaving_a_matrix_unquantized_is_counted(checkpoint, tmp_path):
    """convert silently skips matrices whose input dimension is not a multiple of the group."""
    ckpt = checkpoint("llama", intermediate_size=96)  # down_proj's input: 96, not 64's multiple
    q = load_quantization(convert(ckpt, tmp_path / "q", 4, 64))
    assert q.full_precision == 3 and q.quantized > 0  # one down_proj per layer
    assert "3 matrices left full precision" in q.describe()


def test_torch_refuses_a_quantized_copy_naming_what_to_do(copies):
    with pytest.raises(BadCheckpoint, match="MLX-quantized weights.*full-precision") as exc:
        load_backend("torch", copies[4])
    assert "original checkpoint" in exc.value.hint


def test_mlx_keeps_the_scales_as_saved_and_computes_in_their_dtype(copies):
    b = load_backend("mlx", copies["bf16"], device="cpu")
    assert b.dtype == "bfloat16" and b.quantization.tag == "q4g32-affine"
    dtypes = {k.rsplit(".", 1)[-1]: v.dtype for k, v in tree_flatten(b.model.parameters())}
    assert dtypes["scales"] == mx.bfloat16 and dtypes["weight"] in (mx.uint32, mx.bfloat16)
    asked = load_backend("mlx", copies["bf16"], dtype="float32", device="cpu")
    scales = [v for k, v in tree_flatten(asked.model.parameters()) if k.endswith(".scales")]
    assert asked.dtype == "float32" and all(s.dtype == mx.float32 for s in scales)
    # A model and its 4-bit copy do not share a measured speed.
    full = load_backend("mlx", copies[8], device="cpu")
    assert backend_key(b) != backend_key(asked) != backend_key(full)


def test_the_mixed_pair_decodes_as_mlx_lm_does_from_the_same_cache(llama, copies):
    """torch prefill of the original -> KV into the 8-bit model -> our loop; from that same
    handed-off cache mlx-lm's generate_step gives the same greedy tokens. Teacher-forced, the
    pair agrees with the 8-bit model alone (mlx-lm) on >= 90% of the top-1 tokens."""
    torch_b = load_backend("torch", llama)
    dec = load_backend("mlx", copies[8], device="cpu")
    ids, n = prompt_ids(40, seed=8), 20

    def handed_off():
        cache = dec.new_cache(len(ids) + n)
        done = torch_b.prefill(ids, on_layer=lambda kv: dec.inject(cache, kv))
        return cache, pick(done.logits, GREEDY, 0)

    cache, first = handed_off()
    ours = list(dec.decode(cache, first, max_tokens=n, sampling=GREEDY))
    cache, _ = handed_off()
    steps = generate_step(mx.array([first]), dec.model, max_tokens=n - 1, prompt_cache=cache)
    assert ours == [int(t) for t, _ in steps]
    alone_tokens, alone_logits = mlx_lm_alone(dec, ids, n)
    top1, _ = agreement(teacher_forced_logits(torch_b, dec, ids, alone_tokens), alone_logits)
    assert top1 >= 0.9


def test_check_reports_both_comparisons_for_a_quantized_decode_side(llama, copies):
    out = subprocess.run(
        [sys.executable, "-m", "exo_split", "check", "--model", str(llama), "--decode-model",
         str(copies[8]), "--max-tokens", "8", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["decode_quantization"]["tag"] == "q8g32-affine"
    assert [p["name"] for p in doc["pairings"]] == ["torch->mlx", "mlx->mlx"]
    for p in doc["pairings"]:
        assert p["top1_agreement"] is not None and p["max_logit_diff"] > 0  # (a) vs transformers
        # (b) vs mlx-lm on the 8-bit copy alone: the bar (90%) decides, whatever the tokens;
        # random weights sit near it (their logits are nearly flat), so it is not asserted.
        assert p["top1_vs_decode_alone"] >= 0.75
        assert p["passed"] == (p["top1_vs_decode_alone"] >= 0.9)
        assert p["max_logit_diff_vs_decode_alone"] is not None
    assert out.returncode == (0 if all(p["passed"] for p in doc["pairings"]) else 1), out.stderr
    assert any("torch: it runs full-precision checkpoints" in s for s in doc["skipped"])
    assert "8-bit decode side" in doc["bar"]


def test_a_quantized_decode_node_serves_the_full_precision_prefill(llama, copies, tmp_path):
    prefill = NodeProcess(llama, "torch", tmp_path)
    decode = NodeProcess(copies[4], "mlx", tmp_path)
    try:
        prefill.wait_ready(), decode.wait_ready()
        assert decode.info["quantization"]["tag"] == "q4g32-affine"
        assert prefill.info["quantization"] is None
        assert "weights=q4g32-affine" in decode.log() and "decode graph warmed" in decode.log()
        ids = prompt_ids(60, seed=3)
        done = generate_sync(decode.url, {"token_ids": ids, "max_tokens": 6,
                                          "prefill_peer": prefill.addr, "fallback": "none"})  # fmt: skip
        report = done["report"]
        assert report["mode"] == "overlap" and len(done["tokens"]) == 6
        assert report["timeline"]["decode"]["quantization"]["bits"] == 4
        # Token 0 is the full-precision prefill's: what transformers on the original picks.
        ref = Reference(llama, frozenset())
        assert done["tokens"][0] == ref.generate(ids, 1)[0]
        # Shut down cleanly: MLX's streams released on the compute thread (no abort, 134).
        assert decode.stop() == 0 and "terminate called" not in decode.log_file.read_text()
    finally:
        prefill.stop(), decode.stop()


SMOL_PROMPTS = (
    "<|im_start|>user\nExplain in two sentences what a key-value cache is in a transformer, "
    "and why decoding is memory-bandwidth bound.<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based inks and a wooden press. Within fifty "
    "years, printing shops had spread across Europe, and",
)


@pytest.mark.slow
def test_smollm2_4bit_decode_side_stays_close(tmp_path):
    """Real weights: the mixed pair (torch float32 prefill -> MLX 4-bit decode) of
    SmolLM2-135M-Instruct, teacher-forced over natural text, against (a) transformers on the
    original and (b) mlx-lm running the 4-bit copy alone."""
    from exo_split.models.smollm2 import ensure_smollm2
    from exo_split.tokenizer import TextCodec

    full = ensure_smollm2()
    q4 = convert(full, tmp_path / "q4", 4, 64)
    torch_b, dec = load_backend("torch", full), load_backend("mlx", q4, device="cpu")
    ref, codec, n = Reference(full, frozenset()), TextCodec(full), 24
    a, b = [], []
    for text in SMOL_PROMPTS:
        ids = codec.tokenize(text)
        ref_tokens = ref.generate(ids, n)
        pair = teacher_forced_logits(torch_b, dec, ids, ref_tokens)
        a.append(agreement(pair, ref.teacher_forced_logits(ids, ref_tokens))[0])
        alone_tokens, alone_logits = mlx_lm_alone(dec, ids, n)
        b.append(agreement(teacher_forced_logits(torch_b, dec, ids, alone_tokens), alone_logits)[0])
    assert np.mean(b) >= 0.75, b
    assert np.mean(a) >= 0.7, a


def test_openais_mxfp4_gpt_oss_runs_packed_on_mlx_and_matches_transformers(checkpoint, tmp_path):
    """gpt-oss as OpenAI publishes it (experts in MXFP4, transformers' quantization_config):
    transformers dequantizes it (no MXFP4 kernels on this CPU), mlx-lm runs the experts packed
    (QuantizedSwitchLinear, mode mxfp4); every pairing stays within the float32 bound of
    transformers reading the same file, and the packing written here is the one transformers
    reads (its dequantized experts equal ours bit for bit)."""
    import torch
    from checkpoints import E2M1, build_gpt_oss_mxfp4
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from exo_split.fidelity import FLOAT32_LOGIT_BOUND, run_check

    full = checkpoint("gpt_oss")
    q = build_gpt_oss_mxfp4(tmp_path / "gpt-oss-mxfp4", full)
    quant = load_quantization(q)
    assert (quant.bits, quant.group_size, quant.mode, quant.format) == (
        4,
        32,
        "mxfp4",
        "transformers",
    )
    assert quant.quantized == 2 * 4 and quant.scales_dtype is None
    assert load_spec(q).fingerprint == load_spec(full).fingerprint

    w = load_file(q / "model.safetensors")
    lut = np.array(E2M1 + tuple(-v for v in E2M1), np.float32)
    blocks = w["model.layers.1.mlp.experts.down_proj_blocks"]
    scales = w["model.layers.1.mlp.experts.down_proj_scales"].astype(np.float32)
    nibbles = np.stack([blocks & 15, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32)
    ours = (lut[nibbles] * np.exp2(scales - 127)[..., None]).reshape(*blocks.shape[:-2], -1)
    ref = AutoModelForCausalLM.from_pretrained(str(q), dtype=torch.float32)
    theirs = ref.model.layers[1].mlp.experts.down_proj.detach().numpy()  # [experts, in, out]
    assert np.array_equal(ours.transpose(0, 2, 1), theirs)

    mlx = load_backend("mlx", q)
    assert isinstance(mlx.model.model.layers[0].mlp.experts.gate_proj, QuantizedSwitchLinear)
    assert mlx.model.model.layers[0].mlp.experts.gate_proj.mode == "mxfp4"
    assert load_backend("torch", q).quantization == quant

    report = run_check(q, max_tokens=8)
    assert report.passed, [p.reason for p in report.failing]
    for p in report.pairings:
        for r in p.prompts:
            assert r.max_logit_diff <= FLOAT32_LOGIT_BOUND * max(1.0, r.reference_logit_max)
