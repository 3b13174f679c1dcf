"""How a local prefill shares the decode node's one compute thread with the requests decoding.

A prompt the decode node prefills itself runs as jobs of a few hundred positions (slices);
between two of them the batch takes its decode step. While nothing else decodes a slice is
`max_tokens` long (few jobs, little overhead); while others do, it is sized to about
`target_s` seconds at the node's learned prefill speed, so a running stream waits at most
about that long for its next token. The trade is the user's (`exo-split node
--local-slice`, `--local-slice-ms`): short slices keep the streams' ITL low, long ones spend
fewer decode steps of a small batch while prompts wait (measured on MLX's CPU backend, 4 s
slices did not raise a burst's throughput and doubled its ITL p99: docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

LOCAL_SLICE = 512  # prompt positions per job of a local prefill, at most (the default)
MIN_SLICE = 32  # ... and at least, while others decode
SLICE_S = 0.25  # a slice's target length while others decode (the default)


@dataclass(frozen=True)
class Slicing:
    """`max_tokens`: positions per job, at most; `target_s`: while others decode, a job's
    length in seconds (0: always `max_tokens`); `min_tokens`: a job's positions, at least."""

    max_tokens: int = LOCAL_SLICE
    target_s: float = SLICE_S
    min_tokens: int = MIN_SLICE

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.min_tokens < 1 or not self.target_s >= 0:
            raise ValueError(f"invalid {self}: expected positions >= 1 and seconds >= 0")

    def positions(self, speed: float | None, busy: bool) -> int:
        """Positions for the next job: `max_tokens` unless others decode (`busy`) and the
        node's prefill speed (tok/s) is known; then about `target_s` seconds' worth, within
        [min_tokens, max_tokens]."""
        if not busy or not speed or self.target_s == 0:
            return self.max_tokens
        low = min(self.max_tokens, self.min_tokens)
        return max(low, min(self.max_tokens, int(speed * self.target_s)))
