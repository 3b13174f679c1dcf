"""The benchmark's two "machines": network namespaces joined by a veth pair, the two nodes,
a plain-socket source and the driver in them, and the link's tc tbf shaping. Everything is
created on entry and removed on exit (processes by pid, then the namespaces).

`loopback=True`: the two nodes and the driver on 127.0.0.1 instead, no namespaces, no
source, no shaping (`bench --multiturn`, which measures reuse, not the link; needs no root).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from exo_split.bench import netns
from exo_split.errors import ExoSplitError

TBF_LATENCY = "50ms"
Progress = Callable[[str], None]
LOOPBACK = netns.Netns(name="", veth="lo", ipv4="127.0.0.1")  # no namespace: the host's loopback


class BenchError(ExoSplitError):
    """The benchmark could not run or a measurement failed."""


class Lab:
    """Two namespaces, the two nodes, a plain-socket source and the driver; all removed on exit."""

    def __init__(
        self,
        model: Path,
        *,
        cpus: tuple[int, int] | None,
        logs: Path | None,
        progress: Progress,
        scale: tuple[Path, list[str]] | None = None,
        more: dict[str, tuple[Path, list[str], Path | None]] | None = None,
        loopback: bool = False,
        node_args: list[str] | None = None,
        warmup: bool = False,
    ):
        self.model, self.cpus, self.logs, self.progress = model, cpus, logs, progress
        self.loopback, self.warmup = loopback, warmup
        # More pairs of nodes (another checkpoint, other node options), started with the
        # first so that their start-up overlaps; idle until `use(name)`. `more` pairs may
        # give the decode node its own checkpoint (a quantized copy of the prefill's).
        self.pairs = {"": (model, node_args or [])} | ({"scale": scale} if scale else {})
        self.decode_models = {name: d for name, (_, _, d) in (more or {}).items() if d}
        self.pairs |= {name: (m, args) for name, (m, args, _) in (more or {}).items()}
        self.token = os.urandom(16).hex()
        self._tmp = tempfile.TemporaryDirectory(prefix="exo-split-bench-")
        self.work = Path(self._tmp.name)
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready: dict[str, dict] = {}
        self._stack = contextlib.ExitStack()
        self.pair = ""

    def __enter__(self) -> Lab:
        reason = None if self.loopback else netns.netns_unavailable_reason()
        if reason is not None:
            raise BenchError(f"cannot create network namespaces: {reason}")
        try:
            if self.loopback:
                self.a = self.b = LOOPBACK
            else:
                self.a, self.b = self._stack.enter_context(netns.netns_pair())
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _env(self, pinned: bool) -> dict[str, str]:
        env = {**os.environ, "EXO_SPLIT_TOKEN": self.token, "EXO_SPLIT_PEERS": ""}
        if pinned:  # one torch thread per pinned core; more would only time-share it
            env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        return env

    def _spawn(self, name: str, ns, cpu: int | None, argv: list[str], **kw) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
        pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        proc = subprocess.Popen(
            [*(netns.ns_exec_prefix(ns) if ns.name else []), sys.executable, *argv],
            stderr=log, env=self._env(cpu is not None), preexec_fn=pin,
            **({"stdout": log, "stdin": subprocess.DEVNULL} | kw),
        )  # fmt: skip
        log.close()
        self.procs[name] = proc
        return proc

    def _start(self) -> None:
        prefill_cpu, decode_cpu = self.cpus or (None, None)
        for pair, (model, node_args) in self.pairs.items():
            self._spawn_nodes(pair, model, node_args)
        sources = [] if self.loopback else ["source"]
        if sources:
            self._spawn("source", self.a, prefill_cpu, ["-m", "exo_split.bench.driver", "source",
                        self.a.ipv4, str(self.work / "source.json")])  # fmt: skip
        self._spawn("driver", self.b, decode_cpu, ["-m", "exo_split.bench.driver", "drive"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        names = [f"{role}{pair and '-' + pair}" for pair in self.pairs for role in ("prefill", "decode")]  # fmt: skip
        for name in (*names, *sources):
            self.ready[name] = self.ready.get(name) or self._wait_ready(name)
        self.use("")
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.procs["driver"].stdout, selectors.EVENT_READ)

    def _spawn_nodes(self, pair: str, model: Path, node_args: list[str]) -> None:
        prefill_cpu, decode_cpu = self.cpus or (None, None)
        # No mDNS (traffic stays between the two namespaces); no start-up speed measurement
        # (the benchmark warms both nodes itself) unless `warmup`: the nodes' policy then
        # chooses where to prefill from the speeds they measured.
        extra = ["--no-mdns", *([] if self.warmup else ["--no-warmup"]), *node_args]
        for role, ns, cpu, backend in (
            ("prefill", self.a, prefill_cpu, "torch"),
            ("decode", self.b, decode_cpu, "mlx"),
        ):
            name = f"{role}{pair and '-' + pair}"
            ckpt = self.decode_models.get(pair, model) if role == "decode" else model
            self._spawn(name, ns, cpu, ["-m", "exo_split", "node", "--model", str(ckpt),
                        "--backend", backend, "--device", "cpu", "--host", ns.ipv4, "--port", "0",
                        "--ready-file", str(self.work / f"{name}.json"), *extra])  # fmt: skip
            if self.loopback and role == "prefill":
                # The decode node knows its prefill peer as a user's static one (--peer), so
                # requests need not name it and its policy chooses: the peer's port first.
                self.ready[name] = self._wait_ready(name)
                extra = [*extra, "--peer", f"{ns.ipv4}:{self.ready[name]['port']}"]

    def use(self, pair: str) -> None:
        """Send the next requests to this pair of nodes ("": the first, "scale")."""
        suffix = pair and "-" + pair
        self.pair, self.model = pair, self.pairs[pair][0]
        self.decode_name = f"decode{suffix}"
        self.decode_url = f"http://{self.b.ipv4}:{self.ready[self.decode_name]['port']}"
        self.prefill_addr = f"{self.a.ipv4}:{self.ready[f'prefill{suffix}']['port']}"

    def decode_pid(self) -> int:
        return self.procs[self.decode_name].pid

    def decode_memory(self) -> dict:
        """The decode node's resident memory now and its peak since `reset_peak()` (bytes)."""
        status = Path(f"/proc/{self.procs[self.decode_name].pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        kib = lambda key: int(fields[key].split()[0]) * 1024  # noqa: E731
        return {"rss": kib("VmRSS"), "peak": kib("VmHWM")}

    def reset_peak(self) -> None:
        """Reset the decode node's peak resident memory (VmHWM) to its current RSS."""
        Path(f"/proc/{self.procs[self.decode_name].pid}/clear_refs").write_text("5")

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.work / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self, name: str, timeout: float = 180.0) -> dict:
        ready, t0 = self.work / f"{name}.json", time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.procs[name].poll() is not None:
                raise BenchError(
                    f"the {name} process exited while starting:\n{self.log_tail(name)}"
                )
            if ready.exists() and ready.stat().st_size:
                self.progress(f"{name} ready ({time.monotonic() - t0:.1f} s)")
                return json.loads(ready.read_text())
            time.sleep(0.05)
        raise BenchError(f"the {name} process was not ready after {timeout:.0f} s")

    def call(self, cmd: dict, timeout: float = 900.0) -> dict:
        """One command to the driver (in the decode namespace); its answer."""
        driver = self.procs["driver"]
        driver.stdin.write(json.dumps(cmd) + "\n")
        driver.stdin.flush()
        if not self._selector.select(timeout):
            raise BenchError(f"the driver did not answer {cmd['op']} within {timeout:.0f} s")
        line = driver.stdout.readline()
        if not line:
            raise BenchError(f"the driver exited:\n{self.log_tail('driver')}")
        out = json.loads(line)
        if "error" in out:
            tails = "\n".join(f"[{n}]\n{self.log_tail(n, 8)}" for n in ("prefill", "decode"))
            raise BenchError(f"{out['error']}\n{tails}")
        return out

    def shape(self, rate_bits: int | None) -> None:
        """tbf on both ends of the veth pair (None: unshaped)."""
        for ns in (self.a, self.b):
            base = [*netns.ns_exec_prefix(ns), "tc", "qdisc"]
            if rate_bits is None:
                subprocess.run([*base, "del", "dev", ns.veth, "root"], capture_output=True)
                continue
            # ~2 ms of bytes per burst: bursts far larger would let short transfers skip the
            # shaping; hrtimer-driven tbf keeps the rate at this size.
            burst = max(rate_bits // 8 // 500, 16 * 1024)
            cmd = [*base, "replace", "dev", ns.veth, "root", "tbf", "rate", f"{rate_bits}bit",
                   "burst", str(burst), "latency", TBF_LATENCY]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            if proc.returncode != 0:
                raise BenchError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")

    def close(self) -> None:
        """Stop every process by its pid (TERM, then KILL), then remove the namespaces."""
        for name, proc in self.procs.items():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            if self.logs is not None:
                self.logs.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):
                    (self.logs / f"{name}.log").write_text(self.log_tail(name, 10**6))
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._stack.close()
        self._tmp.cleanup()
