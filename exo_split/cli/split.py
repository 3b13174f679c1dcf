"""`exo-split split-generate`: one request through a decode node, with the KV from a prefill
node; `--compare` runs it overlapped, sequential and local, one after another."""

from __future__ import annotations

import json
import os
from pathlib import Path

from exo_split.cli.common import (
    UsageError,
    add_prompt_options,
    add_token_option,
    read_prompt,
    read_text,
    run_request,
    say,
    with_client_ttft,
    write_html,
)
from exo_split.cli.discover import Roles, add_discovery_options, find_roles
from exo_split.errors import ExoSplitError
from exo_split.report import compare, to_json
from exo_split.report.text import render_comparison, render_terminal

# The runs of `split-generate --compare`, in the order they run: body overrides of each.
# No prefix reuse: each run prefills the whole prompt, or the later ones would find it cached.
COMPARE_RUNS = (
    ("overlap", {"prefill": "remote", "overlap": True, "prefix_cache": False}),
    ("sequential", {"prefill": "remote", "overlap": False, "prefix_cache": False}),
    ("local", {"prefill": "local", "prefix_cache": False}),
)


def add_split_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "split-generate",
        help="generate with prefill on one node and decode on another",
        description="Send a request to the decode node, which pulls the prompt's KV from the "
        "prefill node layer by layer, then decodes. Streams the text, then the timing report.",
    )
    prompt = add_prompt_options(p)
    prompt.add_argument(
        "--messages",
        metavar="FILE",
        help="chat messages as JSON ([{role, content}, ...] or {messages: [...]}; '-': stdin); "
        "implies --chat",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="apply the model's chat template (on the decode node): the prompt is the user's "
        "message; generation stops at the end of the assistant's turn",
    )
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message first")
    add_request_options(p)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the request sequentially (no overlap) and locally; show all three",
    )
    p.add_argument("--report-html", type=Path, metavar="FILE", help="write the report as HTML")
    p.set_defaults(func=cmd_split_generate)


def cmd_split_generate(args) -> int:
    prompt = prompt_body(args)  # bad --chat/--system/--messages: an error before any network
    decode, token, roles = find_decode(args)
    body = {**prompt, **request_options(args, roles)}
    if args.compare:
        return split_compare(args, decode, token, body)
    done, ttft = run_request(decode, token, body, stream=not args.json)
    report = with_client_ttft(done["report"], ttft)
    if args.json:
        doc = {k: done[k] for k in ("tokens", "text", "prompt_tokens", "finish_reason")}
        if roles is not None:
            doc["nodes"] = roles.summary
        doc["report"] = to_json(report)
        print(json.dumps(doc), flush=True)
    else:
        print(flush=True)
        say(render_terminal(report))
    if args.report_html:
        write_html(args.report_html, report)
    return 0


def prompt_body(args) -> dict:
    """The request's prompt: {"prompt": text} or, for a chat, {"messages": [...]}."""
    from exo_split.transport.messages import check_messages

    if args.system is not None and (not args.chat or args.messages is not None):
        raise UsageError(
            "--system goes with --chat and --prompt/--prompt-file",
            hint="with --messages, put the system message in the file",
        )
    if args.messages is not None:
        return {"messages": read_messages(read_text(args.messages, "the messages file"),
                                          args.messages)}  # fmt: skip
    if not args.chat:
        return {"prompt": read_prompt(args)}
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return {"messages": check_messages([*system, {"role": "user", "content": read_prompt(args)}])}


def split_compare(args, url: str, token: str | None, body: dict) -> int:
    """`split-generate --compare`: the same request overlapped, sequential and local, one
    after another on the same two nodes; prints the comparison (and writes --report-html)."""
    if args.prefill == "local":
        raise ExoSplitError(
            "--compare needs a prefill peer", hint="drop --prefill local (and give --prefill-peer)"
        )
    reports, dones = {}, {}
    for i, (name, overrides) in enumerate(COMPARE_RUNS):
        stream = i == 0 and not args.json
        if i:
            say(f"[{name} run ...]")
        done, ttft = run_request(url, token, {**body, **overrides}, stream=stream)
        if stream:
            print(flush=True)
        reports[name] = with_client_ttft(done["report"], ttft)
        dones[name] = done
    comparison = compare(reports)
    first = dones[COMPARE_RUNS[0][0]]
    same = all(d["tokens"] == first["tokens"] for d in dones.values())
    if not same and args.temperature == 0:
        say("note: the three runs generated different tokens (see the JSON for each)")
    if args.json:
        doc = {k: first[k] for k in ("tokens", "text", "prompt_tokens")}
        doc["same_tokens"] = same
        doc["report"] = to_json(comparison)
        print(json.dumps(doc), flush=True)
    else:
        say(render_terminal(reports["overlap"]))
        say(render_comparison(comparison))
    if args.report_html:
        write_html(args.report_html, comparison)
    return 0


def read_messages(text: str, source: str) -> list[dict[str, str]]:
    """Messages from a JSON document: a list of messages, or an object with "messages"."""
    from exo_split.errors import BadMessages
    from exo_split.transport.messages import check_messages

    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise BadMessages(f"{source} is not JSON: {exc}") from exc
    if isinstance(doc, dict) and "messages" in doc:
        doc = doc["messages"]
    return check_messages(doc)


# ---- what split-generate and chat share: the request's options and the nodes --------------


def add_request_options(p, *, max_tokens: int = 64) -> None:
    """The options of a request through a decode node (split-generate, chat): generation,
    sampling, the nodes and how the prefill runs, the token."""
    p.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"at most (default {max_tokens})"
    )
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
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="neither node reuses a cached prefix of the prompt or keeps this request's KV "
        "(to measure without reuse)",
    )
    add_token_option(p)


def find_decode(args) -> tuple[str, str | None, Roles | None]:
    """(the decode node's URL, the shared token, the nodes found or None): --decode-peer, or
    the nodes found by mDNS and --peer / $EXO_SPLIT_PEERS."""
    from exo_split.discovery.peers import peer_url
    from exo_split.transport.auth import resolve_token

    token, _ = resolve_token(args.token_file, dict(os.environ), create=False)
    if args.decode_peer is not None:
        return peer_url(args.decode_peer), token, None
    roles = find_roles(args, token)
    return peer_url(roles.decode_url), token, roles


def request_options(args, roles: Roles | None) -> dict:
    """The body of a generate request, less its prompt."""
    body = {
        "max_tokens": args.max_tokens,
        "sampling": {"temperature": args.temperature, "seed": args.seed},
        "prefill_peer": args.prefill_peer or (roles.prefill_url if roles else None),
        "prefill": args.prefill,
        "overlap": not args.no_overlap,
        "chunk": args.prefill_chunk,
        "fallback": args.fallback,
    }
    if args.no_prefix_cache:  # absent otherwise: the node's default (reuse)
        body["prefix_cache"] = False
    return body
