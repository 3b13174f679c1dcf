"""Advertise this node and browse for peers over mDNS (python-zeroconf, asyncio API).

Service type `_exo-split._tcp.local.`; instance `<hostname>-<node id[:8]>`, whose host
record is `<hostname>-<node id[:8]>.local.` (not the machine's own `<hostname>.local.`,
which the OS responder owns). The TXT record and its credential guard are in txt.py, the
choice of addresses in addresses.py.

Everything runs on the caller's event loop (no zeroconf thread), every network wait has
a timeout, and a zeroconf instance opened here is closed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import replace
from types import TracebackType

from zeroconf import (
    BadTypeInNameException,
    IPVersion,
    NonUniqueNameException,
    ServiceStateChange,
    Zeroconf,
)
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from exo_split.errors import ExoSplitError

from .addresses import (
    adapter_addresses,
    check_interfaces,
    local_addresses,
    pick_host,
    strip_zone,
)
from .peers import NodeInfo, PeerInfo
from .txt import check_txt, node_from_txt, node_txt

log = logging.getLogger(__name__)

SERVICE_TYPE = "_exo-split._tcp.local."


class DiscoveryError(ExoSplitError):
    """mDNS advertisement could not be set up (name clash, no usable interface...)."""


class _Unset(enum.Enum):
    UNSET = enum.auto()


UNSET = _Unset.UNSET


# ---- names ----------------------------------------------------------------------------


def _label(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9-]+", "-", text).strip("-")[:limit] or "node"


def instance_label(node_id: str, hostname: str | None = None) -> str:
    """`<hostname>-<node id[:8]>`: readable, and unique per node on one machine."""
    host = (hostname or socket.gethostname()).split(".", 1)[0]
    return f"{_label(host, 40)}-{_label(node_id, 8)}"


def open_zeroconf(interfaces: Sequence[str] | None = None) -> AsyncZeroconf:
    """A zeroconf instance on the running loop (call from a coroutine: no thread), to share
    between an Advertiser and a Browser; the caller closes it (`await zc.async_close()`).

    On `interfaces` (IP addresses, IPv4 and/or IPv6; zeroconf picks the IP version from
    them), or on every interface, with IPv6 too when this machine has an IPv6 address.
    """
    interfaces = check_interfaces(interfaces)
    asyncio.get_running_loop()  # RuntimeError outside a coroutine: zeroconf would start a thread
    try:
        if interfaces is not None:
            return AsyncZeroconf(interfaces=interfaces)
        if socket.has_ipv6 and any(a.version == 6 for a in adapter_addresses()):
            try:
                return AsyncZeroconf(ip_version=IPVersion.All)
            except OSError as exc:
                log.warning("mDNS over IPv6 unavailable (%s); using IPv4 only", exc)
        return AsyncZeroconf(ip_version=IPVersion.V4Only)
    except (OSError, RuntimeError) as exc:  # zeroconf: RuntimeError("No adapter found ...")
        where = ", ".join(interfaces) if interfaces else "any interface"
        raise DiscoveryError(
            f"cannot open mDNS sockets on {where}: {exc}",
            hint="check the address belongs to this machine, or use --peer host:port",
        ) from exc


async def _settle(started: Awaitable[Awaitable[object]]) -> None:
    """zeroconf's async_*_service return an awaitable that returns the broadcast task."""
    await (await started)


# ---- advertiser -------------------------------------------------------------------------


