"""Find the nodes around: browse mDNS and probe the static `--peer` addresses at the same
time, and merge what answers into one list (one entry per node id).

Used by the CLI (`exo-split nodes`, `split-generate` without named peers); a node agent
keeps a live `Browser` instead. No torch, mlx or HTTP client here: GET /v1/info comes in as
`fetch_info`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .mdns import Browser, DiscoveryError
from .peers import PeerInfo, merge_peers
from .static import FetchInfo, PeerAddress, ProbeFailure, probe_static

log = logging.getLogger(__name__)

NO_PEERS_HINT = (
    "no node answered. If nodes are running: a firewall may block mDNS (UDP 5353) or the "
    "node's port; the machines may be on different subnets or a VPN (mDNS does not cross "
    "routers); on macOS, allow Local Network access for your terminal (System Settings > "
    "Privacy & Security > Local Network). Or skip discovery: --peer HOST:PORT (repeatable) "
    "or EXO_SPLIT_PEERS=HOST:PORT,HOST:PORT"
)


@dataclass(frozen=True)
class Found:
    """What `find_peers` found. `mdns_error`: why mDNS could not be used (None if it was,
    or was not asked for)."""

    peers: tuple[PeerInfo, ...]
    failures: tuple[ProbeFailure, ...]
    mdns: bool
    mdns_error: str | None = None
    seconds: float = 0.0


async def find_peers(
    static: Iterable[PeerAddress | str] = (),
    *,
    fetch_info: FetchInfo,
    mdns: bool = True,
    interfaces: Sequence[str] | None = None,
    timeout: float = 3.0,
    enough: Callable[[list[PeerInfo]], bool] | None = None,
) -> Found:
    """Browse mDNS (unless `mdns` is False) and probe `static` peers, concurrently.

    Returns after `timeout` seconds, or as soon as `enough(peers)` holds (checked once the
    static probes are in and on every mDNS change). mDNS peers come first in the list.
    """
    t0 = time.monotonic()
    static = list(static)
    probing = asyncio.ensure_future(probe_static(static, fetch_info=fetch_info, timeout=timeout))
    browser, mdns_error = None, None
    try:
        if mdns:
            browser = Browser(interfaces=interfaces)
            try:
                await browser.start()
            except DiscoveryError as exc:
                mdns_error, browser = str(exc), None
                log.warning("mDNS unavailable: %s", exc)
        probed = await probing
        remaining = timeout - (time.monotonic() - t0)
        if browser is not None and remaining > 0:

            def merged(found: list[PeerInfo]) -> list[PeerInfo]:
                return merge_peers(found, probed.peers)

            predicate = (lambda ps: enough(merged(ps))) if enough else (lambda ps: False)
            with contextlib.suppress(asyncio.TimeoutError):
                await browser.wait_for(predicate, remaining)
        found = browser.peers() if browser is not None else []
    finally:
        if not probing.done():
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)
        if browser is not None:
            await browser.stop()
    return Found(
        peers=tuple(merge_peers(found, probed.peers)),
        failures=probed.failures,
        mdns=mdns and mdns_error is None,
        mdns_error=mdns_error,
        seconds=time.monotonic() - t0,
    )
