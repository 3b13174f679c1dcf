"""The independent reference: Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=8)
def reference_model(model_dir, dtype: str = "float32"):
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


def reference_generate(model_dir, ids: list[int], max_new_tokens: int) -> list[int]:
    model = reference_model(str(model_dir))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def reference_logits(model_dir, ids: list[int], dtype: str = "float32") -> torch.Tensor:
    """float32 logits [len(ids), vocab] of a teacher-forced pass."""
    model = reference_model(str(model_dir), dtype)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def prompt_ids(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()


def reference_chat(model_dir, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy generate that stops on the checkpoint's end-of-turn ids (generation_config.json),
    as a chat does; the stop token, when reached, is the last id."""
    from transformers import GenerationConfig

    stops = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    model = reference_model(str(model_dir))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=stops[0] if isinstance(stops, list) else stops,
        )
    return out[0, len(ids) :].tolist()
