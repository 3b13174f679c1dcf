"""The conversation of `exo-split bench --multiturn`: what the user says in each of its turns.

Turn 1 hands over a long document (the demo's story of Gullhaven Light, then pages of the
lighthouse keeper's log, about 3,500 tokens with SmolLM2's template) with a question; each
later turn adds 50-300 tokens: short follow-up questions, and new pages of the log pasted in.
The log is generated from a seed (dates, winds, ships), so it reads like a log and is the
same on every run. --quick: pseudo-words of the tiny checkpoints, shorter turns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import date, timedelta

from exo_split.models import demo_document

WINDS = ("north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west")
FORCES = ("calm", "light airs", "a light breeze", "a moderate breeze", "fresh", "strong",
          "a near gale", "a full gale")  # fmt: skip
SHIPS = ("Margaret Ann", "Curlew", "Brothers' Hope", "Sea Pink", "Endeavour", "Lily of Dunmere",
         "Kittiwake", "Three Sisters", "Good Intent", "Petrel", "Mary Brannock", "Fortitude")  # fmt: skip
EVENTS = (
    "The {ship} passed inside the Teeth at dusk and made the harbour safely.",
    "Cleaned the reflectors and trimmed the wicks; two chimney glasses replaced.",
    "Fog from noon. The bell rung every two minutes until it lifted after midnight.",
    "The {ship} came in with her mainsail torn and lay at the quay until morning.",
    "Supply boat from Dunmere brought forty gallons of oil and a ton of coal.",
    "Heavy sea on the Teeth all night; spray reached the gallery twice.",
    "The inspector from the harbour board visited and found the light in good order.",
    "Painted the iron of the lantern room on the seaward side.",
    "The {ship} and the {other} both fishing off the point until the weather turned.",
    "Clockwork stopped at 2.10 am and was rewound at once; the light was dark for under a minute.",
    "Snow in the afternoon; the path from the village was closed and bread came by boat.",
    "A lamp smoked badly through the first watch; the wick was changed at 11 pm.",
)


@dataclass(frozen=True)
class Conversation:
    """The system message and the user's message of each turn, in order."""

    system: str
    turns: tuple[str, ...]


def keepers_log(entries: int, *, year: int, seed: int) -> str:
    """`entries` days of the keeper's log of one winter, the same for the same arguments."""
    rng = random.Random(seed)
    day = date(year, 10, 1)
    lines = [f"Pages from the log of Gullhaven Light, winter of {year}."]
    for _ in range(entries):
        day += timedelta(days=rng.randint(2, 6))
        ship, other = rng.sample(SHIPS, 2)
        lit, out = rng.randint(4, 6), rng.randint(6, 8)
        lines.append(
            f"{day.day} {day:%B %Y}. Wind {rng.choice(WINDS)}, {rng.choice(FORCES)}. Lamp lit at "
            f"{lit}.{rng.randint(0, 59):02d} pm, put out at {out}.{rng.randint(0, 59):02d} am; "
            f"{rng.randint(6, 12)} pints of oil. "
            + rng.choice(EVENTS).format(ship=ship, other=other)
        )
    return "\n".join(lines)


def full() -> Conversation:
    """With SmolLM2's template: 3,501 tokens in turn 1, then 60, 284, 50 and 224 new ones."""
    document = f"{demo_document.DOCUMENT}\n{keepers_log(32, year=1888, seed=1)}"
    return Conversation(
        system=demo_document.SYSTEM,
        turns=(
            f"{document}\n\nQuestion: {demo_document.QUESTION}",
            "Thank you, that is helpful. I have a question about the building of the tower now. "
            "Who was the mason in charge of the work, where had he worked before he came to "
            "Gullhaven, and how thick were the walls at the bottom of the tower? How many "
            "summers did the work take? One sentence is enough.",
            "Here are more pages of the same log, from the following winter:\n\n"
            f"{keepers_log(4, year=1889, seed=2)}\n\nQuestion: which ships are named in these "
            "new pages?",
            "Going back to the story for a moment. When the light was first lit in October "
            "1844, what did the lamps burn, how many lamps were there in the ring, and what "
            "did each lamp have behind it? Who wound the clockwork? Answer briefly, please.",
            "Two more pages turned up in the village hall:\n\n"
            f"{keepers_log(3, year=1890, seed=3)}\n\nQuestion: on which day in these pages was "
            "the wind strongest?",
        ),
    )


def quick(vocab_size: int) -> Conversation:
    """--quick: pseudo-words (tiny checkpoints): ~500 words in turn 1, then 12 to 60."""
    from exo_split.models.tiny import sample_prompt

    def said(n: int, seed: int) -> str:
        return sample_prompt(n, seed=seed, vocab_size=vocab_size)

    return Conversation(
        system=said(6, 0),
        turns=(said(500, 1), said(12, 2), said(60, 3), said(16, 4), said(48, 5)),
    )
