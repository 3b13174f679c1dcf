"""What the command modules share: printing, argument types and options, reading a prompt,
writing a report page, and sending one request to a decode node while its text streams.

Only the cli/ package reads argv, stdin and the environment, and prints. Machine-readable
output (--json) is the last line of stdout; progress and summaries go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from exo_split.errors import ExoSplitError

if TYPE_CHECKING:
    from exo_split.report import HandoffReport

PROG = "exo-split"


class UsageError(ExoSplitError):
    """Bad command-line arguments."""


def say(message: str) -> None:
    """Progress for humans: stderr, so stdout stays the output."""
    print(message, file=sys.stderr, flush=True)


def out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def error_lines(exc: ExoSplitError, prefix: str = f"{PROG}: error") -> str:
    message = " ".join(str(exc).split("\n"))
    lines = f"{prefix}: {message}"
    if exc.hint:
        lines += f"\n  hint: {exc.hint}"
    return lines


# --- argument types --------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def seconds(text: str, *, zero: bool = False, below: float = float("inf")) -> float:
    """A finite number of seconds > 0 (>= 0 with `zero`), under `below`."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < below or (value == 0 and not zero):
        floor = ">= 0" if zero else "> 0"
        limit = "" if below == float("inf") else f" and < {below:g}"
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds {floor}{limit}, got {text!r}"
        )
    return value


def size(text: str, *, zero: bool = False) -> int:
    """A size in bytes: 512M, 8G, 1.5GiB, 4096 (0 only where `zero` allows it)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number, unit = text.upper().rstrip("IB"), ""
    if number and number[-1] in units:
        number, unit = number[:-1], number[-1]
    try:
        value = int(float(number) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 8G, got {text!r}") from None
    if value < (0 if zero else 1):
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return value


# --- shared options --------------------------------------------------------------------


def add_model_options(p: argparse.ArgumentParser) -> None:
    from exo_split.kv import DTYPES

    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        type=model_dir,
        help="Hugging Face checkpoint directory, or an embedded model: "
        + ", ".join(EMBEDDED_MODELS)
        + " (converted into the cache on first use)",
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)"
    )


def add_token_option(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument(
        "--token-file",
        type=Path,
        help=help
        or "file holding the shared token (default: $EXO_SPLIT_TOKEN, else "
        "~/.config/exo-split/token)",
    )


def add_prompt_options(p: argparse.ArgumentParser, *, required: bool = True):
    """--prompt / --prompt-file, one of them; returns the group (a command may add sources)."""
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE ('-': stdin)")
    return src


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    return read_text(args.prompt_file, "the prompt file")


def read_text(path: str | Path, what: str) -> str:
    """A UTF-8 file's text ('-': stdin)."""
    if str(path) == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ExoSplitError(f"cannot read {what} {path}: {exc}") from exc


def write_html(path: Path, obj) -> None:
    """Write a report (or comparison) as one self-contained HTML page."""
    from exo_split.report.html import render_html

    try:
        path.write_text(render_html(obj))
    except OSError as exc:
        raise ExoSplitError(f"cannot write {path}: {exc.strerror}") from exc
    say(f"wrote {path}")


def with_client_ttft(report_json: dict, ttft: float | None) -> HandoffReport:
    """The decode node's report, with the TTFT the client itself observed."""
    from exo_split.report import build_report, load_report

    report = load_report(report_json)
    return build_report(dataclasses.replace(report.timeline, client_ttft_s=ttft))


EMBEDDED_MODELS = ("smollm2", "gemma3")


def embedded_model(name: str) -> Path:
    """The converted directory of an embedded model (converting it on first use)."""
    if name == "smollm2":
        from exo_split.models.smollm2 import ensure_smollm2 as ensure
    elif name == "gemma3":
        from exo_split.models.gemma3 import ensure_gemma3 as ensure
    else:
        raise ExoSplitError(
            f"no embedded model {name!r}: expected one of {', '.join(EMBEDDED_MODELS)}"
        )
    with conversion_progress() as progress:
        return ensure(progress=progress)


def model_dir(value: str) -> Path:
    """--model: a directory; an embedded model's name where no such directory exists."""
    path = Path(value)
    if value in EMBEDDED_MODELS and not path.exists():
        return embedded_model(value)
    return path


@contextlib.contextmanager
def conversion_progress() -> Iterator[Callable]:
    """A `progress` callback for convert_gguf / ensure_smollm2: on a terminal a bar over the
    tensors (stderr); elsewhere the uncounted steps as lines and the tensors every 10%."""
    if not sys.stderr.isatty():
        shown = {"decile": -1}

        def plain(event) -> None:
            if not event.total:
                say(str(event))
            elif (decile := 10 * event.done // event.total) > shown["decile"]:
                shown["decile"] = decile
                say(f"  {event.done}/{event.total} tensors")

        yield plain
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = None

        def rich_progress(event) -> None:
            nonlocal task
            if not event.total:
                bar.console.print(str(event), markup=False, highlight=False)
                return
            if task is None:
                task = bar.add_task("converting tensors", total=event.total)
            bar.update(task, completed=event.done)

        yield rich_progress


# --- one request through a decode node -------------------------------------------------


def run_request(url: str, token: str | None, body: dict, *, stream: bool) -> tuple[dict, float]:
    """Send one generate request to the decode node at `url`; print its text as it streams
    (when `stream`) and a transient progress line while the KV arrives (on a terminal).
    Returns (the `done` event, the client-observed TTFT in seconds)."""
    import asyncio

    from exo_split.transport.client import run_generate

    show_progress = sys.stderr.isatty()
    state = {"first": True}

    def on_event(event: dict) -> None:
        kind = event.get("type")
        if kind == "token":
            if state["first"] and show_progress:
                print("\r\033[K", end="", file=sys.stderr, flush=True)
            state["first"] = False
            if stream:
                out(event.get("text", ""))
        elif kind == "progress" and show_progress:
            _progress_line(event)
        elif kind == "fallback":
            say(f"\n[prefill peer failed, prefilling locally: {event.get('reason')}]")

    t0 = time.perf_counter()
    done, ttft = asyncio.run(
        interruptible(run_generate(url, token, body, on_event=on_event, t0=t0))
    )
    if stream:
        out(done.get("tail", ""))  # an incomplete character the token events held back
    return done, ttft


async def interruptible(coro):
    """Await `coro`; Ctrl-C cancels it and ends as KeyboardInterrupt, whatever the cancelled
    request raised on its way out. Ctrl-C sent to a whole process group (a terminal's, or the
    demo's with its nodes) also stops the node we are reading from, and its broken stream
    can reach us before the cancellation does: that is still an interrupt (exit 130), not a
    failed request."""
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    hit: list[bool] = []

    def on_sigint() -> None:
        hit.append(True)
        if task is not None:
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
        return await coro
    try:
        return await coro
    except BaseException:
        if hit:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)


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
