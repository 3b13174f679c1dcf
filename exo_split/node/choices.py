"""A request's choices (the OpenAI API's `n`): what each one's decode produces, what they
share of the request's one prefill, and running them side by side (node/decode.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from exo_split.backends.base import Constraint
from exo_split.node.timing import Remote
from exo_split.sampling import Adjust
from exo_split.tokenizer import TextStream
from exo_split.transport.messages import GenerateRequest

Emit = Callable[[dict], Awaitable[None]]
EmitMany = Callable[[list[dict]], Awaitable[None]]  # several events, in order, in one write

Other = tuple  # another choice of a request: (emit, until, constraint)


@dataclass(eq=False)
class Choice:
    """One choice of a request: where its tokens go, and what its decode produced."""

    req: GenerateRequest  # its own (the seed of choice i is the request's plus i)
    emit: Emit
    emit_many: EmitMany | None
    until: Callable[[], bool] | None
    constraint: Constraint | None
    lps: list | None
    stream: TextStream
    adjust: Adjust | None = None
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    ended: bool = False  # `until` ended it
    ticket: object = None  # its place in the decode batch, expected (Batcher.expect)


@dataclass
class Shared:
    """What every choice's report takes from the request's one prefill."""

    ids: list[int]
    own: bool  # the decode computes the prompt's last position
    remote: Remote | None
    fallback: str | None
    decision: dict | None
    arrived: float
    local: tuple[float, float]
    cached: int  # prompt positions this node's prefix cache held


async def all_of(runs: list) -> list:
    """Await every coroutine; one failing cancels the rest (and waits for them)."""
    if len(runs) == 1:
        return [await runs[0]]
    tasks = [asyncio.ensure_future(r) for r in runs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def token_event(token: int, stream: TextStream, lps: list | None, i: int) -> dict:
    """Token i's event for its choice's stream (with its log-probabilities, if asked)."""
    event = {"type": "token", "id": token, "text": stream.push(token)}
    if lps is not None and i < len(lps):  # (the loop appended it before yielding)
        event["logprob"], event["top_logprobs"] = lps[i]
    return event
