"""Frame format of the KV stream: the body of ``POST /v1/prefill``, prefill node -> decode node.

Sans-IO: buffers in, frames out (and back). No ML framework, no network library. A frame is a
32-byte little-endian header (``HEADER``) followed by ``payload_len`` bytes of payload:

    offset size field        meaning
    0      4    magic        b"EXOS"
    4      1    version      PROTOCOL_VERSION (1)
    5      1    kind         1 HELLO, 2 LAYER, 3 TOKEN, 4 END, 5 ERROR
    6      1    dtype        0 none (non-LAYER), 1 float32, 2 float16, 3 bfloat16
    7      1    flags        reserved, must be 0
    8      4    layer        u32 layer index (LAYER), else 0
    12     4    token_start  u32 first prompt position the KV covers (LAYER), else 0
    16     4    n_tokens     u32 number of positions (LAYER, >= 1), else 0
    20     8    payload_len  u64 bytes of payload after the header
    28     4    crc32        u32 zlib.crc32 of the payload

Payloads: HELLO, END and ERROR carry one UTF-8 JSON object of at most MAX_JSON_PAYLOAD bytes
(ERROR: string "code" and "message"). LAYER carries K then V, each [n_kv_heads, n_tokens,
head_dim] row-major in the frame's dtype (bfloat16 as raw 16-bit words). TOKEN is "<If": the
first generated token id and its logprob.

Stream: HELLO; LAYER frames chunk-major (layers 0..L-1 for chunk [s, s+n), then the next chunk)
until every layer holds prompt_len positions; TOKEN; END. An ERROR frame may come instead of any
frame and ends the stream. FrameDecoder enforces all of this and checks every header before it
allocates the payload. docs/protocol.md is the long form.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from exo_split import PROTOCOL_VERSION
from exo_split.errors import ProtocolError

MAGIC = b"EXOS"
HEADER = struct.Struct("<4sBBBBIIIQI")
HEADER_SIZE = HEADER.size  # 32
MAX_JSON_PAYLOAD = 1 << 20  # HELLO/END/ERROR are metadata; tensors only travel in LAYER frames
TOKEN_PAYLOAD = struct.Struct("<If")
MAX_ERROR_MESSAGE = 16_384  # characters: an ERROR frame must always fit under the JSON cap

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

    def pack(self) -> bytes:
        self.check()
        fields = (self.layer, self.token_start, self.n_tokens, self.payload_len, self.crc32)
        try:
            return HEADER.pack(MAGIC, PROTOCOL_VERSION, self.kind, self.dtype, 0, *fields)
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
        _require(flags == 0, "non-zero flags", 0, f"0x{flags:02x}")
        header = cls(Kind(kind), WireDtype(dtype), *rest)
        header.check()
        return header

    def check(self) -> None:
        """The rules that need no stream state: which fields a kind sets, payload sizes."""
        name, size = self.describe(), self.payload_len
        if self.kind is Kind.LAYER:
            _require(self.dtype is not WireDtype.none, name, "a tensor dtype", "dtype none")
            _require(self.n_tokens >= 1, name, "n_tokens >= 1", self.n_tokens)
            unit = 2 * self.n_tokens * self.dtype.itemsize  # K and V, one element per position
            ok = size > 0 and size % unit == 0
            _require(ok, name, f"payload_len a positive multiple of {unit}", size)
            return
        zeros = (self.dtype, self.layer, self.token_start, self.n_tokens) == (0, 0, 0, 0)
        _require(zeros, name, "dtype, layer, token_start, n_tokens all 0", self)
        if self.kind is Kind.TOKEN:
            _require(size == TOKEN_PAYLOAD.size, name, f"payload_len {TOKEN_PAYLOAD.size}", size)
        _require(size <= MAX_JSON_PAYLOAD, name, f"payload_len <= {MAX_JSON_PAYLOAD}", size)

    def describe(self) -> str:
        if self.kind is Kind.LAYER:
            end = self.token_start + self.n_tokens
            return f"LAYER {self.layer} tokens [{self.token_start}, {end})"
        return self.kind.name


@dataclass(frozen=True)
class Frame:
    """A complete, checked frame. LAYER: ``k`` and ``v`` view ``payload`` (no copies). HELLO,
    END, ERROR: ``obj``. TOKEN: ``token_id`` and ``logprob``."""

    header: FrameHeader
    payload: bytearray = field(repr=False)
    k: memoryview | None = field(default=None, repr=False)
    v: memoryview | None = field(default=None, repr=False)
    obj: dict[str, Any] | None = None
    token_id: int | None = None
    logprob: float | None = None

    @property
    def kind(self) -> Kind:
        return self.header.kind


@dataclass(frozen=True)
class StreamSpec:
    """What the receiver expects: the model's KV shape and dtype, and the prompt length."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: WireDtype
    prompt_len: int

    def __post_init__(self) -> None:
        sizes = (self.n_layers, self.n_kv_heads, self.head_dim, self.prompt_len)
        if min(sizes) < 1 or self.dtype is WireDtype.none:
            raise ValueError(f"invalid {self}: expected sizes >= 1 and a tensor dtype")

    def layer_payload_len(self, n_tokens: int) -> int:
        return 2 * self.n_kv_heads * n_tokens * self.head_dim * self.dtype.itemsize


