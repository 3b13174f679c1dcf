"""Benchmark the overlapped KV handoff against sequential, local and the physical bound.

Starts a prefill node (torch) and a decode node (mlx) in two Linux network namespaces joined by
a veth pair, shapes the link with `tc ... tbf`, and runs prompts of several lengths three ways:
overlapped, sequential (KV sent after the whole prefill) and local (the decode node prefills).

Per prompt length it first measures, on the unshaped link, the prefill's compute per layer and
the KV bytes per layer, then sets the tbf rate so that one layer's transfer takes `ratio` x one
layer's compute (one link setting per ratio, e.g. 0.6: compute-bound; 1.5: transfer-bound).
On each setting it reports TTFT, the exposed handoff against its target, the overlap
efficiency (T_seq - T_ovl) / (T_seq - T_ideal), with T_ideal the pipelined bound from the
measured per-layer compute times and the link rate measured by a plain TCP socket, and the
transport's throughput against that socket carrying the same bytes over the same link. Then
decode ITL after a handoff against mlx-lm's own prefill + decode of the same prompt, on this
model and on the short-step checkpoint (bench/itl.py: greedy and temperature 0.8, full
precision and a 4-bit decode node). `--itl-only` runs the ITL sections alone.

Every point is repeated and the medians are reported. The two nodes are pinned to one CPU each
(two "machines"), the namespaces and processes are created and removed by the benchmark, and
all traffic stays between its two namespaces. Needs root, iproute2 and both backends.
Human-readable card on stdout, then the last line is one JSON document (`"schema": "exo-split.bench/1"`, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from exo_split.bench import itl, scale
from exo_split.bench.figures import (
    Point,
    Run,
    layer_compute_s,
    render_card,
    render_itl,
    summarize,
)
from exo_split.bench.lab import BenchError, Lab, Progress
from exo_split.bench.prompts import prompt_ids

# Per-layer compute of a few ms (128 tokens) to ~150 ms (4,096 tokens) on one CPU core.
BENCH_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
QUICK_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}
LOCAL_REPEAT_LIMIT_S = 10.0
# ITL is compared at up to two prompt lengths from this one on (mlx-lm's prefill is slow here).
ITL_MIN_TOKENS = 1024


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 128,1024, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0.6,1.5, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, 2 short prompts")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="the vllm prefill node beside the torch one, same decode node and prompts, on "
        "loopback (needs .venv-vllm: make install-vllm; lengths default 1000,3000)",
    )
    p.add_argument("--vllm-budget", type=int, default=2048, help="vLLM's max_num_batched_tokens")
    p.add_argument("--vllm-tp", type=int, default=1, metavar="N",
                   help="with --vllm: also a vllm node with tensor_parallel_size=N")  # fmt: skip
    p.add_argument(
        "--multiturn",
        action="store_true",
        help="instead: a 5-turn conversation on loopback, each turn with and without prefix "
        "reuse (bench/multiturn.py; SmolLM2, or --model, or a tiny model with --quick)",
    )
    p.add_argument(
        "--prefix-cache-bytes",
        type=int,
        metavar="N",
        help="with --multiturn: each node's prefix cache budget (default: the nodes' own)",
    )
    p.add_argument(
        "--suffix-prefill",
        choices=("auto", "local", "remote"),
        default="auto",
        help="with --multiturn: where turns >= 2 with reuse are prefilled (default auto: the "
        "decode node's policy chooses; local: the suffix on the decode node, nothing on the wire)",
    )
    p.add_argument("--lengths", type=_ints, help="prompt lengths (default 128,...,4096)")
    p.add_argument(
        "--ratios", type=_floats, default=[0.6, 1.5], help="transfer/compute per layer per link"
    )
    p.add_argument("--repeats", type=int, help="runs per point, medians reported (default 3)")
    p.add_argument(
        "--scale-lengths",
        type=_ints,
        help="prompt lengths of the real-size points, 8 KV heads x 128 (default "
        "2048,4096,8192,16384: layers of 16-128 MiB; 0: none)",
    )
    p.add_argument("--scale-only", action="store_true", help="only the real-size points")
    p.add_argument("--max-tokens", type=int, help="tokens generated per request (default 24)")
    p.add_argument(
        "--cpus",
        default="auto",
        help="PREFILL,DECODE cpu to pin each node to, or 'none' (default: 0,1 with 2+ cpus)",
    )
    p.add_argument("--model", type=Path, help="a checkpoint to use instead of the bench model")
    p.add_argument("--max-minutes", type=float, help="stop measuring after this (default 45)")
    p.add_argument("--itl-only", action="store_true", help="only the decode ITL sections")
    p.add_argument(
        "--itl-repeats",
        type=int,
        help="repeats of each short-step ITL variant (default: 2 x --repeats, at least 5)",
    )
    p.add_argument("--logs", type=Path, help="keep the nodes' logs in this directory")


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...]
    ratios: tuple[float, ...]
    repeats: int
    max_tokens: int
    itl_lengths: tuple[int, ...]
    itl_tokens: int
    cpus: tuple[int, int] | None
    config: dict
    model: Path | None
    deadline_s: float
    logs: Path | None
    quick: bool
    scale_lengths: tuple[int, ...] = ()
    scale_config: dict | None = None
    scale_only: bool = False
    itl_only: bool = False
    itl_repeats: int = 5


def settings(args) -> Settings:
    quick = args.quick
    lengths = tuple(args.lengths or ((64, 256) if quick else (128, 256, 512, 1024, 2048, 4096)))
    if not lengths or min(lengths) < 2 or not args.ratios or min(args.ratios) <= 0:
        raise BenchError("--lengths must be >= 2 tokens and --ratios > 0")
    # ITL at up to two lengths from 1,024 on: mlx-lm's own prefill is slow on a CPU.
    big = tuple(n for n in lengths if n >= ITL_MIN_TOKENS)[:2]
    default_scale = scale.QUICK_SCALE_LENGTHS if quick else scale.SCALE_LENGTHS
    scale_lengths = tuple(n for n in (args.scale_lengths or default_scale) if n > 0)
    if args.scale_only and not scale_lengths:
        raise BenchError("--scale-only needs --scale-lengths")
    if args.scale_only and args.itl_only:
        raise BenchError("--scale-only and --itl-only exclude each other")
    repeats = max(1, args.repeats or (1 if quick else 3))
    return Settings(
        lengths=lengths,
        ratios=tuple(args.ratios),
        repeats=repeats,
        max_tokens=max(2, args.max_tokens or (6 if quick else 24)),
        itl_lengths=big or (max(lengths),),
        itl_tokens=max(8, 2 * (args.max_tokens or (6 if quick else 24))),
        cpus=cpus_of(args.cpus),
        config=QUICK_CONFIG if quick else BENCH_CONFIG,
        model=args.model,
        deadline_s=60 * (args.max_minutes or (3 if quick else 45)),
        logs=args.logs,
        quick=quick,
        scale_lengths=scale_lengths,
        scale_config=scale.QUICK_SCALE_CONFIG if quick else scale.SCALE_CONFIG,
        scale_only=args.scale_only,
        itl_only=args.itl_only,
        itl_repeats=max(1, args.itl_repeats or (1 if quick else max(5, 2 * repeats))),
    )


def cpus_of(text: str) -> tuple[int, int] | None:
    if text == "none":
        return None
    if text == "auto":
        available = sorted(os.sched_getaffinity(0))
        return (available[0], available[1]) if len(available) >= 2 else None
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise BenchError(
            f"--cpus: expected PREFILL,DECODE like 0,1 or 'none', got {text!r}"
        ) from None
    return a, b


# ---- the model --------------------------------------------------------------------------------


def bench_model(config_overrides: dict, progress: Progress, tag: str = "") -> Path:
    """The bench checkpoint (random Llama weights), built once into the cache directory."""
    from exo_split.models.tiny import DEFAULT_CONFIG, build_llama, default_model_dir

    config = {**DEFAULT_CONFIG, **config_overrides}
    name = "exo-split-bench-{num_hidden_layers}L-{hidden_size}h".format(**config) + f"{tag}-v1"
    out = default_model_dir().parent / name
    if (out / "model.safetensors").is_file():
        return out
    progress(f"building the benchmark model in {out}")
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    build_llama(tmp, config, seed=4321)
    if not out.exists():
        tmp.rename(out)
    return out


# ---- measuring --------------------------------------------------------------------------------


class Bench:
    def __init__(
        self, lab: Lab, s: Settings, spec, progress: Progress, short_models: dict | None = None
    ):
        self.lab, self.s, self.progress = lab, s, progress
        self.short_models = short_models or {}  # the short-step checkpoints: "full", "q4"
        self.spec, self.vocab = spec, spec.vocab_size
        self.t0 = time.monotonic()
        self.skipped: list[str] = []

    def out_of_time(self, what: str) -> bool:
        if time.monotonic() - self.t0 < self.s.deadline_s:
            return False
        self.skipped.append(what)
        return True

    def generate(self, n: int, mode: str, max_tokens: int | None = None) -> Run:
        """One request through the decode node; the report with the client's TTFT."""
        from exo_split.report import build_report, load_report

        max_tokens = max_tokens or self.s.max_tokens
        body = {"token_ids": prompt_ids(n, self.vocab), "max_tokens": max_tokens,
                "fallback": "none", "sampling": {"temperature": 0.0},
                "prefix_cache": False}  # fmt: skip  # repeats must prefill the whole prompt
        if mode == "local":
            body["prefill"] = "local"
        else:
            body |= {"prefill": "remote", "prefill_peer": self.lab.prefill_addr,
                     "overlap": mode == "overlap"}  # fmt: skip
        out = self.lab.call({"op": "generate", "url": self.lab.decode_url, "body": body})
        report = load_report(out["report"])
        if report.timeline.mode != mode:
            raise BenchError(f"asked for a {mode} run, got {report.timeline.mode}")
        timeline = replace(report.timeline, client_ttft_s=out["client_ttft_s"])
        return Run(build_report(timeline), out["tokens"])

    def kv_bytes(self, n: int) -> int:
        """The KV of an n-token prompt in float32 (the bench's dtype)."""
        return n * self.spec.n_layers * 2 * self.spec.n_kv_heads * self.spec.head_dim * 4

    def plain(self, nbytes: int) -> float:
        port = self.lab.ready["source"]["port"]
        cmd = {"op": "socket", "host": self.lab.a.ipv4, "port": port, "nbytes": nbytes}
        return self.lab.call(cmd)["gbps"]

    def warm_up(self) -> None:
        self.progress("warming up both nodes")
        for n in (min(self.s.lengths), max(self.s.lengths)):
            for mode in ("overlap", "sequential"):
                self.generate(n, mode)
        self.generate(min(self.s.lengths), "local")

    def calibrate(self, n: int) -> dict:
        """On the unshaped link: compute per layer (s) and KV bytes per layer of n tokens.

        Sequential runs: their compute is never stalled by a full send queue.
        """
        self.lab.shape(None)
        compute, nbytes = [], []
        for _ in range(min(2, self.s.repeats)):
            r = self.generate(n, "sequential").report
            compute.append(layer_compute_s(r))
            nbytes.append(r.kv_bytes / len(r.pieces))
        return {"compute_per_layer_s": statistics.median(compute),
                "bytes_per_layer": statistics.median(nbytes)}  # fmt: skip

    def point(self, ratio: float, n: int) -> Point:
        """Calibrate (right before, so the machine's load drifts little), shape, measure."""
        cal = self.calibrate(n)
        rate = int(8 * cal["bytes_per_layer"] / (ratio * cal["compute_per_layer_s"]))
        self.progress(
            f"link {ratio:g}x compute, {n} tokens: {cal['compute_per_layer_s'] * 1e3:.1f} ms and "
            f"{cal['bytes_per_layer'] / 1e6:.2f} MB per layer -> tbf {rate / 1e6:,.0f} Mbit/s"
        )
        self.lab.shape(rate)
        pt = Point(ratio, n, rate, cal)
        self.plain(int(cal["bytes_per_layer"]))  # a first transfer through the fresh qdisc
        for rep in range(self.s.repeats):
            # Alternate the order so drift in the machine's load hits both modes alike.
            for mode in ("overlap", "sequential") if rep % 2 == 0 else ("sequential", "overlap"):
                run = self.generate(n, mode)
                pt.runs[mode].append(run)
                if mode == "sequential":
                    pt.plain_gbps.append(self.plain(run.report.kv_bytes))
        return pt

    def itl_pairs(self, n: int) -> list[tuple[Run, dict]]:
        """Decode after a handoff and mlx-lm's own generate_step on the same prompt, in pairs
        run back to back (order alternating), so the machine's load hits both alike."""
        tokens = self.s.itl_tokens
        cmd = {"op": "mlx_lm", "model": str(self.lab.model),
               "token_ids": prompt_ids(n, self.vocab), "max_tokens": tokens}  # fmt: skip
        pairs = []
        for rep in range(self.s.repeats):
            if rep % 2:
                theirs, ours = self.lab.call(cmd), self.generate(n, "overlap", tokens)
            else:
                ours, theirs = self.generate(n, "overlap", tokens), self.lab.call(cmd)
            pairs.append((ours, theirs))
        return pairs

    def run(self) -> dict:
        if self.s.itl_only:
            doc = {"schema": SCHEMA_ITL_ONLY, "itl": self.run_itl(), "repeats": self.s.repeats}
        elif self.s.scale_only:
            doc = {"schema": SCHEMA_SCALE_ONLY}
        else:
            doc = self.run_small()
        if not self.s.scale_only:
            doc["short_step"] = self.run_short_step()
        if self.s.scale_lengths and not self.s.itl_only:
            doc["scale"] = self.run_scale()
        return doc

    def vocab_of(self, model: Path) -> int:
        from exo_split.spec import load_spec

        return load_spec(model).vocab_size

    def run_itl(self) -> list[dict]:
        """The bench model's ITL rows alone (what run_small ends with)."""
        from exo_split.bench.figures import itl_figures

        self.lab.use("")
        out = []
        for n in self.s.itl_lengths:
            self.progress(f"decode ITL: after a handoff and mlx-lm's own, {n} tokens")
            out.append(itl_figures(n, self.itl_pairs(n)))
        return out

    def run_short_step(self) -> dict:
        """bench/itl.py's variants on the short-step checkpoint and its 4-bit copy."""
        self.progress(f"decode ITL on the short-step checkpoint, {self.s.itl_repeats} repeats")
        out = itl.measure(self, self.short_models, self.s.itl_repeats, self.s.quick)
        self.lab.use("")
        return out

    def run_small(self) -> dict:
        self.lab.shape(None)
        self.warm_up()
        unshaped = statistics.median(self.plain(32 * 2**20) for _ in range(3))
        local: dict[int, list[Run]] = {}
        for n in self.s.lengths:
            if self.out_of_time(f"local {n}"):
                continue
            self.progress(f"local prefill, {n} tokens")
            local[n] = [self.generate(n, "local")]
            # A local run far slower than the split needs no repeats: noise cannot change it.
            if local[n][0].report.ttft_s < LOCAL_REPEAT_LIMIT_S:
                local[n] += [self.generate(n, "local") for _ in range(self.s.repeats - 1)]
        points = []
        for ratio in self.s.ratios:
            for n in self.s.lengths:
                if self.out_of_time(f"link {ratio}x, {n} tokens"):
                    continue
                points.append(self.point(ratio, n))
        self.lab.shape(None)
        baseline = {}
        for n in self.s.itl_lengths:
            if self.out_of_time(f"mlx-lm {n}"):
                continue
            self.progress(f"decode ITL: after a handoff and mlx-lm's own, {n} tokens")
            baseline[n] = self.itl_pairs(n)
        return summarize(self.s, unshaped, local, points, baseline, self.skipped)

    def run_scale(self) -> dict:
        """The real-size points (bench/scale.py), on a model with Llama-3.1-8B's KV geometry."""
        from exo_split.spec import load_spec

        self.lab.use("scale")
        model = self.lab.model
        self.spec = load_spec(model)
        self.vocab = self.spec.vocab_size
        points, loads = scale.measure(self, self.s.scale_lengths, self.s.repeats)
        out = scale.summarize(points, loads, self.s.scale_config, self.s.repeats)
        out["model"] = str(model)
        out["skipped"] = list(self.skipped)
        return out


