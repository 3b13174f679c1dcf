"""MLX backend: mlx-lm's model classes and KVCache, loaded from the same HF checkpoint.

The config mlx-lm sees is rebuilt from our canonical ModelSpec: mlx-lm's Llama reads only
the old `rope_theta` / `rope_scaling` keys, while transformers 5 writes `rope_parameters`,
so loading config.json as is would silently run the wrong RoPE.

Received KV is written into preallocated `KVCache`s (room for prompt + max_tokens, in mlx-lm's
step size): decode steps do not reallocate. Decoding is mlx_decode.py's pipelined loop.

Quantized checkpoints (mlx_lm.convert's, mlx-community's) load as mlx-lm loads them: the scales
stay in their saved dtype, the decode dtype unless one is asked for (bfloat16 scales cast to
float32 would read 12.5% more bytes per step for the same numbers).

Prefill runs as mlx-lm's does: chunks of 2,048 positions (the chunk's activations bound the
memory), logits for the last position only (a 32K prompt never holds [T, vocab] logits), each
layer's K/V evaluated as the layer writes them (a stop acts within one layer of one chunk).
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model

from exo_split import families
from exo_split.backends import mlx_cache, mlx_decode
from exo_split.backends.base import Cancelled, OnLayer, Prefilled
from exo_split.backends.mlx_adapt import (
    exact_embedding_scale,
    latent_norm_eps,
    model_classes,
    short_longrope,
    untruncated_yarn,
)
from exo_split.backends.mlx_batch import Batcher
from exo_split.backends.mlx_cache import StreamingKVCache, evaluated, is_state, streaming
from exo_split.errors import BadCheckpoint
from exo_split.kv import LayerKV, chunk_sizes, window_floor
from exo_split.layers import LINEAR, LayerState
from exo_split.spec import ModelSpec, Quantization, load_quantization, load_spec

log = logging.getLogger(__name__)

_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
PREFILL_CHUNK = 2048  # positions per forward when the request asks for no chunking (mlx-lm's)
clock = time.perf_counter


def to_numpy(a: mx.array) -> np.ndarray:
    """An MLX array as numpy in kv.py's storage dtype (bfloat16 -> uint16 words)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def host_view(a: mx.array) -> np.ndarray:
    """An MLX array as numpy over the same memory (bfloat16 as uint16 words): no copy. The
    view keeps the array's buffer alive; MLX never writes an evaluated array in place."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, copy=False)


def from_numpy(a: np.ndarray, dtype: str) -> mx.array:
    if dtype == "bfloat16":
        return mx.array(a).view(mx.bfloat16)
    return mx.array(a)


def _mlx_config(spec: ModelSpec) -> dict:
    """The keys mlx-lm's model classes read, from the canonical spec (overrides config.json):
    the common ones, then the family's own fields under mlx-lm's names (families.py)."""
    fam = families.family(spec.architecture)
    out = {
        "rope_theta": spec.rope_theta,
        "rope_scaling": _mlx_rope_scaling(spec),
        "rope_parameters": None,
        "head_dim": spec.head_dim,
        "num_key_value_heads": spec.n_kv_heads,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.qkv_bias,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
    }
    for key, value in spec.extras:
        value = fam.mlx_value(key, value) if fam.mlx_value else value
        out[fam.mlx_names.get(key, key)] = list(value) if isinstance(value, tuple) else value
    if spec.sliding_window:
        out["sliding_window"] = spec.sliding_window
    if spec.layer_types:
        out["layer_types"] = list(spec.layer_types)
        if fam.mlx_layer_names:
            out["layer_types"] = [fam.mlx_layer_names[t] for t in spec.layer_types]
        elif fam.recurrent:
            out["full_attention_interval"] = families.window_pattern(
                spec.layer_types, families.LINEAR
            )
        if fam.mlx_pattern:
            out["sliding_window_pattern"] = families.window_pattern(spec.layer_types)
    return out


def _mlx_rope_scaling(spec: ModelSpec) -> dict | None:
    """The canonical rope scaling; mlx-lm's phi3 reads longrope's kind as `type`."""
    scaling = dict(spec.rope_scaling)
    if scaling.get("rope_type") == "longrope":
        scaling["type"] = "longrope"
    return scaling or None


def _starts(first: int, sizes: Sequence[int]) -> list[int]:
    out = [first]
    for size in sizes[:-1]:
        out.append(out[-1] + size)
    return out


def _round_up(n: int, step: int) -> int:
    return max(step, (n + step - 1) // step * step)


def _overrides(model_dir, spec: ModelSpec) -> dict:
    """_mlx_config's keys where mlx-lm reads them: a vision-language checkpoint's text model
    reads its own `text_config`."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if families.TEXT_OF.get(config.get("model_type")) and "text_config" in config:
        return {"text_config": {**config["text_config"], **_mlx_config(spec)}}
    return _mlx_config(spec)


