"""The benchmark's helpers inside its network namespaces: `python -m exo_split.bench.driver`.

`source`: a plain TCP server on the prefill side; a client sends 8 bytes (big-endian length N)
and gets N bytes back, written from one preallocated buffer. `drive`: a worker on the decode
side that reads one JSON command per stdin line and answers one JSON line on stdout:

    {"op": "generate", "url": ..., "body": {...}}      -> {"client_ttft_s", "tokens", "text",
                                                            "report"}
    {"op": "socket", "host", "port", "nbytes"}         -> {"seconds", "gbps"}
    {"op": "mlx_lm", "model", "token_ids", "max_tokens"} -> {"ttft_s", "token_times", "tokens"}

`generate` with "cpu_pid" (the decode node's pid) also answers "cpu": that process's CPU
time from the first token event to `done`, per kind of thread (`thread_cpu`); `mlx_lm` with
"temperature" > 0 samples with mlx-lm's own sampler (seeded by "seed") and always answers
"cpu" of its own process from the first token to the last; `mlx_lm` with "prefill_model"
decodes from a handoff (a torch prefill of that checkpoint, injected) instead of mlx-lm's own
prefill.

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


def thread_cpu(pid: int) -> dict[str, int]:
    """CPU time (ns, the scheduler's) of a process's threads by kind: "main" (the Python
    main thread: a node's event loop), "compute" (a node's compute thread, named by
    node/agent.py) and "mlx" (all others: MLX's stream workers). Linux /proc."""
    from exo_split.node.threads import COMPUTE_THREAD

    out = {"main": 0, "compute": 0, "mlx": 0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
        kind = "main" if int(tid) == pid else "compute" if name == COMPUTE_THREAD else "mlx"
        out[kind] += ns
    return out


def _cpu_since(before: dict[str, int], pid: int) -> dict[str, int]:
    after = thread_cpu(pid)
    return {k: after[k] - before[k] for k in after}


async def generate(url: str, body: dict, token: str, cpu_pid: int | None = None) -> dict:
    """One request to the decode node; TTFT as this client sees it."""
    import aiohttp

    from exo_split.transport.client import Timeouts, generate_events

    # A local prefill of 4,096 tokens on one core of MLX's CPU backend takes minutes.
    timeouts = Timeouts(idle=900.0, total=1800.0)
    t0, ttft, cpu = clock(), None, None
    async with aiohttp.ClientSession() as session:
        async for event in generate_events(session, url, token, body, timeouts=timeouts):
            kind = event.get("type")
            if kind == "token" and ttft is None:
                ttft = clock() - t0
                cpu = thread_cpu(cpu_pid) if cpu_pid else None
            elif kind == "error":
                raise RuntimeError(f"the decode node failed the request: {event.get('message')}")
            elif kind == "done":
                out = {"client_ttft_s": ttft, "tokens": event["tokens"], "text": event.get("text"),
                       "report": event["report"]}  # fmt: skip
                if cpu is not None:
                    out["cpu"] = _cpu_since(cpu, cpu_pid)
                return out
    raise RuntimeError(f"{url} closed the stream before the request was done")


_MODELS: dict[tuple[str, str], object] = {}


def _backend(kind: str, model_dir: str):
    """A backend on the CPU, loaded once per process."""
    if (kind, model_dir) not in _MODELS:
        from exo_split.backends import load_backend

        _MODELS[kind, model_dir] = load_backend(kind, model_dir, device="cpu")
    return _MODELS[kind, model_dir]


def mlx_lm_generate(
    model_dir: str,
    token_ids: list[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    prefill_model: str | None = None,
) -> dict:
    """mlx-lm's decode loop (generate_step: greedy, or its own sampler at a temperature) on
    the checkpoint `model_dir`.

    Without `prefill_model`, mlx-lm's own prefill of the prompt comes first. With it, the
    prompt is prefilled by the torch backend on that (full-precision) checkpoint and its KV
    injected layer by layer into the MLX cache, as a decode node receives it; token 0 is
    picked by the prefill's rule (sampling.sample), and generate_step decodes from there:
    the same handed-off state the split's decode node starts from.

    Loaded through the MLX backend's loader, which is mlx-lm's load_model with the RoPE keys
    mlx-lm reads filled in from the checkpoint (see backends/mlx_backend.py); a quantized
    checkpoint keeps its scales as saved, as mlx-lm's own load does.
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    decode = _backend("mlx", model_dir)
    sampler = make_sampler(temp=temperature) if temperature > 0 else None
    mx.random.seed(seed)
    t0 = clock()
    times, tokens, cpu = [], [], None
    prompt, cache = mx.array(token_ids), None
    if prefill_model is not None:
        from exo_split.handoff import prefill_into
        from exo_split.sampling import Sampling, sample

        cache, logits = prefill_into(_backend("torch", prefill_model), decode, token_ids,
                                     capacity=len(token_ids) + max_tokens)  # fmt: skip
        first, _ = sample(logits, Sampling(temperature=temperature, seed=seed), 0)
        times.append(clock() - t0)
        tokens.append(first)
        cpu = thread_cpu(os.getpid())
        prompt, max_tokens = mx.array([first]), max_tokens - 1
    for token, _ in generate_step(prompt, decode.model, max_tokens=max_tokens, sampler=sampler,
                                  prompt_cache=cache):  # fmt: skip
        times.append(clock() - t0)
        tokens.append(int(token))
        if cpu is None:
            cpu = thread_cpu(os.getpid())
    return {"ttft_s": times[0], "token_times": times, "tokens": tokens,
            "cpu": _cpu_since(cpu, os.getpid())}  # fmt: skip


def drive() -> None:
    token = os.environ["EXO_SPLIT_TOKEN"]
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                out = asyncio.run(generate(cmd["url"], cmd["body"], token, cmd.get("cpu_pid")))
            elif op == "socket":
                out = plain_socket(cmd["host"], cmd["port"], cmd["nbytes"])
            elif op == "mlx_lm":
                out = mlx_lm_generate(cmd["model"], cmd["token_ids"], cmd["max_tokens"],
                                      temperature=cmd.get("temperature", 0.0),
                                      seed=cmd.get("seed", 0),
                                      prefill_model=cmd.get("prefill_model"))  # fmt: skip
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
