"""PyTorch backend: transformers' AutoModelForCausalLM, on CUDA (the product) or the CPU.

Per-layer KV during prefill comes from a DynamicCache subclass: transformers calls
`cache.update(k, v, layer_idx)` inside layer `layer_idx`'s attention, with the post-RoPE
keys, so each layer's KV is handed on before the next layer runs. On CUDA that call
happens when the work is *enqueued*, not done: the copy to host is gated by an event on a
side stream, into pinned memory, and handed on from a drainer thread only once complete.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from exo_split.backends.base import Cancelled, OnLayer, Prefilled
from exo_split.errors import BadCheckpoint, ExoSplitError
from exo_split.kv import LayerKV
from exo_split.spec import ModelSpec, load_spec

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


class _StreamingCache(DynamicCache):
    """A DynamicCache that reports every (layer, chunk) K/V the moment the layer writes it."""

    def __init__(self, hook: Callable[[int, torch.Tensor, torch.Tensor], None] | None):
        super().__init__()
        self.hook = hook

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.hook is not None:
            self.hook(layer_idx, key_states, value_states)
        return out


class _HostCopier:
    """Moves each piece of KV to host memory and hands it to `on_layer`.

    CPU: a plain view, handed on synchronously. CUDA: record an event on the compute
    stream, copy on a side stream into pinned buffers, and hand the piece on from a
    drainer thread after the copy's event has completed (never before).
    """

    def __init__(self, device: torch.device, dtype: str, on_layer: OnLayer):
        self.dtype = dtype
        self.on_layer = on_layer
        self.cuda = device.type == "cuda"
        self.error: BaseException | None = None
        if self.cuda:
            self.side = torch.cuda.Stream(device=device)
            self.pending: queue.Queue = queue.Queue()
            self.thread = threading.Thread(target=self._drain, name="kv-d2h", daemon=True)
            self.thread.start()

    def submit(self, layer: int, token_start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k[0], v[0]  # [H, T, D]
        if not self.cuda:
            kv = LayerKV(
                layer, token_start, to_numpy(k.contiguous()), to_numpy(v.contiguous()), self.dtype
            )
            self.on_layer(kv)
            return
        if self.error is not None:
            raise self.error
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(k.device))
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)
            kh = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
            vh = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            kh.copy_(k, non_blocking=True)
            vh.copy_(v, non_blocking=True)
            # The compute stream may free k/v before the side stream has read them.
            k.record_stream(self.side)
            v.record_stream(self.side)
            done = torch.cuda.Event()
            done.record(self.side)
        self.pending.put((done, layer, token_start, kh, vh))

    def _drain(self) -> None:
        while True:
            item = self.pending.get()
            if item is None:
                return
            done, layer, token_start, kh, vh = item
            done.synchronize()
            if self.error is not None:
                continue
            try:
                self.on_layer(LayerKV(layer, token_start, to_numpy(kh), to_numpy(vh), self.dtype))
            except BaseException as exc:  # re-raised on the prefill thread
                self.error = exc

    def close(self) -> None:
        if self.cuda:
            self.pending.put(None)
            self.thread.join()
        if self.error is not None:
            raise self.error


class TorchBackend:
    name = "torch"

    def __init__(self, model, spec: ModelSpec, dtype: str, device: torch.device):
        self.model = model
        self.spec = spec
        self.dtype = dtype
        self.torch_device = device
        self.device = device.type
        # transformers >= 5.2x names the cache argument `cache`; earlier 5.x `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _run(self, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
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
    ) -> Prefilled:
        ids = torch.tensor(
            [[int(t) for t in token_ids]], dtype=torch.long, device=self.torch_device
        )
        n = ids.shape[1]
        step = chunk or n
        copier = _HostCopier(self.torch_device, self.dtype, on_layer) if on_layer else None
        position = [0]

        def hook(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            if should_stop is not None and should_stop():
                raise Cancelled(f"prefill cancelled at layer {layer}")
            if copier is not None:
                copier.submit(layer, position[0], k, v)

        cache = _StreamingCache(hook)
        try:
            for start in range(0, n, step):
                position[0] = start
                logits = self._run(ids[:, start : start + step], cache)
            logits = logits.float().cpu().numpy()
        finally:
            cache.hook = None
            if copier is not None:
                copier.close()
        return Prefilled(cache=cache, logits=logits)

    def new_cache(self, capacity: int) -> DynamicCache:
        return DynamicCache()

    @torch.inference_mode()
    def inject(self, cache: DynamicCache, kv: LayerKV) -> None:
        k = from_numpy(kv.k, kv.dtype).to(self.torch_device, _TORCH_DTYPES[self.dtype])
        v = from_numpy(kv.v, kv.dtype).to(self.torch_device, _TORCH_DTYPES[self.dtype])
        cache.update(k[None], v[None], kv.layer)

    @torch.inference_mode()
    def step(self, cache: DynamicCache, token_id: int) -> np.ndarray:
        ids = torch.tensor([[token_id]], dtype=torch.long, device=self.torch_device)
        return self._run(ids, cache).float().cpu().numpy()

    def export(self, cache: DynamicCache) -> list[LayerKV]:
        out = []
        for i, layer in enumerate(cache.layers):
            k, v = layer.keys[0].contiguous().cpu(), layer.values[0].contiguous().cpu()
            out.append(LayerKV(i, 0, to_numpy(k), to_numpy(v), self.dtype))
        return out

    def cache_len(self, cache: DynamicCache) -> int:
        return cache.get_seq_length()


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
    model_dir: str | Path, *, dtype: str = "float32", device: str | None = None
) -> TorchBackend:
    spec = load_spec(model_dir)
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
    return TorchBackend(model, spec, dtype, dev)
