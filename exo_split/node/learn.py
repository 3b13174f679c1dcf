"""What the policy learns from the requests a node serves (issue 19): prefill speeds per
prompt-length range, the start-up probe only their prior.

A probe is a few seconds at start-up, and it is cached: made while the box was busy, it
can be off by 20x and stay so (a torch node measured 30 tok/s against ~570 in real
requests, and no request went to it again). So every real prefill is a measurement:

- the decode node learns its own local prefill speed from its local prefills, and each
  peer's from that peer's compute span in the stream's END record (report:
  `prefill_compute_s` over `prefix.computed_tokens`);
- a prefill node learns its own from the prefills it serves, advertises the learned figure
  (mDNS, GET /v1/info) and rewrites its cached one;
- a peer that has only its probe behind it, that the policy would not pick, is *explored*
  once in a while: one long prompt goes to it (the report says so), and that request is the
  measurement. At most once per peer per EXPLORE_EVERY_S, and only for prompts long enough
  that a remote prefill is the usual choice (FIXED_THRESHOLD_TOKENS), so a slow peer costs
  one request per period.

Per range the estimate is an exponential average (weight NEW_WEIGHT on the newest); a
range never seen borrows the nearest range that was, else the prior. The report's decision
says which figure it used and where it came from (`figure_sources`).
"""

from __future__ import annotations

import bisect
import math
import threading
import time

from exo_split.node.policy import FIXED_THRESHOLD_TOKENS

RANGES = (512, 2048, 8192, 32768)  # upper bounds of the prompt-length ranges; one more open
NEW_WEIGHT = 0.5
MIN_TOKENS = 32  # shorter prefills measure overheads, not speed
EXPLORE_EVERY_S = 600.0
EXPLORE_MIN_TOKENS = FIXED_THRESHOLD_TOKENS


def _range(tokens: int) -> int:
    return bisect.bisect_left(RANGES, tokens)


def _label(i: int) -> str:
    lo = RANGES[i - 1] + 1 if i else 1
    return f"{lo}-{RANGES[i]}" if i < len(RANGES) else f">{RANGES[-1]}"


class SpeedEstimate:
    """A prefill speed (tokens/s) per prompt-length range."""

    def __init__(self, prior: float | None = None):
        self.prior = prior
        self._learned: dict[int, tuple[float, int]] = {}  # range -> (tokens/s, requests)
        self._lock = threading.Lock()

    def observe(self, tokens: int, seconds: float) -> bool:
        """Take one real prefill of `tokens` in `seconds`; False if it measures nothing."""
        if tokens < MIN_TOKENS or not (seconds > 0 and math.isfinite(seconds)):
            return False
        tps = tokens / seconds
        with self._lock:
            old = self._learned.get(_range(tokens))
            new = tps if old is None else (1 - NEW_WEIGHT) * old[0] + NEW_WEIGHT * tps
            self._learned[_range(tokens)] = (new, (old[1] if old else 0) + 1)
        return True

    @property
    def learned(self) -> bool:
        return bool(self._learned)

    def value(self, tokens: int) -> tuple[float | None, str]:
        """(tokens/s for a prompt of `tokens`, where it comes from: "learned (N requests,
        RANGE tokens)", "probe" or "unknown")."""
        with self._lock:
            if self._learned:
                want = _range(tokens)
                i = min(self._learned, key=lambda r: (abs(r - want), -r))
                tps, n = self._learned[i]
                return tps, f"learned ({n} request{'s' * (n != 1)}, {_label(i)} tokens)"
        return self.prior, "probe" if self.prior is not None else "unknown"

    def headline(self) -> float | None:
        """One figure to advertise: the learned one of the longest range seen, else the prior."""
        with self._lock:
            if self._learned:
                return self._learned[max(self._learned)][0]
        return self.prior

    def to_dict(self) -> dict:
        with self._lock:
            learned = {_label(i): {"tps": round(t, 1), "requests": n}
                       for i, (t, n) in sorted(self._learned.items())}  # fmt: skip
        return {"prior": self.prior, "learned": learned}


class Explorer:
    """When to send a request to a peer the policy would pass over, to measure it."""

    def __init__(self, every_s: float = EXPLORE_EVERY_S, min_tokens: int = EXPLORE_MIN_TOKENS):
        self.every_s, self.min_tokens = every_s, min_tokens
        self._last: dict[str, float] = {}

    def should(self, url: str, tokens: int, estimate: SpeedEstimate) -> bool:
        if estimate.learned or tokens < self.min_tokens:
            return False
        now = time.monotonic()
        if now - self._last.get(url, -math.inf) < self.every_s:
            return False
        self._last[url] = now
        return True


class Learned:
    """A decode node's learned speeds: its own local prefill and each prefill peer's."""

    def __init__(self, local_prior: float | None):
        self.local = SpeedEstimate(local_prior)
        self._peers: dict[str, SpeedEstimate] = {}
        self.explorer = Explorer()

    def peer(self, url: str | None, info=None) -> SpeedEstimate:
        """The estimate for the peer at `url`; its prior follows what it advertises."""
        if url is None:
            return SpeedEstimate(info.prefill_tps if info is not None else None)
        est = self._peers.setdefault(url, SpeedEstimate())
        if info is not None and info.prefill_tps is not None:
            est.prior = info.prefill_tps
        return est

    def served(self, tokens: int, seconds: float) -> float | None:
        """A prefill this node served for a peer: its new headline speed when it moved by
        more than a fifth (worth advertising and caching), else None."""
        before = self.local.headline()
        if not self.local.observe(tokens, seconds):
            return None
        now = self.local.headline()
        return now if not before or abs(now - before) > 0.2 * before else None

    def sources(self, url: str | None, info, tokens: int) -> dict:
        """Where the decision's two speeds came from (the report's `figure_sources`)."""
        peer = self.peer(url, info).value(tokens)[1] if url is not None else None
        return {"local_prefill_tps": self.local.value(tokens)[1], "peer_prefill_tps": peer}

    def explore(self, url: str | None, tokens: int) -> dict:
        """The decision's change when this request should measure the peer instead."""
        if url is None or not self.explorer.should(url, tokens, self.peer(url)):
            return {}
        return {"choice": "remote", "explored": True,
                "reason": "exploring: the prefill peer's speed is only its start-up probe "
                "(measured under load, it may be far off); this request measures it"}  # fmt: skip

    def observe(self, report: dict, url: str | None) -> None:
        """Learn from a finished request's report: the peer's speed (`url`) or ours."""
        if report.get("fallback"):
            return  # the remote part failed; the local redo ran under other conditions
        tokens = (report.get("prefix") or {}).get("computed_tokens")
        seconds = report.get("prefill_compute_s")
        if isinstance(tokens, int) and isinstance(seconds, int | float):
            (self.peer(url) if url is not None else self.local).observe(tokens, seconds)

    def to_dict(self) -> dict:
        return {"local": self.local.to_dict(),
                "peers": {u: e.to_dict() for u, e in self._peers.items()}}  # fmt: skip
