"""The decode loop on MLX after the handoff: pipelined like mlx-lm's generate_step, with the
token picked inside the graph under sampling.py's rule.

Per step n the loop builds and queues step n+1 (`mx.async_eval`) before it reads step n's
token, so building the graph in Python overlaps the device running step n. A token never
leaves the device to feed the next step; per token only its id (and, when sampling, a flag)
comes back: 4-8 bytes instead of the vocabulary's logits.

Greedy is argmax in the graph (lowest id on a tie, as numpy's). With a temperature,
`GraphSampler` runs the rule's inverse CDF in float32 with the step's uniform drawn on the
host. float32 cannot always settle on which side of a token boundary u falls, so the graph
also bounds its own rounding error and flags the step when u lies within that bound of a
boundary, or when top-p's cut is that uncertain. The host redoes a flagged step with the
rule itself (`sampling.pick`, float64) on the same logits; if it disagrees, the step already
queued with the graph's token is dropped (the caches trimmed by one) and rebuilt. So every
token is exactly the rule's token on the logits this model computes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_reduce
from mlx_lm.models.cache import KVCache

from exo_split.backends.base import Constraint, DecodeStats, take
from exo_split.backends.mlx_cache import is_state, new_layer
from exo_split.sampling import Adjust, Sampling, logprobs_of, pick, uniform

ULP = 2.0**-24  # float32's unit roundoff
# Rounding error of e = exp(z - max z) relative to e, in ULPs, per unit of (max z - z): the
# subtraction (1) and exp's own error, allowing for a fast-math exp on Metal (2), plus a
# constant. An assumption about MLX's exp, and the only one; the tests check it on the CPU.
EXP_ULPS_PER_UNIT, EXP_ULPS = 3.0, 8.0
SCAN_LEVELS = 3  # levels of the blocked cumulative sum: its error is about the sum of the blocks
# Top-p: the graph sorts only this many of the most probable tokens (a sort of the whole
# vocabulary costs ~10 ms on MLX's CPU backend); a nucleus reaching past them is left to
# the host. Real models' nuclei are far smaller; a random-weight model's are not.
NUCLEUS_CANDIDATES = 1024
CLEAR_EVERY = 256  # steps between mx.clear_cache(), as mlx-lm
WARM_SAMPLINGS = (Sampling(), Sampling(temperature=0.8), Sampling(temperature=0.8, top_p=0.9))
# Key lengths of the warm-up: below and above where Metal's attention switches kernels.
WARM_KEY_LENGTHS = (256, 2048)
WARM_STEPS = 3

_streams: dict[str, mx.Stream] = {}
_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def decode_stream() -> mx.Stream:
    """The stream the decode graph runs on (one per device, like mlx-lm's generation_stream),
    made on first use: the default device is settled once the backend has loaded."""
    key = str(mx.default_device())
    if key not in _streams:
        _streams[key] = mx.new_thread_local_stream(mx.default_device())
    return _streams[key]


def release_thread() -> None:
    """Before a thread that ran MLX work exits (the node's compute thread at shutdown): let
    its work finish and destroy the streams it made. Left to thread or process teardown,
    MLX may destroy a stream's worker while it is joinable, and the process aborts with
    `terminate called without an active exception` (exit 134)."""
    for stream in _streams.values():
        mx.synchronize(stream)
    mx.synchronize()
    mx.clear_streams()
    _streams.clear()


def blocked_cumsum(x: mx.array, block: int) -> mx.array:
    """Inclusive cumulative sum over the last axis of [N, V], as scans of `block`-long rows
    plus a (recursively blocked) scan of the row totals. A sequential float32 scan of V
    values errs by up to ~V ulps of the total; this by about the sum of the block lengths."""
    n, v = x.shape
    if v <= block:
        return mx.cumsum(x, axis=-1)
    nb = -(-v // block)
    if nb * block != v:
        x = mx.pad(x, ((0, 0), (0, nb * block - v)))
    rows = mx.cumsum(x.reshape(n, nb, block), axis=-1)
    totals = blocked_cumsum(rows[:, :, -1], block)
    offsets = mx.concatenate([mx.zeros((n, 1), x.dtype), totals[:, :-1]], axis=1)
    return (rows + offsets[:, :, None]).reshape(n, nb * block)[:, :v]


def scan_block(v: int, levels: int = SCAN_LEVELS) -> int:
    return max(2, math.ceil(v ** (1.0 / levels)))


def scan_error_ulps(v: int, block: int) -> float:
    """Worst-case error of blocked_cumsum (any summation order) in ulps of the total: each
    level adds at most its block length, and each recombination one more."""
    ulps, length = 0.0, v
    while length > block:
        ulps += block + 1
        length = -(-length // block)
    return ulps + length + 2


def _at(a: mx.array, i: mx.array) -> mx.array:
    """a[r, i[r]] for each row r."""
    return mx.take_along_axis(a, i[:, None], axis=1)[:, 0]


class GraphSampler:
    """The rule in the graph. `pick(logits [N, V], u [N] float32)` -> int32 [N, 2] of
    (token, flag); flag 1 means the host must decide. Greedy -> uint32 [N] (argmax).

    The flag's margin is a bound on how far the float32 CDF can be from the host's float64
    one, relative to the total mass T: the blocked scan's rounding (`scan_error_ulps`), the
    rounding of each e = exp(z - max z), at most (3 |z - max z| + 8) ulps of e (the one
    assumption, about MLX's exp), summed: <= (8 + 3 ln V) ulps of T, since T >= 1 and
    -sum(e ln e) = T (H - ln T) <= T ln V; and 2 ulps for x = u T.
    """

    def __init__(self, vocab_size: int, sampling: Sampling):
        self.sampling = sampling
        self.block = scan_block(vocab_size)
        self.ulps = scan_error_ulps(vocab_size, self.block) + 2
        self.ulps += EXP_ULPS + EXP_ULPS_PER_UNIT * math.log(vocab_size)
        # The rule scales by float32(1 / T): one correctly rounded multiply on any device.
        self.inv_t = np.float32(1.0 / sampling.temperature) if sampling.temperature else None

    def pick(self, logits: mx.array, u: mx.array | None) -> mx.array:
        if self.inv_t is None:
            return mx.argmax(logits, axis=-1)
        z = logits.astype(mx.float32) * self.inv_t
        e = mx.exp(z - mx.max(z, axis=-1, keepdims=True))
        slack = None
        if self.sampling.top_p < 1.0:
            e, slack = self._nucleus(e)
        cdf = blocked_cumsum(e, self.block)
        total = cdf[:, -1]
        x = u * total
        token = mx.minimum(mx.sum(cdf <= x[:, None], axis=-1), e.shape[-1] - 1).astype(mx.int32)
        hi = _at(cdf, token)
        lo = mx.where(token > 0, _at(cdf, mx.maximum(token - 1, 0)), 0.0)
        # With top-p, the tokens whose place in the nucleus float32 cannot settle: adding or
        # dropping them moves every boundary, relative to x, by at most their mass.
        margin = self.ulps * ULP * total + (slack if slack is not None else 0.0)
        near = (x - lo <= margin) | (hi - x <= margin)
        return mx.stack([token, near.astype(mx.int32)], axis=-1)

    def _nucleus(self, e: mx.array) -> tuple[mx.array, mx.array]:
        """(e outside the nucleus zeroed, the mass of the tokens whose membership is
        uncertain; inf when the nucleus may reach past the NUCLEUS_CANDIDATES most probable
        tokens, which are all the graph sorts)."""
        n, v = e.shape
        k = min(v, NUCLEUS_CANDIDATES)
        srt = mx.sort(mx.topk(e, k, axis=-1) if k < v else e, axis=-1)[:, ::-1]  # descending
        c = mx.cumsum(srt, axis=-1)
        before = mx.concatenate([mx.zeros((n, 1), mx.float32), c[:, :-1]], axis=1)
        total = blocked_sum(e, self.block)[:, None]
        err = self.ulps * ULP * total + k * ULP * c[:, -1:]
        target = self.sampling.top_p * total
        cut = mx.sum(before < target, axis=-1, keepdims=True)  # >= 1: the first always counts
        thresh = mx.take_along_axis(srt, (cut - 1).astype(mx.int32), axis=1)
        # Uncertain: the mass before it is within the error of the cut; or its value is so
        # close to the cut's that float32 may order the two otherwise than float64 does.
        rel = 2 * ULP * (EXP_ULPS + EXP_ULPS_PER_UNIT * -mx.log(mx.maximum(thresh, 1e-38)))
        tied = mx.abs(srt - thresh) <= 2 * rel * thresh  # the cut's token itself included
        tied = tied & (mx.sum(tied, axis=-1, keepdims=True) > 1)
        unsure = (mx.abs(before - target) <= err) | tied
        slack = mx.sum(mx.where(unsure, srt, 0.0), axis=-1)
        beyond = c[:, -1] < target[:, 0] + err[:, 0]  # the candidates may not hold it all
        slack = mx.where(beyond, mx.inf, slack)
        return mx.where(e >= thresh, e, 0.0), slack


def blocked_sum(x: mx.array, block: int) -> mx.array:
    """Sum over the last axis of [N, V] in two levels (its error, like blocked_cumsum's)."""
    n, v = x.shape
    nb = -(-v // block)
    if nb * block != v:
        x = mx.pad(x, ((0, 0), (0, nb * block - v)))
    return mx.sum(mx.sum(x.reshape(n, nb, block), axis=-1), axis=-1)


@dataclass
class _Step:
    step: int
    out: mx.array | None  # int32 [1, 2]: (token, flag); flag 1: the host must decide
    logits: mx.array | None  # kept when the host may have to redo the pick
    u: float | None
    raw: mx.array | None = None  # the model's logits, when log-probabilities are wanted
    lp: tuple | None = None  # (the token's, the top ids, theirs), queued with the pick


class Picker:
    """One sequence's pick, in the graph: the rule (GraphSampler), its adjustments and its
    constraint's mask, the log-probabilities; and on the host, each step's token read back,
    redone when the graph flagged it, and taken (constraint, adjustments, logprobs). The solo
    loop (`decode_steps`) and the batched one (mlx_batch.py) both pick through it, a row of
    the batch's logits each."""

    def __init__(self, vocab_size: int, sampling: Sampling, *, constraint: Constraint | None,
                 adjust: Adjust | None, logprobs: list | None, top_logprobs: int,
                 stats: DecodeStats):  # fmt: skip
        self.sampling, self.constraint, self.adjust = sampling, constraint, adjust
        self.logprobs, self.top_logprobs, self.stats = logprobs, top_logprobs, stats
        self.sampler = GraphSampler(vocab_size, sampling)
        self.greedy = sampling.temperature == 0.0
        # Without a mask or adjustments the pick is queued with the forward; with them it
        # waits for the previous token (taken on the host) while the forward runs.
        self.immediate = constraint is None and adjust is None

    def start(self, step: int, logits: mx.array) -> _Step:
        """A step whose forward gave `logits` [1, V]; call on the decode stream."""
        st = _Step(step, None, logits, None if self.greedy else uniform(self.sampling.seed, step))
        st.raw = logits if self.logprobs is not None else None
        if self.immediate:
            self.pick(st)
        else:
            mx.async_eval(logits)  # the forward runs while the host reads the last token
        return st

    def pick(self, st: _Step) -> None:
        """Queue the step's pick (under the constraint's mask for it, if any); call on the
        decode stream, once every token before the step's has been taken."""
        adjust, constraint = self.adjust, self.constraint
        if adjust is not None:
            z = st.logits.astype(mx.float32)
            if adjust.repetition != 1.0:
                r, seen = mx.array(adjust.repetition), mx.array(adjust.seen)
                z = mx.where(seen, mx.where(z > 0, z / r, z * r), z)
            st.logits = z + mx.array(adjust.additive())
        if constraint is not None:
            allowed = mx.array(constraint.allowed())
            st.logits = mx.where(allowed, st.logits, mx.array(-mx.inf, st.logits.dtype))
        if self.greedy:
            token = self.sampler.pick(st.logits, None).astype(mx.int32)
            st.out = mx.stack([token, mx.zeros_like(token)], axis=-1)
            st.logits = None
            mx.async_eval(st.out)
        else:
            st.out = self.sampler.pick(st.logits, mx.array([st.u], mx.float32))
            mx.async_eval(st.out, st.logits)
        if st.raw is not None:
            st.lp = _graph_logprobs(st.raw, st.out[:, 0], self.top_logprobs)
            mx.async_eval(*st.lp)

    def settle(self, st: _Step, token: int, flagged: int) -> int:
        """The step's token: the graph's, or where it flagged the step, the host rule's."""
        if not flagged:
            return token
        return _host_check(st, token, self.sampling, self.stats)

    def accept(self, st: _Step, token: int) -> None:
        """The step's token is final: count it, hand it to the constraint and adjustments,
        and record its log-probabilities (before it is yielded)."""
        self.stats.steps += 1
        take(token, self.constraint, self.adjust)
        if self.logprobs is not None:
            self.logprobs.append(_read_logprobs(st, token, self.top_logprobs))

    @property
    def finished(self) -> bool:
        return self.constraint is not None and self.constraint.done


def decode_steps(
    model,
    cache: Sequence[KVCache],
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
    """`Backend.decode` for mlx-lm models (see the module docstring). The caches are filled
    to the prompt; one step past the last token yielded is computed and written (as in
    mlx-lm: it was queued before the stop was known), so afterwards cache[0].offset is the
    prompt plus the tokens fed in.

    `start` 0: `first_token` is the prompt's last token (the caches hold the positions
    before it) and the first token yielded is step 0's. With a `constraint`, each step's
    logits outside `constraint.allowed()` are -inf before the pick; the step's forward is
    still queued before the previous token is read, and only the pick waits for the mask.
    `logprobs`, a list: each token's (log-probability, [(id, lp)] of the `top_logprobs` most
    probable) is appended before the token is yielded, computed in the graph with the pick
    (sampling.logprobs_of's numbers; 8 + 8 x top bytes per step come back). `adjust`
    (sampling.Adjust: penalties, logit_bias, min_tokens) changes the logits before the mask
    and the pick, in the graph, and takes each token as the constraint does."""
    stats = stats if stats is not None else DecodeStats()
    if max_tokens <= start or (start > 0 and first_token in stop_ids):
        return
    if start > 0:
        take(first_token, constraint, adjust)
    picker = Picker(vocab_size(model), sampling, constraint=constraint, adjust=adjust,
                    logprobs=logprobs, top_logprobs=top_logprobs, stats=stats)  # fmt: skip
    # Graphs are built on the decode stream, inside each builder: the generator may be
    # suspended between tokens while other jobs run on the thread (node/tokens.py), so no
    # stream context stays open across a yield.
    stream = decode_stream()

    def build(token: mx.array, step: int) -> _Step:
        """Queue step `step`'s forward on `token` ([1]; or a pick's [1, 2] output, whose
        first column it is)."""
        with mx.stream(stream):
            token = token[:, 0] if token.ndim == 2 else token
            return picker.start(step, model(token.reshape(1, 1), cache=cache)[:, -1, :])

    def pick(st: _Step) -> None:
        with mx.stream(stream):
            picker.pick(st)

    cur = pending = None
    try:
        cur = build(mx.array([first_token], mx.int32), start)
        if cur.out is None:
            pick(cur)
        while True:
            pending = None
            if cur.step + 1 < max_tokens:  # queue the next step before reading this one
                pending = build(cur.out, cur.step + 1)
            graph_token, flagged = cur.out[0].tolist()
            token = picker.settle(cur, graph_token, flagged)
            if pending is not None and token != graph_token:
                _settle(pending)  # it ran on the graph's token: undo it
                for c in cache:
                    c.trim(1)
                pending = build(mx.array([token], mx.int32), cur.step + 1)
            picker.accept(cur, token)
            yield token
            if pending is None or token in stop_ids or picker.finished:
                break
            if should_stop is not None and should_stop():
                break
            if cur.step % CLEAR_EVERY == 0:
                mx.clear_cache()
            cur = pending
            if cur.out is None:
                pick(cur)
    finally:
        if pending is not None:
            _settle(pending)  # still writing into the cache: let it finish
        cur = pending = None


def _graph_logprobs(raw: mx.array, token: mx.array, top: int) -> tuple:
    z = raw.astype(mx.float32)
    lse = mx.logsumexp(z, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(z, token.astype(mx.int32)[:, None], axis=1) - lse
    if not top:
        return (chosen,)
    ids = mx.argpartition(-z, top - 1, axis=-1)[:, :top]
    return chosen, ids, mx.take_along_axis(z, ids, axis=1) - lse


def _read_logprobs(st: _Step, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The step's log-probabilities from the graph; from the host when the host's pick
    replaced the graph's (the graph's numbers are for its own token)."""
    chosen = st.lp[0].item()
    graph_token = st.out[0, 0].item()
    if graph_token != token:
        return logprobs_of(np.array(st.raw[0].astype(mx.float32)), token, top)
    if not top:
        return chosen, []
    pairs = zip(st.lp[1][0].tolist(), st.lp[2][0].tolist(), strict=True)
    return chosen, sorted(pairs, key=lambda p: (-p[1], p[0]))


def _settle(st: _Step) -> None:
    mx.eval(st.out if st.out is not None else st.logits)


def _host_check(cur: _Step, token: int, sampling: Sampling, stats: DecodeStats) -> int:
    stats.checked += 1
    ref = pick(np.array(cur.logits[0].astype(mx.float32)), sampling, cur.step, u=cur.u)
    if ref != token:
        stats.corrected += 1
    return ref


def vocab_size(model) -> int:
    """The model's vocabulary (a model of mlx-lm's that wraps a text model keeps it there)."""
    args = getattr(model, "language_model", model).args
    return args.vocab_size


def scratch_cache(spec, dtype: mx.Dtype, offset: int, room: int) -> list[KVCache]:
    """Zero caches at `offset` with `room` positions to spare, shaped like the handoff's."""
    size = -(-(offset + room) // KVCache.step) * KVCache.step
    shape = (1, spec.n_kv_heads, size, spec.head_dim)
    cache = []
    for i in range(spec.n_layers):
        c = new_layer(spec, i, KVCache, _DTYPE_NAMES[dtype])
        if is_state(c):
            c.offset = offset
        else:
            c.keys, c.offset = mx.zeros(shape, dtype), offset
            c.values = mx.zeros((*shape[:3], spec.v_dim), dtype)
        cache.append(c)
    return cache


def warm_decode(model, spec, dtype: mx.Dtype, *, key_lengths=WARM_KEY_LENGTHS,
                samplings=WARM_SAMPLINGS, steps: int = WARM_STEPS) -> float:  # fmt: skip
    """Run the decode loop a few steps for each kind of pick and each class of key length,
    on zero caches (no prefill), so the first decode after a handoff finds every kernel
    built: on the CPU, mx.compile'd functions are compiled to C++ and cached on disk on
    first use; on Metal, kernels and their pipelines are built per process. Seconds taken."""
    t0 = time.perf_counter()
    room = spec.max_position_embeddings - steps - 1
    for n in sorted({min(k, room) for k in key_lengths if room > 0}):
        for s in samplings:
            cache = scratch_cache(spec, dtype, n, steps + 1)
            for _ in decode_steps(model, cache, 3 % spec.vocab_size, max_tokens=steps + 1,
                                  sampling=s):  # fmt: skip
                pass
            del cache
    mx.clear_cache()
    return time.perf_counter() - t0


def wire_memory(model) -> int | None:
    """On Metal, wire the memory Metal recommends for this machine (as mlx-lm does for a
    generation), once for the node's life: the weights and the requests' KV then stay
    resident. None (and nothing done) on the CPU, which has no such limit."""
    limit = mx.device_info().get("max_recommended_working_set_size")
    if not limit:
        return None
    weights = tree_reduce(lambda acc, x: acc + x.nbytes if isinstance(x, mx.array) else acc,
                          model, 0)  # fmt: skip
    if weights > 0.9 * limit:
        import logging

        logging.getLogger(__name__).warning(
            "the model's weights (%.1f GB) are close to Metal's recommended working set "
            "(%.1f GB): decoding may be slow",
            weights / 1e9,
            limit / 1e9,
        )
    mx.set_wired_limit(int(limit))
    return int(limit)
