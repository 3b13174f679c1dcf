"""Discovery: mDNS between two network namespaces, static peers, merging and role choice.

mDNS never leaves namespaces these tests create: each zeroconf instance runs in a
subprocess (tests/mdns_agent.py) started with `ip netns exec` inside a veth-joined pair
of namespaces (exo_split/bench/netns.py), bound to the veth addresses. No zeroconf code runs in
this process. Without root or `ip netns` those tests skip; the rest are pure.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout, web

from exo_split.bench.netns import (
    Netns,
    netns_pair,
    netns_unavailable_reason,
    ns_exec_prefix,
    rate_bits,
)
from exo_split.discovery import (
    ENV_VAR,
    TXT_KEYS,
    Advertiser,
    Browser,
    NodeInfo,
    PeerAddress,
    PeerInfo,
    check_txt,
    choose_roles,
    merge_peers,
    node_from_txt,
    node_txt,
    parse_peer,
    parse_peers,
    peers_from_env,
    prefill_candidates,
    probe_static,
)
from exo_split.discovery.addresses import pick_host
from exo_split.discovery.mdns import instance_label
from exo_split.discovery.peers import format_url

REPO = Path(__file__).resolve().parent.parent
AGENT = Path(__file__).with_name("mdns_agent.py")
TOKEN = "tok-3b1f9c0e-never-in-mdns"
FP = "fp-tiny-llama-0001"


def node(node_id: str = "a" * 32, **kw: Any) -> NodeInfo:
    fields = dict(name="spark", backend="torch", device="cuda", model="tiny", fingerprint=FP)
    return NodeInfo(node_id=node_id, **{**fields, **kw})


def peer(node_id: str, *, source: str = "mdns", seen_at: float = 1.0, **kw: Any) -> PeerInfo:
    where = {"host": kw.pop("host", "10.0.0.1"), "port": kw.pop("port", 8470)}
    return PeerInfo.from_node(node(node_id, **kw), **where, source=source, seen_at=seen_at)


# ---- static addresses -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("10.0.0.2:8470", "10.0.0.2", 8470),
        (" spark.local:1 ", "spark.local", 1),
        ("my_host-2:65535", "my_host-2", 65535),
        ("[::1]:8470", "::1", 8470),
        ("[fe80::1%en0]:9000", "fe80::1%en0", 9000),
    ],
)
def test_parse_peer_accepts(text: str, host: str, port: int) -> None:
    assert parse_peer(text) == PeerAddress(host, port)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("10.0.0.2", "missing port"),
        ("spark:", "missing port"),
        (":8470", "missing host"),
        ("spark:0", "1-65535"),
        ("spark:65536", "1-65535"),
        ("spark:http", "must be a number"),
        ("fe80::1:8470", "in brackets"),
        ("[::1]8470", "missing port"),
        ("[::1:8470", "no closing bracket"),
        ("[spark]:8470", "not an IPv6 address"),
        ("300.1.2.3:8470", "not an IPv4 address"),
        ("bad host:8470", "not a valid hostname"),
        ("http://spark:8470", "without a scheme"),
    ],
)
def test_parse_peer_rejects_with_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_peer(text)


def test_peer_address_round_trips_and_urls() -> None:
    for text in ("10.0.0.2:8470", "[fe80::1%en0]:9000", "spark.local:1"):
        assert str(parse_peer(text)) == text
    assert parse_peer("[fe80::1%en0]:9000").url == "http://[fe80::1%25en0]:9000"
    assert peer("n1", host="::1", port=5).url == "http://[::1]:5"
    assert peer("n1", host="10.0.0.1", port=5).url == "http://10.0.0.1:5"
    assert format_url("spark.local", 80) == "http://spark.local:80"


def test_peers_from_env() -> None:
    env = {ENV_VAR: " 10.0.0.2:8470,[::1]:1  spark:2,, 10.0.0.2:8470"}
    assert peers_from_env(env) == [
        PeerAddress("10.0.0.2", 8470),
        PeerAddress("::1", 1),
        PeerAddress("spark", 2),
    ]
    assert peers_from_env({}) == []
    assert peers_from_env({ENV_VAR: "  "}) == []
    with pytest.raises(ValueError, match=f"{ENV_VAR}: .*missing port"):
        peers_from_env({ENV_VAR: "10.0.0.2:1,spark"})
    assert parse_peers(["a:1", "b:2,a:1"]) == [PeerAddress("a", 1), PeerAddress("b", 2)]


# ---- static probing ---------------------------------------------------------------------


def test_probe_static_reports_failures_without_raising() -> None:
    good = node("b" * 32, backend="mlx", device="metal", decode_tps=41.0)
    asked: list[int] = []
    all_in = asyncio.Event()

    async def fetch_info(host: str, port: int) -> dict[str, Any]:
        # Each probe waits until all four are in flight: probed one after another, the
        # first would time out and h:1 would not be found (no clock needed to see it).
        asked.append(port)
        if len(asked) == 4:
            all_in.set()
        await all_in.wait()
        if port == 1:
            return good.to_info_dict()
        if port == 2:
            raise ConnectionRefusedError(111, "Connection refused")
        if port == 3:
            await asyncio.sleep(10)
        return {"node_id": "x"}  # port 4: not a /v1/info answer

    result = asyncio.run(
        probe_static(
            ["h:1", PeerAddress("h", 2), "h:3", "h:4", "h:1"], fetch_info=fetch_info, timeout=0.3
        )
    )
    assert sorted(asked) == [1, 2, 3, 4]  # once per distinct address
    (found,) = result.peers
    assert found.source == "static" and (found.host, found.port) == ("h", 1)
    assert found.decode_tps == 41.0 and found.backend == "mlx" and found.addresses == ("h",)
    reasons = {f.address.port: f.reason for f in result.failures}
    assert set(reasons) == {2, 3, 4}
    assert "ConnectionRefusedError" in reasons[2] and "refused" in reasons[2]
    assert "within 0.3 s" in reasons[3]  # each probe is bounded
    assert "bad GET /v1/info answer: missing field(s) name" in reasons[4]


def test_probe_static_against_a_real_http_server() -> None:
    info = node("c" * 32, prefill_tps=1234.5).to_info_dict()

    async def handle_info(request: web.Request) -> web.Response:
        return web.json_response(info)

    async def fetch_info(host: str, port: int) -> dict[str, Any]:
        async with (
            ClientSession(timeout=ClientTimeout(total=2)) as session,
            session.get(format_url(host, port) + "/v1/info") as resp,
        ):
            resp.raise_for_status()
            return await resp.json()

    async def scenario() -> Any:
        app = web.Application()
        app.router.add_get("/v1/info", handle_info)
        runner = web.AppRunner(app)
        await runner.setup()
        with socket.socket() as listening, socket.socket() as closed:
            listening.bind(("127.0.0.1", 0))
            closed.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
            try:
                await web.SockSite(runner, listening).start()
                addrs = [f"127.0.0.1:{s.getsockname()[1]}" for s in (listening, closed)]
                return await probe_static(addrs, fetch_info=fetch_info, timeout=2.0)
            finally:
                await runner.cleanup()

    result = asyncio.run(scenario())
    (found,) = result.peers
    assert found.prefill_tps == 1234.5 and found.node_id == "c" * 32
    (failure,) = result.failures
    assert "Cannot connect" in failure.reason or "refused" in failure.reason.lower()


# ---- node info, TXT and the token guard -------------------------------------------------


def test_info_dict_and_txt_round_trip() -> None:
    n = node(prefill_tps=9876.54321, decode_tps=None, roles=("prefill",))
    assert NodeInfo.from_info_dict(n.to_info_dict()) == n
    txt = node_txt(n)
    assert set(txt) <= set(TXT_KEYS) and "dtps" not in txt  # unknown speeds are omitted
    assert all(isinstance(v, str) for v in txt.values())
    back = node_from_txt(txt)
    assert back.prefill_tps == pytest.approx(9876.54, rel=1e-5)
    assert replace(back, prefill_tps=n.prefill_tps) == n
    with pytest.raises(ValueError, match="lacks fp"):
        node_from_txt({k: v for k, v in txt.items() if k != "fp"})
    with pytest.raises(ValueError, match="backend must be one of torch, mlx"):
        node_from_txt({**txt, "be": "jax"})
    with pytest.raises(ValueError, match="prefill_tps must be a finite"):
        node(prefill_tps=float("nan"))
    # A quantized decode node says so in both; a node's /v1/info holds the whole description.
    q = node(backend="mlx", device="metal", quantization="q4g64-affine")
    assert node_txt(q)["q"] == "q4g64-affine" and node_from_txt(node_txt(q)) == q
    info = {**q.to_info_dict(), "quantization": {"bits": 4, "tag": "q4g64-affine"}}
    assert NodeInfo.from_info_dict(info) == q and "q" not in txt


def test_the_prefill_role_prefers_full_precision_weights() -> None:
    quick_q4 = peer("q" * 32, backend="mlx", prefill_tps=9000.0, quantization="q4g64-affine")
    slow_full = peer("f" * 32, backend="mlx", prefill_tps=500.0)
    assert [p.node_id for p in prefill_candidates([quick_q4, slow_full], FP)] == [
        "f" * 32,
        "q" * 32,
    ]


@pytest.mark.parametrize("key", ["token", "auth", "AUTH_TOKEN", "secret", "password", "apikey"])
def test_txt_guard_refuses_credential_keys(key: str) -> None:
    with pytest.raises(ValueError, match="credentials never go in mDNS"):
        check_txt({**node_txt(node()), key: "x"})


def test_txt_guard_refuses_secret_values_and_never_echoes_them() -> None:
    check_txt(node_txt(node()), never_publish=[TOKEN, ""])  # clean record passes
    leaky = node(name=f"spark-{TOKEN}")
    with pytest.raises(ValueError, match="contains a secret") as info:
        Advertiser(leaky, 8470, never_publish=[TOKEN])  # refused before any socket opens
    assert TOKEN not in str(info.value)
    with pytest.raises(ValueError, match="255 bytes"):
        check_txt({"model": "m" * 300})


def test_instance_label_and_host_choice() -> None:
    assert instance_label("0123456789abcdef", "Spark.local") == "Spark-01234567"
    assert instance_label("ab", "my host!") == "my-host-ab"
    lan = [ipaddress.ip_network("192.168.1.0/24")]
    addrs = ["172.17.0.1", "fe80::1%eth0", "192.168.1.7", "fd00::7"]
    assert pick_host(addrs, lan) == "192.168.1.7"  # the subnet we share wins
    assert pick_host(addrs) == "172.17.0.1"  # else IPv4 first
    assert pick_host(["fe80::1%eth0", "fd00::7", "127.0.0.1"]) == "fd00::7"


def test_browser_wait_for_times_out_and_interfaces_are_checked() -> None:
    with pytest.raises(asyncio.TimeoutError, match="no matching peers within 0.05 s"):
        asyncio.run(Browser().wait_for(lambda peers: bool(peers), timeout=0.05))
    assert asyncio.run(Browser().wait_for(lambda peers: True, timeout=0.05)) == []
    with pytest.raises(ValueError, match="must be IP addresses"):
        Browser(interfaces=["eth0"])
    with pytest.raises(ValueError, match="pass None for all"):
        Advertiser(node(), 8470, interfaces=["0.0.0.0"])
    with pytest.raises(ValueError, match="port must be 1-65535"):
        Advertiser(node(), 0)


# ---- merge and roles --------------------------------------------------------------------


def test_merge_peers_dedups_by_node_id() -> None:
    a_mdns = peer("A", host="10.0.0.1", port=8470, seen_at=5.0, prefill_tps=900.0)
    b_mdns = peer("B", host="10.0.0.2", seen_at=5.0, backend="mlx", device="metal")
    a_static = peer("A", source="static", host="spark.lan", port=8470, seen_at=2.0)
    c_static = peer("C", source="static", host="10.0.0.3")
    merged = merge_peers([a_mdns, b_mdns], [a_static, c_static])
    assert [p.node_id for p in merged] == ["A", "B", "C"]  # order of first appearance
    a = merged[0]
    assert a.source == "both"
    assert (a.host, a.port) == ("spark.lan", 8470)  # the address we actually reached
    assert a.addresses == ("spark.lan", "10.0.0.1")
    assert a.prefill_tps == 900.0  # the fresher sighting's figure
    assert merged[1] == b_mdns and merged[2] == c_static

    # A fresher sighting wins the figures; one that does not know a figure keeps the old.
    newer = peer("A", seen_at=9.0, prefill_tps=1100.0, decode_tps=None)
    older = peer("A", seen_at=1.0, prefill_tps=800.0, decode_tps=30.0)
    (m,) = merge_peers([older], [newer])
    assert (m.prefill_tps, m.decode_tps, m.source) == (1100.0, 30.0, "mdns")
    assert merge_peers() == [] and merge_peers([a], [a]) == [a]


def test_choose_roles_by_measured_speed() -> None:
    cuda = peer("cuda", prefill_tps=9000.0, decode_tps=30.0)
    mac = peer("mac", backend="mlx", device="metal", prefill_tps=1500.0, decode_tps=45.0)
    cpu = peer("cpu", device="cpu", prefill_tps=200.0, decode_tps=5.0)
    other_model = peer("x", fingerprint="other", prefill_tps=1e6, decode_tps=1e6)
    assert choose_roles([cpu, mac, other_model, cuda], FP) == (cuda, mac)
    assert choose_roles([cuda], FP) == (cuda, cuda)  # one node: it does both
    assert choose_roles([other_model], FP) == (None, None)
    assert choose_roles([], FP) == (None, None)
    future = replace(mac, protocol=99)
    assert choose_roles([future], FP) == (None, None)
    assert choose_roles([future], FP, protocol=None) == (future, future)
    decode_only = replace(mac, roles=("decode",))
    assert choose_roles([decode_only], FP) == (None, decode_only)


def test_choose_roles_ties_and_unknown_speeds() -> None:
    # Nothing measured yet: torch/cuda prefills, mlx/metal decodes.
    torch_cpu = peer("t-cpu", device="cpu")
    torch_cuda = peer("t-cuda")
    mlx_cpu = peer("m-cpu", backend="mlx", device="cpu")
    mlx_metal = peer("m-metal", backend="mlx", device="metal")
    assert choose_roles([mlx_cpu, torch_cpu, mlx_metal, torch_cuda], FP) == (torch_cuda, mlx_metal)
    # A measured speed beats an unknown one.
    measured = replace(mlx_cpu, prefill_tps=10.0)
    assert choose_roles([torch_cuda, measured], FP)[0] == measured


def test_choose_roles_keeps_the_two_apart() -> None:
    # The CUDA box is best at both; giving up decode costs it less (40 vs 38 tok/s)
    # than giving up prefill (9000 vs 1500), so the Mac decodes.
    cuda = peer("cuda", prefill_tps=9000.0, decode_tps=40.0)
    mac = peer("mac", backend="mlx", device="metal", prefill_tps=1500.0, decode_tps=38.0)
    assert choose_roles([mac, cuda], FP) == (cuda, mac)
    # The other way round: the big box is a far better decoder, a barely better prefiller.
    big = peer("big", prefill_tps=1000.0, decode_tps=100.0)
    small = peer("small", prefill_tps=950.0, decode_tps=10.0)
    assert choose_roles([big, small], FP) == (small, big)


# ---- the namespace helper ---------------------------------------------------------------


def test_rate_parsing_for_tbf() -> None:
    assert rate_bits("1gbit") == 10**9
    assert rate_bits("800mbit") == 800 * 10**6
    assert rate_bits("125mbps") == 10**9
    assert rate_bits(5000) == 5000
    with pytest.raises(ValueError, match="tc rate"):
        rate_bits("fast")


@pytest.mark.netns
def test_netns_pair_is_shaped_isolated_and_cleaned_up() -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    echo = "import socket,sys; s=socket.create_server((sys.argv[1], 9000)); c,_=s.accept(); c.sendall(c.recv(5))"
    hello = (
        "import socket,sys,time\n"
        "for _ in range(100):\n"
        "    try: c = socket.create_connection((sys.argv[1], 9000), timeout=1); break\n"
        "    except OSError: time.sleep(0.05)\n"
        "c.sendall(b'hello'); print(c.recv(5).decode())"
    )
    with netns_pair(rate="100mbit") as (a, b):
        qdisc = subprocess.run(
            [*ns_exec_prefix(a), "tc", "qdisc", "show", "dev", a.veth],
            capture_output=True,
            text=True,
        )
        assert "tbf" in qdisc.stdout and "rate 100Mbit" in qdisc.stdout
        host_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        assert a.ipv4 not in host_addrs and b.ipv4 not in host_addrs  # only inside the pair
        server = subprocess.Popen([*ns_exec_prefix(b), sys.executable, "-c", echo, b.ipv4])
        try:
            client = subprocess.run(
                [*ns_exec_prefix(a), sys.executable, "-c", hello, b.ipv4],
                capture_output=True,
                text=True,
                timeout=20,
            )
            assert client.stdout.strip() == "hello", client.stderr
        finally:
            server.kill()
            server.wait(timeout=10)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert a.name not in names and b.name not in names


def test_discovery_imports_no_ml_framework() -> None:
    code = "import sys, exo_split.discovery; print(sorted({'torch', 'mlx'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- mDNS between two namespaces --------------------------------------------------------


class Agent:
    """One tests/mdns_agent.py process inside a namespace; its JSON events in a queue."""

    def __init__(self, ns: Netns, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [*ns_exec_prefix(ns), sys.executable, str(AGENT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read_events, daemon=True),
            threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_events(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.events.put(json.loads(line))

    def expect(self, what: str, predicate: Callable[[dict], bool], timeout: float) -> dict:
        """The next event that satisfies `predicate`; fails the test after `timeout` s."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=remaining)
            except queue.Empty:
                break
            if predicate(event):
                return event
        pytest.fail(
            f"{what}: not seen within {timeout} s from agent {self.args}; "
            f"exit={self.proc.poll()} stderr={''.join(self.stderr)[-2000:]}"
        )

    def drain(self) -> list[dict]:
        """The events received so far and not yet consumed."""
        events = []
        while not self.events.empty():
            events.append(self.events.get_nowait())
        return events

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def stop(self) -> dict:
        """Clean stop; returns the final event (leftover threads, slow callbacks)."""
        self.send("stop")
        stopped = self.expect("clean stop", lambda e: e["event"] == "stopped", 10)
        assert self.proc.wait(timeout=10) == 0
        assert stopped["threads"] == [], "zeroconf left threads running"
        assert stopped["slow_callbacks"] == [], "the event loop was blocked"
        return stopped

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for reader in self._readers:
            reader.join(timeout=5)


