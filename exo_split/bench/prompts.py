"""The benchmark's prompts: the same token ids for the same length in every run and section
(bench/run.py, scale.py, itl.py import them from here, below all three)."""

from __future__ import annotations


def prompt_ids(n: int, vocab_size: int) -> list[int]:
    """n token ids: BOS, then a fixed pseudo-random sequence (no specials)."""
    import numpy as np

    rng = np.random.default_rng(n)
    return [1, *(int(t) for t in rng.integers(3, vocab_size, n - 1))]
