"""A node agent's side of discovery: advertise itself over mDNS for as long as it serves,
keep a live Browser of the other nodes, and keep the static `--peer` list probed; one
merged peer list (deduplicated by node id) for the decode node to choose from.

    presence = Presence(node_info, static=peers, fetch_info=..., never_publish=[token])
    await presence.start(port)      # after the HTTP server listens
    peers = await presence.peers()  # mDNS + static, merged
    await presence.stop()           # goodbye on the air, before the server stops

mDNS trouble (no usable interface, a name clash) is logged and leaves the node serving
without it: the static peers still work.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from zeroconf.asyncio import AsyncZeroconf

from .addresses import local_addresses
from .mdns import Advertiser, Browser, DiscoveryError, open_zeroconf
from .peers import NodeInfo, PeerInfo, merge_peers
from .static import FetchInfo, PeerAddress, ProbeFailure, probe_static

log = logging.getLogger(__name__)


def mdns_interfaces(host: str, interfaces: Sequence[str] | None) -> list[str] | None:
    """Where to advertise (and browse): the given interfaces; else the address we listen
    on; else, listening on 0.0.0.0 (or ::), this machine's IPv4 (or IPv6) addresses, so
    that no address is advertised where nothing listens. None: let zeroconf pick."""
    if interfaces:
        return list(interfaces)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None  # a hostname: every interface
    if not ip.is_unspecified:
        return [host]
    same_family = [a for a in local_addresses() if ipaddress.ip_address(a).version == ip.version]
    return same_family or None


class Presence:
    def __init__(
        self,
        node: NodeInfo,
        *,
        fetch_info: FetchInfo,
        static: Iterable[PeerAddress | str] = (),
        mdns: bool = True,
        interfaces: Sequence[str] | None = None,
        never_publish: Iterable[str] = (),
        static_ttl: float = 10.0,
        probe_timeout: float = 2.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.node = node
        self._fetch_info = fetch_info
        self._static = list(static)
        self._mdns = mdns
        self._interfaces = list(interfaces) if interfaces else None
        self._never_publish = tuple(never_publish)
        self._static_ttl = static_ttl
        self._probe_timeout = probe_timeout
        self._on_change = on_change
        self._zc: AsyncZeroconf | None = None
        self._browser: Browser | None = None
        self.advertiser: Advertiser | None = None
        self.mdns_error: str | None = None
        self._static_peers: list[PeerInfo] = []
        self._static_failures: list[ProbeFailure] = []
        self._static_at: float | None = None
        self._static_lock = asyncio.Lock()
        self._found_at: dict[str, float] = {}  # node id -> time.monotonic() first seen

    @property
    def advertising(self) -> bool:
        return self.advertiser is not None

    async def start(self, port: int) -> None:
        """Browse, then advertise `node` on `port` (browsing first: we hear the peers'
        announcements as they happen, instead of waiting on rate-limited answers)."""
        if self._mdns:
            try:
                self._zc = open_zeroconf(self._interfaces)
                self._browser = Browser(
                    zc=self._zc, ignore_node_id=self.node.node_id, on_change=self._changed
                )
                await self._browser.start()
                self.advertiser = Advertiser(
                    self.node,
                    port,
                    interfaces=self._interfaces,
                    zc=self._zc,
                    never_publish=self._never_publish,
                )
                await self.advertiser.start()
            except (DiscoveryError, OSError, ValueError, asyncio.TimeoutError) as exc:
                self.mdns_error = f"{exc}" + (
                    f" ({exc.hint})" if getattr(exc, "hint", None) else ""
                )
                log.warning("mDNS off: %s", self.mdns_error)
                await self._stop_mdns()
        if self._static:
            await self.refresh_static()

    async def stop(self) -> None:
        """Say goodbye (peers drop this node at once) and stop browsing. Idempotent."""
        await self._stop_mdns()

    async def _stop_mdns(self) -> None:
        advertiser, self.advertiser = self.advertiser, None
        browser, self._browser = self._browser, None
        zc, self._zc = self._zc, None
        try:
            if advertiser is not None:
                await advertiser.stop()
            if browser is not None:
                await browser.stop()
        finally:
            if zc is not None:
                await asyncio.wait_for(zc.async_close(), 10.0)

    async def refresh_static(self) -> None:
        """Ask every static peer for its info now (concurrently, bounded by probe_timeout)."""
        async with self._static_lock:
            probed = await probe_static(
                self._static, fetch_info=self._fetch_info, timeout=self._probe_timeout
            )
            self._static_peers = [p for p in probed.peers if p.node_id != self.node.node_id]
            self._static_failures = list(probed.failures)
            self._static_at = time.monotonic()
        self._changed()

    async def peers(self) -> list[PeerInfo]:
        """Every peer known now: mDNS first, then static, one entry per node id. The static
        ones are asked again when their answers are older than `static_ttl`, or when one of
        them did not answer (it may have started since)."""
        stale = self._static_at is None or time.monotonic() - self._static_at > self._static_ttl
        if self._static and (stale or self._static_failures):
            await self.refresh_static()
        return self._merged()

    def _merged(self) -> list[PeerInfo]:
        found = self._browser.peers() if self._browser is not None else []
        return merge_peers(found, self._static_peers)

    def _changed(self, _peers: object = None) -> None:
        now = time.monotonic()
        for p in self._merged():
            self._found_at.setdefault(p.node_id, now)
        if self._on_change is not None:
            self._on_change()

    def known(self) -> list[dict[str, Any]]:
        """The peers as GET /v1/info shows them (cheap: no probing)."""
        return [
            {
                "node_id": p.node_id,
                "name": p.name,
                "url": p.url,
                "backend": p.backend,
                "device": p.device,
                "fingerprint": p.fingerprint,
                "source": p.source,
                "capabilities": {"prefill_tps": p.prefill_tps, "decode_tps": p.decode_tps},
                "found_at": self._found_at.get(p.node_id),
            }
            for p in self._merged()
        ]

    def static_failures(self) -> list[str]:
        return [str(f) for f in self._static_failures]
