"""The report's CLI against real node agents on 127.0.0.1: `split-generate --compare` and
`--report-html`, `exo-split report` re-rendering what they saved, and the acceptance check that
headless Chromium draws the HTML report of a real run (the screenshot is kept as
artifacts/report_real_run.png, not committed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from nodes import TOKEN, NodeProcess
from reference import reference_generate
from test_report_html import (  # noqa: F401 - needs_chromium is a fixture
    COLORS,
    Page,
    chromium,
    needs_chromium,
    screenshot,
    share_near,
)

from exo_split.models.tiny import sample_prompt
from exo_split.report import Comparison, HandoffReport, load
from exo_split.report.html import render_html
from exo_split.tokenizer import TextCodec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
N_LAYERS = 6


@pytest.fixture(scope="module")
def pair(checkpoint, tmp_path_factory):
    """(prefill node, decode node): torch and MLX agents of one checkpoint."""
    work = tmp_path_factory.mktemp("report-nodes")
    ckpt = checkpoint("llama", num_hidden_layers=N_LAYERS)
    nodes = NodeProcess(ckpt, "torch", work), NodeProcess(ckpt, "mlx", work)
    try:
        for node in nodes:
            node.wait_ready()
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def exo_split(*args: str, merged: bool = False) -> subprocess.CompletedProcess:
    """Run the CLI; `merged`: stderr into stdout, in the order they were written."""
    env = {**os.environ, "EXO_SPLIT_TOKEN": TOKEN, "EXO_SPLIT_PEERS": ""}
    err = subprocess.STDOUT if merged else subprocess.PIPE
    return subprocess.run(
        [sys.executable, "-m", "exo_split", *args], stdout=subprocess.PIPE, stderr=err,
        text=True, env=env, timeout=300,
    )  # fmt: skip


def split_generate(
    pair, *args: str, words: int = 1500, merged: bool = False
) -> subprocess.CompletedProcess:
    prefill, decode = pair
    prompt = sample_prompt(words, seed=7)
    peers = ("--decode-peer", decode.addr, "--prefill-peer", prefill.addr)
    out = exo_split(
        "split-generate", "--prompt", prompt, "--max-tokens", "6", *peers, *args, merged=merged
    )
    assert out.returncode == 0, out.stderr or out.stdout
    return out


def test_compare_runs_three_ways_and_reports_them_side_by_side(pair, tmp_path):
    page = tmp_path / "compare.html"
    out = split_generate(pair, "--compare", "--json", "--report-html", str(page))
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["same_tokens"] is True and len(doc["tokens"]) == 6
    report = doc["report"]
    assert report["schema"] == "exo-split.comparison/1"
    assert [row["name"] for row in report["rows"]] == ["overlap", "sequential", "local"]
    assert [r["mode"] for r in report["reports"].values()] == ["overlap", "sequential", "local"]
    assert all(r["ttft_source"] == "client" for r in report["reports"].values())
    rows = {row["name"]: row for row in report["rows"]}
    assert rows["local"]["speedup_vs_local"] == pytest.approx(1.0)
    assert rows["overlap"]["exposed_handoff_s"] is not None
    assert rows["local"]["exposed_handoff_s"] is None
    assert report["t_ideal_s"] > 0 and report["link_gbps"] > 0
    assert "overlap_efficiency" in report

    html = Page(page.read_text())
    assert html.count("section", "report") == 3 and html.count("table", "comparison") == 1
    assert html.layer_rows == list(range(N_LAYERS)) * 2

    # `exo-split report` re-renders the saved document (captured stdout as it is).
    saved = tmp_path / "compare.json"
    saved.write_text(out.stdout)
    again = exo_split("report", str(saved), "--html", str(tmp_path / "again.html"))
    assert again.returncode == 0, again.stderr
    for text in ("exo-split · compare", "overlap", "sequential", "local", "speedup"):
        assert text in again.stdout, text
    assert sum(line.startswith("L0 ") for line in again.stdout.splitlines()) == 2  # 2 timelines
    comparison = load(saved)
    assert isinstance(comparison, Comparison)
    assert (tmp_path / "again.html").read_text() == render_html(comparison)


def test_compare_prints_the_table_after_the_streamed_text(pair, checkpoint):
    out = split_generate(pair, "--compare", words=300, merged=True).stdout
    ckpt = checkpoint("llama", num_hidden_layers=N_LAYERS)
    codec = TextCodec(ckpt)
    text = codec.detokenize(reference_generate(ckpt, codec.tokenize(sample_prompt(300, seed=7)), 6))
    # stdout and stderr share one pipe here, so the order they were written in shows: the
    # first run's text, then the next runs, then the table.
    assert text.strip() and text in out, out
    assert out.index(text) < out.index("[sequential run ...]") < out.index("exo-split · compare")
    assert "overlap efficiency" in out[out.index("exo-split · compare") :]


def test_compare_needs_a_prefill_peer(pair):
    _, decode = pair
    out = exo_split("split-generate", "--prompt", "ba be", "--decode-peer", decode.addr,
                    "--prefill", "local", "--compare")  # fmt: skip
    assert out.returncode == 2 and "--compare needs a prefill peer" in out.stderr


def test_report_command_rerenders_a_single_run(pair, tmp_path):
    out = split_generate(pair, "--json", words=300)
    saved = tmp_path / "run.json"
    saved.write_text(out.stdout)
    again = exo_split("report", str(saved))
    assert again.returncode == 0, again.stderr
    assert "exo-split · overlap" in again.stdout and "exposed handoff" in again.stdout
    as_json = exo_split("report", str(saved), "--json")
    report = load(json.loads(as_json.stdout.strip().splitlines()[-1]))
    assert isinstance(report, HandoffReport)
    assert report == load(saved)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something/2"}')
    failed = exo_split("report", str(bad))
    assert failed.returncode == 2 and "not a saved exo-split report" in failed.stderr


@pytest.mark.usefixtures("needs_chromium")
def test_chromium_renders_the_report_of_a_real_run(pair, tmp_path):
    page = tmp_path / "report.html"
    split_generate(pair, "--report-html", str(page))
    pixels = screenshot(page, tmp_path, "report_real_run.png", 700)
    assert share_near(pixels, COLORS["compute"]) > 1e-4  # the compute bars are drawn
    for lane in ("wire", "inject", "token"):  # thin on loopback, but there
        assert share_near(pixels, COLORS[lane], tolerance=40) > 0, lane

    dom = Page(
        chromium(f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()).stdout
    )
    assert dom.count("svg") == 1
    assert dom.layer_rows == list(range(N_LAYERS))
    assert dom.count("rect", "compute") == dom.count("rect", "wire") == N_LAYERS
