"""A recurrent layer on the torch side: transformers' own LinearAttentionLayer inside our
PreallocatedCache (its model reads and updates it as it would a DynamicCache's), and its
state into and out of the wire's layout (layers.py: mlx-lm's).

transformers keeps the conv window as [1, conv_dim, K] (the last K inputs, of which the next
step's convolution reads the last K - 1) and the delta rule's matrix as [1, Hv, Dk, Dv] in
float32; the wire carries [K - 1, conv_dim] in the KV dtype and [Hv, Dv, Dk] in float32.
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
          kv_dtype: str, to_numpy) -> LayerState:  # fmt: skip
    """The layer's state after `n` positions, copied to the host (waits for the device)."""
    conv_arr, rec_arr = described
    conv = layer.conv_states[0][0, :, -conv_arr.shape[0] :].transpose(0, 1)
    rec = layer.recurrent_states[0][0].transpose(-1, -2)
    arrays = [to_numpy(conv.contiguous().cpu()), to_numpy(rec.float().contiguous().cpu())]
    return new_state(index, n, described, kv_dtype, arrays)


@torch.inference_mode()
def inject(layer: StateLayer, st: LayerState, device, dtype: torch.dtype, from_numpy) -> None:
    """A received state into the layer, as transformers' own prefill would have left it."""
    conv, rec = (from_numpy(a, d) for a, d in
                 zip(st.arrays, (st.dtype, "float32"), strict=True))  # fmt: skip
    conv = conv.to(device, dtype).transpose(0, 1)[None]  # [1, conv_dim, K - 1]
    conv = torch.nn.functional.pad(conv, (1, 0))  # the column the next step no longer reads
    rec = rec.to(device, torch.float32).transpose(-1, -2)[None].contiguous()
    layer.lazy_initialization(conv_states=conv, recurrent_states=rec,
                              conv_kernel_size=conv.shape[-1])  # fmt: skip
    layer.conv_states[0].copy_(conv)
    layer.recurrent_states[0].copy_(rec)
    layer.has_previous_state[0] = True