@pytest.fixture
def ns_pair() -> Iterator[tuple[Netns, Netns]]:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with netns_pair(ipv6=True) as pair:
        yield pair


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "MDNS_AGENT_HOST_NETNS": str(os.stat("/proc/self/ns/net").st_ino),
        "EXO_SPLIT_TOKEN": TOKEN,  # what a real node has in its environment
    }
    started: list[Agent] = []

    def start(ns: Netns, *args: str) -> Agent:
        agent = Agent(ns, list(args), env)
        started.append(agent)
        return agent

    try:
        yield start
    finally:
        for agent in started:
            agent.kill()


def peer_in(event: dict, node_id: str) -> dict | None:
    if event["event"] != "peers":
        return None
    return next((p for p in event["peers"] if p["node_id"] == node_id), None)


def from_json(p: dict) -> PeerInfo:
    return PeerInfo(**{**p, "roles": tuple(p["roles"]), "addresses": tuple(p["addresses"])})


def node_args(ns: Netns, node_id: str, port: int, *extra: str) -> list[str]:
    return ["node", "--iface", ns.ipv4, "--node-id", node_id, "--port", str(port), *extra]


@pytest.mark.netns
def test_two_nodes_discover_each_other_within_3s(ns_pair, agents) -> None:
    a, b = ns_pair
    id_a, id_b = "a1" * 16, "b2" * 16
    both = ["--fp", FP, "--browse"]
    spark_args = ["--backend", "torch", "--device", "cuda", "--ptps", "9000.5"]
    mac_args = ["--backend", "mlx", "--device", "metal", "--dtps", "41.5"]
    spark = agents(a, *node_args(a, id_a, 8101, "--iface", a.ipv6, *both, *spark_args))
    mac = agents(b, *node_args(b, id_b, 8102, "--iface", b.ipv6, *both, *mac_args))
    started = [
        ag.expect("start", lambda e: e["event"] == "started", 20)["t"] for ag in (spark, mac)
    ]
    seen_by_mac = mac.expect("spark found", lambda e: peer_in(e, id_a) is not None, 10)
    seen_by_spark = spark.expect("mac found", lambda e: peer_in(e, id_b) is not None, 10)
    latency = max(seen_by_mac["t"], seen_by_spark["t"]) - max(started)
    print(f"mutual discovery in {latency:.2f} s")
    assert latency < 3.0

    found_spark, found_mac = peer_in(seen_by_mac, id_a), peer_in(seen_by_spark, id_b)
    assert found_spark["backend"] == "torch" and found_spark["device"] == "cuda"
    assert found_spark["fingerprint"] == FP and found_spark["source"] == "mdns"
    assert (found_spark["prefill_tps"], found_spark["decode_tps"]) == (9000.5, None)
    assert (found_spark["host"], found_spark["port"]) == (a.ipv4, 8101)
    assert set(found_spark["addresses"]) == {a.ipv4, a.ipv6}  # IPv4 and IPv6 advertised
    assert found_mac["backend"] == "mlx" and found_mac["device"] == "metal"
    assert (found_mac["prefill_tps"], found_mac["decode_tps"]) == (None, 41.5)
    assert (found_mac["host"], found_mac["port"]) == (b.ipv4, 8102)
    as_peers = [from_json(p) for p in (found_mac, found_spark)]
    prefill, decode = choose_roles(as_peers, FP)
    assert (prefill.node_id, decode.node_id) == (id_a, id_b)

    # What actually went on the air carries no token and only documented keys.
    for event, node_id in ((seen_by_mac, id_a), (seen_by_spark, id_b)):
        txt = event["txt"][node_id]
        assert set(txt) <= set(TXT_KEYS)
        assert TOKEN not in json.dumps(txt)

    # Measured speeds are re-published and reach the live browser on the other side.
    spark.send("update 9100 12.5")
    updated = mac.expect(
        "updated speeds", lambda e: (p := peer_in(e, id_a)) and p["decode_tps"] == 12.5, 5
    )
    assert peer_in(updated, id_a)["prefill_tps"] == 9100.0
    spark.stop()
    mac.stop()


