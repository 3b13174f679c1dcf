"""CLI commands of the networked split: `node` and `split-generate` (`nodes` is in cli_nodes.py).
Parsing and printing only."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from exo_split.auth import copy_instructions, resolve_token
from exo_split.cli_nodes import (  # add_nodes: the `nodes` command, registered in cli.py
    add_discovery_options,
    add_nodes,
    find_roles,
    interfaces,
    static_peers,
)
from exo_split.errors import ExoSplitError

DEFAULT_PORT = 52417


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_token_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token-file",
        type=Path,
        help="file holding the shared token (default: $EXO_SPLIT_TOKEN, else "
        "~/.config/exo-split/token)",
    )


def add_node(subparsers) -> None:
    p = subparsers.add_parser(
        "node",
        help="run a node agent (prefill and/or decode) for one model",
        description="Load a model into one backend and serve it to peers over HTTP.",
    )
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--backend", required=True, choices=("torch", "mlx"))
    p.add_argument("--device", help="torch: cpu or cuda[:N] (default: cuda if present); mlx: cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to listen on (default 0.0.0.0: all, so peers can reach it; every "
        "request needs the token)",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: any free port)")
    add_discovery_options(p, timeout=False)
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="do not measure prefill/decode speed at start-up (advertise none unless cached)",
    )
    p.add_argument("--remeasure", action="store_true", help="measure speeds even if cached")
    add_token_option(p)
    add_limit_options(p)
    p.add_argument("--ready-file", type=Path, help="write the node's info as JSON here when ready")
    p.set_defaults(func=cmd_node)


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """Limits and timeouts of a node (docs/reliability.md has what each one bounds)."""
    g = p.add_argument_group("limits and timeouts (docs/reliability.md)")
    g.add_argument("--max-prompt-tokens", type=int, default=32_768)
    g.add_argument("--max-concurrent", type=int, default=8, help="requests of each kind at once")
    g.add_argument(
        "--max-kv-bytes",
        type=_size,
        default="8G",
        metavar="SIZE",
        help="KV held for requests in progress, e.g. 512M, 8G (default 8G)",
    )
    for flag, default, what in (
        ("--connect-timeout", 5.0, "connecting to a peer"),
        ("--first-frame-timeout", 30.0, "a prefill peer's first frame"),
        ("--idle-timeout", 60.0, "the longest silence within a stream"),
        ("--prefill-timeout", 600.0, "a whole remote prefill"),
    ):
        g.add_argument(flag, type=_seconds, default=default, metavar="S", help=f"{what} (s)")
    g.add_argument(
        "--busy-wait",
        type=lambda text: _seconds(text, zero=True),
        default=0.0,
        metavar="S",
        help="how long to keep asking a busy (503) prefill peer before prefilling locally",
    )


def _size(text: str) -> int:
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number, unit = text.upper().rstrip("IB"), ""
    if number and number[-1] in units:
        number, unit = number[:-1], number[-1]
    try:
        value = int(float(number) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 8G, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return value


def _seconds(text: str, *, zero: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf") or (value == 0 and not zero):
        floor = ">= 0" if zero else "> 0"
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds {floor}, got {text!r}"
        )
    return value


def cmd_node(args) -> int:
    from exo_split.capabilities import default_cache_dir
    from exo_split.limits import Limits
    from exo_split.node import Node, NodeConfig
    from exo_split.transport.client import Timeouts

    token, source = resolve_token(args.token_file, dict(os.environ), create=True)
    if source.endswith("(new)"):
        _say(copy_instructions(Path(source.removesuffix(" (new)"))))
    # Test hook (docs/reliability.md): SIGKILL the node once it has sent layer k.
    die_after = os.environ.get("EXO_SPLIT_TEST_DIE_AFTER_LAYER")
    config = NodeConfig(
        model_dir=Path(args.model),
        backend=args.backend,
        token=token,
        device=args.device,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        peers=tuple(str(a) for a in static_peers(args)),
        mdns=not args.no_mdns,
        interfaces=tuple(interfaces(args) or ()),
        cache_dir=default_cache_dir(os.environ),
        warmup=not args.no_warmup,
        remeasure=args.remeasure,
        limits=Limits(
            max_prompt_tokens=args.max_prompt_tokens,
            max_concurrent=args.max_concurrent,
            max_kv_bytes=args.max_kv_bytes,
        ),
        timeouts=Timeouts(
            connect=args.connect_timeout,
            first_frame=args.first_frame_timeout,
            idle=args.idle_timeout,
            total=args.prefill_timeout,
            busy_wait=args.busy_wait,
        ),
        ready_file=args.ready_file,
        die_after_layer=int(die_after) if die_after else None,
    )
    node = Node(config, progress=_say)
    asyncio.run(node.serve())
    return 0


def add_split_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "split-generate",
        help="generate with prefill on one node and decode on another",
        description="Send a request to the decode node, which pulls the prompt's KV from the "
        "prefill node layer by layer, then decodes. Streams the text, then the timing report.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--decode-peer", metavar="HOST:PORT", help="the decode node (default: find the nodes)"
    )
    p.add_argument("--prefill-peer", metavar="HOST:PORT", help="the prefill node")
    p.add_argument(
        "--prefill",
        choices=("auto", "remote", "local"),
        default="auto",
        help="auto (default): remote only when its estimated TTFT beats a local prefill",
    )
    add_discovery_options(p)
    p.add_argument(
        "--fingerprint", metavar="PREFIX", help="with several models around: the one to use"
    )
    p.add_argument("--prefill-chunk", type=int, help="prefill this many tokens at a time")
    p.add_argument("--no-overlap", action="store_true", help="send KV only after the whole prefill")
    p.add_argument("--fallback", choices=("local", "none"), default="local")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the request sequentially (no overlap) and locally; show all three",
    )
    p.add_argument("--report-html", type=Path, metavar="FILE", help="write the report as HTML")
    add_token_option(p)
    p.set_defaults(func=cmd_split_generate)


def cmd_split_generate(args) -> int:
    from exo_split.node import peer_url
    from exo_split.report import build_report, load_report, to_json
    from exo_split.report_text import render_terminal

    token, _ = resolve_token(args.token_file, dict(os.environ), create=False)
    decode, roles = args.decode_peer, None
    if decode is None:  # find the nodes: mDNS and --peer / $EXO_SPLIT_PEERS
        roles = find_roles(args, token)
        decode = roles.decode_url
    prompt = args.prompt if args.prompt is not None else _read(args.prompt_file)
    body = {
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "sampling": {"temperature": args.temperature, "seed": args.seed},
        "prefill_peer": args.prefill_peer or (roles.prefill_url if roles else None),
        "prefill": args.prefill,
        "overlap": not args.no_overlap,
        "chunk": args.prefill_chunk,
        "fallback": args.fallback,
    }
    if args.compare:
        from exo_split.cli_report import split_compare

        return split_compare(args, peer_url(decode), token, body)
    done, ttft = asyncio.run(run_request(peer_url(decode), token, body, stream=not args.json))
    report = load_report(done["report"])
    timeline = dataclasses.replace(report.timeline, client_ttft_s=ttft)
    report = build_report(timeline)
    if args.json:
        out = {k: done[k] for k in ("tokens", "text", "prompt_tokens")}
        if roles is not None:
            out["nodes"] = roles.summary
        out["report"] = to_json(report)
        print(json.dumps(out), flush=True)
    else:
        print(flush=True)
        _say(render_terminal(report))
    if args.report_html:
        from exo_split.cli_report import write_html

        write_html(args.report_html, report)
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ExoSplitError(f"cannot read {path}: {exc.strerror}") from exc


async def run_request(
    url: str, token: str, body: dict, *, stream: bool
) -> tuple[dict, float | None]:
    """Send one generate request to the decode node; stream its text; return (done, client TTFT)."""
    import aiohttp

    from exo_split.transport.client import Timeouts, generate_events

    t0 = time.perf_counter()
    ttft = None
    show_progress = sys.stderr.isatty()
    async with aiohttp.ClientSession() as session:
        async for event in generate_events(session, url, token, body, timeouts=Timeouts()):
            kind = event.get("type")
            if kind == "token":
                if ttft is None:
                    ttft = time.perf_counter() - t0
                    if show_progress:
                        print("\r\033[K", end="", file=sys.stderr, flush=True)
                if stream:
                    print(event.get("text", ""), end="", flush=True)
            elif kind == "progress" and show_progress:
                _progress_line(event)
            elif kind == "fallback":
                _say(f"\n[prefill peer failed, prefilling locally: {event.get('reason')}]")
            elif kind == "error":
                raise ExoSplitError(f"the decode node failed the request: {event.get('message')}")
            elif kind == "done":
                return event, ttft
    raise ExoSplitError(f"{url} closed the stream before the request was done")


def _progress_line(event: dict) -> None:
    """A transient line on the terminal while the KV arrives: layers and prompt tokens."""
    layer, layers = event.get("layer", 0) + 1, event.get("layers", 0)
    tokens, of = event.get("tokens", 0), event.get("of", 0)
    print(
        f"\r\033[K[KV arriving] layer {layer}/{layers}, prompt tokens {tokens}/{of}",
        end="",
        file=sys.stderr,
        flush=True,
    )


__all__ = ["add_node", "add_nodes", "add_split_generate", "run_request"]
