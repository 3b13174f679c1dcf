"""Accepting connections within a descriptor budget.

asyncio's own server accepts up to its listen backlog (128) connections per wake-up, and
each gets a protocol (and so meets the Guard, which closes strangers) only two loop turns
later: a burst of idle connections could hold hundreds of descriptors the node had not yet
looked at, and a node under macOS's default limit of 256 ran out (accept failed with EMFILE,
and so would anything else the node opened then: a model file, a data connection to its
peer). `Acceptor` keeps the kernel's backlog (waiting there costs no descriptor) but takes
at most `burst` connections off it that have not yet reached their protocol; the Guard's
caps then bound how many of those wait to say who they are (`stranger_caps`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

# accept() failing for want of resources: wait this long before trying again
RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
RETRY_S = 1.0


def descriptor_limit() -> int | None:
    """The soft RLIMIT_NOFILE of this process; None where there is none to read."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def stranger_caps(limit: int | None = None) -> tuple[int, int]:
    """(per address, total) of connections that may wait to say who they are: 32 and 128
    where descriptors are plenty, a quarter of the descriptor limit in all where they are
    not (64 of macOS's 256), so strangers never hold more than that share."""
    limit = descriptor_limit() if limit is None else limit
    total = 128 if limit is None else max(8, min(128, limit // 4))
    return min(32, total // 2), total


class Acceptor:
    """Listens on `host`:`port` and gives each accepted connection a `factory()` protocol,
    with at most `burst` accepted connections that have not yet met their protocol."""

    def __init__(self, factory: Callable[[], asyncio.BaseProtocol], *, burst: int = 16,
                 backlog: int = 128):  # fmt: skip
        self.factory, self.burst, self.backlog = factory, burst, backlog
        self.sockets: list[socket.socket] = []
        self.pending = 0  # accepted, protocol not yet made
        self.refused = 0  # accept() failures for want of descriptors or memory
        self._reading: set[socket.socket] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._closed = False

    async def start(self, host: str, port: int) -> int:
        """Bind every address `host` names (one port for all, also with port 0) and listen;
        returns the port."""
        self._loop = asyncio.get_running_loop()
        infos = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                             flags=socket.AI_PASSIVE)  # fmt: skip
        seen = set()
        try:
            for family, kind, proto, _, addr in infos:
                if (family, addr[:2]) in seen:
                    continue
                seen.add((family, addr[:2]))
                sock = socket.socket(family, kind, proto)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # "::" and "0.0.0.0" both: two sockets
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0 and len(self.sockets) > 1:  # the port the first one got
                    addr = (addr[0], self.sockets[0].getsockname()[1], *addr[2:])
                sock.bind(addr)
                sock.listen(self.backlog)
                sock.setblocking(False)
        except OSError:
            self.close()
            raise
        self._resume()
        return self.sockets[0].getsockname()[1]

    def close(self) -> None:
        self._closed = True
        self._pause()
        if self._retry is not None:
            self._retry.cancel()
        for sock in self.sockets:
            sock.close()

    def _pause(self) -> None:
        for sock in self._reading:
            if self._loop is not None:
                self._loop.remove_reader(sock.fileno())
        self._reading.clear()

    def _resume(self) -> None:
        self._retry = None
        if self._closed or self._loop is None:
            return
        for sock in self.sockets:
            if sock not in self._reading:
                self._loop.add_reader(sock.fileno(), self._accept, sock)
                self._reading.add(sock)

    def _accept(self, sock: socket.socket) -> None:
        assert self._loop is not None
        while self.pending < self.burst:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # reset while it waited in the queue: the next
                continue
            except OSError as exc:
                if exc.errno not in RESOURCE_ERRORS:  # the reader fires again while readable
                    log.warning("accept failed: %s", exc)
                    return
                self.refused += 1
                log.warning("cannot accept a connection (%s): trying again in %.0f s",
                            exc.strerror, RETRY_S)  # fmt: skip
                self._pause()
                if self._retry is None:
                    self._retry = self._loop.call_later(RETRY_S, self._resume)
                return
            conn.setblocking(False)
            self.pending += 1
            task = self._loop.create_task(self._loop.connect_accepted_socket(self.factory, conn))
            task.add_done_callback(lambda t, conn=conn: self._made(t, conn))
        self._pause()  # `burst` connections wait for their protocol: the rest stay queued

    def _made(self, task: asyncio.Task, conn: socket.socket) -> None:
        self.pending -= 1
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():
                log.warning("an accepted connection got no protocol: %s", task.exception())
            with contextlib.suppress(OSError):
                conn.close()
        if self._retry is None and len(self._reading) < len(self.sockets):
            self._resume()
