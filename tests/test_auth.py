"""The shared token: generated at mode 0600 when missing, required on every endpoint but the
health check (401 before any work), compared in constant time, and never shown: not in logs,
errors, reports, /v1/info or mDNS records."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from fakes import FakePrefillPeer, status
from nodes import TOKEN, NodeProcess

from exo_split.errors import ExoSplitError
from exo_split.node.routes import NodeState, make_app
from exo_split.transport import auth
from exo_split.transport.limits import Limits

pytestmark = pytest.mark.timeout(300)


# ---- where the token comes from ----------------------------------------------------------


def test_a_missing_token_is_generated_0600_under_the_config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    token, source = auth.resolve_token(None, {}, create=True)
    path = auth.default_token_file()
    again, source2 = auth.resolve_token(None, {}, create=True)
    assert path == tmp_path / "cfg" / "exo-split" / "token"
    assert source == f"{path} (new)" and source2 == str(path)
    assert again == token and len(token) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    howto = auth.copy_instructions(path)
    assert str(path) in howto and "scp" in howto and "chmod 600" in howto
    assert token not in howto


def test_token_sources_and_their_errors(tmp_path, caplog):
    assert auth.resolve_token(None, {auth.ENV_VAR: " abc \n"}, create=False) == (
        "abc",
        "$EXO_SPLIT_TOKEN",
    )
    missing = tmp_path / "nope"
    with pytest.raises(ExoSplitError, match="does not exist") as info:
        auth.resolve_token(missing, {}, create=True)  # an explicit file is never created
    assert "EXO_SPLIT_TOKEN" in info.value.hint
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ExoSplitError, match="is empty"):
        auth.resolve_token(empty, {auth.ENV_VAR: "  "}, create=False)  # blank env: not set
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(ExoSplitError, match="not UTF-8"):
        auth.read_token(binary)
    loose = tmp_path / "loose"
    loose.write_text("secret-value\n")
    loose.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="exo_split.transport.auth"):
        assert auth.read_token(loose) == "secret-value"
    assert "chmod 600" in caplog.text and "secret-value" not in caplog.text


def test_two_nodes_generating_at_once_share_one_token(tmp_path):
    path = tmp_path / "exo-split" / "token"
    path.parent.mkdir()
    path.write_text("first\n")
    # the file appeared between the is_file() check and the exclusive create
    assert auth._generate(path) == "first"


def test_node_started_without_a_token_generates_one_and_says_how_to_copy_it(checkpoint, tmp_path):
    home = tmp_path / "home"
    node = NodeProcess(checkpoint("llama", num_hidden_layers=2), "torch", tmp_path, token="",
                       env={"XDG_CONFIG_HOME": str(home / ".config"), "HOME": str(home)})  # fmt: skip
    try:
        node.wait_ready()
        path = home / ".config" / "exo-split" / "token"
        token = path.read_text().strip()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        log = node.log()
        assert f"generated a new token in {path}" in log
        assert "scp" in log and "~/.config/exo-split/token" in log
        assert token not in log
        from nodes import request

        assert asyncio.run(request("GET", f"{node.url}/v1/info", token=token))[0] == 200
        assert asyncio.run(request("GET", f"{node.url}/v1/info", token=TOKEN))[0] == 401
    finally:
        node.stop()
    assert token not in node.log_file.read_text()


# ---- comparison --------------------------------------------------------------------------


def test_comparison_is_constant_time_over_fixed_length_digests(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    presented = [TOKEN, TOKEN[:-1], TOKEN + "x", "x" * 1000, "é\udcff", TOKEN.upper()]
    assert [auth.token_matches(p, TOKEN) for p in presented] == [True] + [False] * 5
    assert len(calls) == len(presented)
    assert all(len(a) == len(b) == 32 for a, b in calls)  # lengths never differ
    assert calls[0][1] == hashlib.sha256(TOKEN.encode()).digest()
    assert not auth.token_matches(None, TOKEN) and not auth.token_matches("", TOKEN)
    assert not auth.token_matches(TOKEN, "")


def test_bearer_header_parsing():
    assert auth.bearer(f"Bearer {TOKEN}") == TOKEN
    assert auth.bearer(f"bearer  {TOKEN} ") == TOKEN
    for header in (None, "", "Bearer", "Bearer ", f"Basic {TOKEN}", TOKEN, f"Bearer{TOKEN}"):
        assert auth.bearer(header) is None, header


# ---- every endpoint but health: 401 before any work -------------------------------------


class Untouchable:
    """Stands in for the backend, the executor and the coordinator: any use is an error."""

    def __getattr__(self, name):
        raise AssertionError(f"work was done for an unauthenticated request: .{name}")


class UntouchableBackend(Untouchable):
    def memory(self) -> None:  # an authorized /v1/info reads the allocator's account
        return None

    def describe(self) -> None:  # and an engine's own counts (vllm)
        return None


def untouchable_state() -> NodeState:
    from exo_split.spec import ModelSpec

    spec = ModelSpec("llama", 2, 4, 2, 8, 32, 64, 512, 1e-5, 10000.0)
    nothing = Untouchable()
    return NodeState(node_id="n", spec=spec, backend=UntouchableBackend(), executor=nothing,
                     token=TOKEN, limits=Limits(), coordinator=nothing,
                     info={"node_id": "n"})  # fmt: skip


async def serve(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


BAD_HEADERS = {
    "none": {},
    "wrong": {"Authorization": "Bearer wrong-token"},
    "prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "suffix": {"Authorization": f"Bearer {TOKEN}0"},
    "basic": {"Authorization": f"Basic {TOKEN}"},
    "bare": {"Authorization": TOKEN},
    "empty bearer": {"Authorization": "Bearer "},
    "in another header": {"X-Token": TOKEN},
}


NATIVE_401 = {"code": "unauthorized", "message": "missing or wrong token"}
# The OpenAI-compatible endpoints answer in OpenAI's error shape (docs/api.md).
# An unknown /v1 path answers in OpenAI's shape (a client of the OpenAI API asked for it).
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}",
                "/v1/no-such-endpoint")  # fmt: skip
ANTHROPIC_401 = {"type": "error", "error": {"type": "authentication_error",
                                           "message": "missing or wrong token"}}  # fmt: skip
OPENAI_401 = {"error": {"message": "missing or wrong token", "type": "authentication_error",
                        "param": None, "code": "unauthorized"}}  # fmt: skip


def test_every_endpoint_but_health_answers_401_before_any_work():
    state = untouchable_state()
    app = make_app(state)
    routes = sorted({(r.method, r.resource.canonical) for r in app.router.routes()})
    assert ("GET", "/v1/health") in routes and len(routes) >= 4
    big = b"{" + b" " * (20 * 2**20) + b"}"  # over the body limit: it must not even be read

    async def run():
        runner, url = await serve(app)
        out = []
        try:
            async with aiohttp.ClientSession() as s:
                for method, path in [*routes, ("GET", "/v1/no-such-endpoint")]:
                    for name, headers in BAD_HEADERS.items():
                        body = big if method == "POST" and name == "none" else b"{}"
                        where = url + path.replace("{model}", "some-model")
                        async with s.request(method, where, data=body, headers=headers) as r:
                            out.append(
                                (method, path, name, r.status, dict(r.headers), await r.read())
                            )
                raw = await (await s.get(url + "/v1/health")).json()
                info = await (
                    await s.get(url + "/v1/info", headers={"Authorization": f"Bearer {TOKEN}"})
                ).json()
        finally:
            await runner.cleanup()
        return out, raw, info

    results, health, info = asyncio.run(run())
    for method, path, name, code, headers, body in results:
        if path in ("/v1/health", "/health"):
            assert code == 200, (method, path, name)
            continue
        if path == "/v1/hello":  # public: its proof discloses nothing (its own tests below)
            assert code == 400 and (method == "HEAD" or b"nonce must be" in body), (method, name)
            continue
        assert code == 401, (method, path, name, body[:200])
        assert headers["WWW-Authenticate"] == "Bearer"
        if method != "HEAD":
            want = OPENAI_401 if path in OPENAI_PATHS else NATIVE_401
            want = ANTHROPIC_401 if path.startswith("/v1/messages") else want
            assert json.loads(body) == want, (
                method,
                path,
            )
        assert TOKEN.encode() not in body
    assert health == {"ok": True}
    assert state.stats == {} and not any(state.busy.values())  # nothing started
    assert TOKEN not in json.dumps(info)


# ---- the token never shows ---------------------------------------------------------------


def test_token_never_in_logs_errors_reports_info_or_mdns(checkpoint, caplog):
    """A real MLX decode node in this process, at DEBUG logging: refused clients, a prefill
    peer that refuses our token (fallback, and fallback none), a local request; then every
    log line, response, report and rendering is searched for the token."""
    from exo_split.backends import load_backend
    from exo_split.discovery import NodeInfo, check_txt, node_txt
    from exo_split.node.agent import NodeConfig
    from exo_split.node.decode import Coordinator
    from exo_split.report import load_report
    from exo_split.report.text import render_terminal
    from exo_split.tokenizer import TextCodec
    from exo_split.transport.client import Timeouts

    ckpt = checkpoint("llama", num_hidden_layers=2)
    executor = ThreadPoolExecutor(1)
    backend = executor.submit(load_backend, "mlx", ckpt).result()
    peer = FakePrefillPeer(token="the-other-machines-token")
    peer.default = status(401, "no")
    seen: list[str] = []

    async def run():
        session = aiohttp.ClientSession()

        async def choose(req, n):
            return (f"http://{req.prefill_peer}" if req.prefill_peer else None), None

        coordinator = Coordinator(backend, TextCodec(ckpt), executor, token=TOKEN,
                                  timeouts=Timeouts(connect=1, first_frame=3, idle=2),
                                  session=lambda: session, choose_peer=choose)  # fmt: skip
        state = NodeState(node_id="n", spec=backend.spec, backend=backend, executor=executor,
                          token=TOKEN, limits=Limits(), coordinator=coordinator,
                          info={"node_id": "n", "fingerprint": backend.spec.fingerprint})  # fmt: skip
        seen.append(repr(state))
        runner, url = await serve(make_app(state))
        good = {"Authorization": f"Bearer {TOKEN}"}
        try:
            async with aiohttp.ClientSession() as s:
                for headers in BAD_HEADERS.values():
                    async with s.post(url + "/v1/generate", json={}, headers=headers) as r:
                        seen.append(await r.text())
                for fallback in ("local", "none"):
                    body = {"token_ids": [1, 5, 9, 12], "max_tokens": 3,
                            "prefill_peer": peer.addr, "fallback": fallback}  # fmt: skip
                    async with s.post(url + "/v1/generate", json=body, headers=good) as r:
                        seen.append(await r.text())
                async with s.get(url + "/v1/info", headers=good) as r:
                    seen.append(await r.text())
        finally:
            await runner.cleanup()
            await session.close()

    try:
        with caplog.at_level(logging.DEBUG):
            asyncio.run(run())
    finally:
        peer.close()
        executor.shutdown()
    events = [json.loads(line) for text in seen[-3:-1] for line in text.splitlines()]
    done = next(e for e in events if e["type"] == "done")
    # A peer with another token cannot prove it holds ours: it is sent nothing at all.
    assert "did not prove that it holds the shared token" in done["report"]["fallback"]
    error = next(e for e in events if e["type"] == "error")
    assert "did not prove that it holds the shared token" in error["message"]
    assert peer.served == []
    seen += [render_terminal(load_report(done["report"])), json.dumps(done["report"]), caplog.text]
    config = NodeConfig(model_dir=Path(ckpt), backend="mlx", token=TOKEN)
    seen.append(repr(config))
    info = NodeInfo(node_id="n1", name="host-n1", backend="mlx", device="cpu", model="m",
                    fingerprint=backend.spec.fingerprint)  # fmt: skip
    txt = node_txt(info)
    check_txt(txt, never_publish=[TOKEN])
    seen.append(json.dumps(txt))
    with pytest.raises(ValueError, match="secret") as refused:
        check_txt({**txt, "name": f"x{TOKEN}"}, never_publish=[TOKEN])
    seen.append(str(refused.value))
    assert caplog.records, "the DEBUG capture saw nothing: the check would prove nothing"
    for text in seen:
        assert TOKEN not in text, text[:300]
