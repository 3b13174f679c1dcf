"""Finding nodes from the command line, shared by `nodes`, `node` and `split-generate`: the
discovery options, the static peers, and picking the decode and prefill nodes when none is
named. discovery/ finds, discovery/peers.py chooses; this module only parses and prints.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo_split.cli.common import say, seconds
from exo_split.errors import ExoSplitError

DEFAULT_TIMEOUT = 2.0


def _timeout(text: str) -> float:
    return seconds(text, below=3600)


def add_discovery_options(p: argparse.ArgumentParser, *, timeout: bool = True) -> None:
    """--peer, --no-mdns, --interface (and --timeout): shared by node, nodes, split-generate."""
    g = p.add_argument_group("finding nodes (docs/discovery.md)")
    g.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a node's address, for when mDNS does not get through (repeatable; also "
        "$EXO_SPLIT_PEERS, comma-separated)",
    )
    g.add_argument("--no-mdns", action="store_true", help="no multicast: --peer addresses only")
    g.add_argument(
        "--interface",
        action="append",
        metavar="IF",
        help="use mDNS only on this interface name or address (repeatable; default: all)",
    )
    if timeout:
        g.add_argument(
            "--timeout",
            type=_timeout,
            default=DEFAULT_TIMEOUT,
            metavar="S",
            help=f"how long to listen for nodes (default {DEFAULT_TIMEOUT:g} s)",
        )


def static_peers(args) -> list:
    """--peer and $EXO_SPLIT_PEERS, parsed; a bad address is a usage error."""
    from exo_split.discovery import parse_peers, peers_from_env

    try:
        return list(dict.fromkeys([*parse_peers(args.peer), *peers_from_env(os.environ)]))
    except ValueError as exc:
        raise ExoSplitError(str(exc), hint="write peers as HOST:PORT, [IPV6]:PORT") from exc


def interfaces(args) -> list[str] | None:
    from exo_split.discovery.addresses import interface_addresses

    if not args.interface:
        return None
    try:
        return interface_addresses(args.interface)
    except ValueError as exc:
        raise ExoSplitError(f"--interface: {exc}") from exc


def token_or_none(token_file: Path | None) -> str | None:
    from exo_split.transport.auth import resolve_token

    try:
        return resolve_token(token_file, dict(os.environ), create=False)[0]
    except ExoSplitError:
        return None  # mDNS needs none; static peers will say 401


def discover(args, token: str | None, *, enough=None):
    """Browse (unless --no-mdns) and probe the static peers; returns discovery.Found."""
    from exo_split.discovery import find_peers

    static = static_peers(args)
    where = interfaces(args)

    async def run():
        import aiohttp

        from exo_split.transport.client import fetch_info

        async with aiohttp.ClientSession() as session:

            def info(host: str, port: int):
                from exo_split.discovery import format_url

                return fetch_info(session, format_url(host, port), token, timeout=args.timeout)

            return await find_peers(
                static,
                fetch_info=info,
                mdns=not args.no_mdns,
                interfaces=where,
                timeout=args.timeout,
                enough=enough,
            )

    return asyncio.run(run())


def peer_doc(p) -> dict[str, Any]:
    """One node as `nodes --json` shows it."""
    d = dataclasses.asdict(p)
    d.pop("seen_at", None)
    prefill, decode = d.pop("prefill_tps"), d.pop("decode_tps")
    return {
        **d,
        "url": p.url,
        "capabilities": {"prefill_tps": prefill, "decode_tps": decode},
    }


# ---- exo-split nodes ----------------------------------------------------------------------


@dataclass(frozen=True)
class Roles:
    """Who does what, as found: the decode node's URL, the prefill node to name (only
    with --prefill remote: otherwise the decode node chooses), and a summary for --json."""

    decode_url: str
    prefill_url: str | None
    summary: dict[str, Any]


def _has_pair(peers) -> bool:
    from exo_split.discovery import choose_pair

    try:
        _, prefill, decode = choose_pair(peers)
    except ValueError:
        return False
    return prefill is not None and decode is not None and prefill.node_id != decode.node_id


def _proven(peers, token: str | None) -> list:
    """The peers that prove they hold the token (GET /v1/hello): what a record advertises
    earns nothing; a device that only advertises itself is skipped, saying so."""
    import aiohttp

    from exo_split.errors import PeerUnavailable
    from exo_split.transport.peer import prove_peer

    if not token:
        return list(peers)

    async def check(session, p) -> bool:
        try:
            await prove_peer(session, p.url, token, timeout=3.0)
            return True
        except PeerUnavailable as exc:
            say(f"skipping {p.name} at {p.url}: {exc}")
            return False

    async def run() -> list[bool]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(check(session, p) for p in peers))

    return [p for p, ok in zip(peers, asyncio.run(run()), strict=True) if ok]


def find_roles(args, token: str) -> Roles:
    """Find the nodes and pick the decode node (best decode speed) and the prefill node
    (best prefill speed among the other nodes serving the same model)."""
    from exo_split.discovery import NO_PEERS_HINT, choose_pair

    found = discover(args, token, enough=_has_pair)
    for failure in found.failures:
        say(f"static peer {failure}")
    if not found.peers:
        raise ExoSplitError("no exo-split node found to run the request", hint=NO_PEERS_HINT)
    peers = _proven(found.peers, token)
    if not peers:
        raise ExoSplitError(
            f"none of the {len(found.peers)} node(s) found proved that it holds the shared token",
            hint="copy the token file from the machine whose node generated it",
        )
    try:
        fingerprint, prefill, decode = choose_pair(peers, fingerprint=args.fingerprint)
    except ValueError as exc:
        raise ExoSplitError(str(exc), hint="pick one with --fingerprint PREFIX") from exc
    if decode is None:
        raise ExoSplitError(
            f"none of the {len(found.peers)} node(s) found can decode",
            hint="start a node with the decode role, or name it with --decode-peer",
        )
    if prefill is not None and prefill.node_id == decode.node_id:
        prefill = None
    plan = f"decode on {decode.name} ({decode.backend}/{decode.device}) at {decode.url}"
    if prefill is not None:
        plan += f"; prefill node {prefill.name} ({prefill.backend}/{prefill.device})"
    say(f"found {len(found.peers)} node(s) in {found.seconds:.1f} s: {plan}")
    summary = {
        "fingerprint": fingerprint,
        "decode": peer_doc(decode),
        "prefill": peer_doc(prefill) if prefill is not None else None,
        "found": [peer_doc(p) for p in found.peers],
        "discovery_s": found.seconds,
    }
    name_prefill = prefill is not None and args.prefill == "remote"
    return Roles(decode.url, prefill.url if name_prefill else None, summary)
