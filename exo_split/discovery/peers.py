"""What a node says about itself (`NodeInfo`), what we know about a peer (`PeerInfo`),
and the two decisions made from a list of peers: `merge_peers` and `choose_roles`.

Pure data and functions: no sockets, no zeroconf, no ML framework. mDNS (mdns.py) and
the static `--peer` list (static.py) both end up here as `PeerInfo`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from exo_split import PROTOCOL_VERSION
from exo_split.errors import ExoSplitError

BACKENDS = ("torch", "mlx", "vllm")
DEVICES = ("cuda", "metal", "mps", "cpu")
ROLES = ("prefill", "decode")
SOURCES = ("mdns", "static", "both")


def new_node_id() -> str:
    """A fresh random node id (32 hex digits); a node keeps it for its lifetime."""
    return uuid.uuid4().hex


def _check_choice(what: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")


def _tps(value: Any, what: str) -> float | None:
    """A tokens/s figure: None (unknown) or a finite number >= 0."""
    if value is None:
        return None
    try:
        tps = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be a number of tokens/s, got {value!r}") from exc
    if not tps >= 0 or tps == float("inf"):  # also rejects NaN
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return tps


@dataclass(frozen=True)
class NodeInfo:
    """A node's description of itself: what it advertises and answers on GET /v1/info."""

    node_id: str
    name: str  # human-readable, e.g. the hostname
    backend: str  # "torch" | "mlx"
    device: str  # "cuda" | "metal" | "cpu"
    model: str  # model name, for people; `fingerprint` is what must match
    fingerprint: str
    protocol: int = PROTOCOL_VERSION
    roles: tuple[str, ...] = ROLES
    prefill_tps: float | None = None  # measured prompt tokens/s; None until measured
    decode_tps: float | None = None  # measured generated tokens/s; None until measured
    quantization: str | None = None  # the weights' quantization tag ("q4g64-affine"); None: full

    def __post_init__(self) -> None:
        for what in ("node_id", "name", "model", "fingerprint"):
            value = getattr(self, what)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{what} must be a non-empty string, got {value!r}")
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("device", self.device, DEVICES)
        if isinstance(self.protocol, bool) or not isinstance(self.protocol, int):
            raise ValueError(f"protocol must be an int, got {self.protocol!r}")
        roles = (self.roles,) if isinstance(self.roles, str) else tuple(self.roles)
        for role in roles:
            _check_choice("role", role, ROLES)
        object.__setattr__(self, "roles", roles)
        object.__setattr__(self, "prefill_tps", _tps(self.prefill_tps, "prefill_tps"))
        object.__setattr__(self, "decode_tps", _tps(self.decode_tps, "decode_tps"))
        if self.quantization is not None and (
            not isinstance(self.quantization, str) or not self.quantization
        ):
            raise ValueError(f"quantization must be a tag or None, got {self.quantization!r}")

    def to_info_dict(self) -> dict[str, Any]:
        """The JSON body of GET /v1/info (`from_info_dict` reads it back)."""
        return {
            "node_id": self.node_id,
            "name": self.name,
            "backend": self.backend,
            "device": self.device,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "protocol": self.protocol,
            "roles": list(self.roles),
            "capabilities": {"prefill_tps": self.prefill_tps, "decode_tps": self.decode_tps},
            "quantization": self.quantization,
        }

    @classmethod
    def from_info_dict(cls, info: Mapping[str, Any]) -> NodeInfo:
        """Parse a GET /v1/info body; ValueError names the missing or bad field."""
        if not isinstance(info, Mapping):
            raise ValueError(f"expected a JSON object, got {type(info).__name__}")
        keys = ("node_id", "name", "backend", "device", "model", "fingerprint", "protocol")
        missing = [k for k in (*keys, "roles") if k not in info]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        caps = info.get("capabilities") or {}
        if not isinstance(caps, Mapping):
            raise ValueError(f"capabilities must be an object, got {caps!r}")
        roles = info["roles"]
        if isinstance(roles, str):
            roles = [r for r in roles.split(",") if r]
        quant = info.get("quantization")  # a node's /v1/info holds the whole description
        return cls(
            **{k: info[k] for k in keys},
            roles=tuple(roles),
            prefill_tps=caps.get("prefill_tps"),
            decode_tps=caps.get("decode_tps"),
            quantization=quant.get("tag") if isinstance(quant, Mapping) else quant,
        )


