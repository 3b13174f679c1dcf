"""Backends by name, imported lazily: a Mac never imports torch, a CUDA box never imports mlx."""

from __future__ import annotations

import importlib
from pathlib import Path

from exo_split.backends.base import Backend, Cancelled, DecodeStats, OnLayer, Prefilled
from exo_split.errors import ExoSplitError

BACKENDS = ("torch", "mlx", "vllm")
_MODULES = {
    "torch": "exo_split.backends.torch_backend",
    "mlx": "exo_split.backends.mlx_backend",
    "vllm": "exo_split.backends.vllm_backend",
}
_EXTRAS = {
    "torch": "pip install 'exo-split[torch]'",
    "mlx": "pip install 'exo-split[mlx]'",
    "vllm": "pip install 'exo-split[torch,vllm]' (docs/vllm.md)",
}

__all__ = [
    "BACKENDS",
    "Backend",
    "Cancelled",
    "DecodeStats",
    "OnLayer",
    "Prefilled",
    "load_backend",
]


def load_backend(
    name: str, model_dir: str | Path, *, dtype: str | None = None, device: str | None = None
) -> Backend:
    """Load `model_dir` into the backend called `name` ("torch" or "mlx"). dtype None: the
    backend's default for the checkpoint (float32; a quantized one: its scales' dtype)."""
    if name not in _MODULES:
        raise ExoSplitError(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")
    try:
        module = importlib.import_module(_MODULES[name])
    except ImportError as exc:
        raise ExoSplitError(
            f"the {name} backend is not installed ({exc.name or exc} missing)", hint=_EXTRAS[name]
        ) from exc
    return module.load(model_dir, dtype=dtype, device=device)
