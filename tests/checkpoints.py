"""Tiny random checkpoints built with transformers' save_pretrained, per test session.

Weights are drawn at std 0.2 (larger than the default init) so greedy output is not a
degenerate repeat; a word-level tokenizer from `tokenizers`. eos_token_id is None so
generation runs to max_tokens on both our side and the reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from exo_split.models.tiny import save_tokenizer

VOCAB = 512
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=None,
)

FAMILIES = {
    # Llama, GQA, llama3 rope scaling, non-default theta, untied.
    "llama": lambda **kw: LlamaConfig(
        **{**_COMMON, **kw},
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    # Mistral, MQA (one KV head), tied embeddings.
    "mistral": lambda **kw: MistralConfig(
        **{**_COMMON, **kw},
        num_key_value_heads=1,
        tie_word_embeddings=True,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
    ),
    # Qwen2: q/k/v biases, GQA, untied.
    "qwen2": lambda **kw: Qwen2Config(
        **{**_COMMON, **kw},
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # Qwen3: q/k norms, explicit head_dim != hidden/heads, MQA, tied.
    "qwen3": lambda **kw: Qwen3Config(
        **{**_COMMON, **kw},
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 300000.0},
    ),
}


def build(out_dir: Path, family: str, *, seed: int = 0, std: float = 0.2, **overrides) -> Path:
    config = FAMILIES[family](**overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir, VOCAB)
    return Path(out_dir)
