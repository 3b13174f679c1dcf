"""A recurrent layer on the torch side: transformers' own LinearAttentionLayer inside our
PreallocatedCache (its model reads and updates it as it would a DynamicCache's), and its
state into and out of the wire's layout (layers.py: mlx-lm's).

transformers keeps the conv window as [1, conv_dim, K] (the last K inputs, of which the next
step's convolution reads the last K - 1) and the recurrent matrix with a batch axis (the
gated delta net's with its last two axes swapped: [1, Hv, Dk, Dv]); the wire carries
[K - 1, conv_dim] and the matrix as layers.py describes it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from exo_split.layers import LayerState, StateArray, new_state


class StateLayer(LinearAttentionLayer):
    """No K or V of its own (`buffers` empty): the cache's KV loops pass it by."""

    buffers: tuple = ()

    @property
    def nbytes(self) -> int:
        states = (*self.conv_states.values(), *self.recurrent_states.values())
        return sum(t.numel() * t.element_size() for t in states if t is not None)


def is_state(layer) -> bool:
    return isinstance(layer, StateLayer)


def piece(layer: StateLayer, index: int, n: int, described: tuple[StateArray, ...],
          kv_dtype: str, to_numpy, *, transposed: bool) -> LayerState:  # fmt: skip
    """The layer's state after `n` positions, copied to the host (waits for the device).
    `transposed`: transformers keeps the recurrent matrix's last two axes swapped."""
    conv_arr, rec_arr = described
    conv = layer.conv_states[0][0, :, -conv_arr.shape[0] :].transpose(0, 1)
    rec = layer.recurrent_states[0][0]
    rec = rec.transpose(-1, -2) if transposed else rec
    rec = rec if rec_arr.follows_kv else rec.float()
    arrays = [to_numpy(conv.contiguous().cpu()), to_numpy(rec.contiguous().cpu())]
    return new_state(index, n, described, kv_dtype, arrays)


@torch.inference_mode()
def inject(layer: StateLayer, st: LayerState, device, dtype: torch.dtype, from_numpy, *,
           transposed: bool) -> None:  # fmt: skip
    """A received state into the layer, as transformers' own prefill would have left it."""
    conv, rec = (from_numpy(a, st.dtype if f else "float32") for a, f in
                 zip(st.arrays, st.follows_kv, strict=True))  # fmt: skip
    conv = conv.to(device, dtype).transpose(0, 1)[None]  # [1, conv_dim, K - 1]
    conv = torch.nn.functional.pad(conv, (1, 0))  # the column the next step no longer reads
    rec = rec.to(device, dtype if st.follows_kv[1] else torch.float32)
    rec = (rec.transpose(-1, -2) if transposed else rec)[None].contiguous()
    layer.lazy_initialization(conv_states=conv, recurrent_states=rec,
                              conv_kernel_size=conv.shape[-1])  # fmt: skip
    layer.conv_states[0].copy_(conv)
    layer.recurrent_states[0].copy_(rec)
    layer.has_previous_state[0] = True
