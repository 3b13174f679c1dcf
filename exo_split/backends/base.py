"""The contract every backend implements. Backends know token ids and KV, never text.

A backend holds one loaded model. Per request it creates a cache object (its own type),
fills it by `prefill` or by `inject`, then generates with `decode` (the fast loop) or
advances it one token at a time with `step` (logits out, for teacher forcing). Logits leave
a backend as float32 numpy arrays, and every token is picked by sampling.py's one rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from exo_split.kv import LayerKV
from exo_split.sampling import Adjust, Sampling, logprobs_of, pick
from exo_split.spec import ModelSpec, Quantization

OnLayer = Callable[[LayerKV], None]


@dataclass
class Prefilled:
    cache: Any  # the backend's cache object, holding prompt KV
    logits: np.ndarray  # float32 [vocab] at the last prompt position
    # time.perf_counter() when the forward ended (device time on a GPU); prefill() itself
    # returns only once every piece was handed to on_layer, which can be later.
    computed_at: float | None = None
    # prefill(background=True): pieces still being staged (torch's ring), or None: .finish()
    # waits for them (raising the staging's error), .abort() stops them.
    staging: Any = None


@dataclass
class DecodeStats:
    """What a `decode` loop did, for the report. `checked`: steps whose in-graph pick lay
    too close to a sampling boundary for float32 and was redone by the host rule;
    `corrected`: of those, the steps where the host's token differed (and won)."""

    steps: int = 0
    checked: int = 0
    corrected: int = 0
    sizes: list[int] = field(default_factory=list)  # batched: the batch's size at each step
    queue_wait_s: float | None = None  # batched: its KV ready -> its first step queued


class Constraint(Protocol):
    """What a request's grammar (node/grammar.py) tells the decode loop: the tokens the next
    step may pick, given every token accepted so far; `done` once it takes no more."""

    def allowed(self) -> np.ndarray:
        """bool [vocab]: True where the next token may be that id."""
        ...

    def accept(self, token: int) -> None: ...

    @property
    def done(self) -> bool: ...


