"""`exo-split keys add NAME | list | remove NAME`: the decode node's client API keys
(transport/keys.py). A key is printed once, when it is made; the file keeps its SHA-256."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from exo_split.cli.common import say


def add_keys(subparsers) -> None:
    p = subparsers.add_parser(
        "keys",
        help="client API keys for the decode node's APIs, each with its own prefix cache",
        description="A client key opens the OpenAI and Anthropic APIs and /v1/generate (not the "
        "node-to-node endpoints), and the prefix caches of both nodes keep each key's "
        "conversations apart. Running nodes re-read the file when it changes.",
    )
    p.add_argument("action", choices=("add", "list", "remove"))
    p.add_argument("name", nargs="?", help="the key's name (add, remove)")
    p.add_argument("--keys-file", type=Path, metavar="FILE",
                   help="default ~/.config/exo-split/keys.json")  # fmt: skip
    p.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    from exo_split.cli.common import UsageError
    from exo_split.transport.keys import add_key, default_keys_file, list_keys, remove_key

    path = args.keys_file or default_keys_file()
    if args.action in ("add", "remove") and not args.name:
        raise UsageError(f"keys {args.action} needs a NAME")
    if args.action == "add":
        key = add_key(path, args.name)
        say(f"key {args.name!r} added to {path}; it is shown only now:")
        print(key)
    elif args.action == "remove":
        remove_key(path, args.name)
        say(f"key {args.name!r} removed from {path}; nodes refuse it from their next request")
    else:
        keys = list_keys(path)
        for name, entry in sorted(keys.items()):
            made = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.get("created", 0)))
            print(f"{name}\tcreated {made}")
        if not keys:
            say(f"no keys in {path}")
    return 0
