from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(family) -> path of a tiny random HF checkpoint, built once per session."""
    from checkpoints import build

    built = {}

    def get(family: str = "llama", **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"ckpt-{family}")
            built[key] = build(out, family, **overrides)
        return built[key]

    return get
