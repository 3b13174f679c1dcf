"""How a GGUF's metadata values are read: model dimensions (bounded integers, one value for
every layer) and the floats llama.cpp stores as float32. No torch, no gguf package."""

from __future__ import annotations

from typing import Any

import numpy as np

from exo_split.errors import BadCheckpoint


def decimal(value: Any) -> float:
    """A float the GGUF stores as float32, as the shortest decimal that reads back as that
    float32 (1e-05, not 9.999999747378752e-06): the value the original config.json held, so
    a converted checkpoint fingerprints as the original it came from (spec.py)."""
    return float(str(np.float32(value)))


_MAX_SIZE = 1 << 24  # no model dimension comes near 16M; larger is a damaged file


def dim(value: Any, what: str) -> int:
    """A model dimension: an integer from 1 to _MAX_SIZE, else BadCheckpoint naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise BadCheckpoint(f"{what} is {value!r}: expected a positive integer")
    if not 1 <= int(value) <= _MAX_SIZE:
        raise BadCheckpoint(f"{what} is {int(value):,}: expected 1 to {_MAX_SIZE:,}")
    return int(value)


def uniform_dim(value: Any, what: str) -> int:
    """A per-layer array that must hold one value for every layer (or a plain int)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise BadCheckpoint(
                f"{what} differs between layers ({sorted(set(value))}): expected one value"
            )
        value = value[0]
    return dim(value, what)
