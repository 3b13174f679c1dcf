"""The weights of a GGUF as one safetensors file, streamed tensor by tensor.

Each tensor is dequantized by the gguf package to float32, checked against the shape the
config implies, un-permuted where llama.cpp permuted it, and written as float32 or bfloat16.
The header is written first (shapes are known from the GGUF's tensor table), so memory holds
one dequantized tensor at a time, whatever the model's size. No torch: bfloat16 is rounded
here, bit for bit as torch rounds it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exo_split.errors import BadCheckpoint
from exo_split.models import gguf_gpt_oss
from exo_split.models.gguf_config import ROPE_FREQS

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 norms its attention and MLP on both sides, and llama.cpp stores every Gemma norm
# weight as 1 + w (transformers' Gemma RMSNorm scales by 1 + w): the - 1 undoes that.
GEMMA3_LAYER_TENSORS = LAYER_TENSORS | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Qwen3 MoE: the router, and the experts stacked in one GGUF tensor per projection
# ([experts, out, in]) written one tensor per expert, as checkpoints on disk have them (and
# mlx-lm reads them).
_DENSE_MLP = ("ffn_gate.", "ffn_up.", "ffn_down.")
MOE_LAYER_TENSORS = {k: v for k, v in LAYER_TENSORS.items() if not k.startswith(_DENSE_MLP)}
MOE_LAYER_TENSORS["ffn_gate_inp.weight"] = "mlp.gate.weight"
EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
           "ffn_down_exps.weight": "down_proj"}  # fmt: skip
# gpt-oss: the attention projections, biases and input norm every family has (not Qwen3's
# q/k norms), then its own (an output bias, sinks, its post-attention norm, the router).
GPT_OSS_LAYER_TENSORS = {
    **{
        k: v
        for k, v in LAYER_TENSORS.items()
        if k.startswith("attn_") and "_k_norm" not in k and "_q_norm" not in k
    },
    **gguf_gpt_oss.LAYER_TENSORS,
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor to write: where it comes from and what it must look like."""

    source: Any  # gguf.ReaderTensor
    name: str  # transformers name
    shape: tuple[int, ...]  # transformers shape [out, in]
    unpermute_heads: int | None  # llama Q/K: heads to undo llama.cpp's RoPE permutation over
    shift: float = 0.0  # subtracted after dequantization (Gemma's 1 + w norms)
    index: int | None = None  # one expert of a stacked [experts, out, in] tensor
    # Made otherwise than by dequantizing `source` (gpt-oss's repacked MXFP4 experts, from
    # two GGUF tensors): the array, as float32 or, with `stored`, as written ("U8": bytes).
    build: Callable[[], np.ndarray] | None = field(default=None, compare=False)
    stored: str | None = None


def tensor_plan(tensors: dict, config: dict[str, Any], arch: str) -> list[PlannedTensor]:
    """Every tensor to write, with its transformers name and checked shape."""
    if arch == gguf_gpt_oss.ARCH:
        return _gpt_oss_plan(tensors, config)
    n_layers = config["num_hidden_layers"]
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    expected = {
        "model.embed_tokens.weight": (v, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (v, d),
    }
    per_layer = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (nh * hd, d),
        "self_attn.k_proj.weight": (nkv * hd, d),
        "self_attn.v_proj.weight": (nkv * hd, d),
        "self_attn.o_proj.weight": (d, nh * hd),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    if config["attention_bias"]:
        per_layer |= {
            "self_attn.q_proj.bias": (nh * hd,),
            "self_attn.k_proj.bias": (nkv * hd,),
            "self_attn.v_proj.bias": (nkv * hd,),
        }
    if arch in ("qwen3", "gemma3"):
        per_layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    if arch == "gemma3":
        per_layer |= {"pre_feedforward_layernorm.weight": (d,),
                      "post_feedforward_layernorm.weight": (d,)}  # fmt: skip
    moe = arch == "qwen3moe"
    if moe:
        e, fe = config["num_experts"], config["moe_intermediate_size"]
        for k in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            del per_layer[k]
        per_layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
                      "mlp.gate.weight": (e, d)}  # fmt: skip
        for j in range(e):
            per_layer |= {f"mlp.experts.{j}.gate_proj.weight": (fe, d),
                          f"mlp.experts.{j}.up_proj.weight": (fe, d),
                          f"mlp.experts.{j}.down_proj.weight": (d, fe)}  # fmt: skip
    for i in range(n_layers):
        expected |= {f"model.layers.{i}.{k}": s for k, s in per_layer.items()}
    if config["tie_word_embeddings"]:
        del expected["lm_head.weight"]

    plan = []
    table = (
        GEMMA3_LAYER_TENSORS if arch == "gemma3" else MOE_LAYER_TENSORS if moe else LAYER_TENSORS
    )
    for gguf_name, t in tensors.items():
        if gguf_name == ROPE_FREQS:
            continue  # became rope_scaling in config.json
        m = _LAYER.fullmatch(gguf_name)
        if moe and m and m[2] in EXPERTS and int(m[1]) < n_layers:
            proj = EXPERTS[m[2]]
            want = (e, d, fe) if proj == "down_proj" else (e, fe, d)
            shape = tuple(int(x) for x in reversed(t.shape))
            if shape != want:
                raise BadCheckpoint(f"{gguf_name} has shape {shape}, expected {want}")
            plan += [PlannedTensor(t, f"model.layers.{m[1]}.mlp.experts.{j}.{proj}.weight",
                                   want[1:], None, index=j) for j in range(e)]  # fmt: skip
            continue
        name = _hf_name(gguf_name, n_layers, table)
        if name not in expected:
            raise BadCheckpoint(f"unexpected tensor {gguf_name} in a {arch} GGUF")
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
        if shape != expected[name]:
            raise BadCheckpoint(
                f"{gguf_name} has shape {shape}, expected {expected[name]} from the metadata"
            )
        heads = None
        if arch == "llama" and ".attn_q." in gguf_name:
            heads = nh
        elif arch == "llama" and ".attn_k." in gguf_name:
            heads = nkv
        shift = 1.0 if arch == "gemma3" and gguf_name.endswith("norm.weight") else 0.0
        plan.append(PlannedTensor(t, name, shape, heads, shift))
    missing = sorted(set(expected) - {p.name for p in plan})
    if missing:
        raise BadCheckpoint(
            f"the GGUF lacks {len(missing)} tensor(s) a {arch} model needs, e.g. {missing[0]}"
        )
    return plan


