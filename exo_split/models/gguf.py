"""Convert a GGUF file (llama.cpp, Ollama, LM Studio) into a Hugging Face checkpoint directory.

    convert_gguf("model.gguf", "out/", dtype="bfloat16") -> Path("out/")

writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with the chat
template) and generation_config.json (the end-of-turn ids). numpy, gguf, tokenizers only: no
torch, so the Mac side converts too.

- Weights are dequantized with the gguf package (the maintained reader of llama.cpp's formats)
  to float32, then written as float32 or bfloat16. The GGUF's quantization is not kept: the
  prefill side runs at full precision, and both sides must hold the same numbers.
- llama.cpp permutes the Q and K rows of `llama`-architecture files for its interleaved RoPE;
  transformers and mlx-lm expect the rotate-half layout, so that permutation is undone.
- Llama 3.1+ files carry their RoPE scaling as a `rope_freqs` tensor, not as config: it is
  matched back to the llama3 parameters that produce it, or refused.
- Tensors stream to disk one at a time (peak memory: one dequantized tensor), into a temporary
  directory that is renamed into place at the end: an interrupted conversion leaves nothing
  half-written under `out_dir`.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import secrets
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from exo_split.errors import BadCheckpoint, ExoSplitError
from exo_split.models.gguf_config import ARCHITECTURES, hf_config
from exo_split.models.gguf_vocab import (
    Vocab,
    build_tokenizer,
    end_of_turn_ids,
    tokenizer_config,
    vocab_from_metadata,
)
from exo_split.models.gguf_weights import PlannedTensor, tensor_plan, write_safetensors

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when the output of the same file changes
DTYPES = ("float32", "bfloat16")
# Weight encodings whose dequantization (gguf package) we accept: the float types, llama.cpp's
# legacy and k-quants, and the i-quants. Not: integer tensors, the Q8_1/Q8_K scratch types.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "MXFP4",  # gpt-oss's experts (repacked, not dequantized: models/gguf_gpt_oss.py)
)  # fmt: skip


@dataclass(frozen=True)
class ConvertProgress:
    """One step of a conversion; str() is the line to show, done/total drive a bar."""

    message: str
    done: int = 0  # tensors written so far
    total: int = 0  # tensors to write (0: this step is not counted)

    def __str__(self) -> str:
        return self.message


Progress = Callable[[ConvertProgress], None]


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face checkpoint directory for a GGUF of ARCHITECTURES.

    Raises BadCheckpoint (before writing anything) for a file that is not GGUF, or holds an
    architecture, quantization type, tokenizer or RoPE scaling that exo-split cannot run.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    say = progress or (lambda p: log.info("%s", p))
    src, out = Path(gguf_path), Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExoSplitError(f"{out} is a file: expected a directory to write the checkpoint into")
    if out.exists() and not overwrite and any(out.iterdir()):
        raise ExoSplitError(
            f"{out} already exists and is not empty", hint="choose a new directory or overwrite it"
        )
    check_magic(src)
    say(ConvertProgress(f"reading {src.name} ..."))
    reader = open_gguf(src)
    meta = metadata(reader)
    arch = _architecture(meta)
    _check_types(reader.tensors)
    vocab = vocab_from_metadata(meta)
    tensors = {t.name: t for t in reader.tensors}
    config = hf_config(meta, tensors, vocab, dtype=dtype)
    plan = tensor_plan(tensors, config, arch)
    tokenizer = build_tokenizer(vocab)

    out.parent.mkdir(parents=True, exist_ok=True)
    # Beside `out` (same filesystem, so the final rename is atomic); plain mkdir keeps the umask.
    tmp = out.with_name(f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    tmp.mkdir()
    try:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config(vocab))
        _write_json(
            tmp / "tokenizer_config.json",
            tokenizer_config(vocab, max_length=config["max_position_embeddings"]),
        )
        tokenizer.save(str(tmp / "tokenizer.json"))
        provenance = {
            "format": "pt",
            "converted_from": src.name,
            "converter": f"exo-split convert-gguf v{CONVERTER_VERSION}",
        }

        def on_tensor(i: int, p: PlannedTensor) -> None:
            t = p.source
            expert = f"[{p.index}]" if p.index is not None else ""
            line = f"{i + 1}/{len(plan)} {t.name}{expert} ({t.tensor_type.name}) -> {p.name}"
            say(ConvertProgress(line, done=i + 1, total=len(plan)))

        write_safetensors(
            tmp / "model.safetensors", plan, dtype, metadata=provenance, on_tensor=on_tensor
        )
        _commit(tmp, out, overwrite=overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(ConvertProgress(f"wrote {out} ({config['num_hidden_layers']} layers, {dtype})"))
    return out


def check_magic(path: Path) -> None:
    """BadCheckpoint unless `path` is a file that starts like a GGUF file."""
    if not path.is_file():
        raise BadCheckpoint(f"{path} is not a file", hint="convert-gguf takes a .gguf file")
    with path.open("rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise BadCheckpoint(
            f"{path} is not a GGUF file: expected it to start with b'GGUF', found {head!r}",
            hint="a Hugging Face checkpoint directory needs no conversion: pass it as --model",
        )


# GGUF value types: u8 i8 u16 i16 u32 i32 f32 bool (0-7), string (8), array (9), u64 i64 f64.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def check_bounds(f: BinaryIO) -> None:
    """Every count in a GGUF's header and key-value section fits the bytes the file has,
    checked before gguf's reader sees it: that reader builds a list per array element, so
    one forged count (2^40 items in a 68-byte file) would take all the memory there is.
    Reads the header and seeks over the values. BadCheckpoint names the first count that
    does not fit."""
    end = os.fstat(f.fileno()).st_size

    def take(fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        raw = f.read(size)
        if len(raw) < size:
            raise BadCheckpoint(f"the file ends inside {what} (byte {f.tell():,} of {end:,})")
        return struct.unpack(fmt, raw)[0]

    def skip(n: int, what: str) -> None:
        if n > end - f.tell():
            raise BadCheckpoint(f"{what}: {n:,} bytes of values, {end - f.tell():,} left")
        f.seek(n, os.SEEK_CUR)

    def value(kind: int, what: str, depth: int = 0) -> None:
        if kind in _SCALAR_SIZES:
            skip(_SCALAR_SIZES[kind], what)
        elif kind == _STRING:
            skip(take("<Q", what), what)
        elif kind == _ARRAY and depth < 4:
            item, n = take("<I", what), take("<Q", what)
            least = _SCALAR_SIZES.get(item, 8)  # a string or an array takes 8 bytes at least
            if n * least > end - f.tell():
                raise BadCheckpoint(f"{what}: an array of {n:,} items, {end - f.tell():,} bytes left")  # fmt: skip
            if item in _SCALAR_SIZES:
                skip(n * least, what)
            else:
                for _ in range(n):
                    value(item, what, depth + 1)
        else:
            raise BadCheckpoint(f"{what}: unknown GGUF value type {kind}")

    f.seek(4)
    version = take("<I", "the header")
    if version not in (2, 3):
        raise BadCheckpoint(f"GGUF version {version}: exo-split reads versions 2 and 3")
    tensors, kvs = take("<Q", "the header"), take("<Q", "the header")
    if tensors > end // 24 or kvs > end // 12:  # the smallest tensor info / key-value entry
        raise BadCheckpoint(f"the header claims {tensors:,} tensors and {kvs:,} keys in "
                            f"{end:,} bytes")  # fmt: skip
    for i in range(kvs):
        value(_STRING, f"key {i}")
        value(take("<I", f"key {i}"), f"key {i}")


def open_gguf(path: Path):
    """A GGUFReader on `path`, or BadCheckpoint saying what the file is instead."""
    check_magic(path)
    try:
        with path.open("rb") as f:
            check_bounds(f)
    except BadCheckpoint as exc:
        raise BadCheckpoint(f"cannot read {path.name} as GGUF: {exc}") from None
    from gguf import GGUFReader  # the import takes ~1 s: only when converting

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, MemoryError, OverflowError) as exc:
        # MemoryError / OverflowError: a count in the file (an array of 2^40 items in a
        # 60-byte file) that no real model has; the reader tried to allocate it.
        # gguf's reader also fails here on a tensor type newer than its own table.
        raise BadCheckpoint(
            f"cannot read {path} as GGUF (truncated, corrupt, or a format newer than gguf "
            f"{_gguf_version()} reads?): {exc}"
        ) from exc
    if reader.byte_order != "I":
        raise BadCheckpoint(f"{path} is a big-endian GGUF: expected a little-endian file")
    return reader


def _gguf_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def metadata(reader) -> dict[str, Any]:
    """Every key-value pair of the file as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _architecture(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise BadCheckpoint(
            f"unsupported GGUF architecture {arch!r}: exo-split converts "
            + ", ".join(ARCHITECTURES)
            + " (Mistral 7B GGUFs are 'llama')"
        )
    if arch not in ("qwen3moe", "gpt-oss") and int(meta.get(f"{arch}.expert_count") or 0) > 0:
        raise BadCheckpoint(
            f"{arch} GGUF with {meta[f'{arch}.expert_count']} experts: mixture-of-experts "
            "models are not supported, expected a dense model"
        )
    return arch


def _check_types(reader_tensors) -> None:
    bad = {}
    for t in reader_tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            bad.setdefault(t.tensor_type.name, t.name)
    if bad:
        found = ", ".join(f"{kind} (e.g. {name})" for kind, name in bad.items())
        raise BadCheckpoint(
            f"unsupported tensor type(s) {found}: exo-split dequantizes "
            + ", ".join(SUPPORTED_TYPES)
        )


def generation_config(vocab: Vocab) -> dict[str, Any]:
    eot = end_of_turn_ids(vocab)
    out: dict[str, Any] = {"bos_token_id": vocab.bos_id, "eos_token_id": eot or None}
    if vocab.pad_id is not None:
        out["pad_token_id"] = vocab.pad_id
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _commit(tmp: Path, out: Path, *, overwrite: bool) -> None:
    """Move the finished directory into place; the old one (overwrite) goes only after."""
    old = None
    if out.exists():
        if overwrite and any(out.iterdir()):
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        else:
            out.rmdir()  # empty (checked before converting)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- an embedded model's checkpoint: converted once into the cache ---------------------------

_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def converted_dir(name: str, distribution: str, cache_dir: str | Path | None, dtype: str) -> Path:
    """Where an embedded model's converted checkpoint lives (or will): named after the
    package's version, the dtype and the converter's version, so an upgrade reconverts."""
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    from exo_split.models.tiny import default_model_dir

    root = Path(cache_dir) if cache_dir is not None else default_model_dir().parent
    return root / f"{name}-{distribution}-{version}-{dtype}-c{CONVERTER_VERSION}"


def is_complete(out: Path) -> bool:
    # Conversion renames a finished directory into place, so these files mean it is whole.
    return all((out / f).is_file() for f in _CHECKPOINT_FILES)


def convert_once(gguf: Path, out: Path, *, dtype: str, progress: Progress | None) -> Path:
    """convert_gguf into `out`, unless another process finishes the same conversion first
    (then its directory is the answer)."""
    try:
        return convert_gguf(gguf, out, dtype=dtype, progress=progress)
    except (OSError, ExoSplitError):
        if is_complete(out):  # another process converted it meanwhile
            return out
        raise
