"""This machine's addresses for mDNS: which to advertise, what `--interface` means, and which
of a peer's addresses to connect to. ifaddr and ipaddress only."""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Sequence

import ifaddr


def strip_zone(addr: str) -> str:
    return addr.split("%", 1)[0]


def check_interfaces(interfaces: Sequence[str] | None) -> list[str] | None:
    if interfaces is None:
        return None
    if isinstance(interfaces, str):
        interfaces = [interfaces]
    for addr in interfaces:
        try:
            ip = ipaddress.ip_address(strip_zone(addr))
        except ValueError as exc:
            raise ValueError(f"interfaces must be IP addresses, got {addr!r}") from exc
        if ip.is_unspecified:
            raise ValueError(f"{addr!r} is not an interface address; pass None for all")
    if not interfaces:
        raise ValueError("interfaces is empty; pass None for all interfaces")
    return list(interfaces)


def adapter_addresses() -> list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]:
    """Every address on this machine, with its prefix length."""
    found: list[ipaddress.IPv4Interface | ipaddress.IPv6Interface] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            addr = ip.ip[0] if isinstance(ip.ip, tuple) else ip.ip
            with contextlib.suppress(ValueError):
                found.append(ipaddress.ip_interface(f"{strip_zone(addr)}/{ip.network_prefix}"))
    return found


def local_addresses() -> list[str]:
    """Addresses worth advertising when no interfaces are given: IPv4 first, then global
    or ULA IPv6; never link-local (useless without a zone); loopback only if nothing else."""
    found = adapter_addresses()
    usable = [a for a in found if not a.ip.is_loopback and not a.ip.is_link_local]
    usable.sort(key=lambda a: a.version)
    chosen = usable or [a for a in found if a.ip.is_loopback]
    return list(dict.fromkeys(str(a.ip) for a in chosen))


def interface_addresses(items: Sequence[str]) -> list[str]:
    """`--interface` values as addresses: an IP address stays as it is; an interface name
    (en0, eth0) becomes its IPv4 and routable IPv6 addresses. ValueError names what is
    unknown and lists the interfaces there are."""
    out: list[str] = []
    adapters = None
    for item in items:
        try:
            ipaddress.ip_address(strip_zone(item))
            out.append(item)
            continue
        except ValueError:
            pass
        adapters = adapters if adapters is not None else ifaddr.get_adapters()
        match = next((a for a in adapters if item in (a.nice_name, a.name)), None)
        if match is None:
            names = ", ".join(sorted({a.nice_name for a in adapters}))
            raise ValueError(f"no interface or address {item!r} here (interfaces: {names})")
        found = []
        for ip in match.ips:
            addr = ipaddress.ip_address(strip_zone(ip.ip[0] if isinstance(ip.ip, tuple) else ip.ip))
            if not addr.is_link_local:
                found.append(str(addr))
        if not found:
            raise ValueError(f"interface {item!r} has no usable IPv4 or IPv6 address")
        out.extend(sorted(found, key=lambda a: ":" in a))
    return list(dict.fromkeys(out))


def pick_host(addresses: Sequence[str], local: Sequence[ipaddress._BaseNetwork] = ()) -> str:
    """The address to connect to: one on a subnet we share first, then IPv4 over IPv6,
    routable over loopback, link-local last. Order is otherwise kept."""

    def rank(addr: str) -> tuple[bool, bool, bool, bool]:
        ip = ipaddress.ip_address(strip_zone(addr))
        return (
            not any(ip in net for net in local if net.version == ip.version),
            ip.is_loopback,
            ip.is_link_local,
            ip.version != 4,
        )

    return min(addresses, key=rank)