def _gpt_oss_plan(tensors: dict, config: dict[str, Any]) -> list[PlannedTensor]:
    """gpt-oss: its experts repacked as OpenAI's MXFP4 (models/gguf_gpt_oss.py), every other
    tensor one to one."""
    n_layers, d, v = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    hd, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    e = config["num_local_experts"]
    shapes = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (nh * hd, d), "self_attn.k_proj.weight": (nkv * hd, d),
        "self_attn.v_proj.weight": (nkv * hd, d), "self_attn.o_proj.weight": (d, nh * hd),
        "self_attn.q_proj.bias": (nh * hd,), "self_attn.k_proj.bias": (nkv * hd,),
        "self_attn.v_proj.bias": (nkv * hd,), "self_attn.o_proj.bias": (d,),
        "self_attn.sinks": (nh,), "mlp.router.weight": (e, d), "mlp.router.bias": (e,),
        "mlp.experts.down_proj_bias": (e, d),
    }  # fmt: skip
    expected = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
                "lm_head.weight": (v, d)}  # fmt: skip
    for i in range(n_layers):
        expected |= {f"model.layers.{i}.{k}": s for k, s in shapes.items()}
    plan = []
    for gguf_name, t in tensors.items():
        m = _LAYER.fullmatch(gguf_name)
        if m and m[2] in gguf_gpt_oss.EXPERT_TENSORS:
            continue  # below, a layer's at a time
        name = _hf_name(gguf_name, n_layers, GPT_OSS_LAYER_TENSORS)
        if name not in expected:
            raise BadCheckpoint(f"unexpected tensor {gguf_name} in a gpt-oss GGUF")
        shape = tuple(int(x) for x in reversed(t.shape))
        if math.prod(shape) != math.prod(expected[name]) or shape[-1] != expected[name][-1]:
            raise BadCheckpoint(f"{gguf_name} has shape {shape}, expected {expected[name]}")
        plan.append(PlannedTensor(t, name, expected[name], None))
    missing = sorted(set(expected) - {p.name for p in plan})
    if missing:
        raise BadCheckpoint(
            f"the GGUF lacks {len(missing)} tensor(s) gpt-oss needs, e.g. {missing[0]}"
        )
    for i in range(n_layers):
        plan += gguf_gpt_oss.experts_plan(tensors, i, config, _planned)
    return plan


def _planned(source, name: str, shape: tuple[int, ...], **kw) -> PlannedTensor:
    return PlannedTensor(source, name, shape, None, **kw)


def _hf_name(gguf_name: str, n_layers: int, layer_tensors: dict[str, str]) -> str | None:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m and int(m[1]) < n_layers and m[2] in layer_tensors:
        return f"model.layers.{m[1]}.{layer_tensors[m[2]]}"
    return None


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows [0, 2, 4.., 1, 3, 5..] of the
    interleaved-pair layout back to transformers' two halves (rotate_half)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weights(plan: list[PlannedTensor]) -> Iterator[np.ndarray]:
    from gguf import dequantize

    for p in plan:
        if p.build is not None:
            yield p.build()
            continue
        data = p.source.data
        if p.index is not None:  # one expert: its rows of the stacked tensor only
            data = data.reshape(int(p.source.shape[-1]), -1)[p.index]
        w = np.asarray(dequantize(data, p.source.tensor_type), dtype=np.float32)
        w = w.reshape(p.shape)
        if p.unpermute_heads:
            w = unpermute_rope(w, p.unpermute_heads)
        if p.shift:
            w = w - np.float32(p.shift)
        yield w


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (little-endian uint16) of float32 values, rounded to nearest even
    as torch does; NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype("<u2")
    nan = np.isnan(x)
    if nan.any():
        bits[nan] = (u[nan] >> 16) | 0x40
    return bits


def write_safetensors(
    path: Path,
    plan: list[PlannedTensor],
    dtype: str,
    *,
    metadata: dict[str, str],
    on_tensor: Callable[[int, PlannedTensor], None] | None = None,
) -> None:
    """Stream `plan` into one safetensors file; `on_tensor(i, planned)` after each is written."""
    code, size = ("F32", 4) if dtype == "float32" else ("BF16", 2)
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for p in plan:
        n = math.prod(p.shape) * (1 if p.stored == "U8" else size)
        header[p.name] = {
            "dtype": p.stored or code,
            "shape": list(p.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for i, (p, w) in enumerate(zip(plan, _weights(plan), strict=True)):
            if p.stored == "U8":
                bits = np.asarray(w, dtype=np.uint8).reshape(p.shape)
            elif dtype == "float32":
                bits = w.astype("<f4")
            else:
                bits = float32_to_bfloat16_bits(w)
            f.write(np.ascontiguousarray(bits).reshape(-1).view(np.uint8))
            if on_tensor:
                on_tensor(i, p)
        f.flush()
        os.fsync(f.fileno())
