"""`exo-split chat`: a conversation in the terminal, each turn one request to the decode node
as `split-generate --chat` sends it (the whole history as `messages`; the decode node applies
the chat template and reuses what it already holds of the conversation).

The reply streams to stdout; after it, one line on stderr says how the turn went (TTFT,
speed, where the prefill ran, the KV moved, the prefix reused). Ctrl-C during a reply cancels
that reply (the turn is dropped from the history) and the conversation goes on; Ctrl-D (end
of input) or /exit ends it; /reset clears the history. A request that fails is one line on
stderr and the conversation goes on; a decode node that cannot be reached at the start ends it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from exo_split.cli.common import error_lines, out, run_request, say
from exo_split.cli.split import add_request_options, find_decode, request_options
from exo_split.errors import ExoSplitError, PeerUnavailable
from exo_split.report.turn import turn_line

HELP = "/reset clears the history, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"
PROMPT = "you> "


def add_chat(subparsers) -> None:
    p = subparsers.add_parser(
        "chat",
        help="an interactive conversation through the decode node (history kept)",
        description="Chat in the terminal with the model of a decode node (and its prefill "
        "node): the history goes with every turn, the reply streams, and a one-line report "
        f"follows each reply. {HELP}.",
    )
    p.add_argument("--system", metavar="TEXT", help="a system message at the start")
    add_request_options(p, max_tokens=256)  # a reply per turn, not a completion
    p.set_defaults(func=cmd_chat)


@dataclass
class Conversation:
    """The messages so far; a turn joins the history only once its reply is complete."""

    system: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)  # (user, assistant)

    def messages(self, user: str | None = None) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system is not None else []
        for asked, answered in self.turns:
            msgs += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs


def cmd_chat(args) -> int:
    url, token, _roles = find_decode(args)
    body = request_options(args, _roles)
    say(f"chatting with {_check_decode_node(url, token)} at {url} ({HELP})")
    chat = Conversation(system=args.system)
    while (line := _read_line()) is not None:
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            chat.turns.clear()
            say("[history cleared]")
            continue
        if text.startswith("/") and text.split()[0] in ("/help", "/?"):
            say(HELP)
            continue
        _turn(chat, text, url, token, body)
    return 0


def _turn(chat: Conversation, text: str, url: str, token: str | None, body: dict) -> None:
    """One exchange: the reply streams; it joins the history only if it completed."""
    try:
        done, ttft = run_request(url, token, {**body, "messages": chat.messages(text)},
                                 stream=True)  # fmt: skip
    except KeyboardInterrupt:
        out("\n")
        say("[reply cancelled; the turn is not kept in the history]")
        return
    except ExoSplitError as exc:
        out("\n")
        say(error_lines(exc, prefix="error") + "\n[the turn is not kept in the history]")
        return
    out("\n")
    chat.turns.append((text, done.get("text", "")))
    say(turn_line(done.get("report") or {}, turn=len(chat.turns), ttft_s=ttft))


def _read_line() -> str | None:
    """The user's next line; None at end of input. Ctrl-C at the prompt starts a new line."""
    while True:
        try:
            if sys.stdin.isatty():
                import readline  # noqa: F401 - line editing and history for input()

                return input(PROMPT)
            line = sys.stdin.readline()
            return line if line else None
        except EOFError:
            return None
        except KeyboardInterrupt:
            say("\n(Ctrl-D or /exit to quit)")


def _check_decode_node(url: str, token: str | None) -> str:
    """The model's name, after checking that the decode node answers and can chat."""
    import asyncio

    import aiohttp

    from exo_split.transport.client import fetch_info

    async def info() -> dict:
        async with aiohttp.ClientSession() as session:
            return await fetch_info(session, url, token)

    try:
        doc = asyncio.run(info())
    except PeerUnavailable as exc:
        raise PeerUnavailable(
            str(exc),
            hint="is `exo-split node` running there? Without --decode-peer, chat finds the nodes",
        ) from exc
    openai = doc.get("openai") or {}
    if openai.get("chat") is False:
        raise ExoSplitError(
            f"the decode node at {url} serves {doc.get('model')}, which has no chat template",
            hint="chat needs an instruct checkpoint; split-generate takes a raw prompt",
        )
    return str(openai.get("model") or doc.get("model") or "the model")
