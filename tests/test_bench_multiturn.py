"""`exo-split bench --multiturn --quick`: a five-turn conversation on two real nodes on
127.0.0.1 (a tiny checkpoint given a chat template), each turn with and without prefix reuse.
What is checked is what must hold on any machine (the fields, how the runs relate, what
crossed the network); never how fast anything was."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from exo_split.bench.multiturn import TARGET_RATIO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
PREFIX_KEYS = {"decode_cached_tokens", "prefill_cached_tokens", "computed_tokens"}


@pytest.fixture(scope="module", params=["auto", "local"])
def bench(request, tmp_path_factory):
    """(card, JSON) of a quick run: turns >= 2 prefilled where the policy chooses, or on the
    decode node (the suffix-only local path, nothing on the wire)."""
    tmp = tmp_path_factory.mktemp("multiturn")
    env = {**os.environ, "EXO_SPLIT_CACHE": str(tmp / "cache"), "EXO_SPLIT_PEERS": ""}
    where = [] if request.param == "auto" else ["--suffix-prefill", request.param]
    proc = subprocess.run(
        [sys.executable, "-m", "exo_split", "bench", "--multiturn", "--quick",
         "--logs", str(tmp / "logs"), *where],
        capture_output=True, text=True, env=env, timeout=360,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    *card, line = proc.stdout.strip().splitlines()
    return "\n".join(card), json.loads(line)


def test_every_turn_is_measured_with_and_without_reuse(bench):
    card, doc = bench
    assert doc["schema"] == "exo-split.bench-multiturn/1" and doc["quick"] is True
    later = doc["suffix_prefill"]
    assert doc["command"] == "exo-split bench --multiturn --quick" + (
        "" if later == "auto" else f" --suffix-prefill {later}"
    )
    turns = doc["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4, 5]
    for t in turns:
        for run in (t["reuse"], t["no_reuse"]):
            assert run["ttft_s"] > 0 and run["prompt_tokens"] == t["prompt_tokens"]
            assert run["prefill"] in ("remote", "local") and run["decision"]
            assert isinstance(run["kv_bytes"], int) and set(run["prefix"]) == PREFIX_KEYS
            assert all(isinstance(v, int) for v in run["prefix"].values()), run["prefix"]
            # What crossed is a local prefill's nothing or a range that ends with the prompt.
            if run["prefill"] == "local":
                assert run["kv_bytes"] == 0 and run["moved"] is None
            else:
                assert run["kv_bytes"] > 0 and run["moved"][1] == t["prompt_tokens"]
        assert t["same_tokens"] is True  # float32 greedy: reuse changes no token
        # Without reuse nothing was held or reused, and the whole prompt was computed.
        plain = t["no_reuse"]
        assert (
            plain["prefix"]["decode_cached_tokens"] == plain["prefix"]["prefill_cached_tokens"] == 0
        )
        assert plain["prefix"]["computed_tokens"] == t["prompt_tokens"]
        assert plain["moved"] in (None, [0, t["prompt_tokens"]])
        assert plain["kv_bytes"] >= t["reuse"]["kv_bytes"]
        assert t["ttft_vs_no_reuse"] == pytest.approx(t["reuse"]["ttft_s"] / plain["ttft_s"])
        assert t["ttft_vs_turn1"] == pytest.approx(
            t["reuse"]["ttft_s"] / turns[0]["reuse"]["ttft_s"]
        )
    first = turns[0]["reuse"]["prefix"]
    assert first["decode_cached_tokens"] == 0  # a conversation nobody had before

    # Each later turn: the prompt carries the last prompt and (most of) its reply, the decode
    # node held that history and only the new tokens' KV crossed, if any crossed at all.
    for i, (before, t) in enumerate(zip(turns, turns[1:], strict=False)):
        assert t["history_tokens"] == before["prompt_tokens"] + before["reuse"]["generated_tokens"]
        assert before["prompt_tokens"] <= t["reusable_tokens"] <= t["history_tokens"]
        assert t["new_tokens"] == t["prompt_tokens"] - t["reusable_tokens"] > 0
        prefix = t["reuse"]["prefix"]
        held = prefix["decode_cached_tokens"]
        assert t["reusable_tokens"] - 1 <= held <= t["reusable_tokens"], t
        # Computed: the prompt less what the node that prefilled held.
        local = t["reuse"]["prefill"] == "local"
        assert local == (later == "local") or later == "auto"
        start = held if local else prefix["prefill_cached_tokens"]
        assert prefix["computed_tokens"] == t["prompt_tokens"] - start
        # Something was reused, unless the prefill node never saw this conversation before
        # (auto placed every earlier turn on the decode node: its own figures decide).
        if local or any(u["reuse"]["prefill"] == "remote" for u in turns[: i + 1]):
            assert start > 0, t
        assert t["only_new_kv"] is True
        if t["reuse"]["prefill"] == "remote":
            assert t["reuse"]["moved"] == [held, t["prompt_tokens"]]
            assert t["reuse"]["kv_bytes"] < plain_bytes(t)

    targets = doc["targets"]
    assert targets["only_new_kv"] == {"met": True, "turns_met": 4, "of": 4}
    assert targets["same_tokens"] is True
    for key in ("ttft_vs_turn1", "ttft_vs_no_reuse"):
        worst = max(t[key] for t in turns[1:])
        assert targets[key]["worst"] == pytest.approx(worst)
        assert targets[key]["met"] == (worst <= TARGET_RATIO)
    assert "targets (turns ≥ 2):" in card and "only the new tokens' KV moved: 4/4" in card


def plain_bytes(t: dict) -> int:
    """What the whole prompt's KV weighs, from a run that moved all of it (no reuse, remote),
    else from the reuse run's bytes per moved token."""
    plain = t["no_reuse"]
    if plain["prefill"] == "remote":
        return plain["kv_bytes"]
    a, b = t["reuse"]["moved"]
    return t["reuse"]["kv_bytes"] * t["prompt_tokens"] // (b - a)
