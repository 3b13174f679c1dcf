"""Hostile frames against the parser, in process: a hypothesis property test and a seeded
run of 50,000 mutated frames. The oracle, for every input: a valid parse whose content is the
original's (never silently different), or a ProtocolError; nothing else, in work linear in
the input (counted, not timed), and no allocation beyond what the spec allows. The live decode node's share is in
test_reliability.py (test_mutated_streams_against_a_live_decode_node)."""

from __future__ import annotations

import contextlib
import random
import tracemalloc
import zlib

import numpy as np
import pytest
from fakes import mutate_stream, split_frames
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo_split.errors import ProtocolError
from exo_split.kv import chunk_sizes
from exo_split.transport import decoder as decoder_module
from exo_split.transport import wire
from exo_split.transport.decoder import FrameDecoder

# Frames of at most 3 positions (3 x 64 B): a chunk of 4 travels as two frames.
SPEC = wire.StreamSpec(
    n_layers=3, n_kv_heads=2, head_dim=8, dtype=wire.WireDtype.float16, prompt_len=10,
    max_frame_bytes=3 * 64,
)  # fmt: skip
PLAN = wire.Plan(chunk_sizes(10, 4), 3, n_layers=3)
HELLO = {"spec": {"n_layers": 3}, "prefill_received": 1.0, "prefill_replied": 2.0,
         "plan": PLAN.to_json()}  # fmt: skip
END = {"prefill_start": 1.0, "prefill_end": 2.0, "pieces": []}
# The most one frame may make the parser allocate: the largest LAYER frame the receiver
# accepts, the JSON cap, or END's cap under the plan.
ALLOWED = max(SPEC.max_frame_bytes, wire.MAX_JSON_PAYLOAD, PLAN.end_cap())


def valid_stream() -> tuple[bytes, dict]:
    """A valid stream and what it carries: {(layer, token_start): payload}, token, objects."""
    rng = np.random.default_rng(0)
    parts, layers = [wire.encode_hello(HELLO)], {}
    for _, layer, start, n in PLAN.frames():
        k, v = (rng.integers(0, 2**16, (2, n, 8), dtype=np.uint16) for _ in "kv")
        parts.append(wire.encode_layer(layer, start, n, SPEC.dtype, k, v))
        layers[(layer, start)] = k.tobytes() + v.tobytes()
    parts += [wire.encode_token(42, -0.5), wire.encode_end(END)]
    data = b"".join(wire.frame_bytes(p) for p in parts)
    return data, {"layers": layers, "token": (42, -0.5)}


STREAM, CONTENT = valid_stream()
FRAMES = split_frames(STREAM)


def parse(data: bytes, rng: random.Random) -> str:
    """'valid' or 'protocol_error'; asserts a valid parse carries exactly the original."""
    decoder, frames, last = FrameDecoder(SPEC), [], 0
    cuts = sorted(rng.sample(range(1, len(data)), min(5, len(data) - 1))) if len(data) > 1 else []
    try:
        for cut in (*cuts, len(data)):  # the bytes arrive in pieces of any size
            frames += decoder.feed(data[last:cut])
            last = cut
        decoder.eof()
    except ProtocolError:
        return "protocol_error"
    check_content(frames)
    return "valid"


def check_content(frames: list) -> None:
    kinds = [f.kind for f in frames]
    n_layer = len(CONTENT["layers"])
    assert kinds == [wire.Kind.HELLO] + [wire.Kind.LAYER] * n_layer + [
        wire.Kind.TOKEN,
        wire.Kind.END,
    ]
    assert frames[0].obj == HELLO and frames[-1].obj == END
    for f in frames[1:-2]:
        assert bytes(f.payload) == CONTENT["layers"][(f.header.layer, f.header.token_start)]
    assert (frames[-2].token_id, frames[-2].logprob) == CONTENT["token"]


def test_the_unmutated_stream_parses():
    assert parse(STREAM, random.Random(0)) == "valid"


MUTATED_FRAMES = 50_000


