"""The node agent: one loaded backend, served over HTTP for exactly as long as it runs.

Lifecycle: load the model (the slow part, with progress), bind the port, say so in one
startup line, serve until SIGINT/SIGTERM, then stop accepting, finish or cancel what is in
flight, and close. All backend work runs on one compute thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from exo_split import PROTOCOL_VERSION, __version__
from exo_split.backends import load_backend
from exo_split.coordinator import Coordinator, GenerateRequest
from exo_split.errors import ExoSplitError
from exo_split.tokenizer import TextCodec
from exo_split.transport.client import Timeouts, fetch_info
from exo_split.transport.server import Limits, NodeState, make_app

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    model_dir: Path
    backend: str
    token: str
    device: str | None = None
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 0
    peers: tuple[str, ...] = ()  # static peers, "host:port"
    limits: Limits = field(default_factory=Limits)
    timeouts: Timeouts = field(default_factory=Timeouts)
    ready_file: Path | None = None


def peer_url(addr: str) -> str:
    """'host:port' (or a URL) -> 'http://host:port'."""
    if addr.startswith(("http://", "https://")):
        return addr.rstrip("/")
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ExoSplitError(f"bad peer address {addr!r}: expected HOST:PORT")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class Node:
    def __init__(self, config: NodeConfig, *, progress: Callable[[str], None] = print):
        self.config = config
        self.progress = progress
        self.node_id = uuid.uuid4().hex[:12]
        self._session: aiohttp.ClientSession | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        progress(f"loading {config.model_dir} into the {config.backend} backend ...")
        # Loaded on the compute thread that will run it: MLX streams belong to a thread.
        self.backend = self.executor.submit(
            load_backend, config.backend, config.model_dir, dtype=config.dtype, device=config.device
        ).result()
        self.codec = TextCodec(config.model_dir)
        self.spec = self.backend.spec
        self.coordinator = Coordinator(
            self.backend,
            self.codec,
            self.executor,
            token=config.token,
            timeouts=config.timeouts,
            session=self.session,
            choose_peer=self.choose_prefill_peer,
        )

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def info(self) -> dict:
        return {
            "node_id": self.node_id,
            "name": f"{socket.gethostname()}-{self.node_id[:6]}",
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "backend": self.backend.name,
            "device": self.backend.device,
            "dtype": self.backend.dtype,
            "model": self.spec.name,
            "fingerprint": self.spec.fingerprint,
            "spec": self.spec.to_dict(),
            "roles": ["prefill", "decode"],
            "capabilities": {},
        }

    async def choose_prefill_peer(
        self, req: GenerateRequest, prompt_len: int
    ) -> tuple[str | None, dict | None]:
        """Which node prefills: the request's peer, else the first static peer that serves
        our model; None = prefill locally."""
        if req.prefill == "local":
            return None, {"choice": "local", "reason": "requested"}
        if req.prefill_peer:
            return peer_url(req.prefill_peer), {"choice": "remote", "reason": "requested peer"}
        for addr in self.config.peers:
            url = peer_url(addr)
            try:
                info = await fetch_info(self.session(), url, self.config.token, timeout=3)
            except ExoSplitError as exc:
                log.warning("static peer %s unusable: %s", addr, exc)
                continue
            if info.get("fingerprint") == self.spec.fingerprint and info["node_id"] != self.node_id:
                return url, {"choice": "remote", "reason": f"static peer {addr}"}
        if req.prefill == "remote":
            raise ExoSplitError(
                "no prefill peer serving this model was found", hint="use --prefill-peer"
            )
        return None, {"choice": "local", "reason": "no prefill peer"}

    def state(self) -> NodeState:
        return NodeState(
            node_id=self.node_id,
            spec=self.spec,
            backend=self.backend,
            executor=self.executor,
            token=self.config.token,
            limits=self.config.limits,
            coordinator=self.coordinator,
            info=self.info(),
            busy={},
            stats={},
        )

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set or SIGINT/SIGTERM arrives."""
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = web.AppRunner(make_app(self.state()), shutdown_timeout=5.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.config.host, self.config.port)
            try:
                await site.start()
            except OSError as exc:
                raise ExoSplitError(
                    f"cannot listen on {self.config.host}:{self.config.port}: {exc.strerror}",
                    hint="pick another --port, or stop the process that holds it",
                ) from exc
            port = site._server.sockets[0].getsockname()[1]
            url = f"http://{self.config.host}:{port}"
            self.progress(
                f"exo-split node ready: backend={self.backend.name} device={self.backend.device} "
                f"dtype={self.backend.dtype} model={self.spec.name} "
                f"fingerprint={self.spec.fingerprint} at {url}"
            )
            if self.config.ready_file:
                self.config.ready_file.write_text(
                    json.dumps({**self.info(), "url": url, "port": port})
                )
            await stop.wait()
            self.progress("exo-split node: shutting down")
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await runner.cleanup()
            if self._session is not None:
                await self._session.close()
            self.executor.shutdown(wait=False, cancel_futures=True)
