"""The vLLM connector's request side, without vLLM: a prefill job's pieces in plan order, and
the gathers out of vLLM's paged KV layouts (torch and numpy only, so the tests of the main
environment run them). vllm_connector.py, which vLLM loads, calls into this.

A piece may need positions that vLLM did not compute in the step that completes it: its
prefix cache hit (blocks other requests computed) or earlier chunks. They are all in the
request's blocks, so a piece is gathered whenever its layer holds every position of it, in
plan order (chunk-major, then layer): the plan depends neither on vLLM's cache hit nor on how
it chunks. Gathering copies the piece out of the paged cache (the blocks are freed once the
request finishes); handing it on only queues frames, so the forward never waits for the
network. Nothing raised here reaches vLLM's forward: a job's failure is kept and re-raised
by the backend after the step.

Layouts (`layout_of`): the CPU attention backend ("vec" ISA) keeps a layer as
[blocks, kv_heads, block_size, 2 * head_dim], K of each (block, head) transposed as
[head_dim, block_size] in the first half, V as [block_size, head_dim] in the second;
FlashAttention/FlashInfer on CUDA as [2, blocks, block_size, kv_heads, head_dim] (NHD) or
[2, blocks, kv_heads, block_size, head_dim] (HND). Others are refused.

An fp8 KV cache (vLLM's kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2) keeps the same layouts in
bytes: a gather reads them as that float8 format, times the layer's scale (vLLM stores
value / scale), in the engine's dtype: the decode node gets plain KV (`Dequant`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from exo_split.kv import LayerKV, bf16_words_from_float32

JOB_KEY = "exo_split_job"
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_JOBS: dict[str, Job] = {}
_LOCK = threading.Lock()


@dataclass
class Job:
    """One prefill's pieces, in plan order: (layer, start, n_tokens). `on_piece` gets each
    gathered LayerKV (any thread that calls it must not block: the frame sender queues)."""

    pieces: list[tuple[int, int, int]]
    on_piece: Callable[[LayerKV], None]
    dtype: str  # the pieces' storage dtype (kv.py): the decode node's
    should_stop: Callable[[], bool] = lambda: False
    layout: str = ""
    # (layer, start, k, v) of a gathered piece still on the device ([heads, n, dim]): the
    # backend's staging ring copies it to host memory off the forward (CUDA); None: gathered
    # to host memory here and handed to on_piece.
    stage: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None
    error: BaseException | None = None
    next_piece: int = 0
    # Per layer: positions [0, ready) are in the paged cache; the layer's tensor; the blocks.
    ready: dict[int, int] = field(default_factory=dict)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    blocks: list[int] = field(default_factory=list)
    block_size: int = 0
    saves: list[tuple[int, int, int]] = field(default_factory=list)  # (layer, a, b) per hook
    dequant: dict[int, Dequant] = field(default_factory=dict)  # per layer, an fp8 cache's

    @property
    def done(self) -> bool:
        return self.next_piece >= len(self.pieces)

    def layer_saved(self, layer: int, tensor: torch.Tensor, blocks: list[int], a: int, b: int,
                    block_size: int) -> None:  # fmt: skip
        self.saves.append((layer, a, b))
        if self.error is not None:
            return
        self.ready[layer], self.tensors[layer] = b, tensor
        self.blocks, self.block_size = blocks, block_size
        try:
            if self.should_stop():
                raise Cancelled("prefill cancelled")
            self._emit()
        except BaseException as exc:  # kept for the backend: never into vLLM's forward
            self.error = exc

    def _emit(self) -> None:
        while not self.done:
            layer, start, n = self.pieces[self.next_piece]
            if self.ready.get(layer, 0) < start + n:
                return
            k, v = gather(self.tensors[layer], self.layout, self.blocks, self.block_size,
                          start, start + n, host=self.stage is None,
                          dequant=self.dequant.get(layer), dtype=self.dtype)  # fmt: skip
            if self.stage is not None:
                self.stage(layer, start, k, v)
            else:
                self.on_piece(LayerKV(layer, start, _stored(k, self.dtype),
                                      _stored(v, self.dtype), self.dtype))  # fmt: skip
            self.next_piece += 1


@dataclass(frozen=True)
class Dequant:
    """How one layer's fp8 KV cache reads back: its float8 format and K's and V's scales."""

    fmt: torch.dtype
    k_scale: float
    v_scale: float


class Cancelled(Exception):
    """The job's should_stop said stop (the backend raises base.Cancelled for it)."""


def register(job_id: str, job: Job) -> None:
    with _LOCK:
        _JOBS[job_id] = job