class FrameDecoder:
    """Incremental parser and validator of one frame stream (sans-IO).

    ``feed()`` the bytes as they arrive, in pieces of any size; it returns the frames they
    complete. Each header is checked against the spec and the stream so far before its payload
    buffer is allocated; payload bytes are copied once, from the chunk into that buffer. Call
    ``eof()`` when the transport ends. After a ProtocolError the decoder refuses more input.
    """

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self._expect: Kind | None = Kind.HELLO  # None once END or ERROR has come
        self._last = "nothing"  # the previous frame, for messages
        self._positions = 0  # positions every layer holds (complete chunks)
        self._next_layer = 0
        self._chunk_len = 0  # n_tokens of the chunk in progress
        self._head = bytearray()  # header bytes so far
        self._header: FrameHeader | None = None  # set while its payload arrives
        self._payload = bytearray()
        self._filled = self._crc = 0
        self._failure: ProtocolError | None = None

    @property
    def done(self) -> bool:
        """END has been received."""
        return self._last == Kind.END.name

    @property
    def finished(self) -> bool:
        """END or ERROR has been received: no more frames may come."""
        return self._expect is None

    def feed(self, data: Buffer) -> list[Frame]:
        self._check_alive()
        view, frames = memoryview(data).cast("B"), []
        try:
            while view:
                take = self._take_header if self._header is None else self._take_payload
                view = take(view)
                if self._header is not None and self._filled == self._header.payload_len:
                    frames.append(self._finish())
        except ProtocolError as exc:
            self._failure = exc
            raise
        return frames

    def eof(self) -> None:
        """The transport ended: raise ProtocolError unless the stream was complete."""
        self._check_alive()
        if (h := self._header) is not None:
            what = f"stream ended mid-frame in {h.describe()}"
            _require(
                self._filled == h.payload_len, what, f"{h.payload_len} payload bytes", self._filled
            )
        _require(not self._head, "stream ended mid-header", f"{HEADER_SIZE} bytes", len(self._head))
        expected = self._expecting()
        if self._expect is Kind.LAYER:
            spec = self.spec
            expected += f"; all {spec.n_layers} layers hold {self._positions} of {spec.prompt_len}"
        _require(self._expect is None, f"stream ended after {self._last}", expected, "EOF")

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise ProtocolError(f"stream already failed: {self._failure}")

    def _take_header(self, view: memoryview) -> memoryview:
        _require(self._expect is not None, f"data after {self._last}", "EOF", f"{len(view)} bytes")
        need = HEADER_SIZE - len(self._head)
        self._head += view[:need]
        if len(self._head) == HEADER_SIZE:
            header = FrameHeader.unpack(self._head)
            self._check_order(header)  # before allocating: payload_len is now known to be sane
            self._head.clear()
            self._header, self._payload = header, bytearray(header.payload_len)
            self._filled = self._crc = 0
        return view[need:]

    def _take_payload(self, view: memoryview) -> memoryview:
        assert self._header is not None
        piece = view[: self._header.payload_len - self._filled]
        self._payload[self._filled : self._filled + len(piece)] = piece
        self._crc = zlib.crc32(piece, self._crc)
        self._filled += len(piece)
        return view[len(piece) :]

    def _finish(self) -> Frame:
        assert self._header is not None
        header, payload = self._header, self._payload
        self._header, self._payload = None, bytearray()
        frame = _parse(header, payload, self._crc)
        self._advance(header)
        return frame

    def _expecting(self) -> str:
        if self._expect is Kind.LAYER:
            start, layer = self._positions, self._next_layer
            if layer == 0:
                return f"LAYER 0 from token {start}"
            return f"LAYER {layer} tokens [{start}, {start + self._chunk_len})"
        return self._expect.name if self._expect is not None else "EOF"

    def _check_order(self, h: FrameHeader) -> None:
        if h.kind is Kind.ERROR:
            return
        twice = " (HELLO twice)" if h.kind is Kind.HELLO else ""
        what = f"out of order after {self._last}{twice}"
        _require(h.kind is self._expect, what, self._expecting(), h.describe())
        if h.kind is Kind.LAYER:
            self._check_layer(h)

    def _check_layer(self, h: FrameHeader) -> None:
        spec, name, end = self.spec, f"LAYER {h.layer}", h.token_start + h.n_tokens
        what = f"out-of-order layer ({spec.n_layers} layers)"
        _require(h.layer == self._next_layer, what, f"LAYER {self._next_layer}", name)
        _require(h.dtype == spec.dtype, f"wrong dtype on {name}", spec.dtype.name, h.dtype.name)
        what = f"wrong token_start on {name}"
        _require(h.token_start == self._positions, what, self._positions, h.token_start)
        if self._next_layer > 0:
            what = f"n_tokens changed within a chunk on {name}"
            _require(h.n_tokens == self._chunk_len, what, self._chunk_len, h.n_tokens)
        what = f"{h.describe()} runs past the prompt"
        _require(end <= spec.prompt_len, what, f"at most {spec.prompt_len} positions", end)
        size = spec.layer_payload_len(h.n_tokens)
        shape = f"2 x {spec.n_kv_heads} heads x {h.n_tokens} tokens x {spec.head_dim} dims"
        what = f"wrong payload_len on {h.describe()}"
        _require(
            h.payload_len == size, what, f"{size} ({shape} x {spec.dtype.name})", h.payload_len
        )

    def _advance(self, h: FrameHeader) -> None:
        self._last = h.describe()
        if h.kind in (Kind.END, Kind.ERROR):
            self._expect = None
        elif h.kind is not Kind.LAYER:
            self._expect = Kind.LAYER if h.kind is Kind.HELLO else Kind.END
            return
        self._chunk_len, self._next_layer = h.n_tokens, self._next_layer + 1
        if self._next_layer == self.spec.n_layers:  # chunk complete in every layer
            self._next_layer, self._positions = 0, self._positions + h.n_tokens
            if self._positions == self.spec.prompt_len:
                self._expect = Kind.TOKEN


