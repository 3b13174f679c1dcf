"""Measured speeds and their cache (node/capabilities.py), and the node-side discovery pieces
that need no network namespace: static-peer presence, pair choice, interface resolution."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from exo_split.discovery import NodeInfo, PeerInfo, choose_pair, prefill_candidates
from exo_split.discovery.addresses import interface_addresses
from exo_split.discovery.presence import Presence, mdns_interfaces
from exo_split.node import capabilities
from exo_split.node.capabilities import (
    CACHE_VERSION,
    Speeds,
    cache_file,
    default_cache_dir,
    load_cached,
    measure_speeds,
    node_speeds,
    save_cached,
)

FP = "fp-tiny-0001"


def speeds(key: str = f"{FP}-mlx-cpu-float32", **kw: Any) -> Speeds:
    base = dict(prefill_tps=3000.0, decode_tps=300.0, prefill_tokens=256, decode_steps=32,
                seconds=0.4, key=key)  # fmt: skip
    return Speeds(**{**base, **kw})


def test_cache_dir_follows_the_environment(tmp_path) -> None:
    assert default_cache_dir({"EXO_SPLIT_CACHE": str(tmp_path)}) == tmp_path
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}).as_posix() == "/x/exo-split"
    assert default_cache_dir({}).name == "exo-split"


def test_cache_round_trip_and_what_it_refuses(tmp_path) -> None:
    s = speeds()
    path = save_cached(tmp_path, s)
    assert path == cache_file(tmp_path, s.key) and path.is_file()
    assert load_cached(tmp_path, s.key) == s
    assert load_cached(tmp_path, "other-key") is None
    doc = json.loads(path.read_text())
    for bad in ({**doc, "version": CACHE_VERSION - 1}, {**doc, "decode_tps": -1}, "garbage"):
        path.write_text(json.dumps(bad))
        assert load_cached(tmp_path, s.key) is None


def test_real_warmup_is_short_and_cached_per_model(checkpoint, tmp_path) -> None:
    from exo_split.backends import load_backend

    backend = load_backend("mlx", checkpoint("llama"), dtype="float32", device="cpu")
    measured, cached = node_speeds(backend, tmp_path)
    assert not cached
    assert measured.prefill_tps > 0 and measured.decode_tps > 0
    assert measured.seconds > 0 and measured.decode_steps >= 2
    assert measured.key.startswith(backend.spec.fingerprint) and measured.key.endswith("float32")
    again, cached = node_speeds(backend, tmp_path)
    assert cached and again == measured
    calls = []
    fresh, cached = node_speeds(backend, tmp_path, remeasure=True,
                                measure=lambda b: calls.append(b) or speeds(measured.key))  # fmt: skip
    assert not cached and calls == [backend] and load_cached(tmp_path, measured.key) == fresh


class ClockedBackend:
    """A backend whose work only moves a fake clock: a prefill costs `overhead` plus
    `per_token` per token, a decode step `per_step` (binary fractions: exact sums)."""

    name, device, dtype = "fake", "cpu", "float32"

    def __init__(self, per_token: float, per_step: float, overhead: float = 1 / 64):
        self.spec = SimpleNamespace(fingerprint=FP, vocab_size=512, max_position_embeddings=4096)
        self.per_token, self.per_step, self.overhead = per_token, per_step, overhead
        self.now, self.prefills, self.steps = 0.0, [], 0

    def clock(self) -> float:
        return self.now

    def prefill(self, ids, *, capacity):
        self.now += self.overhead + self.per_token * len(ids)
        self.prefills.append(len(ids))
        return SimpleNamespace(cache=None)

    def step(self, cache, token_id):
        self.now += self.per_step
        self.steps += 1

    def decode(self, cache, first_token, *, max_tokens, sampling, should_stop=None, stats=None):
        for _ in range(1, max_tokens):  # Backend.decode's contract: should_stop between steps
            if should_stop is not None and should_stop():
                return
            self.step(cache, first_token)
            stats.steps += 1
            yield first_token


@pytest.mark.parametrize(
    "per_token,per_step,want",
    [
        # Fast: 256 tokens fit half the budget, the long prefill is cheap enough to run twice
        # and all 32 decode steps fit.
        (1 / 4096, 1 / 64, dict(prefills=[16, 32, 32, 256, 256], tokens=256, steps=32)),
        # Slow prefill: the long prompt shrinks to fit half the 4 s budget (124 tokens cost
        # 1.95 s), and decode stops at its deadline (1 s, a quarter of the budget: 8 steps).
        (1 / 64, 1 / 8, dict(prefills=[16, 32, 32, 124], tokens=124, steps=8)),
        # A decode step longer than the whole budget: still the two steps a rate needs.
        (1 / 64, 8.0, dict(prefills=[16, 32, 32, 124], tokens=124, steps=2)),
    ],
    ids=["fast", "slow-prefill", "slow-decode"],
)
def test_warmup_fits_its_budget(monkeypatch, per_token, per_step, want) -> None:
    """The budget logic on a fake clock: no wall time involved, so no threshold to flake."""
    backend = ClockedBackend(per_token, per_step)
    monkeypatch.setattr(capabilities, "clock", backend.clock)
    got = measure_speeds(backend, budget_s=4.0)
    assert backend.prefills == want["prefills"]
    assert got.prefill_tokens == want["tokens"]
    assert got.decode_steps == backend.steps == want["steps"]
    # The rates are the fake's own: per-token slope without the per-call overhead, steps/s.
    assert got.prefill_tps == pytest.approx(1 / per_token)
    assert got.decode_tps == pytest.approx(1 / per_step)
    assert got.seconds == backend.now
    assert backend.per_token * got.prefill_tokens <= 4.0 / 2  # the timed long prefill


def peer(node_id: str, backend: str, *, fp: str = FP, **kw: Any) -> PeerInfo:
    node = NodeInfo(node_id=node_id, name=node_id, backend=backend, device="cpu", model="tiny",
                    fingerprint=fp, **kw)  # fmt: skip
    return PeerInfo.from_node(node, host="10.0.0.1", port=8000 + len(node_id), source="mdns")


def test_prefill_candidates_rank_and_exclude() -> None:
    fast, slow = peer("a", "torch", prefill_tps=9000), peer("b", "mlx", prefill_tps=100)
    other = peer("c", "torch", fp="another-model", prefill_tps=99999)
    assert prefill_candidates([slow, other, fast], FP) == [fast, slow]
    assert prefill_candidates([slow, fast], FP, exclude=["a"]) == [slow]


def test_choose_pair_picks_the_model_two_nodes_serve() -> None:
    t, m = peer("t", "torch", prefill_tps=900), peer("m", "mlx", decode_tps=300)
    lone = peer("x", "torch", fp="lonely-model")
    fp, prefill, decode = choose_pair([lone, m, t])
    assert (fp, prefill.node_id, decode.node_id) == (FP, "t", "m")
    assert choose_pair([lone, m, t], fingerprint="lonely")[1:] == (lone, lone)
    with pytest.raises(ValueError, match="no node serving fingerprint zzz"):
        choose_pair([t, m], fingerprint="zzz")
    with pytest.raises(ValueError, match="several models"):
        choose_pair([t, m, peer("t2", "torch", fp="fp2"), peer("m2", "mlx", fp="fp2")])


def test_interfaces_by_name_or_address() -> None:
    assert interface_addresses(["127.0.0.1"]) == ["127.0.0.1"]
    assert "127.0.0.1" in interface_addresses(["lo"])
    with pytest.raises(ValueError, match="no interface or address 'no-such-if0'"):
        interface_addresses(["no-such-if0"])
    assert mdns_interfaces("10.1.2.3", None) == ["10.1.2.3"]
    assert mdns_interfaces("0.0.0.0", ["10.9.9.9"]) == ["10.9.9.9"]
    assert all(":" not in a for a in mdns_interfaces("0.0.0.0", None) or [])


def test_presence_without_mdns_merges_static_peers_and_retries_failures() -> None:
    me = NodeInfo(node_id="me", name="me", backend="mlx", device="cpu", model="tiny",
                  fingerprint=FP)  # fmt: skip
    up = {"10.0.0.2": True, "10.0.0.3": False}
    asked: list[str] = []

    async def fetch_info(host: str, port: int) -> dict:
        asked.append(host)
        if not up[host]:
            raise ConnectionRefusedError(f"{host}:{port} refused")
        node = NodeInfo(node_id=f"id-{host}", name=host, backend="torch", device="cpu",
                        model="tiny", fingerprint=FP, prefill_tps=5000)  # fmt: skip
        return node.to_info_dict()

    async def run() -> None:
        presence = Presence(me, fetch_info=fetch_info, static=["10.0.0.2:1", "10.0.0.3:1"],
                            mdns=False)  # fmt: skip
        await presence.start(9999)
        assert not presence.advertising and presence.mdns_error is None
        peers = await presence.peers()  # the failed one is asked again
        assert [p.node_id for p in peers] == ["id-10.0.0.2"] and peers[0].source == "static"
        assert asked.count("10.0.0.3") == 2 and "refused" in presence.static_failures()[0]
        up["10.0.0.3"] = True
        peers = await presence.peers()
        assert {p.node_id for p in peers} == {"id-10.0.0.2", "id-10.0.0.3"}
        n = len(asked)
        await presence.peers()  # all answered recently: no probing
        assert len(asked) == n
        known = presence.known()
        assert known[0]["capabilities"]["prefill_tps"] == 5000 and known[0]["found_at"]
        await presence.stop()

    asyncio.run(run())
