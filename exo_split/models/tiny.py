"""Tiny Hugging Face checkpoints built locally: a word-level tokenizer, and the demo's
embedded default model (Llama family, random weights), built with numpy only so that a
Mac without torch can build it too. Nothing is ever downloaded.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

SPECIALS = ("<unk>", "<s>", "</s>")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "ch", "st")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")


def words(n: int) -> list[str]:
    """n distinct pronounceable pseudo-words, always the same for the same n (and the first
    ones the same for every n): the 112 syllables, then every pair of them, then every
    triple, ... Each syllable is a consonant onset and a vowel, so a word splits into
    syllables in one way only: no two words are equal, whatever n (a vocabulary of 32,000)."""
    syllables = [o + v for o in _ONSETS for v in _VOWELS]
    # Pairs in the order they have always had (first syllable 1, 2, ..., 111, then 0), so the
    # tokenizers of checkpoints built before keep their ids.
    pairs = (a + b for a in syllables[1:] + syllables[:1] for b in syllables)
    longer = (
        "".join(combo)
        for length in itertools.count(3)
        for combo in itertools.product(syllables, repeat=length)
    )
    return list(itertools.islice(itertools.chain(syllables, pairs, longer), n))


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Word-level tokenizer: specials, then pseudo-words; BOS prepended to every prompt."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for w in words(vocab_size - len(SPECIALS)):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIALS))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    return tok


def save_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    out = Path(out_dir)
    build_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
            },
            indent=2,
        )
    )


def sample_prompt(n_words: int, *, seed: int = 0, vocab_size: int = 512) -> str:
    """A prompt of exactly n_words pseudo-words (n_words + 1 tokens with BOS)."""
    rng = np.random.default_rng(seed)
    vocab = words(vocab_size - len(SPECIALS))
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), n_words))


def chat_template() -> str:
    """A ChatML-like chat template over the word-level vocabulary's own first two words (its
    markers of a message's start and end), so that every token of a rendered chat is a word
    of the vocabulary except the roles. It never writes </s>: a reply that ended with it is
    rendered differently next turn, as real templates often do."""
    begin, end = words(2)
    return (
        "{% for m in messages %}" + begin + " {{ m['role'] }} {{ m['content'] }} " + end + " "
        "{% endfor %}{% if add_generation_prompt %}" + begin + " assistant{% endif %}"
    )


def add_chat_template(model_dir: str | Path, template: str | None = None) -> Path:
    """Give a checkpoint a chat template (tokenizer_config.json), `chat_template()` by default."""
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | {"chat_template": template or chat_template()}, indent=2))
    return Path(model_dir)


# The embedded default: big enough that per-layer compute shows in the timeline on a
# laptop CPU (a few hundred ms of prefill for ~1,000 tokens), small enough to build in seconds.
DEFAULT_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}
DEFAULT_NAME = "exo-split-demo-llama-12L"
_BUILD_VERSION = 1


def default_model_dir() -> Path:
    base = os.environ.get("EXO_SPLIT_CACHE") or os.environ.get("XDG_CACHE_HOME")
    root = Path(base) if base else Path.home() / ".cache"
    if not os.environ.get("EXO_SPLIT_CACHE"):
        root = root / "exo-split"
    return root / f"{DEFAULT_NAME}-v{_BUILD_VERSION}"


def build_llama(out_dir: str | Path, config: dict, *, seed: int = 0, std: float = 0.08) -> Path:
    """Write a random-weight Llama checkpoint in HF format (config, safetensors, tokenizer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    c = config
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def w(*shape):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": np.ones(d, np.float32)}
    if not c.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = w(v, d)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(q, d),
            p + "self_attn.k_proj.weight": w(kv, d),
            p + "self_attn.v_proj.weight": w(kv, d),
            p + "self_attn.o_proj.weight": w(d, q),
            p + "mlp.gate_proj.weight": w(f, d),
            p + "mlp.up_proj.weight": w(f, d),
            p + "mlp.down_proj.weight": w(d, f),
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(out, v)
    return out


def ensure_default_model(progress=None) -> Path:
    """The embedded default model, built on first use into the cache directory."""
    out = default_model_dir()
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    if progress:
        progress(f"building the embedded default model in {out} (first run only)")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        build_llama(tmp, DEFAULT_CONFIG, seed=1234)
        tmp.rename(out)  # atomic: a half-built model is never seen under the real name
    except OSError:
        if not (out / "model.safetensors").is_file():  # not a lost race with another build
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
