"""A discovery node for tests, run inside a test-made network namespace:

    ip netns exec NS python tests/mdns_agent.py node --iface 10.213.7.1 --port 8101 ...
    ip netns exec NS python tests/mdns_agent.py browse --iface 10.213.7.2
    ip netns exec NS python tests/mdns_agent.py browse-once --iface 10.213.7.2 --timeout 1.5

Prints one JSON object per line on stdout ({"event": ..., "t": time.monotonic(), ...}).
`node` and `browse` read commands on stdin: `update PTPS DTPS` ("-" = unknown), `stop`
(end of input also stops). On stop it reports leftover threads and event-loop callbacks
slower than 0.1 s (asyncio debug mode), which the tests require to be none.

Refuses to run unless MDNS_AGENT_HOST_NETNS holds the inode of the caller's network
namespace and ours differs from it: mDNS must never leave a test namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import threading
import time

from exo_split.discovery import Advertiser, Browser, NodeInfo, PeerInfo, browse, open_zeroconf


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


class SlowCallbacks(logging.Handler):
    """Counts asyncio debug-mode reports of callbacks that blocked the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing") and " took " in message:
            self.messages.append(message)


def peers_event(browser: Browser, peers: list[PeerInfo]) -> None:
    emit(
        "peers",
        peers=[dataclasses.asdict(p) for p in peers],
        txt={p.node_id: browser.txt(p.node_id) for p in peers},
    )


async def commands(advertiser: Advertiser | None) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    try:
        while line := (await reader.readline()).decode().strip():
            cmd, *args = line.split()
            if cmd == "stop":
                return
            if cmd == "update" and advertiser is not None:
                ptps, dtps = (None if a == "-" else float(a) for a in args)
                await advertiser.update(prefill_tps=ptps, decode_tps=dtps)
                emit("updated", prefill_tps=ptps, decode_tps=dtps)
    finally:
        transport.close()


async def run(args: argparse.Namespace) -> None:
    # A blocking call shows: zeroconf's synchronous register and unregister wait between
    # their three rounds of packets (225 / 125 ms apart: 0.45 s / 0.25 s or more); a loaded
    # 2-core CI box's scheduling should not (one step of the stop path took 0.128 s there).
    asyncio.get_running_loop().slow_callback_duration = 0.2
    emit("started")
    if args.mode == "browse-once":
        peers = await browse(args.timeout, interfaces=args.iface)
        emit("browsed", peers=[dataclasses.asdict(p) for p in peers])
        return
    # A node that browses shares one zeroconf instance between browsing and advertising,
    # and starts browsing first so it hears the peer's announcements as they happen.
    shared = open_zeroconf(args.iface) if args.mode == "node" and args.browse else None
    advertiser = browser = None
    try:
        if args.mode == "browse" or args.browse:
            browser = Browser(
                interfaces=args.iface,
                zc=shared,
                ignore_node_id=args.node_id or None,
                recheck_interval=args.recheck,
                on_change=lambda peers: peers_event(browser, peers),
            )
            await browser.start()
            emit("browsing")
            if args.wait_for:
                peers = await browser.wait_for(
                    lambda ps: any(p.node_id == args.wait_for for p in ps), timeout=10
                )
                emit("waited", peers=[dataclasses.asdict(p) for p in peers])
        if args.mode == "node":
            node = NodeInfo(
                node_id=args.node_id,
                name=args.name,
                backend=args.backend,
                device=args.device,
                model="tiny-llama",
                fingerprint=args.fp,
                prefill_tps=args.ptps,
                decode_tps=args.dtps,
            )
            token = os.environ.get("EXO_SPLIT_TOKEN", "")
            advertiser = Advertiser(
                node,
                args.port,
                interfaces=args.iface,
                zc=shared,
                never_publish=[token],
                ttl=args.ttl,
            )
            await advertiser.start()
            emit("advertised", name=advertiser.service_name, addresses=advertiser.addresses)
        await commands(advertiser)
    finally:
        if browser is not None:
            await browser.stop()
        if advertiser is not None:
            await advertiser.stop()
        if shared is not None:
            await shared.async_close()


def main() -> None:
    # The test passes its own namespace's inode; we must be somewhere else.
    host_ns = os.environ.get("MDNS_AGENT_HOST_NETNS", "")
    if not host_ns or os.stat("/proc/self/ns/net").st_ino == int(host_ns):
        sys.exit("mdns_agent: refusing to send mDNS from the host's network namespace")
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["node", "browse", "browse-once"])
    parser.add_argument("--iface", action="append", help="default: all interfaces")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--node-id", default="")
    parser.add_argument("--name", default="test-node")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fp", default="fp-test")
    parser.add_argument("--ptps", type=float)
    parser.add_argument("--dtps", type=float)
    parser.add_argument("--browse", action="store_true", help="node: also browse")
    parser.add_argument("--ttl", type=int, default=120, help="node: record TTL, s")
    parser.add_argument("--recheck", type=float, default=10.0, help="Browser recheck, s")
    parser.add_argument("--wait-for", default="", help="browse: node id to Browser.wait_for")
    parser.add_argument("--timeout", type=float, default=1.5, help="browse-once")
    args = parser.parse_args()

    slow = SlowCallbacks()
    logging.getLogger("asyncio").addHandler(slow)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(run(args), debug=True)
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    emit("stopped", threads=threads, slow_callbacks=slow.messages)


if __name__ == "__main__":
    main()
