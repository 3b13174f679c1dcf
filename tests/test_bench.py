"""`exo-split bench --quick`: the benchmark runs end to end between two network namespaces of its
own and reports every figure. Only that the figures exist and are sane is checked, never how
fast anything was (the machine is shared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from exo_split.bench.netns import netns_unavailable_reason

_reason = netns_unavailable_reason()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.timeout(480),
    pytest.mark.skipif(_reason is not None, reason=_reason or ""),
]

POINT_KEYS = (
    "rate_mbit", "link_gbps", "compute_per_layer_s", "bytes_per_layer", "transfer_ratio",
    "t_overlap_s", "t_sequential_s", "t_ideal_s", "overlap_efficiency", "exposed_handoff_s",
    "handoff_target_s", "meets_handoff_target", "ideal_exposed_s", "hidden_fraction",
    "transport_gbps", "plain_gbps", "transport_vs_plain",
)  # fmt: skip


def _namespaces_of(pid: int) -> list[str]:
    """Namespaces that exo_split/bench/netns.py made for process `pid` (named exs<pid>x<n>a/b)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"exs{pid}x")]


def test_quick_bench_reports_every_figure(tmp_path):
    env = {**os.environ, "EXO_SPLIT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "exo_split", "bench", "--quick", "--logs", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:  # timed out: SIGTERM lets the bench remove its namespaces
            proc.terminate()
            proc.wait(30)
    assert proc.returncode == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    doc = json.loads(lines[-1])
    card = "\n".join(lines[:-1])
    assert "targets" in card and "decode ITL" in card
    assert "n/a (no such point)\n" in card and "()" not in card  # no empty detail on n/a

    assert doc["schema"] == "exo-split.bench/1" and doc["quick"] is True
    assert doc["unshaped_gbps"] > 0
    points = {(p["ratio"], p["prompt_tokens"]): p for p in doc["points"]}
    assert set(points) == {(r, n) for r in (0.6, 1.5) for n in (64, 256)}
    for p in points.values():
        for key in POINT_KEYS:
            assert key in p, key
        for key in ("t_overlap_s", "t_sequential_s", "t_ideal_s", "transport_gbps", "plain_gbps"):
            assert p[key] > 0, (key, p)
        assert all(p["ttft_s"][mode] > 0 for mode in ("overlap", "sequential", "local"))
        # Efficiency is null only when sequential was not slower than the bound.
        assert p["overlap_efficiency"] is not None or p["t_sequential_s"] <= p["t_ideal_s"]
        # Defined even for sub-ms pieces: each piece's send_start bounds the clock offset.
        assert p["hidden_fraction"] is not None and 0 <= p["hidden_fraction"] <= 1
    assert [local["prompt_tokens"] for local in doc["local"]] == [64, 256]
    (itl,) = doc["itl"]
    assert itl["prompt_tokens"] == 256 and itl["split_itl_p50_s"] > 0
    assert itl["mlx_lm_itl_p50_s"] > 0 and itl["ratio"] > 0
    assert itl["same_tokens"] is True  # float32 greedy: the split decodes what mlx-lm does
    for name in ("overlap_efficiency", "exposed_handoff", "transport_vs_plain"):
        assert doc["targets"][name]["met"] is None  # no prompt of 1,024 tokens in --quick
    assert doc["targets"]["decode_itl_ratio"]["worst"] == itl["ratio"]

    # The short-step decode section (bench/itl.py): every variant against mlx-lm.
    assert "short-step checkpoint" in card and "4-bit decode tok/s" in card
    st = doc["short_step"]
    assert st["config"]["num_hidden_layers"] == 4 and st["quantization"]["bits"] == 4
    rows = {(r["weights"], r["temperature"]): r for r in st["rows"]}
    assert set(rows) == {(w, t) for w in ("full", "q4") for t in (0.0, 0.8)}
    for r in rows.values():
        assert r["split_itl_p50_s"] > 0 and r["mlx_lm_itl_p50_s"] > 0 and r["ratio"] > 0
        # CPU per token, by kind of thread: the node's compute thread is told apart by name.
        assert r["split_host_per_token_s"] > 0 and r["split_mlx_per_token_s"] > 0
        assert r["mlx_lm_host_per_token_s"] > 0 and r["mlx_lm_mlx_per_token_s"] > 0
        assert 0 <= r["host_corrected"] <= r["host_checked"] <= r["decode_steps"]
    # Greedy, mlx-lm decodes from the same handed-off state: the same tokens, 4-bit too.
    assert rows["full", 0.0]["same_tokens"] is True and rows["q4", 0.0]["same_tokens"] is True
    assert st["q_speed"]["split"] > 0 and st["q_speed"]["mlx_lm"] > 0
    assert st["target"]["worst_full_precision"] == max(rows["full", t]["ratio"] for t in (0.0, 0.8))
    assert len(st["load_average_1m"]) == 2

    # The real-size section (bench/scale.py), small in --quick: 8 KV heads x 128, 4 MiB layers.
    assert "real-size KV" in card and "Llama-3.1-8B, 8K prompt, 10 GbE" in card
    sc = doc["scale"]
    (p,) = sc["points"]
    assert p["prompt_tokens"] == 512 and p["layer_bytes"] == 512 * 2 * 8 * 128 * 4
    assert p["kv_bytes"] == p["layers"] * p["layer_bytes"]
    for section, key in (("unshaped", "transport_gbps"), ("unshaped", "plain_gbps"),
                         ("shaped", "transport_gbps"), ("shaped", "plain_gbps"),
                         ("shaped", "t_overlap_s"), ("shaped", "t_ideal_s")):  # fmt: skip
        assert p[section][key] > 0, (section, key)
    assert p["unshaped"]["transport_vs_plain"] == pytest.approx(
        p["unshaped"]["transport_gbps"] / p["unshaped"]["plain_gbps"]
    )  # one repeat: the median of the paired ratios is that pair's
    assert p["decode_memory"]["rss_before"] > 0 and p["decode_memory"]["peak_growth"] >= 0
    assert p["same_tokens"] is True
    assert p["same_as_transformers"] is True and len(p["reference_tokens"]) > 0  # float32
    assert sc["targets"]["same_as_transformers"] is True and "transformers (float32): yes" in card
    assert sc["llama_8b_10gbe"]["kv_bytes"] == 32 * 8192 * 2 * 8 * 128 * 2  # 1 GiB of bf16
    assert len(sc["load_average"]["start"]) == 3

    # Everything the benchmark created is gone; the nodes' logs were kept as asked.
    assert _namespaces_of(proc.pid) == []
    assert {"prefill.log", "decode.log"} <= {p.name for p in (tmp_path / "logs").iterdir()}


def test_the_vllm_bench_table_has_a_row_per_vllm_node_with_its_ratios_to_torch():
    """bench --vllm --vllm-tp 2's table (bench/vllm.py render): the torch node's figures beside
    each vllm node's, each ratio that node's over torch's."""
    from exo_split.bench.vllm import render

    def arm(compute, ttft):
        return {"compute": compute, "ttft": ttft, "exposed": 0.01, "hidden": 0.9}

    row = {"tokens": 1000, "case": "new prompt", "torch": arm(2.0, 2.5),
           "vllm": arm(1.0, 1.5), "vllm-tp2": arm(4.0, 5.0),
           "ratios": {"vllm": {"compute": 0.5, "ttft": 0.6},
                      "vllm-tp2": {"compute": 2.0, "ttft": 2.0}}}  # fmt: skip
    lines = render([row], "m", 2, 256).splitlines()[-2:]
    assert lines[0].startswith(
        "| 1000 | new prompt | 2.000 s | 1.000 s | 0.50x | 2.500 s | 1.500 s"
    )
    assert lines[1].startswith("| 1000 | new prompt (vllm-tp2) | 2.000 s | 4.000 s | 2.00x |")
