"""Real node agents as separate processes on 127.0.0.1, for end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

TOKEN = "test-token-0123456789"


# Measured node speeds are cached here, not in the user's ~/.cache (node/capabilities.py).
CACHE = Path(tempfile.gettempdir()) / f"exo-split-test-cache-{os.getuid()}"


class NodeProcess:
    """`exo-split node` as a child process. By default on 127.0.0.1 with --no-mdns: a node in
    the host's network namespace must never send multicast. `mdns=True` only together with
    `prefix` = `ns_exec_prefix(ns)` of a namespace the test created (exo_split/bench/netns.py).
    The prefix cache is off unless `prefix_cache_bytes` says otherwise (e.g. "2G")."""

    def __init__(
        self,
        model_dir,
        backend: str,
        workdir: Path,
        *extra: str,
        token=TOKEN,
        env=None,
        mdns: bool = False,
        host: str = "127.0.0.1",
        prefix: tuple[str, ...] | list[str] = (),
        prefix_cache_bytes: str = "0",
        python: str = sys.executable,
    ):
        if mdns and not prefix:
            raise ValueError("mdns=True needs prefix=ns_exec_prefix(ns): never from the host")
        self.host = host
        self.ready_file = workdir / f"ready-{backend}-{time.monotonic_ns()}.json"
        self.log_file = workdir / f"node-{backend}-{time.monotonic_ns()}.log"
        where = ["--host", host] + ([] if mdns else ["--no-mdns"])
        # The split's own tests send the same prompt again and again: a prefix cache would
        # turn their handoffs into one-token ones. Multi-turn tests turn it on.
        where += ["--prefix-cache-bytes", prefix_cache_bytes]
        cmd = [*prefix, python, "-m", "exo_split", "node", "--model", str(model_dir),
               "--backend", backend, "--port", "0", "--ready-file", str(self.ready_file),
               *where, *extra]  # fmt: skip
        full_env = {**os.environ, "EXO_SPLIT_TOKEN": token, "EXO_SPLIT_CACHE": str(CACHE),
                    **(env or {})}  # fmt: skip
        self._log = open(self.log_file, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self.info: dict = {}

    def wait_ready(self, timeout: float = 90.0) -> NodeProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited with {self.proc.returncode}:\n{self.log()}")
            if self.ready_file.exists() and self.ready_file.stat().st_size:
                self.info = json.loads(self.ready_file.read_text())
                return self
            time.sleep(0.1)
        raise TimeoutError(f"node not ready after {timeout} s:\n{self.log()}")

    @property
    def addr(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"[{host}]:{self.info['port']}" if ":" in host else f"{host}:{self.info['port']}"

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    @property
    def tls_url(self) -> str:
        """The node's port over TLS (node-to-node endpoints such as /v1/prefill need it)."""
        return f"https://{self.addr}"

    def log(self) -> str:
        self._log.flush()
        return self.log_file.read_text()

    def stop(self, sig=signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


async def generate(url: str, body: dict, token: str = TOKEN, timeout: float = 120) -> list[dict]:
    """POST /v1/generate and collect the NDJSON events."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{url}/v1/generate",
            json=body,
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return [json.loads(line) for line in (await resp.read()).splitlines() if line.strip()]


def running(started: dict[str, NodeProcess]) -> Iterator[dict[str, NodeProcess]]:
    """A fixture's body: wait until every node is ready, yield them, stop them all after."""
    try:
        for node in started.values():
            node.wait_ready()
        yield started
    finally:
        for node in started.values():
            node.stop()


def generate_sync(url: str, body: dict, **kw) -> dict:
    events = asyncio.run(generate(url, body, **kw))
    assert events[-1]["type"] == "done", events[-1]
    return events[-1]


async def open_kv_stream(url: str, body: dict, authorization: str = f"Bearer {TOKEN}", *,
                         tls: bool = True):  # fmt: skip
    """POST /v1/prefill, then the KV data connection its ticket admits, on the same port:
    (200, reader, writer) of the data connection, or (status, answer body, None). `tls`: both
    over TLS (the certificate not checked: the tests' own nodes), as nodes talk by default."""
    from exo_split import PROTOCOL_VERSION
    from exo_split.transport.datalink import TICKET, TICKET_MAGIC
    from exo_split.transport.tls import DATA_TLS_MAGIC, client_context

    hostport = url.removeprefix("http://").removeprefix("https://")
    base = f"{'https' if tls else 'http'}://{hostport}"
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{base}/v1/prefill", json=body, headers={"Authorization": authorization},
               ssl=client_context() if tls else True) as resp,
    ):  # fmt: skip
        answer = await resp.json(content_type=None)
        if resp.status != 200:
            return resp.status, answer, None
    host, _, port = hostport.rpartition(":")
    reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    if tls:
        writer.write(DATA_TLS_MAGIC)
        await writer.start_tls(client_context())
    writer.write(TICKET.pack(TICKET_MAGIC, PROTOCOL_VERSION, bytes.fromhex(answer["ticket"])))
    return 200, reader, writer


