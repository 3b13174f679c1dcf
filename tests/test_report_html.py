"""The HTML report: structure (html.parser) and what headless Chromium actually draws.

The screenshot of the 32-layer page is kept as artifacts/report_timeline.png.
"""

import os
import shutil
import struct
import subprocess
import zlib
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from exo_split.report import ClockSync, LayerTiming, Timeline, build_report, compare
from exo_split.report.html import COLORS, render_html

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Set by `make test` where it can install Chromium (root + apt-get: CI): a missing Chromium is
# then a failure, so the screenshot tests cannot be lost to a silent skip.
REQUIRE_CHROMIUM = "EXO_SPLIT_REQUIRE_CHROMIUM"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def timeline(mode: str = "overlap", n_layers: int = 32, **overrides) -> Timeline:
    """8,192 tokens, 12 ms compute, 8 ms wire and 1.5 ms inject per layer; prefill clock +100 s."""
    pieces, link, injected = [], 0.0, 0.0
    prefill_end = 0.010 + 0.012 * n_layers
    for i in range(n_layers):
        done = 0.010 + 0.012 * (i + 1)
        sent = (max(done, link) if mode == "overlap" else max(prefill_end, link)) + 0.002
        received = sent + 0.008
        link, injected = received, max(received, injected) + 0.0015
        pieces.append(
            LayerTiming(i, 0, 8192, 16 * 2**20, 100 + done, 100 + sent, received, injected)
        )
    first = injected + 0.020
    fields = dict(
        mode=mode,
        prompt_tokens=8192,
        n_layers=n_layers,
        client_sent=0.0,
        prefill_start=100.010,
        prefill_end=100 + prefill_end,
        layers=tuple(pieces),
        clock=ClockSync(0.0, 100.002, 100.003, 0.005),
        first_token=first,
        token_times=tuple(first + 0.030 * k for k in range(24)),
        decision={"role": "split", "why": "<script>alert(1)</script> & long prompt"},
    )
    return Timeline(**{**fields, **overrides})


