"""Tool calls and structured output.

- The conventions (Hermes, Llama 3, Mistral) parse what their templates' models write, and
  their grammars, run by llguidance on SmolLM2's real tokenizer with random picks, only
  ever produce calls that parse and validate against the tool's schema.
- A constrained greedy answer equals transformers' greedy answer wherever the mask allowed
  transformers' token, and is the best allowed token elsewhere (teacher-forced logits).
- An agent loop through the real openai client on two real nodes (torch prefill, MLX decode)
  with a tiny random model that carries a Hermes-style tools template: schema-valid calls at
  every required step, streamed equal to not streamed, each step reusing the last.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import openai
import pytest
from nodes import TOKEN, node_pair, tiny_decode_node
from reference import reference_logits

from exo_split.chat import ChatTemplate
from exo_split.node.grammar import Grammars
from exo_split.tokenizer import TextCodec
from exo_split.transport.tools import (
    HERMES,
    LLAMA3,
    MISTRAL,
    ToolStream,
    check_tools,
    convention_of,
    json_grammar,
)

pytestmark = pytest.mark.timeout(600)

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}  # fmt: skip
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b",
                                      "parameters": ADD}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


# ---------------------------------------------------------------- conventions


@pytest.mark.parametrize(
    "convention, text, content, calls",
    [
        (HERMES, 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
         "Sure.", [("add", {"a": 1, "b": 2})]),
        (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n'
         "</tool_call>", "", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
        (LLAMA3, '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}', "",
         [("add", {"a": 3, "b": 4})]),
        (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 5, "b": 6}}]', "",
         [("add", {"a": 5, "b": 6})]),
        # not a call: all content (a broken JSON, an undeclared tool, plain text)
        (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>', None, []),
        (HERMES, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', None, []),
        (LLAMA3, "The answer is {not json}", None, []),
    ],
)  # fmt: skip
def test_conventions_parse_what_their_models_write(convention, text, content, calls):
    got_content, got = convention.parse(text, check_tools(TOOLS))
    assert [(c.name, c.arguments) for c in got] == calls
    assert got_content == (text if content is None else content)


def test_convention_is_read_from_the_template():
    assert convention_of("{{ '<tool_call>' }}") is HERMES
    assert convention_of("[TOOL_CALLS] {{ x }}") is MISTRAL
    assert convention_of("<|python_tag|>") is LLAMA3 and convention_of("ipython") is LLAMA3
    assert convention_of("{{ messages }}") is None


@pytest.mark.parametrize("convention", [HERMES, LLAMA3])
def test_a_stream_releases_the_content_and_holds_the_calls(convention):
    text = HERMES.start + '{"name": "add", "arguments": {}}' + HERMES.end
    whole = ("Let me see. " + text) if convention is HERMES else '{"name": "add"}'
    for cut in range(1, len(whole)):
        stream = ToolStream(convention)
        out = stream.push(whole[:cut]) + stream.push(whole[cut:])
        assert out == ("Let me see. " if convention is HERMES else "")
        assert stream.in_call
    plain = ToolStream(LLAMA3)
    assert plain.push("  Hello {x}") + plain.push(' {"a"') == '  Hello {x} {"a"'


@pytest.fixture(scope="module")
def grammars(smollm2):
    return Grammars(smollm2.dir, 49152, TextCodec(smollm2.dir).eos_ids)


@pytest.mark.parametrize("convention", [HERMES, LLAMA3, MISTRAL])
@pytest.mark.parametrize("choice", ["required", "add"])
def test_grammars_force_calls_that_validate(grammars, smollm2, convention, choice):
    """Random picks among the allowed tokens (20 walks): every output is a call of a declared
    tool (the named one when named) whose arguments validate against its schema."""
    tools = check_tools(TOOLS)
    picked = tools[1] if choice == "add" else "required"
    codec = TextCodec(smollm2.dir)
    rng = np.random.default_rng(7)
    for _ in range(20):
        constraint = grammars.compile(convention.grammar(tools, picked, parallel=False))
        out = []
        for _ in range(400):
            token = int(rng.choice(np.flatnonzero(constraint.allowed())))
            constraint.accept(token)
            if token not in codec.eos_ids:
                out.append(token)
            if constraint.done:
                break
        assert constraint.done
        text = codec._tok.decode(out, skip_special_tokens=False)
        _, calls = convention.parse(text, tools)
        assert len(calls) == 1, text
        assert choice == "required" or calls[0].name == "add"
        jsonschema.validate(calls[0].arguments, SCHEMAS[calls[0].name])


def test_a_grammar_that_cannot_compile_is_a_clear_error(grammars):
    from exo_split.node.grammar import BadGrammar

    with pytest.raises(BadGrammar, match="cannot be enforced"):
        grammars.compile(json_grammar({"type": "string", "pattern": "(unclosed"}))


# ---------------------------------------------------------------- constrained = reference


PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "note", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "note": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}  # fmt: skip
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def test_json_schema_outputs_validate_for_20_seeds_and_greedy_follows_transformers(
    tools_model, smollm2
):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    async def probe(url):
        async with openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0) as c:
            kw = dict(model="tiny", messages=ASK, max_tokens=120, response_format=fmt)
            sampled = [await c.chat.completions.create(**kw, temperature=1.0, seed=s)
                       for s in range(20)]  # fmt: skip
            greedy = await c.chat.completions.create(**kw, temperature=0)
            free = await c.chat.completions.create(model="tiny", messages=ASK, max_tokens=8,
                                                   temperature=0)  # fmt: skip
            return sampled, greedy, free

    async def go():
        async with tiny_decode_node(tools_model) as url:
            return await probe(url)

    sampled, greedy, free = asyncio.run(go())
    texts = [r.choices[0].message.content for r in sampled]
    for r, text in zip(sampled, texts, strict=True):
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 5  # sampled, not one answer
    assert not free.choices[0].message.content.startswith("{")  # unconstrained: not JSON

    # Replay the greedy answer's tokens against transformers' logits and the mask.
    chat = ChatTemplate(tools_model)
    prompt = chat.token_ids(ASK)
    codec = TextCodec(tools_model)
    out = codec._tok.encode(greedy.choices[0].message.content, add_special_tokens=False).ids
    constraint = Grammars(tools_model, 49152, codec.eos_ids).compile(json_grammar(PERSON))
    ids = _greedy_ids(tools_model, prompt, constraint, len(out) + 1)
    assert codec.detokenize(ids) == greedy.choices[0].message.content


def _greedy_ids(ckpt, prompt, constraint, limit) -> list[int]:
    """Constrained greedy decoding on transformers' logits: at each step the argmax, or the
    best allowed token when the mask forbids it (counting both cases)."""
    ids, kept, moved = [], 0, 0
    for _ in range(limit):
        logits = reference_logits(ckpt, prompt + ids)[-1].numpy()
        allowed = constraint.allowed()
        best = int(np.argmax(logits))
        if allowed[best]:
            token, kept = best, kept + 1
        else:
            token, moved = int(np.argmax(np.where(allowed, logits, -np.inf))), moved + 1
        constraint.accept(token)
        ids.append(token)
        if constraint.done:
            break
    assert kept and moved  # both cases occurred on this prompt
    return ids


def test_tools_on_a_template_that_cannot_express_them_are_a_400(smollm2):
    async def probe(url):
        async with openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0) as c:
            with pytest.raises(openai.BadRequestError) as info:
                await c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
            return info.value.body

    async def go():
        async with tiny_decode_node(smollm2.dir) as url:
            return await probe(url)

    body = asyncio.run(go())
    assert body["param"] == "tools" and "cannot express tools" in body["message"]


# ---------------------------------------------------------------- the agent loop


@pytest.fixture(scope="module")
def nodes(tools_model, tmp_path_factory):
    with node_pair(tools_model, tmp_path_factory.mktemp("tools"), "tiny", "1G") as pair:
        yield pair


def _call(client, remote, messages, choice, stream):
    kw = dict(model="tiny", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=160,
              temperature=0, extra_body=remote)  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.message.tool_calls or []]
        return (
            m.message.content,
            calls,
            m.finish_reason,
            r.exo_split["report"] | {"prompt_tokens": r.usage.prompt_tokens},
        )
    content, calls, reason, report = "", {}, None, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        report = (chunk.model_extra.get("exo_split") or {}).get("report", report)
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:  # the first delta of a call: id and name, no arguments
                assert d.function.name and d.function.arguments == ""
                calls[d.index] = [d.id, d.function.name, ""]
            calls[d.index][2] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [tuple(c) for _, c in sorted(calls.items())], reason, report


def test_an_agent_loop_through_the_openai_client(nodes):
    prefill, decode = nodes
    remote = {"exo_split": {"prefill": "remote", "prefill_peer": prefill.addr, "fallback": "none"}}
    messages = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": "Weather in Oslo, then add 2 and 3."}]  # fmt: skip
    with openai.OpenAI(base_url=f"{decode.url}/v1", api_key=TOKEN, max_retries=0,
                       timeout=300) as client:  # fmt: skip
        last_prompt = 0
        for step in range(6):
            choice = "required" if step < 4 else "auto"
            if step == 2:
                choice = {"type": "function", "function": {"name": "add"}}
            content, calls, reason, report = _call(client, remote, messages, choice, False)
            s_content, s_calls, s_reason, _ = _call(client, remote, messages, choice, True)
            assert (s_content, [c[1:] for c in s_calls], s_reason) == (
                content,
                [c[1:] for c in calls],
                reason,
            )  # streamed equals not streamed
            assert report["decision"]["choice"] == "remote" and report["fallback"] is None
            if step > 0:  # everything up to the new tool result was reused on both nodes
                prefix = report["prefix"]
                assert prefix["decode_cached_tokens"] >= last_prompt, prefix
                assert prefix["prefill_cached_tokens"] >= last_prompt - 1, prefix
            if choice == "auto" and not calls:
                assert reason in ("stop", "length")
                break
            assert reason == "tool_calls" and calls, (step, content)
            for _, name, args in calls:
                jsonschema.validate(json.loads(args), SCHEMAS[name])
            assert step != 2 or all(name == "add" for _, name, _ in calls)
            last_prompt = report["prompt_tokens"]
            messages.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in calls]})  # fmt: skip
            for i, name, _ in calls:
                messages.append({"role": "tool", "tool_call_id": i,
                                 "content": json.dumps({"ok": True, "step": step, "of": name})})  # fmt: skip
        assert step >= 4  # the required steps all ran


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip


def _message(client, messages, choice, stream, remote):
    # temperature in extra_body: this SDK's create() no longer takes it (the API does)
    kw = dict(model="tiny", system="You are an agent.", messages=messages, max_tokens=160,
              tools=ANTHROPIC_TOOLS, tool_choice=choice,
              extra_body={"temperature": 0, **remote})  # fmt: skip
    if not stream:
        m = client.messages.create(**kw)
        blocks = [b.model_dump() for b in m.content]
        return blocks, m.stop_reason, m.model_extra["exo_split"]["report"], m.usage
    kinds, blocks = [], {}
    with client.messages.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_message()
    for b in final.content:
        blocks[len(blocks)] = b.model_dump()
    return list(blocks.values()), final.stop_reason, kinds, final.usage


def _ids_free(blocks):
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def test_an_agent_loop_through_the_anthropic_client(nodes):
    """The same loop on /v1/messages (x-api-key auth): tool_use blocks whose input validates,
    tool_result blocks sent back, Anthropic's event sequence when streamed, equal to the
    message; the prefix caches serve it as they serve the OpenAI API."""
    anthropic = pytest.importorskip("anthropic")
    prefill, decode = nodes
    remote = {"exo_split": {"prefill": "remote", "prefill_peer": prefill.addr, "fallback": "none"}}
    # (another question than the OpenAI loop's: that one's prompt is in the prefix caches)
    messages = [{"role": "user", "content": "Weather in Bergen, then add 4 and 5."}]
    with anthropic.Anthropic(base_url=decode.url, api_key=TOKEN, max_retries=0,
                             timeout=300) as client:  # fmt: skip
        last_prompt = 0
        for step in range(4):
            choice = {"type": "any"} if step < 3 else {"type": "auto"}
            if step == 1:
                choice = {"type": "tool", "name": "get_weather"}
            blocks, reason, report, use = _message(client, messages, choice, False, remote)
            s_blocks, s_reason, kinds, s_use = _message(client, messages, choice, True, remote)
            assert (_ids_free(s_blocks), s_reason) == (_ids_free(blocks), reason)
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert "message_delta" in kinds and use.output_tokens == s_use.output_tokens
            assert report["decision"]["choice"] == "remote"
            assert report["prefix"]["decode_cached_tokens"] >= last_prompt
            # Anthropic's split of the prompt: computed + read from a cache = the whole prompt
            assert use.cache_read_input_tokens == report["prompt_tokens"] - report["prefix"][
                "computed_tokens"]  # fmt: skip
            assert step == 0 or use.cache_read_input_tokens > 0  # the turns before it
            assert use.cache_creation_input_tokens == 0
            last_prompt = use.input_tokens + use.cache_read_input_tokens
            uses = [b for b in blocks if b["type"] == "tool_use"]
            if step == 3 and not uses:
                assert reason in ("end_turn", "max_tokens")
                break
            assert reason == "tool_use" and uses, (step, blocks)
            for b in uses:
                jsonschema.validate(b["input"], SCHEMAS[b["name"]])
            assert step != 1 or all(b["name"] == "get_weather" for b in uses)
            messages.append({"role": "assistant", "content": blocks})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b["id"], "content": f"ok {step}"}
                for b in uses]})  # fmt: skip
        count = client.messages.count_tokens(model="tiny", messages=messages,
                                             system="You are an agent.", tools=ANTHROPIC_TOOLS)  # fmt: skip
        assert step == 3 and count.input_tokens == last_prompt  # what the last step's prompt was


def test_chat_logprobs_through_the_split_equal_transformers(nodes, tools_model):
    """Chat logprobs with top_logprobs=3 through the remote prefill, streamed and not: the
    first token's included (the decode node computes it), each within 1e-4 of transformers'
    log-softmax on the same ids, greedy ids equal transformers'."""
    import torch
    from reference import reference_generate

    prefill, decode = nodes
    remote = {"exo_split": {"prefill": "remote", "prefill_peer": prefill.addr, "fallback": "none",
                            "prefix_cache": False}}  # fmt: skip
    ask = [{"role": "user", "content": "Name three colours."}]
    with openai.OpenAI(base_url=f"{decode.url}/v1", api_key=TOKEN, max_retries=0) as client:
        kw = dict(model="tiny", messages=ask, max_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=3, extra_body=remote)  # fmt: skip
        r = client.chat.completions.create(**kw)
        chunks = [c.choices[0].logprobs for c in client.chat.completions.create(**kw, stream=True)
                  if c.choices and c.choices[0].logprobs]  # fmt: skip
    assert r.exo_split["report"]["decision"]["choice"] == "remote"
    got = r.choices[0].logprobs.content
    assert [e.model_dump() for c in chunks for e in c.content] == [e.model_dump() for e in got]
    prompt = ChatTemplate(tools_model).token_ids(ask)
    ids = reference_generate(tools_model, prompt, 6)
    codec = TextCodec(tools_model)
    ref = torch.log_softmax(reference_logits(tools_model, prompt + ids)[len(prompt) - 1 :], -1)
    assert [e.token for e in got] == [codec.token_text(t) for t in ids]
    for i, e in enumerate(got):
        assert abs(e.logprob - ref[i, ids[i]].item()) <= 1e-4
        best = torch.topk(ref[i], 3)
        assert [a.token for a in e.top_logprobs] == [codec.token_text(int(j)) for j in best.indices]
        assert max(abs(a.logprob - v.item()) for a, v in zip(e.top_logprobs, best.values,
                                                              strict=True)) <= 1e-4  # fmt: skip
