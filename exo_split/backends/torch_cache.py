"""The torch backend's device cache: one buffer per layer, allocated before the forward, so
each layer's positions keep their address for the whole request and the stager
(torch_staging.py) can copy them out later. transformers' model reads and updates it as it
would a DynamicCache; a latent (MLA) layer keeps its roped key in the wire's order
(`LatentLayer`), a recurrent layer is transformers' own (torch_state.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from exo_split.backends.torch_state import StateLayer, is_state


class PreallocatedLayer(DynamicLayer):
    """DynamicLayer semantics (update returns the keys so far) over one buffer of `capacity`
    positions: no torch.cat per chunk, so positions [s, e) keep their address for the request
    and a pending copy can read them later. Grows (a copy) only past its capacity (decode)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.buffers = (keys, values)  # [1, H, capacity, D] (V's D: v_dim)
        self.length = 0
        self.device = keys.device
        self.is_initialized = True
        self.keys, self.values = keys[:, :, :0], values[:, :, :0]

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2]

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        kb, vb = self.buffers
        kb[:, :, self.length : end].copy_(key_states)
        vb[:, :, self.length : end].copy_(value_states)
        self.length = end
        self.keys, self.values = kb[:, :, :end], vb[:, :, :end]
        return self.keys, self.values

    def _grow(self, end: int) -> None:
        cap = max(end, 2 * self.capacity)
        grown = []
        for b in self.buffers:
            new = b.new_empty((*b.shape[:2], cap, b.shape[3]))
            new[:, :, : self.length].copy_(b[:, :, : self.length])
            grown.append(new)
        self.buffers = tuple(grown)

    def get_seq_length(self) -> int:
        return self.length


class LatentLayer(PreallocatedLayer):
    """A latent (MLA) layer's cache: K the latent, V the roped key, which it keeps in the
    wire's (mlx-lm's) order of the rotated dimensions, so that staging, export and prefix
    reuse read the buffers as they are; transformers gets (and gives) its own order
    (layers.latent_key_order): a [1, 1, positions, qk_rope_head_dim] gather per update."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, order: torch.Tensor):
        super().__init__(keys, values)
        self.order, self.back = order, torch.argsort(order)

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states[..., self.back], *args, **kwargs)
        return keys, values[..., self.order]


@dataclass
class Mark:
    """Positions [start, start + n) of `layer` were computed at `at` (an event until resolved)."""

    layer: int
    start: int
    n: int
    at: Any


class PreallocatedCache(Cache):
    """The torch backend's cache: one PreallocatedLayer per layer. During a prefill, `hook(layer,
    start, n)` runs on the compute thread right after a layer wrote positions [start, start + n);
    `marks` keeps when each piece was computed (for `stream_kv` after the prefill)."""

    def __init__(self, n_layers: int, shape: tuple[int, int, int], dtype, device, adopt=None,
                 recurrent: tuple[int, ...] = (), v_dim: int | None = None,
                 key_order=None):  # fmt: skip
        """`shape`: K's [heads, capacity, head_dim] (V's last: `v_dim`, default head_dim);
        `key_order`: a latent model's (LatentLayer), else None."""
        heads, capacity, head_dim = shape
        order = None if key_order is None else torch.as_tensor(key_order, device=device)
        layers = []
        for i in range(n_layers):
            if i in recurrent:  # transformers' own linear-attention layer (torch_state.py)
                layers.append(StateLayer())
                continue
            kv = [torch.empty((1, heads, capacity, d), dtype=dtype, device=device)
                  for d in (head_dim, v_dim or head_dim)]  # fmt: skip
            if adopt is not None:
                for b in kv:
                    adopt(b)
            layers.append(PreallocatedLayer(*kv) if order is None else LatentLayer(*kv, order))
        super().__init__(layers=layers)
        self.hook: Callable[[int, int, int], None] | None = None
        self.state_hook: Callable[[int], None] | None = None  # after a recurrent layer's step
        self.marks: list[Mark] = []

    @property
    def kv_layers(self) -> list[PreallocatedLayer]:
        return [layer for layer in self.layers if not is_state(layer)]

    def update_recurrent_state(self, recurrent_states, layer_idx, *args, **kwargs):
        out = super().update_recurrent_state(recurrent_states, layer_idx, *args, **kwargs)
        if self.state_hook is not None:
            self.state_hook(layer_idx)
        return out

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        start = self.layers[layer_idx].length
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.hook is not None:
            self.hook(layer_idx, start, key_states.shape[-2])
        return out

    def stamps(self) -> list[list[tuple[int, float]]]:
        """Per layer, (end position, when computed) of each piece the prefill computed, in
        order (marks resolved to seconds)."""
        out: list[list[tuple[int, float]]] = [[] for _ in self.layers]
        for m in self.marks:
            if isinstance(m.at, float):
                out[m.layer].append((m.start + m.n, m.at))
        return out