def encode_hello(obj: dict[str, Any]) -> list[Buffer]:
    return _encode_json(Kind.HELLO, obj)


def encode_end(obj: dict[str, Any]) -> list[Buffer]:
    return _encode_json(Kind.END, obj)


def encode_error(code: str, message: str) -> list[Buffer]:
    return _encode_json(Kind.ERROR, {"code": code, "message": message[:MAX_ERROR_MESSAGE]})


def encode_token(token_id: int, logprob: float) -> list[Buffer]:
    payload = TOKEN_PAYLOAD.pack(token_id, logprob)
    return [FrameHeader(Kind.TOKEN, payload_len=8, crc32=zlib.crc32(payload)).pack(), payload]


def encode_layer(
    layer: int, token_start: int, n_tokens: int, dtype: WireDtype, k: Buffer, v: Buffer
) -> list[Buffer]:
    """Header, then byte views of K and V ([n_kv_heads, n_tokens, head_dim], C-contiguous).

    The views are not copies: keep ``k`` and ``v`` alive and unchanged until they are written.
    """
    k_bytes, v_bytes = _byte_view(k, "k"), _byte_view(v, "v")
    if k_bytes.nbytes != v_bytes.nbytes:
        raise ValueError(f"K and V differ in size: {k_bytes.nbytes} vs {v_bytes.nbytes} bytes")
    crc = zlib.crc32(v_bytes, zlib.crc32(k_bytes))
    size = 2 * k_bytes.nbytes
    header = FrameHeader(Kind.LAYER, WireDtype(dtype), layer, token_start, n_tokens, size, crc)
    return [header.pack(), k_bytes, v_bytes]


