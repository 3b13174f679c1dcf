"""MLX backend: mlx-lm's model classes and KVCache, loaded from the same HF checkpoint.

The config mlx-lm sees is rebuilt from our canonical ModelSpec: mlx-lm's Llama reads only
the old `rope_theta` / `rope_scaling` keys, while transformers 5 writes `rope_parameters`,
so loading config.json as is would silently run the wrong RoPE.

Received KV is written into preallocated `KVCache`s (room for prompt + max_tokens, in
mlx-lm's own step size) so the first decode steps do not reallocate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model

from exo_split.backends.base import Cancelled, OnLayer, Prefilled
from exo_split.errors import BadCheckpoint
from exo_split.kv import LayerKV
from exo_split.spec import ModelSpec, load_spec

log = logging.getLogger(__name__)

_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def to_numpy(a: mx.array) -> np.ndarray:
    """An MLX array as numpy in kv.py's storage dtype (bfloat16 -> uint16 words)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def from_numpy(a: np.ndarray, dtype: str) -> mx.array:
    if dtype == "bfloat16":
        return mx.array(a).view(mx.bfloat16)
    return mx.array(a)


def _mlx_config(spec: ModelSpec) -> dict:
    """The keys mlx-lm's model classes read, from the canonical spec (overrides config.json)."""
    return {
        "rope_theta": spec.rope_theta,
        "rope_scaling": dict(spec.rope_scaling) or None,
        "rope_parameters": None,
        "head_dim": spec.head_dim,
        "num_key_value_heads": spec.n_kv_heads,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.qkv_bias,
        "max_position_embeddings": spec.max_position_embeddings,
    }


class _StreamingKVCache(KVCache):
    """A KVCache that evaluates and reports each layer's new K/V as soon as it is written.

    MLX is lazy: forcing `mx.eval` here makes layer l's KV real before layer l+1 is built.
    """

    def __init__(self, layer: int, hook: Callable[[int, mx.array, mx.array], None]):
        super().__init__()
        self.layer = layer
        self.hook: Callable | None = hook

    def update_and_fetch(self, keys, values):
        if self.hook is not None:
            self.hook(self.layer, keys, values)
        return super().update_and_fetch(keys, values)


def _round_up(n: int, step: int) -> int:
    return max(step, (n + step - 1) // step * step)


class MLXBackend:
    name = "mlx"

    def __init__(self, model, spec: ModelSpec, dtype: str):
        self.model = model
        self.spec = spec
        self.dtype = dtype
        self.device = "metal" if mx.default_device() == mx.gpu else "cpu"

    def _logits(self, ids: mx.array, cache: list) -> mx.array:
        return self.model(ids, cache=cache)[0, -1]

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        chunk: int | None = None,
        on_layer: OnLayer | None = None,
        should_stop: Callable[[], bool] | None = None,
        capacity: int | None = None,
    ) -> Prefilled:
        n = len(token_ids)
        step = chunk or n
        position = [0]

        def hook(layer: int, k: mx.array, v: mx.array) -> None:
            if should_stop is not None and should_stop():
                raise Cancelled(f"prefill cancelled at layer {layer}")
            if on_layer is not None:
                mx.eval(k, v)
                on_layer(LayerKV(layer, position[0], to_numpy(k[0]), to_numpy(v[0]), self.dtype))

        cache = [_StreamingKVCache(i, hook) for i in range(self.spec.n_layers)]
        if capacity:
            self._preallocate(cache, capacity)
        ids = mx.array([[int(t) for t in token_ids]])
        for start in range(0, n, step):
            position[0] = start
            logits = self._logits(ids[:, start : start + step], cache)
            mx.eval(logits, [(c.keys, c.values) for c in cache])
        for c in cache:
            c.hook = None
        return Prefilled(cache=cache, logits=np.array(logits.astype(mx.float32)))

    def _preallocate(self, cache: list[KVCache], capacity: int) -> None:
        shape = (1, self.spec.n_kv_heads, _round_up(capacity, KVCache.step), self.spec.head_dim)
        for c in cache:
            c.keys = mx.zeros(shape, _MX_DTYPES[self.dtype])
            c.values = mx.zeros(shape, _MX_DTYPES[self.dtype])
        mx.eval([(c.keys, c.values) for c in cache])

    def new_cache(self, capacity: int) -> list[KVCache]:
        cache = [KVCache() for _ in range(self.spec.n_layers)]
        self._preallocate(cache, capacity)
        return cache

    def inject(self, cache: list[KVCache], kv: LayerKV) -> None:
        c = cache[kv.layer]
        if kv.token_start != c.offset:
            raise ValueError(
                f"layer {kv.layer}: piece starts at {kv.token_start}, cache at {c.offset}"
            )
        end = kv.token_start + kv.n_tokens
        if c.keys is None or end > c.keys.shape[2]:
            raise ValueError(f"layer {kv.layer}: {end} positions exceed the preallocated cache")
        mx_dtype = _MX_DTYPES[self.dtype]
        c.keys[..., kv.token_start : end, :] = from_numpy(kv.k, kv.dtype)[None].astype(mx_dtype)
        c.values[..., kv.token_start : end, :] = from_numpy(kv.v, kv.dtype)[None].astype(mx_dtype)
        c.offset = end
        mx.eval(c.keys, c.values)

    def step(self, cache: list[KVCache], token_id: int) -> np.ndarray:
        logits = self._logits(mx.array([[token_id]]), cache)
        return np.array(logits.astype(mx.float32))

    def export(self, cache: list[KVCache]) -> list[LayerKV]:
        out = []
        for i, c in enumerate(cache):
            k, v = c.keys[0, :, : c.offset, :], c.values[0, :, : c.offset, :]
            out.append(LayerKV(i, 0, to_numpy(k), to_numpy(v), self.dtype))
        return out

    def cache_len(self, cache: list[KVCache]) -> int:
        return cache[0].offset


def load(model_dir: str | Path, *, dtype: str = "float32", device: str | None = None) -> MLXBackend:
    spec = load_spec(model_dir)
    if dtype not in _MX_DTYPES:
        raise BadCheckpoint(f"unknown dtype {dtype!r}: expected one of {', '.join(_MX_DTYPES)}")
    if spec.architecture == "qwen2" and spec.head_dim != spec.hidden_size // spec.n_heads:
        raise BadCheckpoint("mlx-lm's qwen2 cannot run a head_dim other than hidden_size / heads")
    if device == "cpu":
        mx.set_default_device(mx.cpu)
    try:
        model, _ = load_model(Path(model_dir), model_config=_mlx_config(spec))
    except (OSError, ValueError, KeyError) as exc:
        raise BadCheckpoint(f"mlx-lm cannot load {model_dir}: {exc}") from exc
    model.set_dtype(_MX_DTYPES[dtype])
    mx.eval(model.parameters())
    log.info("mlx backend: %s on %s in %s", spec.name, mx.default_device(), dtype)
    return MLXBackend(model, spec, dtype)
