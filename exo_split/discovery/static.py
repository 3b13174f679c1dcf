"""Static peers: `--peer HOST:PORT` (repeatable) and `EXO_SPLIT_PEERS`.

The fallback for when mDNS does not get through (different subnets, VPNs, macOS Local
Network permission, headless servers). A static address says nothing about the node
behind it, so `probe_static` asks each one for its GET /v1/info through an injected
client; the ones that do not answer are returned with the reason, not raised.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from exo_split.errors import ExoSplitError

from .peers import NodeInfo, PeerInfo, format_url

log = logging.getLogger(__name__)

ENV_VAR = "EXO_SPLIT_PEERS"
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")

FetchInfo = Callable[[str, int], Awaitable[Mapping[str, Any]]]


@dataclass(frozen=True)
class PeerAddress:
    """A peer given by address: host is an IPv4/IPv6 address (no brackets) or a hostname."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return format_url(self.host, self.port)


def _port(text: str, whole: str) -> int:
    if not text:
        raise ValueError(f"expected HOST:PORT, got {whole!r} (missing port)")
    if not text.isdigit():
        raise ValueError(f"port must be a number, got {text!r} in {whole!r}")
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be 1-65535, got {port} in {whole!r}")
    return port


def parse_peer(text: str) -> PeerAddress:
    """Parse `HOST:PORT`: `10.0.0.2:8470`, `spark.local:8470`, `[fe80::1%en0]:8470`.

    ValueError says what was expected and what came.
    """
    whole = text
    text = text.strip()
    if not text:
        raise ValueError("expected HOST:PORT, got an empty string")
    if "://" in text:
        raise ValueError(f"expected HOST:PORT without a scheme, got {whole!r}")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"expected [IPV6]:PORT, got {whole!r} (no closing bracket)")
        if not rest.startswith(":"):
            raise ValueError(f"expected [IPV6]:PORT, got {whole!r} (missing port)")
        try:
            ipaddress.IPv6Address(host)  # accepts a %zone suffix
        except ValueError as exc:
            raise ValueError(f"{host!r} in {whole!r} is not an IPv6 address") from exc
        return PeerAddress(host, _port(rest[1:], whole))
    if text.count(":") > 1:
        raise ValueError(f"write an IPv6 address in brackets, [ADDR]:PORT; got {whole!r}")
    host, sep, port = text.partition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT, got {whole!r} (missing port)")
    if not host:
        raise ValueError(f"expected HOST:PORT, got {whole!r} (missing host)")
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError as exc:
            raise ValueError(f"{host!r} in {whole!r} is not an IPv4 address") from exc
    elif len(host) > 253 or not _HOSTNAME.fullmatch(host):
        raise ValueError(f"{host!r} in {whole!r} is not a valid hostname")
    return PeerAddress(host, _port(port, whole))


def parse_peers(items: Iterable[str]) -> list[PeerAddress]:
    """Parse several addresses (each item may itself be a comma/space-separated list);
    duplicates are dropped, order kept."""
    found: dict[PeerAddress, None] = {}
    for item in items:
        for part in re.split(r"[,\s]+", item):
            if part:
                found[parse_peer(part)] = None
    return list(found)


def peers_from_env(environ: Mapping[str, str]) -> list[PeerAddress]:
    """The peers listed in EXO_SPLIT_PEERS (comma or space separated); [] when unset."""
    try:
        return parse_peers([environ.get(ENV_VAR, "")])
    except ValueError as exc:
        raise ValueError(f"{ENV_VAR}: {exc}") from exc


@dataclass(frozen=True)
class ProbeFailure:
    address: PeerAddress
    reason: str

    def __str__(self) -> str:
        return f"{self.address}: {self.reason}"


@dataclass(frozen=True)
class StaticProbe:
    """What probing the static peers found: who answered, and why the others did not."""

    peers: tuple[PeerInfo, ...]
    failures: tuple[ProbeFailure, ...]


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ExoSplitError):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _probe(address: PeerAddress, fetch_info: FetchInfo, timeout: float) -> PeerInfo:
    try:
        info = await asyncio.wait_for(fetch_info(address.host, address.port), timeout)
    except asyncio.TimeoutError as exc:
        raise ExoSplitError(f"no answer to GET /v1/info within {timeout:g} s") from exc
    try:
        node = NodeInfo.from_info_dict(info)
    except ValueError as exc:
        raise ExoSplitError(f"bad GET /v1/info answer: {exc}") from exc
    return PeerInfo.from_node(node, host=address.host, port=address.port, source="static")


async def probe_static(
    addrs: Iterable[PeerAddress | str], *, fetch_info: FetchInfo, timeout: float = 3.0
) -> StaticProbe:
    """Ask every static peer, concurrently, for its info; `timeout` applies to each.

    `fetch_info(host, port)` is the node's GET /v1/info client; any exception it raises
    (or a timeout, or a malformed answer) becomes a `ProbeFailure` with the reason.
    """
    parsed = (a if isinstance(a, PeerAddress) else parse_peer(a) for a in addrs)
    addresses = list(dict.fromkeys(parsed))
    results = await asyncio.gather(
        *(_probe(a, fetch_info, timeout) for a in addresses), return_exceptions=True
    )
    peers: list[PeerInfo] = []
    failures: list[ProbeFailure] = []
    for address, result in zip(addresses, results, strict=True):
        if isinstance(result, PeerInfo):
            peers.append(result)
        elif isinstance(result, Exception):
            failure = ProbeFailure(address, _reason(result))
            log.warning("static peer %s", failure)
            failures.append(failure)
        else:  # CancelledError, KeyboardInterrupt...: not a property of the peer
            raise result
    return StaticProbe(peers=tuple(peers), failures=tuple(failures))
