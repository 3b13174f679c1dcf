"""4-bit checkpoints of a tiny float one, written here in the two formats vLLM's CPU build
runs (our own packing of what vLLM and transformers read), and the float checkpoint of
exactly the weights each holds.

`write_int4(src, out_q, out_f, method)`: every linear layer of the decoder blocks is
quantized to 4 bits in groups of `group` inputs (round to nearest, fp16 scales), `out_q`
holds the packed form with its `quantization_config`, `out_f` the same numbers dequantized
to float32 with the rest of the checkpoint unchanged: the model the quantized weights *are*,
for transformers and for a decode node that runs full precision.

- "gptq": symmetric, w = s (q - 8); qweight int32 [in / 8, out], 8 values of consecutive
  inputs per word; qzeros in the v1 layout (the zero point minus one: 7); g_idx.
- "awq": asymmetric, w = s (q - z), z in 0..15 per group and output; qweight and qzeros
  int32 [in, out / 8] and [groups, out / 8], 8 values of consecutive outputs per word in
  AWQ's interleaved order (0, 2, 4, 6, 1, 3, 5, 7).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column whose nibble sits at 4 i bits


def quantize(w: np.ndarray, group: int, symmetric: bool):
    """w [out, in] float -> (q [in, out] ints 0..15, zeros [groups, out] ints, scales
    [groups, out] float16)."""
    out_dim, in_dim = w.shape
    groups = np.ascontiguousarray(w.T).reshape(in_dim // group, group, out_dim)
    if symmetric:
        scales = np.abs(groups).max(axis=1) / 7.5
        zeros = np.full(scales.shape, 8, np.int64)
    else:
        low, high = groups.min(axis=1), groups.max(axis=1)
        scales = (high - low) / 15
        zeros = np.clip(np.rint(-low / np.maximum(scales, 1e-8)), 0, 15).astype(np.int64)
    scales = np.ascontiguousarray(scales, dtype=np.float16)
    s = np.maximum(scales.astype(np.float32), 1e-8)[:, None, :]
    q = np.clip(np.rint(groups / s) + zeros[:, None, :], 0, 15).astype(np.int64)
    return q.reshape(in_dim, out_dim), zeros, scales


def dequantize(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """-> w [out, in] float32."""
    z = np.repeat(zeros, group, axis=0)
    s = np.repeat(scales.astype(np.float32), group, axis=0)
    return ((q - z) * s).T.astype(np.float32)


def _words(x: np.ndarray) -> np.ndarray:
    """[..., 8] 4-bit values -> int32 [...]: value j in bits 4j."""
    packed = sum(x[..., j].astype(np.uint32) << np.uint32(4 * j) for j in range(8))
    return np.asarray(packed, np.uint32).view(np.int32)


def pack_gptq(q: np.ndarray) -> np.ndarray:
    """[in, out] -> int32 [in / 8, out]: inputs 8i..8i+7 of each output in word (i, out)."""
    return _words(q.reshape(q.shape[0] // 8, 8, q.shape[1]).transpose(0, 2, 1))


def pack_awq(q: np.ndarray) -> np.ndarray:
    """[rows, out] -> int32 [rows, out / 8]: outputs 8c..8c+7 of each row in word (row, c),
    in AWQ_ORDER."""
    return _words(q.reshape(q.shape[0], q.shape[1] // 8, 8)[..., list(AWQ_ORDER)])


def write_int4(src: Path, out_q: Path, out_f: Path, method: str = "gptq", *,
               group: int = 32) -> None:  # fmt: skip
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
        q, zeros, scales = quantize(w.astype(np.float32), group, symmetric=method == "gptq")
        floats[name] = dequantize(q, zeros, scales, group)
        packed[f"{base}.scales"] = scales
        if method == "gptq":
            packed[f"{base}.qweight"] = pack_gptq(q)
            packed[f"{base}.qzeros"] = pack_awq(zeros - 1)  # v1: any order, all alike
            packed[f"{base}.g_idx"] = (np.arange(q.shape[0]) // group).astype(np.int32)
        else:
            packed[f"{base}.qweight"] = pack_awq(q)
            packed[f"{base}.qzeros"] = pack_awq(zeros)
    for out, arrays in ((out_q, packed), (out_f, floats)):  # safetensors writes memory order
        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        save_file(arrays, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    common = {"bits": 4, "group_size": group}
    config["quantization_config"] = (
        {"quant_method": "gptq", **common, "desc_act": False, "sym": True,
         "checkpoint_format": "gptq"}
        if method == "gptq"
        else {"quant_method": "awq", **common, "zero_point": True, "version": "gemm"}
    )  # fmt: skip
    (out_q / "config.json").write_text(json.dumps(config, indent=2))
