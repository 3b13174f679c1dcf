"""What each layer of a model holds for the next position, and the piece that carries a
recurrent layer's state: the one place the spec, the wire plan, the ledger and the receive
path ask "what does layer l hold?". numpy only.

Kinds (ModelSpec.layer_types, transformers' names):
- full_attention: K and V of every position (kv.LayerKV pieces, per chunk);
- sliding_attention: K and V of the window's last W - 1 positions (spec.window_keep);
- linear_attention: a recurrent layer (Qwen3-Next's gated delta net): fixed-size state
  arrays, the same size at every prompt length, complete only once the layer has consumed
  the whole prompt: one `LayerState` piece, sent in the last chunk, in layer order.
- latent attention (MLA: DeepSeek-V3; families.Family.latent, every layer of the model):
  per position the normalized latent and the roped key all heads share, as both libraries
  cache them: LayerKV pieces of one "head" whose K is the latent (spec.head_dim =
  kv_lora_rank wide) and whose V is the roped key (spec.v_dim = qk_rope_head_dim wide), in
  mlx-lm's order of the rotated dimensions (`latent_key_order`).

A state's arrays travel in mlx-lm's layout (its ArraysCache holds them so), each either in
the KV's wire dtype (`follows_kv`: the conv window of the layer's inputs) or in float32 (the
recurrent matrix both libraries keep in float32 whatever the weights). The torch side
transposes into and out of transformers' layout (backends/torch_state.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exo_split import families
from exo_split.kv import _from_float32, _to_float32, storage_dtype

LINEAR = "linear_attention"


@dataclass(frozen=True)
class StateArray:
    name: str
    shape: tuple[int, ...]
    follows_kv: bool  # in the KV's dtype; else always float32

    def dtype(self, kv_dtype: str) -> str:
        return kv_dtype if self.follows_kv else "float32"

    def nbytes(self, kv_dtype: str) -> int:
        return int(np.prod(self.shape)) * storage_dtype(self.dtype(kv_dtype)).itemsize


def gated_delta_state(extras: Mapping[str, Any]) -> tuple[StateArray, ...]:
    """Qwen3-Next's linear attention: the conv window (the last K - 1 inputs of the causal
    conv over q, k and v: [K - 1, 2 Hk Dk + Hv Dv]) and the delta rule's matrix per value
    head ([Hv, Dv, Dk])."""
    hk, dk = extras["linear_num_key_heads"], extras["linear_key_head_dim"]
    hv, dv = extras["linear_num_value_heads"], extras["linear_value_head_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    return (
        StateArray("conv", (extras["linear_conv_kernel_dim"] - 1, conv_dim), True),
        StateArray("recurrent", (hv, dv, dk), False),
    )


def mamba2_state(extras: Mapping[str, Any]) -> tuple[StateArray, ...]:
    """Granite 4.0-H's Mamba2 mixer: the conv window over x, B and C ([K - 1, H P + 2 G N])
    and the SSM state per head ([H, P, N]), both in the activations' dtype (as mlx-lm keeps
    them)."""
    heads, head_dim = extras["mamba_n_heads"], extras["mamba_d_head"]
    groups, state = extras["mamba_n_groups"], extras["mamba_d_state"]
    conv_dim = heads * head_dim + 2 * groups * state
    return (
        StateArray("conv", (extras["mamba_d_conv"] - 1, conv_dim), True),
        StateArray("ssm", (heads, head_dim, state), True),
    )


def is_latent(spec) -> bool:
    fam = families.family(spec.architecture)
    return bool(fam and fam.latent)


def latent_key_order(spec) -> np.ndarray | None:
    """Where transformers keeps each dimension of a latent model's roped key: mlx-lm (and the
    wire) keep each rotated pair side by side, transformers' interleaved rope puts the pairs'
    first elements in the first half and their second ones in the second:
    transformers' = wire[..., order], wire = transformers'[..., argsort(order)]. None: no
    latent layers."""
    if not is_latent(spec):
        return None
    d = spec.v_dim
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


STATES: dict[str, Callable[[Mapping[str, Any]], tuple[StateArray, ...]]] = {
    "gated_delta": gated_delta_state,
    "mamba2": mamba2_state,
}
# The recurrent matrix's last two axes in transformers' cache, swapped against the wire's
# (mlx-lm's): the gated delta net keeps [Hv, Dk, Dv] there, Mamba2 the same [H, P, N].
TRANSPOSED = {"gated_delta": True, "mamba2": False}


def state_arrays(spec) -> tuple[StateArray, ...]:
    """The arrays of each recurrent layer of `spec` (a ModelSpec); () when it has none."""
    kind = families.family(spec.architecture).recurrent
    return STATES[kind](dict(spec.extras)) if kind and recurrent_layers(spec) else ()


def recurrent_layers(spec) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(spec.layer_types) if t == LINEAR)


def state_bytes(spec, kv_dtype: str) -> tuple[int, ...]:
    """Per layer, the bytes of its state piece on the wire (0: a layer of K and V)."""
    arrays = state_arrays(spec)
    size = sum(a.nbytes(kv_dtype) for a in arrays)
    return tuple(size if t == LINEAR else 0 for t in spec.layer_types) if arrays else ()


@dataclass(frozen=True)
class LayerState:
    """A recurrent layer's state after prompt positions [0, token_start): its arrays in
    `state_arrays` order and layout, storage dtypes. `n_tokens` is 0 (a state covers no
    positions of its own); `release` and `computed_at` as for LayerKV."""

    layer: int
    token_start: int
    arrays: tuple[np.ndarray, ...]
    follows_kv: tuple[bool, ...]
    dtype: str  # the KV dtype the `follows_kv` arrays are in
    computed_at: float | None = None
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    n_tokens = 0

    def since(self, position: int) -> LayerState:
        return self

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def buffers(self) -> tuple[memoryview, ...]:
        return tuple(memoryview(np.ascontiguousarray(a)).cast("B") for a in self.arrays)

    def copy(self) -> LayerState:
        """A piece whose arrays are its own (a snapshot the live state cannot change)."""
        return dataclasses.replace(self, arrays=tuple(np.array(a, copy=True) for a in self.arrays),
                                   release=None)  # fmt: skip

    def astype(self, dtype: str) -> LayerState:
        if dtype == self.dtype:
            return self
        arrays = tuple(
            _from_float32(_to_float32(a, self.dtype), dtype) if f else a
            for a, f in zip(self.arrays, self.follows_kv, strict=True)
        )
        return dataclasses.replace(self, arrays=arrays, dtype=dtype)

    @classmethod
    def from_bytes(cls, layer: int, token_start: int, described: tuple[StateArray, ...],
                   dtype: str, payload: bytes | bytearray | memoryview) -> LayerState:  # fmt: skip
        """Views over a received payload (no copy); ValueError if its size is not the
        description's."""
        view, arrays, at = memoryview(payload).cast("B"), [], 0
        for a in described:
            n = a.nbytes(dtype)
            if at + n > len(view):
                raise ValueError(f"a state payload of {len(view)} bytes is too short")
            sd = storage_dtype(a.dtype(dtype))
            arrays.append(np.frombuffer(view[at : at + n], dtype=sd).reshape(a.shape))
            at += n
        if at != len(view):
            raise ValueError(f"a state payload of {len(view)} bytes, expected {at}")
        return cls(layer, token_start, tuple(arrays), tuple(a.follows_kv for a in described),
                   dtype)  # fmt: skip


def new_state(layer: int, token_start: int, described: tuple[StateArray, ...], dtype: str,
              arrays: list[np.ndarray]) -> LayerState:  # fmt: skip
    """A piece from arrays in the description's shapes (checked) and dtypes."""
    for a, d in zip(arrays, described, strict=True):
        if tuple(a.shape) != d.shape or a.dtype != storage_dtype(d.dtype(dtype)):
            raise ValueError(f"layer {layer} state {d.name}: {a.shape} {a.dtype}, expected "
                             f"{d.shape} {d.dtype(dtype)}")  # fmt: skip
    return LayerState(layer, token_start, tuple(arrays), tuple(d.follows_kv for d in described),
                      dtype)  # fmt: skip
