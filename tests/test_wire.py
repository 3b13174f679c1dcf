"""Frame format, the Plan and FrameDecoder: round trips, stream order, every rejection, the
END of many pieces, writing into a destination, fuzzing."""

from __future__ import annotations

import json
import random
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo_split import PROTOCOL_VERSION
from exo_split.errors import ExoSplitError, ProtocolError
from exo_split.kv import chunk_sizes
from exo_split.transport.decoder import Frame, FrameDecoder, ThreadCrc, decode_frame
from exo_split.transport.stamps import end_record, parse_end
from exo_split.transport.wire import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_ERROR_MESSAGE,
    MAX_JSON_PAYLOAD,
    FrameHeader,
    Kind,
    Plan,
    StreamSpec,
    WireDtype,
    encode_end,
    encode_error,
    encode_hello,
    encode_layer,
    encode_token,
    frame_bytes,
    layer_frame,
)

SPEC = StreamSpec(n_layers=3, n_kv_heads=2, head_dim=4, dtype=WireDtype.float16, prompt_len=10)


def hello(chunk: int = 4, frame_tokens: int = 100, spec: StreamSpec = SPEC) -> dict:
    plan = Plan(chunk_sizes(spec.prompt_len, chunk), min(frame_tokens, spec.frame_tokens()),
                spec.n_layers)  # fmt: skip
    return {"spec": {"n_layers": 3}, "node_id": "prefill-α", "clock": 12.5, "plan": plan.to_json()}


HELLO = hello()
END = {"layers": [[0.1, 0.2]] * 3, "total_s": 0.75}
FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# numpy carriers: bfloat16 travels as raw 16-bit words
NP_DTYPE = {
    WireDtype.float32: np.float32,
    WireDtype.float16: np.float16,
    WireDtype.bfloat16: np.uint16,
}
UINT = {4: np.uint32, 2: np.uint16}


