"""`exo-split chat` against real node agents on 127.0.0.1 (a torch prefill node, an MLX decode
node) with a tiny checkpoint that carries a chat template: the conversation is driven through
piped stdin, and what the decode node received is checked against the template applied to
the history as the user saw it. Ctrl-C during a reply, a node that goes away, a node that is
not there, /reset and end of input, each as a user meets them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from nodes import TOKEN, NodeProcess
from test_chat import TEMPLATE, W, with_template

from exo_split.chat import ChatTemplate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
REPORT = re.compile(r"^\[turn (\d+)\] prompt ([\d,]+) tok · TTFT ([\d.]+) s · ([\d,]+) tok")


@pytest.fixture(scope="module")
def chat_model(checkpoint, tmp_path_factory):
    return with_template(checkpoint("llama"), tmp_path_factory.mktemp("chat") / "ckpt", TEMPLATE)


@pytest.fixture(scope="module")
def pair(chat_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("chat-nodes")
    nodes = NodeProcess(chat_model, "torch", work), NodeProcess(chat_model, "mlx", work)
    try:
        for node in nodes:
            node.wait_ready()
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def chat(decode: str, *args: str, prefill: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "EXO_SPLIT_TOKEN": TOKEN, "EXO_SPLIT_PEERS": ""}
    where = ["--decode-peer", decode] + (["--prefill-peer", prefill] if prefill else [])
    return subprocess.Popen(
        [sys.executable, "-m", "exo_split", "chat", *where, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # Ctrl-C as at a terminal
    )  # fmt: skip


def reports(stderr: str) -> list[tuple[int, int, int]]:
    """(turn, prompt tokens, generated tokens) of each report line."""
    found = [REPORT.match(line) for line in stderr.splitlines()]
    return [(int(m[1]), int(m[2].replace(",", "")), int(m[4].replace(",", ""))) for m in found if m]


def test_a_conversation_sends_its_history_and_reports_each_turn(pair, chat_model):
    torch_node, mlx_node = pair
    system, turns = f"{W[2]} {W[3]}", [f"{W[4]} {W[5]} {W[6]}", f"{W[7]} {W[8]}", W[9]]
    lines = [turns[0], turns[1], "/reset", turns[2]]
    proc = chat(mlx_node.addr, "--system", system, "--max-tokens", "7", prefill=torch_node.addr)
    stdout, stderr = proc.communicate("\n".join(lines) + "\n", timeout=300)  # then EOF
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    replies = stdout.splitlines()
    assert len(replies) == 3 and all(replies), stdout
    got = reports(stderr)
    assert [turn for turn, _, _ in got] == [1, 2, 1]  # /reset starts the count again
    assert all(generated == 7 for _, _, generated in got)  # no EOS in the tiny model
    assert "[history cleared]" in stderr

    template = ChatTemplate(chat_model)
    sys_msg = [{"role": "system", "content": system}]
    first = [*sys_msg, {"role": "user", "content": turns[0]}]
    second = [*first, {"role": "assistant", "content": replies[0]},
              {"role": "user", "content": turns[1]}]  # fmt: skip
    after_reset = [*sys_msg, {"role": "user", "content": turns[2]}]
    # The decode node tokenized exactly the history the user saw: turn 2 carries turn 1's
    # question and reply (more tokens than turn 1's prompt and reply together).
    assert [n for _, n, _ in got] == [
        len(template.token_ids(m)) for m in (first, second, after_reset)
    ]
    assert got[1][1] > got[0][1] + got[0][2]
    for line in stderr.splitlines():
        if line.startswith("[turn"):  # every figure of the line, unknown ones as '?'
            assert re.search(r"prefill (remote|local)", line) and "moved" in line
            assert "cached decode " in line and "computed " in line


def test_ctrl_c_cancels_the_reply_and_the_conversation_goes_on(pair, chat_model):
    torch_node, mlx_node = pair
    proc = chat(mlx_node.addr, "--max-tokens", "3500", prefill=torch_node.addr)
    try:
        proc.stdin.write(f"{W[4]} {W[5]}\n")
        proc.stdin.flush()
        assert proc.stdout.read(1), "the reply streams"  # some of the reply arrived
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.stdin.write(f"/help\n{W[6]}\n")
        proc.stdin.close()
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr
    assert "[reply cancelled; the turn is not kept in the history]" in stderr
    assert "/reset clears the history" in stderr  # /help
    assert "Traceback" not in stderr
    # The next turn is turn 1 again, its prompt the new message alone: the cancelled turn
    # left nothing in the history.
    ((turn, prompt, _),) = reports(stderr)
    want = ChatTemplate(chat_model).token_ids([{"role": "user", "content": W[6]}])
    assert (turn, prompt) == (1, len(want))


def test_a_failed_turn_is_one_line_and_an_absent_node_ends_the_chat(
    pair, chat_model, tmp_path_factory
):
    # A decode node that goes away between two turns: the second turn fails in one line.
    decode = NodeProcess(chat_model, "mlx", tmp_path_factory.mktemp("gone")).wait_ready()
    proc = chat(decode.addr, "--max-tokens", "3", "--prefill", "local")
    try:
        proc.stdin.write(f"{W[4]}\n")
        proc.stdin.flush()
        assert proc.stdout.readline()  # turn 1's reply
        decode.stop()
        proc.stdin.write(f"{W[5]}\n")
        proc.stdin.close()
        proc.wait(60)
    finally:
        decode.stop()
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and len(reports(stderr)) == 1
    (error,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert decode.addr in error and "POST /v1/generate" in error
    assert "[the turn is not kept in the history]" in stderr

    # No node at that address at all: the chat does not start.
    proc = chat(decode.addr)
    _, stderr = proc.communicate("hello\n", timeout=60)
    assert proc.returncode == 2
    error, hint = stderr.strip().splitlines()
    assert error.startswith("exo-split: error: ") and "GET /v1/info" in error
    assert hint.startswith("  hint: is `exo-split node` running there?")
