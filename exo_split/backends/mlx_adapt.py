"""Where mlx-lm's module of a family computes other numbers than transformers from the same
checkpoint, and the difference can be made up exactly after (or while) loading it.

Each fix is checked against transformers in tests/test_families.py; what cannot be made up
is refused in families.py instead.
- Gemma's embedding scale: rounded to bfloat16 by mlx-lm, to the weights' dtype by
  transformers (`exact_embedding_scale`).
- YaRN with `truncate: false` (gpt-oss): mlx-lm always floors/ceils the correction range;
  the frequencies are recomputed without it (`untruncated_yarn`).
- gpt-oss experts saved by transformers 5 ([experts, in, out], gate and up interleaved):
  mlx-lm's sanitize expects OpenAI's [experts, out, in] (`model_classes`).
- Qwen3.5 MoE experts saved one matrix each by transformers 5: mlx-lm's sanitize expects
  them fused; they are stacked into its SwitchGLU's layout (`model_classes`).
- longrope (Phi-3.5/4-mini): mlx-lm rotates with the long factors at every length,
  transformers with the short ones up to original_max_position_embeddings, as far as
  exo-split runs it (rope.py): the short ones are swapped in (`short_longrope`).
- GLM-4.7-Flash's latent and low-rank query norms: transformers' epsilon is 1e-6, mlx-lm
  takes rms_norm_eps (`latent_norm_eps`).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import SuScaledRoPE, YarnRoPE
from mlx_lm.utils import _get_classes

from exo_split import families
from exo_split.spec import ModelSpec

_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class _RescaledEmbedding(nn.Module):
    """An embedding whose lookups are multiplied by `factor` (the output head, through
    `as_linear`, is not): see `exact_embedding_scale`."""

    def __init__(self, inner: nn.Module, factor: float):
        super().__init__()
        self.inner = inner
        self.factor = factor

    def __call__(self, x):
        return self.inner(x) * self.factor

    def as_linear(self, x):
        return self.inner.as_linear(x)


def exact_embedding_scale(model, spec: ModelSpec, dtype: str) -> None:
    """Gemma multiplies its embeddings by sqrt(hidden_size): transformers rounds the factor to
    the weights' dtype, mlx-lm always to bfloat16 (sqrt(640) = 25.298 becomes 25.25), which
    in float32 moves Gemma 3 270M's logits by up to 0.4. The lookups are rescaled by the ratio
    so that both sides compute transformers' numbers (in bfloat16 the ratio is 1)."""
    rounded_as = families.family(spec.architecture).mlx_embed_scale_dtype
    if rounded_as is None:
        return
    root = spec.hidden_size**0.5
    ours = mx.array(root, _MX_DTYPES[dtype]).astype(mx.float32).item()
    theirs = mx.array(root, _MX_DTYPES[rounded_as]).astype(mx.float32).item()
    if ours != theirs:
        inner = model.model
        inner.embed_tokens = _RescaledEmbedding(inner.embed_tokens, ours / theirs)


def latent_norm_eps(model, spec: ModelSpec) -> int:
    """GLM-4.7-Flash: transformers normalizes the latent and the query's low-rank projection
    with an epsilon of 1e-6, mlx-lm's glm4_moe_lite with rms_norm_eps (1e-5 in its config):
    those norms get transformers' epsilon. Returns how many changed."""
    eps = families.family(spec.architecture).latent_norm_eps
    if eps is None:
        return 0
    changed = 0
    for _, module in model.named_modules():
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            norm = getattr(module, name, None)
            if isinstance(norm, nn.RMSNorm):
                norm.eps = eps
                changed += 1
    return changed


