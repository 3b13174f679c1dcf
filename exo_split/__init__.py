"""exo-split: PyTorch prefill on one machine, MLX decode on another, KV streamed per layer."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 2
