"""The one sampling rule (sampling.py) and its in-graph form (backends/mlx_decode.py).

The host rule is the reference: it is checked against its own definition written out the
slow way, and the graph's pick against it on logits built to be hard (flat distributions,
exact ties, masked tokens, tiny and huge temperatures, nucleus cuts).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from exo_split.backends.mlx_decode import GraphSampler, blocked_cumsum, scan_error_ulps
from exo_split.sampling import Sampling, nucleus_mask, pick, sample, uniform


def _definition(logits: np.ndarray, s: Sampling, step: int) -> int:
    """The module docstring's rule, spelled out with a full sort and float64 throughout."""
    logits = np.asarray(logits, np.float32)
    if s.temperature == 0:
        return int(np.argmax(logits))
    z = (logits * np.float32(1 / s.temperature)).astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1:
        order = sorted(range(len(p)), key=lambda i: (-p[i], i))
        kept, before = [], 0.0
        for i in order:
            if before >= s.top_p:
                break
            kept.append(i)
            before += p[i]
        p = np.where(np.isin(np.arange(len(p)), kept), p, 0.0)
    cdf = np.cumsum(p)
    return int(np.searchsorted(cdf, uniform(s.seed, step) * cdf[-1], side="right"))


def _hard_rows(rng, n: int, v: int) -> np.ndarray:
    scale = rng.choice([0.3, 1.0, 3.0, 12.0], size=(n, 1))
    rows = (rng.standard_normal((n, v)) * scale).astype(np.float32)
    rows[::5, : v // 8] = rows[::5, :1]  # many exact ties, at the top
    rows[1::7] = np.round(rows[1::7])  # ties everywhere
    rows[2::9, v // 2 :] = -np.inf  # masked tokens
    return rows


@pytest.mark.parametrize(
    "s",
    [Sampling(), Sampling(0.8, seed=1), Sampling(1.0, 2, top_p=0.9), Sampling(0.3, 3, top_p=0.4)],
    ids=["greedy", "t0.8", "t1-top0.9", "t0.3-top0.4"],
)
def test_pick_is_the_documented_rule(s):
    rng = np.random.default_rng(0)
    for step, row in enumerate(_hard_rows(rng, 60, 300)):
        assert pick(row, s, step) == _definition(row, s, step), step
        assert sample(row, s, step)[0] == pick(row, s, step)


def test_nucleus_from_candidates_equals_the_full_sort_even_with_ties():
    rng = np.random.default_rng(1)
    for trial in range(200):
        n = int(rng.integers(1, 3000))
        x = rng.standard_normal(n) * rng.uniform(0.1, 8)
        x = np.round(x) if trial % 2 else x  # ties, also across the candidate boundary
        p = np.exp(x - x.max())
        p /= p.sum()
        top_p = float(rng.uniform(0.01, 1.0))
        order = np.lexsort((np.arange(n), -p))
        want = np.zeros(n)
        want[order[(np.cumsum(p[order]) - p[order]) < top_p]] = 1.0
        assert (nucleus_mask(p, top_p) == want).all(), trial


def test_blocked_cumsum_stays_within_its_stated_error():
    rng = np.random.default_rng(2)
    for v in (7, 1000, 32000, 49152):
        x = rng.exponential(size=(2, v)).astype(np.float32)
        x[1, ::3] = 0.0
        block = max(2, int(np.ceil(v ** (1 / 3))))
        got = np.array(blocked_cumsum(mx.array(x), block))
        exact = np.cumsum(x.astype(np.float64), axis=1)
        err = np.abs(got - exact).max(axis=1) / exact[:, -1]
        assert (err <= scan_error_ulps(v, block) * 2.0**-24).all(), (v, err)


@pytest.mark.parametrize(
    "s",
    [Sampling(0.8, seed=1), Sampling(1.3, 4), Sampling(0.05, 5), Sampling(1.0, 2, top_p=0.9),
     Sampling(0.5, 3, top_p=0.5), Sampling(2.0, 6, top_p=0.99)],
    ids=["t0.8", "t1.3", "t0.05", "top0.9", "top0.5", "t2-top0.99"],
)  # fmt: skip
@pytest.mark.parametrize("v", [1000, 32000])
def test_the_graph_pick_is_the_rule_unless_it_says_so(s, v):
    """Wherever the graph does not flag a step its token is the rule's; flagged steps are
    the host's to decide. And the flag is not the whole story: it stays rare on peaked
    distributions, so the check costs little on real models."""
    rng = np.random.default_rng(v)
    peaked = (rng.standard_normal((60, v)) * 12).astype(np.float32)
    for rows, most_flagged in ((_hard_rows(rng, 100, v), 1.0), (peaked, 0.1)):
        us = np.array([uniform(s.seed, i) for i in range(len(rows))])
        out = np.array(GraphSampler(v, s).pick(mx.array(rows), mx.array(us, mx.float32)))
        want = np.array([pick(r, s, i) for i, r in enumerate(rows)])
        unflagged = out[:, 1] == 0
        assert (out[unflagged, 0] == want[unflagged]).all()
        assert out[:, 1].mean() <= most_flagged


def test_the_graph_flags_a_nucleus_it_cannot_hold():
    """A flat distribution's nucleus reaches past the candidates the graph sorts: every
    step goes to the host, none is decided wrongly."""
    v = 4096
    rows = np.zeros((8, v), np.float32)
    s = Sampling(1.0, 0, top_p=0.9)
    us = mx.array([uniform(0, i) for i in range(8)], mx.float32)
    out = np.array(GraphSampler(v, s).pick(mx.array(rows), us))
    assert (out[:, 1] == 1).all()


def test_greedy_in_the_graph_is_argmax_lowest_id_on_ties():
    x = mx.array([[1.0, 5.0, 5.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    assert np.array(GraphSampler(4, Sampling()).pick(x, None)).tolist() == [1, 0]
