"""`exo-split check`: the fidelity self-test of every backend pairing against transformers."""

from __future__ import annotations

import json
import sys

from rich import box
from rich.console import Console
from rich.table import Table

from exo_split.backends import BACKENDS
from exo_split.cli.common import PROG, add_model_options, error_lines, positive_int, say
from exo_split.errors import IncompatiblePeer
from exo_split.fidelity import CheckReport, run_check

EXIT_OK, EXIT_FAILED = 0, 1


def add_check(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="fidelity self-test: does every split pairing give the reference tokens?",
        description="Run built-in prompts through every installed pairing (torch->mlx, "
        "mlx->torch, torch->torch, mlx->mlx) and compare greedy tokens and logits with each "
        "backend alone and with transformers. Exit 0 when all agree, 1 otherwise.",
    )
    add_model_options(p)
    p.add_argument(
        "--decode-model",
        metavar="DIR2",
        help="load the decode side from another directory (the two machines' copies); an "
        "mlx_lm.convert 4/8-bit copy of --model is checked against mlx-lm running it alone",
    )
    p.add_argument(
        "--prefill-backend",
        choices=BACKENDS,
        help="check only this prefill side (e.g. vllm, which only prefills) against every "
        "installed decode backend",
    )
    p.add_argument("--max-tokens", type=positive_int, default=16, metavar="N", help="default 16")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    try:
        report = run_check(
            args.model,
            args.decode_model,
            dtype=args.dtype,
            max_tokens=args.max_tokens,
            progress=say,
            prefill_backend=args.prefill_backend,
        )
    except IncompatiblePeer as exc:
        print(error_lines(exc, prefix=f"{PROG}: check failed"), file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        _print_check(report)
    if report.passed:
        say(f"all {len(report.pairings)} pairings agree ({report.bar})")
        return EXIT_OK
    failing = "; ".join(f"{p.name}: {p.reason}" for p in report.failing)
    say(
        f"{PROG}: check failed: {len(report.failing)} of {len(report.pairings)} pairings disagree: {failing}"
    )
    return EXIT_FAILED


def _print_check(report: CheckReport) -> None:
    # Piped output is not cut at 80 columns: the table is read whole or not at all.
    console = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 160)
    decode_dir = f"  (decode side: {report.decode_model_dir})" if report.decode_model_dir else ""
    if report.decode_quantization:
        decode_dir += f", {report.decode_quantization['tag']}"
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
        "reference's logits; prefill Δ: max |logit diff| of generated token 0"
        + (
            "; q-alone: the same vs mlx-lm running the quantized checkpoint alone"
            if report.decode_quantization
            else ""
        ),
        f"bar: {report.bar}",
        *(f"{p.name}: {p.reason}" for p in report.failing),
        *(f"skipped {s}" for s in report.skipped),
        *report.notes,
    ]
    for line in lines:
        console.print(line, markup=False)


def _check_table(report: CheckReport) -> Table:
    # Token agreement is the bar in float32 only: in half precision, or with a quantized
    # decode side, it is informational.
    quantized = report.decode_quantization is not None
    style = "red" if report.dtype == "float32" and not quantized else "yellow"

    def agree(p, against: str, agrees: bool | None) -> str:
        if agrees is None:
            return "n/a"
        return "yes" if agrees else f"[{style}]no @{p.first_mismatch(against)[1]}[/]"

    def num(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    table = Table(box=box.SIMPLE_HEAD)
    columns = ["pairing", "= alone", "= HF", "top-1", "max Δ", "prefill Δ"]
    columns += ["top-1 q-alone", "max Δ q-alone"] if quantized else []
    for col in (*columns, "result"):
        table.add_column(col, justify="left" if col in ("pairing", "result") else "right")
    for p in report.pairings:
        cells = [
            p.name,
            agree(p, "baseline", p.agrees_with_baseline),
            agree(p, "reference", p.agrees_with_reference),
            num(p.top1_agreement, ".1%"),
            num(p.max_logit_diff, ".2e"),
            num(p.first_logit_diff, ".2e"),
        ]
        if quantized:
            cells += [
                num(p.top1_vs_decode_alone, ".1%"),
                num(p.max_logit_diff_vs_decode_alone, ".2e"),
            ]
        table.add_row(*cells, "[green]pass[/]" if p.passed else "[red]FAIL[/]")
    return table