def format_url(host: str, port: int) -> str:
    """http://host:port, with IPv6 in brackets and a zone id escaped as %25 (RFC 6874)."""
    if ":" in host:
        host = "[" + host.replace("%", "%25") + "]"
    return f"http://{host}:{port}"


@dataclass(frozen=True)
class PeerInfo:
    """Another node as we found it: its `NodeInfo` fields plus where to reach it."""

    node_id: str
    name: str
    host: str  # the address (or, for a static peer, the hostname) to connect to
    port: int
    backend: str
    device: str
    model: str
    fingerprint: str
    protocol: int
    roles: tuple[str, ...]
    prefill_tps: float | None
    decode_tps: float | None
    source: str  # "mdns" | "static" | "both"
    quantization: str | None = None  # NodeInfo.quantization
    addresses: tuple[str, ...] = ()  # every known address, IPv4 and IPv6; `host` first
    # time.monotonic() when these fields were read; merge_peers keeps the fresher figures.
    seen_at: float = field(default=0.0, compare=False)

    @property
    def url(self) -> str:
        return format_url(self.host, self.port)

    @classmethod
    def from_node(
        cls,
        node: NodeInfo,
        *,
        host: str,
        port: int,
        source: str,
        addresses: Iterable[str] = (),
        seen_at: float | None = None,
    ) -> PeerInfo:
        _check_choice("source", source, SOURCES)
        return cls(
            node_id=node.node_id,
            name=node.name,
            host=host,
            port=port,
            backend=node.backend,
            device=node.device,
            model=node.model,
            fingerprint=node.fingerprint,
            protocol=node.protocol,
            roles=node.roles,
            prefill_tps=node.prefill_tps,
            decode_tps=node.decode_tps,
            quantization=node.quantization,
            source=source,
            addresses=_unique((host, *addresses)),
            seen_at=time.monotonic() if seen_at is None else seen_at,
        )


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _has_static(p: PeerInfo) -> bool:
    return p.source in ("static", "both")


def _merge_two(old: PeerInfo, new: PeerInfo) -> PeerInfo:
    """One node seen twice. Identity and figures from the fresher sighting (a figure it does
    not know is taken from the other); the endpoint from a static sighting when there is one,
    since that address was just reached, not merely advertised."""
    fresh, stale = (new, old) if new.seen_at >= old.seen_at else (old, new)
    endpoint = fresh
    if _has_static(stale) and not _has_static(fresh):
        endpoint = stale
    sources = {old.source, new.source}
    source = "both" if "both" in sources or sources == {"mdns", "static"} else fresh.source
    return replace(
        fresh,
        host=endpoint.host,
        port=endpoint.port,
        source=source,
        addresses=_unique((endpoint.host, *old.addresses, *new.addresses)),
        prefill_tps=fresh.prefill_tps if fresh.prefill_tps is not None else stale.prefill_tps,
        decode_tps=fresh.decode_tps if fresh.decode_tps is not None else stale.decode_tps,
    )


def merge_peers(*lists: Iterable[PeerInfo]) -> list[PeerInfo]:
    """One entry per node_id, in order of first appearance (e.g. mDNS list, then static).

    The same node found by mDNS and by --peer becomes one entry with source="both".
    """
    merged: dict[str, PeerInfo] = {}
    for peers in lists:
        for peer in peers:
            old = merged.get(peer.node_id)
            merged[peer.node_id] = peer if old is None else _merge_two(old, peer)
    return list(merged.values())


def _prefill_rank(p: PeerInfo) -> tuple:
    # Sorted ascending: full-precision weights first (the prefill side stays at full
    # precision: its KV and first token are the quantized decode's starting point), measured
    # before unknown, faster first, then torch, then cuda.
    return (
        p.quantization is not None,
        p.prefill_tps is None,
        -(p.prefill_tps or 0.0),
        p.backend != "torch",
        p.device != "cuda",
    )


def _decode_rank(p: PeerInfo) -> tuple:
    return (p.decode_tps is None, -(p.decode_tps or 0.0), p.backend != "mlx", p.device != "metal")