SCHEMA_SCALE_ONLY = "exo-split.bench-scale/1"
SCHEMA_ITL_ONLY = "exo-split.bench-itl/1"


def progress_printer() -> Progress:
    """Progress lines on stderr, stamped with the seconds since this call."""
    t0 = time.monotonic()

    def progress(message: str) -> None:
        print(f"[bench {time.monotonic() - t0:6.1f} s] {message}", file=sys.stderr, flush=True)

    return progress


def main(args) -> int:
    progress, t0 = progress_printer(), time.monotonic()
    s = settings(args)
    model = s.model or bench_model(s.config, progress)
    from exo_split.spec import load_spec

    spec = load_spec(model)
    if s.model is not None:
        config = {"num_hidden_layers": spec.n_layers, "hidden_size": spec.hidden_size,
                  "num_key_value_heads": spec.n_kv_heads, "head_dim": spec.head_dim}  # fmt: skip
        s = replace(s, config=config)
    pair = None
    if s.scale_lengths and not s.itl_only:
        pair = (bench_model(s.scale_config, progress, tag="-kv8x128"), scale.NODE_ARGS)
    short = {}
    if not s.scale_only:
        config = itl.config(s.quick)
        full = bench_model(config, progress, tag=itl.tag(config))
        short = {"full": full, f"q{itl.Q_BITS}": itl.quantized_copy(full, progress)}
    more = None
    if short:
        more = {"short": (short["full"], [], None), "short-q4": (short["full"], [], short["q4"])}
    previous = signal.signal(signal.SIGTERM, terminate)  # so the namespaces are removed
    try:
        with Lab(model, cpus=s.cpus, logs=s.logs, progress=progress, scale=pair,
                 more=more) as lab:  # fmt: skip
            doc = Bench(lab, s, spec, progress, short).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    doc["model"] = doc["scale"]["model"] if s.scale_only else str(model)
    doc["elapsed_s"] = time.monotonic() - t0
    doc["command"] = "exo-split bench " + " ".join(argv_of(args))
    if s.itl_only:
        cards = [render_itl(doc["itl"])] if doc["itl"] else []
    else:
        cards = [] if s.scale_only else [render_card(doc)]
    if "short_step" in doc:
        cards.append(itl.render(doc["short_step"]))
    if "scale" in doc:
        cards.append(scale.render(doc["scale"]))
    print("\n\n".join(cards), flush=True)
    print(json.dumps(doc), flush=True)
    return 0


def terminate(signum, frame) -> None:
    raise KeyboardInterrupt  # unwinds through Lab.close(); the CLI reports it as interrupted


def argv_of(args) -> list[str]:
    """The options given, as they would be typed (for the JSON's `command`)."""
    out = ["--quick"] if args.quick else []
    out += ["--scale-only"] if args.scale_only else []
    out += ["--itl-only"] if getattr(args, "itl_only", False) else []
    for key in ("lengths", "ratios", "repeats", "max_tokens", "cpus", "model", "max_minutes",
                "scale_lengths", "itl_repeats", "prefix_cache_bytes", "suffix_prefill"):  # fmt: skip
        value = getattr(args, key, None)
        if (
            value is None
            or (key in ("cpus", "suffix_prefill") and value == "auto")
            or (key == "ratios" and value == [0.6, 1.5])
        ):
            continue
        text = ",".join(f"{v:g}" for v in value) if isinstance(value, list) else str(value)
        out.append(f"--{key.replace('_', '-')} {text}")
    return out
