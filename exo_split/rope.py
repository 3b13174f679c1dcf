"""RoPE scaling: the canonical form of a config's rope settings, and the refusals where the
two libraries would compute different rotations from the same file (no torch or mlx here).

transformers and mlx-lm each implement llama3, linear and YaRN scaling; this module accepts a
setting only where both give the same frequencies and scale:
- YaRN: mlx-lm derives the attention scale from mscale / mscale_all_dim; transformers takes
  `attention_factor` when given and uses mscale only when both are set: compared, and refused
  if the two disagree. A missing `factor` is derived as transformers derives it. mlx-lm
  always truncates the correction range, transformers unless `truncate` is false (gpt-oss):
  `truncate: false` stays in the canonical form (it changes the maths) and the MLX backend
  recomputes the frequencies without truncating (backends/mlx_adapt.py).
- longrope (Phi-3.5/4-mini, Phi-3-128k): transformers rotates with the short factors while a
  forward's last position is within original_max_position_embeddings and with the long ones
  for a whole forward past it (so there its result depends on how the prompt is chunked);
  mlx-lm always with the long ones. Run with the short factors on both sides (the MLX
  backend swaps them in: backends/mlx_adapt.py), up to original_max_position_embeddings
  positions (`limit`): a longer request is refused. The attention factor is compared as
  YaRN's is.
- dynamic: the frequencies change with the length in transformers: refused.
"""

from __future__ import annotations

import math
from typing import Any

from exo_split.errors import BadCheckpoint

KEYS = (
    "rope_type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "short_factor",
    "long_factor",
)
SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope")
_WHY_NOT = {
    "dynamic": "dynamic NTK scaling changes the frequencies with the length in transformers",
}


def canonical(merged: dict[str, Any], *, max_position_embeddings: int) -> dict[str, Any]:
    """The rope_scaling fields that matter, checked ({} for plain RoPE)."""
    if "type" in merged and "rope_type" not in merged:
        merged = {**merged, "rope_type": merged["type"]}
    scaling = {k: merged[k] for k in KEYS if merged.get(k) is not None}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return {}
    if rope_type not in SUPPORTED:
        why = _WHY_NOT.get(rope_type, "")
        raise BadCheckpoint(
            f"unsupported rope type {rope_type!r}: exo-split supports {', '.join(SUPPORTED)}"
            + (f" ({why})" if why else "")
        )
    if rope_type == "yarn":
        scaling = _yarn(scaling, max_position_embeddings)
    if rope_type == "longrope":
        scaling = _longrope(scaling, max_position_embeddings)
    return scaling


def limit(scaling: dict[str, Any]) -> int | None:
    """The most positions a request may reach with this scaling (None: no limit of its own):
    longrope's short factors hold up to original_max_position_embeddings."""
    if scaling.get("rope_type") == "longrope":
        return int(scaling["original_max_position_embeddings"])
    return None


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(s: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        if s.get(key) is None:
            raise BadCheckpoint(f"longrope rope scaling without {key}")
    s["short_factor"], s["long_factor"] = (tuple(float(x) for x in s[k])
                                           for k in ("short_factor", "long_factor"))  # fmt: skip
    original = s["original_max_position_embeddings"]
    # transformers: attention_factor, else derived from factor, else from the context ratio;
    # mlx-lm's phi3 always derives it from the context ratio
    ratio = max_position_embeddings / original
    factor = s.pop("factor", None) or ratio
    theirs = s.pop("attention_factor", None)
    if theirs is None:
        theirs = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ours = 1.0 if ratio <= 1 else math.sqrt(1 + math.log(ratio) / math.log(original))
    if not math.isclose(ours, theirs, rel_tol=1e-9):
        raise BadCheckpoint(
            f"longrope attention scale: transformers uses {theirs:.6g}, mlx-lm would use "
            f"{ours:.6g} (attention_factor / factor against max_position_embeddings)"
        )
    return s


def _yarn(s: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    if "original_max_position_embeddings" not in s:
        raise BadCheckpoint("YaRN rope scaling without original_max_position_embeddings")
    if s.get("factor") is None:
        s["factor"] = max_position_embeddings / s["original_max_position_embeddings"]
    if s.get("truncate", True) is not False:
        s.pop("truncate", None)  # truncating is the default: absent, as in older files
    factor, mscale, all_dim = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    theirs = s.get("attention_factor")
    if theirs is None:
        theirs = (
            _mscale(factor, mscale) / _mscale(factor, all_dim)
            if mscale and all_dim
            else _mscale(factor)
        )
    ours = _mscale(factor, mscale if mscale is not None else 1.0) / _mscale(factor, all_dim or 0.0)
    if not math.isclose(ours, theirs, rel_tol=1e-9):
        raise BadCheckpoint(
            f"YaRN attention scale: transformers uses {theirs:.6g}, mlx-lm would use "
            f"{ours:.6g} (attention_factor / mscale / mscale_all_dim)"
        )
    s.pop("attention_factor", None)  # equal to what both derive: not a setting of its own
    return s
