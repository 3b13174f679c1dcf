"""`exo-split report`: print a saved timing report (or comparison) again, or write it as HTML."""

from __future__ import annotations

import json
from pathlib import Path

from exo_split.cli.common import write_html
from exo_split.errors import ExoSplitError
from exo_split.report import Comparison, HandoffReport, load, to_json
from exo_split.report.text import render_comparison, render_terminal


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
