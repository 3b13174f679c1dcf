"""`exo-split demo`: the whole product on one machine, no GPU, no second machine, no download."""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

from exo_split.cli.common import run_request, say, with_client_ttft
from exo_split.errors import ExoSplitError

RANDOM_WEIGHTS_NOTE = "random weights: the text is noise, the timings are real"


def add_demo(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run a prefill node and a decode node locally and split one request between them",
        description="Builds the embedded default model on first use (no download), starts a "
        "torch prefill agent and an MLX decode agent on 127.0.0.1, streams one split "
        "generation, prints the handoff report and writes it as HTML, then stops both agents.",
    )
    p.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length (default 1000)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--model", type=Path, help="use this checkpoint instead of the embedded one")
    p.add_argument("--discover", action="store_true", help="find the nodes over mDNS")
    p.add_argument(
        "--report-html",
        type=Path,
        default=Path("exo-split-demo.html"),
        help="where to write the HTML report (default ./exo-split-demo.html)",
    )
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.set_defaults(func=cmd_demo)


def _raise_on_sigterm() -> None:
    """SIGTERM ends the demo like Ctrl-C: through `finally`, so the agents are stopped."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def cmd_demo(args: argparse.Namespace) -> int:
    from exo_split.models.tiny import ensure_default_model
    from exo_split.node.local import LocalPair, default_prompt
    from exo_split.report import to_json
    from exo_split.report.html import render_html
    from exo_split.report.text import render_terminal
    from exo_split.spec import load_spec

    if args.prompt_tokens < 1 or args.max_tokens < 1:
        raise ExoSplitError("--prompt-tokens and --max-tokens must be at least 1")
    _raise_on_sigterm()
    embedded = args.model is None
    model_dir = ensure_default_model(progress=say) if embedded else args.model
    spec = load_spec(model_dir)
    say(f"model: {spec.name} ({spec.n_layers} layers, fingerprint {spec.fingerprint})")
    prompt = default_prompt(args.prompt_tokens - 1, spec.vocab_size)  # BOS makes one more
    with LocalPair(model_dir, progress=say, discover=args.discover) as pair:
        body = {
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "prefill_peer": None if args.discover else pair.addr("prefill"),
            "prefill": "remote",
        }
        say(f"splitting one request: ~{args.prompt_tokens} prompt tokens, {args.max_tokens} new")
        if embedded and not args.json:
            say(f"--- generated text ({RANDOM_WEIGHTS_NOTE}) ---")
        url = f"http://{pair.addr('decode')}"
        done, ttft = run_request(url, pair.token, body, stream=not args.json)
    report = with_client_ttft(done["report"], ttft)
    args.report_html.write_text(render_html(report))
    if args.json:
        out = {k: done[k] for k in ("tokens", "text", "prompt_tokens")}
        out |= {"random_weights": embedded, "report": to_json(report)}
        out["report_html"] = str(args.report_html)
        print(json.dumps(out), flush=True)
    else:
        print(flush=True)
        say(render_terminal(report))
        say(f"HTML report: {args.report_html}")
    return 0
