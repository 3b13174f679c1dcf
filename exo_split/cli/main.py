"""The `exo-split` command line: the parser and `main`.

One module per command in this package (generate, check, node, split, chat, nodes, report,
bench, demo, convert), each a pair: `add_<cmd>(subparsers)` declares its arguments and
`cmd_<cmd>(args) -> int` runs it by calling into the package and printing what it returns.
`main` turns an ExoSplitError (and a usage error) into one line on stderr, exit 2; Ctrl-C into
one line, exit 130. Tracebacks only with --debug. Nothing outside cli/ imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence

from exo_split import __version__
from exo_split.cli import (
    bench,
    chat,
    check,
    convert,
    demo,
    generate,
    keys,
    node,
    nodes,
    report,
    split,
)
from exo_split.cli.common import PROG, UsageError, error_lines
from exo_split.errors import ExoSplitError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line like every other error, not usage + error
        raise UsageError(message, hint=f"see '{self.prog} --help'")


COMMANDS = (
    generate.add_generate,
    check.add_check,
    node.add_node,
    split.add_split_generate,
    chat.add_chat,
    nodes.add_nodes,
    demo.add_demo,
    report.add_report,
    bench.add_bench,
    convert.add_convert_gguf,
    keys.add_keys,
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Split one LLM request: PyTorch prefill, MLX decode, KV handed over per layer.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in COMMANDS:
        add(subparsers)
    for p in (parser, *subparsers.choices.values()):
        _add_global_options(p)
    return parser


def _add_global_options(p: argparse.ArgumentParser) -> None:
    """Accepted before and after the command. SUPPRESS: a subcommand's unset copy must not
    overwrite a value given before the command."""
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks"
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO"
    )


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (tests swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _setup_logging(verbose: bool) -> None:
    logger = logging.getLogger("exo_split")
    for h in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script. Returns the exit status."""
    parser = build_parser()
    debug = False
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version
            return int(exc.code or 0)
        debug = getattr(args, "debug", False)
        _setup_logging(getattr(args, "verbose", False))
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return args.func(args)
    except ExoSplitError as exc:
        if debug:
            traceback.print_exc()
        print(error_lines(exc), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `exo-split generate ... | head`: the reader left
        with contextlib.suppress(OSError, ValueError):  # keep the exit-time flush quiet
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