def frame_bytes(parts: Iterable[Buffer]) -> bytes:
    """Frames as contiguous bytes: for tests and small frames."""
    return b"".join(parts)


def decode_frame(buf: Buffer) -> Frame:
    """Parse exactly one complete frame: header, size, CRC, payload (not stream order)."""
    view = memoryview(buf).cast("B")
    header = FrameHeader.unpack(view)
    size = HEADER_SIZE + header.payload_len
    _require(len(view) == size, f"frame size of {header.describe()}", size, len(view))
    payload = bytearray(view[HEADER_SIZE:])
    return _parse(header, payload, zlib.crc32(payload))


def _byte_view(buf: Buffer, name: str) -> memoryview:
    try:
        return memoryview(buf).cast("B")
    except TypeError as exc:
        raise ValueError(f"{name}: expected a C-contiguous buffer, got {exc}") from exc


def _encode_json(kind: Kind, obj: dict[str, Any]) -> list[Buffer]:
    if not isinstance(obj, dict):
        raise TypeError(f"{kind.name} payload: expected a dict, got {type(obj).__name__}")
    payload = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    header = FrameHeader(kind, payload_len=len(payload), crc32=zlib.crc32(payload))
    return [header.pack(), payload]


def _parse(header: FrameHeader, payload: bytearray, crc: int) -> Frame:
    if crc != header.crc32:
        raise ProtocolError(
            f"CRC mismatch on {header.describe()}: "
            f"expected 0x{header.crc32:08x}, computed 0x{crc:08x}"
        )
    if header.kind is Kind.LAYER:
        view, half = memoryview(payload), len(payload) // 2
        return Frame(header, payload, k=view[:half], v=view[half:])
    if header.kind is Kind.TOKEN:
        token_id, logprob = TOKEN_PAYLOAD.unpack(payload)
        return Frame(header, payload, token_id=token_id, logprob=logprob)
    return Frame(header, payload, obj=_parse_json(header.kind, payload))


def _parse_json(kind: Kind, payload: bytearray) -> dict[str, Any]:
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError too
        raise ProtocolError(f"{kind.name}: expected a UTF-8 JSON payload, got {exc}") from exc
    _require(isinstance(obj, dict), kind.name, "a JSON object", type(obj).__name__)
    if kind is Kind.ERROR:
        ok = isinstance(obj.get("code"), str) and isinstance(obj.get("message"), str)
        _require(ok, "ERROR payload", "string 'code' and 'message'", sorted(obj))
    return obj