class MLXBackend:
    name = "mlx"

    def __init__(
        self, model, spec: ModelSpec, dtype: str, quantization: Quantization | None = None
    ):
        self.model = model
        self.spec = spec
        self.dtype = dtype
        self.quantization = quantization
        self.device = "metal" if mx.default_device() == mx.gpu else "cpu"
        self.wired_bytes: int | None = None  # Metal's wired limit, once `warm` has set it

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
        cache: list[KVCache] | None = None,
        emit_from: int = 0,
    ) -> Prefilled:
        """Chunks of `chunk` positions (default PREFILL_CHUNK); pieces are zero-copy views of
        each layer's new K/V, handed on from the compute thread. Not views of the cache: a
        view held by the sender would make MLX copy the whole layer buffer at the next chunk's
        update (it writes in place only when nothing else references the buffer). So pieces
        in flight cost their own memory, unbounded on a link slower than the compute.

        `cache`: resume on a cache that holds the first k positions (prefix reuse): only
        ids[k:] are computed, in chunks from k. `emit_from`: `on_layer` sees positions
        [emit_from, n) only; the cached [emit_from, k) of every layer go first (copies)."""
        n = len(token_ids)
        position = [0]

        def hook(layer: int, k: mx.array, v: mx.array) -> None:
            if should_stop is not None and should_stop():
                raise Cancelled(f"prefill cancelled at layer {layer}")
            # MLX is lazy: evaluate up to this layer's K/V now (the next poll: one layer on)
            mx.eval(k, v)
            at = clock()
            cache[layer].computed.append((position[0] + k.shape[2], at))
            skip = max(0, emit_from - position[0])
            if on_layer is not None and skip < k.shape[2]:
                k, v = (k, v) if not skip else (k[:, :, skip:], v[:, :, skip:])
                kv = LayerKV(layer, position[0] + skip, host_view(k[0]), host_view(v[0]),
                             self.dtype, at)  # fmt: skip
                on_layer(kv)

        def state_hook(c) -> None:  # a recurrent layer has consumed a chunk
            if should_stop is not None and should_stop():
                raise Cancelled(f"prefill cancelled at layer {c.layer}")
            mx.eval(c.arrays)
            c.computed.append((c.offset, clock()))
            if on_layer is not None and c.offset == n:  # its state, once, after the prompt
                on_layer(mlx_cache.piece(c, self.spec, self.dtype, host_view, c.computed[-1][1]))

        if cache is None:
            cache = [self._layer(i, lambda i=i: StreamingKVCache(i, hook), state_hook)
                     for i in range(self.spec.n_layers)]  # fmt: skip
            if capacity:
                self._preallocate(cache, capacity)
        else:
            cache = [streaming(c, i, hook, state_hook) for i, c in enumerate(cache)]
            self.reserve(cache, max(n, capacity or 0))
        cached = self.cache_len(cache)
        if not (0 <= emit_from < n and cached < n):
            raise ValueError(f"need emit_from ({emit_from}) < n ({n}) and cached ({cached}) < n")
        if on_layer is not None and emit_from < cached:  # the cached part the receiver lacks
            for i, c in enumerate(cache):
                if is_state(c):
                    continue  # its state goes once the prompt is in
                k, v = (to_numpy(a[0]) for a in c.slots(emit_from, cached))
                on_layer(LayerKV(i, emit_from, k, v, self.dtype, clock()))
        ids = mx.array([[int(t) for t in token_ids]])
        try:
            sizes = self.prefill_chunks(n - cached, chunk)
            for start, size in zip(_starts(cached, sizes), sizes, strict=True):
                position[0] = start
                # mlx-lm's own model, head included (logit scales, soft-caps)
                out = self.model(ids[:, start : start + size], cache=cache)
                if start + size < n:
                    mx.eval(evaluated(cache))
                    mx.clear_cache()  # this chunk's activations, before the next one's
            logits = out[0, -1]  # [vocab]: lazy, so only the last position's are computed
            mx.eval(logits, evaluated(cache))
        finally:
            for c in cache:
                c.hook = None
        computed_at = clock()
        return Prefilled(cache=cache, logits=np.array(logits.astype(mx.float32)),
                         computed_at=computed_at)  # fmt: skip

    def prefill_chunks(self, n_tokens: int, chunk: int | None) -> tuple[int, ...]:
        """The chunks `prefill` emits pieces for (the KV stream's plan announces them): the
        last position alone, as mlx-lm prefills, so its logits are the only ones computed."""
        if n_tokens <= 1:
            return (n_tokens,)
        return (*chunk_sizes(n_tokens - 1, chunk or PREFILL_CHUNK), 1)

    def stream_kv(
        self,
        cache: list[KVCache],
        on_layer: OnLayer,
        *,
        chunk: int | None = None,
        should_stop: Callable[[], bool] | None = None,
        start_pos: int = 0,
    ) -> None:
        """Zero-copy views of the cache from `start_pos` on, chunk-major, then layer, from the
        calling thread."""
        n = cache[0].offset
        step = chunk or max(1, n - start_pos)
        for start in range(start_pos, n, step):
            end = min(start + step, n)
            for i, c in enumerate(cache):
                if should_stop is not None and should_stop():
                    raise Cancelled(f"streaming cancelled at layer {i}")
                if is_state(c):  # its state, in the last chunk
                    if end == n:
                        on_layer(mlx_cache.piece(c, self.spec, self.dtype, host_view, None))
                    continue
                stamps = getattr(c, "computed", [])
                j = bisect.bisect_left([e for e, _ in stamps], end)  # the piece holding end - 1
                at = stamps[j][1] if j < len(stamps) else None
                a, b = start - c.base, end - c.base  # one slice op: a view of the cache
                k, v = c.keys[0, :, a:b], c.values[0, :, a:b]
                on_layer(LayerKV(i, start, host_view(k), host_view(v), self.dtype, at))

    def _preallocate(self, cache: list[KVCache], capacity: int) -> None:
        """Room for positions up to `capacity` (a windowed layer: from its base on)."""
        for c in (c for c in cache if not is_state(c)):
            slots = _round_up(capacity - getattr(c, "base", 0), KVCache.step)
            shape = (1, self.spec.n_kv_heads, slots, self.spec.head_dim)
            c.keys = mx.zeros(shape, _MX_DTYPES[self.dtype])
            c.values = mx.zeros((*shape[:3], self.spec.v_dim), _MX_DTYPES[self.dtype])
        mx.eval(evaluated(cache))

    def _layer(self, i: int, kv_layer, state_hook=None):
        return mlx_cache.new_layer(self.spec, i, kv_layer, self.dtype, state_hook)

    @property
    def window_keep(self) -> tuple[int | None, ...]:
        """What `new_cache(..., prompt_len=n)` keeps of each layer (spec.window_keep)."""
        return self.spec.window_keep

    def new_cache(self, capacity: int, *, prompt_len: int | None = None) -> list[KVCache]:
        """Empty layers with room for `capacity` positions. `prompt_len`: the cache will be
        filled with a prompt of that length (received or injected, not computed here), so a
        sliding layer holds only the window's last positions of it, from its floor on."""
        cache, _ = self.new_cache_parts(capacity, prompt_len=prompt_len)
        self._preallocate(cache, capacity)  # every layer in one evaluation
        return cache

    def new_cache_parts(self, capacity: int, *, prompt_len: int | None = None) -> tuple:
        """new_cache's cache before its memory is, and the jobs that allocate it a layer each
        (run all, in order, before using it): a node decoding others allocates a receiving
        cache between their steps, not in one stall as long as the whole cache's pages."""
        keep = self.window_keep if prompt_len else ()
        cache = [self._layer(i, lambda i=i: StreamingKVCache(i, None, window_floor(keep, i, prompt_len or 0)))
                 for i in range(self.spec.n_layers)]  # fmt: skip
        return cache, [functools.partial(self._preallocate, [c], capacity) for c in cache]

    def reuse_floor(self, cache: list[KVCache]) -> int:
        """The shortest prefix of `cache` a later request may reuse: a windowed layer must
        still hold the window before it (0 when every layer holds every position); a
        recurrent layer's state is that of its whole length, so a hybrid serves only that."""
        if any(map(is_state, cache)):
            return self.cache_len(cache)
        keep = self.window_keep
        return max((c.base + keep[i] for i, c in enumerate(cache) if c.base), default=0)

    def inject(self, cache: list[KVCache], kv: LayerKV | LayerState) -> None:
        c = cache[kv.layer]
        if isinstance(kv, LayerState):
            return mlx_cache.inject(c, kv, self.dtype)
        if kv.token_start != c.offset:
            raise ValueError(
                f"layer {kv.layer}: piece starts at {kv.token_start}, cache at {c.offset}"
            )
        end = kv.token_start + kv.n_tokens
        if c.keys is None or end - c.base > c.keys.shape[2]:
            raise ValueError(f"layer {kv.layer}: {end} positions exceed the preallocated cache")
        mx_dtype = _MX_DTYPES[self.dtype]
        a, b = kv.token_start - c.base, end - c.base
        c.keys[..., a:b, :] = from_numpy(kv.k, kv.dtype)[None].astype(mx_dtype)
        c.values[..., a:b, :] = from_numpy(kv.v, kv.dtype)[None].astype(mx_dtype)
        c.offset = end
        mx.eval(c.keys, c.values)

    def receive_views(self, cache: list[KVCache]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Writable numpy views [n_kv_heads, capacity, head_dim] of each layer's preallocated
        K and V (kv.py's storage dtype: bfloat16 as uint16 words) that alias the cache's own
        memory, so received KV is written in place (node/receive.py). Valid while no MLX op
        touches the cache; `receive_done` ends it."""
        out = []
        for c in cache:
            if is_state(c):
                out.append(mlx_cache.views(c))
                continue
            k, v = c.keys, c.values
            if k.dtype == mx.bfloat16:
                k, v = k.view(mx.uint16), v.view(mx.uint16)
                mx.eval(k, v)
            out.append((np.array(k, copy=False)[0], np.array(v, copy=False)[0]))
        return out

    def receive_bases(self, cache: list[KVCache]) -> list[int]:
        """The position slot 0 of each layer's views holds (0; a windowed layer's floor)."""
        return [c.base for c in cache]

    def receive_done(self, cache: list[KVCache], n_tokens: int) -> None:
        """The first `n_tokens` positions of every layer were written through the views."""
        for c in cache:
            c.offset = n_tokens

    def step(self, cache: list[KVCache], token_id: int) -> np.ndarray:
        logits = self._logits(mx.array([[token_id]]), cache)
        return np.array(logits.astype(mx.float32))

    def decode(self, cache: list[KVCache], first_token: int, **kw):
        """mlx_decode.decode_steps on this model (its keywords)."""
        return mlx_decode.decode_steps(self.model, cache, first_token, **kw)

    def batcher(self) -> Batcher | None:
        """A decode batch for this model (backends/mlx_batch.py); None with sliding or recurrent
        layers (each such request decodes on its own)."""
        if any(k is not None for k in self.window_keep) or LINEAR in self.spec.layer_types:
            return None
        return Batcher(self.model, lambda i: StreamingKVCache(i, None))

    def memory(self) -> dict:
        return {"active": mx.get_active_memory(), "cache": mx.get_cache_memory(),
                "peak": mx.get_peak_memory()}  # fmt: skip

    def close(self) -> None:
        """On the compute thread, before it exits: MLX's streams go cleanly."""
        mlx_decode.release_thread()

    def warm(self) -> float:
        """Wire Metal's memory (once), then run the decode loop on scratch caches."""
        self.wired_bytes = mlx_decode.wire_memory(self.model)
        return mlx_decode.warm_decode(self.model, self.spec, _MX_DTYPES[self.dtype])

    def export(self, cache: list[KVCache]) -> list[LayerKV]:
        out = []
        for i, c in enumerate(cache):
            if is_state(c):
                out.append(mlx_cache.piece(c, self.spec, self.dtype, to_numpy, None))
                continue
            k, v = c.slots(c.base, c.offset)
            out.append(LayerKV(i, c.base, to_numpy(k[0]), to_numpy(v[0]), self.dtype))
        return out

    def cache_len(self, cache: list[KVCache]) -> int:
        return min(c.offset for c in cache)

    # ---- prefix reuse (node/prefix.py): only offsets move, or one copy ----

    def trim(self, cache: list[KVCache], n: int) -> None:
        for c in cache:
            if is_state(c) and n != c.offset:
                c.trim(c.offset - n)  # only a last step can be taken back (ValueError)
            if not c.base <= n <= c.offset:
                raise ValueError(f"cannot trim a layer of positions [{c.base}, {c.offset}) to {n}")
            c.offset = n  # the bytes past it stay, to be overwritten by the next write
            if isinstance(c, StreamingKVCache):
                c.computed = [(e, t) for e, t in c.computed if e <= n]

    def reserve(self, cache: list[KVCache], capacity: int) -> None:
        """Room for `capacity` positions: one copy of each layer that is smaller (mlx-lm
        would grow 256 positions at a time, a copy each)."""
        grew = []
        for c in (c for c in cache if not is_state(c)):
            held = c.offset - c.base  # slots in use
            if c.keys is not None and c.keys.shape[2] >= capacity - c.base:
                continue
            old = (c.keys, c.values)
            self._preallocate([c], capacity)
            if old[0] is not None and held:
                c.keys[..., :held, :] = old[0][..., :held, :]
                c.values[..., :held, :] = old[1][..., :held, :]
            grew.append(c)
        if grew:
            mx.eval(evaluated(grew))

    def fork(self, cache: list[KVCache], n: int, capacity: int) -> list[KVCache]:
        if any(map(is_state, cache)):
            raise ValueError("a recurrent layer's state cannot be cut back to a prefix")
        out = [StreamingKVCache(i, None, c.base) for i, c in enumerate(cache)]
        self._preallocate(out, max(capacity, n))
        for src, dst in zip(cache, out, strict=True):
            k, v = src.slots(src.base, n)
            dst.keys[..., : n - src.base, :] = k
            dst.values[..., : n - src.base, :] = v
            dst.offset = n
        mx.eval([(c.keys, c.values) for c in out])  # no view of the source outlives this
        return out

    def snapshot(self, cache: list[KVCache]) -> list[LayerState]:
        return [
            mlx_cache.piece(c, self.spec, self.dtype, to_numpy, None) for c in cache if is_state(c)
        ]

    def restore(self, cache: list[KVCache], states: list[LayerState]) -> None:
        for st in states:  # copied in: a later receive writes into the arrays in place
            mlx_cache.inject(cache[st.layer], st, self.dtype)
        self.trim(cache, states[0].token_start)

    def cache_nbytes(self, cache: list[KVCache]) -> int:
        return sum(c.nbytes if is_state(c) else c.keys.nbytes + c.values.nbytes
                   for c in cache if is_state(c) or c.keys is not None)  # fmt: skip


def load(
    model_dir: str | Path, *, dtype: str | None = None, device: str | None = None
) -> MLXBackend:
    """dtype None: float32, or for a quantized checkpoint the dtype of its scales."""
    spec = load_spec(model_dir)
    quant = load_quantization(model_dir)
    if dtype is None:
        dtype = (quant.scales_dtype if quant else None) or "float32"
    if dtype not in _MX_DTYPES:
        raise BadCheckpoint(f"unknown dtype {dtype!r}: expected one of {', '.join(_MX_DTYPES)}")
    if spec.architecture == "qwen2" and spec.head_dim != spec.hidden_size // spec.n_heads:
        raise BadCheckpoint("mlx-lm's qwen2 cannot run a head_dim other than hidden_size / heads")
    if device == "cpu":
        mx.set_default_device(mx.cpu)
    try:
        model, _ = load_model(
            Path(model_dir),
            model_config=_overrides(model_dir, spec),
            get_model_classes=model_classes,
        )
    except (OSError, ValueError, KeyError) as exc:
        raise BadCheckpoint(f"mlx-lm cannot load {model_dir}: {exc}") from exc
    if quant is not None and quant.scales_dtype in (None, dtype):
        _cast_unquantized(model, _MX_DTYPES[dtype])
    else:  # full precision, or scales asked to change dtype: everything follows
        model.set_dtype(_MX_DTYPES[dtype])
    exact_embedding_scale(model, spec, dtype)
    untruncated_yarn(model, spec)
    short_longrope(model, spec)
    latent_norm_eps(model, spec)
    mx.eval(model.parameters())
    what = quant.describe() if quant else "full precision"
    log.info("mlx backend: %s on %s in %s (%s)", spec.name, mx.default_device(), dtype, what)
    return MLXBackend(model, spec, dtype, quant)


def _cast_unquantized(model, dtype: mx.Dtype) -> None:
    """set_dtype for every floating parameter but the quantization scales and biases."""
    params = tree_flatten(model.parameters())
    model.update(tree_unflatten([
        (k, v.astype(dtype)) for k, v in params
        if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases"))
    ]))  # fmt: skip
