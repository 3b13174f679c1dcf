"""convert-gguf on gpt-oss, as llama.cpp writes it: the experts in llama.cpp's MXFP4 blocks,
gate and up apart, come back as OpenAI's published MXFP4 checkpoint.

The GGUF is written here from a tiny gpt-oss in OpenAI's MXFP4 form (tests/checkpoints.py),
with this file's own packing into llama.cpp's block layout; the reference is transformers
loading that OpenAI-form checkpoint (it dequantizes the experts itself). The o200k split
(tokenizer.ggml.pre "gpt-4o") is checked on text whose pieces are known."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from checkpoints import build_gpt_oss_mxfp4
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from safetensors import safe_open
from test_gguf import CHATML, finish, put, tiny_vocab
from transformers import AutoModelForCausalLM

from exo_split.errors import BadCheckpoint
from exo_split.models.gguf import convert_gguf
from exo_split.spec import load_spec

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}  # fmt: skip


def llama_cpp_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 ([..., nb, 16] codes two to a byte in order, [..., nb] scales) as
    llama.cpp stores it: per block the scale byte, then byte j holding code j (low nibble)
    and code j + 16 (high nibble). Rows of nb * 17 bytes."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs], axis=-1).astype(np.uint8)
    return out.reshape(*blocks.shape[:-2], -1)


def gguf_from_openai(path, mx_dir, vocab, *, experts_as=Q.MXFP4):
    """A `gpt-oss` GGUF of the OpenAI-form checkpoint in `mx_dir`, laid out as llama.cpp's
    converter lays it out."""
    cfg = json.loads((mx_dir / "config.json").read_text())
    rope = cfg["rope_parameters"]
    with safe_open(mx_dir / "model.safetensors", "np") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    w = GGUFWriter(str(path), "gpt-oss")
    a = "gpt-oss"
    keys = {
        f"{a}.block_count": cfg["num_hidden_layers"], f"{a}.context_length": 4096,
        f"{a}.embedding_length": cfg["hidden_size"],
        f"{a}.feed_forward_length": cfg["intermediate_size"],
        f"{a}.expert_feed_forward_length": cfg["intermediate_size"],
        f"{a}.attention.head_count": cfg["num_attention_heads"],
        f"{a}.attention.head_count_kv": cfg["num_key_value_heads"],
        f"{a}.attention.key_length": cfg["head_dim"], f"{a}.attention.value_length": cfg["head_dim"],
        f"{a}.rope.freq_base": float(rope["rope_theta"]),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        f"{a}.expert_count": cfg["num_local_experts"],
        f"{a}.expert_used_count": cfg["num_experts_per_tok"],
        f"{a}.attention.sliding_window": cfg["sliding_window"],
        f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": float(rope["factor"]),
        f"{a}.rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        "tokenizer.ggml.model": vocab["model"], "tokenizer.ggml.pre": vocab["pre"],
        "tokenizer.ggml.tokens": vocab["tokens"], "tokenizer.ggml.token_type": vocab["types"],
        "tokenizer.ggml.merges": vocab["merges"], "tokenizer.ggml.bos_token_id": vocab["bos"],
        "tokenizer.ggml.eos_token_id": vocab["eos"], "tokenizer.chat_template": CHATML,
    }  # fmt: skip
    for key, value in keys.items():
        put(w, key, value)
    for name, gname in (("model.embed_tokens.weight", "token_embd.weight"),
                        ("model.norm.weight", "output_norm.weight"),
                        ("lm_head.weight", "output.weight")):  # fmt: skip
        w.add_tensor(gname, weights[name].astype(np.float32))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, gname in LAYER_NAMES.items():
            w.add_tensor(f"blk.{i}.{gname}", weights[p + name].astype(np.float32))
        gu_b, gu_s = (
            weights[p + "mlp.experts.gate_up_proj_blocks"],
            weights[p + "mlp.experts.gate_up_proj_scales"],
        )
        down = llama_cpp_blocks(weights[p + "mlp.experts.down_proj_blocks"],
                                weights[p + "mlp.experts.down_proj_scales"])  # fmt: skip
        for gname, rows in (("ffn_gate_exps.weight", slice(0, None, 2)),
                            ("ffn_up_exps.weight", slice(1, None, 2))):  # fmt: skip
            raw = llama_cpp_blocks(gu_b[:, rows], gu_s[:, rows])
            if experts_as == Q.MXFP4:
                w.add_tensor(f"blk.{i}.{gname}", raw, raw_dtype=Q.MXFP4)
            else:
                w.add_tensor(f"blk.{i}.{gname}", np.zeros(raw.shape[:2] + (cfg["hidden_size"],),
                                                            np.float32))  # fmt: skip
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", down, raw_dtype=Q.MXFP4)
        bias = weights[p + "mlp.experts.gate_up_proj_bias"].astype(np.float32)
        w.add_tensor(f"blk.{i}.ffn_gate_exps.bias", np.ascontiguousarray(bias[:, 0::2]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.bias", np.ascontiguousarray(bias[:, 1::2]))
    finish(w)
    return path


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    """(the GGUF, its conversion, the OpenAI-form checkpoint it was written from)."""
    d = tmp_path_factory.mktemp("gpt-oss-gguf")
    mx = build_gpt_oss_mxfp4(d / "openai", checkpoint("gpt_oss"))
    path = gguf_from_openai(d / "gpt-oss.gguf", mx, tiny_vocab("gpt-4o"))
    return path, convert_gguf(path, d / "hf"), mx


def test_the_experts_come_back_as_openais_mxfp4_bit_for_bit(converted):
    _, out, mx = converted
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt_oss"
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False,
                                      "original_max_position_embeddings": 512}  # fmt: skip
    assert load_spec(out).fingerprint == load_spec(mx).fingerprint
    with (
        safe_open(out / "model.safetensors", "np") as ours,
        safe_open(mx / "model.safetensors", "np") as theirs,
    ):
        assert set(ours.keys()) == set(theirs.keys())
        for key in theirs.keys():  # noqa: SIM118
            a, b = ours.get_tensor(key), theirs.get_tensor(key)
            assert a.dtype == b.dtype and np.array_equal(a, b), key


def test_the_gguf_holds_what_transformers_dequantizes(converted):
    """This file's packing into llama.cpp's blocks, read back by the gguf package's own
    MXFP4 decoder, is transformers' dequantization of OpenAI's blocks: the layout is
    llama.cpp's, independently of the converter."""
    from gguf import GGUFReader, dequantize

    path, _, mx = converted
    ref = AutoModelForCausalLM.from_pretrained(mx, dtype=torch.float32).state_dict()
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for i in range(2):
        fused = ref[f"model.layers.{i}.mlp.experts.gate_up_proj"].numpy()  # [E, H, 2I]
        for name, part in (("ffn_gate_exps", fused[..., 0::2]), ("ffn_up_exps", fused[..., 1::2])):
            t = tensors[f"blk.{i}.{name}.weight"]
            ours = dequantize(t.data, t.tensor_type).reshape(part.shape[0], part.shape[2], -1)
            assert np.array_equal(ours, part.transpose(0, 2, 1)), (i, name)


