"""Tiny random checkpoints built with transformers' save_pretrained, per test session.

Weights are drawn at std 0.2 (larger than the default init) so greedy output is not a
degenerate repeat; a word-level tokenizer from `tokenizers`. eos_token_id is None so
generation runs to max_tokens on both our side and the reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Cohere2Config,
    CohereConfig,
    DeepseekV3Config,
    Gemma3TextConfig,
    Glm4Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeHybridConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Olmo3Config,
    Phi3Config,
    Qwen2Config,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SmolLM3Config,
)

from exo_split.models.tiny import save_tokenizer

VOCAB = 512
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=None,
)


def _family(cls, **fixed):
    """A config builder: the common sizes, then the family's own values, then the test's."""
    return lambda **kw: cls(**{**_COMMON, **fixed, **kw})


FAMILIES = {
    # Llama, GQA, llama3 rope scaling, non-default theta, untied.
    "llama": _family(
        LlamaConfig,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    # Mistral, MQA (one KV head), tied embeddings.
    "mistral": _family(
        MistralConfig,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
    ),
    # Qwen2: q/k/v biases, GQA, untied.
    "qwen2": _family(
        Qwen2Config,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # Qwen3: q/k norms, explicit head_dim != hidden/heads, MQA, tied.
    "qwen3": _family(
        Qwen3Config,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 300000.0},
    ),
}

# The families of families.py beyond the first four: 4 layers, non-default values for every
# field that changes the maths, sliding windows of WINDOW (prompts stay inside it).
WINDOW = 64
S, F = "sliding_attention", "full_attention"
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_SMALL = dict(num_hidden_layers=4, num_key_value_heads=2)
MORE_FAMILIES = {
    "qwen3_moe": _family(Qwen3MoeConfig,
        **_SMALL, **_MOE, num_experts=4, head_dim=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 200000.0},
    ),
    "mixtral": _family(MixtralConfig,
        **_SMALL, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 30000.0},
    ),
    "phi3": _family(Phi3Config,
        **_SMALL,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5},
    ),
    "olmo2": _family(Olmo2Config, **_SMALL),
    "olmo3": _family(Olmo3Config,
        **_SMALL, sliding_window=WINDOW, layer_types=[S, F, S, F],
    ),
    "glm4": _family(Glm4Config,
        **_SMALL, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 40000.0, "partial_rotary_factor": 0.5},
    ),
    "glm4_moe": _family(Glm4MoeConfig,
        **_SMALL, **_MOE, head_dim=16, n_routed_experts=4, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.5,
        use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "smollm3": _family(SmolLM3Config,
        **_SMALL, no_rope_layers=[1, 0, 1, 0],
    ),
    "granite": _family(GraniteConfig,
        **_SMALL, logits_scaling=4.0, embedding_multiplier=3.0,
        residual_multiplier=0.5, attention_multiplier=0.2,
    ),
    "cohere": _family(CohereConfig,
        **_SMALL, logit_scale=0.3, use_qk_norm=False,
    ),
    "cohere2": _family(Cohere2Config,
        **_SMALL, head_dim=16, logit_scale=0.3, sliding_window=WINDOW,
        layer_types=[S, F, S, F],
    ),
    # Qwen3-Next: gated delta net (recurrent) layers beside full attention every 2nd layer
    # (mlx-lm's full_attention_interval), experts with a shared one, partial rotary.
    "qwen3_next": _family(Qwen3NextConfig,
        **_SMALL, **_MOE, num_experts=4, shared_expert_intermediate_size=32, head_dim=32,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=3, mlp_only_layers=[1],
        norm_topk_prob=False, layer_types=["linear_attention", F] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5},
    ),
    # Granite 4.0-H: Mamba2 layers and attention ones in a list of its own (no period),
    # experts beside a shared MLP, Granite's multipliers; RoPE on.
    "granitemoehybrid": _family(GraniteMoeHybridConfig,
        **_SMALL, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
        mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=3,
        mamba_expand=2, mamba_chunk_size=16, position_embedding_type="rope",
        layer_types=["linear_attention", "linear_attention", F, "linear_attention"],
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=4.0,  # time_step_limit: transformers' (0, inf), written as {"__float__": ...}
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
    ),
    # Qwen3.5's text models, dense and of experts: gated delta nets (q/k/v in one projection),
    # full attention every 2nd layer here.
    "qwen3_5_text": _family(Qwen3_5TextConfig,
        **_SMALL, head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=3,
        layer_types=["linear_attention", F] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 30000.0, "partial_rotary_factor": 0.5},
    ),
    "qwen3_5_moe_text": _family(Qwen3_5MoeTextConfig,
        **_SMALL, **_MOE, num_experts=4, shared_expert_intermediate_size=32, head_dim=32,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", F],
        rope_parameters={"rope_type": "default", "rope_theta": 40000.0, "partial_rotary_factor": 0.25},
    ),
    # gpt-oss: sinks, biases, alternating windows, experts with their own activation, and
    # YaRN with truncate: false (the correction range's ends fall between pairs here).
    "gpt_oss": _family(GptOssConfig,
        **_SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=WINDOW, layer_types=[S, F, S, F],
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 512},
    ),
    # DeepSeek-V3: latent attention (the cache holds a 32-wide latent and an 8-wide roped
    # key), YaRN with DeepSeek's mscales, experts routed in groups, a dense first layer.
    # (transformers' MLA attention needs num_key_value_heads = num_attention_heads.)
    "deepseek_v3": _family(DeepseekV3Config,
        num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=24, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, norm_topk_prob=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 20000.0, "factor": 4.0,
                         "mscale": 0.9, "mscale_all_dim": 0.8, "beta_fast": 16.0, "beta_slow": 2.0,
                         "original_max_position_embeddings": 1024},
    ),
    # GLM-4.7-Flash: latent attention; two dense layers, then experts (mlp_layer_types);
    # rms_norm_eps 1e-4, which mlx-lm would also use for the latent's norm (transformers: 1e-6).
    "glm4_moe_lite": _family(Glm4MoeLiteConfig,
        num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=24,
        v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=32, routed_scaling_factor=2.0, rms_norm_eps=1e-4,
        mlp_layer_types=["dense", "dense", "sparse", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    ),
    "gemma3_text": _family(Gemma3TextConfig,
        **_SMALL, head_dim=16, sliding_window=WINDOW, layer_types=[S, F, S, F],
        query_pre_attn_scalar=24, final_logit_softcapping=None,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 300000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
        },
    ),
}  # fmt: skip
FAMILIES.update(MORE_FAMILIES)


def build(out_dir: Path, family: str, *, seed: int = 0, std: float = 0.2, **overrides) -> Path:
    config = FAMILIES[family](**overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir, VOCAB)
    return Path(out_dir)


# A Hermes / Qwen-style chat template with tools, written for these tests: ChatML turns, the
# tools as JSON in the system turn, calls as <tool_call> JSON, results in <tool_response>.
# An assistant turn with calls is written the way exo-split's grammar has the model write
# them, so that the next turn's prompt starts with the text the model produced.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call these functions, each given by a JSON schema:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one by answering <tool_call>
{"name": <its name>, "arguments": <its arguments>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}
{% endif %}{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def build_tools_model(out_dir: Path, tokenizer_dir: Path) -> Path:
    """A tiny random Llama with a real byte-level tokenizer (SmolLM2's, from
    `tokenizer_dir`, so JSON can be spelled) and TOOLS_TEMPLATE; <|im_end|> ends a turn."""
    import json
    import shutil

    build(out_dir, "llama", vocab_size=49152, bos_token_id=1, eos_token_id=2)
    shutil.copy(Path(tokenizer_dir) / "tokenizer.json", out_dir / "tokenizer.json")
    config = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return Path(out_dir)


# MXFP4 (OCP microscaling): 32 values share a power-of-two scale (a biased exponent byte);
# each value is a 4-bit E2M1 number, two to a byte, the first in the low nibble.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4(w):
    """[..., out, in] floats -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out,
    in/32]): each group's scale the smallest power of two that brings it within +-6, each
    value rounded to the nearest E2M1 number."""
    import numpy as np

    *lead, rows, cols = w.shape
    g = np.asarray(w, np.float32).reshape(*lead, rows, cols // 32, 32)
    amax = np.abs(g).max(-1, keepdims=True)
    e = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    x = g / np.exp2(e)
    idx = np.abs(np.abs(x)[..., None] - np.array(E2M1, np.float32)).argmin(-1).astype(np.uint8)
    idx |= (x < 0).astype(np.uint8) << 3
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return np.ascontiguousarray(blocks), np.ascontiguousarray((e[..., 0] + 127).astype(np.uint8))


def build_gpt_oss_mxfp4(out_dir: Path, full_dir: Path) -> Path:
    """`full_dir` (a transformers-5 gpt-oss) as OpenAI publishes gpt-oss: the experts'
    matrices MXFP4 as [experts, out, in] `_blocks` / `_scales`, everything else as it was,
    and transformers' `quantization_config`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(full_dir, out_dir, dirs_exist_ok=True)
    weights = {}
    for key, value in load_file(Path(full_dir) / "model.safetensors").items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4(value.transpose(-1, -2).numpy())
            weights[f"{key}_blocks"] = torch.from_numpy(blocks)
            weights[f"{key}_scales"] = torch.from_numpy(scales)
        else:
            weights[key] = value
    save_file(weights, Path(out_dir) / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((Path(out_dir) / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (Path(out_dir) / "config.json").write_text(json.dumps(config, indent=2))
    return Path(out_dir)


def build_qwen35_vision_language(out_dir: Path, text_family: str = "qwen3_5_text") -> Path:
    """Qwen3.5 as it is published: the vision-language model (model_type qwen3_5 or
    qwen3_5_moe), its text model (FAMILIES[text_family]'s config) under text_config, a tiny
    vision tower."""
    import json

    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    moe = text_family == "qwen3_5_moe_text"
    config_class = Qwen3_5MoeConfig if moe else Qwen3_5Config
    model_class = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    text = json.loads(FAMILIES[text_family]().to_json_string())
    for key in ("architectures", "transformers_version", "model_type"):
        text.pop(key, None)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, patch_size=4, temporal_patch_size=1)  # fmt: skip
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir, VOCAB)
    return Path(out_dir)
