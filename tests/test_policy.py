"""The remote-or-local prefill policy on made-up capabilities (exo_split/node/policy.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from exo_split.node.policy import (
    FIXED_THRESHOLD_TOKENS,
    Figures,
    LinkEstimate,
    break_even_tokens,
    decide,
    figures_for,
    kv_bytes_per_token,
    link_from_report,
    local_ttft,
    remote_ttft,
    with_outcome,
)
from exo_split.report import ClockSync, LayerTiming, Timeline, build_report, to_json

# Llama-3.1-8B in fp16: 32 layers, 8 KV heads of 128 -> 128 KiB of KV per prompt token.
KV_8B = kv_bytes_per_token(32, 8, 128, "float16")
TEN_GBE = 1.25e9  # bytes/s
MAC = 1_300.0  # prefill tokens/s on the decode node (made up, M3-Ultra-like)
SPARK = 9_000.0  # prefill tokens/s on the CUDA peer (made up)


def figures(**kw) -> Figures:
    base = dict(
        local_prefill_tps=MAC,
        peer_prefill_tps=SPARK,
        link_bytes_per_s=TEN_GBE,
        round_trip_s=0.002,
        kv_bytes_per_token=KV_8B,
        n_layers=32,
        overhead_s=0.05,
    )
    return Figures(**{**base, **kw})


def test_kv_bytes_per_token() -> None:
    assert KV_8B == 131_072
    assert kv_bytes_per_token(12, 2, 64, "float32") == 12_288


def test_short_prompt_goes_local() -> None:
    d = decide(16, figures())
    assert d.choice == "local"
    assert d.local_ttft_s < d.remote_ttft_s
    assert "local prefill estimated faster" in d.reason


def test_long_prompt_on_a_fast_link_goes_remote() -> None:
    d = decide(8192, figures())
    assert d.choice == "remote"
    assert d.remote_ttft_s < d.local_ttft_s
    # 8192 / 1300 = 6.30 s locally; remote is compute-bound: 0.052 + 8192/9000 + transfer/32.
    assert d.local_ttft_s == pytest.approx(6.3015, abs=1e-3)
    transfer = 8192 * KV_8B / TEN_GBE
    assert d.remote_ttft_s == pytest.approx(0.052 + 8192 / SPARK + transfer / 32)
    assert "break-even at" in d.reason


def test_slow_link_keeps_it_local_at_any_length() -> None:
    slow = figures(link_bytes_per_s=12.5e6)  # 100 Mbit/s: 10 ms of wire per token
    for n in (16, 8192, 100_000):
        d = decide(n, slow)
        assert d.choice == "local", n
    assert break_even_tokens(slow) is None
    assert "remote never wins" in decide(8192, slow).reason


def test_break_even_is_where_the_estimates_cross() -> None:
    f = figures()
    n_star = break_even_tokens(f)
    assert n_star is not None and 10 < n_star < 200
    assert local_ttft(n_star, f) == pytest.approx(remote_ttft(n_star, f))
    assert decide(int(n_star) - 1, f).choice == "local"
    assert decide(int(n_star) + 2, f).choice == "remote"


def test_transfer_bound_pipeline_and_no_overlap() -> None:
    # 1 Gbit/s: transfer (8192 * 131072 / 1.25e8 = 8.6 s) dominates the compute.
    f = figures(link_bytes_per_s=1.25e8, round_trip_s=0.0, overhead_s=0.0)
    n = 8192
    compute, transfer = n / SPARK, n * KV_8B / 1.25e8
    assert remote_ttft(n, f) == pytest.approx(transfer + compute / 32)
    sequential = replace(f, overlap=False)
    assert remote_ttft(n, sequential) == pytest.approx(transfer + compute)


def test_missing_figures_fall_back_to_the_fixed_threshold() -> None:
    f = figures(peer_prefill_tps=None)
    short, long = decide(FIXED_THRESHOLD_TOKENS - 1, f), decide(FIXED_THRESHOLD_TOKENS, f)
    assert (short.choice, long.choice) == ("local", "remote")
    assert "peer_prefill_tps unknown" in short.reason and "threshold" in short.reason
    assert short.local_ttft_s is None and short.remote_ttft_s is None


def test_forced_modes_still_report_estimates() -> None:
    d = decide(16, figures(), mode="remote")
    assert (d.choice, d.reason) == ("remote", "requested")
    assert d.local_ttft_s is not None and d.remote_ttft_s is not None
    assert decide(8192, figures(), mode="local").choice == "local"
    assert decide(5, None).choice == "local"
    assert decide(5, None).reason == "no prefill peer serving this model"
    with pytest.raises(ValueError, match="no prefill peer"):
        decide(5, None, mode="remote")
    with pytest.raises(ValueError, match="mode must be"):
        decide(5, figures(), mode="sometimes")


def _report(**kw) -> dict:
    base = dict(mode="overlap", fallback=None, kv_bytes=10_000_000, transfer_span_s=0.1,
                prefill_compute_s=0.2, clock_uncertainty_s=0.001, ttft_s=0.35,
                exposed_handoff_s=0.02)  # fmt: skip
    return {**base, **kw}


def test_link_learned_from_real_transfers() -> None:
    probe = LinkEstimate(50e6, 0.004, "probe")
    # Compute-bound (span < compute): 100 MB/s is a lower bound; it raises the estimate...
    learned = link_from_report(probe, _report(), decision_s=0.01)
    assert learned.bytes_per_s == pytest.approx(100e6)
    assert learned.round_trip_s == pytest.approx(0.002)
    assert learned.overhead_s == pytest.approx(0.35 - 0.01 - 0.2 - 0.02 - 0.002)
    # ...but never lowers it.
    fast = LinkEstimate(1e9, 0.002, "probe")
    assert link_from_report(fast, _report()).bytes_per_s == 1e9
    # Link-bound (span >= compute): the figure is the link's, up or down.
    slow = link_from_report(fast, _report(transfer_span_s=0.5))
    assert slow.bytes_per_s == pytest.approx(20e6)
    # A local run or a fallback teaches nothing about the link.
    assert link_from_report(probe, _report(mode="local")) is probe
    assert link_from_report(probe, _report(fallback="peer died")) is probe


def _timeline(decision: dict) -> Timeline:
    layers = tuple(
        LayerTiming(
            i, 0, 100, 1000, 1.0 + 0.01 * i, 1.001 + 0.01 * i, 1.002 + 0.01 * i, 1.003 + 0.01 * i
        )  # fmt: skip
        for i in range(4)
    )
    return Timeline(
        mode="overlap", prompt_tokens=100, n_layers=4, client_sent=0.9, prefill_start=0.95,
        prefill_end=1.03, layers=layers, clock=ClockSync(0.94, 0.95, 0.95, 0.96),
        first_token=1.05, token_times=(1.05, 1.06), decision=decision,
    )  # fmt: skip


def test_decision_and_estimates_appear_in_the_json_report() -> None:
    f = figures_for(
        local_prefill_tps=MAC, peer_prefill_tps=SPARK, link=LinkEstimate(TEN_GBE, 0.002, "probe"),
        kv_bytes_per_token=KV_8B, n_layers=32,
    )  # fmt: skip
    decision = decide(100, f).to_dict()
    report = to_json(build_report(_timeline(decision)))
    doc = json.loads(json.dumps(report))
    got = doc["decision"]
    assert got["choice"] == "remote" and got["mode"] == "auto"
    assert set(got["estimates"]) == {"local_ttft_s", "remote_ttft_s"}
    assert got["estimates"]["remote_ttft_s"] < got["estimates"]["local_ttft_s"]
    assert got["figures"]["peer_prefill_tps"] == SPARK
    assert got["break_even_tokens"] > 0
    after = with_outcome(got, doc)
    assert after["measured"]["ran"] == "remote"
    assert after["measured"]["ttft_s"] == pytest.approx(doc["ttft_s"])
    assert after["measured"]["estimated_ttft_s"] == got["estimates"]["remote_ttft_s"]
    assert "measured" not in got


def test_a_hybrids_handoff_grows_by_its_attention_layers_only():
    """Qwen3-Next-80B's geometry: 12 of its 48 layers hold K and V per position; the others'
    state is one size at every length, so the link estimate counts the 12 (a llama: all)."""
    import transformers

    from exo_split.node.policy import handoff_bytes_per_token
    from exo_split.spec import spec_from_config

    hybrid = spec_from_config(json.loads(transformers.Qwen3NextConfig().to_json_string()))
    assert handoff_bytes_per_token(hybrid, "bfloat16") == kv_bytes_per_token(12, 2, 256, "bfloat16")
    assert handoff_bytes_per_token(hybrid, "bfloat16") == 24 * 1024
    dense = spec_from_config(json.loads(transformers.LlamaConfig().to_json_string()))
    assert handoff_bytes_per_token(dense, "float16") == kv_bytes_per_token(32, 32, 128, "float16")
