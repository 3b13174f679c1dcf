"""`exo-split nodes`: list the nodes found over mDNS and at the --peer addresses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from exo_split.cli.common import say
from exo_split.cli.discover import add_discovery_options, discover, peer_doc, token_or_none


def add_nodes(subparsers) -> None:
    p = subparsers.add_parser(
        "nodes",
        help="list the exo-split nodes found on the network",
        description="Listen for nodes over mDNS (and ask the --peer addresses) and list them: "
        "address, backend, device, model, weights (quantization), fingerprint, measured speeds, "
        "how each was found.",
    )
    add_discovery_options(p)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument(
        "--token-file", type=Path, help="token for --peer addresses (default: as for node)"
    )
    p.set_defaults(func=cmd_nodes)


def cmd_nodes(args) -> int:
    from exo_split.discovery import NO_PEERS_HINT

    found = discover(args, token_or_none(args.token_file))
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
        say(f"static peer {failure}")
    if found.mdns_error:
        say(f"mDNS unavailable: {found.mdns_error}")
    if not found.peers:
        how = "over mDNS" if found.mdns else "at the --peer addresses"
        say(f"no exo-split node found {how} in {found.seconds:.1f} s")
        say(f"  hint: {NO_PEERS_HINT}")
        return 1
    return 0


def _tps(x: float | None, fmt: str) -> str:
    return "?" if x is None else format(x, fmt)


def _print_table(peers) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD)
    for col in ("name", "address", "backend", "device", "model", "weights", "fingerprint",
                "prefill tok/s", "decode tok/s", "found by"):  # fmt: skip
        table.add_column(col, justify="right" if "tok/s" in col else "left")
    for p in peers:
        addr = f"[{p.host}]:{p.port}" if ":" in p.host else f"{p.host}:{p.port}"
        table.add_row(p.name, addr, p.backend, p.device, p.model, p.quantization or "full",
                      p.fingerprint[:12], _tps(p.prefill_tps, ".0f"), _tps(p.decode_tps, ".1f"),
                      p.source)  # fmt: skip
    # Piped output is not cut at 80 columns: a table is read whole or not at all.
    width = None if sys.stdout.isatty() else 200
    Console(file=sys.stdout, highlight=False, width=width).print(table)


# ---- split-generate without named nodes ---------------------------------------------------
