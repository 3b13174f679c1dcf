"""Fidelity of the in-process split: every pairing, every family, against transformers."""

from __future__ import annotations

import pytest
from reference import prompt_ids, reference_generate

from exo_split.backends import load_backend
from exo_split.errors import IncompatiblePeer, PromptTooLong
from exo_split.handoff import split_generate
from exo_split.sampling import Sampling

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LENGTHS = (1, 7, 255, 256, 257, 600)
PAIRINGS = (("torch", "mlx"), ("mlx", "torch"), ("torch", "torch"), ("mlx", "mlx"))
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def backends(checkpoint):
    loaded = {}

    def get(family, name):
        if (family, name) not in loaded:
            loaded[family, name] = load_backend(name, checkpoint(family))
        return loaded[family, name]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_every_pairing_matches_transformers(family, checkpoint, backends):
    for n in LENGTHS:
        ids = prompt_ids(n, seed=n)
        ref = reference_generate(checkpoint(family), ids, NEW_TOKENS)
        assert len(set(ref)) > 4, f"reference output is degenerate: {ref}"
        for a, b in PAIRINGS:
            got = split_generate(
                backends(family, a), backends(family, b), ids, max_tokens=NEW_TOKENS
            ).tokens
            assert got == ref, f"{family} {a}->{b} prompt {n}: {got} != {ref}"


@pytest.mark.parametrize("chunk", [1, 100, 256])
def test_chunked_prefill_gives_the_same_tokens(chunk, checkpoint, backends):
    ids = prompt_ids(300, seed=3)
    ref = reference_generate(checkpoint("llama"), ids, NEW_TOKENS)
    for a, b in (("torch", "mlx"), ("mlx", "torch")):
        got = split_generate(
            backends("llama", a), backends("llama", b), ids, max_tokens=NEW_TOKENS, chunk=chunk
        ).tokens
        assert got == ref


def test_rope_config_translation_matters(checkpoint, backends, monkeypatch):
    """The fidelity test is sensitive to config translation: dropping our rope translation
    (the old mlx-lm reading of transformers-5 configs) breaks agreement on a long prompt."""
    from exo_split.backends import mlx_backend

    ids = prompt_ids(600, seed=600)
    ref = reference_generate(checkpoint("llama"), ids, NEW_TOKENS)
    monkeypatch.setattr(mlx_backend, "_mlx_config", lambda spec: {})
    naive = mlx_backend.load(checkpoint("llama"))
    got = split_generate(backends("llama", "torch"), naive, ids, max_tokens=NEW_TOKENS).tokens
    assert got != ref


def test_sampling_with_temperature_is_the_same_on_every_pairing(backends):
    ids = prompt_ids(50, seed=5)
    s = Sampling(temperature=0.9, seed=42)
    runs = {
        (a, b): split_generate(
            backends("qwen3", a), backends("qwen3", b), ids, max_tokens=20, sampling=s
        ).tokens
        for a, b in PAIRINGS
    }
    assert len({tuple(r) for r in runs.values()}) == 1, runs
    other = split_generate(
        backends("qwen3", "torch"),
        backends("qwen3", "mlx"),
        ids,
        max_tokens=20,
        sampling=Sampling(temperature=0.9, seed=43),
    ).tokens
    assert other != runs["torch", "mlx"]


def test_incompatible_models_are_refused_naming_the_fields(backends):
    with pytest.raises(IncompatiblePeer) as err:
        split_generate(backends("llama", "torch"), backends("qwen3", "mlx"), [1, 2], max_tokens=2)
    msg = str(err.value)
    assert "architecture: 'llama' != 'qwen3'" in msg
    assert "head_dim" in msg


def test_prompt_longer_than_context_is_refused(backends):
    b = backends("llama", "torch")
    with pytest.raises(PromptTooLong, match="exceeds the model's context of 4096"):
        split_generate(b, b, [1] * 4090, max_tokens=10)
