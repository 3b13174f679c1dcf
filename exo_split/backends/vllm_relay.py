"""Tensor-parallel vLLM: each worker process hands its KV heads to the node's process.

With tensor_parallel_size > 1 vLLM runs every worker in a process of its own, each holding a
range of every layer's KV heads (worker r the r-th of `tp` equal ranges). The node process
listens on a Unix socket in a private directory (`Relay`); each worker's connector gathers
the plan's pieces out of its own paged cache (vllm_kv.Job, as the one in-process worker
does: the plan reaches the workers in the connector's metadata) and a `WorkerLink` sends them
there from a thread of its own, so the forward never waits for the socket. The relay puts
each piece together from every worker's heads, in plan order (`RelayJob`), and hands it to
the frame sender, which sends it as one frame per worker's range (backend.head_ranges,
wire.HEADS): the decode node assembles the layer as it would from any tensor-parallel node.

A message: its header's length (u32, little-endian), the header (JSON: job, rank, and either
the piece's layer, start, shape and dtype, or an error), then K's bytes and V's. A worker
that reports an error, or whose connection closes while a job waits on it, fails the job;
the backend waits a bounded time for the pieces after vLLM finished the request.

Without vLLM (numpy and the standard library only): the tests of the main environment run it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from exo_split.errors import ExoSplitError
from exo_split.kv import LayerKV, storage_dtype

log = logging.getLogger(__name__)
RELAY_KEY = "exo_split_relay"  # kv_connector_extra_config: the relay's socket path
PLAN_KEY = "exo_split_plan"  # SamplingParams.extra_args: {"pieces": [[layer, start, n]], "dtype"}
_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 16


def parallel_size(spec, engine_args: dict) -> int:
    """The engine arguments' tensor_parallel_size (1 without), checked against the model's KV
    heads: each worker must hold a range of its own (vLLM replicates heads across workers
    when there are fewer heads than workers, which the wire's ranges do not describe)."""
    tp = int(engine_args.get("tensor_parallel_size", 1)) if isinstance(engine_args, dict) else 1
    if tp > 1 and spec.n_kv_heads % tp:
        raise ExoSplitError(
            f"tensor_parallel_size {tp} does not divide {spec.name}'s {spec.n_kv_heads} KV heads: "
            "exo-split sends each worker's own range of heads",
            hint="a tensor_parallel_size that divides the KV heads",
        )
    return max(tp, 1)


class RelayError(ExoSplitError):
    """A tensor-parallel worker could not hand its KV heads to the node."""


@dataclass
class RelayJob:
    """One prefill's pieces (layer, start, n) in plan order, put together from the `ranks`
    workers' heads (rank order is head order) and handed to `on_piece` (must not block)."""

    pieces: list[tuple[int, int, int]]
    ranks: int
    on_piece: Callable[[LayerKV], None]
    dtype: str
    error: BaseException | None = None
    next_piece: int = 0
    saves: list = field(default_factory=list)  # the in-process Job's field; unused here
    _parts: dict[tuple[int, int], dict[int, tuple[np.ndarray, np.ndarray]]] = field(
        default_factory=dict
    )
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def done(self) -> bool:
        return self.next_piece >= len(self.pieces)

    def add(self, rank: int, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        with self._cond:
            if self.error is not None:
                return
            try:
                if not 0 <= rank < self.ranks:
                    raise RelayError(f"a piece from worker {rank} of {self.ranks}")
                got = self._parts.setdefault((layer, start), {})
                if rank in got:
                    raise RelayError(f"worker {rank} sent layer {layer} at {start} twice")
                got[rank] = (k, v)
                self._emit()
            except BaseException as exc:  # kept for the backend, as the in-process Job's
                self.error = exc
            self._cond.notify_all()

    def _emit(self) -> None:
        while not self.done:
            layer, start, n = self.pieces[self.next_piece]
            got = self._parts.get((layer, start), {})
            if len(got) < self.ranks:
                return
            del self._parts[(layer, start)]
            parts = [got[r] for r in range(self.ranks)]
            if any(k.shape[1] != n for k, _ in parts):
                raise RelayError(f"layer {layer} at {start}: a worker sent another length than {n}")
            k = np.concatenate([k for k, _ in parts], axis=0)
            v = np.concatenate([v for _, v in parts], axis=0)
            self.on_piece(LayerKV(layer, start, k, v, self.dtype))
            self.next_piece += 1

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.error is None and not self.done:
                self.error = exc
            self._cond.notify_all()

    def wait(self, timeout: float, stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait until every piece was handed on or the job failed (or `stop`); True when
        done, False when `timeout` seconds passed first."""
        until = time.monotonic() + timeout
        with self._cond:
            while not self.done and self.error is None and not stop():
                left = until - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return self.done


class Relay:
    """The node process's end: a Unix socket the workers connect to, and the jobs waiting for
    their pieces."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="exo-split-relay-")  # mode 0700: this user only
        self.path = os.path.join(self._dir, "kv.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(64)
        self._jobs: dict[str, RelayJob] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.received_bytes = 0
        threading.Thread(target=self._accept, name="vllm-relay", daemon=True).start()

    def register(self, job_id: str, job: RelayJob) -> None:
        with self._lock:
            self._jobs[job_id] = job

    def unregister(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="vllm-relay-worker",
                             daemon=True).start()  # fmt: skip

    def _serve(self, conn: socket.socket) -> None:
        why = "closed its connection"
        try:
            with conn:
                while True:
                    head = _read(conn, _LEN.size)
                    if head is None:
                        break
                    self._message(conn, _LEN.unpack(head)[0])
        except (OSError, ValueError, KeyError, TypeError, RelayError) as exc:
            why = f"sent what the relay cannot read ({exc})"
            log.warning("vLLM worker link: %s", why)
        if not self._closed:  # the jobs waiting on it cannot complete
            with self._lock:
                jobs = list(self._jobs.values())
            for job in jobs:
                job.fail(RelayError(f"a vLLM worker {why} while a prefill waited on it"))

    def _message(self, conn: socket.socket, size: int) -> None:
        if size > MAX_HEADER:
            raise RelayError(f"a header of {size} bytes")
        head = json.loads(_read_exactly(conn, size))
        with self._lock:
            job = self._jobs.get(head["job"])
        if "error" in head:
            if job is not None:
                job.fail(RelayError(f"vLLM worker {head['rank']}: {head['error']}"))
            return
        dtype = np.dtype(storage_dtype(head["dtype"]))
        shapes = [tuple(int(x) for x in head["k"]), tuple(int(x) for x in head["v"])]
        arrays = []
        for shape in shapes:
            raw = _read_exactly(conn, math.prod(shape) * dtype.itemsize)
            arrays.append(np.frombuffer(raw, dtype).reshape(shape))
            self.received_bytes += len(raw)
        if job is not None:  # else a cancelled job's late pieces: dropped
            job.add(int(head["rank"]), int(head["layer"]), int(head["start"]), *arrays)


class WorkerLink:
    """A worker process's end: pieces queued by the forward's thread, sent by a thread of
    this link's own to the relay at `path`. A link that cannot reach the relay drops what it
    is given (the node's job then fails: the connection closed, or its pieces never came)."""

    def __init__(self, path: str, rank: int) -> None:
        self.path, self.rank = path, rank
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.broken: str | None = None

    def send(self, job_id: str, kv: LayerKV) -> None:
        head = {"job": job_id, "rank": self.rank, "layer": kv.layer, "start": kv.token_start,
                "dtype": kv.dtype, "k": list(kv.k.shape), "v": list(kv.v.shape)}  # fmt: skip
        self._put(head, (np.ascontiguousarray(kv.k), np.ascontiguousarray(kv.v)))

    def fail(self, job_id: str, why: str) -> None:
        self._put({"job": job_id, "rank": self.rank, "error": why}, ())

    def _put(self, head: dict, arrays: tuple) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="exo-split-link", daemon=True)
            self._thread.start()
        self._queue.put((head, arrays))

    def _run(self) -> None:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(self.path)
                while True:
                    head, arrays = self._queue.get()
                    raw = json.dumps(head).encode()
                    sock.sendall(_LEN.pack(len(raw)) + raw)
                    for a in arrays:
                        sock.sendall(memoryview(a).cast("B"))
        except OSError as exc:
            self.broken = str(exc)
            log.error("exo-split: vLLM worker %d cannot reach the node's relay at %s: %s",
                      self.rank, self.path, exc)  # fmt: skip


def _read(conn: socket.socket, n: int) -> bytes | None:
    """n bytes, or None at a clean end before the first."""
    first = conn.recv(n)
    if not first:
        return None
    return first + _read_exactly(conn, n - len(first)) if len(first) < n else first


def _read_exactly(conn: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = conn.recv_into(view[got:])
        if r == 0:
            raise RelayError(f"the connection closed {n - got} bytes into a message")
        got += r
    return buf
