"""The `exo-split` command line: argument parsing and printing only.

Each command is a pair: `_add_<cmd>(subparsers)` declares its arguments and
`_cmd_<cmd>(args) -> int` runs it by calling into the modules and printing what they
return. `main` turns an ExoSplitError (and a usage error) into one line on stderr, exit 2;
Ctrl-C into one line, exit 130. Tracebacks only with --debug. Only this module reads argv,
stdin and the environment. Machine-readable output (--json) is the last line of stdout;
progress and summaries go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from exo_split import __version__, cli_demo, cli_report, cli_split
from exo_split.backends import BACKENDS, Backend, load_backend
from exo_split.errors import ExoSplitError, IncompatiblePeer
from exo_split.fidelity import CheckReport, run_check
from exo_split.handoff import SplitResult, check_request, split_generate
from exo_split.kv import DTYPES
from exo_split.sampling import Sampling
from exo_split.spec import ModelSpec, load_spec
from exo_split.tokenizer import TextCodec, TextStream

PROG = "exo-split"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(ExoSplitError):
    """Bad command-line arguments."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line like every other error, not usage + error
        raise UsageError(message, hint=f"see '{self.prog} --help'")


# --- shared helpers ------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _say(message: str) -> None:
    """Progress for humans: stderr, so stdout stays the output."""
    print(message, file=sys.stderr, flush=True)


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _error_lines(exc: ExoSplitError, prefix: str = f"{PROG}: error") -> str:
    message = " ".join(str(exc).split("\n"))
    lines = f"{prefix}: {message}"
    if exc.hint:
        lines += f"\n  hint: {exc.hint}"
    return lines


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, metavar="DIR", help="Hugging Face checkpoint directory"
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)"
    )


def _load(name: str, model_dir: str, dtype: str, device: str | None) -> Backend:
    _say(f"loading {name} backend ({dtype}) from {model_dir} ...")
    t0 = time.perf_counter()
    # --device names a torch device (cpu, cuda, cuda:1); "cpu" also puts mlx on the CPU.
    dev = device if name == "torch" or device == "cpu" else None
    backend = load_backend(name, model_dir, dtype=dtype, device=dev)
    _say(f"{name} backend ready on {backend.device} in {time.perf_counter() - t0:.2f} s")
    return backend


# --- generate --------------------------------------------------------------------------


def _add_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="prefill on one backend, decode on another, in this process",
        description="Generate text with the prefill on one backend and the decode on another "
        "(the same backend for both is the local baseline). The KV cache is handed over in "
        "process, layer by layer.",
    )
    _add_model_options(p)
    p.add_argument("--prefill-backend", choices=BACKENDS, default="torch")
    p.add_argument("--decode-backend", choices=BACKENDS, default="mlx")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT")
    prompt.add_argument(
        "--prompt-file", metavar="FILE", help="read the prompt from FILE ('-': stdin)"
    )
    p.add_argument("--max-tokens", type=_positive_int, default=64, metavar="N", help="default 64")
    p.add_argument(
        "--device", help="torch device (cpu, cuda, cuda:1); 'cpu' also puts mlx on the CPU"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature)")
    p.add_argument(
        "--prefill-chunk", type=_positive_int, metavar="C", help="prefill C tokens at a time"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (last line of stdout) instead of streaming text",
    )
    p.set_defaults(func=_cmd_generate)


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ExoSplitError(f"cannot read the prompt file {args.prompt_file}: {exc}") from exc


def _cmd_generate(args) -> int:
    try:
        sampling = Sampling.from_dict({"temperature": args.temperature, "seed": args.seed})
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    prompt = _read_prompt(args)
    # Fail fast, before loading anything heavy: checkpoint, tokenizer, context length.
    spec = load_spec(args.model)
    codec = TextCodec(args.model)
    ids = codec.tokenize(prompt)
    check_request(spec, len(ids), args.max_tokens)

    prefill = _load(args.prefill_backend, args.model, args.dtype, args.device)
    decode = prefill
    if args.decode_backend != args.prefill_backend:
        decode = _load(args.decode_backend, args.model, args.dtype, args.device)

    printed: list[str] = []
    on_token = None
    if not args.json:
        stream = TextStream(codec)

        def on_token(token: int) -> None:
            piece = stream.push(token)
            if piece:
                printed.append(piece)
                _out(piece)

    result = split_generate(
        prefill,
        decode,
        ids,
        max_tokens=args.max_tokens,
        sampling=sampling,
        chunk=args.prefill_chunk,
        stop_ids=codec.eos_ids,
        on_token=on_token,
    )
    text = codec.detokenize(result.tokens)
    if args.json:
        finished = "eos" if result.tokens[-1] in codec.eos_ids else "max_tokens"
        doc = _generate_doc(result, text, spec, prefill, decode, sampling, finished)
        print(json.dumps(doc))
    else:
        shown = "".join(printed)  # a held-back partial character, if any, comes out now
        _out((text[len(shown) :] if text.startswith(shown) else "") + "\n")
    _say(_generate_summary(result, prefill.name, decode.name))
    return EXIT_OK