def test_the_conversion_computes_what_transformers_computes_from_openais_files(converted):
    _, out, mx = converted
    ids = list(np.random.default_rng(0).integers(3, 384, 40))

    def logits(d):
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0]

    assert (logits(out) - logits(mx)).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_a_converted_gpt_oss_gguf_passes_the_check(converted):
    """torch (transformers dequantizing the MXFP4 experts) and MLX (running them packed)
    in every pairing: tokens and float32 logits equal transformers'."""
    from exo_split.fidelity import run_check

    _, out, _ = converted
    report = run_check(out, max_tokens=6)
    assert report.passed, [(p.name, p.reason) for p in report.failing]


def test_the_o200k_split_keeps_contractions_on_words_and_groups_digits():
    from exo_split.models.gguf_vocab import build_tokenizer, vocab_from_metadata

    vocab = tiny_vocab("gpt-4o")
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o",
            "tokenizer.ggml.tokens": vocab["tokens"], "tokenizer.ggml.token_type": vocab["types"],
            "tokenizer.ggml.merges": vocab["merges"]}  # fmt: skip
    tok = build_tokenizer(vocab_from_metadata(meta))
    pieces = [
        p for p, _ in tok.pre_tokenizer.pre_tokenize_str("Hello World's isn't 1234567 a+=b\n\n x")
    ]
    assert pieces == ["Hello", "ĠWorld's", "Ġisn't", "Ġ", "123", "456", "7", "Ġa", "+=", "b",
                      "ĊĊ", "Ġx"]  # fmt: skip
    text = "The 2025 results: isn't it GREAT? Ελληνικά 日本語"
    assert tok.decode(tok.encode(text).ids) == text


def test_experts_stored_otherwise_than_mxfp4_are_refused(checkpoint, tmp_path):
    mx = build_gpt_oss_mxfp4(tmp_path / "openai", checkpoint("gpt_oss"))
    path = gguf_from_openai(tmp_path / "f32.gguf", mx, tiny_vocab("gpt-4o"), experts_as=Q.F32)
    with pytest.raises(BadCheckpoint, match="experts stored as F32, MXFP4"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