class Advertiser:
    """Publishes this node for exactly as long as it is started; `stop()` says goodbye,
    so peers drop it at once instead of waiting for the records to expire.

        async with Advertiser(node, port=8470, never_publish=[token]) as adv:
            ...serve...
            await adv.update(prefill_tps=9800.0)

    `zc` shares an existing AsyncZeroconf (`open_zeroconf`, e.g. with a Browser); it is
    then not closed here. A node that also browses should start its Browser first, so it
    hears the peer's announcements as they happen: answers to a query can be held back up
    to a second by mDNS rate limiting.

    `ttl` (seconds) applies to all records. With zeroconf's defaults (75 minutes for TXT)
    a crashed node would stay listed that long; with 120 s a peer's `Browser` drops it
    within about `ttl + recheck_interval + resolve_timeout`. A clean stop is seen at once.
    """

    def __init__(
        self,
        node: NodeInfo,
        port: int,
        *,
        interfaces: Sequence[str] | None = None,
        zc: AsyncZeroconf | None = None,
        hostname: str | None = None,
        never_publish: Iterable[str] = (),
        ttl: int = 120,
        timeout: float = 10.0,
    ) -> None:
        if not 1 <= port <= 65535:
            raise ValueError(f"port must be 1-65535, got {port}")
        if ttl < 1:
            raise ValueError(f"ttl must be >= 1 s, got {ttl}")
        self._ttl = ttl
        self._node = node
        self._port = port
        self._interfaces = check_interfaces(interfaces)
        self._given_zc = zc
        self._zc: AsyncZeroconf | None = None
        self._label = instance_label(node.node_id, hostname)
        self._never_publish = tuple(never_publish)
        self._timeout = timeout
        self._info: AsyncServiceInfo | None = None
        check_txt(node_txt(node), never_publish=self._never_publish)  # fail before the network

    @property
    def node(self) -> NodeInfo:
        return self._node

    @property
    def port(self) -> int:
        return self._port

    @property
    def service_name(self) -> str:
        return f"{self._label}.{SERVICE_TYPE}"

    @property
    def addresses(self) -> list[str]:
        """The addresses in the published A/AAAA records (empty until started)."""
        return self._info.parsed_scoped_addresses() if self._info is not None else []

    def _service_info(self, addresses: list[str]) -> AsyncServiceInfo:
        txt = node_txt(self._node)
        check_txt(txt, never_publish=self._never_publish)  # every publish passes here
        return AsyncServiceInfo(
            SERVICE_TYPE,
            self.service_name,
            port=self._port,
            properties=txt,
            server=f"{self._label}.local.",
            parsed_addresses=addresses,
            host_ttl=self._ttl,
            other_ttl=self._ttl,
        )

    async def start(self) -> None:
        if self._info is not None:
            return
        addresses = [strip_zone(a) for a in self._interfaces or local_addresses()]
        if not addresses:
            raise DiscoveryError(
                "no network address to advertise",
                hint="name the address to advertise on, or use --peer host:port",
            )
        info = self._service_info(addresses)
        self._zc = self._given_zc or open_zeroconf(self._interfaces)
        try:
            await asyncio.wait_for(
                _settle(self._zc.async_register_service(info)), timeout=self._timeout
            )
        except NonUniqueNameException as exc:
            await self._close()
            raise DiscoveryError(
                f"another node already advertises {self.service_name}",
                hint="is a node with the same node id already running?",
            ) from exc
        except BaseException:
            await self._close()
            raise
        self._info = info
        log.info("advertising %s on %s port %d", self.service_name, addresses, self._port)

    async def update(
        self,
        *,
        prefill_tps: float | None | _Unset = UNSET,
        decode_tps: float | None | _Unset = UNSET,
    ) -> None:
        """Re-publish the TXT record with new measured speeds (None = unknown again)."""
        changes: dict[str, float | None] = {}
        if prefill_tps is not UNSET:
            changes["prefill_tps"] = prefill_tps
        if decode_tps is not UNSET:
            changes["decode_tps"] = decode_tps
        node = replace(self._node, **changes)
        if node == self._node:
            return
        self._node = node
        if self._info is None or self._zc is None:
            return  # not published yet: start() will publish the new figures
        info = self._service_info(self._info.parsed_addresses())
        await asyncio.wait_for(_settle(self._zc.async_update_service(info)), self._timeout)
        self._info = info

    async def stop(self) -> None:
        """Unregister (peers see the node go) and close zeroconf if it is ours. Idempotent."""
        info, self._info = self._info, None
        try:
            if info is not None and self._zc is not None:
                await asyncio.wait_for(
                    _settle(self._zc.async_unregister_service(info)), self._timeout
                )
        except (asyncio.TimeoutError, OSError) as exc:
            log.warning("could not unregister %s cleanly: %r", self.service_name, exc)
        finally:
            await self._close()

    async def _close(self) -> None:
        zc, self._zc = self._zc, None
        if zc is not None and zc is not self._given_zc:
            await asyncio.wait_for(zc.async_close(), self._timeout)

    async def __aenter__(self) -> Advertiser:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


# ---- browser ----------------------------------------------------------------------------