class Backend(Protocol):
    name: str  # "torch" | "mlx"
    device: str  # "cpu" | "cuda" | "metal" ...
    dtype: str  # "float32" | "float16" | "bfloat16"
    spec: ModelSpec
    quantization: Quantization | None  # the weights' quantization; None: full precision

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        chunk: int | None = None,
        on_layer: OnLayer | None = None,
        should_stop: Callable[[], bool] | None = None,
        capacity: int | None = None,
        cache: Any = None,
        emit_from: int = 0,
    ) -> Prefilled:
        """Run the prompt (`cache`: on top of a cache that already holds its first k < n
        positions, computing only the rest; `emit_from`: hand on only positions
        [emit_from, n), the cached [emit_from, k) of every layer first); hand each (chunk, layer) KV piece to `on_layer` as soon as that
        layer has produced it (host memory, storage dtype of kv.py), chunk-major, then layer,
        then consecutive token ranges (a backend may split a chunk's layer into several).

        `on_layer` may be called from any thread (the compute thread, or a staging thread on
        CUDA) and must not block on the network; a piece with `release` holds a slot of the
        node's staging ring until release() is called (or the piece is dropped). Returns once
        every piece was handed on. `should_stop` is polled as each layer writes its KV: when it
        returns True the prefill raises `Cancelled` (the bound per backend: docs/reliability.md).
        """
        ...

    def stream_kv(
        self,
        cache: Any,
        on_layer: OnLayer,
        *,
        chunk: int | None = None,
        should_stop: Callable[[], bool] | None = None,
        start_pos: int = 0,
    ) -> None:
        """Hand an existing cache's KV (from `start_pos` on) (after a prefill) to `on_layer` the way `prefill` does:
        chunk-major in ranges of `chunk` positions (None: whole layers), then layer. For the
        sequential mode: staging memory stays bounded as during an overlapped prefill."""
        ...

    # Per layer, how many of a prompt's last positions `new_cache(..., prompt_len=n)` keeps
    # (a sliding window, spec.window_keep); None: all; empty: every layer keeps all.
    window_keep: tuple[int | None, ...]

    def new_cache(self, capacity: int, *, prompt_len: int | None = None) -> Any:
        """An empty cache with room for `capacity` positions. `prompt_len`: it is to be filled
        with a prompt of n positions from outside (inject, or received in place): a layer
        with a window may then keep only `window_keep[layer]` of them (kv.window_floor)."""
        ...

    def inject(self, cache: Any, kv: LayerKV) -> None:
        """Write one received piece into the cache (pieces of a layer arrive in order)."""
        ...

    def step(self, cache: Any, token_id: int) -> np.ndarray:
        """Feed one token at the next position; float32 logits [vocab] for the position after."""
        ...

    def decode(
        self,
        cache: Any,
        first_token: int,
        *,
        max_tokens: int,
        sampling: Sampling,
        stop_ids: frozenset[int] = frozenset(),
        should_stop: Callable[[], bool] | None = None,
        stats: DecodeStats | None = None,
        constraint: Constraint | None = None,
        start: int = 1,
        logprobs: list | None = None,
        top_logprobs: int = 0,
        adjust: Adjust | None = None,
    ) -> Iterator[int]:
        """Yield the tokens of generation steps 1..max_tokens-1; `first_token` is step 0's
        (picked from the prefill's logits) and is fed in first. With `start` 0 it is the
        prompt's last token instead (the cache holds the positions before it), and step 0's
        token is yielded first. A `constraint` masks every pick it makes (and takes
        `first_token` when `start` is 1); the loop ends once the constraint is done. With a
        `logprobs` list, each token's `sampling.logprobs_of` entry is appended before it is
        yielded. `adjust` (sampling.Adjust) changes every step's logits before the mask. Each token is the one
        `sampling.pick` gives on the logits this backend computes. Stops after yielding a
        token of `stop_ids`, or between steps once `should_stop()` is true; run it on the
        compute thread, and it has let go of the cache when it returns or is closed."""
        ...

    def warm(self) -> float:
        """Run what the first decode after a handoff would otherwise pay for (kernel builds,
        compilation); seconds taken. Called once at node start."""
        ...

    def close(self) -> None:
        """Release what the backend holds on the calling thread (MLX: its streams); run on
        the compute thread before it exits."""
        ...

    def export(self, cache: Any) -> list[LayerKV]:
        """The cache's KV, one LayerKV per layer."""
        ...

    def memory(self) -> dict | None:
        """The accelerator memory the backend's allocator accounts for, in bytes: `active`
        (held by live arrays), `cache` (freed, kept for reuse), `peak`; None where there is
        no such account (torch on the CPU). GET /v1/info's stats.memory."""
        ...

    def cache_len(self, cache: Any) -> int:
        """The positions every layer holds."""
        ...

    # Prefix reuse (node/prefix.py). Run on the compute thread.

    def trim(self, cache: Any, n: int) -> None:
        """Keep positions [0, n) of every layer (only the length moves)."""
        ...

    def reserve(self, cache: Any, capacity: int) -> None:
        """Room for `capacity` positions: one copy of the layers that are smaller."""
        ...

    def fork(self, cache: Any, n: int, capacity: int) -> Any:
        """A new cache holding a copy of positions [0, n), with room for `capacity`."""
        ...

    def cache_nbytes(self, cache: Any) -> int:
        """Bytes the cache's buffers take (their capacity, not the length used)."""
        ...

    # A model with recurrent layers (layers.py) also has (node/prefix.py's turn snapshots):
    # snapshot(cache) -> list[LayerState], copies of its recurrent layers' states now; and
    # restore(cache, states): those states back, and every KV layer cut to their position.


class Cancelled(Exception):
    """A prefill was stopped by its `should_stop` callback."""


def take(token: int, *takers) -> None:
    """Hand a picked token to what follows the sequence (a Constraint, a sampling.Adjust;
    None: absent), as every decode loop must before its next pick."""
    for taker in takers:
        if taker is not None:
            taker.accept(token)


def serial_decode(
    backend: Any,
    cache: Any,
    first_token: int,
    *,
    max_tokens: int,
    sampling: Sampling,
    stop_ids: frozenset[int] = frozenset(),
    should_stop: Callable[[], bool] | None = None,
    stats: DecodeStats | None = None,
    constraint: Constraint | None = None,
    start: int = 1,
    logprobs: list | None = None,
    top_logprobs: int = 0,
    adjust: Adjust | None = None,
) -> Iterator[int]:
    """`Backend.decode` from `step` and the host rule: one step at a time, logits to the
    host (a constraint's mask applied there). What a backend without a pipelined loop uses
    (torch)."""
    token = first_token
    if start > 0:
        take(token, constraint, adjust)
    for step in range(start, max_tokens):
        if step > 0 and token in stop_ids or (should_stop is not None and should_stop()):
            return
        if constraint is not None and step > start and constraint.done:
            return
        logits = raw = backend.step(cache, token)
        if adjust is not None:
            logits = adjust.apply(logits)
        if constraint is not None:
            logits = np.where(constraint.allowed(), logits, -np.inf).astype(np.float32)
        token = pick(logits, sampling, step)
        take(token, constraint, adjust)
        if logprobs is not None:
            logprobs.append(logprobs_of(raw, token, top_logprobs))
        if stats is not None:
            stats.steps += 1
        yield token