def unregister(job_id: str) -> None:
    with _LOCK:
        _JOBS.pop(job_id, None)


def lookup(job_id: str | None) -> Job | None:
    with _LOCK:
        return _JOBS.get(job_id) if job_id is not None else None


def layout_of(backend_name: str, isa: str | None, shape: tuple[int, ...], n_kv_heads: int,
              head_dim: int, dtype: str = "float32", cache_dtype: str = "auto") -> str:  # fmt: skip
    """The paged layout of one attention layer's KV tensor, from vLLM's attention backend
    (its name), the CPU backend's ISA, the tensor's shape and dtype, and vLLM's
    kv_cache_dtype (fp8 ones read as bytes); ValueError if not one we read."""
    fp8 = cache_dtype in FP8 and dtype in ("uint8", str(FP8[cache_dtype]).removeprefix("torch."))
    if dtype not in ("float32", "float16", "bfloat16") and not fp8:
        raise ValueError(
            f"vLLM keeps its KV cache as {dtype} (kv_cache_dtype {cache_dtype}): exo-split "
            f"reads float32, float16, bfloat16 and fp8 ({', '.join(FP8)}) caches only"
        )
    if backend_name == "CPU_ATTN":
        if isa != "vec":
            raise ValueError(
                f"vLLM's CPU attention uses the {isa!r} kernels, whose KV cache layout exo-split "
                "has not been checked against (only 'vec'): run it in float32 or float16"
            )
        if len(shape) == 4 and shape[1] == n_kv_heads and shape[3] == 2 * head_dim:
            return "cpu_vec"
    elif backend_name in ("FLASH_ATTN", "FLASHINFER") and len(shape) == 5 and shape[0] == 2:
        if shape[2] != n_kv_heads and shape[3] == n_kv_heads and shape[4] == head_dim:
            return "nhd"
        if shape[2] == n_kv_heads and shape[4] == head_dim:
            return "hnd"
    raise ValueError(
        f"vLLM's {backend_name} attention keeps its KV as {list(shape)}: not a layout exo-split "
        f"reads ({n_kv_heads} KV heads of {head_dim})"
    )


def gather(tensor: torch.Tensor, layout: str, blocks: list[int], block_size: int, a: int,
           b: int, *, host: bool = True, dequant: Dequant | None = None,
           dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """K and V of positions [a, b) as [kv_heads, b - a, head_dim] tensors in the cache's dtype
    (an fp8 cache, `dequant`: its values times its scales, in `dtype`), copied out of the
    paged cache (the blocks holding them only): on the host, or (`host` False) still on the
    cache's device, contiguous, queued on the current stream."""
    first, last = a // block_size, (b - 1) // block_size + 1
    ids = torch.tensor(blocks[first:last], dtype=torch.long, device=tensor.device)
    off = a - first * block_size
    if layout == "cpu_vec":
        sel = tensor.index_select(0, ids)  # [nb, H, bs, 2 D]
        nb, heads, bs, two_d = sel.shape
        halves = sel.view(nb, heads, 2 * bs, two_d // 2)
        k = halves[:, :, :bs].reshape(nb, heads, two_d // 2, bs).transpose(2, 3)
        v = halves[:, :, bs:]
    elif layout == "nhd":  # [2, blocks, bs, H, D]
        sel = tensor.index_select(1, ids).transpose(2, 3)
        k, v = sel[0], sel[1]
    elif layout == "hnd":  # [2, blocks, H, bs, D]
        sel = tensor.index_select(1, ids)
        k, v = sel[0], sel[1]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    # [nb, H, bs, D] -> [H, nb * bs, D], then the positions asked for
    out = []
    scales = (dequant.k_scale, dequant.v_scale) if dequant is not None else (1.0, 1.0)
    for x, scale in zip((k, v), scales, strict=True):
        x = x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])[:, off : off + b - a]
        if dequant is not None:  # bytes -> float8 -> float32 x scale -> the engine's dtype
            x = (x.view(dequant.fmt).to(torch.float32) * scale).to(getattr(torch, dtype))
        x = x.contiguous()  # queued after this layer's kernels (the same stream)
        out.append(x.cpu() if host else x)
    return out[0], out[1]


def _stored(x: torch.Tensor, dtype: str) -> np.ndarray:
    """A gathered tensor in kv.py's storage dtype for `dtype` (bfloat16: raw 16-bit words)."""
    if dtype == "bfloat16":
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(np.uint16)
        return bf16_words_from_float32(x.float().numpy())
    return x.to(getattr(torch, dtype)).numpy()