class Work:
    """Counts what the decoder does: calls of its consuming step (`buffer_updated`), and
    payload bytes run through the CRC. Linear work: each step completes a header or a payload
    block, or uses up the piece it was given; and every payload byte goes through the CRC once."""

    def __init__(self, monkeypatch):
        self.steps = self.crc_bytes = 0
        take = FrameDecoder.buffer_updated
        monkeypatch.setattr(FrameDecoder, "buffer_updated", self._counted(take))

        def crc32(data, value=0):
            self.crc_bytes += len(data)
            return zlib.crc32(data, value)

        monkeypatch.setattr(decoder_module, "crc32", crc32)

    def _counted(self, take):
        def counted(decoder, n):
            self.steps += 1
            return take(decoder, n)

        return counted

    def check(self, data: bytes, case: int, mutation) -> None:
        # Frames completed <= len // HEADER_SIZE, each with at most one payload step; plus one
        # step per piece of input (at most 6 in parse()) and the one that raised.
        bound = 2 * (len(data) // wire.HEADER_SIZE) + 6 + 1
        assert self.steps <= bound, f"case {case} ({mutation}): {self.steps} steps > {bound}"
        assert self.crc_bytes <= len(data), f"case {case} ({mutation}): CRC over {self.crc_bytes} B"
        self.steps = self.crc_bytes = 0


@pytest.mark.slow
def test_50k_mutated_frames_parse_or_raise_protocol_error_within_bounds(monkeypatch):
    """Seeded: each case mutates one frame (header fields set to edge values, bit flips,
    truncation, garbage, duplication, reordering...). Bounded: every payload buffer the parser
    allocates is checked against the spec's largest frame as it is requested (a 100 GB claim
    would fail here, not in the allocator), every 100th case runs under tracemalloc, and the
    decoder's work is counted per case (Work): linear in the input, whatever the input is.
    pytest-timeout bounds a hang; no wall-clock threshold."""
    largest = [0]

    def guarded_bytearray(*args):
        if args and isinstance(args[0], int):
            assert args[0] <= ALLOWED, f"the parser asked for {args[0]} bytes"
            largest[0] = max(largest[0], args[0])
        return bytearray(*args)

    monkeypatch.setattr(decoder_module, "bytearray", guarded_bytearray, raising=False)
    work = Work(monkeypatch)
    rng = random.Random(20_260_601)
    outcomes: dict[str, int] = {}
    traced_peak, most_steps = 0, 0
    for case in range(MUTATED_FRAMES):
        data, mutation = mutate_stream(FRAMES, rng)
        traced = case % 100 == 0
        if traced:
            tracemalloc.start()
        try:
            outcome = parse(data, rng)
        except Exception as exc:  # the test's point: nothing but ProtocolError escapes
            pytest.fail(f"case {case} ({mutation}): {type(exc).__name__}: {exc}")
        finally:
            if traced:
                traced_peak = max(traced_peak, tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()
        most_steps = max(most_steps, work.steps)
        work.check(data, case, mutation)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\n{MUTATED_FRAMES} mutated frames: {outcomes}; at most {most_steps} decoder steps "
          f"a case; largest buffer {largest[0]} B; traced peak {traced_peak} B")  # fmt: skip
    assert sum(outcomes.values()) == MUTATED_FRAMES
    assert outcomes["protocol_error"] > MUTATED_FRAMES * 0.9  # the mutations do bite
    assert largest[0] > 0 and traced_peak < ALLOWED + (1 << 20)
    assert most_steps > 0  # the counters are wired in


FUZZ = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), n_ops=st.integers(1, 4))
def test_property_mutated_stream_parses_or_raises_protocol_error(seed, n_ops):
    rng = random.Random(seed)
    data, _ = mutate_stream(FRAMES, rng, n_ops=n_ops)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        parse(data, rng)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before < ALLOWED + (1 << 20)


@FUZZ
@given(
    field=st.sampled_from(["layer", "token_start", "n_tokens", "payload_len", "dtype", "kind"]),
    value=st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**32 - 1, 2**64 - 1])),
    frame=st.integers(0, len(FRAMES) - 1),
)
def test_property_any_header_value_is_checked_before_allocation(field, value, frame):
    """A header claiming any size (up to 2**64 - 1 bytes) allocates nothing beyond the spec."""
    from fakes import FIELDS

    off, size = FIELDS[field]
    value %= 1 << (8 * size)
    frames = list(FRAMES)
    head = bytearray(frames[frame][: wire.HEADER_SIZE])
    head[off : off + size] = value.to_bytes(size, "little")
    frames[frame] = bytes(head)  # header only: a claim with no payload behind it
    data = b"".join(frames[: frame + 1])
    tracemalloc.start()
    try:
        decoder = FrameDecoder(SPEC)
        with contextlib.suppress(ProtocolError):
            decoder.feed(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ALLOWED + (1 << 20)


# The decode node's checks of what the frames carry (HELLO's spec and stamps, END's
# pieces): any JSON object is either accepted or refused as a peer failure.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def coordinator():
    from exo_split.node.decode import Coordinator
    from exo_split.spec import ModelSpec

    class Backend:
        spec = ModelSpec("llama", 3, 4, 2, 8, 32, 64, 512, 1e-5, 10000.0)
        dtype = "float16"

    return Coordinator(Backend(), None, None, token=None, timeouts=None, session=None,
                       choose_peer=None)  # fmt: skip


@FUZZ
@given(
    hello=st.dictionaries(
        st.sampled_from(["spec", "prefill_received", "prefill_replied", "dtype", "x"]),
        json_values,
    ),
    spec_edits=st.dictionaries(st.text(max_size=12), json_values, max_size=3),
)
def test_property_hello_contents_fail_only_as_peer_failures(coordinator, hello, spec_edits):
    from exo_split.node.decode import PEER_FAILURES

    if spec_edits:
        hello = {**hello, "spec": {**coordinator.spec.to_dict(), **spec_edits}}
    with contextlib.suppress(PEER_FAILURES):
        coordinator._check_hello("peer", hello)


@FUZZ
@given(
    end=st.dictionaries(st.sampled_from(["pieces", "prefill_start", "prefill_end"]), json_values)
)
def test_property_end_contents_fail_only_as_protocol_errors(end):
    from exo_split.node.remote import _check_end

    with contextlib.suppress(ProtocolError):
        _check_end("peer", end, 3)
