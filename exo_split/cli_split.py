"""CLI commands of the networked split: `node` and `split-generate`. Parsing and printing only."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from exo_split.auth import resolve_token
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
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: any free port)")
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a peer node (repeatable; also $EXO_SPLIT_PEERS)",
    )
    add_token_option(p)
    p.add_argument("--max-prompt-tokens", type=int, default=32_768)
    p.add_argument("--max-concurrent", type=int, default=8, help="requests of each kind at once")
    p.add_argument("--ready-file", type=Path, help="write the node's info as JSON here when ready")
    p.set_defaults(func=cmd_node)


def _env_peers() -> list[str]:
    raw = os.environ.get("EXO_SPLIT_PEERS", "")
    return [p for p in raw.replace(",", " ").split() if p]


def cmd_node(args) -> int:
    from exo_split.node import Node, NodeConfig
    from exo_split.transport.server import Limits

    token, source = resolve_token(args.token_file, dict(os.environ), create=True)
    if source.endswith("(new)"):
        _say(
            f"generated a new token in {source.removesuffix(' (new)')}; copy that file to the "
            "same place on the other machine (or set EXO_SPLIT_TOKEN there)"
        )
    config = NodeConfig(
        model_dir=Path(args.model),
        backend=args.backend,
        token=token,
        device=args.device,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        peers=tuple(args.peer) + tuple(_env_peers()),
        limits=Limits(max_prompt_tokens=args.max_prompt_tokens, max_concurrent=args.max_concurrent),
        ready_file=args.ready_file,
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
    p.add_argument("--decode-peer", metavar="HOST:PORT", help="the decode node")
    p.add_argument("--prefill-peer", metavar="HOST:PORT", help="the prefill node")
    p.add_argument("--prefill", choices=("auto", "remote", "local"), default="auto")
    p.add_argument("--prefill-chunk", type=int, help="prefill this many tokens at a time")
    p.add_argument("--no-overlap", action="store_true", help="send KV only after the whole prefill")
    p.add_argument("--fallback", choices=("local", "none"), default="local")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    add_token_option(p)
    p.set_defaults(func=cmd_split_generate)


def cmd_split_generate(args) -> int:
    from exo_split.node import peer_url
    from exo_split.report import build_report, load_report, render_terminal, to_json

    token, _ = resolve_token(args.token_file, dict(os.environ), create=False)
    decode = args.decode_peer or next(iter(_env_peers()), None)
    if decode is None:
        raise ExoSplitError(
            "no decode node given", hint="pass --decode-peer HOST:PORT or set EXO_SPLIT_PEERS"
        )
    prompt = args.prompt if args.prompt is not None else _read(args.prompt_file)
    body = {
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "sampling": {"temperature": args.temperature, "seed": args.seed},
        "prefill_peer": args.prefill_peer,
        "prefill": args.prefill,
        "overlap": not args.no_overlap,
        "chunk": args.prefill_chunk,
        "fallback": args.fallback,
    }
    done, ttft = asyncio.run(run_request(peer_url(decode), token, body, stream=not args.json))
    report = load_report(done["report"])
    timeline = dataclasses.replace(report.timeline, client_ttft_s=ttft)
    report = build_report(timeline)
    if args.json:
        out = {k: done[k] for k in ("tokens", "text", "prompt_tokens")}
        out["report"] = to_json(report)
        print(json.dumps(out), flush=True)
    else:
        print(flush=True)
        _say(render_terminal(report))
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
