"""PyTorch backend: transformers' AutoModelForCausalLM, on CUDA (the product) or the CPU.

Per-layer KV during prefill: the cache is a `PreallocatedCache` (torch_cache.py) whose
`update(k, v, layer_idx)` transformers calls inside layer `layer_idx`'s attention with the
post-RoPE keys; each layer's positions go into one buffer allocated before the forward, so they
keep their address for the whole request. Its hook records an event and hands the piece to the
stager, which copies it (CUDA: a side stream into the node's pinned staging ring, once the
event has completed) and calls `on_layer`. On the CPU, by default, the piece is a view of the
cache handed on at once from the compute thread.
"""

from __future__ import annotations

import bisect
import collections
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from exo_split import families
from exo_split.backends import torch_state
from exo_split.backends.base import Cancelled, OnLayer, Prefilled, serial_decode
from exo_split.backends.staged import StagedBackend
from exo_split.backends.torch_cache import LatentLayer, Mark, PreallocatedCache
from exo_split.backends.torch_staging import (
    DEFAULT_RUN_AHEAD,
    DEFAULT_SLOT_TIMEOUT_S,
    CpuOps,
    CudaOps,
)
from exo_split.errors import BadCheckpoint, ExoSplitError
from exo_split.kv import LayerKV
from exo_split.layers import (
    TRANSPOSED,
    LayerState,
    latent_key_order,
    recurrent_layers,
    state_arrays,
)
from exo_split.spec import ModelSpec, load_quantization, load_spec

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host tensor as numpy in kv.py's storage dtype (bfloat16 -> uint16 words), no copy."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(a: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class TorchBackend(StagedBackend):
    name = "torch"
    quantization = None  # full precision, or a transformers-format MXFP4 checkpoint (load)
    decode = serial_decode  # one step at a time: the prefill side's backend rarely decodes
    stages_in_background = True  # prefill(background=True): see there

    def __init__(self, model, spec: ModelSpec, dtype: str, device: torch.device):
        self.model = model
        self.spec = spec
        self.dtype = dtype
        self.torch_device = device
        self.device = device.type
        # transformers >= 5.2x names the cache argument `cache`; earlier 5.x `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.ops = CudaOps(device) if device.type == "cuda" else CpuOps()
        self.run_ahead = DEFAULT_RUN_AHEAD
        self.slot_timeout = DEFAULT_SLOT_TIMEOUT_S
        self.set_staging()

    def _run(self, ids: torch.Tensor, cache) -> torch.Tensor:
        kwargs = {self._cache_kwarg: cache}
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[0, -1]

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        chunk: int | None = None,
        on_layer: OnLayer | None = None,
        should_stop: Callable[[], bool] | None = None,
        capacity: int | None = None,
        cache: PreallocatedCache | None = None,
        emit_from: int = 0,
        background: bool = False,
    ) -> Prefilled:
        """Returns once every piece was handed to `on_layer`; `Prefilled.computed_at` is when
        the forward itself ended. `background`: returns when the forward has ended, pieces
        the ring's stager thread has not handed on yet going on meanwhile: `Prefilled.staging`
        then has `finish()` (waits for them; raises the staging's error) and `abort()`. Cancellation: `should_stop` is polled as each layer writes its
        KV; the compute thread is then at most `run_ahead` pieces ahead of the device, and this
        raises `Cancelled` once the device has finished that queued work.

        `cache`: resume on a cache that holds the first k positions (prefix reuse): only
        ids[k:] are computed. `emit_from`: `on_layer` sees positions [emit_from, n) only; the
        cached [emit_from, k) of every layer go first, then what is computed."""
        ids = torch.tensor(
            [[int(t) for t in token_ids]], dtype=torch.long, device=self.torch_device
        )
        n = ids.shape[1]
        clock = self.ops.begin()
        if cache is None:
            cache = self.new_cache(max(n, capacity or 0))
        else:
            self.reserve(cache, max(n, capacity or 0))
        k = self.cache_len(cache)
        if not (0 <= emit_from < n and k < n):
            raise ValueError(f"need emit_from ({emit_from}) < n ({n}) and cached k ({k}) < n")
        step = chunk or (n - k)
        stager = self._stager(clock, on_layer, should_stop) if on_layer else None
        if stager is not None and emit_from < k:  # the cached part the receiver lacks
            held = clock.record()
            for layer, lay in enumerate(cache.layers):
                if not torch_state.is_state(lay):  # a state goes once the prompt is in
                    stager.put(layer, emit_from, k - emit_from, held, lay.buffers)
        queued: collections.deque = collections.deque()  # events of the pieces ahead of the device

        def hook(layer: int, start: int, count: int) -> None:  # compute thread
            if should_stop is not None and should_stop():
                raise Cancelled(f"prefill cancelled at layer {layer}")
            event = clock.record()
            cache.marks.append(Mark(layer, start, count, event))
            queued.append(event)
            if len(queued) > self.run_ahead:
                clock.wait(queued.popleft())
            lo = max(start, emit_from)
            if stager is not None and lo < start + count:
                stager.put(layer, lo, start + count - lo, event, cache.layers[layer].buffers)

        last = [False]

        def state_hook(layer: int) -> None:  # compute thread, after a recurrent layer's step
            if should_stop is not None and should_stop():
                raise Cancelled(f"prefill cancelled at layer {layer}")
            if stager is not None and last[0]:  # its state, once the whole prompt is in
                stager.put_ready(self._state_piece(cache, layer, n))

        cache.hook, cache.state_hook = hook, state_hook
        try:
            for start in range(k, n, step):
                last[0] = start + step >= n
                logits = self._run(ids[:, start : start + step], cache)
            end = clock.record()
            logits = logits.float().cpu().numpy()  # waits for the device
            computed_at = clock.seconds(end)
            staging = stager if background and stager is not None and stager.threaded else None
            if stager is not None and staging is None:
                stager.finish()
        except BaseException:
            if stager is not None:
                stager.abort()
            self.ops.drain()  # the queued device work: at most run_ahead pieces
            raise
        finally:
            cache.hook = cache.state_hook = None
        for m in cache.marks:
            if not isinstance(m.at, float):  # this run's events (a reused cache's are seconds)
                m.at = clock.seconds(m.at)
        return Prefilled(cache=cache, logits=logits, computed_at=computed_at, staging=staging)

    @torch.inference_mode()
    def stream_kv(
        self,
        cache: PreallocatedCache,
        on_layer: OnLayer,
        *,
        chunk: int | None = None,
        should_stop: Callable[[], bool] | None = None,
        start_pos: int = 0,
    ) -> None:
        """Hand the cache's KV from `start_pos` on to `on_layer` through the same staging as a
        prefill (for the sequential mode: never more pinned memory than the ring): chunk-major, then layer, in
        token ranges of at most `chunk` positions (and one ring slot). Returns once every piece
        was handed on; `computed_at` is when the prefill computed the piece's last position."""
        n = cache.get_seq_length()
        step = chunk or max(1, n - start_pos)
        clock = self.ops.begin()
        written = clock.record()  # the device has queued every write into the cache before this
        stamps = [([e for e, _ in marks], [t for _, t in marks]) for marks in cache.stamps()]
        stager = self._stager(clock, on_layer, should_stop)
        try:
            for start in range(start_pos, n, step):
                count = min(step, n - start)
                for layer, (ends, ats) in enumerate(stamps):
                    if torch_state.is_state(cache.layers[layer]):  # its state, in the last chunk
                        if start + count == n:
                            stager.put_ready(self._state_piece(cache, layer, n))
                        continue
                    i = bisect.bisect_left(
                        ends, start + count
                    )  # the piece holding the last position
                    at = ats[i] if i < len(ats) else None
                    buffers = cache.layers[layer].buffers
                    stager.put(layer, start, count, written, buffers, computed_at=at)
            stager.finish()
        except BaseException:
            stager.abort()
            raise

    window_keep: tuple[int | None, ...] = ()  # every layer holds every position

    def new_cache(self, capacity: int, *, prompt_len: int | None = None) -> PreallocatedCache:
        """`prompt_len` is accepted and ignored: this cache holds all of every layer."""
        shape = (self.spec.n_kv_heads, max(1, capacity), self.spec.head_dim)
        return PreallocatedCache(self.spec.n_layers, shape, _TORCH_DTYPES[self.dtype],
                                 self.torch_device, adopt=self.ops.adopt,
                                 recurrent=recurrent_layers(self.spec), v_dim=self.spec.v_dim,
                                 key_order=latent_key_order(self.spec))  # fmt: skip

    def _state_piece(self, cache: PreallocatedCache, layer: int, n: int) -> LayerState:
        return torch_state.piece(cache.layers[layer], layer, n, state_arrays(self.spec),
                                 self.dtype, to_numpy, transposed=self._transposed)  # fmt: skip

    @property
    def _transposed(self) -> bool:
        return TRANSPOSED.get(families.family(self.spec.architecture).recurrent or "", False)

    @torch.inference_mode()
    def inject(self, cache: PreallocatedCache, kv: LayerKV | LayerState) -> None:
        if isinstance(kv, LayerState):
            return torch_state.inject(cache.layers[kv.layer], kv, self.torch_device,
                                      _TORCH_DTYPES[self.dtype], from_numpy,
                                      transposed=self._transposed)  # fmt: skip
        k = from_numpy(kv.k, kv.dtype).to(self.torch_device, _TORCH_DTYPES[self.dtype])
        v = from_numpy(kv.v, kv.dtype).to(self.torch_device, _TORCH_DTYPES[self.dtype])
        layer = cache.layers[kv.layer]
        if isinstance(layer, LatentLayer):  # update() takes transformers' order
            v = v[..., layer.order]
        cache.update(k[None], v[None], kv.layer)

    @torch.inference_mode()
    def step(self, cache: PreallocatedCache, token_id: int) -> np.ndarray:
        ids = torch.tensor([[token_id]], dtype=torch.long, device=self.torch_device)
        return self._run(ids, cache).float().cpu().numpy()

    def memory(self) -> dict | None:
        if self.torch_device.type != "cuda":
            return None
        cuda = torch.cuda
        return {"active": cuda.memory_allocated(self.torch_device),
                "cache": cuda.memory_reserved(self.torch_device) - cuda.memory_allocated(self.torch_device),
                "peak": cuda.max_memory_allocated(self.torch_device)}  # fmt: skip

    def close(self) -> None:
        """Nothing is held per thread."""

    def warm(self) -> float:
        """A short prefill and two steps: library initialisation (cuBLAS handles, kernel
        selection) is paid here, not by the first request."""
        t0 = time.perf_counter()
        ids = [t % self.spec.vocab_size for t in range(1, 7)]
        done = self.prefill(ids[:4], capacity=6)
        for token in ids[4:]:
            self.step(done.cache, token)
        return time.perf_counter() - t0

    def export(self, cache: PreallocatedCache) -> list[LayerKV]:
        out = []
        for i, layer in enumerate(cache.layers):
            if torch_state.is_state(layer):
                out.append(self._state_piece(cache, i, self.cache_len(cache)))
                continue
            k, v = layer.keys[0].contiguous().cpu(), layer.values[0].contiguous().cpu()
            out.append(LayerKV(i, 0, to_numpy(k), to_numpy(v), self.dtype))
        return out

    def reuse_floor(self, cache: PreallocatedCache) -> int:
        """A hybrid's cache serves only its whole length (its recurrent layers' state is that
        of every position it holds); any prefix of any other."""
        return self.cache_len(cache) if cache.kv_layers != cache.layers else 0

    def cache_len(self, cache: PreallocatedCache) -> int:
        return min(layer.length for layer in cache.kv_layers)

    # ---- prefix reuse (node/prefix.py): only lengths move, or one copy ----

    def trim(self, cache: PreallocatedCache, n: int) -> None:
        if cache.kv_layers != cache.layers and n != self.cache_len(cache):
            raise ValueError("a recurrent layer's state cannot be cut back to a prefix")
        self._cut(cache, n)

    def snapshot(self, cache: PreallocatedCache) -> list[LayerState]:
        n = self.cache_len(cache)
        return [self._state_piece(cache, i, n).copy() for i, layer in enumerate(cache.layers)
                if torch_state.is_state(layer)]  # fmt: skip

    def restore(self, cache: PreallocatedCache, states: list[LayerState]) -> None:
        for st in states:
            self.inject(cache, st)
        self._cut(cache, states[0].token_start)

    def _cut(self, cache: PreallocatedCache, n: int) -> None:
        for layer in cache.kv_layers:
            if n > layer.length:
                raise ValueError(f"cannot trim a layer of {layer.length} positions to {n}")
            kb, vb = layer.buffers
            layer.length = n
            layer.keys, layer.values = kb[:, :, :n], vb[:, :, :n]
        cache.marks = [m for m in cache.marks if m.start + m.n <= n]

    @torch.inference_mode()
    def reserve(self, cache: PreallocatedCache, capacity: int) -> None:
        """Exactly `capacity` positions for a layer that has fewer (the layer itself would
        double its capacity: a cached entry would keep the unused half)."""
        for layer in cache.kv_layers:
            if layer.capacity < capacity:
                grown = []
                for b in layer.buffers:
                    new = b.new_empty((*b.shape[:2], capacity, b.shape[3]))
                    new[:, :, : layer.length].copy_(b[:, :, : layer.length])
                    self.ops.adopt(new)  # the side stream may read it (CUDA)
                    grown.append(new)
                layer.buffers = tuple(grown)
                layer.keys, layer.values = (b[:, :, : layer.length] for b in layer.buffers)

    @torch.inference_mode()
    def fork(self, cache: PreallocatedCache, n: int, capacity: int) -> PreallocatedCache:
        if cache.kv_layers != cache.layers:
            raise ValueError("a recurrent layer's state cannot be cut back to a prefix")
        out = self.new_cache(max(capacity, n))
        for src, dst in zip(cache.layers, out.layers, strict=True):
            for s, d in zip(src.buffers, dst.buffers, strict=True):
                d[:, :, :n].copy_(s[:, :, :n])
            dst.length = n
            dst.keys, dst.values = (b[:, :, :n] for b in dst.buffers)
        return out

    def cache_nbytes(self, cache: PreallocatedCache) -> int:
        states = sum(layer.nbytes for layer in cache.layers if torch_state.is_state(layer))
        return states + sum(b.numel() * b.element_size() for layer in cache.kv_layers
                            for b in layer.buffers)  # fmt: skip


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise ExoSplitError(
            f"unknown torch device {name!r}", hint="use cpu, cuda or cuda:N"
        ) from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ExoSplitError(
            f"device {name} requested but this torch build sees no CUDA GPU",
            hint="use --device cpu, or install a CUDA build of torch",
        )
    return dev


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load(
    model_dir: str | Path, *, dtype: str | None = None, device: str | None = None
) -> TorchBackend:
    spec = load_spec(model_dir)
    quant = load_quantization(model_dir)
    if quant is not None and quant.format != "transformers":
        raise BadCheckpoint(
            f"{model_dir} holds MLX-quantized weights ({quant.describe()}): the torch backend "
            "runs full-precision checkpoints",
            hint="give the prefill node the original checkpoint; the quantized copy is for "
            "the MLX decode node",
        )
    dtype = dtype or "float32"
    if dtype not in _TORCH_DTYPES:
        raise BadCheckpoint(f"unknown dtype {dtype!r}: expected one of {', '.join(_TORCH_DTYPES)}")
    dev = _device(device or default_device())
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_TORCH_DTYPES[dtype])
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise BadCheckpoint(f"transformers cannot load {model_dir}: {exc}") from exc
    try:
        model.to(dev).eval()
    except (AssertionError, RuntimeError) as exc:  # torch asserts when CUDA is not compiled in
        raise ExoSplitError(f"cannot use device {dev} for the torch backend: {exc}") from exc
    log.info("torch backend: %s on %s in %s", spec.name, dev, dtype)
    backend = TorchBackend(model, spec, dtype, dev)
    backend.quantization = quant  # OpenAI's MXFP4 (transformers' own loader), or None
    return backend
