"""The prefill node's overlap on its own device: `python -m exo_split.bench.device [--device D]`.

What `scripts/cuda-check` runs after the CUDA tests: one torch prefill with Llama-3.1-8B's KV
geometry (8 KV heads x 128) through the node's staging ring, each piece sent over a loopback
TCP socket to a receiver that reads at a paced rate (10 Gbit/s by default), as the sender would
to a decode node; then the same prefill with nothing streamed. The card compares:

- compute: the forward alone, and the forward while the pieces stream (slow-down);
- the handoff: last byte received - forward end (exposed), against the pipelined bound for the
  measured per-piece compute stamps (CUDA events on a GPU) at the paced rate;
- the ring: pinned bytes (allocated once, before the first forward), slots, pieces per slot.

On a machine without CUDA it runs the same on the CPU, smaller. Human-readable card, then the
last line is one JSON document. No network beyond 127.0.0.1; every loop is bounded.
"""

from __future__ import annotations

import argparse
import json
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

clock = time.perf_counter
# Llama-3.1-8B's layer on a GPU (4 of its 32 layers, random weights); a small one on the CPU.
SIZES = {
    "cuda": {"num_hidden_layers": 4, "hidden_size": 4096, "intermediate_size": 14336,
             "num_attention_heads": 32, "tokens": 8192, "dtype": "bfloat16"},
    "cpu": {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
            "num_attention_heads": 8, "tokens": 1024, "dtype": "float32"},
}  # fmt: skip
KV_GEOMETRY = {"num_key_value_heads": 8, "head_dim": 128}


def _model(size: dict, out: Path) -> Path:
    from exo_split.models.tiny import DEFAULT_CONFIG, build_llama

    shape = {k: v for k, v in size.items() if k not in ("tokens", "dtype")}
    config = {**DEFAULT_CONFIG, **shape, **KV_GEOMETRY, "vocab_size": 512,
              "max_position_embeddings": 32768}  # fmt: skip
    build_llama(out, config, seed=10)
    return out


class PacedLink:
    """A loopback TCP connection whose receiver reads at most `rate` bytes/s on average."""

    def __init__(self, rate: float, total: int):
        self.rate, self.total = rate, total
        server = socket.create_server(("127.0.0.1", 0))
        self.tx = socket.create_connection(server.getsockname(), timeout=60)
        self.rx, _ = server.accept()
        server.close()
        self.rx.settimeout(60)
        self.last_byte = 0.0
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        buf = memoryview(bytearray(4 * 2**20))
        got, t0 = 0, None
        while got < self.total:  # bounded: exactly the bytes the sender announced
            n = self.rx.recv_into(buf, min(len(buf), self.total - got))
            if not n:
                raise ConnectionError(f"sender closed after {got} of {self.total} bytes")
            t0 = clock() if t0 is None else t0
            got += n
            ahead = got / self.rate - (clock() - t0)
            if ahead > 0:
                time.sleep(ahead)
        self.last_byte = clock()

    def close(self) -> None:
        self.thread.join(120)
        self.tx.close()
        self.rx.close()


def _alone(backend, ids: list[int], per_position: int, rate: float) -> tuple[float, float]:
    """The forward with nothing streamed: its time, and the pipelined bound for its per-piece
    compute stamps (nothing stalls them) at `rate` bytes/s."""
    from exo_split.report.figures import ideal_pipelined_time

    t0 = clock()
    done = backend.prefill(ids)
    marks = done.cache.marks
    ats = [t0, *(m.at for m in marks)]
    compute = [b - a for a, b in zip(ats, ats[1:], strict=False)]
    return done.computed_at - t0, ideal_pipelined_time(
        compute, [m.n * per_position for m in marks], rate
    )


def _streamed(backend, ids: list[int], total: int, rate: float) -> dict:
    """The forward with every piece sent over a paced loopback link as it is staged."""
    import numpy as np

    link = PacedLink(rate, total)
    pieces: queue.SimpleQueue = queue.SimpleQueue()
    stamps: list[tuple[float, int]] = []

    def sender() -> None:  # what the node's sender does: bytes on the wire, then release
        while (kv := pieces.get()) is not None:
            for part in (kv.k, kv.v):
                link.tx.sendall(memoryview(np.ascontiguousarray(part)).cast("B"))
            stamps.append((kv.computed_at, kv.nbytes))
            kv.release()

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    acquired = backend.ring.acquired
    t0 = clock()
    try:
        done = backend.prefill(ids, on_layer=pieces.put)
        returned = clock()
    finally:
        pieces.put(None)
        thread.join(300)
        link.close()
    if sum(s[1] for s in stamps) != total:
        raise RuntimeError(f"{sum(s[1] for s in stamps)} of {total} KV bytes went through")
    if [s[0] for s in stamps] != sorted(s[0] for s in stamps):
        raise RuntimeError("compute stamps out of order")
    return {
        "forward_s": done.computed_at - t0,
        "returned_s": returned - t0,
        "last_byte_s": link.last_byte - t0,
        "exposed_s": link.last_byte - done.computed_at,
        "pieces": backend.ring.acquired - acquired,
    }