async def request(method: str, url: str, *, token: str | None = TOKEN, **kw):
    """One request; over https the node's certificate is not checked (the tests' own)."""
    from exo_split.transport.tls import client_context

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    headers |= kw.pop("headers", {})
    if url.startswith("https://"):
        kw.setdefault("ssl", client_context())
    async with aiohttp.ClientSession() as s, s.request(method, url, headers=headers, **kw) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


@contextlib.asynccontextmanager
async def tiny_decode_node(ckpt, limits=None, slicing=None):
    """An MLX decode node for a tiny random checkpoint, in this process (local prefill only);
    it serves chat when the checkpoint carries a chat template. Yields its /v1 URL."""
    from concurrent.futures import ThreadPoolExecutor

    from aiohttp import web

    from exo_split.backends import load_backend
    from exo_split.chat import ChatTemplate, has_chat_template
    from exo_split.node.decode import Coordinator
    from exo_split.node.grammar import Grammars
    from exo_split.node.routes import NodeState, make_app
    from exo_split.tokenizer import TextCodec
    from exo_split.transport.client import Timeouts
    from exo_split.transport.limits import Limits

    limits = limits if limits is not None else Limits()
    chat = ChatTemplate(ckpt) if has_chat_template(ckpt) else None
    executor = ThreadPoolExecutor(1, thread_name_prefix="compute-mlx")
    backend = executor.submit(load_backend, "mlx", ckpt).result()

    async def choose_peer(req, n):
        return None, None

    timeouts = Timeouts()
    coordinator = Coordinator(backend, TextCodec(ckpt), executor, token=TOKEN, timeouts=timeouts,
                              session=aiohttp.ClientSession, choose_peer=choose_peer,
                              chat=chat, grammars=Grammars(ckpt, backend.spec.vocab_size,
                                                           TextCodec(ckpt).eos_ids),
                              slicing=slicing)  # fmt: skip
    state = NodeState(node_id="tiny", spec=backend.spec, backend=backend, executor=executor,
                      token=TOKEN, limits=limits, coordinator=coordinator, info={},
                      timeouts=timeouts, model_id="tiny", batch=coordinator.batch.batcher)  # fmt: skip
    coordinator.count_in(state.ledger)
    runner = web.AppRunner(make_app(state), shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
    finally:
        await runner.cleanup()
        executor.shutdown()


@contextlib.contextmanager
def node_pair(model_dir, work, name: str, prefix_cache_bytes: str = "0", *args: str):
    """A torch prefill node and an MLX decode node (serving the model as `name`) on
    127.0.0.1, ready; both stopped on the way out. `args` go to both."""
    kw = {"prefix_cache_bytes": prefix_cache_bytes}
    prefill = NodeProcess(model_dir, "torch", work, "--no-warmup", *args, **kw)
    decode = NodeProcess(model_dir, "mlx", work, "--no-warmup", "--model-name", name, *args,
                         **kw)  # fmt: skip
    try:
        prefill.wait_ready(180)
        decode.wait_ready(180)
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()
