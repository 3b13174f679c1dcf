"""config.json for a GGUF's model: transformers' names, both RoPE layouts, every flag explicit.

Config translation is where silent errors live (DESIGN §3): every value that changes the maths
is read from the GGUF or refused, never left to a loader's default. mlx-lm's Llama, for one,
defaults to tied embeddings and reads only `rope_theta` / `rope_scaling`, while transformers 5
reads `rope_parameters`; both are written.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from exo_split.errors import BadCheckpoint
from exo_split.models import gguf_gpt_oss
from exo_split.models.gguf_values import decimal, dim, uniform_dim
from exo_split.models.gguf_vocab import Vocab

# GGUF general.architecture -> (transformers model_type, class). Mistral 7B files say "llama".
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
}
# What llama.cpp's gemma3 hard-codes instead of storing: every 6th layer global, the local
# layers' RoPE base, and 1/sqrt(query_pre_attn_scalar) (hidden/heads for the 62-layer 27B).
GEMMA3_PATTERN, GEMMA3_LOCAL_THETA = 6, 10000.0
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's llama3 RoPE, as per-frequency divisors


def hf_config(meta: dict[str, Any], tensors: dict, vocab: Vocab, *, dtype: str) -> dict[str, Any]:
    """config.json for transformers and mlx-lm: both RoPE layouts (transformers 5 reads
    `rope_parameters`, mlx-lm `rope_theta`/`rope_scaling`), every flag written explicitly."""
    arch = meta["general.architecture"]
    model_type, class_name = ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise BadCheckpoint(f"the GGUF lacks {arch}.{name}, which the conversion needs")
        return value

    n_heads = dim(key("attention.head_count"), f"{arch}.attention.head_count")
    n_kv = uniform_dim(key("attention.head_count_kv", n_heads), f"{arch}.attention.head_count_kv")
    hidden = dim(key("embedding_length"), f"{arch}.embedding_length")
    head_dim = dim(key("attention.key_length", hidden // n_heads), f"{arch}.attention.key_length")
    n_layers = dim(key("block_count"), f"{arch}.block_count")
    # Each layer has tensors of its own: a count beyond them is a damaged (or hostile) file,
    # and looping over it (2^32 layers) would never end.
    blocks = {name.split(".")[1] for name in tensors if name.startswith("blk.")}
    if n_layers > len(blocks):
        raise BadCheckpoint(
            f"{arch}.block_count says {n_layers:,} layers but the file holds tensors of "
            f"{len(blocks)}: a damaged GGUF"
        )
    if not 1 <= n_kv <= n_heads or n_heads % n_kv:
        raise BadCheckpoint(
            f"{n_kv} KV heads for {n_heads} attention heads: expected a divisor of the heads"
        )
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise BadCheckpoint(
            f"key and value head sizes differ: {head_dim} != {meta[f'{arch}.attention.value_length']}"
        )
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise BadCheckpoint(
            f"partial RoPE ({meta[f'{arch}.rope.dimension_count']} of {head_dim} dims) is not "
            "supported: expected RoPE over the whole head"
        )
    if meta.get(f"{arch}.attention.sliding_window") and arch not in ("gemma3", "gpt-oss"):
        raise BadCheckpoint("sliding-window attention GGUFs are not supported")
    if "token_embd.weight" not in tensors:
        raise BadCheckpoint("the GGUF has no token_embd.weight")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    if len(vocab.tokens) > vocab_size:
        raise BadCheckpoint(f"{len(vocab.tokens)} tokens but only {vocab_size} embedding rows")
    theta = decimal(key("rope.freq_base", 10000.0))
    if arch == "gpt-oss":
        scaling = gguf_gpt_oss.rope_scaling(meta)
    else:
        scaling = _rope_scaling(meta, arch, tensors.get(ROPE_FREQS), theta, head_dim)
    has = lambda suffix: f"blk.0.{suffix}" in tensors  # noqa: E731
    attention_bias = has("attn_q.bias")
    if model_type == "qwen2" and not attention_bias:
        raise BadCheckpoint("qwen2 GGUF without attention biases (blk.0.attn_q.bias)")
    config: dict[str, Any] = {
        "architectures": [class_name],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": dim(
            meta.get(f"{arch}.feed_forward_length") or key("expert_feed_forward_length")
            if arch == "qwen3moe"
            else key("feed_forward_length"),
            f"{arch}.feed_forward_length",
        ),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length", 4096)),
        "rms_norm_eps": decimal(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})},
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
        "bos_token_id": vocab.bos_id,
        "eos_token_id": vocab.eos_id,
        "pad_token_id": vocab.pad_id,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,  # transformers 4 and older mlx-lm read this name
    }
    if arch != "gpt-oss" and (has("ffn_up.bias") or has("attn_output.bias")):
        raise BadCheckpoint("MLP or output-projection biases are not supported: expected none")
    if model_type == "llama":
        config["mlp_bias"] = False
    elif arch == "gemma3":
        config |= _gemma3(meta, config, scaling)
    elif arch == "qwen3moe":
        config |= _qwen3moe(key, tensors)
    elif arch == "gpt-oss":
        config |= gguf_gpt_oss.config(meta, key, tensors, config)
    else:
        config |= {"use_sliding_window": False, "sliding_window": None}
    return config


def _qwen3moe(key, tensors: dict) -> dict[str, Any]:
    """Every layer a mixture of experts (llama.cpp's qwen3moe has no dense layers), top-k
    weights renormalized (llama.cpp's qwen3moe always does: transformers' default is not)."""
    experts = dim(key("expert_count"), "qwen3moe.expert_count")
    used = dim(key("expert_used_count"), "qwen3moe.expert_used_count")
    if used > experts:
        raise BadCheckpoint(f"{used} experts per token of {experts}: a damaged GGUF")
    if any(".ffn_gate_inp_shexp." in name or ".ffn_up_shexp." in name for name in tensors):
        raise BadCheckpoint("a qwen3moe GGUF with shared experts: not a Qwen3 MoE")
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": dim(
            key("expert_feed_forward_length"), "qwen3moe.expert_feed_forward_length"
        ),  # fmt: skip
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _gemma3(meta: dict[str, Any], config: dict[str, Any], scaling) -> dict[str, Any]:
    n = config["num_hidden_layers"]
    theta = config["rope_theta"]
    types = ["full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention"
             for i in range(n)]  # fmt: skip
    heads = config["num_attention_heads"]
    scalar = config["hidden_size"] // heads if n == 62 else config["head_dim"]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(meta["gemma3.attention.sliding_window"]),
        "sliding_window_pattern": GEMMA3_PATTERN,
        "layer_types": types,
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": GEMMA3_LOCAL_THETA,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": theta, **(scaling or {})},
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_THETA},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def _rope_scaling(meta, arch: str, freqs, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The rope_scaling dict of config.json (None: plain RoPE)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
    if freqs is not None:
        if kind not in (None, "none"):
            raise BadCheckpoint(f"both rope_freqs and rope scaling {kind!r}: expected one")
        from gguf import dequantize

        return llama3_rope(np.asarray(dequantize(freqs.data, freqs.tensor_type)), theta, head_dim)
    if kind in (None, "none") and (factor is None or float(factor) == 1.0):
        return None
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": decimal(factor)}
    raise BadCheckpoint(
        f"unsupported RoPE scaling {kind!r}: exo-split supports none, linear and llama3"
    )


def llama3_rope(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The llama3 rope_scaling that yields llama.cpp's per-frequency divisors `factors`.

    llama.cpp stores only the divisors. Meta's published values are tried first, then values
    fitted to the divisors; whatever is returned is checked to reproduce them, else refused.
    (original, low, high) and (c*original, c*low, c*high) give the same RoPE, so low is 1.0
    unless a published triple matches.)
    """
    r = factors.astype(np.float64).reshape(-1)
    if r.shape != (head_dim // 2,):
        raise BadCheckpoint(f"rope_freqs has {r.size} values: expected {head_dim // 2}")
    if np.allclose(r, 1.0):
        return None
    factor = float(r.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    for low, high, original in _llama3_candidates(r, wavelen, factor):
        if np.allclose(
            _llama3_divisors(wavelen, factor, low, high, original), r, rtol=1e-4, atol=1e-6
        ):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise BadCheckpoint(
        f"rope_freqs.weight matches no llama3 RoPE scaling (factor {factor:g}): cannot say "
        "what RoPE the model needs"
    )


def _llama3_divisors(wavelen, factor, low, high, original) -> np.ndarray:
    smooth = (original / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium)
    )


def _llama3_candidates(r, wavelen, factor) -> Iterator[tuple[float, float, int]]:
    for original in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        yield 1.0, 4.0, original
    mid = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    # In the medium band, smooth = original / (high - 1) / wavelen - 1 / (high - 1): a line in
    # 1/wavelen, whose two coefficients give high and original (low = 1).
    smooth = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)
    if mid.sum() >= 2:
        a, b = np.polyfit(1 / wavelen[mid], smooth, 1)
        if b < 0:
            yield 1.0, round(1 - 1 / b, 4), round(-a / b)
    for high in (4.0, 2.0, 8.0):
        if mid.any():
            yield 1.0, high, round(float(np.median((smooth * (high - 1) + 1) * wavelen[mid])))
        else:  # no medium band: any original between the two bands will do
            above = wavelen[np.isclose(r, 1.0)].max(initial=0.0) * high
            below = wavelen[np.isclose(r, factor)].min(initial=np.inf)
            if above < below:
                yield 1.0, high, math.floor(above) + 1
