"""The model families exo-split runs: for each, the config fields that change its maths and
how they reach mlx-lm. Data, not branches in the backends (no torch or mlx imports).

A family's `fields` are read from config.json as they are (absent: transformers' own default
for that family, so a checkpoint that relies on a default means the same on both sides), go
into the fingerprint, and are handed to mlx-lm's ModelArgs under mlx-lm's name for them
(`mlx_names`). The transformers side needs no translation: it reads the same config.json.

What mlx-lm's module cannot express is refused with the reason (`refuse`), never run: a
final soft-cap that mlx-lm's gemma3_text never applies, a layer pattern it cannot describe.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


@dataclass(frozen=True)
class Family:
    fields: Mapping[str, Any] = field(default_factory=dict)  # config key -> transformers' default
    mlx_names: Mapping[str, str] = field(default_factory=dict)  # our key -> mlx-lm's, if other
    aliases: Mapping[str, str] = field(default_factory=dict)  # our key -> an older config key
    qkv_bias: bool = False  # q/k/v always carry a bias, whatever attention_bias says
    qk_norm: bool = False  # per-head RMSNorm on q and k
    # Where the sliding window applies: "always" (every layer when sliding_window is set),
    # "flag" (when use_sliding_window is true), "layer_types" (the layers typed sliding),
    # None: the family never slides.
    window: str | None = None
    # The window pattern mlx-lm's module takes instead of layer_types (sliding_window_pattern).
    mlx_pattern: bool = False
    refuse: Callable[[dict[str, Any]], str | None] | None = None
    # mlx-lm scales the embeddings by sqrt(hidden_size) rounded to this dtype, where
    # transformers rounds it to the weights' dtype: the MLX backend makes up the difference.
    mlx_embed_scale_dtype: str | None = None
    # The rope scalings mlx-lm's module of the family applies (several build a plain RoPE and
    # never read rope_scaling: a scaled checkpoint would rotate differently there).
    mlx_rope: tuple[str, ...] = ("linear", "llama3", "yarn")
    # The state of its recurrent (linear_attention) layers, by name in layers.STATES; its
    # layer_types then say which layers are recurrent, and mlx-lm takes the period of their
    # pattern as `full_attention_interval`.
    recurrent: str | None = None
    # mlx-lm's module for this model_type, where it is named otherwise (qwen3_5_text -> qwen3_5).
    mlx_module: str | None = None
    # Where mlx-lm takes the layer list itself (not a period): its names for the layer types.
    mlx_layer_names: Mapping[str, str] = field(default_factory=dict)
    # A field's value as mlx-lm's module means it, where the two libraries read it otherwise
    # (key, value) -> value; None: as it is.
    mlx_value: Callable[[str, Any], Any] | None = None
    # Latent attention (MLA): every layer caches the normalized latent (K, kv_lora_rank wide)
    # and the roped key shared by all heads (V, qk_rope_head_dim wide), one "head" (layers.py).
    latent: bool = False
    # The epsilon transformers normalizes the latent and the query's low-rank projection
    # with, where mlx-lm's module takes rms_norm_eps instead (set after loading: mlx_adapt).
    latent_norm_eps: float | None = None


_QWEN_MOE = {
    "num_local_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
}
_GLM_MOE = {
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "use_qk_norm": False,
}


# Qwen3-Next's and Qwen3.5's gated delta net layers (3 of every 4 by default).
_GATED_DELTA = {
    "linear_num_value_heads": 32,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "partial_rotary_factor": 0.25,
    "layer_types": None,
}
_QWEN_NEXT = {
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    **_GATED_DELTA,
}
_QWEN35 = _GATED_DELTA  # Qwen3.5's text model: the same layers and defaults, no experts
_QWEN35_MOE = {
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}


_GRANITE_HYBRID = {
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 1.0,
    "logits_scaling": 1.0,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "shared_intermediate_size": 1024,
    "position_embedding_type": None,
    "mamba_n_heads": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_head": None,  # "auto": mamba_expand (2) * hidden_size / mamba_n_heads
    "mamba_d_conv": 4,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "time_step_limit": ("0.0", "inf"),  # as strings: the wire's JSON has no infinity
    "layer_types": None,
}


def _granite_hybrid_mlx(key: str, value: Any) -> Any:
    # transformers rotates only when position_embedding_type is "rope" (None: no RoPE);
    # mlx-lm unless it is "nope".
    if key == "position_embedding_type":
        return "rope" if value == "rope" else "nope"
    if key == "time_step_limit":
        return tuple(float(x) for x in value)
    return value


def _granite_hybrid_refuse(config: dict[str, Any]) -> str | None:
    types = set(config.get("layer_types") or ())
    if not types & {FULL, "attention"}:
        return "a model without attention layers (Mamba only) is not supported"
    return None


# DeepSeek-V3's latent attention and its experts (group-limited routing by sigmoid scores).
_MLA = {
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}
_DEEPSEEK_MOE = {
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}


_GLM_LITE = {
    **_MLA,
    "q_lora_rank": 768,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1536,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.8,
    "norm_topk_prob": True,
    "mlp_layer_types": None,  # transformers: one dense layer, then experts
}


def _glm_lite_mlx(key: str, value: Any) -> Any:
    # transformers reads the list, mlx-lm the number of dense layers before the experts
    return value.count("dense") if key == "mlp_layer_types" else value


def _glm_lite_refuse(config: dict[str, Any]) -> str | None:
    types = list(config.get("mlp_layer_types") or ())
    dense = types.count("dense")
    if types and (types != ["dense"] * dense + ["sparse"] * (len(types) - dense)):
        return f"mlx-lm runs dense layers first, then experts; mlp_layer_types is {types}"
    return _mla_refuse(config)


def _mla_refuse(config: dict[str, Any]) -> str | None:
    if config.get("rope_interleave", True) is False:
        return ("rope_interleave is false: mlx-lm always rotates the latent key's dimensions "
                "in interleaved pairs")  # fmt: skip
    for key, fixed in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if config.get(key, fixed) != fixed:
            return f"mlx-lm and transformers route experts by {key} {fixed!r} only, not {config[key]!r}"
    if int(config.get("moe_layer_freq", 1)) != 1:
        return "transformers makes every layer past first_k_dense_replace sparse (moe_layer_freq 1)"
    return None


def _gemma3_refuse(config: dict[str, Any]) -> str | None:
    if config.get("final_logit_softcapping") is not None:
        return "mlx-lm's gemma3_text does not apply final_logit_softcapping"
    if config.get("attn_logit_softcapping") is not None:
        return "mlx-lm's gemma3_text does not apply attn_logit_softcapping"
    if config.get("use_bidirectional_attention"):
        return "bidirectional attention (an encoder configuration) is not a causal LM"
    return None


def _gpt_oss_refuse(config: dict[str, Any]) -> str | None:
    for key, fixed in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        if float(config.get(key, fixed)) != fixed:
            return f"mlx-lm's gpt_oss fixes {key} at {fixed}; this checkpoint has {config[key]}"
    if not config.get("attention_bias", True):
        return "mlx-lm's gpt_oss always adds attention biases; this checkpoint has none"
    if config.get("tie_word_embeddings"):
        return "mlx-lm's gpt_oss always has an output head of its own (tied embeddings here)"
    types = set(config.get("layer_types") or (SLIDING, FULL))
    if not config.get("sliding_window") or types != {SLIDING, FULL}:
        return "mlx-lm's gpt_oss needs both sliding and full layers and a sliding_window"
    return None


FAMILIES: dict[str, Family] = {
    "llama": Family(fields={"mlp_bias": False}),
    "mistral": Family(window="always"),
    "qwen2": Family(qkv_bias=True, window="flag"),
    "qwen3": Family(qk_norm=True, window="flag"),
    "qwen3_moe": Family(
        mlx_rope=(),
        fields=_QWEN_MOE,
        mlx_names={"num_local_experts": "num_experts"},
        aliases={"num_local_experts": "num_experts"},
        qk_norm=True,
        window="flag",
    ),
    "mixtral": Family(
        mlx_rope=(), fields={"num_local_experts": 8, "num_experts_per_tok": 2}, window="always"
    ),
    "phi3": Family(
        mlx_rope=("longrope",),
        fields={"partial_rotary_factor": 1.0, "original_max_position_embeddings": 4096},
        window="always",
    ),
    "olmo2": Family(),
    "olmo3": Family(fields={"layer_types": None}, window="layer_types"),
    "glm4": Family(mlx_rope=(), fields={"partial_rotary_factor": 0.5}),
    "glm4_moe": Family(mlx_rope=(), fields={"partial_rotary_factor": 0.5, **_GLM_MOE}),
    "smollm3": Family(fields={"no_rope_layers": None, "no_rope_layer_interval": 4}, window="flag"),
    "granite": Family(
        fields={
            "embedding_multiplier": 1.0,
            "residual_multiplier": 1.0,
            "attention_multiplier": 1.0,
            "logits_scaling": 1.0,
            "mlp_bias": False,
        }
    ),
    "cohere": Family(
        mlx_rope=(), fields={"logit_scale": 0.0625, "use_qk_norm": False, "layer_norm_eps": 1e-5}
    ),
    "cohere2": Family(
        mlx_rope=(),
        fields={"logit_scale": 0.0625, "layer_norm_eps": 1e-5},
        window="layer_types",
        mlx_pattern=True,
    ),
    "qwen3_next": Family(fields=_QWEN_NEXT, qk_norm=True, recurrent="gated_delta"),
    "granitemoehybrid": Family(
        fields=_GRANITE_HYBRID,
        recurrent="mamba2",
        mlx_layer_names={LINEAR: "mamba", FULL: "attention"},
        mlx_value=_granite_hybrid_mlx,
        refuse=_granite_hybrid_refuse,
    ),
    "qwen3_5_text": Family(
        fields=_QWEN35, qk_norm=True, recurrent="gated_delta", mlx_module="qwen3_5"
    ),
    "qwen3_5_moe_text": Family(
        fields={**_QWEN35, **_QWEN35_MOE},
        qk_norm=True,
        recurrent="gated_delta",
        mlx_module="qwen3_5_moe",
    ),
    "gpt_oss": Family(
        fields={"num_local_experts": 128, "num_experts_per_tok": 4, "layer_types": None},
        qkv_bias=True,
        window="layer_types",
        refuse=_gpt_oss_refuse,
    ),
    "deepseek_v3": Family(fields={**_MLA, **_DEEPSEEK_MOE}, latent=True, refuse=_mla_refuse),
    "glm4_moe_lite": Family(
        fields=_GLM_LITE,
        latent=True,
        latent_norm_eps=1e-6,
        mlx_names={"mlp_layer_types": "first_k_dense_replace"},
        mlx_value=_glm_lite_mlx,
        refuse=_glm_lite_refuse,
    ),
    "gemma3_text": Family(
        fields={"query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0},
        window="layer_types",
        mlx_pattern=True,
        refuse=_gemma3_refuse,
        mlx_embed_scale_dtype="bfloat16",
    ),
}
# Families both libraries implement that exo-split refuses, and why (README, Limitations).
REFUSED = {
    "gemma2": "mlx-lm's gemma2 module ignores the sliding window its layers have",
    "gemma4_text": "its layers have head sizes of their own, which the per-layer cache "
    "description does not hold yet",
    "kimi_k2": "transformers runs it, and its tokenizer, only through the checkpoint's own "
    "code (trust_remote_code), which exo-split does not run (its layers are DeepSeek-V3's, "
    "which run as deepseek_v3)",
}
# Checkpoints of a vision-language model whose text model is a family above: its config
# under `text_config` (the vision tower's weights are left unloaded on both sides).
TEXT_OF = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# Config keys that are read from rope_parameters in transformers 5 (the old layout: top level).
ROPE_FIELDS = ("partial_rotary_factor",)


def family(model_type: str | None) -> Family | None:
    return FAMILIES.get(model_type or "")


def window_pattern(layer_types: tuple[str, ...], other: str = SLIDING) -> int | None:
    """The period P of a 'P-1 sliding (or `other`) layers, then one full' pattern (mlx-lm's
    sliding_window_pattern, full_attention_interval), or None when the layers follow none."""
    if FULL not in layer_types:
        return None
    p = layer_types.index(FULL) + 1
    expected = tuple(FULL if (i + 1) % p == 0 else other for i in range(len(layer_types)))
    return p if expected == layer_types else None


def default_layer_types(model_type: str, n_layers: int, config: dict[str, Any]) -> tuple[str, ...]:
    """transformers' own layer_types when config.json has none (its config classes fill them
    from a pattern, and older files carry only the pattern)."""
    other = LINEAR if FAMILIES[model_type].recurrent else SLIDING
    pattern = (
        config.get("sliding_window_pattern")
        or config.get("_sliding_window_pattern")
        or config.get("full_attention_interval")
    )
    if pattern is None:
        pattern = {"gemma3_text": 6, "cohere2": 4, "olmo3": 4, "gpt_oss": 2, "qwen3_next": 4,
                   "qwen3_5_text": 4, "qwen3_5_moe_text": 4}.get(model_type)  # fmt: skip
    if not pattern:
        return (FULL,) * n_layers
    return tuple(FULL if (i + 1) % int(pattern) == 0 else other for i in range(n_layers))