def yarn_freqs(
    dims: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    *,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> np.ndarray:
    """A YaRN rope's wavelengths per rotated pair (mlx-lm's `_freqs`, 1 / inv_freq): each
    pair's frequency is blended between the original and the `factor`-interpolated one by a
    ramp over the correction range, whose ends are rounded outwards when `truncate`."""

    def dim_of(rotations: float) -> float:
        ratio = original_max_position_embeddings / (rotations * 2 * math.pi)
        return dims * math.log(ratio) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    wavelength = base ** (np.arange(0, dims, 2, dtype=np.float32) / dims)
    inv = (1 - ramp) / wavelength + ramp / (factor * wavelength)
    return (1 / inv).astype(np.float32)


def untruncated_yarn(model, spec: ModelSpec) -> int:
    """Give every YarnRoPE of the model the frequencies of an untruncated correction range when
    the checkpoint says `truncate: false`; returns how many modules changed."""
    s = dict(spec.rope_scaling)
    if s.get("rope_type") != "yarn" or s.get("truncate", True):
        return 0
    changed = 0
    for _, module in model.named_modules():
        if isinstance(module, YarnRoPE):
            module._freqs = mx.array(yarn_freqs(
                module.dims, spec.rope_theta, float(s["factor"]),
                int(s["original_max_position_embeddings"]),
                beta_fast=float(s.get("beta_fast", 32.0)), beta_slow=float(s.get("beta_slow", 1.0)),
                truncate=False,
            ))  # fmt: skip
            changed += 1
    return changed


def short_longrope(model, spec: ModelSpec) -> int:
    """Give every SuScaledRoPE of the model longrope's short factors (mlx-lm builds it with
    the long ones); its attention scale already is transformers' (rope.py compares them).
    Returns how many modules changed."""
    s = dict(spec.rope_scaling)
    if s.get("rope_type") != "longrope":
        return 0
    changed = 0
    for _, module in model.named_modules():
        if isinstance(module, SuScaledRoPE):
            dims = np.arange(0, module.dim, 2, dtype=np.float32) / module.dim
            wavelength = np.float32(spec.rope_theta) ** dims
            module._freqs = mx.array(np.asarray(s["short_factor"], np.float32) * wavelength)
            changed += 1
    return changed


def _gpt_oss_from_transformers(weights: dict) -> dict:
    """transformers 5 keeps gpt-oss's experts as [experts, in, out] matrices (x @ W), gate
    and up interleaved in gate_up_proj's last axis; mlx-lm's sanitize takes OpenAI's
    [experts, out, in] and splits the interleaving itself. Transposed here, exactly."""
    out = {}
    for key, value in weights.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            key, value = f"{key}.weight", mx.contiguous(value.swapaxes(-1, -2))
        out[key] = value
    return out


def _stacked_experts(weights: dict) -> dict:
    """Experts saved one matrix each (`mlp.experts.E.gate_proj.weight`, transformers 5's
    qwen3_5_moe_text) as mlx-lm's SwitchGLU holds them: stacked, `mlp.switch_mlp.*`."""
    out, groups = {}, {}
    for key, value in weights.items():
        head, sep, tail = key.partition(".mlp.experts.")
        index, _, proj = tail.partition(".")
        if sep and index.isdigit() and proj.endswith("_proj.weight"):
            groups.setdefault((head, proj), {})[int(index)] = value
        else:
            out[key] = value
    for (head, proj), by_index in groups.items():
        out[f"{head}.mlp.switch_mlp.{proj}"] = mx.stack([by_index[i] for i in sorted(by_index)])
    return out


def model_classes(config: dict):
    """mlx-lm's (Model, ModelArgs) for a config, with the weight translations above."""
    model_type = config.get("model_type") or ""
    fam = families.family(families.TEXT_OF.get(model_type, model_type))
    module = fam.mlx_module if fam is not None else None
    model_class, args_class = _get_classes({**config, "model_type": module} if module else config)
    if module == "qwen3_5_moe":

        class Qwen35MoeFromTransformers(model_class):
            def sanitize(self, weights):
                return super().sanitize(_stacked_experts(weights))

        return Qwen35MoeFromTransformers, args_class
    if config.get("model_type") != "gpt_oss":
        return model_class, args_class

    class GptOssFromTransformers(model_class):
        def sanitize(self, weights):
            if any(k.endswith("experts.gate_up_proj") for k in weights):
                weights = _gpt_oss_from_transformers(weights)
            return super().sanitize(weights)

    return GptOssFromTransformers, args_class