class Browser:
    """A live view of the peers on the network, kept current as services come, change
    (e.g. new measured speeds) and go.

        async with Browser(ignore_node_id=me.node_id) as browser:
            peers = await browser.wait_for(lambda ps: any(p.fingerprint == fp for p in ps), 5)

    `on_change(peers)` is called on the event loop after every change. `interfaces` is
    used when the Browser opens its own zeroconf instance, i.e. unless `zc` is given.

    A peer that stops cleanly sends a goodbye and goes at once. One that crashes does not,
    and python-zeroconf keeps a service's PTR record at least 1,125 s whatever its TTL;
    so every `recheck_interval` seconds, a peer whose SRV/TXT/address records have expired
    from the cache (after the advertiser's `ttl`) is asked again, and dropped if it does
    not answer within `resolve_timeout`.
    """

    def __init__(
        self,
        *,
        interfaces: Sequence[str] | None = None,
        zc: AsyncZeroconf | None = None,
        ignore_node_id: str | None = None,
        resolve_timeout: float = 3.0,
        recheck_interval: float = 10.0,
        on_change: Callable[[list[PeerInfo]], None] | None = None,
    ) -> None:
        self._interfaces = check_interfaces(interfaces)
        self._given_zc = zc
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._ignore = ignore_node_id
        self._resolve_timeout = resolve_timeout
        self._recheck_interval = recheck_interval
        self._on_change = on_change
        self._peers: dict[str, PeerInfo] = {}  # service name -> peer, in order of discovery
        self._txt: dict[str, dict[str, str | None]] = {}  # node id -> TXT as received
        self._generation: dict[str, int] = {}  # service name -> latest event number
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self._local_nets: list[ipaddress._BaseNetwork] = []

    def peers(self) -> list[PeerInfo]:
        """The peers currently advertised, in order of discovery (one per node id)."""
        return list({p.node_id: p for p in self._peers.values()}.values())

    def txt(self, node_id: str) -> dict[str, str | None] | None:
        """The TXT record last received from `node_id`, as it came (for diagnostics)."""
        return self._txt.get(node_id)

    async def wait_for(
        self, predicate: Callable[[list[PeerInfo]], bool], timeout: float
    ) -> list[PeerInfo]:
        """Wait until `predicate(peers)` holds; return the peers. TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while not predicate(peers := self.peers()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError(f"no matching peers within {timeout:g} s: {peers}")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return peers

    async def start(self) -> None:
        if self._browser is not None:
            return
        self._local_nets = [a.network for a in adapter_addresses()]
        self._zc = self._given_zc or open_zeroconf(self._interfaces)
        self._browser = AsyncServiceBrowser(
            self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_service_state_change]
        )
        self._spawn(self._recheck_forever())

    async def stop(self) -> None:
        """Stop browsing, cancel pending look-ups, close zeroconf if it is ours. Idempotent."""
        browser, self._browser = self._browser, None
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        try:
            if browser is not None:
                await asyncio.wait_for(browser.async_cancel(), self._resolve_timeout)
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            zc, self._zc = self._zc, None
            if zc is not None and zc is not self._given_zc:
                await asyncio.wait_for(zc.async_close(), 10.0)

    async def __aenter__(self) -> Browser:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # zeroconf calls this on the event loop with these exact keyword names.
    def _on_service_state_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        generation = self._generation.get(name, 0) + 1
        self._generation[name] = generation
        if state_change is ServiceStateChange.Removed:
            self._drop(name, "said goodbye")
        else:
            self._spawn(self._resolve(name, generation))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("mDNS browser task failed", exc_info=task.exception())

    def _drop(self, name: str, why: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        log.info("peer gone (%s): %s at %s", why, peer.name, peer.url)
        if all(p.node_id != peer.node_id for p in self._peers.values()):
            self._txt.pop(peer.node_id, None)
        self._notify()

    async def _recheck_forever(self) -> None:
        while True:
            await asyncio.sleep(self._recheck_interval)
            await asyncio.gather(*(self._recheck(name) for name in list(self._peers)))

    async def _recheck(self, name: str) -> None:
        """Drop a peer whose records expired and who does not answer a new query."""
        if self._zc is None:
            return
        generation = self._generation.get(name)
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if info.load_from_cache(self._zc.zeroconf):
            return
        # A changed record that does come back arrives as an Updated event.
        if await info.async_request(self._zc.zeroconf, self._resolve_timeout * 1000):
            return
        if self._generation.get(name) == generation:  # no news meanwhile
            self._generation[name] = (generation or 0) + 1
            self._drop(name, f"records expired, no answer within {self._resolve_timeout:g} s")

    async def _resolve(self, name: str, generation: int) -> None:
        if self._zc is None:
            return
        try:
            info = AsyncServiceInfo(SERVICE_TYPE, name)
        except BadTypeInNameException:
            return
        if not await info.async_request(self._zc.zeroconf, self._resolve_timeout * 1000):
            log.debug("no complete answer for %s within %g s", name, self._resolve_timeout)
            return
        if self._generation.get(name) != generation:
            return  # a newer event for this service superseded this look-up
        txt = info.decoded_properties
        addresses = info.parsed_scoped_addresses()
        try:
            node = node_from_txt(txt)
        except ValueError as exc:
            log.warning("ignoring mDNS service %s: %s", name, exc)
            return
        if node.node_id == self._ignore:
            return
        if not addresses or info.port is None:
            log.warning("ignoring mDNS service %s: no address or port", name)
            return
        host = pick_host(addresses, self._local_nets)
        peer = PeerInfo.from_node(
            node, host=host, port=info.port, source="mdns", addresses=addresses
        )
        self._txt[node.node_id] = dict(txt)
        if self._peers.get(name) != peer:
            change = "updated" if name in self._peers else "found"
            log.info("peer %s: %s at %s", change, node.name, peer.url)
            self._peers[name] = peer
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        if self._on_change is not None:
            try:
                self._on_change(self.peers())
            except Exception:  # a bad callback must not break zeroconf's dispatch
                log.exception("on_change callback failed")


async def browse(
    timeout: float,
    *,
    interfaces: Sequence[str] | None = None,
    zc: AsyncZeroconf | None = None,
    ignore_node_id: str | None = None,
) -> list[PeerInfo]:
    """Listen for `timeout` seconds and return the peers found (source="mdns")."""
    async with Browser(interfaces=interfaces, zc=zc, ignore_node_id=ignore_node_id) as browser:
        await asyncio.sleep(timeout)
        return browser.peers()
