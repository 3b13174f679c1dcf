"""The local demo: two real node agents as child processes on 127.0.0.1, one split request.

`LocalPair` starts a torch prefill agent and an MLX decode agent (`python -m exo_split node`),
waits until both are ready, and always stops them: on success, on error, on Ctrl-C and on
SIGTERM, no child process is left running and no port stays bound. The demo token is made
up for the run and handed to the children in their environment; the user's token file is
neither read nor written.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from exo_split.errors import ExoSplitError

Progress = Callable[[str], None]


class LocalPair:
    """A prefill node (torch) and a decode node (mlx) for one model, on loopback."""

    def __init__(
        self,
        model_dir: Path,
        *,
        progress: Progress,
        discover: bool = False,
        ready_timeout: float = 180.0,
        dtype: str = "float32",
    ):
        self.model_dir = model_dir
        self.progress = progress
        self.discover = discover
        self.ready_timeout = ready_timeout
        self.dtype = dtype
        self.token = secrets.token_urlsafe(24)
        self.children: dict[str, subprocess.Popen] = {}
        self.ready: dict[str, dict] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="exo-split-demo-")
        self.workdir = Path(self._tmp.name)

    def env(self) -> dict[str, str]:
        return {**os.environ, "EXO_SPLIT_TOKEN": self.token, "EXO_SPLIT_PEERS": ""}

    def _start(self, role: str, backend: str, *extra: str) -> None:
        ready = self.workdir / f"{role}.json"
        log = open(self.workdir / f"{role}.log", "w")  # noqa: SIM115 - the child owns it
        cmd = [sys.executable, "-m", "exo_split", "node", "--model", str(self.model_dir),
               "--backend", backend, "--dtype", self.dtype, "--host", "127.0.0.1",
               "--port", "0", "--ready-file", str(ready), *extra]  # fmt: skip
        # The demo names the prefill node and forces remote prefill: no speed warm-up needed.
        cmd.append("--no-warmup")
        if not self.discover:
            cmd.append("--no-mdns")
        self.children[role] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env()
        )
        log.close()

    def log_tail(self, role: str, lines: int = 15) -> str:
        path = self.workdir / f"{role}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait(self, role: str) -> dict:
        t0 = time.monotonic()
        ready = self.workdir / f"{role}.json"
        while time.monotonic() - t0 < self.ready_timeout:
            proc = self.children[role]
            if proc.poll() is not None:
                raise ExoSplitError(
                    f"the {role} node exited with status {proc.returncode} while starting:\n"
                    + self.log_tail(role)
                )
            if ready.exists() and ready.stat().st_size:
                info = json.loads(ready.read_text())
                self.progress(
                    f"{role} node ready: {info['backend']} on {info['device']} at {info['url']} "
                    f"({time.monotonic() - t0:.1f} s)"
                )
                return info
            time.sleep(0.05)
        raise ExoSplitError(
            f"the {role} node was not ready after {self.ready_timeout:.0f} s:\n"
            + self.log_tail(role)
        )

    def __enter__(self) -> LocalPair:
        try:
            self.progress("starting the prefill node (torch) and the decode node (mlx) ...")
            self._start("prefill", "torch")
            self._start("decode", "mlx")
            self.ready["prefill"] = self._wait("prefill")
            self.ready["decode"] = self._wait("decode")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def addr(self, role: str) -> str:
        return f"127.0.0.1:{self.ready[role]['port']}"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM each child, wait, then SIGKILL what is left. Idempotent."""
        for proc in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.children.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._tmp.cleanup()


def default_prompt(n_words: int, vocab_size: int) -> str:
    from exo_split.models.tiny import sample_prompt

    return sample_prompt(n_words, seed=2026, vocab_size=vocab_size)
