from __future__ import annotations

import logging
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


@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("llama")


@pytest.fixture(autouse=True)
def _restore_logging():
    """cli.main.main() configures the "exo_split" logger, as a CLI does; undo it for other tests."""
    logger = logging.getLogger("exo_split")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers
