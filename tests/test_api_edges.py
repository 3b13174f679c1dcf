"""The API's edges on a real node (a tiny random model, MLX decode, in this process): invalid
Unicode, bodies over the limit, unknown paths and methods, GET /health, options that would
change the output and are not implemented (400, never ignored), and ignore_eos.

Every error must come in the shape of the API the path belongs to: OpenAI's
{"error": {message, type, param, code}} under /v1 (and for the openai client), exo-split's
own {code, message} on its native endpoints.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import openai
import pytest
from nodes import TOKEN, request, tiny_decode_node
from reference import prompt_ids, reference_generate

from exo_split.tokenizer import TextCodec

pytestmark = pytest.mark.timeout(300)

LONE = '"\\ud83d"'  # a lone high surrogate, as JSON text: what a JavaScript client sends


def run(ckpt, probe):
    async def go():
        async with tiny_decode_node(ckpt) as url:
            return await probe(url.removesuffix("/v1"))

    return asyncio.run(go())


def openai_error(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_a_lone_surrogate_is_a_400_naming_its_place(llama):
    chat = ('{"model": "tiny", "messages": [{"role": "user", "content": "cut ' + LONE[1:-1]
            + '"}]}').encode()  # fmt: skip
    completion = ('{"model": "tiny", "prompt": ' + LONE + ', "max_tokens": 2}').encode()
    generate = ('{"prompt": ' + LONE + "}").encode()

    async def probe(base):
        return [
            await request("POST", f"{base}/v1/chat/completions", data=chat),
            await request("POST", f"{base}/v1/completions", data=completion),
            await request("POST", f"{base}/v1/generate", data=generate),
            # the node still serves a valid request afterwards
            await request("POST", f"{base}/v1/completions",
                          data=b'{"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}'),
        ]  # fmt: skip

    (s1, r1, _), (s2, r2, _), (s3, r3, _), (s4, _, _) = run(llama, probe)
    assert (s1, s2, s3, s4) == (400, 400, 400, 200)
    e1, e2 = openai_error(r1), openai_error(r2)
    assert e1["code"] == e2["code"] == "invalid_unicode"
    assert e1["param"] == "messages[0].content" and "\\ud83d at character 4" in e1["message"]
    assert e2["param"] == "prompt"
    native = json.loads(r3)
    assert native["code"] == "bad_request" and "lone surrogate" in native["message"]


def test_errors_of_the_http_layer_come_in_the_paths_shape(llama):
    big = b'{"model": "tiny", "prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}'

    async def probe(base):
        return {
            "big": await request("POST", f"{base}/v1/completions", data=big),
            "responses": await request("POST", f"{base}/v1/responses", json={}),
            "embeddings": await request("POST", f"{base}/v1/embeddings", json={}),
            "get_chat": await request("GET", f"{base}/v1/chat/completions"),
            "get_generate": await request("GET", f"{base}/v1/generate"),
            "no_token": await request("POST", f"{base}/v1/embeddings", token=None),
            "health": await request("GET", f"{base}/health", token=None),
            "v1_health": await request("GET", f"{base}/v1/health", token=None),
        }

    got = run(llama, probe)
    status, raw, _ = got["big"]
    assert status == 413 and "Maximum request body size" in openai_error(raw)["message"]
    for name in ("responses", "embeddings"):
        status, raw, _ = got[name]
        err = openai_error(raw)
        assert status == 404 and err["type"] == "invalid_request_error", err
        assert f"/v1/{name}" in err["message"]
    status, raw, headers = got["get_chat"]
    assert status == 405 and "POST" in headers["Allow"]
    assert "GET is not allowed on /v1/chat/completions" in openai_error(raw)["message"]
    status, raw, _ = got["get_generate"]
    assert status == 405 and json.loads(raw)["code"] == "method_not_allowed"  # native shape
    status, raw, _ = got["no_token"]
    assert status == 401 and openai_error(raw)["code"] == "unauthorized"
    assert got["health"][:2] == (200, b'{"ok": true}') == got["v1_health"][:2]


REFUSED = [
    ({"top_k": 40}, "top_k"),
    ({"min_p": 0.1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"response_format": "json"}, "response_format.type"),
    ({"logprobs": True}, "logprobs"),
    ({"functions": [{"name": "f"}]}, "functions"),
]
NEUTRAL = [{"top_k": -1}, {"min_p": 0}, {"repetition_penalty": 1}, {"tool_choice": "none"},
           {"parallel_tool_calls": True}, {"modalities": ["text"]}]  # fmt: skip


def test_options_that_would_change_the_output_are_refused_never_ignored(llama):
    async def probe(base):
        out = []
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0) as c:
            for extra, _ in REFUSED:
                try:
                    await c.completions.create(model="tiny", prompt=[1, 2], max_tokens=2,
                                               extra_body=extra)  # fmt: skip
                    out.append(None)
                except openai.BadRequestError as exc:
                    out.append(exc.body)
            for extra in NEUTRAL:
                r = await c.completions.create(model="tiny", prompt=[1, 2], max_tokens=2,
                                               temperature=0, extra_body=extra)  # fmt: skip
                out.append(r.usage.completion_tokens)
        return out

    got = run(llama, probe)
    for (extra, param), body in zip(REFUSED, got, strict=False):
        assert body is not None, f"{extra} was accepted"
        assert body["param"] == param, body
    assert got[len(REFUSED) :] == [2] * len(NEUTRAL)


def test_ignore_eos_decodes_to_max_tokens_past_the_end_of_turn(llama, tmp_path):
    """The tiny model (a copy whose config names as EOS the third token of a greedy answer):
    without ignore_eos the answer stops there; with it, it runs to max_tokens and equals
    transformers' greedy run, which does not stop."""
    prompt = prompt_ids(8, seed=5)
    want = reference_generate(llama, prompt, 12)
    eos = want[2]
    assert eos not in want[:2]
    ckpt = tmp_path / "tiny-eos"
    shutil.copytree(llama, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"eos_token_id": eos}))

    async def probe(base):
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0) as c:
            kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            plain = await c.completions.create(**kw)
            forced = await c.completions.create(**kw, extra_body={"ignore_eos": True})
        return plain, forced

    plain, forced = run(ckpt, probe)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 3
    assert plain.exo_split["report"]["timeline"]["decode"]["stopped_by"] == "end_of_turn"
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 12
    assert forced.exo_split["report"]["timeline"]["decode"]["stopped_by"] == "max_tokens"
    assert forced.choices[0].text == TextCodec(ckpt).detokenize(want)


