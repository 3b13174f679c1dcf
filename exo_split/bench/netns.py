"""Two Linux network namespaces joined by a veth pair: two "machines" on one box.

Used by tests that must not send traffic from the host's own namespace (mDNS) and by
benchmarks that shape the link (``tc ... tbf``). Needs root and iproute2.

    with netns_pair(rate="1gbit") as (a, b):
        subprocess.run([*ns_exec_prefix(a), sys.executable, "-c", "..."], check=True)
        # a.name, a.ipv4 ("10.213.x.1"), a.veth; b.ipv4 == "10.213.x.2"

The addresses live on the veth ends only, so they exist only inside the two namespaces.
Names carry the pid and a counter, so parallel runs do not clash. Everything the context
manager created is removed in ``finally``, including processes still running inside.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

_counter = itertools.count()


@dataclass(frozen=True)
class Netns:
    name: str  # namespace name, for `ip netns exec NAME`
    veth: str  # the namespace's end of the veth pair
    ipv4: str  # address on `veth`, /24
    ipv6: str | None = None  # ULA address on `veth`, /64, when asked for


def ns_exec_prefix(ns: Netns | str) -> list[str]:
    """The argv prefix that runs a command inside `ns`."""
    return ["ip", "netns", "exec", ns.name if isinstance(ns, Netns) else ns]


@functools.cache
def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be created here, or None when they can.

    Listing namespaces works in an unprivileged container too, so the probe really makes a
    throwaway namespace with a veth pair and removes it: what the tests and the bench do.
    """
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    name = f"exsprobe{os.getpid()}"
    steps = (
        ("netns", "add", name),
        ("link", "add", f"{name}a", "type", "veth", "peer", "name", f"{name}b"),
        ("link", "set", f"{name}b", "netns", name),
    )
    try:
        for step in steps:
            proc = subprocess.run(["ip", *step], capture_output=True, text=True, timeout=10)
            if proc.returncode != 0:
                return f"`ip {' '.join(step)}` failed: {proc.stderr.strip() or proc.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip` failed: {exc}"
    finally:
        for cleanup in (("link", "del", f"{name}a"), ("netns", "del", name)):
            subprocess.run(["ip", *cleanup], capture_output=True, timeout=10)
    return None


_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_UNITS |= {u.replace("bit", "bps"): 8 * f for u, f in _RATE_UNITS.items()}


def rate_bits(rate: str | int) -> int:
    """A tc rate ("800mbit", "1gbit", "125mbps" = bytes/s) or bits/s (int) as bits/s."""
    if isinstance(rate, int):
        return rate
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", rate.lower())
    if m is None or m.group(2) not in _RATE_UNITS | {"": 1}:
        raise ValueError(f"expected a tc rate like '1gbit' or '800mbit', got {rate!r}")
    return int(float(m.group(1)) * _RATE_UNITS.get(m.group(2), 1))


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def _shape(ns: str, dev: str, rate: str | int, burst: str | int | None, latency: str) -> None:
    """Token-bucket shaping on the egress of `dev` (netem is not available here)."""
    if burst is None:
        # tbf needs burst >= rate / HZ; ~10 ms worth of bytes is safe for any kernel HZ.
        burst = max(rate_bits(rate) // 8 // 100, 32 * 1024)
    rate_arg = f"{rate}bit" if isinstance(rate, int) else rate
    cmd = [*ns_exec_prefix(ns), "tc", "qdisc", "add", "dev", dev, "root", "tbf"]
    cmd += ["rate", rate_arg, "burst", str(burst), "latency", latency]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def _kill_namespace_pids(ns: str) -> None:
    """Processes the test left inside `ns` (by pid, from `ip netns pids`)."""
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in proc.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def netns_pair(
    rate: str | int | None = None,
    *,
    ipv6: bool = False,
    burst: str | int | None = None,
    latency: str = "50ms",
) -> Iterator[tuple[Netns, Netns]]:
    """Create namespaces A and B joined by a veth pair; remove them on exit.

    rate: None for an unshaped link, else a tc rate ("1gbit", "800mbit") or bits/s (int),
    applied with tbf to both directions. ipv6: also put fd00:213:x::1/64 and ::2/64 on the
    veth ends (no duplicate address detection, so they are usable at once).
    """
    reason = netns_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    n = next(_counter)
    tag = f"{os.getpid()}x{n}"
    subnet = (os.getpid() + n) % 250 + 1
    names = (f"exs{tag}a", f"exs{tag}b")
    veths = (f"xva{tag}", f"xvb{tag}")  # interface names: 15 characters at most
    if len(veths[0]) > 15:
        raise RuntimeError(f"veth name {veths[0]!r} is longer than 15 characters")
    v4 = (f"10.213.{subnet}.1", f"10.213.{subnet}.2")
    v6 = (f"fd00:213:{subnet:x}::1", f"fd00:213:{subnet:x}::2") if ipv6 else (None, None)
    created: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            created.append(name)
        # Both ends are created inside their namespaces: the host's never sees them.
        _ip("link", "add", veths[0], "netns", names[0], "type", "veth",
            "peer", "name", veths[1], "netns", names[1])  # fmt: skip
        for name, veth, addr4, addr6 in zip(names, veths, v4, v6, strict=True):
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "addr", "add", f"{addr4}/24", "dev", veth)
            if addr6 is not None:
                _ip("-n", name, "addr", "add", f"{addr6}/64", "dev", veth, "nodad")
            _ip("-n", name, "link", "set", veth, "up")
            if rate is not None:
                _shape(name, veth, rate, burst, latency)
        yield tuple(  # type: ignore[misc]
            Netns(name=name, veth=veth, ipv4=addr4, ipv6=addr6)
            for name, veth, addr4, addr6 in zip(names, veths, v4, v6, strict=True)
        )
    finally:
        for name in created:
            _kill_namespace_pids(name)
            # Deleting a namespace deletes the veth end inside it, and so the whole pair.
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