def kv_arrays(spec: StreamSpec, n_tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random bit patterns (NaNs, denormals and all) shaped [n_kv_heads, n_tokens, head_dim]."""
    rng = np.random.default_rng(seed)
    uint = UINT[spec.dtype.itemsize]
    shape = (spec.n_kv_heads, n_tokens, spec.head_dim)
    k, v = (rng.integers(0, np.iinfo(uint).max, shape, dtype=uint, endpoint=True) for _ in "kv")
    return k.view(NP_DTYPE[spec.dtype]), v.view(NP_DTYPE[spec.dtype])


def layer_frames(
    spec: StreamSpec, chunk: int, frame_tokens: int = 100
) -> list[tuple[int, int, int, np.ndarray, np.ndarray]]:
    """(layer, token_start, n_tokens, k, v) of every LAYER frame, in the Plan's order."""
    plan = Plan(chunk_sizes(spec.prompt_len, chunk), min(frame_tokens, spec.frame_tokens()),
                spec.n_layers)  # fmt: skip
    return [(layer, s, n, *kv_arrays(spec, n, seed=layer * 1000 + s))
            for _, layer, s, n in plan.frames()]  # fmt: skip


def valid_stream(spec: StreamSpec = SPEC, chunk: int = 4, frame_tokens: int = 100):
    layers = layer_frames(spec, chunk, frame_tokens)
    parts = [encode_hello(hello(chunk, frame_tokens, spec))]
    parts += [encode_layer(lay, s, n, spec.dtype, k, v) for lay, s, n, k, v in layers]
    parts += [encode_token(128_001, -0.25), encode_end(END)]
    return b"".join(frame_bytes(p) for p in parts), layers


def raw(kind: int, payload: bytes = b"", **fields: int) -> bytes:
    """A frame built by hand, bypassing every check; the CRC is right unless given."""
    f = dict(magic=MAGIC, version=PROTOCOL_VERSION, kind=kind, dtype=0, flags=0, layer=0)
    f.update(token_start=0, n_tokens=0, payload_len=len(payload), crc=zlib.crc32(payload))
    f.update(fields)
    return HEADER.pack(*f.values()) + payload


def raw_layer(layer: int, start: int, n: int, spec: StreamSpec = SPEC, **fields: int) -> bytes:
    payload = bytes(range(256)) * (spec.layer_payload_len(n) // 256 + 1)
    payload = payload[: spec.layer_payload_len(n)]
    fields.setdefault("dtype", spec.dtype)
    return raw(Kind.LAYER, payload, layer=layer, token_start=start, n_tokens=n, **fields)


def feed_pieces(decoder: FrameDecoder, data: bytes, seed: int) -> list[Frame]:
    rng, frames, i = random.Random(seed), [], 0
    while i < len(data):
        step = rng.choice([1, 2, 7, 31, 32, 33, 100, 4096])
        frames += decoder.feed(memoryview(data)[i : i + step])
        i += step
    return frames


def check_stream(frames: list[Frame], layers: list, hello_obj: dict = HELLO) -> None:
    assert [f.kind for f in frames] == [Kind.HELLO] + [Kind.LAYER] * len(layers) + [
        Kind.TOKEN,
        Kind.END,
    ]
    assert frames[0].obj == hello_obj
    for frame, (layer, start, n, k, v) in zip(frames[1:], layers, strict=False):
        h = frame.header
        assert (h.layer, h.token_start, h.n_tokens, h.dtype) == (layer, start, n, SPEC.dtype)
        assert bytes(frame.k) == k.tobytes() and bytes(frame.v) == v.tobytes()
    assert (frames[-2].token_id, frames[-2].logprob) == (128_001, -0.25)
    assert frames[-1].obj == END


def test_header_layout():
    header = FrameHeader(Kind.LAYER, WireDtype.bfloat16, 7, 256, 128, 2 * 128 * 2 * 3, 0xDEADBEEF)
    packed = header.pack()
    assert HEADER_SIZE == len(packed) == 32
    assert packed[:4] == b"EXOS" and packed[4:8] == bytes([2, 2, 3, 0])
    assert packed[8:12] == (7).to_bytes(4, "little")
    assert packed[20:28] == (2 * 128 * 2 * 3).to_bytes(8, "little")
    assert packed[28:] == (0xDEADBEEF).to_bytes(4, "little")
    assert FrameHeader.unpack(packed) == header


def test_wire_dtype_names_and_sizes():
    assert [(d.name, d.itemsize) for d in WireDtype][1:] == [
        ("float32", 4),
        ("float16", 2),
        ("bfloat16", 2),
    ]
    assert WireDtype.from_name("bfloat16") is WireDtype.bfloat16
    assert WireDtype.from_name("torch.float16") is WireDtype.float16
    for bad in ("int8", "none", "bf16"):
        with pytest.raises(ProtocolError, match="unknown dtype"):
            WireDtype.from_name(bad)


def test_stream_spec():
    assert SPEC.layer_payload_len(4) == 2 * 2 * 4 * 4 * 2
    with pytest.raises(ValueError):
        StreamSpec(n_layers=0, n_kv_heads=2, head_dim=4, dtype=WireDtype.float16, prompt_len=1)
    with pytest.raises(ValueError):
        StreamSpec(n_layers=1, n_kv_heads=2, head_dim=4, dtype=WireDtype.none, prompt_len=1)


@pytest.mark.parametrize("seed", range(6))
def test_every_kind_round_trips_in_random_pieces(seed):
    chunk, frame_tokens = [(1, 100), (3, 100), (4, 100), (7, 100), (10, 3), (None, 1)][seed]
    data, layers = valid_stream(chunk=chunk, frame_tokens=frame_tokens)
    decoder = FrameDecoder(SPEC)
    check_stream(feed_pieces(decoder, data, seed), layers, hello(chunk, frame_tokens))
    assert decoder.done and decoder.finished
    decoder.eof()


def test_plan_frames_are_bounded_token_ranges_of_each_piece():
    plan = Plan((4, 4, 2), 3, n_layers=2)
    assert list(plan.pieces()) == [(0, 0, 4), (1, 0, 4), (0, 4, 4), (1, 4, 4), (0, 8, 2),
                                   (1, 8, 2)]  # fmt: skip
    assert list(plan.frames()) == [
        (0, 0, 0, 3), (0, 0, 3, 1), (1, 1, 0, 3), (1, 1, 3, 1), (2, 0, 4, 3), (2, 0, 7, 1),
        (3, 1, 4, 3), (3, 1, 7, 1), (4, 0, 8, 2), (5, 1, 8, 2),
    ]  # fmt: skip
    assert plan.n_frames == 10 and plan.n_pieces == 6 and plan.prompt_len == 10
    assert plan.to_json() == {"chunks": [[4, 2], [2, 1]], "frame_tokens": 3}
    spec = StreamSpec(2, 2, 4, WireDtype.float16, 10, max_frame_bytes=3 * 32)
    assert Plan.from_json(plan.to_json(), spec) == plan
    # the frame bound is in bytes: 3 positions of 2 x 2 heads x 4 dims x 2 B = 96 B
    assert spec.frame_tokens() == 3 and spec.frame_tokens(64) == 2 and spec.frame_tokens(1) == 1


BAD_PLANS = {
    "not an object": ([1], "HELLO plan: expected a JSON object, got list"),
    "chunks not pairs": ({"chunks": [[4]], "frame_tokens": 3}, "[size, count] pairs"),
    "zero size": ({"chunks": [[0, 3], [10, 1]], "frame_tokens": 3}, "integers >= 1"),
    "bool count": ({"chunks": [[10, True]], "frame_tokens": 3}, "integers >= 1"),
    "too few tokens": ({"chunks": [[4, 2]], "frame_tokens": 3}, "expected 10 tokens, got 8"),
    "too many tokens": ({"chunks": [[4, 2**40]], "frame_tokens": 3}, "expected 10 tokens"),
    "frames over the bound": ({"chunks": [[10, 1]], "frame_tokens": 4}, "expected 1..3 (96 B)"),
    "frame_tokens 0": ({"chunks": [[10, 1]], "frame_tokens": 0}, "frame_tokens"),
    "frame_tokens text": ({"chunks": [[10, 1]], "frame_tokens": "3"}, "frame_tokens"),
}


@pytest.mark.parametrize("case", BAD_PLANS, ids=list(BAD_PLANS))
def test_a_plan_that_does_not_fit_the_receiver_is_refused(case):
    obj, message = BAD_PLANS[case]
    spec = StreamSpec(2, 2, 4, WireDtype.float16, 10, max_frame_bytes=3 * 32)
    with pytest.raises(ProtocolError) as info:
        Plan.from_json(obj, spec)
    assert message in str(info.value)


def test_end_with_8192_pieces_fits_its_cap():
    """32 layers x 32K tokens with chunks of 128: 8,192 pieces. Their stamps fit END's cap
    (they did not in protocol 1, where END was a list of objects capped at 1 MiB)."""
    plan = Plan(chunk_sizes(32_768, 128), 128, n_layers=32)
    assert plan.n_pieces == 8192
    rng = random.Random(0)
    t0 = 1_000_000.123456  # a perf_counter after days of uptime
    stamps = {k: [t0 + rng.uniform(0, 600) for _ in range(8192)]
              for k in ("compute_done", "send_start", "sent")}  # fmt: skip
    end = end_record(t0, t0 + 600, True, stamps)
    payload = frame_bytes(encode_end(end))
    assert len(payload) - HEADER_SIZE <= plan.end_cap()
    assert len(payload) - HEADER_SIZE < MAX_JSON_PAYLOAD  # about 0.2 MB
    back = parse_end(json.loads(payload[HEADER_SIZE:]), 8192)
    for k, values in stamps.items():
        assert max(abs(a - b) for a, b in zip(back[k], values, strict=True)) < 1e-6
    with pytest.raises(ProtocolError, match="8191 integer"):
        parse_end(end, 8191)


def test_end_over_the_plans_cap_is_refused_from_its_header():
    decoder = FrameDecoder(SPEC)
    decoder.feed(frame_bytes(encode_hello(HELLO)))
    cap = decoder.plan.end_cap()
    head = raw(Kind.END, payload_len=cap + 1)
    layers = b"".join(frame_bytes(encode_layer(lay, s, n, SPEC.dtype, k, v))
                      for lay, s, n, k, v in layer_frames(SPEC, 4))  # fmt: skip
    decoder.feed(layers + frame_bytes(encode_token(1, 0.0)))
    with pytest.raises(ProtocolError, match=f"END: expected payload_len <= {cap}"):
        decoder.feed(head)


class Cache:
    """A destination: per layer K and V [heads, capacity, dims], like the decode cache."""

    def __init__(self, spec: StreamSpec, capacity: int):
        shape = (spec.n_kv_heads, capacity, spec.head_dim)
        self.k = [np.zeros(shape, NP_DTYPE[spec.dtype]) for _ in range(spec.n_layers)]
        self.v = [np.zeros(shape, NP_DTYPE[spec.dtype]) for _ in range(spec.n_layers)]

    def blocks(self, layer, start, n):
        return [memoryview(a[layer][h, start : start + n]).cast("B")
                for a in (self.k, self.v) for h in range(a[layer].shape[0])]  # fmt: skip


@pytest.mark.parametrize("threaded", [False, True], ids=["inline-crc", "thread-crc"])
def test_layer_payloads_land_in_the_destination(threaded):
    data, layers = valid_stream(chunk=4, frame_tokens=3)
    cache, crc = Cache(SPEC, 16), ThreadCrc() if threaded else None
    decoder = FrameDecoder(SPEC, dest=cache, crc=crc)
    frames = feed_pieces(decoder, data, seed=1)
    for f in frames:
        f.verify()
        assert f.payload is None if f.kind is Kind.LAYER else True
    for layer, s, n, k, v in layers:  # bit for bit (the random patterns include NaNs)
        assert np.array_equal(cache.k[layer][:, s : s + n].view(np.uint16), k.view(np.uint16))
        assert np.array_equal(cache.v[layer][:, s : s + n].view(np.uint16), v.view(np.uint16))
    assert not cache.k[0][:, 10:].any()  # nothing past the prompt
    if crc is not None:
        crc.close()


def _tp_stream(ranges) -> tuple[bytes, list]:
    """A valid stream whose every LAYER frame is one frame per head range (a tensor-parallel
    prefill's workers each sending theirs), and the whole layers' K and V it carries."""
    layers = layer_frames(SPEC, 4, 3)
    plan = hello(4, 3)["plan"] | {"heads": [list(r) for r in ranges]}
    parts = [encode_hello(hello(4, 3) | {"plan": plan})]
    for lay, s, n, k, v in layers:
        for first, count in ranges:
            blocks = [memoryview(np.ascontiguousarray(a[first : first + count])).cast("B")
                      for a in (k, v)]  # fmt: skip
            parts.append(layer_frame(lay, s, n, SPEC.dtype, blocks, heads=(first, count)))
    parts += [encode_token(128_001, -0.25), encode_end(END)]
    return b"".join(frame_bytes(p) for p in parts), layers


@pytest.mark.parametrize("into", ["cache", "buffers"])
def test_head_ranges_are_assembled_into_whole_layers(into):
    """Each token range of each layer arrives as two frames, one per head range: the decoder
    lands each range's heads where they belong (a Destination: the cache; none: a buffer of
    the whole range, handed on once its last head range is in), bit for bit."""
    data, layers = _tp_stream(TP2)
    cache = Cache(SPEC, 16) if into == "cache" else None
    decoder = FrameDecoder(SPEC, dest=cache)
    frames = [f for f in feed_pieces(decoder, data, seed=5) if f.kind is Kind.LAYER]
    assert decoder.done and len(frames) == 2 * len(layers)
    assert [f.header.heads for f in frames] == [(0, 1), (1, 1)] * len(layers)
    assert [f.complete for f in frames] == [False, True] * len(layers)
    assert sum(f.last for f in frames) == decoder.plan.n_pieces
    for (layer, s, n, k, v), f in zip(layers, frames[1::2], strict=True):
        if cache is not None:
            k_got, v_got = cache.k[layer][:, s : s + n], cache.v[layer][:, s : s + n]
        else:
            assert frames[frames.index(f) - 1].k is None  # only the whole range is handed on
            shape = (SPEC.n_kv_heads, n, SPEC.head_dim)
            k_got, v_got = (np.frombuffer(x, np.uint16).reshape(shape) for x in (f.k, f.v))
        assert np.array_equal(k_got.view(np.uint16), k.view(np.uint16))
        assert np.array_equal(v_got.view(np.uint16), v.view(np.uint16))


def test_a_head_range_header_round_trips_and_is_bounded():
    h = FrameHeader(Kind.LAYER, WireDtype.float16, 300, 8, 4, 64, 0, heads=(4, 4))
    back = FrameHeader.unpack(h.pack())
    assert back == h and back.describe() == "LAYER 300 tokens [8, 12) heads [4, 8)"
    with pytest.raises(ProtocolError, match="layer <= 65535"):
        FrameHeader(Kind.LAYER, WireDtype.float16, 70_000, 8, 4, 64, 0, heads=(4, 4)).pack()
    with pytest.raises(ProtocolError, match="1..255 heads, got"):
        FrameHeader(Kind.LAYER, WireDtype.float16, 3, 8, 4, 64, 0, heads=(0, 256)).pack()


def test_a_threaded_crc_mismatch_is_found_when_verified():
    data = frame_bytes(encode_hello(HELLO)) + raw_layer(0, 0, 4, crc=0x1234)
    crc = ThreadCrc()
    frames = FrameDecoder(SPEC, dest=Cache(SPEC, 16), crc=crc).feed(data)
    with pytest.raises(ProtocolError, match="CRC mismatch on LAYER 0 tokens"):
        frames[1].verify()
    crc.close()


@pytest.mark.parametrize("whole", [True, False], ids=["all-at-once", "byte-by-byte"])
def test_full_stream_fed_whole_or_one_byte_at_a_time(whole):
    data, layers = valid_stream(chunk=4)
    decoder = FrameDecoder(SPEC)
    if whole:
        frames = decoder.feed(data)
    else:
        frames = [f for i in range(len(data)) for f in decoder.feed(data[i : i + 1])]
    check_stream(frames, layers)
    assert decoder.done
    decoder.eof()


@pytest.mark.parametrize("dtype", [WireDtype.float32, WireDtype.float16, WireDtype.bfloat16])
def test_layer_payload_is_bit_exact(dtype):
    spec = StreamSpec(n_layers=1, n_kv_heads=4, head_dim=8, dtype=dtype, prompt_len=16)
    k, v = kv_arrays(spec, 16, seed=int(dtype))
    frame = decode_frame(frame_bytes(encode_layer(0, 0, 16, dtype, k, v)))
    uint = UINT[dtype.itemsize]
    got_k = np.frombuffer(frame.k, dtype=NP_DTYPE[dtype]).reshape(k.shape)
    got_v = np.frombuffer(frame.v, dtype=NP_DTYPE[dtype]).reshape(v.shape)
    assert np.array_equal(got_k.view(uint), k.view(uint))
    assert np.array_equal(got_v.view(uint), v.view(uint))
    assert frame.header.payload_len == spec.layer_payload_len(16)


def test_single_frames_decode_without_stream_state():
    assert decode_frame(frame_bytes(encode_hello(HELLO))).obj == HELLO
    assert decode_frame(frame_bytes(encode_end(END))).obj == END
    error = decode_frame(frame_bytes(encode_error("oom", "CUDA out of memory")))
    assert error.kind is Kind.ERROR
    assert error.obj == {"code": "oom", "message": "CUDA out of memory"}
    token = decode_frame(frame_bytes(encode_token(7, -1.5)))
    assert (token.token_id, token.logprob) == (7, -1.5)
    with pytest.raises(ProtocolError, match="frame size of HELLO: expected"):
        decode_frame(frame_bytes(encode_hello(HELLO)) + b"x")


def test_encode_layer_does_not_copy():
    k, v = kv_arrays(SPEC, 4, seed=1)
    header, k_part, v_part = encode_layer(0, 0, 4, WireDtype.float16, k, v)
    assert isinstance(k_part, memoryview) and isinstance(v_part, memoryview)
    assert k_part.obj is k and v_part.obj is v
    k[0, 0, 0] = np.float16(3.0)  # a write through the caller's array shows in the part
    assert bytes(k_part[:2]) == np.float16(3.0).tobytes()
    assert len(header) == HEADER_SIZE


def test_decoded_k_and_v_view_the_payload():
    data, _ = valid_stream()
    frame = FrameDecoder(SPEC).feed(data)[1]
    assert frame.piece == 0 and frame.last
    assert frame.k.obj is frame.payload and frame.v.obj is frame.payload
    assert len(frame.payload) == frame.header.payload_len


def test_encoders_reject_bad_input():
    k, v = kv_arrays(SPEC, 4, seed=1)
    with pytest.raises(ValueError, match="must each hold 4 whole positions"):
        encode_layer(0, 0, 4, WireDtype.float16, k, v.reshape(-1)[:7])
    with pytest.raises(ValueError, match="C-contiguous"):
        encode_layer(0, 0, 2, WireDtype.float16, k[:, ::2], v[:, ::2])
    with pytest.raises(ValueError, match="must each hold 3 whole positions"):
        encode_layer(0, 0, 3, WireDtype.float16, k, v)  # 4 positions labelled as 3
    with pytest.raises(ProtocolError, match="cannot pack"):
        encode_layer(2**32, 0, 4, WireDtype.float16, k, v)
    with pytest.raises(ProtocolError, match="payload_len <= 1048576"):
        encode_hello({"blob": "x" * MAX_JSON_PAYLOAD})
    with pytest.raises(ProtocolError, match="payload_len <= 67108864"):
        encode_end({"blob": "x" * (64 << 20)})
    with pytest.raises(ValueError):
        encode_end({"ratio": float("nan")})
    with pytest.raises(TypeError):
        encode_hello([1, 2])


def test_error_message_is_truncated_to_fit():
    frame = decode_frame(frame_bytes(encode_error("crash", "x" * (10 * MAX_JSON_PAYLOAD))))
    assert len(frame.obj["message"]) == MAX_ERROR_MESSAGE


@pytest.mark.parametrize("first", [False, True], ids=["after-layers", "first-frame"])
def test_error_frame_ends_the_stream(first):
    head = b"" if first else frame_bytes(encode_hello(HELLO)) + raw_layer(0, 0, 4)
    data = head + frame_bytes(encode_error("oom", "CUDA out of memory"))
    decoder = FrameDecoder(SPEC)
    frames = feed_pieces(decoder, data, seed=3)
    assert frames[-1].kind is Kind.ERROR and frames[-1].obj["code"] == "oom"
    assert decoder.finished and not decoder.done
    decoder.eof()  # a stream that ends with ERROR ended properly
    with pytest.raises(ProtocolError, match="data after ERROR: expected EOF, got 1 bytes"):
        decoder.feed(b"\0")


def _through_tokens() -> bytes:
    data, _ = valid_stream(chunk=4)
    return data[: -len(frame_bytes(encode_end(END)))]


HELLO_FRAME = frame_bytes(encode_hello(HELLO))
TP2 = ((0, 1), (1, 1))  # SPEC's 2 KV heads as two tensor-parallel workers hold them
TP_HELLO = frame_bytes(
    encode_hello(hello() | {"plan": hello()["plan"] | {"heads": [[0, 1], [1, 1]]}})
)


def raw_heads(layer: int, start: int, n: int, heads: tuple[int, int], **fields: int) -> bytes:
    """A head range's LAYER frame built by hand (flags HEADS, the range in the layer field)."""
    payload = bytes(range(256))[: SPEC.layer_payload_len(n, heads[1])]
    fields.setdefault("dtype", SPEC.dtype)
    field = layer | heads[0] << 16 | heads[1] << 24
    return raw(Kind.LAYER, payload, flags=0x01, layer=field, token_start=start, n_tokens=n,
               **fields)  # fmt: skip


CYCLE = b"".join(raw_layer(layer, 0, 4) for layer in range(3))
BAD_STREAMS = {
    "bad magic": (raw(Kind.HELLO, magic=b"EXOX"), "bad magic: expected b'EXOS', got b'EXOX'"),
    "bad version": (raw(Kind.HELLO, version=1), "protocol version: expected 2, got 1"),
    "unknown kind": (raw(9), "unknown frame kind: expected 1..5, got 9"),
    "unknown dtype": (raw(Kind.HELLO, dtype=7), "unknown dtype code: expected 0..3, got 7"),
    "unknown flags": (raw(Kind.HELLO, flags=0x80), "unknown flags: expected 0 or 0x01, got 0x80"),
    "head range on HELLO": (raw(Kind.HELLO, flags=0x01), "HELLO: expected a head range only on"),
    "layer fields on HELLO": (raw(Kind.HELLO, layer=3), "HELLO: expected dtype, layer"),
    "a head range of no heads": (
        raw(Kind.LAYER, b"\0" * 8, dtype=2, flags=0x01, n_tokens=1),
        "heads [0, 0): expected first head 0..255, 1..255 heads, got (0, 0)",
    ),
    "the whole layer where a head range is due": (
        TP_HELLO + raw_layer(0, 0, 4),
        "wrong head range on LAYER 0 tokens [0, 4): expected heads [0, 1], got all heads",
    ),
    "a head range where the whole layer is due": (
        HELLO_FRAME + raw_heads(0, 0, 4, (0, 1)),
        "wrong head range on LAYER 0 tokens [0, 4) heads [0, 1): expected all heads (flags 0), "
        "got [0, 1]",
    ),
    "head ranges out of order": (
        TP_HELLO + raw_heads(0, 0, 4, (1, 1)),
        "on LAYER 0 tokens [0, 4) heads [1, 2): expected heads [0, 1], got [1, 1]",
    ),
    "the next token range before the last head range": (
        TP_HELLO + raw_heads(0, 0, 4, (0, 1)) + raw_heads(1, 0, 4, (0, 1)),
        "out-of-order layer after LAYER 0 tokens [0, 4) heads [0, 1): expected LAYER 0, got "
        "LAYER 1",
    ),
    "a head range's payload sized for the whole layer": (
        TP_HELLO + raw_heads(0, 0, 4, (0, 1), payload_len=SPEC.layer_payload_len(4)),
        "heads [0, 1): expected 64 (2 x 1 heads x 4 tokens x 4 dims x float16), got 128",
    ),
    "plan heads that miss a head": (
        frame_bytes(encode_hello(hello() | {"plan": hello()["plan"] | {"heads": [[0, 1]]}})),
        "HELLO plan heads: expected absent, or >= 2 [first, count] ranges covering the 2 KV",
    ),
    "plan heads out of order": (
        frame_bytes(
            encode_hello(hello() | {"plan": hello()["plan"] | {"heads": [[1, 1], [0, 1]]}})
        ),
        "covering the 2 KV heads in order, got [[1, 1], [0, 1]]",
    ),
    "LAYER without dtype": (raw_layer(0, 0, 4, dtype=0), "expected a tensor dtype"),
    "LAYER n_tokens 0": (
        raw(Kind.LAYER, b"", dtype=2),
        "state after 0 tokens: expected a payload, got 0",
    ),
    "a state where KV is due": (
        HELLO_FRAME + raw(Kind.LAYER, b"\0" * 8, dtype=2),
        "expected [0, 4), got LAYER 0 state after 0 tokens",
    ),
    "LAYER before HELLO": (raw_layer(0, 0, 4), "after nothing: expected HELLO, got LAYER 0"),
    "TOKEN before HELLO": (frame_bytes(encode_token(1, 0.0)), "expected HELLO, got TOKEN"),
    "two HELLOs": (HELLO_FRAME * 2, "(HELLO twice): expected LAYER 0 tokens [0, 4), got HELLO"),
    "HELLO without a plan": (
        frame_bytes(encode_hello({"spec": {}})),
        "HELLO plan: expected a JSON object, got NoneType",
    ),
    "out-of-order layer": (
        HELLO_FRAME + raw_layer(1, 0, 4),
        "out-of-order layer after HELLO: expected LAYER 0, got LAYER 1",
    ),
    "skipped layer": (
        HELLO_FRAME + raw_layer(0, 0, 4) + raw_layer(2, 0, 4),
        "expected LAYER 1, got LAYER 2",
    ),
    "layer out of range": (
        HELLO_FRAME + CYCLE[:-160] + raw_layer(3, 0, 4),
        "expected LAYER 2, got LAYER 3",
    ),
    "wrong token_start in a chunk": (
        HELLO_FRAME + raw_layer(0, 0, 4) + raw_layer(1, 2, 4),
        "wrong token range on LAYER 1 after LAYER 0 tokens [0, 4): expected [0, 4), got [2, 6)",
    ),
    "next chunk restarts at 0": (
        HELLO_FRAME + CYCLE + raw_layer(0, 0, 4),
        "wrong token range on LAYER 0 after LAYER 2 tokens [0, 4): expected [4, 8), got [0, 4)",
    ),
    "chunk n_tokens mismatch": (
        HELLO_FRAME + raw_layer(0, 0, 4) + raw_layer(1, 0, 3),
        "wrong token range on LAYER 1 after LAYER 0 tokens [0, 4): expected [0, 4), got [0, 3)",
    ),
    "past the prompt": (
        HELLO_FRAME + raw_layer(0, 0, 11),
        "wrong token range on LAYER 0 after HELLO: expected [0, 4), got [0, 11)",
    ),
    "a frame bigger than the plan's": (
        frame_bytes(encode_hello(hello(chunk=10, frame_tokens=3))) + raw_layer(0, 0, 4),
        "wrong token range on LAYER 0 after HELLO: expected [0, 3), got [0, 4)",
    ),
    "wrong dtype": (
        HELLO_FRAME + raw_layer(0, 0, 4, dtype=WireDtype.float32, payload_len=256),
        "wrong dtype on LAYER 0: expected float16, got float32",
    ),
    "LAYER payload_len too big": (
        HELLO_FRAME + raw_layer(0, 0, 4, payload_len=SPEC.layer_payload_len(4) * 2),
        "wrong payload_len on LAYER 0 tokens [0, 4): expected 128 (2 x 2 heads x 4 tokens",
    ),
    "JSON over the cap": (
        raw(Kind.HELLO, payload_len=MAX_JSON_PAYLOAD + 1),
        f"HELLO: expected payload_len <= {MAX_JSON_PAYLOAD}, got {MAX_JSON_PAYLOAD + 1}",
    ),
    "LAYER CRC": (
        HELLO_FRAME + raw_layer(0, 0, 4, crc=0x1234),
        "CRC mismatch on LAYER 0 tokens [0, 4): expected 0x00001234, computed 0x",
    ),
    "HELLO CRC": (raw(Kind.HELLO, b"{}", crc=1), "CRC mismatch on HELLO: expected 0x00000001"),
    "HELLO not UTF-8": (raw(Kind.HELLO, b'{"a": "\xff"}'), "HELLO: expected a UTF-8 JSON"),
    "HELLO not JSON": (raw(Kind.HELLO, b"{nope"), "HELLO: expected a UTF-8 JSON payload"),
    "HELLO not an object": (raw(Kind.HELLO, b"[1, 2]"), "expected a JSON object, got list"),
    "deeply nested JSON": (raw(Kind.HELLO, b"[" * 200_000), "HELLO: expected a UTF-8 JSON"),
    "ERROR without code": (
        raw(Kind.ERROR, json.dumps({"message": "x"}).encode()),
        "ERROR payload: expected string 'code' and 'message', got ['message']",
    ),
    "TOKEN before all layers": (
        HELLO_FRAME + CYCLE + frame_bytes(encode_token(1, 0.0)),
        "expected LAYER 0 tokens [4, 8), got TOKEN",
    ),
    "TOKEN mid-chunk": (
        HELLO_FRAME + raw_layer(0, 0, 4) + frame_bytes(encode_token(1, 0.0)),
        "expected LAYER 1 tokens [0, 4), got TOKEN",
    ),
    "TOKEN payload_len": (raw(Kind.TOKEN, b"\0" * 9), "TOKEN: expected payload_len 8, got 9"),
    "END before TOKEN": (
        _through_tokens()[: -len(frame_bytes(encode_token(128_001, -0.25)))]
        + frame_bytes(encode_end(END)),
        "expected TOKEN, got END",
    ),
    "LAYER after all layers": (
        _through_tokens()[: -len(frame_bytes(encode_token(128_001, -0.25)))] + raw_layer(0, 10, 1),
        "expected TOKEN, got LAYER 0 tokens [10, 11)",
    ),
    "two TOKENs": (
        _through_tokens() + frame_bytes(encode_token(2, 0.0)),
        "expected END, got TOKEN",
    ),
    "data after END": (valid_stream()[0] + b"\0\0\0", "data after END: expected EOF, got"),
}


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "bytewise"])
@pytest.mark.parametrize("case", BAD_STREAMS, ids=list(BAD_STREAMS))
def test_bad_stream_raises_protocol_error(case, whole):
    data, message = BAD_STREAMS[case]
    decoder = FrameDecoder(SPEC)
    with pytest.raises(ProtocolError) as info:
        if whole:
            decoder.feed(data)
        else:
            for i in range(len(data)):
                decoder.feed(data[i : i + 1])
    assert message in str(info.value)
    assert isinstance(info.value, ExoSplitError)
    with pytest.raises(ProtocolError, match="stream already failed"):
        decoder.feed(b"more")


