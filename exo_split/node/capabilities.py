"""What a node can do, measured: its own prefill and decode tokens/s for the loaded model
(a short warm-up, cached on disk per model fingerprint, backend, device, dtype and weight
quantization), and the
link to a peer (a short authenticated GET /v1/probe that streams N bytes).

The node advertises its speeds (mDNS TXT `ptps`/`dtps`, GET /v1/info `capabilities`); the
decode node feeds them, with the link figures, to policy.py. No torch or mlx import here:
the warm-up drives whatever backend object it is given, on the caller's thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from exo_split.backends.base import DecodeStats
from exo_split.errors import PeerUnavailable
from exo_split.node.policy import LinkEstimate
from exo_split.sampling import GREEDY
from exo_split.transport.peer import peer_headers

log = logging.getLogger(__name__)
clock = time.perf_counter

CACHE_VERSION = 3  # 2: prefill speed is the short-to-long slope; 3: decode by Backend.decode
WARMUP_PREFILL_TOKENS = 256
WARMUP_DECODE_STEPS = 32
WARMUP_BUDGET_S = 3.0  # whole warm-up, roughly: prefill gets half, decode the rest
PROBE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Speeds:
    """A node's measured speeds for one model on one backend/device/dtype."""

    prefill_tps: float
    decode_tps: float | None  # None: a backend that only prefills (vllm)
    prefill_tokens: int  # prompt length of the timed prefill
    decode_steps: int  # decode steps timed
    seconds: float  # wall time of the whole warm-up
    key: str  # what it was measured for: cache_key()

    def to_dict(self) -> dict[str, Any]:
        return {"version": CACHE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Speeds:
        if not isinstance(d, Mapping):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        if d.get("version") != CACHE_VERSION:
            raise ValueError(f"cache version {d.get('version')!r} != {CACHE_VERSION}")
        speeds = cls(**{k: v for k, v in d.items() if k != "version"})
        decode_ok = speeds.decode_tps is None or _finite_positive(speeds.decode_tps)
        if not (_finite_positive(speeds.prefill_tps) and decode_ok):
            raise ValueError(f"speeds must be positive numbers, got {speeds}")
        return speeds


def _finite_positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """$EXO_SPLIT_CACHE, else $XDG_CACHE_HOME/exo-split, else ~/.cache/exo-split."""
    if environ.get("EXO_SPLIT_CACHE"):
        return Path(environ["EXO_SPLIT_CACHE"])
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "exo-split"


def cache_key(
    fingerprint: str, backend: str, device: str, dtype: str, quantization: str | None = None
) -> str:
    """A 4-bit copy of a model has the model's fingerprint but not its speed."""
    return f"{fingerprint}-{backend}-{device}-{dtype}" + (
        f"-{quantization}" if quantization else ""
    )


def backend_key(backend: Any) -> str:
    quant = getattr(backend, "quantization", None)
    return cache_key(backend.spec.fingerprint, backend.name, backend.device, backend.dtype,
                     quant.tag if quant is not None else None)  # fmt: skip


def cache_file(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / "capabilities" / f"{key}.json"


def load_cached(cache_dir: Path, key: str) -> Speeds | None:
    """The cached speeds for `key`, or None (absent, unreadable or from another version)."""
    path = cache_file(cache_dir, key)
    try:
        speeds = Speeds.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring the capability cache %s: %s", path, exc)
        return None
    return speeds if speeds.key == key else None


def save_cached(cache_dir: Path, speeds: Speeds) -> Path:
    """Write atomically (a temporary file renamed into place)."""
    path = cache_file(cache_dir, speeds.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(speeds.to_dict(), indent=2))
    tmp.replace(path)
    return path


_SEEDS = itertools.count()


def _prompt(n: int, vocab_size: int) -> list[int]:
    # Ids past the usual specials (0-2); the values do not change the compute. A new prompt
    # each time: an engine with a prefix cache of its own (vLLM) would not compute a repeat.
    rng = np.random.default_rng(next(_SEEDS))
    return rng.integers(3, max(vocab_size, 4), n).tolist()


def _timed_prefill(backend: Any, n: int, capacity: int) -> tuple[float, Any]:
    ids = _prompt(n, backend.spec.vocab_size)
    t0 = clock()
    done = backend.prefill(ids, capacity=capacity)  # logits come back as numpy: synced
    return clock() - t0, done


def measure_speeds(
    backend: Any,
    *,
    prefill_tokens: int = WARMUP_PREFILL_TOKENS,
    decode_steps: int = WARMUP_DECODE_STEPS,
    budget_s: float = WARMUP_BUDGET_S,
) -> Speeds:
    """Warm the backend up and time it, within about `budget_s` seconds in all.

    Prefill speed is the slope between a short and a long prompt (`prefill_tokens`, shrunk
    to fit half the budget): what one more prompt token costs, without the per-call
    overhead that would make a short warm-up look slow. Decode speed is steps per second
    over up to `decode_steps` steps after the long prompt. Run it on the thread that runs
    the backend (MLX streams belong to a thread); an untimed pass first pays one-time costs.
    """
    spec = backend.spec
    t_start = clock()
    room = max(spec.max_position_embeddings - decode_steps - 1, 8)
    short = max(min(32, room // 4), 1)
    backend.prefill(_prompt(min(16, room), spec.vocab_size), capacity=min(16, room) + 1)
    t_short = min(_timed_prefill(backend, short, short + 1)[0] for _ in range(2))
    long = min(prefill_tokens, room)
    if t_short / short * long > budget_s / 2:  # t_short/short overestimates a token's cost
        long = min(long, max(2 * short, int(budget_s / 2 / (t_short / short))))
    t_long, done = _timed_prefill(backend, long, long + decode_steps + 1)
    if t_long < budget_s / 8:  # cheap enough to repeat: the faster run has less noise in it
        t_again, done = _timed_prefill(backend, long, long + decode_steps + 1)
        t_long = min(t_long, t_again)
    if long > short and t_long > t_short:
        prefill_tps = (long - short) / (t_long - t_short)
    else:
        prefill_tps = long / t_long
    t0 = clock()
    deadline = t0 + max(budget_s - (t0 - t_start), budget_s / 4)
    stats = DecodeStats()
    if getattr(backend, "prefill_only", False):  # vLLM: the decode node decodes
        return Speeds(prefill_tps, None, long, 0, clock() - t_start, backend_key(backend))
    for _ in backend.decode(
        done.cache, 3 % spec.vocab_size, max_tokens=decode_steps + 1, sampling=GREEDY,
        should_stop=lambda: stats.steps >= 2 and clock() >= deadline, stats=stats,
    ):  # fmt: skip
        pass
    steps, decode_s = stats.steps, clock() - t0
    key = backend_key(backend)
    return Speeds(
        prefill_tps=prefill_tps,
        decode_tps=steps / decode_s,
        prefill_tokens=long,
        decode_steps=steps,
        seconds=clock() - t_start,
        key=key,
    )


def startup_speeds(executor, backend, cache_dir: Path | None, *, warmup: bool,
                   remeasure: bool, progress: Callable[[str], None]) -> Speeds | None:  # fmt: skip
    """A starting node's prefill and decode tokens/s (on its compute thread `executor`):
    cached, else a short warm-up; None without `warmup`."""
    if not warmup:
        return None
    t0 = time.perf_counter()
    speeds, cached = executor.submit(node_speeds, backend, cache_dir, remeasure=remeasure).result()
    where = f"cached in {cache_dir}" if cached else f"measured in {time.perf_counter() - t0:.1f} s"
    decode = "none" if speeds.decode_tps is None else f"{speeds.decode_tps:.1f} tok/s"
    progress(f"speeds ({where}): prefill {speeds.prefill_tps:.0f} tok/s, decode {decode}")
    return speeds


def node_speeds(
    backend: Any,
    cache_dir: Path | None,
    *,
    remeasure: bool = False,
    measure: Callable[[Any], Speeds] = measure_speeds,
) -> tuple[Speeds, bool]:
    """(speeds, came from the cache). Measures on a miss (or when asked) and caches."""
    key = backend_key(backend)
    if cache_dir is not None and not remeasure:
        cached = load_cached(cache_dir, key)
        if cached is not None:
            return cached, True
    speeds = measure(backend)
    if cache_dir is not None:
        try:
            save_cached(cache_dir, speeds)
        except OSError as exc:
            log.warning("could not cache the measured speeds in %s: %s", cache_dir, exc)
    return speeds, False


# ---- the link -----------------------------------------------------------------------------


async def probe_link(
    session: aiohttp.ClientSession,
    base_url: str,
    token: str | None,
    *,
    nbytes: int = PROBE_BYTES,
    timeout: float = 5.0,
) -> LinkEstimate:
    """Time the link to a peer: the round trip of a 1-byte GET /v1/probe (on a connection
    already open, so connecting is not counted), then the rate of an `nbytes` one, from its
    first body byte to its last. PeerUnavailable if the peer does not answer in `timeout`."""

    async def get(n: int) -> tuple[float, float | None, int, float]:
        target = f"/v1/probe?bytes={n}"
        auth = await peer_headers(session, base_url, token, "GET", target, timeout=timeout)
        t0 = clock()
        async with session.get(
            f"{base_url}{target}", **auth, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            t_head = clock()
            if resp.status != 200:
                raise PeerUnavailable(f"{base_url}: GET /v1/probe answered {resp.status}")
            first_at, after_first = None, 0
            async for chunk in resp.content.iter_any():
                if first_at is None:
                    first_at = clock()
                else:
                    after_first += len(chunk)
            return t_head - t0, first_at, after_first, clock()

    try:
        await get(1)  # opens (or reuses) the connection
        rtt, *_ = await get(1)
        _, first_at, after_first, end = await get(nbytes)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        raise PeerUnavailable(f"{base_url}: link probe failed: {exc!r}") from exc
    if first_at is None or after_first == 0 or end <= first_at:
        raise PeerUnavailable(f"{base_url}: link probe got too little data to time")
    return LinkEstimate(
        bytes_per_s=after_first / (end - first_at), round_trip_s=rtt, source="probe"
    )


__all__ = [
    "PROBE_BYTES",
    "Speeds",
    "backend_key",
    "cache_file",
    "cache_key",
    "default_cache_dir",
    "load_cached",
    "measure_speeds",
    "node_speeds",
    "probe_link",
    "save_cached",
]