def _share(tps: float | None, best: float | None) -> float:
    """A candidate's speed as a fraction of the best candidate's (1.0 when nothing is known)."""
    if best is None or best <= 0:
        return 1.0
    return (tps or 0.0) / best


def choose_roles(
    peers: Iterable[PeerInfo], fingerprint: str, *, protocol: int | None = PROTOCOL_VERSION
) -> tuple[PeerInfo | None, PeerInfo | None]:
    """(prefill peer, decode peer) among peers that serve `fingerprint` (and `protocol`,
    unless None): best prefill_tps and best decode_tps; unknown speeds rank last.

    Ties go to torch/cuda for prefill and mlx/metal for decode, so a CUDA box and a Mac
    pair up before anything is measured. The two differ whenever two nodes can serve: if
    one node is best at both, it keeps the role where giving it up costs more (speeds
    compared as fractions of the best), prefill winning a tie.
    """
    usable = [
        p
        for p in peers
        if p.fingerprint == fingerprint and (protocol is None or p.protocol == protocol)
    ]
    prefills = sorted((p for p in usable if "prefill" in p.roles), key=_prefill_rank)
    decodes = sorted((p for p in usable if "decode" in p.roles), key=_decode_rank)
    if not prefills or not decodes:
        return (prefills[0] if prefills else None, decodes[0] if decodes else None)
    best_p, best_d = prefills[0], decodes[0]
    if best_p.node_id != best_d.node_id:
        return best_p, best_d
    other_d = next((d for d in decodes if d.node_id != best_p.node_id), None)
    other_p = next((p for p in prefills if p.node_id != best_d.node_id), None)
    options = [(best_p, other_d)] if other_d is not None else []
    if other_p is not None:
        options.append((other_p, best_d))
    if not options:  # a single node serves both roles
        return best_p, best_d

    def score(pair: tuple[PeerInfo, PeerInfo]) -> float:
        p, d = pair
        return _share(p.prefill_tps, best_p.prefill_tps) + _share(d.decode_tps, best_d.decode_tps)

    return max(options, key=score)  # max keeps the first of equals: prefill wins a tie


def prefill_candidates(
    peers: Iterable[PeerInfo],
    fingerprint: str,
    *,
    exclude: Iterable[str] = (),
    protocol: int | None = PROTOCOL_VERSION,
) -> list[PeerInfo]:
    """The peers that can prefill for `fingerprint` (and `protocol`), best first (the
    ranking of choose_roles), leaving out the node ids in `exclude` (e.g. our own)."""
    skip = set(exclude)
    usable = (
        p
        for p in peers
        if p.node_id not in skip
        and p.fingerprint == fingerprint
        and (protocol is None or p.protocol == protocol)
        and "prefill" in p.roles
    )
    return sorted(usable, key=_prefill_rank)


def choose_pair(
    peers: Iterable[PeerInfo], *, fingerprint: str | None = None
) -> tuple[str, PeerInfo | None, PeerInfo | None]:
    """(fingerprint, prefill peer, decode peer) when no node was named.

    The model is `fingerprint` (a prefix is enough), else the one served by the most nodes,
    preferring a model that two different nodes serve. ValueError when nothing matches, or
    when two models are equally good candidates: the message lists them.
    """
    peers = [p for p in peers if p.protocol == PROTOCOL_VERSION]
    models: dict[str, list[PeerInfo]] = {}
    for p in peers:
        if fingerprint is None or p.fingerprint.startswith(fingerprint):
            models.setdefault(p.fingerprint, []).append(p)
    if not models:
        wanted = f" serving fingerprint {fingerprint}" if fingerprint else ""
        raise ValueError(f"no node{wanted} found among {len(peers)} peer(s)")

    def score(fp: str) -> tuple[bool, int]:
        prefill, decode = choose_roles(models[fp], fp)
        split = prefill is not None and decode is not None and prefill.node_id != decode.node_id
        return split, len(models[fp])

    ranked = sorted(models, key=score, reverse=True)
    if len(ranked) > 1 and score(ranked[0]) == score(ranked[1]):
        listed = ", ".join(f"{models[fp][0].model} ({fp[:12]})" for fp in ranked)
        raise ValueError(f"nodes serve several models equally: {listed}; name one")
    best = ranked[0]
    return (best, *choose_roles(models[best], best))


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
