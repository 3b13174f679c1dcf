"""The policy learns from the requests it serves (node/learn.py, issue 19): speeds per
prompt-length range with the start-up probe as the prior, exploring a peer that only has
its probe behind it, and a prefill node that corrects its advertised and cached speed.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from nodes import TOKEN, NodeProcess, request

from exo_split.node import policy
from exo_split.node.capabilities import Speeds, backend_key, load_cached, save_cached
from exo_split.node.learn import Explorer, Learned, SpeedEstimate

pytestmark = pytest.mark.timeout(300)


def test_an_estimate_starts_at_its_prior_and_follows_real_prefills():
    est = SpeedEstimate(prior=30.0)
    assert est.value(1000) == (30.0, "probe") and not est.learned
    assert not est.observe(8, 0.1)  # too short to measure a speed
    assert est.observe(1000, 2.0)  # 500 tok/s in the 513-2048 range
    assert est.value(1500) == (500.0, "learned (1 request, 513-2048 tokens)")
    assert est.value(100) == (500.0, "learned (1 request, 513-2048 tokens)")  # the nearest
    est.observe(1000, 1.0)  # 1000 tok/s: the average moves half way
    assert est.value(1000)[0] == 750.0
    est.observe(20000, 10.0)
    assert est.value(30000)[0] == 2000.0 and est.headline() == 2000.0
    assert est.to_dict()["learned"]["8193-32768"] == {"tps": 2000.0, "requests": 1}


def test_a_peer_with_only_its_probe_is_explored_once_per_period():
    explorer = Explorer(every_s=600, min_tokens=1000)
    fresh = SpeedEstimate(prior=1.0)
    assert not explorer.should("http://p", 500, fresh)  # short prompts are never spent on it
    assert explorer.should("http://p", 2000, fresh)
    assert not explorer.should("http://p", 2000, fresh)  # once per period
    assert explorer.should("http://q", 2000, fresh)  # per peer
    known = SpeedEstimate(prior=1.0)
    known.observe(2000, 1.0)
    assert not Explorer().should("http://r", 5000, known)  # learned: the policy decides


def test_learned_reads_reports_and_reports_its_sources():
    learned = Learned(local_prior=200.0)
    remote = {"prefill_compute_s": 0.5, "prefix": {"computed_tokens": 1000}}
    learned.observe(remote, "http://p")
    learned.observe(remote | {"fallback": "local prefill: died"}, "http://p")  # ignored
    learned.observe({"prefill_compute_s": 4.0, "prefix": {"computed_tokens": 1000}}, None)
    assert learned.peer("http://p").value(1000)[0] == 2000.0
    assert learned.local.value(1000)[0] == 250.0
    sources = learned.sources("http://p", None, 1000)
    assert sources == {"local_prefill_tps": "learned (1 request, 513-2048 tokens)",
                       "peer_prefill_tps": "learned (1 request, 513-2048 tokens)"}  # fmt: skip
    # The decision the learned figures give: the peer at 2000 tok/s wins a long prompt.
    f = policy.figures_for(local_prefill_tps=learned.local.value(4000)[0],
                           peer_prefill_tps=learned.peer("http://p").value(4000)[0],
                           link=policy.LinkEstimate(1e9, 0.001, "probe", 0.0),
                           kv_bytes_per_token=1000, n_layers=4)  # fmt: skip
    assert policy.decide(4000, f).choice == "remote"


def test_served_prefills_move_the_headline_only_when_it_changed():
    learned = Learned(local_prior=30.0)
    assert learned.served(1000, 2.0) == 500.0  # 30 -> 500: advertise it
    assert learned.served(1000, 2.1) is None  # ~ the same: nothing to re-advertise


def test_a_probe_made_under_load_is_corrected_by_the_first_real_requests(llama, tmp_path):
    """The prefill node's cached speed says 1 tok/s (a probe made while the box was busy, as
    cached): the decode node explores it with the first long prompt, learns its real speed
    from that request, and decides on the learned figure next; the prefill node advertises
    and caches what it really does."""
    from exo_split.backends import load_backend

    cache = tmp_path / "prefill-cache"
    key = backend_key(load_backend("torch", llama))
    save_cached(cache, Speeds(prefill_tps=1.0, decode_tps=50.0, prefill_tokens=256,
                              decode_steps=8, seconds=1.0, key=key))  # fmt: skip
    prefill = NodeProcess(llama, "torch", tmp_path, env={"EXO_SPLIT_CACHE": str(cache)})
    decode = None
    try:
        prefill.wait_ready(180)
        decode = NodeProcess(llama, "mlx", tmp_path, "--model-name", "tiny", "--peer",
                             prefill.addr)  # fmt: skip
        decode.wait_ready(180)
        with openai.OpenAI(base_url=f"{decode.url}/v1", api_key=TOKEN, max_retries=0) as c:
            decisions = []
            for seed in (1, 2):
                prompt = [3 + (seed * 7 + 13 * i) % 500 for i in range(1100)]
                r = c.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                         temperature=0)  # fmt: skip
                decisions.append(r.exo_split["report"]["decision"])
        info = json.loads(asyncio.run(request("GET", f"{prefill.url}/v1/info"))[1])
    finally:
        prefill.stop()
        if decode is not None:
            decode.stop()
    first, second = decisions
    assert first["explored"] and first["choice"] == "remote", first["reason"]
    assert first["figure_sources"]["peer_prefill_tps"] == "probe"
    assert first["figures"]["peer_prefill_tps"] == 1.0
    assert "explored" not in second
    assert second["figure_sources"]["peer_prefill_tps"].startswith("learned (1 request")
    assert second["figures"]["peer_prefill_tps"] > 50  # the real speed, not the probe's 1
    local, remote = second["estimates"]["local_ttft_s"], second["estimates"]["remote_ttft_s"]
    assert second["choice"] == ("remote" if remote < local else "local")
    assert info["capabilities"]["prefill_tps"] > 50  # the prefill node learned it too
    assert load_cached(cache, key).prefill_tps > 50  # and its next start will not trust 1
