"""The listener takes connections off the kernel's queue within a descriptor budget
(exo_split/transport/accept.py)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap

from exo_split.transport.accept import Acceptor, stranger_caps


def test_stranger_caps_follow_the_descriptor_limit():
    assert stranger_caps(1_048_576) == (32, 128)
    assert stranger_caps(1024) == (32, 128)
    assert stranger_caps(256) == (32, 64)  # macOS's default soft limit
    assert stranger_caps(40) == (5, 10)
    assert stranger_caps(12) == (4, 8)


def test_at_most_burst_connections_wait_for_their_protocol_and_all_are_served():
    """60 clients connect before the node's loop runs once: they wait in the kernel's queue,
    and the acceptor takes at most `burst` of them off it before each one has met its
    protocol (asyncio's own server took up to its backlog per wake-up)."""
    n, burst = 60, 4

    async def run():
        seen_pending: list[int] = []
        made: list[asyncio.Transport] = []

        class Hold(asyncio.Protocol):
            def connection_made(self, transport):
                seen_pending.append(acceptor.pending)
                made.append(transport)

        acceptor = Acceptor(Hold, burst=burst)
        port = await acceptor.start("127.0.0.1", 0)
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]
        try:
            for _ in range(2000):  # bounded: a few ms per turn at most
                if len(made) == n:
                    break
                await asyncio.sleep(0.001)
            for c in clients:  # every one was taken and given its protocol
                c.sendall(b"x")
            return seen_pending, len(made)
        finally:
            for t in made:
                t.abort()
            for c in clients:
                c.close()
            acceptor.close()

    seen_pending, made = asyncio.run(run())
    assert made == n
    assert max(seen_pending) <= burst, seen_pending
    assert max(seen_pending) >= 2  # the bound was reached, not merely never approached


SERVER = textwrap.dedent("""
    import asyncio, resource, sys
    from exo_split.transport.accept import Acceptor

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
        def data_received(self, data):
            self.transport.write(data)

    async def main():
        acceptor = Acceptor(Echo)
        port = await acceptor.start("127.0.0.1", 0)
        resource.setrlimit(resource.RLIMIT_NOFILE, (@LIMIT@, @LIMIT@))
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        print("refused", acceptor.refused, flush=True)
        acceptor.close()

    asyncio.run(main())
""")


def test_out_of_descriptors_the_listener_waits_and_serves_again():
    """A server process with few descriptors left: connections past its limit are refused
    by accept() (EMFILE); it says so, keeps serving the ones it holds, and once they close
    accepts and serves the ones that waited in the queue."""
    script = SERVER.replace("@LIMIT@", "40")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    clients: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(60):  # more than the server has descriptors for
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        served = 0
        for c in clients[:5]:  # those it accepted are served while the rest wait
            c.sendall(b"ping")
            served += c.recv(4) == b"ping"
        assert served == 5
        for c in clients[:40]:
            c.close()
        for c in clients[40:]:  # ...and the ones that waited in the queue are served now
            c.settimeout(10)  # bounds the wait: the listener retries after 1 s
            c.sendall(b"pong")
            assert c.recv(4) == b"pong"
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert int(out.split()[-1]) >= 1  # it did run out, and said so
        assert "cannot accept a connection (Too many open files)" in err
    finally:
        for c in clients:
            c.close()
        if proc.poll() is None:
            proc.kill()