@pytest.mark.netns
def test_clean_stop_disappears_and_restart_is_found_on_new_port(ns_pair, agents) -> None:
    a, b = ns_pair
    node_id = "c3" * 16
    watcher = agents(b, "browse", "--iface", b.ipv4, "--wait-for", node_id)
    first = agents(a, *node_args(a, node_id, 8201))
    up = watcher.expect("Browser.wait_for", lambda e: e["event"] == "waited", 10)
    assert [(p["node_id"], p["port"]) for p in up["peers"]] == [(node_id, 8201)]

    t_stop = time.monotonic()  # CLOCK_MONOTONIC is shared by all network namespaces
    first.stop()
    gone = watcher.expect(
        "node gone", lambda e: e["event"] == "peers" and peer_in(e, node_id) is None, 5
    )
    # Seen within the 5 s wait, so a goodbye, not the records' TTL (minutes) running out.
    print(f"clean stop seen by the peer after {gone['t'] - t_stop:.2f} s")

    # Restarted on another port, on all of its interfaces this time (no --iface).
    second = agents(a, "node", "--node-id", node_id, "--port", "8202")
    back = watcher.expect("node back", lambda e: peer_in(e, node_id) is not None, 10)
    found = peer_in(back, node_id)
    assert (found["host"], found["port"]) == (a.ipv4, 8202)
    assert set(found["addresses"]) == {a.ipv4, a.ipv6}  # no loopback, no link-local

    once = agents(b, "browse-once", "--iface", b.ipv4, "--timeout", "1.5")
    browsed = once.expect("one-shot browse", lambda e: e["event"] == "browsed", 15)
    assert [(p["node_id"], p["port"]) for p in browsed["peers"]] == [(node_id, 8202)]
    done = once.expect("one-shot exit", lambda e: e["event"] == "stopped", 5)
    assert done["threads"] == [] and done["slow_callbacks"] == []
    second.stop()
    watcher.stop()


@pytest.mark.netns
def test_crashed_node_is_dropped_after_its_ttl(ns_pair, agents) -> None:
    a, b = ns_pair
    node_id = "d4" * 16
    watcher = agents(b, "browse", "--iface", b.ipv4, "--recheck", "0.5")
    crasher = agents(a, *node_args(a, node_id, 8301, "--ttl", "2"))
    watcher.expect("node up", lambda e: peer_in(e, node_id) is not None, 10)
    time.sleep(3.0)  # past the TTL: a live node answers the recheck and stays listed
    assert all(peer_in(e, node_id) for e in watcher.drain() if e["event"] == "peers")

    t_kill = time.monotonic()
    crasher.kill()  # SIGKILL: no goodbye
    gone = watcher.expect(
        "node dropped", lambda e: e["event"] == "peers" and peer_in(e, node_id) is None, 10
    )
    # Within the 10 s wait: the 2 s TTL ran out (ttl + recheck + resolve timeout is 5.5 s),
    # where the default TTL would have kept it listed for minutes.
    print(f"crashed node dropped after {gone['t'] - t_kill:.2f} s (ttl 2 s)")
    watcher.stop()