def run(
    device: str,
    tokens: int | None = None,
    rate_gbit: float = 10.0,
    repeats: int = 3,
    *,
    small: bool = False,
) -> dict:
    """The measurements, as the JSON document; `small`: the CPU's model on any device."""
    import numpy as np

    from exo_split.backends import load_backend
    from exo_split.kv import itemsize

    size = SIZES["cuda" if device.startswith("cuda") and not small else "cpu"]
    layers, n, dtype = size["num_hidden_layers"], tokens or size["tokens"], size["dtype"]
    with tempfile.TemporaryDirectory(prefix="exo-split-device-") as tmp:
        backend = load_backend("torch", _model(size, Path(tmp)), dtype=dtype, device=device)
    if backend.device == "cpu":
        backend.set_staging(copy=True)  # the GPU's path with plain memory
    ring = backend.ring
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 512, n)]
    backend.prefill(ids[:256])  # warm-up (kernels, allocator)
    per_position = 2 * backend.spec.n_kv_heads * backend.spec.head_dim * itemsize(dtype)
    total, rate = n * layers * per_position, rate_gbit * 1e9 / 8
    alone, streamed = [], []
    for _ in range(repeats):  # interleaved: the machine's load drifts over both alike
        alone.append(_alone(backend, ids, per_position, rate))
        streamed.append(_streamed(backend, ids, total, rate))
    med = statistics.median
    compute, bound = med(a[0] for a in alone), med(a[1] for a in alone)
    last = med(s["last_byte_s"] for s in streamed)
    return {
        "schema": "exo-split.device-overlap/1",
        "device": backend.device,
        "geometry": {**size, **KV_GEOMETRY, "tokens": n, "layers": layers},
        "kv_bytes": total,
        "rate_gbit": rate_gbit,
        "repeats": repeats,
        "ring": {
            "slots": len(ring.slots),
            "slot_bytes": ring.slot_bytes,
            "host_bytes": ring.host_bytes,
            "allocations": ring.allocations,
            "pieces_per_request": streamed[0]["pieces"],
            "in_use_max": ring.in_use_max,
        },  # fmt: skip
        "compute_alone_s": compute,
        "forward_streaming_s": med(s["forward_s"] for s in streamed),
        "slow_down": med(s["forward_s"] / a[0] for s, a in zip(streamed, alone, strict=True)),
        "prefill_returned_s": med(s["returned_s"] for s in streamed),
        "last_byte_s": last,
        "exposed_s": med(s["exposed_s"] for s in streamed),
        "ideal_s": bound,
        "vs_ideal": med(s["last_byte_s"] / a[1] for s, a in zip(streamed, alone, strict=True)),
        "sequential_estimate_s": compute + total / rate,
    }


def render(doc: dict) -> str:
    g, r = doc["geometry"], doc["ring"]
    return "\n".join(
        [
            f"device overlap · torch on {doc['device']} · {g['layers']} layers × "
            f"{g['num_key_value_heads']} KV heads × {g['head_dim']}, {g['tokens']:,} tokens, "
            f"{g['dtype']} · {doc['kv_bytes'] / 2**20:,.0f} MiB of KV · loopback paced to "
            f"{doc['rate_gbit']:g} Gbit/s · medians of {doc['repeats']}",
            f"  ring: {r['slots']} × {r['slot_bytes'] / 2**20:.0f} MiB "
            f"({r['host_bytes'] / 2**20:.0f} MiB host memory, allocated {r['allocations']}× at "
            f"start-up); {r['pieces_per_request']} pieces a request, at most {r['in_use_max']} "
            "slots in use",
            f"  compute alone {doc['compute_alone_s'] * 1e3:,.1f} ms; while streaming "
            f"{doc['forward_streaming_s'] * 1e3:,.1f} ms (× {doc['slow_down']:.2f})",
            f"  last byte received {doc['last_byte_s'] * 1e3:,.1f} ms after the start; exposed "
            f"after the forward {doc['exposed_s'] * 1e3:,.1f} ms; pipelined bound "
            f"{doc['ideal_s'] * 1e3:,.1f} ms (× {doc['vs_ideal']:.2f}); sent after the "
            f"prefill it would be ≈ {doc['sequential_estimate_s'] * 1e3:,.1f} ms",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m exo_split.bench.device", description=__doc__)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--tokens", type=int, help="prompt tokens (default 8192 on CUDA, 1024 on CPU)")
    p.add_argument("--rate-gbit", type=float, default=10.0, help="the paced link (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind (medians)")
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    doc = run(args.device, args.tokens, args.rate_gbit, max(1, args.repeats))
    print(render(doc), flush=True)
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
