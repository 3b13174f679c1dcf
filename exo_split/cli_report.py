"""CLI commands around the timing report: `report` (re-render a saved one), `bench` (the overlap
benchmark), and the `--compare` / `--report-html` parts of `split-generate`. Parsing and
printing only; the figures are report.py's, the page report_html.py's, the benchmark bench.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

from exo_split.errors import ExoSplitError
from exo_split.report import (
    Comparison,
    HandoffReport,
    build_report,
    compare,
    load,
    load_report,
    to_json,
)
from exo_split.report_text import render_comparison, render_terminal

# The runs of `split-generate --compare`, in the order they run: body overrides of each.
COMPARE_RUNS = (
    ("overlap", {"prefill": "remote", "overlap": True}),
    ("sequential", {"prefill": "remote", "overlap": False}),
    ("local", {"prefill": "local"}),
)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_html(path: Path, obj: HandoffReport | Comparison) -> None:
    from exo_split.report_html import render_html

    try:
        path.write_text(render_html(obj))
    except OSError as exc:
        raise ExoSplitError(f"cannot write {path}: {exc.strerror}") from exc
    _say(f"wrote {path}")


def add_report(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="re-render a saved timing report (or comparison)",
        description="Read a report saved from `split-generate --json` (the captured stdout, its "
        "last line, or the bare report) and print it again, or write it as an HTML page.",
    )
    p.add_argument("file", type=Path, metavar="FILE.json", help="the saved report")
    p.add_argument("--html", type=Path, metavar="OUT", help="also write one self-contained page")
    p.add_argument("--json", action="store_true", help="print the report's JSON document instead")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    try:
        obj = load(args.file)
    except OSError as exc:
        raise ExoSplitError(f"cannot read {args.file}: {exc.strerror}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ExoSplitError(f"{args.file} is not a saved exo-split report: {exc}") from exc
    if args.json:
        print(json.dumps(to_json(obj)), flush=True)
    else:
        print(_render(obj), flush=True)
    if args.html:
        write_html(args.html, obj)
    return 0


def _render(obj: HandoffReport | Comparison) -> str:
    if isinstance(obj, HandoffReport):
        return render_terminal(obj)
    sections = [render_terminal(r) for r in obj.reports.values() if r.pieces]
    return "\n\n".join([*sections, render_comparison(obj)])


def split_compare(args, url: str, token: str | None, body: dict) -> int:
    """`split-generate --compare`: the same request overlapped, sequential and local, one
    after another on the same two nodes; prints the comparison (and writes --report-html)."""
    from exo_split.cli_split import run_request

    if args.prefill == "local":
        raise ExoSplitError(
            "--compare needs a prefill peer", hint="drop --prefill local (and give --prefill-peer)"
        )
    reports, dones = {}, {}
    for i, (name, overrides) in enumerate(COMPARE_RUNS):
        stream = i == 0 and not args.json
        if i:
            _say(f"[{name} run ...]")
        done, ttft = asyncio.run(run_request(url, token, {**body, **overrides}, stream=stream))
        if stream:
            print(flush=True)
        report = load_report(done["report"])
        reports[name] = build_report(dataclasses.replace(report.timeline, client_ttft_s=ttft))
        dones[name] = done
    comparison = compare(reports)
    first = dones[COMPARE_RUNS[0][0]]
    same = all(d["tokens"] == first["tokens"] for d in dones.values())
    if not same and args.temperature == 0:
        _say("note: the three runs generated different tokens (see the JSON for each)")
    if args.json:
        out = {k: first[k] for k in ("tokens", "text", "prompt_tokens")}
        out["same_tokens"] = same
        out["report"] = to_json(comparison)
        print(json.dumps(out), flush=True)
    else:
        _say(render_terminal(reports["overlap"]))
        _say(render_comparison(comparison))
    if args.report_html:
        write_html(args.report_html, comparison)
    return 0


def add_bench(subparsers) -> None:
    from exo_split import bench

    p = subparsers.add_parser(
        "bench",
        help="benchmark the overlapped handoff between two network namespaces (root, Linux)",
        description=bench.__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from exo_split import bench

    return bench.main(args)
