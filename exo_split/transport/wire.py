"""Frame format of the KV stream, prefill node -> decode node, on the data connection.

Sans-IO: bytes, ints and JSON only; no ML framework, no network library. A frame is a 32-byte
little-endian header (``HEADER``) followed by ``payload_len`` bytes of payload:

    offset size field        meaning
    0      4    magic        b"EXOS"
    4      1    version      PROTOCOL_VERSION (2)
    5      1    kind         1 HELLO, 2 LAYER, 3 TOKEN, 4 END, 5 ERROR
    6      1    dtype        0 none (non-LAYER), 1 float32, 2 float16, 3 bfloat16
    7      1    flags        0, or HEADS (0x01) on a LAYER frame that carries a head range
    8      4    layer        u32 layer index (LAYER), else 0; with HEADS: u16 layer index,
                                 u8 first head, u8 number of heads
    12     4    token_start  u32 first prompt position the KV covers (LAYER), else 0
    16     4    n_tokens     u32 number of positions (LAYER: >= 1; 0: a recurrent layer's
                                 state, token_start then the prompt length), else 0
    20     8    payload_len  u64 bytes of payload after the header
    28     4    crc32        u32 CRC-32 (zlib's) of the payload

Payloads: HELLO, END and ERROR carry one UTF-8 JSON object (ERROR: string "code" and
"message"). LAYER carries K then V, each [n_kv_heads, n_tokens, head_dim] row-major in the
frame's dtype (bfloat16 as raw 16-bit words; with HEADS, the range's heads only, as a
tensor-parallel worker holds them); a state frame (n_tokens 0) carries the layer's state
arrays as layers.py describes them, in order (the KV dtype's, then float32 ones). TOKEN is
"<If": the first generated token id and its logprob.

Stream: HELLO, which announces the `Plan`; then exactly the Plan's LAYER frames (chunk-major,
then layer, then token ranges of at most `frame_tokens`, then the plan's head ranges); TOKEN;
END, whose per-piece stamps are columns of integer microseconds. An ERROR frame may come
instead of any frame and ends the stream. decoder.FrameDecoder enforces all of this;
docs/protocol.md is the long form.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from exo_split import PROTOCOL_VERSION
from exo_split.errors import ProtocolError
from exo_split.kv import window_floor
from exo_split.transport.heads import MAX_RANGE_HEADS, parse_ranges

try:  # the same CRC-32 as zlib's, 3-5x faster, and it releases the GIL
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a core dependency; zlib gives equal values
    from zlib import crc32

MAGIC = b"EXOS"
HEADS = 0x01  # flags: this LAYER frame carries a head range (FrameHeader.heads)
HEADER = struct.Struct("<4sBBBBIIIQI")
HEADER_SIZE = HEADER.size  # 32
MAX_JSON_PAYLOAD = 1 << 20  # HELLO and ERROR; END's cap grows with the plan (end_cap)
END_BYTES_PER_PIECE = 40  # 3 integer-microsecond stamps a piece, with room to spare
MAX_END_PAYLOAD = 64 << 20  # END's cap without a plan (decode_frame)
DEFAULT_MAX_FRAME_BYTES = 16 << 20
TOKEN_PAYLOAD = struct.Struct("<If")
MAX_ERROR_MESSAGE = 16_384  # characters: an ERROR frame must always fit under the JSON cap
END_STAMPS = ("compute_done", "send_start", "sent")

Buffer = bytes | bytearray | memoryview


def _require(ok: bool, what: str, expected: object, got: object) -> None:
    """The one shape of every check here: a ProtocolError saying what was expected and what came."""
    if not ok:
        raise ProtocolError(f"{what}: expected {expected}, got {got}")


class Kind(IntEnum):
    HELLO = 1
    LAYER = 2
    TOKEN = 3
    END = 4
    ERROR = 5


class WireDtype(IntEnum):
    """Element type of a LAYER payload. Member names are the usual dtype names."""

    none = 0
    float32 = 1
    float16 = 2
    bfloat16 = 3

    @property
    def itemsize(self) -> int:
        return (0, 4, 2, 2)[self]

    @classmethod
    def from_name(cls, name: str) -> WireDtype:
        """``"bfloat16"`` -> ``WireDtype.bfloat16``; also takes ``str(torch.bfloat16)``-style names."""
        dtype = cls.__members__.get(name.rsplit(".", 1)[-1], cls.none)
        _require(dtype is not cls.none, "unknown dtype", "float32, float16 or bfloat16", repr(name))
        return dtype


@dataclass(frozen=True)
class FrameHeader:
    kind: Kind
    dtype: WireDtype = WireDtype.none
    layer: int = 0
    token_start: int = 0
    n_tokens: int = 0
    payload_len: int = 0
    crc32: int = 0
    heads: tuple[int, int] | None = None  # (first head, number of heads); None: all of them

    def pack(self) -> bytes:
        self.check()
        layer, flags = self.layer, 0
        if self.heads is not None:  # the layer field: u16 layer, u8 first head, u8 heads
            layer, flags = self.layer | self.heads[0] << 16 | self.heads[1] << 24, HEADS
        fields = (layer, self.token_start, self.n_tokens, self.payload_len, self.crc32)
        try:
            return HEADER.pack(MAGIC, PROTOCOL_VERSION, self.kind, self.dtype, flags, *fields)
        except struct.error as exc:
            raise ProtocolError(f"cannot pack the header of {self.describe()}: {exc}") from exc

    @classmethod
    def unpack(cls, buf: Buffer) -> FrameHeader:
        """Parse and check one header (the first HEADER_SIZE bytes of ``buf``)."""
        _require(len(buf) >= HEADER_SIZE, "short header", f"{HEADER_SIZE} bytes", len(buf))
        magic, version, kind, dtype, flags, *rest = HEADER.unpack_from(buf)
        _require(magic == MAGIC, "bad magic", repr(MAGIC), repr(magic))
        _require(
            version == PROTOCOL_VERSION, "unsupported protocol version", PROTOCOL_VERSION, version
        )
        _require(kind in set(Kind), "unknown frame kind", f"1..{len(Kind)}", kind)
        _require(dtype in set(WireDtype), "unknown dtype code", f"0..{len(WireDtype) - 1}", dtype)
        _require(flags in (0, HEADS), "unknown flags", f"0 or 0x{HEADS:02x}", f"0x{flags:02x}")
        layer, heads = rest[0], None
        if flags == HEADS:
            layer, heads = layer & 0xFFFF, (layer >> 16 & 0xFF, layer >> 24)
        header = cls(Kind(kind), WireDtype(dtype), layer, *rest[1:], heads=heads)
        header.check()
        return header

    def check(self) -> None:
        """The rules that need no stream state: which fields a kind sets, payload sizes."""
        name, size = self.describe(), self.payload_len
        if self.heads is not None:
            first, count = self.heads
            ok = self.kind is Kind.LAYER and self.n_tokens >= 1 and self.layer <= 0xFFFF
            _require(ok, name, "a head range only on a LAYER frame of KV, layer <= 65535",
                     "flags HEADS")  # fmt: skip
            ok = 0 <= first <= MAX_RANGE_HEADS and 1 <= count <= MAX_RANGE_HEADS
            _require(ok, name, f"first head 0..{MAX_RANGE_HEADS}, 1..{MAX_RANGE_HEADS} heads",
                     self.heads)  # fmt: skip
        if self.kind is Kind.LAYER:
            _require(self.dtype is not WireDtype.none, name, "a tensor dtype", "dtype none")
            if self.n_tokens == 0:  # a recurrent layer's state: its size is the stream's to check
                _require(size > 0, name, "a payload", size)
                return
            unit = self.n_tokens * self.dtype.itemsize  # whole elements per position (K and V
            # of any widths: a latent layer's differ); the stream checks the exact size
            ok = size > 0 and size % unit == 0
            _require(ok, name, f"payload_len a positive multiple of {unit}", size)
            return
        zeros = (self.dtype, self.layer, self.token_start, self.n_tokens) == (0, 0, 0, 0)
        _require(zeros, name, "dtype, layer, token_start, n_tokens all 0", self)
        if self.kind is Kind.TOKEN:
            _require(size == TOKEN_PAYLOAD.size, name, f"payload_len {TOKEN_PAYLOAD.size}", size)
        cap = MAX_END_PAYLOAD if self.kind is Kind.END else MAX_JSON_PAYLOAD
        _require(size <= cap, name, f"payload_len <= {cap}", size)

    def describe(self) -> str:
        if self.kind is Kind.LAYER and self.n_tokens == 0:
            return f"LAYER {self.layer} state after {self.token_start} tokens"
        if self.kind is Kind.LAYER:
            end = self.token_start + self.n_tokens
            heads = "" if self.heads is None else f" heads {_heads(self.heads)}"
            return f"LAYER {self.layer} tokens [{self.token_start}, {end}){heads}"
        return self.kind.name


def _heads(heads: tuple[int, int]) -> str:
    return f"[{heads[0]}, {heads[0] + heads[1]})"


@dataclass(frozen=True)
class StreamSpec:
    """What the receiver expects before HELLO: the model's KV shape and dtype, the prompt
    length, the largest LAYER payload it accepts, and `start`: the positions it already holds
    (prefix reuse), so the stream covers [start, prompt_len)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: WireDtype
    prompt_len: int
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    start: int = 0
    # Per layer, the prompt's last positions it keeps (a sliding window), None: all of them;
    # empty: every layer keeps all. The receiver asks for it (PrefillRequest.keep).
    keep: tuple[int | None, ...] = ()
    # Per layer, the bytes of its state frame (layers.state_bytes; 0: a layer of K and V),
    # empty when no layer is recurrent.
    state_bytes: tuple[int, ...] = ()
    # V's width per head where it is not head_dim (a latent layer's roped key), else None.
    v_dim: int | None = None

    def __post_init__(self) -> None:
        sizes = (self.n_layers, self.n_kv_heads, self.head_dim, self.prompt_len, self.v_width)
        if min(sizes) < 1 or self.dtype is WireDtype.none or self.max_frame_bytes < 1:
            raise ValueError(f"invalid {self}: expected sizes >= 1 and a tensor dtype")
        if not 0 <= self.start < self.prompt_len:
            raise ValueError(f"invalid {self}: expected 0 <= start < prompt_len")
        if self.keep and (
            len(self.keep) != self.n_layers or not all(_keep_ok(k) for k in self.keep)
        ):
            raise ValueError(f"invalid {self}: keep must name every layer, each None or >= 1")
        if self.state_bytes and (
            len(self.state_bytes) != self.n_layers or min(self.state_bytes) < 0
        ):
            raise ValueError(f"invalid {self}: state_bytes must name every layer, each >= 0")

    @property
    def states(self) -> tuple[int, ...]:
        """The recurrent layers: one state frame each, in the last chunk."""
        return tuple(i for i, b in enumerate(self.state_bytes) if b)

    @property
    def v_width(self) -> int:
        return self.head_dim if self.v_dim is None else self.v_dim

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one position of one layer."""
        return self.n_kv_heads * (self.head_dim + self.v_width) * self.dtype.itemsize

    def k_payload_len(self, n_tokens: int, heads: int | None = None) -> int:
        """The first part of a LAYER payload of `n_tokens` positions (of `heads` heads; None:
        all): K's bytes (V's follow)."""
        return n_tokens * (heads or self.n_kv_heads) * self.head_dim * self.dtype.itemsize

    def layer_payload_len(self, n_tokens: int, heads: int | None = None) -> int:
        return n_tokens * self.bytes_per_token * (heads or self.n_kv_heads) // self.n_kv_heads

    def frame_tokens(self, max_frame_bytes: int | None = None) -> int:
        """The most positions whose K and V fit `max_frame_bytes` (at least 1)."""
        limit = min(max_frame_bytes or self.max_frame_bytes, self.max_frame_bytes)
        return max(1, limit // self.bytes_per_token)


@dataclass(frozen=True)
class Plan:
    """The exact sequence of LAYER frames of one stream, announced in HELLO.

    The stream covers positions [start, start + sum(chunks)) in `chunks` (sizes, in order);
    for each chunk, layers 0..L-1; each (chunk, layer) *piece* travels as consecutive token
    ranges of at most `frame_tokens` positions, each range as one frame per head range of
    `heads` (a tensor-parallel prefill: each worker holds a range of KV heads; empty: one
    frame of all heads). The receiver derives from it the one header it expects next. (With
    prefix reuse the first chunk may be KV the prefill node had cached, and the positions
    before `start` are the decode node's own.)
    """

    chunks: tuple[int, ...]
    frame_tokens: int
    n_layers: int
    start: int = 0
    keep: tuple[int | None, ...] = ()  # StreamSpec.keep: a sliding layer's pieces start later
    states: tuple[int, ...] = ()  # StreamSpec.states: their pieces are one state frame each
    heads: tuple[tuple[int, int], ...] = ()  # (first head, heads) of each range, in order

    @property
    def prompt_len(self) -> int:
        return self.start + sum(self.chunks)

    @property
    def n_pieces(self) -> int:
        return sum(1 for _ in self.pieces())

    @property
    def n_frames(self) -> int:
        return sum(1 for _ in self.wire_frames())

    def floor(self, layer: int) -> int:
        """The first position `layer` sends (its window's, for a layer that keeps a window)."""
        return window_floor(self.keep, layer, self.prompt_len, self.start)

    def pieces(self) -> Iterator[tuple[int, int, int]]:
        """(layer, token_start, n_tokens) of every piece, in stream order: each chunk's part
        at or after the layer's floor (a chunk wholly before a window sends nothing there); a
        recurrent layer's state, (layer, prompt_len, 0), in the last chunk only."""
        floors = [self.floor(layer) for layer in range(self.n_layers)]
        start, n, states = self.start, self.prompt_len, set(self.states)
        for size in self.chunks:
            for layer in range(self.n_layers):
                if layer in states:
                    if start + size == n:
                        yield layer, n, 0
                    continue
                lo = max(start, floors[layer])
                if lo < start + size:
                    yield layer, lo, start + size - lo
            start += size

    def frames(self) -> Iterator[tuple[int, int, int, int]]:
        """(piece index, layer, token_start, n_tokens) of every LAYER frame, in stream order."""
        for i, (layer, start, size) in enumerate(self.pieces()):
            if size == 0:  # a state: one frame
                yield i, layer, start, 0
            for s, n in split_range(start, size, self.frame_tokens):
                yield i, layer, s, n

    def wire_frames(self) -> Iterator[tuple[int, int, int, int, tuple[int, int] | None]]:
        """`frames()`, each KV frame as one frame per head range: (piece index, layer,
        token_start, n_tokens, heads: (first head, heads), None for all of them)."""
        for i, layer, s, n in self.frames():
            for heads in self.heads if n else ():
                yield i, layer, s, n, heads
            if not n or not self.heads:
                yield i, layer, s, n, None

    def end_cap(self) -> int:
        """The largest END payload this stream may carry (its per-piece stamps)."""
        return MAX_JSON_PAYLOAD + END_BYTES_PER_PIECE * self.n_pieces

    def to_json(self) -> dict[str, Any]:
        runs: list[list[int]] = []  # [size, count]: 32K tokens in chunks of 128 is [[128, 256]]
        for size in self.chunks:
            if runs and runs[-1][0] == size:
                runs[-1][1] += 1
            else:
                runs.append([size, 1])
        out: dict[str, Any] = {"chunks": runs, "frame_tokens": self.frame_tokens}
        if self.keep:
            out["keep"] = list(self.keep)
        if self.states:
            out["states"] = list(self.states)
        if self.heads:
            out["heads"] = [list(h) for h in self.heads]
        return out | {"start": self.start} if self.start else out

    @classmethod
    def from_json(cls, obj: Any, spec: StreamSpec) -> Plan:
        """The plan a HELLO announces, checked against what the receiver expects."""
        _require(isinstance(obj, dict), "HELLO plan", "a JSON object", type(obj).__name__)
        runs, frame_tokens = obj.get("chunks"), obj.get("frame_tokens")
        ok = isinstance(runs, list) and 1 <= len(runs) <= spec.prompt_len
        ok = ok and all(
            isinstance(r, list) and len(r) == 2 and all(_is_int(x) and x >= 1 for x in r)
            for r in runs
        )
        _require(ok, "HELLO plan chunks", "a list of [size, count] pairs of integers >= 1", runs)
        start = obj.get("start", 0)
        _require(start == spec.start, "HELLO plan start", spec.start, start)
        total = sum(size * count for size, count in runs)
        want = spec.prompt_len - spec.start
        _require(total == want, "HELLO plan chunks", f"{want} tokens", total)
        most = spec.frame_tokens()
        ok = _is_int(frame_tokens) and 1 <= frame_tokens <= most
        _require(
            ok, "HELLO plan frame_tokens", f"1..{most} ({spec.max_frame_bytes} B)", frame_tokens
        )
        keep = obj.get("keep", [])
        ok = isinstance(keep, list) and tuple(keep) == spec.keep
        _require(ok, "HELLO plan keep", list(spec.keep) or "absent (every position)", keep)
        states = obj.get("states", [])
        ok = isinstance(states, list) and tuple(states) == spec.states
        _require(ok, "HELLO plan states", list(spec.states) or "absent (no recurrent layer)",
                 states)  # fmt: skip
        heads = parse_ranges(obj.get("heads", []), spec.n_kv_heads, spec.n_layers)
        chunks = tuple(size for size, count in runs for _ in range(count))
        return cls(chunks, frame_tokens, spec.n_layers, start, spec.keep, spec.states, heads)


def split_range(start: int, n: int, most: int) -> Iterator[tuple[int, int]]:
    """[start, start + n) as consecutive (start, n) ranges of at most `most` positions."""
    for s in range(start, start + n, most):
        yield s, min(most, start + n - s)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _keep_ok(k: object) -> bool:
    return k is None or (_is_int(k) and k >= 1)


# ---- encoders --------------------------------------------------------------------------------


def encode_hello(obj: dict[str, Any]) -> list[Buffer]:
    return _encode_json(Kind.HELLO, obj)


def encode_end(obj: dict[str, Any]) -> list[Buffer]:
    return _encode_json(Kind.END, obj)


def encode_error(code: str, message: str) -> list[Buffer]:
    return _encode_json(Kind.ERROR, {"code": code, "message": message[:MAX_ERROR_MESSAGE]})


def encode_token(token_id: int, logprob: float) -> list[Buffer]:
    payload = TOKEN_PAYLOAD.pack(token_id, logprob)
    return [FrameHeader(Kind.TOKEN, payload_len=8, crc32=crc32(payload)).pack(), payload]


def encode_layer(
    layer: int, token_start: int, n_tokens: int, dtype: WireDtype, k: Buffer, v: Buffer
) -> list[Buffer]:
    """Header, then byte views of K and V ([n_kv_heads, n_tokens, head_dim], C-contiguous;
    a latent layer's V is narrower). The receiver checks the total against its StreamSpec.

    The views are not copies: keep ``k`` and ``v`` alive and unchanged until they are written.
    """
    k_bytes, v_bytes = _byte_view(k, "k"), _byte_view(v, "v")
    if n_tokens > 0 and (k_bytes.nbytes % n_tokens or v_bytes.nbytes % n_tokens):
        raise ValueError(f"K ({k_bytes.nbytes} bytes) and V ({v_bytes.nbytes} bytes) must each "
                         f"hold {n_tokens} whole positions")  # fmt: skip
    return layer_frame(layer, token_start, n_tokens, dtype, [k_bytes, v_bytes])


def layer_frame(
    layer: int,
    token_start: int,
    n_tokens: int,
    dtype: WireDtype,
    blocks: Sequence[memoryview],
    crc: int | None = None,
    heads: tuple[int, int] | None = None,
) -> list[Buffer]:
    """Header, then `blocks` (byte views whose concatenation is the payload: K's heads, then
    V's; `heads`: those of this head range only). `crc` may be given when it was computed
    elsewhere (a worker thread)."""
    size = sum(b.nbytes for b in blocks)
    if crc is None:
        crc = 0
        for b in blocks:
            crc = crc32(b, crc)
    header = FrameHeader(Kind.LAYER, WireDtype(dtype), layer, token_start, n_tokens, size, crc,
                         heads)  # fmt: skip
    return [header.pack(), *blocks]


def frame_bytes(parts: Iterable[Buffer]) -> bytes:
    """Frames as contiguous bytes: for tests and small frames."""
    return b"".join(parts)


def _byte_view(buf: Buffer, name: str) -> memoryview:
    try:
        return memoryview(buf).cast("B")
    except TypeError as exc:
        raise ValueError(f"{name}: expected a C-contiguous buffer, got {exc}") from exc


def _encode_json(kind: Kind, obj: dict[str, Any]) -> list[Buffer]:
    if not isinstance(obj, dict):
        raise TypeError(f"{kind.name} payload: expected a dict, got {type(obj).__name__}")
    payload = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    header = FrameHeader(kind, payload_len=len(payload), crc32=crc32(payload))
    return [header.pack(), payload]


def parse_json(kind: Kind, payload: Buffer) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(payload).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError too
        raise ProtocolError(f"{kind.name}: expected a UTF-8 JSON payload, got {exc}") from exc
    _require(isinstance(obj, dict), kind.name, "a JSON object", type(obj).__name__)
    if kind is Kind.ERROR:
        ok = isinstance(obj.get("code"), str) and isinstance(obj.get("message"), str)
        _require(ok, "ERROR payload", "string 'code' and 'message'", sorted(obj))
    return obj


def check_crc(header: FrameHeader, computed: int) -> None:
    if computed != header.crc32:
        raise ProtocolError(
            f"CRC mismatch on {header.describe()}: "
            f"expected 0x{header.crc32:08x}, computed 0x{computed:08x}"
        )
