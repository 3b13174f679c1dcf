"""The demo's built-in long document (written for exo-split, free to reuse) and its question.

About 1,500 tokens through SmolLM2's chat template: long enough that the prefill is worth
sending to a CUDA box, short enough for a 135M model with an 8K context to read.
"""

from __future__ import annotations

SYSTEM = "You are a helpful assistant. Answer from the document, in one or two sentences."

DOCUMENT = """\
The Keepers of Gullhaven Light

Gullhaven is a fishing village on a rocky headland at the mouth of the Marrow estuary. For most
of its history the village had no light at all. Boats coming home in the dark steered by the
glow of cottage windows and by the sound of the surf on the Teeth, a line of black rocks that
runs out from the headland for almost half a mile. Every few winters a boat misjudged the
channel and struck the Teeth, and the village lost men it could not spare.

In 1841 the harbour board decided to build a lighthouse. The board had very little money, so
the tower was built from the grey granite of the headland itself, quarried by the fishermen in
the months when the weather kept them ashore. The mason in charge was a quiet man named Elias
Brannock, who had built bridges inland and had never seen the sea before he arrived. He
designed a round tower sixty-two feet high, wider at the base than at the top, with walls nine
feet thick at the bottom. The work took three summers. The lantern room, made of iron and
glass, was carried from the railway at Dunmere on a cart pulled by four horses, and the story
in the village is that the cart lost a wheel twice on the way.

The light was first lit on the night of the fourteenth of October, 1844. It burned colza oil in
a ring of ten lamps, each with its own polished copper reflector. The keepers wound a clockwork
mechanism every four hours, which turned the ring so that a ship at sea saw a white flash every
twenty seconds. On a clear night the flash could be seen from eighteen miles away.

The first keeper was Thomas Wrayburn, a former sailor who had lost two fingers of his left
hand to a rope on a whaling ship. He kept the light for thirty-one years. His log books survive
in the village library, and they are mostly about weather, oil and wicks, but now and then he
wrote something more personal. In the winter of 1852 he noted that he had not slept in a bed
for nine nights because the storms would not let the lamps rest. In 1860 he wrote only one line
for the whole of the twelfth of March: "Fog. Rang the bell all night. My arms are finished."

When Thomas Wrayburn retired in 1875, his daughter Margaret Wrayburn took over the light. The
harbour board was at first unwilling to appoint a woman, but Margaret had been trimming the
wicks and winding the clockwork since she was eleven years old, and the fishermen signed a
petition in her favour. She became the keeper in her own name in 1876 and kept the light for
forty-four years, longer than anyone before or after her. In 1889 she rowed out alone in a gale
to a coal barge that had struck the outer rocks and brought back three of its four crew. The
harbour board gave her a silver watch, which is now in a glass case in the village hall.

Margaret Wrayburn oversaw the biggest change in the light's history. In 1902 the oil lamps were
replaced by a single paraffin vapour burner and a large glass lens, built in Birmingham, which
floated in a bath of mercury so that it could turn with almost no friction. The new light was
far brighter. The flash was changed from one white flash every twenty seconds to two white
flashes every fifteen seconds, so that sailors would not confuse Gullhaven with the light at
Scarrow Point to the north. Margaret complained in her log that the mercury made her
headaches worse, and later keepers were told to open the windows of the lantern room whenever
they worked on the lens.

After Margaret retired in 1920, the light was kept by a series of men who each stayed only a
few years. The most remembered of them is Arthur Penhale, who kept the light during the war
years. Because of the danger from enemy ships, the light was dimmed or put out on many nights,
and Arthur was ordered to show it only when the navy signalled that friendly ships were
expected. He kept a small garden of potatoes and onions at the foot of the tower, and the
village children were allowed to pick the peas in summer.

In 1958 the light was connected to the electricity supply for the first time. An electric lamp
of one thousand watts replaced the paraffin burner, and an electric motor took over from the
clockwork. The keepers no longer had to wind anything or climb the tower every four hours, but
they still lived in the cottages beside it, because someone had to change the lamp if it
failed and start the diesel generator during power cuts.

The last keeper of Gullhaven Light was Jonah Treloar. He arrived in 1979 and stayed until the
light was made fully automatic on the thirtieth of June, 1991. After that date the light was
watched from a control room in Falbridge, forty miles away, and no one lived at the headland
any more. On his last night Jonah Treloar climbed the tower at midnight, as the old keepers had
done, and wrote the final entry in the log: "All well. Light burning. Handed over to the
machines. Goodnight, Gullhaven."

Today the tower is painted white with a single red band, and it still shows two white flashes
every fifteen seconds. The keepers' cottages have become a small museum, open from Easter to
the end of September, where visitors can see Thomas Wrayburn's log books, Margaret Wrayburn's
silver watch, and the brass bell that was rung in fog before the electric foghorn was
installed. The museum is run by volunteers from the village, several of whom are descended
from the fishermen who quarried the granite for the tower.

People in Gullhaven still say that a boat has never been lost on the Teeth while the light was
burning. The harbour records are not quite so generous: they list two wrecks after 1844, both
on nights when the light had been put out during the war. But the village prefers its own
version of the story, and on the fourteenth of October each year, the anniversary of the first
lighting, the children of the school walk up to the headland with paper lanterns.
"""

QUESTION = "What did the harbour board give Margaret Wrayburn in 1889?"
# The document's answer (middle of the text): a silver watch, now in the village hall.
# SmolLM2-135M answers it in float32 greedy; it does not manage questions that need comparing
# facts ("who kept the light longest?" gets a wrong keeper).
ANSWER_WORDS = ("silver watch",)


def messages() -> list[dict[str, str]]:
    """The chat: the system message, then the document and the question as the user's turn."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{DOCUMENT}\n\nQuestion: {QUESTION}"},
    ]


def raw_prompt() -> str:
    """The same, as plain text, for a checkpoint without a chat template."""
    return f"{DOCUMENT}\nQuestion: {QUESTION}\nAnswer:"