def _generate_doc(
    result: SplitResult,
    text: str,
    spec: ModelSpec,
    prefill: Backend,
    decode: Backend,
    sampling: Sampling,
    finish_reason: str,
) -> dict[str, Any]:
    return {
        "tokens": result.tokens,
        "text": text,
        "prompt_tokens": result.prompt_tokens,
        "prefill_backend": prefill.name,
        "decode_backend": decode.name,
        "dtype": decode.dtype,
        "devices": {"prefill": prefill.device, "decode": decode.device},
        "model": spec.name,
        "fingerprint": spec.fingerprint,
        "sampling": sampling.to_dict(),
        "finish_reason": finish_reason,
        "timings": result.timings,
    }


def _generate_summary(result: SplitResult, prefill: str, decode: str) -> str:
    t = result.timings
    n_decode = len(result.tokens) - 1
    return (
        f"prompt {result.prompt_tokens} tokens | prefill ({prefill}) {t['prefill_s']:.3f} s, "
        f"{t['prefill_tokens_per_s']:.0f} tok/s | TTFT {t['ttft_s']:.3f} s | "
        f"decode ({decode}) {n_decode} tokens, {t['decode_tokens_per_s']:.1f} tok/s"
    )


# --- check -----------------------------------------------------------------------------


def _add_check(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="fidelity self-test: does every split pairing give the reference tokens?",
        description="Run built-in prompts through every installed pairing (torch->mlx, "
        "mlx->torch, torch->torch, mlx->mlx) and compare greedy tokens and logits with each "
        "backend alone and with transformers. Exit 0 when all agree, 1 otherwise.",
    )
    _add_model_options(p)
    p.add_argument(
        "--decode-model",
        metavar="DIR2",
        help="load the decode side from another directory (the two machines' copies)",
    )
    p.add_argument("--max-tokens", type=_positive_int, default=16, metavar="N", help="default 16")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=_cmd_check)


def _cmd_check(args) -> int:
    try:
        report = run_check(
            args.model,
            args.decode_model,
            dtype=args.dtype,
            max_tokens=args.max_tokens,
            progress=_say,
        )
    except IncompatiblePeer as exc:
        print(_error_lines(exc, prefix=f"{PROG}: check failed"), file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        _print_check(report)
    if report.passed:
        _say(f"all {len(report.pairings)} pairings agree ({report.bar})")
        return EXIT_OK
    failing = "; ".join(f"{p.name}: {p.reason}" for p in report.failing)
    _say(
        f"{PROG}: check failed: {len(report.failing)} of {len(report.pairings)} pairings disagree: {failing}"
    )
    return EXIT_FAILED


def _print_check(report: CheckReport) -> None:
    console = Console(file=sys.stdout, highlight=False)
    decode_dir = f"  (decode side: {report.decode_model_dir})" if report.decode_model_dir else ""
    console.print(f"model: {report.model_dir}{decode_dir}", markup=False)
    console.print(
        f"{report.dtype}, prompts of {', '.join(map(str, report.prompt_lengths))} tokens, "
        f"{report.max_tokens} new tokens each; reference: {report.reference or 'none'}",
        markup=False,
    )
    console.print(_check_table(report))
    lines = [
        "= alone: greedy tokens equal the decode backend run alone; = HF: equal transformers "
        "generate() (no @i: first differing position); top-1, max Δ: teacher-forced vs the "
        "reference's logits; prefill Δ: max |logit diff| of generated token 0",
        f"bar: {report.bar}",
        *(f"{p.name}: {p.reason}" for p in report.failing),
        *(f"skipped {s}" for s in report.skipped),
        *report.notes,
    ]
    for line in lines:
        console.print(line, markup=False)


def _check_table(report: CheckReport) -> Table:
    # Token agreement is the bar in float32 only: in half precision it is informational.
    style = "red" if report.dtype == "float32" else "yellow"

    def agree(p, against: str, agrees: bool | None) -> str:
        if agrees is None:
            return "n/a"
        return "yes" if agrees else f"[{style}]no @{p.first_mismatch(against)[1]}[/]"

    def num(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    table = Table(box=box.SIMPLE_HEAD)
    for col in ("pairing", "= alone", "= HF", "top-1", "max Δ", "prefill Δ", "result"):
        table.add_column(col, justify="left" if col in ("pairing", "result") else "right")
    for p in report.pairings:
        top1 = p.top1_agreement
        table.add_row(
            p.name,
            agree(p, "baseline", p.agrees_with_baseline),
            agree(p, "reference", p.agrees_with_reference),
            "n/a" if top1 is None else f"{top1:.1%}",
            num(p.max_logit_diff, ".2e"),
            num(p.first_logit_diff, ".2e"),
            "[green]pass[/]" if p.passed else "[red]FAIL[/]",
        )
    return table


# --- main ------------------------------------------------------------------------------

COMMANDS = (
    _add_generate,
    _add_check,
    cli_split.add_node,
    cli_split.add_split_generate,
    cli_split.add_nodes,
    cli_demo.add_demo,
    cli_report.add_report,
    cli_report.add_bench,
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
        print(_error_lines(exc), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `exo-split generate ... | head`: the reader left
        with contextlib.suppress(OSError, ValueError):  # keep the exit-time flush quiet
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
