"""`exo-split bench --vllm [--model DIR] [--lengths 1000,3000] [--repeats 3]` (also
`scripts/bench-vllm`).

The vllm prefill node beside the torch one, in one run: both serve the same MLX decode node
on 127.0.0.1 (three real node processes; the vllm one from .venv-vllm, `make install-vllm`),
and each prompt goes to both, alternating which goes first. Every request has a prompt of its
own (vLLM's prefix cache would otherwise serve a repeat), except the "prefix hit" rows: the
same prompt again, which each prefill node serves from its own prefix cache (vLLM's automatic
prefix caching; the torch node's PrefixCache, 2 GB); the decode node has none, so every
position travels each time. Per node and length, medians
of: the prefill's compute time (the prefill node's own clock), the exposed handoff (the
decode node's KV-complete minus the prefill's end), the hidden fraction of the transfer, and
TTFT as the client sees it. Ratios are each vllm node's / torch's. The nodes get the same
threads (OMP_NUM_THREADS, default: all cores; vLLM would otherwise take one). `--vllm-tp N`
adds a third prefill node, vLLM with tensor_parallel_size=N (each worker process bound to
one of the first N cores: VLLM_CPU_OMP_THREADS_BIND), whose workers' KV heads reach the node
through its relay and travel as N head ranges.

Prints a Markdown table and one JSON line; docs/BENCHMARKS.md "vLLM as the prefill engine".
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from exo_split.bench.driver import generate

ROOT = Path(__file__).resolve().parents[2]

TOKEN = "bench-vllm-token-0123456789"


def start(model: Path, backend: str, python: str, work: Path, *extra: str, name: str = "",
          env: dict | None = None) -> subprocess.Popen:  # fmt: skip
    name = name or backend
    ready = work / f"ready-{name}.json"
    log = (work / f"{name}.log").open("w")
    cache = "2G" if backend == "torch" else "0"  # the decode node: none; vLLM: its own
    cmd = [python, "-m", "exo_split", "node", "--model", str(model), "--backend", backend,
           "--host", "127.0.0.1", "--port", "0", "--no-mdns", "--prefix-cache-bytes", cache,
           "--ready-file", str(ready), *extra]  # fmt: skip
    env = {**os.environ, "EXO_SPLIT_TOKEN": TOKEN, "EXO_SPLIT_CACHE": str(work / "cache"),
           **(env or {})}  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    proc.ready, proc.log_path = ready, work / f"{name}.log"  # type: ignore[attr-defined]
    return proc


def wait(proc, timeout: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a node exited:\n{proc.log_path.read_text()[-3000:]}")
        if proc.ready.exists() and proc.ready.stat().st_size:
            return json.loads(proc.ready.read_text())
        time.sleep(0.2)
    raise SystemExit(f"a node was not ready after {timeout} s")


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    import numpy as np

    return [1] + np.random.default_rng(seed).integers(3, vocab, n - 1).tolist()


def one(decode_url: str, peer: str, ids: list[int]) -> dict:
    body = {"token_ids": ids, "max_tokens": 2, "prefill_peer": peer, "prefix_cache": True}
    out = asyncio.run(generate(decode_url, body, TOKEN))
    rep = out["report"]
    if rep["fallback"] is not None:
        raise SystemExit(f"the split fell back: {rep['fallback']}")
    return {"compute": rep["prefill_compute_s"], "exposed": rep["exposed_handoff_s"],
            "hidden": rep["hidden_fraction"], "ttft": out["client_ttft_s"]}  # fmt: skip


def main(args) -> int:
    """`exo-split bench --vllm`: args.model (a checkpoint directory), args.lengths (None: 1000,
    3000), args.repeats (None: 3), args.vllm_budget."""
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    if not vllm_python.exists():
        raise SystemExit("no .venv-vllm: run `make install-vllm` first")
    model = Path(args.model)
    config = json.loads((model / "config.json").read_text())
    vocab = config["vocab_size"]
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    lengths = list(args.lengths or (1000, 3000))
    repeats, budget, tp = args.repeats or 3, args.vllm_budget, getattr(args, "vllm_tp", 1)
    engine = ["--engine-arg", f"max_num_batched_tokens={budget}",
              "--engine-arg", "kv_cache_memory_bytes=1073741824",
              "--engine-arg", f"max_model_len={max(max(lengths) + 64, 512)}"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        procs = {"mlx": start(model, "mlx", sys.executable, work),
                 "torch": start(model, "torch", sys.executable, work),
                 "vllm": start(model, "vllm", str(vllm_python), work, *engine)}  # fmt: skip
        if tp > 1:
            cpus = sorted(os.sched_getaffinity(0))[:tp]
            procs[f"vllm-tp{tp}"] = start(
                model, "vllm", str(vllm_python), work, *engine, "--engine-arg",
                f"tensor_parallel_size={tp}", name=f"vllm-tp{tp}",
                env={"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cpus))})  # fmt: skip
        try:
            infos = {name: wait(proc) for name, proc in procs.items()}
            decode = f"http://127.0.0.1:{infos.pop('mlx')['port']}"
            peers = {name: f"127.0.0.1:{info['port']}" for name, info in infos.items()}
            rows = run(decode, peers, lengths, repeats, vocab)
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(30)
    print(render(rows, model.name, repeats, budget))
    print(json.dumps({"schema": "exo-split.bench-vllm/1", "model": model.name,
                      "threads": os.environ["OMP_NUM_THREADS"], "rows": rows}))  # fmt: skip
    return 0


def run(decode: str, peers: dict, lengths: list[int], repeats: int, vocab: int) -> list[dict]:
    for i, peer in enumerate(peers.values()):  # each path's first request, untimed
        one(decode, peer, prompt(64, 999 - i, vocab))
    rows = []
    for n in lengths:
        got: dict[str, list[dict]] = {name: [] for name in peers}
        hit: dict[str, list[dict]] = {name: [] for name in peers}
        for r in range(repeats):
            order = list(peers) if r % 2 == 0 else list(reversed(peers))
            ids = prompt(n, 1000 * n + r, vocab)
            for name in order:
                got[name].append(one(decode, peers[name], ids))
            for name in order:  # the same prompt again: vLLM's prefix cache holds it
                hit[name].append(one(decode, peers[name], ids))
            print(f"{n} tokens, run {r + 1}/{repeats}: " + ", ".join(
                f"{k} {got[k][-1]['compute']:.3f} s / hit {hit[k][-1]['compute']:.3f} s"
                for k in order), flush=True)  # fmt: skip
        for label, runs in (("new prompt", got), ("prefix hit", hit)):
            med = {
                k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()
            }
            ratios = {k: {"compute": med[k]["compute"] / med["torch"]["compute"],
                          "ttft": med[k]["ttft"] / med["torch"]["ttft"]}
                      for k in med if k != "torch"}  # fmt: skip
            rows.append({"tokens": n, "case": label, **{k: med[k] for k in med},
                         "compute_ratio": ratios["vllm"]["compute"],
                         "ttft_ratio": ratios["vllm"]["ttft"], "ratios": ratios})  # fmt: skip
    return rows


def render(rows: list[dict], model: str, repeats: int, budget: int) -> str:
    out = [f"{model}, {repeats} runs per point (medians), vLLM budget {budget}, "
           f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}", "",
           "| tokens | case | torch prefill | vllm prefill | vllm / torch | torch TTFT | "
           "vllm TTFT | vllm / torch | exposed handoff torch / vllm | hidden torch / vllm |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        t = r["torch"]
        for name, ratio in r["ratios"].items():  # a row per vllm node
            v = r[name]
            out.append(
                f"| {r['tokens']} | {r['case']}{'' if name == 'vllm' else f' ({name})'} | "
                f"{t['compute']:.3f} s | {v['compute']:.3f} s | {ratio['compute']:.2f}x | "
                f"{t['ttft']:.3f} s | {v['ttft']:.3f} s | {ratio['ttft']:.2f}x | "
                f"{t['exposed']:.3f} / {v['exposed']:.3f} s | {t['hidden']:.2f} / {v['hidden']:.2f} |"
            )
    return "\n".join(out)
