"""The Anthropic Messages API: the translation into the OpenAI API's request, and a node
(a tiny random model with a tools template, MLX, in this process) answering the real
`anthropic` client: event order, stop sequences, auth by x-api-key, errors in Anthropic's
shape. The agent loop with tools is in test_tools.py (on two real nodes).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from nodes import TOKEN, request, tiny_decode_node

from exo_split.transport.anthropic import to_openai
from exo_split.transport.openai import OpenAIError

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.timeout(300)

BASE = {"model": "m", "max_tokens": 8}


def test_a_conversation_with_tool_use_becomes_the_openai_request():
    body = BASE | {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12 C"},
                {"type": "text", "text": "Thanks"}]},
        ],
        "tools": [{"name": "w", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "w", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "temperature": 0.5, "metadata": {"user_id": "u"},
    }  # fmt: skip
    req = to_openai(body)
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "user"]
    assert req.messages[0]["content"] == "Be brief."
    assert req.messages[2]["tool_calls"][0]["function"] == {
        "name": "w",
        "arguments": {"city": "Oslo"},
    }
    assert req.messages[3] == {"role": "tool", "content": "12 C", "tool_call_id": "toolu_1",
                               "name": "w"}  # fmt: skip
    assert req.tool_choice["function"]["name"] == "w" and req.parallel_tool_calls is False
    assert req.stop == ("END",) and req.sampling.temperature == 0.5


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
        ({"top_k": 5}, "top_k"),
        ({"temperature": 1.5}, "temperature"),
        ({"max_tokens": None}, "max_tokens"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"citations": True}, "citations"),
        ({"tools": [{"type": "web_search_20250305", "name": "web"}]}, "tools[0].type"),
    ],
)  # fmt: skip
def test_what_would_change_the_output_and_is_not_implemented_is_refused(extra, param):
    body = BASE | {"messages": [{"role": "user", "content": "hi"}]} | extra
    with pytest.raises(OpenAIError) as info:
        to_openai(body)
    assert info.value.status == 400 and info.value.param == param


def test_the_anthropic_client_streams_messages_events_in_order(tools_model):
    async def probe(url):
        base = url.removesuffix("/v1")
        async with anthropic.AsyncAnthropic(base_url=base, api_key=TOKEN, max_retries=0) as c:
            kw = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "Hi"}],
                      extra_body={"temperature": 0})  # fmt: skip
            whole = await c.messages.create(**kw)
            kinds = []
            async with c.messages.stream(**kw) as s:
                async for ev in s:
                    kinds.append(ev.type)
                streamed = await s.get_final_message()
            text = whole.content[0].text
            stop = text[3:6]  # a stop sequence that occurs in the answer
            stopped = await c.messages.create(**kw, stop_sequences=[stop])
            errors = {}
            async with anthropic.AsyncAnthropic(base_url=base, api_key="wrong", max_retries=0) as w:
                with pytest.raises(anthropic.AuthenticationError) as info:
                    await w.messages.create(**kw)
                errors["auth"] = info.value.body
            with pytest.raises(anthropic.NotFoundError) as info:
                await c.messages.create(**kw | {"model": "claude-sonnet-4-5"})
            errors["model"] = info.value.body
            errors["get"] = await request("GET", f"{base}/v1/messages", token=None,
                                          headers={"x-api-key": TOKEN})  # fmt: skip
            return whole, streamed, kinds, stopped, stop, errors

    async def go():
        async with tiny_decode_node(tools_model) as url:
            return await probe(url)

    whole, streamed, kinds, stopped, stop, errors = asyncio.run(go())
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    order = [k for k in kinds if k not in ("text", "ping")]
    assert order[0] == "message_start" and order[-2:] == ["message_delta", "message_stop"]
    assert order[1] == "content_block_start" and order[-3] == "content_block_stop"
    assert set(order[2:-3]) == {"content_block_delta"}
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == whole.content[0].text[: whole.content[0].text.find(stop)]
    assert errors["auth"]["type"] == "error"
    assert errors["auth"]["error"]["type"] == "authentication_error"
    assert errors["model"]["error"]["type"] == "not_found_error"
    status, raw, _ = errors["get"]
    assert status == 405 and json.loads(raw)["error"]["type"] == "invalid_request_error"
