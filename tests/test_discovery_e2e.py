"""Discovery end to end with real node agents (torch prefill, MLX decode).

Over mDNS: each node runs inside its own network namespace, joined by a veth pair the test
creates (exo_split/bench/netns.py); every command that browses (`nodes`, `split-generate` without
addresses) runs inside a namespace too. Nothing here sends multicast from the host's
namespace. Without multicast: nodes on 127.0.0.1 with --no-mdns and --peer addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fakes import fake_identity
from nodes import CACHE, TOKEN, NodeProcess, request
from reference import reference_generate

from exo_split.bench.netns import Netns, netns_pair, netns_unavailable_reason, ns_exec_prefix
from exo_split.models.tiny import sample_prompt
from exo_split.spec import load_spec
from exo_split.tokenizer import TextCodec

pytestmark = pytest.mark.timeout(300)

ENV = {**os.environ, "EXO_SPLIT_TOKEN": TOKEN, "EXO_SPLIT_CACHE": str(CACHE),
       "EXO_SPLIT_PEERS": ""}  # fmt: skip
PROMPT = sample_prompt(150, seed=5)
NEW_TOKENS = 8
_INFO = (
    "import sys, urllib.request as u; r = u.Request(sys.argv[1] + '/v1/info', "
    "headers={'Authorization': 'Bearer ' + sys.argv[2]}); "
    "print(u.urlopen(r, timeout=5).read().decode())"
)


def exo(prefix: list[str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`exo-split ARGS` (inside a namespace when `prefix` is `ns_exec_prefix(ns)`)."""
    cmd = [*prefix, sys.executable, "-m", "exo_split", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def last_json(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def node_info(ns: Netns, node: NodeProcess) -> dict:
    """GET /v1/info of `node`, from inside its namespace."""
    url = f"http://{ns.ipv4}:{node.info['port']}"
    cmd = [*ns_exec_prefix(ns), sys.executable, "-c", _INFO, url, TOKEN]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_until(what: str, check: Callable[[], object], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.1)
    pytest.fail(f"{what}: not within {timeout} s")


def peer_entry(info: dict, node_id: str) -> dict | None:
    return next((p for p in info["peers"] if p["node_id"] == node_id), None)


def udp_sockets_of(pids: set[int], port: int = 5353) -> list[str]:
    """The UDP sockets on `port` these processes hold in this test's network namespace: the
    kernel's own tables (/proc/net/udp, udp6) matched to the processes' socket fds, so no
    tool that may be missing (`ss`) can turn the check into a silent pass."""
    inodes = set()
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()  # sl local_address rem_address st ... uid timeout inode
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    held = []
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # closed since the listing
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    held.append(f"pid {pid} fd {fd.name}: UDP port {port} ({target})")
    return held


def test_udp_sockets_of_sees_a_socket_that_is_there() -> None:
    """The check the static-peer test relies on finds a bound socket (on a free port of
    127.0.0.1, not 5353: nothing here touches mDNS in the host's namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert len(udp_sockets_of({os.getpid()}, port)) == 1
    assert udp_sockets_of({os.getpid()}, port) == []


def reference_tokens(ckpt: Path) -> list[int]:
    return reference_generate(ckpt, TextCodec(ckpt).tokenize(PROMPT), NEW_TOKENS)


@dataclass
class Cluster:
    a: Netns  # the torch node's namespace
    b: Netns  # the MLX node's namespace
    torch: NodeProcess
    mlx: NodeProcess
    ckpt: Path
    work: Path

    def start_torch(self, *extra: str) -> NodeProcess:
        return NodeProcess(self.ckpt, "torch", self.work, *extra, mdns=True, host="0.0.0.0",
                           prefix=ns_exec_prefix(self.a))  # fmt: skip


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory) -> Iterator[Cluster]:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    ckpt = checkpoint("llama", num_hidden_layers=6)
    work = tmp_path_factory.mktemp("discovery-e2e")
    with netns_pair() as (a, b):
        c = Cluster(a, b, None, None, ckpt, work)  # type: ignore[arg-type]
        started: list[NodeProcess] = []
        try:
            # The torch node listens everywhere in its namespace; the MLX node names its
            # interface (by name: resolved to the address) and listens on that address.
            c.torch = c.start_torch()
            started.append(c.torch)
            c.mlx = NodeProcess(ckpt, "mlx", work, "--interface", b.veth, mdns=True,
                                host=b.ipv4, prefix=ns_exec_prefix(b))  # fmt: skip
            started.append(c.mlx)
            c.torch.wait_ready()
            c.mlx.wait_ready()
            yield c
        finally:
            for node in [*started, c.torch]:
                if node is not None:
                    node.stop()


@pytest.mark.netns
def test_two_nodes_discover_each_other_within_3s(cluster: Cluster) -> None:
    c = cluster
    t_id, m_id = c.torch.info["node_id"], c.mlx.info["node_id"]
    for node in (c.torch, c.mlx):
        assert "mDNS: advertising" in node.log(), node.log()

    def both_found():
        ti, mi = node_info(c.a, c.torch), node_info(c.b, c.mlx)
        return (ti, mi) if peer_entry(ti, m_id) and peer_entry(mi, t_id) else None

    t_info, m_info = wait_until("mutual discovery", both_found, 10)
    # Both stamps are CLOCK_MONOTONIC, one clock for every namespace and process.
    started = max(c.torch.info["discovery_at"], c.mlx.info["discovery_at"])
    found = max(peer_entry(t_info, m_id)["found_at"], peer_entry(m_info, t_id)["found_at"])
    print(f"mutual discovery {found - started:.2f} s after the second node began advertising")
    assert found - started < 3.0
    seen = peer_entry(m_info, t_id)
    assert seen["backend"] == "torch" and seen["source"] == "mdns"
    assert seen["url"] == f"http://{c.a.ipv4}:{c.torch.info['port']}"
    assert seen["capabilities"]["prefill_tps"] > 0
    assert m_info["mdns"] == {"advertised": True, "error": None}


@pytest.mark.netns
def test_nodes_command_lists_the_other_node(cluster: Cluster) -> None:
    c = cluster
    out = exo(ns_exec_prefix(c.a), "nodes", "--json", "--timeout", "1.5")
    doc = last_json(out)
    assert TOKEN not in out.stdout + out.stderr
    assert doc["mdns"] is True and doc["failures"] == []
    mlx = next(n for n in doc["nodes"] if n["node_id"] == c.mlx.info["node_id"])
    fingerprint = load_spec(c.ckpt).fingerprint
    assert (mlx["backend"], mlx["device"], mlx["fingerprint"]) == ("mlx", "cpu", fingerprint)
    assert (mlx["host"], mlx["port"], mlx["source"]) == (c.b.ipv4, c.mlx.info["port"], "mdns")
    caps = mlx["capabilities"]
    assert caps["prefill_tps"] > 0 and caps["decode_tps"] > 0
    for key in ("prefill_tps", "decode_tps"):  # what the node measured, as advertised
        assert caps[key] == pytest.approx(c.mlx.info["capabilities"][key], rel=1e-5)


@pytest.mark.netns
def test_split_generate_finds_the_nodes_and_picks_roles(cluster: Cluster) -> None:
    c = cluster
    expected = reference_tokens(c.ckpt)
    args = ["split-generate", "--prompt", PROMPT, "--max-tokens", str(NEW_TOKENS), "--json"]
    doc = last_json(exo(ns_exec_prefix(c.a), *args, "--prefill", "remote"))
    nodes = doc["nodes"]
    assert nodes["decode"]["backend"] == "mlx" and nodes["prefill"]["backend"] == "torch"
    assert {n["node_id"] for n in nodes["found"]} >= {c.torch.info["node_id"],
                                                      c.mlx.info["node_id"]}  # fmt: skip
    report = doc["report"]
    assert report["mode"] == "overlap" and report["fallback"] is None
    assert report["decision"]["peer"]["backend"] == "torch"
    assert doc["tokens"] == expected

    # auto (the default): the decode node weighs the torch peer against itself.
    doc = last_json(exo(ns_exec_prefix(c.a), *args))
    decision = doc["report"]["decision"]
    est = decision["estimates"]
    assert decision["mode"] == "auto" and decision["peer"]["backend"] == "torch"
    assert est["local_ttft_s"] > 0 and est["remote_ttft_s"] > 0
    assert decision["choice"] == ("remote" if est["remote_ttft_s"] < est["local_ttft_s"]
                                  else "local")  # fmt: skip
    assert decision["measured"]["ran"] == decision["choice"]
    assert decision["measured"]["ttft_s"] > 0
    assert doc["report"]["mode"] == ("overlap" if decision["choice"] == "remote" else "local")
    assert doc["tokens"] == expected


@pytest.mark.netns
def test_clean_stop_disappears_and_restart_is_found_on_new_port(cluster: Cluster) -> None:
    c = cluster
    old_id, old_port = c.torch.info["node_id"], c.torch.info["port"]
    wait_until("torch node known", lambda: peer_entry(node_info(c.b, c.mlx), old_id), 10)
    t_stop = time.monotonic()
    assert c.torch.stop() == 0
    # Gone within 5 s of the stop: a goodbye, not the records' 120 s TTL running out.
    wait_until("torch node gone", lambda: not peer_entry(node_info(c.b, c.mlx), old_id), 5)
    print(f"clean stop seen by the MLX node after {time.monotonic() - t_stop:.2f} s")

    c.torch = c.start_torch("--port", str(old_port + 1)).wait_ready()
    new_id, new_port = c.torch.info["node_id"], c.torch.info["port"]
    assert new_port == old_port + 1
    back = wait_until("restarted node", lambda: peer_entry(node_info(c.b, c.mlx), new_id), 10)
    assert back["url"] == f"http://{c.a.ipv4}:{new_port}"
    doc = last_json(exo(ns_exec_prefix(c.b), "nodes", "--json", "--timeout", "1.5"))
    torch_nodes = [(n["node_id"], n["port"]) for n in doc["nodes"] if n["backend"] == "torch"]
    assert torch_nodes == [(new_id, new_port)]


def test_without_multicast_static_peers_do_everything(checkpoint, tmp_path) -> None:
    """--no-mdns (NodeProcess's default: the host's namespace) and --peer addresses."""
    ckpt = checkpoint("llama", num_hidden_layers=6)
    t = NodeProcess(ckpt, "torch", tmp_path)
    try:
        t.wait_ready()
        m = NodeProcess(ckpt, "mlx", tmp_path, "--peer", t.addr).wait_ready()
    except BaseException:
        t.stop()
        raise
    try:
        for node in (t, m):
            assert "mDNS: off (--no-mdns)" in node.log()
        assert not udp_sockets_of({t.proc.pid, m.proc.pid})
        # The link probe streams what it is asked for, and only to a holder of the token.
        probe = f"{t.url}/v1/probe?bytes=100000"
        assert asyncio.run(request("GET", probe, token=None))[0] == 401
        status, body, _ = asyncio.run(request("GET", probe))
        assert (status, len(body)) == (200, 100_000)
        assert asyncio.run(request("GET", f"{t.url}/v1/probe?bytes=-1"))[0] == 400
        peers = ["--no-mdns", "--peer", t.addr, "--peer", m.addr]
        doc = last_json(exo([], "nodes", "--json", *peers))
        assert doc["mdns"] is False
        listed = {n["backend"]: n for n in doc["nodes"]}
        assert set(listed) == {"torch", "mlx"}
        assert all(n["source"] == "static" for n in doc["nodes"])
        assert listed["mlx"]["capabilities"]["decode_tps"] > 0

        expected = reference_tokens(ckpt)
        args = ["split-generate", "--prompt", PROMPT, "--max-tokens", str(NEW_TOKENS), "--json"]
        doc = last_json(exo([], *args, *peers, "--prefill", "remote"))
        assert (doc["nodes"]["decode"]["url"], doc["nodes"]["prefill"]["url"]) == (m.url, t.url)
        assert doc["report"]["mode"] == "overlap" and doc["tokens"] == expected
        doc = last_json(exo([], *args, *peers))  # auto: the MLX node knows torch by --peer
        decision = doc["report"]["decision"]
        assert decision["peer"]["source"] == "static" and decision["estimates"]["local_ttft_s"]
        assert doc["tokens"] == expected
        # Nothing found and nothing given: a clear hint, not a hang.
        out = exo([], "nodes", "--no-mdns")
        assert out.returncode == 1
        assert "--peer HOST:PORT" in out.stderr and "Local Network" in out.stderr
    finally:
        t.stop()
        m.stop()


# A device on the LAN that advertises itself as the best prefill node for our model: it
# records every request it gets and answers /v1/hello with a proof it cannot make.
_ROGUE = r"""
import json, ssl, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
log = open(sys.argv[2], "a", buffering=1)
class H(BaseHTTPRequestHandler):
    def _any(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n).decode("utf-8", "replace") if n else ""
        log.write(json.dumps({"method": self.command, "path": self.path,
                              "headers": dict(self.headers), "body": body}) + "\n")
        out = {"nonce": "0" * 32, "proof": "0" * 64} if self.path.startswith("/v1/hello") else {}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    do_GET = do_POST = _any
    def log_message(self, *a):
        pass
server = ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # it speaks TLS as nodes do, with its own cert
ctx.load_cert_chain(sys.argv[3])
server.socket = ctx.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_a_rogue_advertiser_never_gets_the_token_nor_supplies_kv(cluster: Cluster) -> None:
    """Issue 18, H1, in the test's namespaces: a rogue advertises the model's (public)
    fingerprint and 10^9 prefill tokens/s over mDNS beside the real torch node. Requests
    (auto placement, found over mDNS) run on the real peer or locally with transformers'
    tokens; the rogue only ever sees GET /v1/hello with a random nonce: no token, nothing
    derived from it, no prompt."""
    c = cluster
    log = c.work / "rogue.jsonl"
    log.write_text("")
    port = 18471
    fp = load_spec(c.ckpt).fingerprint
    env = {**ENV, "MDNS_AGENT_HOST_NETNS": str(os.stat("/proc/self/ns/net").st_ino),
           "EXO_SPLIT_TOKEN": "", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}  # fmt: skip
    server = subprocess.Popen([*ns_exec_prefix(c.a), sys.executable, "-c", _ROGUE, str(port),
                               str(log), str(fake_identity().path)], env=env)  # fmt: skip
    agent = subprocess.Popen(
        [*ns_exec_prefix(c.a), sys.executable, str(Path(__file__).parent / "mdns_agent.py"),
         "node", "--iface", c.a.ipv4, "--port", str(port), "--node-id", "rogue0001",
         "--name", "fastest-node", "--fp", fp, "--ptps", "1e9", "--dtps", "1e9"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        events = [json.loads(agent.stdout.readline()) for _ in range(2)]
        assert [e["event"] for e in events] == ["started", "advertised"], events
        wait_until("the decode node sees the rogue",
                   lambda: peer_entry(node_info(c.b, c.mlx), "rogue0001"), 15)  # fmt: skip
        expected = reference_tokens(c.ckpt)
        args = ["split-generate", "--prompt", PROMPT, "--max-tokens", str(NEW_TOKENS), "--json"]
        for _ in range(3):  # the rogue stays advertised: later requests are not its either
            doc = last_json(exo(ns_exec_prefix(c.b), *args))
            assert doc["tokens"] == expected
            peer = (doc["report"].get("decision") or {}).get("peer") or {}
            assert peer.get("node_id") != "rogue0001"
            assert doc["report"]["mode"] in ("overlap", "local")
    finally:
        with contextlib.suppress(Exception):
            agent.communicate("stop\n", timeout=10)
        server.kill()
        server.wait(10)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert seen, "the rogue was never even asked: the test would prove nothing"
    for r in seen:
        assert r["method"] == "GET" and r["path"].startswith("/v1/hello?nonce="), r
        assert "Authorization" not in r["headers"] and r["body"] == ""
    assert TOKEN not in log.read_text() and PROMPT.split()[0] not in log.read_text()
