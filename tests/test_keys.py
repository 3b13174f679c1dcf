"""Client API keys (transport/keys.py, issue 18 M6): the key file, what a key opens, and
prefix caches scoped per key on both nodes, so one client's cached-token figures say
nothing about another's conversations.
"""

from __future__ import annotations

import asyncio
import json
import stat

import openai
import pytest
from nodes import TOKEN, node_pair, request

from exo_split.cli.main import main
from exo_split.errors import ExoSplitError
from exo_split.node.prefix import PrefixCache
from exo_split.transport.keys import KeyRing, add_key, list_keys, remove_key, scope_of

pytestmark = pytest.mark.timeout(300)


def test_the_key_file_holds_digests_and_a_ring_follows_its_changes(tmp_path):
    path = tmp_path / "keys.json"
    ring = KeyRing(path)
    assert ring.match("exo-nothing") is None  # no file yet
    alice, bob = add_key(path, "alice"), add_key(path, "bob")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert alice not in path.read_text() and set(list_keys(path)) == {"alice", "bob"}
    assert ring.match(alice) == "alice" and ring.match(bob) == "bob"
    assert ring.match(TOKEN) is None and ring.match(alice + "x") is None
    with pytest.raises(ExoSplitError, match="already has a key named 'alice'"):
        add_key(path, "alice")
    with pytest.raises(ExoSplitError, match="1-64 of"):
        add_key(path, "a b")
    remove_key(path, "alice")
    assert ring.match(alice) is None and ring.match(bob) == "bob"
    path.write_text("{broken")
    assert ring.match(bob) is None  # a broken file opens nothing


def test_scopes_are_per_name_and_token(tmp_path):
    assert scope_of(TOKEN, "") == ""
    assert scope_of(TOKEN, "alice") != scope_of(TOKEN, "bob")
    assert scope_of(TOKEN, "alice") != scope_of("another-token", "alice")
    assert "alice" not in scope_of(TOKEN, "alice")


class _Ops:
    def trim(self, cache, n): ...
    def reserve(self, cache, capacity): ...
    def fork(self, cache, n, capacity):
        return cache

    def cache_nbytes(self, cache):
        return 1


def test_a_prefix_cache_serves_each_scope_its_own_entries():
    cache = PrefixCache(_Ops(), limit_bytes=100)
    tokens = list(range(40))
    cache.put(tokens, "alice's", "A")
    cache.put(tokens[:20], "bob's", "B")  # not dropped by alice's longer entry: other scope
    assert len(cache) == 2
    assert cache.checkout(tokens + [1], "B").cached == 20
    assert cache.checkout(tokens + [1], "").how == "none"
    assert cache.checkout(tokens + [1], "A").cached == 40


def test_cli_keys_add_list_remove(tmp_path, capsys):
    path = tmp_path / "k.json"
    assert main(["keys", "add", "laptop", "--keys-file", str(path)]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    assert key.startswith("exo-") and KeyRing(path).match(key) == "laptop"
    assert main(["keys", "list", "--keys-file", str(path)]) == 0
    assert capsys.readouterr().out.startswith("laptop\tcreated ")
    assert main(["keys", "remove", "laptop", "--keys-file", str(path)]) == 0
    assert main(["keys", "remove", "laptop", "--keys-file", str(path)]) == 2  # a clear error


def test_keys_on_real_nodes_open_the_apis_only_and_keep_prefixes_apart(llama, tmp_path):
    keys = tmp_path / "keys.json"
    alice, bob = add_key(keys, "alice"), add_key(keys, "bob")
    prompt = list(range(3, 43))
    with node_pair(llama, tmp_path, "tiny", "1G", "--keys-file", str(keys)) as (prefill, decode):
        remote = {"exo_split": {"prefill": "remote", "prefill_peer": prefill.addr,
                                "fallback": "none"}}  # fmt: skip

        def complete(key, ids):
            with openai.OpenAI(base_url=f"{decode.url}/v1", api_key=key, max_retries=0) as c:
                r = c.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                         extra_body=remote)  # fmt: skip
            return r.exo_split["report"]["prefix"]

        first = complete(alice, prompt)
        assert first["decode_cached_tokens"] == 0
        longer = prompt + [50, 51, 52, 53, 54, 55]
        mine = complete(alice, longer)  # alice's own conversation: reused on both nodes
        assert mine["decode_cached_tokens"] >= 40 and mine["prefill_cached_tokens"] >= 39
        theirs = complete(bob, longer)  # bob sends alice's conversation: nothing is reused
        assert theirs["decode_cached_tokens"] == 0 and theirs["prefill_cached_tokens"] == 0
        owner = complete(TOKEN, longer)  # the shared token's scope is another again
        assert owner["decode_cached_tokens"] == 0 and owner["prefill_cached_tokens"] == 0

        async def plane():
            return [
                (await request("GET", f"{decode.url}/v1/info", token=alice))[0],
                (await request("POST", f"{prefill.url}/v1/prefill", token=alice,
                               data=json.dumps({"token_ids": [1, 2]})))[0],
                (await request("GET", f"{decode.url}/v1/models", token=alice))[0],
            ]  # fmt: skip

        assert asyncio.run(plane()) == [401, 401, 200]
        remove_key(keys, "alice")
        with pytest.raises(openai.AuthenticationError):
            complete(alice, prompt)
        assert complete(bob, prompt)["decode_cached_tokens"] == 39  # bob: his own, still
