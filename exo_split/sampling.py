"""How a token is picked from logits: one rule, used by every backend and both nodes.

Sampling is stateless per step: step i draws its uniform number from (seed, i), so the
prefill node can pick token 0 and the decode node continue with token 1.. and the whole
sequence equals a single-machine run with the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    seed: int = 0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict | None) -> Sampling:
        d = d or {}
        t = float(d.get("temperature", 0.0))
        if not (0.0 <= t <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {t}")
        return cls(temperature=t, seed=int(d.get("seed", 0)))


GREEDY = Sampling()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def sample(logits: np.ndarray, sampling: Sampling, step: int) -> tuple[int, float]:
    """Pick the token for generation step `step` (0 = the first generated token).

    Returns (token id, its log-probability under the unscaled distribution).
    """
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    logp = log_softmax(logits)
    if sampling.temperature == 0.0:
        token = int(np.argmax(logits))
    else:
        p = np.exp(log_softmax(logits / sampling.temperature))
        u = np.random.default_rng([sampling.seed, step]).random()
        token = int(min(np.searchsorted(np.cumsum(p), u, side="right"), len(p) - 1))
    return token, float(logp[token])