def test_header_is_rejected_before_its_payload_arrives():
    decoder = FrameDecoder(SPEC)
    decoder.feed(HELLO_FRAME)
    header = raw_layer(0, 0, 4, dtype=WireDtype.float32)[:HEADER_SIZE]
    with pytest.raises(ProtocolError, match="wrong dtype"):
        decoder.feed(header)  # no payload byte sent


@pytest.mark.parametrize(
    "data",
    [
        HELLO_FRAME + raw(Kind.LAYER, layer=0, n_tokens=4, dtype=2, payload_len=100 * 2**30),
        raw(Kind.LAYER, layer=0, n_tokens=4, dtype=2, payload_len=100 * 2**30),
        raw(Kind.HELLO, payload_len=100 * 2**30),
        raw(Kind.END, payload_len=2**64 - 1),
    ],
    ids=["LAYER after HELLO", "LAYER first", "HELLO", "END u64 max"],
)
def test_100_gb_claim_is_rejected_without_allocating(data):
    decoder = FrameDecoder(SPEC)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="expected"):
            decoder.feed(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


EOF_CASES = {
    "empty": (b"", "stream ended after nothing: expected HELLO, got EOF"),
    "mid-header": (HELLO_FRAME + raw_layer(0, 0, 4)[:10], "mid-header: expected 32 bytes, got 10"),
    "mid-frame": (
        HELLO_FRAME + raw_layer(0, 0, 4)[: HEADER_SIZE + 50],
        "mid-frame in LAYER 0 tokens [0, 4): expected 128 payload bytes, got 50",
    ),
    "mid-chunk": (
        HELLO_FRAME + CYCLE + raw_layer(0, 4, 4) + raw_layer(1, 4, 4),
        "ended after LAYER 1 tokens [4, 8): expected LAYER 2 tokens [4, 8) "
        "(5 of 9 LAYER frames received), got EOF",
    ),
    "before TOKEN": (
        _through_tokens()[: -len(frame_bytes(encode_token(128_001, -0.25)))],
        "stream ended after LAYER 2 tokens [8, 10): expected TOKEN, got EOF",
    ),
    "before END": (_through_tokens(), "stream ended after TOKEN: expected END, got EOF"),
}


@pytest.mark.parametrize("case", EOF_CASES, ids=list(EOF_CASES))
def test_truncated_stream_fails_at_eof(case):
    data, message = EOF_CASES[case]
    decoder = FrameDecoder(SPEC)
    decoder.feed(data)
    with pytest.raises(ProtocolError) as info:
        decoder.eof()
    assert message in str(info.value)


# Fuzzing: whatever arrives, the decoder parses it or raises ProtocolError, nothing else.
SMALL = StreamSpec(n_layers=2, n_kv_heads=1, head_dim=2, dtype=WireDtype.float16, prompt_len=3)
SMALL_STREAM = valid_stream(SMALL, chunk=2)[0]
SMALL_HELLO = hello(2, 100, SMALL)


def parse_or_protocol_error(data: bytes, cuts: list[int]) -> None:
    decoder, last = FrameDecoder(SMALL), 0
    try:
        for cut in sorted({c % (len(data) + 1) for c in cuts}) + [len(data)]:
            decoder.feed(data[last:cut])
            last = cut
        decoder.eof()
    except ProtocolError:
        pass


@FUZZ
@given(
    prefix=st.sampled_from([b"", MAGIC, MAGIC + bytes([1]), SMALL_STREAM[:HEADER_SIZE]]),
    data=st.binary(max_size=200),
    cuts=st.lists(st.integers(0, 400), max_size=8),
)
def test_fuzz_arbitrary_bytes(prefix, data, cuts):
    parse_or_protocol_error(prefix + data, cuts)


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.sampled_from("fid"), st.integers(0, 10_000), st.integers(0, 255)),
        min_size=1,
        max_size=6,
    ),
    cuts=st.lists(st.integers(0, 10_000), max_size=8),
)
def test_fuzz_mutated_valid_stream(edits, cuts):
    data = bytearray(SMALL_STREAM)
    for op, pos, byte in edits:
        pos %= len(data) + 1
        if op == "f" and pos < len(data):
            data[pos] ^= byte or 1
        elif op == "i":
            data.insert(pos, byte)
        elif pos < len(data):
            del data[pos]
    parse_or_protocol_error(bytes(data), cuts)


frame_fields = st.tuples(
    st.integers(0, 6),  # kind, valid or not
    st.integers(0, 4),  # dtype code
    st.integers(0, 3),  # layer
    st.integers(0, 4),  # token_start
    st.integers(0, 4),  # n_tokens
    st.binary(max_size=40),
    st.booleans(),  # right CRC
)


@FUZZ
@given(frames=st.lists(frame_fields, max_size=10), cuts=st.lists(st.integers(0, 500), max_size=6))
def test_fuzz_well_formed_headers_in_any_order(frames, cuts):
    data = frame_bytes(encode_hello(SMALL_HELLO))
    for kind, dtype, layer, start, n, payload, crc_ok in frames:
        crc = zlib.crc32(payload) ^ (0 if crc_ok else 1)
        fields = dict(dtype=dtype, layer=layer, token_start=start, n_tokens=n, crc=crc)
        data += raw(kind, payload, **fields)
    parse_or_protocol_error(data, cuts)