def test_logprobs_equal_transformers_log_softmax_first_token_included(llama):
    """Completions with logprobs=5, greedy and sampled, streamed and not: each token's
    log-probability and its top 5 equal log-softmax of transformers' logits on the same ids
    within 1e-4 (float32), the first token's included."""
    import torch
    from reference import reference_logits

    codec = TextCodec(llama)
    prompt = prompt_ids(12, seed=8)

    async def probe(base):
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0) as c:
            out = []
            for temperature in (0.0, 0.9):
                kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=temperature,
                          seed=3, logprobs=5)  # fmt: skip
                whole = (await c.completions.create(**kw)).choices[0].logprobs
                chunks = [ch.choices[0].logprobs async for ch in await c.completions.create(
                    **kw, stream=True) if ch.choices and ch.choices[0].logprobs]  # fmt: skip
                out.append((whole, chunks))
            return out

    for whole, chunks in run(llama, probe):
        ids = [codec._tok.token_to_id(t) for t in whole.tokens]
        assert len(ids) == 8 and None not in ids
        ref = torch.log_softmax(reference_logits(llama, prompt + ids)[len(prompt) - 1 :], -1)
        for i, (token, lp, top) in enumerate(
            zip(ids, whole.token_logprobs, whole.top_logprobs, strict=True)
        ):
            assert abs(lp - ref[i, token].item()) <= 1e-4, (i, lp, ref[i, token].item())
            best = torch.topk(ref[i], 5)
            assert list(top) == [codec.token_text(int(j)) for j in best.indices]
            assert max(abs(top[codec.token_text(int(j))] - v.item())
                       for j, v in zip(best.indices, best.values, strict=True)) <= 1e-4  # fmt: skip
        streamed = [t for ch in chunks for t in ch.tokens]
        assert streamed == whole.tokens
        assert [x for ch in chunks for x in ch.token_logprobs] == whole.token_logprobs


def _hf_generate(ckpt, prompt, n, **kw) -> list[int]:
    import torch
    from reference import reference_model

    model = reference_model(str(ckpt))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **kw)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_penalties_logit_bias_and_min_tokens_equal_transformers(llama, tmp_path):
    """Greedy through the API (the first token is the decode node's own pick) against
    transformers' generate with its own processors: repetition_penalty with min_tokens
    (end-of-turn banned until then: the copy's EOS is the third greedy token), and
    logit_bias (transformers' sequence_bias on single tokens); presence and frequency
    penalties against OpenAI's formula applied by hand to transformers' logits."""
    import torch
    from reference import reference_logits

    prompt = prompt_ids(8, seed=5)
    eos = reference_generate(llama, prompt, 12)[2]
    ckpt = tmp_path / "tiny-eos"
    shutil.copytree(llama, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"eos_token_id": eos}))
    codec = TextCodec(ckpt)
    favoured = reference_generate(llama, prompt, 12)[5]

    async def probe(base):
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0) as c:
            kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            rep = await c.completions.create(**kw, extra_body={"repetition_penalty": 1.3,
                                                               "min_tokens": 6})  # fmt: skip
            bias = await c.completions.create(**kw, logit_bias={str(favoured): 4.0},
                                              extra_body={"ignore_eos": True})  # fmt: skip
            pen = await c.completions.create(**kw, presence_penalty=1.5, frequency_penalty=0.7,
                                             extra_body={"ignore_eos": True})  # fmt: skip
            return rep, bias, pen

    rep, bias, pen = run(ckpt, probe)
    want = _hf_generate(ckpt, prompt, 12, repetition_penalty=1.3, min_new_tokens=6,
                        eos_token_id=eos)  # fmt: skip
    if eos in want:
        want = want[: want.index(eos)]
    assert eos in reference_generate(llama, prompt, 12)[:6]  # min_tokens had work to do
    assert rep.choices[0].text == codec.detokenize(want)
    want = _hf_generate(ckpt, prompt, 12, sequence_bias={(favoured,): 4.0}, eos_token_id=None)
    assert bias.choices[0].text == codec.detokenize(want)
    assert want != reference_generate(llama, prompt, 12)  # the bias changed the answer
    ids: list[int] = []  # OpenAI's formula, greedy, on transformers' logits
    for _ in range(12):
        z = reference_logits(ckpt, prompt + ids)[-1].clone()
        counts = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=len(z)).float()
        z -= 0.7 * counts + 1.5 * (counts > 0).float()
        ids.append(int(torch.argmax(z)))
    assert pen.choices[0].text == codec.detokenize(ids)
