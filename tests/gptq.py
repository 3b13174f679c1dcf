"""A GPTQ 4-bit checkpoint of a tiny float one, written here (our own packing of the format
vLLM and transformers read: symmetric 4-bit, groups along the input dimension, the v1
checkpoint layout), and the float checkpoint of exactly the weights it holds.

`write_gptq(src, out_q, out_f)`: every linear layer of the decoder blocks is quantized
(round to nearest, one fp16 scale per group of `group` inputs and output channel, values
q - 8 for q in 0..15); `out_q` holds the packed form (qweight, qzeros, scales, g_idx, and
`quantization_config`), `out_f` the same numbers dequantized to float32 with the rest of
the checkpoint unchanged: the model the quantized weights *are*, for transformers and for a
decode node that runs full precision.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float -> (q [in, out] ints 0..15, scales [in / group, out] float16)."""
    out_dim, in_dim = w.shape
    groups = np.ascontiguousarray(w.T).reshape(in_dim // group, group, out_dim)
    scales = np.ascontiguousarray(np.abs(groups).max(axis=1) / 7.5, dtype=np.float16)
    s = np.maximum(scales.astype(np.float32), 1e-8)[:, None, :]
    q = np.clip(np.rint(groups / s) + 8, 0, 15).astype(np.int64)
    return q.reshape(in_dim, out_dim), scales


def dequantize(q: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """q [in, out], scales [groups, out] -> w [out, in] float32."""
    s = np.repeat(scales.astype(np.float32), group, axis=0)
    return ((q - 8) * s).T.astype(np.float32)


def pack_rows(q: np.ndarray) -> np.ndarray:
    """[in, out] 4-bit values -> int32 [in / 8, out]: value 8i + j in bits 4j of row i."""
    rows = q.reshape(q.shape[0] // 8, 8, q.shape[1]).astype(np.uint32)
    packed = sum(rows[:, j] << np.uint32(4 * j) for j in range(8))
    return packed.astype(np.uint32).view(np.int32)


def write_gptq(src: Path, out_q: Path, out_f: Path, *, group: int = 32) -> None:
    for out in (out_q, out_f):
        shutil.copytree(src, out, dirs_exist_ok=True)
        for f in out.glob("*.safetensors"):
            f.unlink()
    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    packed, floats = {}, dict(tensors)
    for name, w in tensors.items():
        base = name.removesuffix(".weight")
        if not name.endswith(".weight") or base.rsplit(".", 1)[-1] not in LINEARS:
            packed[name] = w
            continue
        q, scales = quantize(w.astype(np.float32), group)
        floats[name] = dequantize(q, scales, group)
        out_dim = w.shape[0]
        packed[f"{base}.qweight"] = pack_rows(q)
        # v1 layout: the zero point minus one, packed along the output dimension (8 - 1 = 7)
        packed[f"{base}.qzeros"] = np.full((q.shape[0] // group, out_dim // 8), 0x77777777,
                                           np.uint32).view(np.int32)  # fmt: skip
        packed[f"{base}.scales"] = scales
        packed[f"{base}.g_idx"] = (np.arange(q.shape[0]) // group).astype(np.int32)
    for out, arrays in ((out_q, packed), (out_f, floats)):  # safetensors writes memory order
        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        save_file(arrays, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                     "desc_act": False, "sym": True,
                                     "checkpoint_format": "gptq"}  # fmt: skip
    (out_q / "config.json").write_text(json.dumps(config, indent=2))