class Page(HTMLParser):
    """Tags, layer rows and text of a page; fails on anything html.parser cannot take."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.layer_rows: list[int] = []
        self.text: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if "layer-row" in (attrs.get("class") or "").split():
            self.layer_rows.append(int(attrs["data-layer"]))

    def handle_data(self, data):
        self.text.append(data)

    def count(self, tag: str, cls: str | None = None) -> int:
        return sum(t == tag and (cls is None or a.get("class") == cls) for t, a in self.tags)


def test_one_layer_row_per_layer_with_three_lanes():
    page = Page(render_html(build_report(timeline())))
    assert page.layer_rows == list(range(32))
    assert page.count("svg") == 1
    for lane in ("compute", "queued", "wire", "inject"):
        assert page.count("rect", lane) == 32, lane
    assert page.count("line", "token") == 24
    assert page.count("title") >= 4 * 32 + 24  # every bar and token has a tooltip


def test_tooltips_give_exact_figures():
    text = "".join(Page(render_html(build_report(timeline()))).text)
    # Layer 0: computed 10 -> 22 ms, sent at 24 ms, received at 32 ms.
    assert "layer 0, tokens 0–8191: compute 12.000 ms, done at 22.000 ms" in text
    assert "sent 24.000 ms → received 32.000 ms, 8.000 ms on the wire" in text


def test_page_is_self_contained_and_escaped():
    html = render_html(build_report(timeline()))
    page = Page(html)
    assert page.count("script") == 0 and page.count("link") == 0 and page.count("img") == 0
    assert not any("src" in a or "href" in a for _, a in page.tags)
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; long prompt" in html
    assert "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_local_and_fallback_pages():
    local = timeline("local", layers=(), clock=None, prefill_start=0.010, prefill_end=0.400)
    page = Page(render_html(build_report(local)))
    assert page.layer_rows == [] and page.count("g", "local-prefill") == 1
    reason = "local prefill: peer died after layer 3 (connection reset)"
    partial = timeline("local", prefill_start=0.060, prefill_end=0.450, fallback=reason)
    partial = replace(partial, layers=partial.layers[:4])
    page = Page(render_html(build_report(partial)))
    assert page.layer_rows == list(range(32))
    assert page.count("rect", "wire") == 4
    assert f"fallback: {reason}" in "".join(page.text)


def test_comparison_page_has_a_section_per_run():
    runs = {m: build_report(timeline(m)) for m in ("overlap", "sequential")}
    runs["local"] = build_report(
        timeline("local", layers=(), clock=None, prefill_start=0.010, prefill_end=0.700)
    )
    page = Page(render_html(compare(runs)))
    assert page.count("section", "report") == 3 and page.count("svg") == 3
    assert page.layer_rows == list(range(32)) * 2
    assert page.count("table", "comparison") == 1


# ---- headless Chromium -----------------------------------------------------------------------


def read_png(data: bytes) -> np.ndarray:
    """8-bit RGB/RGBA non-interlaced PNG -> [height, width, channels] uint8."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body, pos = data[pos + 8 : pos + 8 + length], pos + 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    out = np.zeros((height, stride), np.uint8)
    prev = bytearray(stride)
    for y in range(height):
        kind, row = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        if kind == 1:  # Sub
            for i in range(bpp, stride):
                row[i] = (row[i] + row[i - bpp]) & 0xFF
        elif kind == 2:  # Up
            row = bytearray(
                (np.frombuffer(row, np.uint8) + np.frombuffer(prev, np.uint8)).tobytes()
            )
        elif kind == 3:  # Average
            for i in range(stride):
                row[i] = (row[i] + ((row[i - bpp] if i >= bpp else 0) + prev[i]) // 2) & 0xFF
        elif kind == 4:  # Paeth
            for i in range(stride):
                a, b = (row[i - bpp] if i >= bpp else 0), prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        out[y] = np.frombuffer(row, np.uint8)
        prev = row
    return out.reshape(height, width, bpp)


@pytest.fixture
def needs_chromium() -> None:
    """Skip without Chromium, or fail where EXO_SPLIT_REQUIRE_CHROMIUM=1."""
    if Path(CHROMIUM).exists():
        return
    why = f"{CHROMIUM} missing: install the Debian package `chromium` to run the screenshot test"
    if os.environ.get(REQUIRE_CHROMIUM) == "1":
        pytest.fail(f"{why} ({REQUIRE_CHROMIUM}=1)")
    pytest.skip(why)


def chromium(*args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars"]  # fmt: skip
    return subprocess.run(
        [CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=90, check=True
    )


def screenshot(page: Path, tmp_path: Path, artifact: str, height: int) -> np.ndarray:
    """Render `page` in headless Chromium (1200 x height), keep the PNG under artifacts/,
    return its pixels; fails on a page that is one colour."""
    shot = tmp_path / "report.png"
    profile = f"--user-data-dir={tmp_path / 'profile'}"
    chromium(profile, f"--screenshot={shot}", f"--window-size=1200,{height}", page.as_uri())
    data = shot.read_bytes()
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / artifact).write_bytes(data)
    pixels = read_png(data)
    assert pixels.shape[:2] == (height, 1200)
    assert len(np.unique(pixels[..., :3].reshape(-1, 3), axis=0)) > 2, "a single-colour page"
    return pixels


def share_near(pixels: np.ndarray, hex_color: str, tolerance: int = 12) -> float:
    target = np.array([int(hex_color[k : k + 2], 16) for k in (1, 3, 5)])
    return float((np.abs(pixels[..., :3].astype(int) - target).max(axis=-1) <= tolerance).mean())


def test_chromium_renders_the_timeline(needs_chromium, tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render_html(build_report(timeline())))
    pixels = screenshot(page, tmp_path, "report_timeline.png", 900)
    # The bars are drawn: compute, wire and inject colours all show up.
    for lane in ("compute", "wire", "inject"):
        assert share_near(pixels, COLORS[lane]) > 1e-4, lane

    dom = Page(
        chromium(f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()).stdout
    )
    assert dom.count("svg") == 1
    assert dom.layer_rows == list(range(32))


def test_tooltips_name_first_and_last_byte_to_the_socket():
    tl = timeline(n_layers=2)
    tl = replace(tl, layers=tuple(replace(p, send_start=p.sent - 0.001) for p in tl.layers))
    text = "".join(Page(render_html(build_report(tl))).text)
    # Layer 0: first byte at 23 ms, last at 24 ms; on the wire from 23 ms.
    assert "sent 23.000 ms → received 32.000 ms, 9.000 ms on the wire" in text
    assert "handed to the socket 23.000–24.000 ms" in text
