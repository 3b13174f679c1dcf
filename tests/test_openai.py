"""The OpenAI-compatible API with the real `openai` client, end to end.

Two real node agents on 127.0.0.1 (torch prefill, MLX decode) serve the embedded SmolLM2-
135M-Instruct (float32). Chat answers, streamed and not, and `split-generate --chat`, must
equal transformers' greedy generate on the chat-templated ids, with the report attached and
the KV moved from the prefill node. Then: raw completions, stop strings, a conversation sent
whole each turn, errors in OpenAI's shape, and a client that leaves mid-request. A tiny
random model served in this process covers a checkpoint without a chat template and a busy
node.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from nodes import TOKEN, node_pair, request, tiny_decode_node
from reference import prompt_ids, reference_chat, reference_generate
from transformers import AutoTokenizer

from exo_split.cli.main import main
from exo_split.tokenizer import TextCodec
from exo_split.transport.limits import Limits

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2"  # the decode node's --model-name
LAYERS = 30
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NEW = 24  # enough for the short answers here, which end on <|im_end|> before it
# The requests prefill on the torch node: MLX on a Linux CPU prefills a few tokens a second.


@pytest.fixture(scope="module")
def nodes(smollm2, tmp_path_factory):
    with node_pair(smollm2.dir, tmp_path_factory.mktemp("openai"), MODEL) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(nodes):
    _, decode = nodes
    with openai.OpenAI(base_url=f"{decode.url}/v1", api_key=TOKEN, max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def remote(nodes):
    """extra_body that makes the decode node pull the KV from the prefill node."""
    prefill, _ = nodes
    return {"exo_split": {"prefill": "remote", "prefill_peer": prefill.addr, "fallback": "none"}}


@pytest.fixture(scope="module")
def expect(smollm2):
    """messages -> (prompt ids, generated ids, text): transformers' greedy answer on the
    chat-templated ids, float32, stopping at the end of the turn."""
    tok = AutoTokenizer.from_pretrained(smollm2.dir)
    cache = {}

    def get(messages, max_new=NEW):
        key = (json.dumps(messages), max_new)
        if key not in cache:
            ids = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            new = reference_chat(smollm2.dir, ids, max_new)
            cache[key] = (ids, new, tok.decode(new, skip_special_tokens=True))
        return cache[key]

    return get


def assert_split(report: dict) -> None:
    """The KV came from the prefill node, every layer of it."""
    assert report["mode"] == "overlap" and report["fallback"] is None, report.get("fallback")
    assert report["decision"]["choice"] == "remote"
    assert len(report["layers"]) == LAYERS and report["kv_bytes"] > 0


def stats(node) -> dict:
    async def get():
        async with aiohttp.ClientSession() as s, s.get(
            f"{node.url}/v1/info", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp:  # fmt: skip
            return (await resp.json())["stats"]

    return asyncio.run(get())


# ---------------------------------------------------------------- answers


def test_models_lists_the_served_model(client, nodes):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "exo-split"
    assert nodes[1].info["openai"] == {"model": MODEL, "chat": True}


def test_chat_completion_equals_transformers(client, remote, expect):
    ids, new, text = expect(QUESTION)
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=NEW, extra_body=remote
    )
    print(f"\nanswer: {r.choices[0].message.content!r}")
    assert r.choices[0].message.content == text and "Paris" in text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop" and len(new) < NEW  # the turn ended
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(new))
    assert r.usage.total_tokens == len(ids) + len(new)
    assert r.model == MODEL and r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert_split(r.exo_split["report"])
    assert r.exo_split["report"]["prompt_tokens"] == len(ids)


def test_streamed_chat_equals_transformers(client, remote, expect):
    ids, new, text = expect(QUESTION)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0, max_tokens=NEW, stream=True,
            stream_options={"include_usage": True}, extra_body=remote,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 2  # streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    last = chunks[-1]  # include_usage: a last chunk without choices, with the usage
    assert last.choices == [] and last.usage.completion_tokens == len(new)
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    assert_split(last.exo_split["report"])
    assert [c for c in chunks if "exo_split" in (c.model_extra or {})] == [last]


def test_split_generate_chat_equals_the_api(nodes, expect, capsys):
    prefill, decode = nodes
    ids, new, text = expect(QUESTION)
    argv = ["split-generate", "--chat", "--prompt", QUESTION[0]["content"], "--max-tokens",
            str(NEW), "--decode-peer", decode.addr, "--prefill-peer", prefill.addr,
            "--prefill", "remote", "--fallback", "none", "--json"]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXO_SPLIT_TOKEN", TOKEN)
        assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (doc["tokens"], doc["text"], doc["finish_reason"]) == (new, text, "stop")
    assert doc["prompt_tokens"] == len(ids)
    assert_split(doc["report"])


def test_a_conversation_sent_whole_each_turn(client, remote, expect, nodes, tmp_path, capsys):
    history = list(QUESTION)
    first = client.chat.completions.create(
        model=MODEL, messages=history, temperature=0, max_tokens=NEW, extra_body=remote
    )
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what is the capital of Germany?"},
    ]
    ids, new, text = expect(history)
    second = client.chat.completions.create(
        model=MODEL, messages=history, temperature=0, max_tokens=NEW, extra_body=remote
    )
    print(f"\nturn 2: {second.choices[0].message.content!r}")
    assert second.choices[0].message.content == text and "Berlin" in text
    assert second.usage.prompt_tokens == len(ids) > first.usage.prompt_tokens
    assert_split(second.exo_split["report"])
    # The same conversation from a --messages file gives the same answer.
    (tmp_path / "chat.json").write_text(json.dumps({"messages": history}))
    prefill, decode = nodes
    argv = ["split-generate", "--messages", str(tmp_path / "chat.json"), "--max-tokens",
            str(NEW), "--decode-peer", decode.addr, "--prefill-peer", prefill.addr,
            "--prefill", "remote", "--json"]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXO_SPLIT_TOKEN", TOKEN)
        assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["text"] == text


def test_completion_of_a_raw_prompt_equals_transformers(client, remote, smollm2):
    prompt = "The capital of France is"
    ids = TextCodec(smollm2.dir).tokenize(prompt)
    want = TextCodec(smollm2.dir).detokenize(reference_generate(smollm2.dir, ids, 6))
    r = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=6, extra_body=remote
    )
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 6)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert_split(r.exo_split["report"])
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=6, stream=True, extra_body=remote
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length" and "exo_split" in chunks[-1].model_extra


def test_stop_strings_end_the_answer_where_they_start(client, remote, expect):
    _, new, text = expect(QUESTION)
    stop = " Paris"
    assert stop in text
    kw = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=NEW, stop=[stop, "zzz"],
              extra_body=remote)  # fmt: skip
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < len(new)  # the generation ended there, not at the turn
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].exo_split["report"]["prompt_tokens"] == r.usage.prompt_tokens


def test_sampling_with_a_seed_repeats(client, remote):
    kw = dict(model=MODEL, messages=QUESTION, temperature=0.9, top_p=0.9, seed=7, max_tokens=8,
              extra_body=remote)  # fmt: skip
    a, b = (client.chat.completions.create(**kw) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


# ---------------------------------------------------------------- errors


def test_errors_come_in_openai_shape(client, nodes):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    assert "this node serves 'smollm2'" in info.value.body["message"]

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}])
    assert info.value.body["param"] == "messages[0].content"
    assert info.value.body["type"] == "invalid_request_error"

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=9000)
    body = info.value.body
    assert body["code"] == "context_length_exceeded", body
    assert "+ max tokens (9000) = " in body["message"] and "context of 8192" in body["message"]

    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=long)
    assert info.value.body["code"] == "context_length_exceeded"
    assert "exceeds the model's context of 8192" in info.value.body["message"]

    with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 8\]"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, n=9)
    with pytest.raises(openai.BadRequestError, match="best_of=2 is not supported"):
        client.completions.create(model=MODEL, prompt="hi", best_of=2)

    with (
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError) as info,
    ):
        wrong.chat.completions.create(model=MODEL, messages=QUESTION)
    assert info.value.body["code"] == "unauthorized"

    _, decode = nodes
    status, raw, _ = asyncio.run(
        request("POST", f"{decode.url}/v1/chat/completions", data=b"{not json")
    )
    assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_json"


def test_a_prefill_peer_that_fails_with_no_fallback_is_an_error_in_both_shapes(client):
    dead = {"exo_split": {"prefill": "remote", "prefill_peer": "127.0.0.1:1", "fallback": "none"}}
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=2, extra_body=dead)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(**kw)
    assert info.value.body["code"] == "PeerUnavailable"
    assert "remote prefill failed and fallback is none" in info.value.body["message"]
    with pytest.raises(openai.APIError, match="remote prefill failed and fallback is none"):
        list(client.chat.completions.create(**kw, stream=True))  # after the 200: in the stream


def test_a_client_that_leaves_cancels_the_work_on_both_nodes(client, remote, nodes):
    """The prefill of a long chat is under way on the prefill node when the client closes
    its stream: both nodes stop the request and go back to idle, and keep serving."""
    prefill, decode = nodes
    before_p, before_d = stats(prefill), stats(decode)
    long = [{"role": "user", "content": "Summarise: " + "the quick brown fox jumps. " * 600}]
    stream = client.chat.completions.create(
        model=MODEL, messages=long, max_tokens=8, stream=True, extra_body=remote
    )
    first = next(iter(stream))  # the role chunk comes before the prefill
    assert first.choices[0].delta.role == "assistant"
    wait_for(prefill, lambda s: s.get("active", {}).get("prefill"))
    stream.close()
    left = time.monotonic()
    s = wait_for(
        prefill, lambda s: s.get("prefills_cancelled", 0) > before_p.get("prefills_cancelled", 0)
    )
    print(f"\nprefill node stopped {time.monotonic() - left:.2f} s after the client left")
    # It stopped short of the whole prompt: part-way, or before the stream began (the
    # receiver gone before its data connection came: nothing planned, nothing computed).
    cancel = s["last_cancel"]
    assert cancel["pieces_computed"] < cancel["pieces_total"] or cancel["pieces_computed"] == 0
    key = "completions_cancelled"
    d = wait_for(decode, lambda s: s.get(key, 0) > before_d.get(key, 0) and not s["active"])
    assert d["kv_bytes_held"] == 0 and not wait_for(prefill, lambda s: not s["active"])["active"]
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=2, extra_body=remote
    )
    assert r.choices[0].finish_reason == "length"


def wait_for(node, cond, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = stats(node)
        if cond(s):
            return s
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout} s: {stats(node)}")


# ---------------------------------------------------------------- a model without a template


def test_a_model_without_a_chat_template_serves_completions_only(llama):
    ids = prompt_ids(20, seed=3)

    async def run():
        async with (
            tiny_decode_node(llama, Limits()) as url,
            openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0) as c,
        ):
            with pytest.raises(openai.BadRequestError) as info:
                await c.chat.completions.create(model="tiny", messages=QUESTION)
            r = await c.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
            return info.value.body, r

    body, r = asyncio.run(run())
    assert "has no chat template" in body["message"] and body["param"] == "messages"
    assert r.choices[0].text == TextCodec(llama).detokenize(reference_generate(llama, ids, 5))
    assert r.exo_split["report"]["mode"] == "local"


def test_a_busy_node_answers_503_in_openai_shape(llama):
    async def run():
        async with (
            tiny_decode_node(llama, Limits(max_concurrent=0)) as url,
            openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0) as c,
        ):
            with pytest.raises(openai.InternalServerError) as info:
                await c.completions.create(model="tiny", prompt=[1, 5, 6], max_tokens=2)
            return info.value

    exc = asyncio.run(run())
    assert exc.status_code == 503 and exc.response.headers["Retry-After"] == "1"
    assert exc.body["code"] == "busy" and exc.body["type"] == "server_error"


def test_a_chat_with_n_choices_streams_each_by_index_as_the_whole_response(client):
    """n = 2 on the real model through the prefill node: the stream's role chunk, text and
    finish_reason come per index, and join to the response's choices; choice 1 is the
    answer a lone request gets with the seed plus one."""
    kw = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 1.0, "seed": 3}
    whole = client.chat.completions.create(n=2, **kw)
    alone = client.chat.completions.create(**{**kw, "seed": 4})
    roles, texts, reasons = {}, {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(n=2, stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.role:
                roles[ch.index] = ch.delta.role
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    assert [c.index for c in whole.choices] == [0, 1]
    assert roles == {0: "assistant", 1: "assistant"}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert whole.choices[1].message.content == alone.choices[0].message.content
    assert len(whole.model_extra["exo_split"]["choices"]) == 2
