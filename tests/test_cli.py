"""The command line: `generate` end to end (in-process and through `python -m exo_split`),
and how bad input is reported: one line, exit 2, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from reference import reference_generate

from exo_split.cli import generate as generate_cmd
from exo_split.cli.main import main
from exo_split.models.tiny import sample_prompt
from exo_split.tokenizer import TextCodec

PROMPT = sample_prompt(30, seed=1)
NEW_TOKENS = 12


def generate_args(model, *extra, prefill="torch", decode="mlx"):
    return [
        "generate",
        "--model",
        str(model),
        "--prefill-backend",
        prefill,
        "--decode-backend",
        decode,
        "--max-tokens",
        str(NEW_TOKENS),
        *extra,
    ]


def test_generate_json_torch_to_mlx_equals_transformers(llama, capsys):
    assert main(generate_args(llama, "--prompt", PROMPT, "--json")) == 0
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 1, "--json must not mix the streamed text into stdout"
    doc = json.loads(lines[-1])
    codec = TextCodec(llama)
    ids = codec.tokenize(PROMPT)
    assert doc["tokens"] == reference_generate(llama, ids, NEW_TOKENS)
    assert doc["text"] == codec.detokenize(doc["tokens"])
    assert doc["prompt_tokens"] == len(ids)
    assert (doc["prefill_backend"], doc["decode_backend"], doc["dtype"]) == (
        "torch",
        "mlx",
        "float32",
    )
    assert {"prefill_s", "ttft_s", "decode_tokens_per_s"} <= doc["timings"].keys()
    assert "loading torch backend" in err and "loading mlx backend" in err
    assert "TTFT" in err


class _Recorder:
    """A stdout that remembers each write and flush, to see the text arrive piece by piece."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def write(self, s: str) -> int:
        self.events.append(("write", s))
        return len(s)

    def flush(self) -> None:
        self.events.append(("flush", ""))

    def text(self) -> str:
        return "".join(s for kind, s in self.events if kind == "write")


def test_generate_streams_the_text_as_tokens_arrive(llama, monkeypatch, capsys):
    stdout = _Recorder()
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(generate_args(llama, "--prompt", PROMPT, prefill="mlx", decode="torch")) == 0
    codec = TextCodec(llama)
    expected = reference_generate(llama, codec.tokenize(PROMPT), NEW_TOKENS)
    assert stdout.text() == codec.detokenize(expected) + "\n"
    writes = [i for i, (kind, _) in enumerate(stdout.events) if kind == "write"]
    assert len(writes) >= NEW_TOKENS, "one write per token, not the text at the end"
    assert all(stdout.events[i + 1][0] == "flush" for i in writes)
    assert "decode (torch)" in capsys.readouterr().err


def test_same_backend_on_both_sides_is_loaded_once(llama, capsys):
    assert main(generate_args(llama, "--prompt", PROMPT, prefill="torch", decode="torch")) == 0
    assert capsys.readouterr().err.count("loading torch backend") == 1


def test_prompt_file(llama, tmp_path, capsys):
    f = tmp_path / "prompt.txt"
    f.write_text(PROMPT)
    assert main(generate_args(llama, "--prompt-file", str(f), "--json")) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert doc["prompt_tokens"] == len(TextCodec(llama).tokenize(PROMPT))


def test_python_m_exo_split_is_the_entry_point(llama):
    proc = subprocess.run(
        [sys.executable, "-m", "exo_split", *generate_args(llama, "--prompt", PROMPT, "--json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    ids = TextCodec(llama).tokenize(PROMPT)
    assert doc["tokens"] == reference_generate(llama, ids, NEW_TOKENS)


# --- bad input: one clear line, exit 2, no traceback ---------------------------------------


def assert_one_line_error(capsys, rc: int, *, contains: str) -> str:
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert "Traceback" not in err + out
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("exo-split: error:")]
    assert len(errors) == 1, err
    # The error line, optionally its hint; nothing else (no progress: we failed fast).
    assert lines[0] == errors[0] and all(line.startswith("  hint:") for line in lines[1:]), err
    assert contains in errors[0], err
    return errors[0]


def test_model_that_is_not_a_directory(tmp_path, capsys):
    rc = main(generate_args(tmp_path / "nowhere", "--prompt", "ba"))
    assert_one_line_error(capsys, rc, contains="is not a directory")


def test_model_directory_without_config(tmp_path, capsys):
    rc = main(generate_args(tmp_path, "--prompt", "ba"))
    assert_one_line_error(capsys, rc, contains="no config.json")


def test_unsupported_architecture(llama, tmp_path, capsys):
    copy = shutil.copytree(llama, tmp_path / "gpt2")
    config = json.loads((copy / "config.json").read_text())
    config["model_type"] = "gpt2"
    (copy / "config.json").write_text(json.dumps(config))
    rc = main(generate_args(copy, "--prompt", "ba"))
    assert_one_line_error(capsys, rc, contains="unsupported architecture 'gpt2'")


def test_prompt_longer_than_the_context_fails_before_loading(checkpoint, capsys):
    short = checkpoint("llama", max_position_embeddings=64)
    capsys.readouterr()  # building the checkpoint prints progress
    rc = main(generate_args(short, "--prompt", sample_prompt(70)))
    line = assert_one_line_error(capsys, rc, contains="exceeds the model's context of 64")
    assert "prompt (71 tokens)" in line


def test_unknown_dtype(llama, capsys):
    rc = main(generate_args(llama, "--prompt", "ba", "--dtype", "float8"))
    assert_one_line_error(capsys, rc, contains="invalid choice: 'float8'")


def test_usage_errors_are_one_line_too(llama, capsys):
    rc = main(["generate", "--model", str(llama)])  # no prompt
    assert_one_line_error(capsys, rc, contains="--prompt")
    rc = main(generate_args(llama, "--prompt", "ba", "--max-tokens", "0"))
    assert_one_line_error(capsys, rc, contains="must be at least 1")


def test_debug_shows_the_traceback(tmp_path, capsys):
    rc = main(["--debug", *generate_args(tmp_path / "nowhere", "--prompt", "ba")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "BadCheckpoint" in err
    # --debug after the command works too.
    assert main([*generate_args(tmp_path / "nowhere", "--prompt", "ba"), "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_ctrl_c_exits_130_with_one_line(llama, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_cmd, "load_backend", interrupted)
    assert main(generate_args(llama, "--prompt", "ba")) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "exo-split: interrupted"


def test_no_command_prints_help_and_help_exits_0(capsys):
    assert main([]) == 2
    assert "generate" in capsys.readouterr().err
    assert main(["generate", "--help"]) == 0
    assert "--prefill-backend" in capsys.readouterr().out


def test_ctrl_c_is_an_interrupt_even_when_the_stream_breaks_first():
    """Ctrl-C to a process group also stops the node we read from: the broken stream it
    leaves can reach the request before the cancellation does. It is still an interrupt."""
    import asyncio
    import os
    import signal

    from exo_split.cli.common import interruptible
    from exo_split.errors import PeerUnavailable

    async def request_whose_node_died() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the group's Ctrl-C ...
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            raise PeerUnavailable("node: response payload is not completed") from None

    async def request_that_fails() -> None:
        raise PeerUnavailable("node: connection refused")

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(interruptible(request_whose_node_died()))
    with pytest.raises(PeerUnavailable):  # no Ctrl-C: the failure is the request's own
        asyncio.run(interruptible(request_that_fails()))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
