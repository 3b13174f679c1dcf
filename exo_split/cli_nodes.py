"""CLI: `exo-split nodes` (who is out there), and the node finding of `split-generate` when
no node is named. Parsing and printing only; discovery/ finds, peers.py chooses.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo_split.errors import ExoSplitError

DEFAULT_TIMEOUT = 2.0


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 3600:
        raise argparse.ArgumentTypeError(f"expected seconds between 0 and 3600, got {text!r}")
    return value


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
            type=_seconds,
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
    from exo_split.discovery.mdns import interface_addresses

    if not args.interface:
        return None
    try:
        return interface_addresses(args.interface)
    except ValueError as exc:
        raise ExoSplitError(f"--interface: {exc}") from exc


def _token(token_file: Path | None) -> str | None:
    from exo_split.auth import resolve_token

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


def add_nodes(subparsers) -> None:
    p = subparsers.add_parser(
        "nodes",
        help="list the exo-split nodes found on the network",
        description="Listen for nodes over mDNS (and ask the --peer addresses) and list them: "
        "address, backend, device, model, fingerprint, measured speeds, how each was found.",
    )
    add_discovery_options(p)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument(
        "--token-file", type=Path, help="token for --peer addresses (default: as for node)"
    )
    p.set_defaults(func=cmd_nodes)


def cmd_nodes(args) -> int:
    from exo_split.discovery import NO_PEERS_HINT

    found = discover(args, _token(args.token_file))
    if args.json:
        doc = {
            "nodes": [peer_doc(p) for p in found.peers],
            "failures": [{"address": str(f.address), "reason": f.reason} for f in found.failures],
            "mdns": found.mdns,
            "mdns_error": found.mdns_error,
            "seconds": found.seconds,
        }
        print(json.dumps(doc), flush=True)
    elif found.peers:
        _print_table(found.peers)
    for failure in found.failures:
        _say(f"static peer {failure}")
    if found.mdns_error:
        _say(f"mDNS unavailable: {found.mdns_error}")
    if not found.peers:
        how = "over mDNS" if found.mdns else "at the --peer addresses"
        _say(f"no exo-split node found {how} in {found.seconds:.1f} s")
        _say(f"  hint: {NO_PEERS_HINT}")
        return 1
    return 0


def _tps(x: float | None, fmt: str) -> str:
    return "?" if x is None else format(x, fmt)


def _print_table(peers) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD)
    for col in ("name", "address", "backend", "device", "model", "fingerprint",
                "prefill tok/s", "decode tok/s", "found by"):  # fmt: skip
        table.add_column(col, justify="right" if "tok/s" in col else "left")
    for p in peers:
        addr = f"[{p.host}]:{p.port}" if ":" in p.host else f"{p.host}:{p.port}"
        table.add_row(p.name, addr, p.backend, p.device, p.model, p.fingerprint[:12],
                      _tps(p.prefill_tps, ".0f"), _tps(p.decode_tps, ".1f"), p.source)  # fmt: skip
    # Piped output is not cut at 80 columns: a table is read whole or not at all.
    width = None if sys.stdout.isatty() else 200
    Console(file=sys.stdout, highlight=False, width=width).print(table)


# ---- split-generate without named nodes ---------------------------------------------------


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


def find_roles(args, token: str) -> Roles:
    """Find the nodes and pick the decode node (best decode speed) and the prefill node
    (best prefill speed among the other nodes serving the same model)."""
    from exo_split.discovery import NO_PEERS_HINT, choose_pair

    found = discover(args, token, enough=_has_pair)
    for failure in found.failures:
        _say(f"static peer {failure}")
    if not found.peers:
        raise ExoSplitError("no exo-split node found to run the request", hint=NO_PEERS_HINT)
    try:
        fingerprint, prefill, decode = choose_pair(found.peers, fingerprint=args.fingerprint)
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
    _say(f"found {len(found.peers)} node(s) in {found.seconds:.1f} s: {plan}")
    summary = {
        "fingerprint": fingerprint,
        "decode": peer_doc(decode),
        "prefill": peer_doc(prefill) if prefill is not None else None,
        "found": [peer_doc(p) for p in found.peers],
        "discovery_s": found.seconds,
    }
    name_prefill = prefill is not None and args.prefill == "remote"
    return Roles(decode.url, prefill.url if name_prefill else None, summary)
