"""Multi-turn conversations through two real nodes (torch prefill, MLX decode) with their
prefix caches on: every turn's tokens equal transformers' on the whole history (float32,
greedy, no cache), whether the new suffix is prefilled locally or remotely, and after the
caches evicted the conversation; only the KV the decode node lacks moves."""

from __future__ import annotations

import asyncio
import json

import pytest
from nodes import NodeProcess, generate_sync, request
from reference import prompt_ids, reference_generate

pytestmark = pytest.mark.timeout(600)

LAYERS = 6
NEW = 8
BYTES_PER_POSITION = LAYERS * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x float32


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def pair(ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("multiturn")
    prefill = NodeProcess(ckpt, "torch", work, prefix_cache_bytes="1M")
    decode = NodeProcess(ckpt, "mlx", work, "--max-kv-bytes", "3M", prefix_cache_bytes="2M")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def info(node) -> dict:
    status, body, _ = asyncio.run(request("GET", f"{node.url}/v1/info"))
    assert status == 200
    return json.loads(body)


def turn(pair, ckpt, ids: list[int], where: str, **extra) -> dict:
    prefill, decode = pair
    body = {"token_ids": ids, "max_tokens": NEW, "fallback": "none", **extra}
    body |= {"prefill": "local"} if where == "local" else {"prefill_peer": prefill.addr}
    done = generate_sync(decode.url, body)
    assert done["tokens"] == reference_generate(ckpt, ids, NEW), where
    report = done["report"]
    assert report["mode"] == ("local" if where == "local" else "overlap")
    assert set(report["prefix"]) == {"decode_cached_tokens", "prefill_cached_tokens",
                                     "computed_tokens"}  # fmt: skip
    return done


def test_a_conversation_reuses_both_caches_and_moves_only_the_new_kv(pair, ckpt):
    history = prompt_ids(300, seed=1)
    # Turn 1: nothing cached anywhere; the whole prompt's KV moves.
    done = turn(pair, ckpt, history, "remote")
    assert done["report"]["prefix"] == {"decode_cached_tokens": 0, "prefill_cached_tokens": 0,
                                        "computed_tokens": 300}  # fmt: skip
    assert done["report"]["kv_bytes"] == 300 * BYTES_PER_POSITION
    # The decode node holds the prompt and the reply tokens it fed back in.
    held = len(history) + NEW - 1
    history = history + done["tokens"] + prompt_ids(41, seed=2)[1:]

    # Turn 2: a short user turn, prefilled on the decode node: nothing on the wire.
    done = turn(pair, ckpt, history, "local")
    n = len(history)
    assert done["report"]["prefix"] == {"decode_cached_tokens": held, "prefill_cached_tokens": 0,
                                        "computed_tokens": n - held}  # fmt: skip
    assert done["report"]["kv_bytes"] == 0 and done["report"]["layers"] == []
    held = n + NEW - 1
    history = history + done["tokens"] + prompt_ids(201, seed=3)[1:]

    # Turn 3: a long paste, prefilled remotely. The prefill node holds turn 1's prompt only:
    # it recomputes the replies and turn 2, and streams only what the decode node lacks.
    done = turn(pair, ckpt, history, "remote")
    n = len(history)
    assert done["report"]["prefix"] == {"decode_cached_tokens": held, "prefill_cached_tokens": 300,
                                        "computed_tokens": n - 300}  # fmt: skip
    assert done["report"]["kv_bytes"] == (n - held) * BYTES_PER_POSITION
    assert {p["token_start"] for p in done["report"]["layers"]} == {held}
    prev, held = n, n + NEW - 1
    history = history + done["tokens"] + prompt_ids(31, seed=4)[1:]

    # Turn 4, remote again: now the prefill node holds turn 3's prompt.
    done = turn(pair, ckpt, history, "remote")
    n = len(history)
    assert done["report"]["prefix"] == {"decode_cached_tokens": held, "prefill_cached_tokens": prev,
                                        "computed_tokens": n - prev}  # fmt: skip
    assert done["report"]["kv_bytes"] == (n - held) * BYTES_PER_POSITION

    # The same turn without reuse: the whole history computed and moved, the same tokens.
    again = turn(pair, ckpt, history, "remote", prefix_cache=False)
    assert again["report"]["prefix"] == {"decode_cached_tokens": 0, "prefill_cached_tokens": 0,
                                         "computed_tokens": n}  # fmt: skip
    assert again["report"]["kv_bytes"] == n * BYTES_PER_POSITION
    assert again["tokens"] == done["tokens"]
    cache = info(pair[1])["prefix_cache"]
    assert cache["entries"] >= 1 and 0 < cache["bytes"] <= cache["limit"] == 2 * 2**20


def test_a_failed_peer_falls_back_to_a_local_prefill_on_top_of_the_held_prefix(pair, ckpt):
    history = prompt_ids(120, seed=50)
    done = turn(pair, ckpt, history, "local")
    history = history + done["tokens"] + prompt_ids(31, seed=51)[1:]
    _, decode = pair
    body = {"token_ids": history, "max_tokens": NEW, "prefill_peer": "127.0.0.1:9"}
    done = generate_sync(decode.url, body)  # nothing listens there: the fallback prefills
    assert done["report"]["fallback"] and done["report"]["mode"] == "local"
    assert done["tokens"] == reference_generate(ckpt, history, NEW)
    held = 120 + NEW - 1
    assert done["report"]["prefix"] == {"decode_cached_tokens": held, "prefill_cached_tokens": 0,
                                        "computed_tokens": len(history) - held}  # fmt: skip


def test_the_caches_evict_lru_and_refuse_nothing_that_fits(pair, ckpt):
    prefill, decode = pair
    convs = {c: prompt_ids(300, seed=100 + c) for c in range(3)}
    for c, ids in convs.items():  # three 300-token conversations: the oldest must go
        done = turn(pair, ckpt, ids, "remote")
        convs[c] = ids + done["tokens"] + prompt_ids(21, seed=200 + c)[1:]
    d, p = info(decode)["prefix_cache"], info(prefill)["prefix_cache"]
    for cache in (d, p):
        assert cache["evicted"] >= 1 and cache["bytes"] <= cache["limit"], cache
    # Conversation 0 was evicted on both sides: its next turn computes everything, correctly.
    done = turn(pair, ckpt, convs[0], "remote")
    assert done["report"]["prefix"]["decode_cached_tokens"] == 0
    assert done["report"]["prefix"]["prefill_cached_tokens"] == 0
    # Conversation 2 is the most recent: reused.
    done = turn(pair, ckpt, convs[2], "local")
    assert done["report"]["prefix"]["decode_cached_tokens"] == 300 + NEW - 1
    # A request whose KV fits the node's 3M only once the cache gives way is admitted: the
    # cache shrinks, nothing is refused.
    before = info(decode)
    assert before["prefix_cache"]["bytes"] > 3 * 2**20 - 1700 * BYTES_PER_POSITION
    ids = prompt_ids(300, seed=300)
    body = {"token_ids": ids, "max_tokens": 1400, "prefill": "local"}
    done = generate_sync(decode.url, body)
    assert len(done["tokens"]) >= 1
    after = info(decode)
    assert after["prefix_cache"]["evicted"] > before["prefix_cache"]["evicted"]
    assert after["stats"]["kv_bytes_peak"] <= 3 * 2**20
    assert after["stats"].get("refused", 0) == before["stats"].get("refused", 0)


# ---- the embedded chat model through the OpenAI API --------------------------------------

CHAT = ["What is the capital of France?", "And of Italy?", "Which one is bigger?"]


def test_a_smollm2_chat_through_the_openai_api_reuses_its_history(smollm2, tmp_path):
    """Three turns of SmolLM2's ChatML conversation, each sent as the whole history (the reply
    text re-rendered by the template): every answer is transformers' on that history, turn 2
    is prefilled on the decode node from its cache, turn 3 moves only the new turn's KV."""
    import openai
    from reference import reference_chat
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2.dir)
    prefill = NodeProcess(smollm2.dir, "torch", tmp_path, "--no-warmup", prefix_cache_bytes="1G")
    decode = NodeProcess(smollm2.dir, "mlx", tmp_path, "--no-warmup", "--model-name", "smollm2",
                         prefix_cache_bytes="1G")  # fmt: skip
    try:
        prefill.wait_ready(180)
        decode.wait_ready(180)
        client = openai.OpenAI(base_url=f"{decode.url}/v1", api_key="test-token-0123456789",
                               max_retries=0, timeout=300)  # fmt: skip
        messages, held = [], 0
        for i, (question, where) in enumerate(
            zip(CHAT, ("remote", "local", "remote"), strict=True)
        ):
            messages.append({"role": "user", "content": question})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)  # fmt: skip
            want = reference_chat(smollm2.dir, ids, 24)
            split = {"prefill": where, "fallback": "none"}
            if where == "remote":
                split["prefill_peer"] = prefill.addr
            r = client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                               max_tokens=24, extra_body={"exo_split": split})  # fmt: skip
            text = r.choices[0].message.content
            assert text == tok.decode(want, skip_special_tokens=True), (i, text)
            prefix, kv = r.exo_split["report"]["prefix"], r.exo_split["report"]["kv_bytes"]
            print(f"\nturn {i + 1} ({where}): {len(ids)} tokens, {prefix}, {kv} B: {text!r}")
            # The template renders the reply as generated: the whole held turn is reused.
            assert prefix["decode_cached_tokens"] == held
            # OpenAI's usage counts the positions no node computed: a local turn's held ones
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert cached == len(ids) - prefix["computed_tokens"]
            assert cached == held if where == "local" else cached == prefix["prefill_cached_tokens"]
            assert (kv == 0) == (where == "local")
            if i == 2:  # the prefill node holds turn 1's prompt; only [held, n) moved
                assert prefix["prefill_cached_tokens"] > 0
                assert kv == (len(ids) - held) * 30 * 2 * 3 * 64 * 4
            # Every generated id was fed back in but the last one when max_tokens cut it.
            held = len(ids) + len(want) - (want[-1] not in (0, 2))
            messages.append({"role": "assistant", "content": text})
        client.close()
    finally:
        prefill.stop()
        decode.stop()
