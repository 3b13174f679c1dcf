"""gpt-oss GGUFs (llama.cpp's `gpt-oss` architecture) back into the checkpoint OpenAI publishes.

llama.cpp keeps gpt-oss's experts in MXFP4 (32 values share a power-of-two scale; each value
an E2M1 code), splits the fused gate/up projection into `ffn_gate_exps` and `ffn_up_exps`
(OpenAI interleaves them row by row) and stores each 32-value block as its scale byte then
16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31. OpenAI's files hold
the same codes two to a byte in order, the scales apart. So the experts are repacked, not
dequantized: the same numbers, a quarter of float32's bytes, and the layout both nodes
already load as published (transformers dequantizes it where it has no MXFP4 kernels,
mlx-lm runs it packed). Experts stored otherwise than MXFP4 are refused.

The rest maps one tensor to one: attention with biases and sinks, the router with its bias,
the norms. The config is gpt-oss's: alternating sliding and full layers (sliding first, as
llama.cpp runs them), YaRN without truncating the correction range (as OpenAI trained it;
the GGUF stores only the factor and the original context).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from exo_split.errors import BadCheckpoint
from exo_split.models.gguf_values import decimal, dim

ARCH = "gpt-oss"
BLOCK = 32  # values per MXFP4 block
# Beside the attention tensors every family has (gguf_weights.LAYER_TENSORS):
LAYER_TENSORS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
                  "ffn_gate_exps.bias", "ffn_up_exps.bias")  # fmt: skip
# The modules OpenAI's quantization_config leaves in full precision (everything but experts).
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]  # fmt: skip


def config(meta: dict[str, Any], key, tensors: dict, base: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's own fields, on top of the common config `base`."""
    experts = dim(key("expert_count"), f"{ARCH}.expert_count")
    used = dim(key("expert_used_count"), f"{ARCH}.expert_used_count")
    if used > experts:
        raise BadCheckpoint(f"{used} experts per token of {experts}: a damaged GGUF")
    kinds = {tensors[f"blk.0.{n}"].tensor_type.name for n in EXPERT_TENSORS[:3]
             if f"blk.0.{n}" in tensors}  # fmt: skip
    if kinds != {"MXFP4"}:
        raise BadCheckpoint(
            f"gpt-oss experts stored as {', '.join(sorted(kinds)) or 'nothing'}: exo-split "
            "converts gpt-oss GGUFs whose experts are MXFP4, as llama.cpp writes them"
        )
    n = base["num_hidden_layers"]
    ff = dim(key("expert_feed_forward_length", base["intermediate_size"]),
               f"{ARCH}.expert_feed_forward_length")  # fmt: skip
    if base["hidden_size"] % BLOCK or ff % BLOCK:
        raise BadCheckpoint(f"MXFP4 experts need sizes that are multiples of {BLOCK}")
    return {
        "intermediate_size": ff,
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "sliding_window": dim(key("attention.sliding_window"), f"{ARCH}.attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "router_aux_loss_coef": 0.9,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED},
    }


def rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    """YaRN from the factor and original context llama.cpp stores (None: no scaling)."""
    kind = meta.get(f"{ARCH}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta.get(f"{ARCH}.rope.scaling.factor")
    original = meta.get(f"{ARCH}.rope.scaling.original_context_length")
    if kind != "yarn" or factor is None or original is None:
        raise BadCheckpoint(f"gpt-oss rope scaling {kind!r} (factor {factor}, original context "
                            f"{original}): expected yarn with both")  # fmt: skip
    return {
        "rope_type": "yarn",
        "factor": decimal(factor),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(meta.get(f"{ARCH}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get(f"{ARCH}.rope.scaling.yarn_beta_slow", 1.0)),
        "truncate": False,
    }


def openai_mxfp4(raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's MXFP4 rows (each block a scale byte, then 16 bytes: low nibbles values
    0-15, high nibbles 16-31) of `cols` values as OpenAI's (blocks [..., cols/32, 16] with
    values 2j and 2j+1 in byte j's low and high nibble, scales [..., cols/32])."""
    lead = raw.shape[:-1]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(*lead, cols // BLOCK, 1 + BLOCK // 2)
    scales, qs = b[..., 0], b[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [..., blocks, 32] in order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)


def interleave(gate: np.ndarray, up: np.ndarray, axis: int) -> np.ndarray:
    """OpenAI's fused gate/up: gate row i at 2i, up row i at 2i + 1 along `axis`."""
    out = np.stack([gate, up], axis=axis + 1)
    shape = list(gate.shape)
    shape[axis] *= 2
    return out.reshape(shape)


def experts_plan(tensors: dict, layer: int, cfg: dict[str, Any], planned) -> list:
    """One layer's experts as OpenAI's tensors (PlannedTensors built from two GGUF tensors)."""
    e, d, f = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    name = f"model.layers.{layer}.mlp.experts"
    src = {n: tensors.get(f"blk.{layer}.{n}") for n in EXPERT_TENSORS}
    missing = [n for n, t in src.items() if t is None]
    if missing:
        raise BadCheckpoint(f"the GGUF lacks blk.{layer}.{missing[0]}, which gpt-oss needs")
    wants = {"ffn_gate_exps.weight": (e, f, d), "ffn_up_exps.weight": (e, f, d),
             "ffn_down_exps.weight": (e, d, f), "ffn_gate_exps.bias": (e, f),
             "ffn_up_exps.bias": (e, f)}  # fmt: skip
    for n, want in wants.items():
        shape = tuple(int(x) for x in reversed(src[n].shape))
        if shape != want:
            raise BadCheckpoint(f"blk.{layer}.{n} has shape {shape}, expected {want}")
    gate, up, down = (src[n] for n in EXPERT_TENSORS[:3])

    def gate_up(part: int):
        def build() -> np.ndarray:
            g, u = openai_mxfp4(gate.data, d)[part], openai_mxfp4(up.data, d)[part]
            return interleave(g, u, axis=1)

        return build

    def bias() -> np.ndarray:
        from gguf import dequantize

        g, u = (np.asarray(dequantize(src[n].data, src[n].tensor_type), np.float32)
                for n in ("ffn_gate_exps.bias", "ffn_up_exps.bias"))  # fmt: skip
        return interleave(g.reshape(e, f), u.reshape(e, f), axis=1)

    nb = d // BLOCK
    return [
        planned(gate, f"{name}.gate_up_proj_blocks", (e, 2 * f, nb, 16), build=gate_up(0),
                stored="U8"),
        planned(gate, f"{name}.gate_up_proj_scales", (e, 2 * f, nb), build=gate_up(1),
                stored="U8"),
        planned(down, f"{name}.down_proj_blocks", (e, d, f // BLOCK, 16),
                build=lambda: openai_mxfp4(down.data, f)[0], stored="U8"),
        planned(down, f"{name}.down_proj_scales", (e, d, f // BLOCK),
                build=lambda: openai_mxfp4(down.data, f)[1], stored="U8"),
        planned(src["ffn_gate_exps.bias"], f"{name}.gate_up_proj_bias", (e, 2 * f), build=bias),
    ]  # fmt: skip
