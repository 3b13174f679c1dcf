"""The node agent: one loaded backend, served over HTTP for exactly as long as it runs.

Lifecycle: load the model (the slow part, with progress), warm the decode graph (always:
the first request after a handoff must not pay for kernel builds), measure its speeds (a
short run, cached per model), bind the port, advertise over mDNS and browse for peers, say so
in one startup line, serve until SIGINT/SIGTERM, then say goodbye on mDNS, stop accepting,
finish or cancel what is in flight, and close. All backend work runs on one compute thread,
never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from exo_split import PROTOCOL_VERSION, __version__
from exo_split.backends import load_backend
from exo_split.chat import ChatTemplate, has_chat_template
from exo_split.discovery import NodeInfo, PeerInfo, format_url, new_node_id, prefill_candidates
from exo_split.discovery.peers import ROLES, peer_url
from exo_split.discovery.presence import Presence, mdns_interfaces
from exo_split.errors import ExoSplitError, PeerUnavailable, UntrustedPeer
from exo_split.node import policy
from exo_split.node.capabilities import probe_link, save_cached, startup_speeds
from exo_split.node.decode import Coordinator
from exo_split.node.grammar import Grammars
from exo_split.node.learn import Learned
from exo_split.node.prefix import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache
from exo_split.node.routes import NodeState, make_app
from exo_split.node.slicing import Slicing
from exo_split.node.threads import COMPUTE_THREAD, name_thread
from exo_split.tokenizer import TextCodec
from exo_split.transport.client import Timeouts, fetch_info
from exo_split.transport.datalink import Listener
from exo_split.transport.keys import KeyRing
from exo_split.transport.limits import Limits
from exo_split.transport.messages import GenerateRequest
from exo_split.transport.tls import Identity, secure_url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    model_dir: Path
    backend: str
    token: str = field(repr=False)
    device: str | None = None
    dtype: str | None = None  # None: the backend's default (float32; quantized: the scales')
    host: str = "127.0.0.1"
    port: int = 0
    peers: tuple[str, ...] = ()  # static peers, "host:port"
    limits: Limits = field(default_factory=Limits)
    timeouts: Timeouts = field(default_factory=Timeouts)
    ready_file: Path | None = None
    # Discovery and capabilities (docs/discovery.md).
    mdns: bool = True
    interfaces: tuple[str, ...] = ()  # mDNS on these addresses; (): where we listen
    cache_dir: Path | None = None  # measured speeds are cached here; None: not cached
    warmup: bool = True  # measure speeds at start-up (unless cached)
    remeasure: bool = False  # measure even when cached
    gc_freeze: bool = True  # start-up's objects out of the cyclic GC's reach once ready
    slicing: Slicing = field(default_factory=Slicing)  # a local prefill's jobs
    model_name: str | None = None  # the model's id in the OpenAI API; None: the directory's name
    die_after_layer: int | None = None  # test hook: docs/reliability.md
    staging_bytes: int | None = None  # torch: the prefill's staging ring (None: its default)
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # finished requests' KV; 0: none
    header_timeout: float = 10.0  # a connection's time to identify itself (limits.Guard)
    keys_file: Path | None = None  # clients' API keys (transport/keys.py); None: none
    identity: Identity | None = None  # the node's TLS certificate; None: no TLS served
    insecure_transport: bool = False  # to peers over plain TCP, /v1/prefill served so too


SHUTDOWN_RELEASE_S = 10.0  # the compute thread's last job at shutdown
UNTRUSTED_S = 600.0  # a peer that failed its token proof is not chosen again for this long


class Node:
    def __init__(self, config: NodeConfig, *, progress: Callable[[str], None] = print):
        self.config = config
        self.progress = progress
        self.node_id = new_node_id()
        self._session: aiohttp.ClientSession | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        progress(f"loading {config.model_dir} into the {config.backend} backend ...")
        # Loaded on the compute thread that will run it: MLX streams belong to a thread.
        self.backend = self.executor.submit(
            load_backend, config.backend, config.model_dir, dtype=config.dtype, device=config.device
        ).result()
        self._configure_staging()
        self.codec = TextCodec(config.model_dir)
        self.chat = ChatTemplate(config.model_dir) if has_chat_template(config.model_dir) else None
        self.spec = self.backend.spec
        self.started = int(time.time())
        self.quantization = getattr(self.backend, "quantization", None)
        self.warm_s = self.executor.submit(self.backend.warm).result()
        # Named only now: threads it started (MLX's stream workers) keep the process's name.
        self.executor.submit(name_thread, COMPUTE_THREAD).result()
        self.progress(f"{self._weights()}; decode graph warmed in {self.warm_s:.2f} s")
        self.speeds = startup_speeds(self.executor, self.backend, config.cache_dir,
                                     warmup=config.warmup, remeasure=config.remeasure,
                                     progress=progress)  # fmt: skip
        self.links: dict[str, policy.LinkEstimate] = {}  # peer URL -> measured link
        # Prefill speeds learned from real requests (node/learn.py), the probe as the prior.
        self.learned = Learned(self.speeds.prefill_tps if self.speeds else None)
        self.untrusted: dict[str, float] = {}  # peer URL -> when it failed its token proof
        self._info: dict | None = None
        self.presence = Presence(
            self.node_info(),
            fetch_info=lambda host, port: fetch_info(
                self.session(), self.link(format_url(host, port)), config.token, timeout=2
            ),
            static=config.peers,
            mdns=config.mdns,
            interfaces=mdns_interfaces(config.host, config.interfaces),
            never_publish=[config.token],
            on_change=self._refresh_info,
        )
        # One prefix cache for both roles: prompts prefilled here, conversations decoded here.
        self.prefix = None
        if config.prefix_cache_bytes > 0 and not getattr(self.backend, "own_prefix_cache", False):
            self.prefix = PrefixCache(self.backend, limit_bytes=config.prefix_cache_bytes)
        self.coordinator = _Coordinator(
            self.backend,
            self.codec,
            self.executor,
            token=config.token,
            timeouts=config.timeouts,
            session=self.session,
            choose_peer=self.choose_prefill_peer,
            chat=self.chat,
            max_frame_bytes=config.limits.max_frame_bytes,
            prefix=self.prefix,
            grammars=Grammars(config.model_dir, self.spec.vocab_size, self.codec.eos_ids),
            slicing=config.slicing,
        )
        self.coordinator.on_done = self._learn
        self.coordinator.link = self.link
        self.coordinator.local_speed = self.learned.local.headline

    def _configure_staging(self) -> None:
        """The torch prefill's staging ring, pinned once at start-up (never during a request);
        a ring whose consumer stopped releasing slots gives up after the idle timeout."""
        backend = self.backend
        if not hasattr(backend, "set_staging"):
            return
        backend.slot_timeout = self.config.timeouts.idle
        if self.config.staging_bytes is not None:
            self.executor.submit(backend.set_staging, self.config.staging_bytes).result()

    def _weights(self) -> str:
        b, q = self.backend, self.quantization
        wired = getattr(b, "wired_bytes", None)
        return (
            f"{b.name} on {b.device}, {b.dtype}, "
            + (f"{q.describe()} ({q.tag})" if q is not None else "full-precision weights")
            + (f", {wired / 2**30:.1f} GiB wired" if wired else "")
        )

    def node_info(self) -> NodeInfo:
        """What this node advertises (mDNS TXT) and answers on GET /v1/info."""
        return NodeInfo(
            node_id=self.node_id,
            name=f"{socket.gethostname()}-{self.node_id[:6]}",
            backend=self.backend.name,
            device=self.backend.device,
            model=(self.spec.name or self.config.model_dir.name or "model")[:100],
            fingerprint=self.spec.fingerprint,
            prefill_tps=self.learned.local.headline(),
            decode_tps=self.speeds.decode_tps if self.speeds else None,
            quantization=getattr(self.quantization, "tag", None)  # ours, or vLLM's "vllm:fp8"
            or getattr(self.backend, "quantization_tag", None),
            # vLLM prefills only: the decode node decodes (backends/vllm_backend.py)
            roles=("prefill",) if getattr(self.backend, "prefill_only", False) else ROLES,
        )

    @property
    def model_id(self) -> str:
        """The model's name in the OpenAI API."""
        return self.config.model_name or self.config.model_dir.name or self.spec.name or "model"

    def link(self, url: str) -> str:
        """A peer's URL as this node reaches it: https unless --insecure-transport."""
        return secure_url(url, not self.config.insecure_transport)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def info(self) -> dict:
        """The GET /v1/info body: one dict, kept current in place (peers come and go)."""
        if self._info is None:
            node = self.node_info()
            self._info = {
                **node.to_info_dict(),
                "version": __version__,
                "protocol": PROTOCOL_VERSION,
                "dtype": self.backend.dtype,
                "quantization": self.quantization.to_dict() if self.quantization else None,
                "warmup_s": self.warm_s,
                "wired_bytes": getattr(self.backend, "wired_bytes", None),
                "spec": self.spec.to_dict(),
                "openai": {"model": self.model_id, "chat": self.chat is not None},
                "tls": {
                    "cert_sha256": getattr(self.config.identity, "fingerprint", None),
                    "to_peers": not self.config.insecure_transport,
                },
            }
            if self.speeds is not None:
                self._info["capabilities"] |= {
                    "warmup_prompt_tokens": self.speeds.prefill_tokens,
                    "warmup_decode_steps": self.speeds.decode_steps,
                }
            self._refresh_info()
        return self._info

    def _refresh_info(self) -> None:
        if self._info is not None:
            self._info["mdns"] = {
                "advertised": self.presence.advertising,
                "error": self.presence.mdns_error,
            }
            self._info["peers"] = self.presence.known()
            self._info["links"] = {url: vars(link) for url, link in self.links.items()}
            self._info["learned_prefill_tps"] = self.learned.to_dict()

    async def choose_prefill_peer(
        self, req: GenerateRequest, prompt_len: int
    ) -> tuple[str | None, dict | None]:
        """Which node prefills (None: this one) and why (the report's `decision`).

        A peer named in the request is used as asked. Otherwise the best prefill peer we
        know (mDNS and static, same model) is weighed against prefilling here by
        policy.decide, from the speeds both advertise and the measured link (probed on
        first use, then learned from each transfer). Estimates are made whenever the
        figures are known, so a forced choice still shows what it gave up."""
        t0 = time.perf_counter()
        named = peer_url(req.prefill_peer) if req.prefill_peer else None
        peer, url, unreachable = None, None, None
        # Looked up for "local" too: the report shows what a remote prefill would have cost.
        known = await self.presence.peers()
        if named is not None:
            url = named
            peer = next((p for p in known if p.url == named), None)
        else:  # a peer that failed its proof lately is not a candidate (UNTRUSTED_S)
            ranked = [p for p in prefill_candidates(known, self.spec.fingerprint,
                                                    exclude=[self.node_id])
                      if time.monotonic() - self.untrusted.get(p.url, -UNTRUSTED_S) >= UNTRUSTED_S]  # fmt: skip
            peer = ranked[0] if ranked else None
            url = peer.url if peer is not None else None
        if url is None and req.prefill == "remote":
            raise ExoSplitError(
                "no prefill peer serving this model was found",
                hint="start a node with the same model, or pass --prefill-peer HOST:PORT",
            )
        figures = None
        while url is not None:
            try:
                # A named peer is used whatever the estimates say: no probe on its path.
                probe = named is None and req.prefill != "local"
                figures = await self._figures(url, peer, req, prompt_len, probe=probe)
                break
            except PeerUnavailable as exc:
                log.warning("prefill peer %s unusable: %s", url, exc)
                if isinstance(exc, UntrustedPeer):  # it advertised itself, it cannot prove it
                    self.untrusted[url] = time.monotonic()
                if named is None and (isinstance(exc, UntrustedPeer) or req.prefill == "auto"):
                    ranked = ranked[1:]  # the next best, if any: an advert earns nothing
                    peer = ranked[0] if ranked else None
                    url, unreachable = (peer.url if peer else None), str(exc)
                    continue
                # asked for: let the coordinator try it (and fall back if it must)
                figures = self._figures_without_link(url, peer, req, prompt_len)
                break
        if url is not None and figures is not None:
            unreachable = None
        mode = "remote" if named is not None and req.prefill != "local" else req.prefill
        decision = policy.decide(prompt_len, figures, mode=mode).to_dict()
        decision["mode"] = req.prefill
        if figures is not None:
            decision["figure_sources"] = self.learned.sources(url, peer, prompt_len)
            if named is None and mode == "auto" and decision["choice"] == "local":
                decision |= self.learned.explore(url, prompt_len)
        if named is not None and req.prefill != "local":
            decision["reason"] = "prefill peer named in the request"
        if unreachable is not None:
            decision["reason"] = f"prefill peer unreachable: {unreachable}"
        if url is not None:
            decision["peer"] = {"url": url}
        if peer is not None:
            decision["peer"] |= {"name": peer.name, "node_id": peer.node_id,
                                 "backend": peer.backend, "device": peer.device,
                                 "source": peer.source}  # fmt: skip
        decision["decided_in_s"] = time.perf_counter() - t0
        return (url if decision["choice"] == "remote" else None), decision

    def _figures_without_link(self, url, peer: PeerInfo | None, req: GenerateRequest, n: int):
        return policy.figures_for(
            local_prefill_tps=self.learned.local.value(n)[0],
            peer_prefill_tps=self.learned.peer(url, peer).value(n)[0],
            link=None,
            kv_bytes_per_token=policy.handoff_bytes_per_token(self.spec, self.backend.dtype),
            n_layers=self.spec.n_layers,
            overlap=req.overlap,
        )

    async def _figures(
        self, url: str, peer: PeerInfo | None, req: GenerateRequest, n: int, *, probe: bool = True
    ) -> policy.Figures:
        """The policy's inputs for the peer at `url`; probes the link the first time
        (unless `probe` is False: then the link figures stay unknown)."""
        link = self.links.get(url)
        if link is None and not probe:
            return self._figures_without_link(url, peer, req, n)
        if link is None:
            link = await probe_link(
                self.session(), self.link(url), self.config.token,
                timeout=self.config.timeouts.connect,
            )  # fmt: skip
            self.links[url] = link
            self._refresh_info()
        return dataclasses.replace(
            self._figures_without_link(url, peer, req, n),
            link_bytes_per_s=link.bytes_per_s,
            round_trip_s=link.round_trip_s,
            overhead_s=link.overhead_s,
        )

    def _prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill this node served: a real speed that moved replaces the probe's in what
        the node advertises (mDNS, /v1/info) and caches (node/learn.py)."""
        now = self.learned.served(tokens, seconds)
        if now is not None and self._info is not None:
            self._info["capabilities"]["prefill_tps"] = now
        if now is not None and self.presence.advertiser is not None:
            asyncio.ensure_future(self.presence.advertiser.update(prefill_tps=now))
        if now is not None and self.speeds is not None and self.config.cache_dir is not None:
            with contextlib.suppress(OSError):
                save_cached(
                    self.config.cache_dir, dataclasses.replace(self.speeds, prefill_tps=now)
                )

    def _learn(self, done: dict) -> None:
        """After a request: learn the link from a remote transfer, and put the measured
        TTFT next to the estimate in the report's decision."""
        report = done.get("report") or {}
        decision = report.get("decision")
        if not isinstance(decision, dict):
            return
        peer = decision.get("peer")
        url = peer.get("url") if isinstance(peer, dict) else peer
        if decision.get("choice") == "remote" and isinstance(url, str):
            learned = policy.link_from_report(
                self.links.get(url), report, decision_s=decision.get("decided_in_s") or 0.0
            )
            if learned is not None:
                self.links[url] = learned
                self._refresh_info()
        self.learned.observe(report, url if decision.get("choice") == "remote" else None)
        outcome = policy.with_outcome(decision, report)
        report["decision"] = outcome
        if isinstance(report.get("timeline"), dict):
            report["timeline"]["decision"] = outcome

    def _mdns_line(self) -> str:
        adv = self.presence.advertiser
        if adv is not None:
            where = ", ".join(adv.addresses)
            return f"mDNS: advertising {adv.service_name} on {where} port {adv.port}"
        if not self.config.mdns:
            return "mDNS: off (--no-mdns); peers: --peer / EXO_SPLIT_PEERS only"
        return f"mDNS: not advertising ({self.presence.mdns_error}); use --peer HOST:PORT"

    def state(self) -> NodeState:
        state = NodeState(
            node_id=self.node_id,
            spec=self.spec,
            backend=self.backend,
            executor=self.executor,
            token=self.config.token,
            limits=self.config.limits,
            coordinator=self.coordinator,
            info=self.info(),
            model_id=self.model_id,
            started=self.started,
            busy={},
            stats={},
            timeouts=self.config.timeouts,
            die_after_layer=self.config.die_after_layer,
            prefix=self.prefix,
            keys=KeyRing(self.config.keys_file),
            identity=self.config.identity,
            insecure_transport=self.config.insecure_transport,
            on_prefilled=self._prefilled,
            batch=getattr(self.coordinator.batch, "batcher", None),
        )
        if self.prefix is not None:
            state.ledger.caches.append(self.prefix)
        self.coordinator.count_in(state.ledger)
        return state

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set or SIGINT/SIGTERM arrives."""
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        state = self.state()
        listener = Listener(make_app(state), state.tickets, identity=self.config.identity,
                            sniff_timeout=self.config.header_timeout)  # fmt: skip
        try:
            try:
                port = await listener.start(self.config.host, self.config.port)
            except OSError as exc:
                raise ExoSplitError(
                    f"cannot listen on {self.config.host}:{self.config.port}: {exc.strerror}",
                    hint="pick another --port, or stop the process that holds it",
                ) from exc
            url = f"http://{self.config.host}:{port}"
            discovery_at = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
            await self.presence.start(port)  # advertised from here until the finally below
            self._refresh_info()
            if self.config.gc_freeze:  # a full collection would scan the model's and the
                gc.freeze()  # libraries' objects: ~150 ms, a stall in every stream
            self.progress(self._mdns_line())
            self.progress(
                f"exo-split node ready: backend={self.backend.name} device={self.backend.device} "
                f"dtype={self.backend.dtype} weights={self.quantization.tag if self.quantization else 'full'} "
                f"model={self.spec.name} fingerprint={self.spec.fingerprint} at {url} "
                f"(warm-up {self.warm_s:.2f} s)"
            )
            chat = "chat and completions" if self.chat is not None else "completions (no template)"
            self.progress(f"OpenAI API ({chat}): base_url {url}/v1, model {self.model_id!r}")
            if self.config.ready_file:
                self.config.ready_file.write_text(
                    json.dumps(
                        {**self.info(), "url": url, "port": port, "discovery_at": discovery_at}
                    )
                )
            await stop.wait()
            self.progress("exo-split node: shutting down")
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await self.presence.stop()  # goodbye first: peers stop choosing us at once
            await listener.stop()
            if self._session is not None:
                await self._session.close()
            await self._release_compute()

    async def _release_compute(self) -> None:
        """Let the compute thread release what it holds (MLX's streams: without this a
        process can abort on exit), then stop it."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.executor.submit(self.backend.close)),
                                   SHUTDOWN_RELEASE_S)  # fmt: skip
        except (asyncio.TimeoutError, TimeoutError):
            log.warning("the compute thread did not finish within %g s", SHUTDOWN_RELEASE_S)
        except Exception:
            log.exception("releasing the backend failed")
        self.executor.shutdown(wait=False, cancel_futures=True)


class _Coordinator(Coordinator):
    """The node's coordinator: hands each finished request's `done` event to `on_done`
    (the node learns the link and records the measured TTFT) before it is sent."""

    on_done: Callable[[dict], None] | None = None

    async def generate(self, *args, **kwargs) -> dict:
        done = await super().generate(*args, **kwargs)
        if self.on_done is not None:
            try:
                self.on_done(done)
            except Exception:  # bookkeeping must never fail a finished request
                log.exception("learning from a finished request failed")
        return done
