"""The benchmark's helpers inside its network namespaces: `python -m exo_split.bench.driver`.

`source`: a plain TCP server on the prefill side; a client sends 8 bytes (big-endian length N)
and gets N bytes back, written from one preallocated buffer. `drive`: a worker on the decode
side that reads one JSON command per stdin line and answers one JSON line on stdout:

    {"op": "generate", "url": ..., "body": {...}}      -> {"client_ttft_s", "tokens", "report"}
    {"op": "socket", "host", "port", "nbytes"}         -> {"seconds", "gbps"}
    {"op": "mlx_lm", "model", "token_ids", "max_tokens"} -> {"ttft_s", "token_times", "tokens"}

The plain-socket figure is what the KV transport is held against: the same bytes over the same
link, timed the same way (request sent -> last byte received, on the receiving side).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path

clock = time.perf_counter
_CHUNK = 4 * 2**20
_IDLE_EXIT_S = 3600.0  # a source nobody talks to for this long exits on its own


def serve_source(host: str, ready_file: Path) -> None:
    payload = memoryview(bytes(range(256)) * (_CHUNK // 256))
    with socket.create_server((host, 0)) as server:
        server.settimeout(_IDLE_EXIT_S)
        ready_file.write_text(json.dumps({"port": server.getsockname()[1]}))
        while True:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                return
            with conn:
                conn.settimeout(120)
                header = _recv_exact(conn, 8)
                (left,) = struct.unpack(">Q", header)
                while left:
                    n = min(left, _CHUNK)
                    conn.sendall(payload[:n])
                    left -= n


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def plain_socket(host: str, port: int, nbytes: int, timeout: float = 120.0) -> dict:
    """Receive `nbytes` from a source: seconds from the request to the last byte."""
    buf = memoryview(bytearray(_CHUNK))
    with socket.create_connection((host, port), timeout=timeout) as conn:
        t0 = clock()
        conn.sendall(struct.pack(">Q", nbytes))
        got = 0
        while got < nbytes:
            k = conn.recv_into(buf, min(_CHUNK, nbytes - got))
            if not k:
                raise ConnectionError(f"source closed after {got} of {nbytes} bytes")
            got += k
        seconds = clock() - t0
    return {"seconds": seconds, "gbps": nbytes / seconds / 1e9}


async def generate(url: str, body: dict, token: str) -> dict:
    """One request to the decode node; TTFT as this client sees it."""
    import aiohttp

    from exo_split.transport.client import Timeouts, generate_events

    # A local prefill of 4,096 tokens on one core of MLX's CPU backend takes minutes.
    timeouts = Timeouts(idle=900.0, total=1800.0)
    t0, ttft = clock(), None
    async with aiohttp.ClientSession() as session:
        async for event in generate_events(session, url, token, body, timeouts=timeouts):
            kind = event.get("type")
            if kind == "token" and ttft is None:
                ttft = clock() - t0
            elif kind == "error":
                raise RuntimeError(f"the decode node failed the request: {event.get('message')}")
            elif kind == "done":
                return {"client_ttft_s": ttft, "tokens": event["tokens"], "report": event["report"]}
    raise RuntimeError(f"{url} closed the stream before the request was done")


_MODELS: dict[str, object] = {}


def mlx_lm_generate(model_dir: str, token_ids: list[int], max_tokens: int) -> dict:
    """mlx-lm's own prefill + decode loop (generate_step, greedy) on the same checkpoint.

    Loaded through the MLX backend's loader, which is mlx-lm's load_model with the RoPE keys
    mlx-lm reads filled in from the checkpoint (see backends/mlx_backend.py).
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from exo_split.backends.mlx_backend import load

    if model_dir not in _MODELS:
        _MODELS[model_dir] = load(model_dir, device="cpu").model
    model = _MODELS[model_dir]
    t0 = clock()
    times, tokens = [], []
    for token, _ in generate_step(mx.array(token_ids), model, max_tokens=max_tokens):
        times.append(clock() - t0)
        tokens.append(int(token))
    return {"ttft_s": times[0], "token_times": times, "tokens": tokens}


def drive() -> None:
    token = os.environ["EXO_SPLIT_TOKEN"]
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                out = asyncio.run(generate(cmd["url"], cmd["body"], token))
            elif op == "socket":
                out = plain_socket(cmd["host"], cmd["port"], cmd["nbytes"])
            elif op == "mlx_lm":
                out = mlx_lm_generate(cmd["model"], cmd["token_ids"], cmd["max_tokens"])
            elif op == "quit":
                return
            else:
                out = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # answered, so the benchmark can say what failed
            out = {"error": f"{op}: {type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["source"] and len(argv) == 3:
        serve_source(argv[1], Path(argv[2]))
    elif argv == ["drive"]:
        drive()
    else:
        print("usage: python -m exo_split.bench.driver (source HOST READY_FILE | drive)")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
