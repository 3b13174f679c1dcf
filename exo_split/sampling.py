"""How a token is picked from logits: one rule, used by every backend and both nodes.

Sampling is stateless per step: step i draws its uniform number from (seed, i), so the
prefill node can pick token 0 and the decode node continue with token 1.. and the whole
sequence equals a single-machine run with the same seed.

The rule, for temperature T > 0 and nucleus top_p: z = logits x float32(1 / T) in float32
(one correctly rounded multiply, the same on every device), p = softmax(z) in float64;
tokens outside the nucleus (the most probable tokens, in order of probability, ties by id,
until their sum reaches top_p; the first always counts) get p = 0; the token is the first
id, in vocabulary order, where the cumulative sum of p passes u * sum(p), with u from
(seed, step). T = 0 is greedy (argmax, lowest id on a tie). `pick` is the rule; the MLX
decode loop computes it in the graph and defers to `pick` wherever float32 is not sure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "seed": self.seed, "top_p": self.top_p}

    @classmethod
    def from_dict(cls, d: dict | None) -> Sampling:
        d = d or {}
        try:
            return cls(
                temperature=float(d.get("temperature", 0.0)),
                seed=int(d.get("seed", 0)),
                top_p=float(d.get("top_p", 1.0)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad sampling settings {d!r}: {exc}") from exc


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
    token = pick(logits, sampling, step)
    return token, float(log_softmax(logits)[token])


MAX_TOP_LOGPROBS = 20  # as OpenAI


def logprobs_of(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """A picked token's log-probability under the model's own distribution (the logits
    before temperature, top-p or a grammar's mask) and the `top` most probable tokens with
    theirs, most probable first (ties by id)."""
    lp = log_softmax(np.asarray(logits, dtype=np.float32).reshape(-1))
    best = np.lexsort((np.arange(len(lp)), -lp))[:top] if top else []
    return float(lp[token]), [(int(i), float(lp[i])) for i in best]


def pick(logits: np.ndarray, sampling: Sampling, step: int, *, u: float | None = None) -> int:
    """The token of the rule (module docstring) for generation step `step`; `u` may be given
    when the caller already drew uniform(seed, step). The decode loop's host check calls this."""
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    if sampling.temperature == 0.0:
        return int(np.argmax(logits))
    # One correctly rounded float32 multiply: the same z on every device, the graph's too.
    z = (logits * np.float32(1.0 / sampling.temperature)).astype(np.float64)
    p = np.exp(z - z.max())  # softmax up to its normalisation, which the rule scales away
    if sampling.top_p < 1.0:
        p = p * nucleus_mask(p / p.sum(), sampling.top_p)
    cdf = np.cumsum(p)
    u = uniform(sampling.seed, step) if u is None else u
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(p) - 1))


def uniform(seed: int, step: int) -> float:
    """The one random number of generation step `step`: a pure function of (seed, step)."""
    return float(np.random.default_rng([seed, step]).random())


def nucleus_mask(p: np.ndarray, top_p: float) -> np.ndarray:
    """1.0 for the tokens of the nucleus of `p` (probabilities), else 0.0 (see the module
    docstring). Only the most probable tokens are sorted: a candidate set that grows until
    the nucleus ends strictly above every token left out (so ties are never cut apart)."""
    n = len(p)
    k = min(n, 256)
    while True:
        cand = np.argpartition(-p, k - 1)[:k] if k < n else np.arange(n)
        order = cand[np.lexsort((cand, -p[cand]))]  # by probability, then by id
        before = np.cumsum(p[order]) - p[order]  # mass of the more probable tokens
        kept = order[before < top_p]
        # Every token outside `cand` is <= the smallest candidate: if the nucleus's last
        # token is strictly more probable, no outsider could have come before it.
        if k == n or p[kept[-1]] > p[order[-1]]:
            break
        k = min(n, 4 * k)
    mask = np.zeros_like(p)
    mask[kept] = 1.0
    return mask


class Adjust:
    """What OpenAI's penalties, logit_bias and min_tokens do to the logits before the rule,
    a pure function of the prompt and the tokens generated so far (so a split still equals
    a single-machine run): for a logit l of token t,

        l = l / r if l > 0 else l * r        when t is in the prompt or the output (r: the
                                             repetition penalty, vLLM's and transformers')
        l = l + bias[t] - frequency * count[t] - presence * (count[t] > 0)
        l = -inf                             for end-of-turn ids while fewer than min_tokens

    where count[t] counts t in the generated tokens (OpenAI's definition, as vLLM applies it).
    `apply` is the rule on the host (float32, numpy); the MLX loop computes the same
    operations in float32 in its graph from `seen` and `additive()`."""

    def __init__(self, vocab: int, *, bias: dict[int, float] | None = None,
                 presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0,
                 min_tokens: int = 0, eos_ids: frozenset[int] = frozenset(),
                 prompt: tuple[int, ...] = ()):  # fmt: skip
        self.presence, self.frequency = np.float32(presence), np.float32(frequency)
        self.repetition, self.min_tokens = np.float32(repetition), min_tokens
        self.eos = np.array(sorted(e for e in eos_ids if e < vocab), dtype=np.int64)
        self.counts = np.zeros(vocab, np.float32)
        self.seen = np.zeros(vocab, bool)
        if repetition != 1.0:
            self.seen[np.asarray(prompt, dtype=np.int64)] = True
        self.static = np.zeros(vocab, np.float32)
        for token, b in (bias or {}).items():
            self.static[token] += np.float32(b)
        self.generated = 0

    def accept(self, token: int) -> None:
        self.counts[token] += 1
        self.seen[token] = True
        self.generated += 1

    def additive(self) -> np.ndarray:
        add = self.static - self.frequency * self.counts - self.presence * (self.counts > 0)
        if self.generated < self.min_tokens and len(self.eos):
            add[self.eos] = -np.inf
        return add.astype(np.float32)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        z = np.asarray(logits, dtype=np.float32).reshape(-1)
        if self.repetition != 1.0:
            r = self.repetition
            z = np.where(self.seen, np.where(z > 0, z / r, z * r), z).astype(np.float32)
        return (z + self.additive()).astype(np.float32)
