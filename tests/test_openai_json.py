"""The OpenAI API's JSON (exo_split/transport/openai.py), without a server: request bodies
accepted and refused (naming the parameter), response and chunk shapes, and stop strings that
come out the same however the text is cut into pieces. tests/test_openai.py runs the API."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exo_split.transport.openai import (
    CompletionRequest,
    OpenAIError,
    Reply,
    error_body,
)
from exo_split.transport.stops import StopStrings, cut_at_stop

# ---------------------------------------------------------------- OpenAI request bodies

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_chat_request_with_every_option():
    req = CompletionRequest.from_json(
        CHAT | {"max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
                "stop": "\n", "stream": True, "stream_options": {"include_usage": True},
                "n": 1, "presence_penalty": 0, "user": "someone",
                "exo_split": {"prefill": "remote", "prefill_peer": "h:1",
                              "prefix_cache": False}},
        chat=True,
    )  # fmt: skip
    assert (req.max_tokens, req.stop, req.stream, req.include_usage) == (7, ("\n",), True, True)
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.seed) == (0.0, 0.5, 3)
    gen = req.generate_request(7)
    assert gen.messages == ({"role": "user", "content": "hi"},)
    assert (gen.prefill, gen.prefill_peer, gen.max_tokens) == ("remote", "h:1", 7)
    assert gen.prefix_cache is False
    assert CompletionRequest.from_json(CHAT, chat=True).generate_request(1).prefix_cache is True


def test_defaults_follow_openai():
    a = CompletionRequest.from_json(CHAT, chat=True)
    b = CompletionRequest.from_json(CHAT, chat=True)
    assert a.sampling.temperature == 1.0 and a.max_tokens is None and not a.include_usage
    assert a.sampling.seed != b.sampling.seed  # no seed: sampled differently each time
    # stream_options without a stream is refused (OpenAI: 400), not ignored
    with pytest.raises(OpenAIError, match="only allowed with stream: true"):
        CompletionRequest.from_json(CHAT | {"stream_options": {"include_usage": True}}, chat=True)
    c = CompletionRequest.from_json(CHAT | {"stream": True, "stream_options": {}}, chat=True)
    assert c.stream and not c.include_usage


@pytest.mark.parametrize(
    "prompt, field, value",
    [("text", "prompt", "text"), (["text"], "prompt", "text"), ([5, 6], "token_ids", (5, 6)),
     ([[5, 6]], "token_ids", (5, 6))],
)  # fmt: skip
def test_completion_prompts(prompt, field, value):
    req = CompletionRequest.from_json({"model": "m", "prompt": prompt}, chat=False)
    assert getattr(req, field) == value


@pytest.mark.parametrize(
    "body, param, message",
    [
        ([], None, "must be a JSON object"),
        ({"messages": CHAT["messages"]}, "model", "model is required"),
        (CHAT | {"messages": [{"role": "x", "content": "y"}]}, "messages[0].role", "got 'x'"),
        (CHAT | {"n": 9}, "n", r"n must be an integer in \[1, 8\], got 9"),
        (CHAT | {"n": 0}, "n", "n must be an integer"),
        (CHAT | {"best_of": 3}, "best_of", "best_of=3 is not supported"),
        (CHAT | {"logprobs": 3}, "logprobs", "true or false"),
        (CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs", r"in \[0, 20\]"),
        (CHAT | {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        (CHAT | {"tools": [{"type": "function"}]}, "tools[0]", "must be an object with a name"),
        (
            CHAT | {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "must match",
        ),
        (
            CHAT
            | {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
            "not among the tools",
        ),
        (
            CHAT
            | {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "cannot both constrain",
        ),
        (
            CHAT | {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.schema",
            "must be a JSON schema",
        ),
        (CHAT | {"frequency_penalty": 2.5}, "frequency_penalty", r"in \[-2, 2\]"),
        (CHAT | {"top_k": 5}, "top_k", "not supported"),
        (CHAT | {"temperature": 3}, "temperature", r"in \[0, 2\], got 3"),
        (CHAT | {"temperature": "hot"}, "temperature", "got 'hot'"),
        (CHAT | {"top_p": 0}, "top_p", "above 0"),
        (CHAT | {"seed": 1.5}, "seed", "integer"),
        (CHAT | {"max_tokens": 0}, "max_tokens", "positive integer, got 0"),
        (CHAT | {"max_tokens": True}, "max_tokens", "positive integer"),
        (CHAT | {"stop": ["a", 1]}, "stop", "list of strings"),
        (CHAT | {"stop": list("abcde")}, "stop", "at most 4"),
        (CHAT | {"stream": "yes"}, "stream", "true or false"),
        (CHAT | {"exo_split": {"prefill": "elsewhere"}}, "exo_split.prefill", "not an option"),
    ],
)
def test_bad_chat_requests_name_the_parameter(body, param, message):
    with pytest.raises(OpenAIError, match=message) as info:
        CompletionRequest.from_json(body, chat=True)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", [None, [], ["a", "b"], [1, -2], {"text": "x"}, [True]])
def test_bad_completion_prompts(prompt):
    with pytest.raises(OpenAIError) as info:
        CompletionRequest.from_json({"model": "m", "prompt": prompt}, chat=False)
    assert info.value.param == "prompt"


def test_error_bodies_have_openai_shape():
    assert error_body(401, "unauthorized", "no") == {
        "error": {"message": "no", "type": "authentication_error", "param": None,
                  "code": "unauthorized"}
    }  # fmt: skip
    assert error_body(503, "busy", "full")["error"]["type"] == "server_error"


def test_reply_shapes():
    chat = Reply.new(True, 1, "m", "fp")
    assert chat.id.startswith("chatcmpl-") and Reply.new(False, 1, "m", "fp").id.startswith("cmpl-")
    r = chat.response("Hi.", "stop", {"prompt_tokens": 1}, {"mode": "overlap"})
    assert r["object"] == "chat.completion" and r["system_fingerprint"] == "fp"
    assert r["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hi."},
                             "logprobs": None, "finish_reason": "stop"}]  # fmt: skip
    assert r["exo_split"] == {"report": {"mode": "overlap"}}
    assert chat.chunk("")["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk("x")["choices"][0]["delta"] == {"content": "x"}
    end = chat.chunk(None, "length")["choices"][0]
    assert end["delta"] == {} and end["finish_reason"] == "length"
    assert Reply.new(False, 1, "m", "fp").chunk("x")["choices"][0]["text"] == "x"


# ---------------------------------------------------------------- stop strings


def test_the_first_stop_string_to_be_complete_ends_the_text():
    # "c" is complete (at 3) before "aca" (at 4), though "aca" starts first.
    assert cut_at_stop("aaca", ("c", "aca")) == 2
    assert cut_at_stop("xab", ("b", "ab")) == 1  # both complete at once: the longer
    assert cut_at_stop("abc", ("z",)) is None


def test_stop_strings_hold_back_what_may_be_a_stop():
    s = StopStrings(("END", "\n\n"))
    assert s.push("The answer") == "The answer"
    assert s.push(" is E") == " is "  # "E" may start "END"
    assert s.push("N") == ""
    assert s.push("TRY\n") == "ENTRY"  # not "END" after all; "\n" may start "\n\n"
    assert s.push("\nmore") == "" and s.hit
    assert s.push("after") == ""


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\nc", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=4), min_size=1, max_size=4),
)
def test_stop_strings_stream_equals_cutting_the_whole_text(text, cuts, stops):
    stops = tuple(stops)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    s = StopStrings(stops)
    out = "".join(s.push(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    cut = cut_at_stop(text, stops)
    whole = text if cut is None else text[:cut]
    assert s.hit == (cut is not None)
    assert whole.startswith(out)
    if s.hit:
        assert out == whole
    else:  # what is held back could still start a stop string
        assert len(whole) - len(out) < max(map(len, stops))
