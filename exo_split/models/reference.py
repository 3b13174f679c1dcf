"""The independent reference of `exo-split check` and the fidelity tests: transformers'
AutoModelForCausalLM on the CPU, loaded on its own from the same checkpoint. torch and
transformers are imported when one is made, never at import."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from exo_split.errors import BadCheckpoint

__all__ = ["Reference"]


class Reference:
    """transformers' AutoModelForCausalLM on the CPU, loaded on its own."""

    def __init__(self, model_dir: str | Path, eos_ids: frozenset[int], dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        self._torch = torch
        self.eos_ids = sorted(eos_ids) or None
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=getattr(torch, dtype)
            ).eval()
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise BadCheckpoint(f"transformers cannot load {model_dir}: {exc}") from exc
        # A clean generation config: a checkpoint's own (repetition_penalty, top_k, ...)
        # would change what greedy means.
        self.model.generation_config = GenerationConfig(
            do_sample=False, eos_token_id=self.eos_ids, pad_token_id=0
        )

    def generate(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        torch = self._torch
        ids = torch.tensor([list(token_ids)])
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens
            )
        return out[0, len(token_ids) :].tolist()

    def teacher_forced_logits(self, token_ids: Sequence[int], forced: Sequence[int]) -> np.ndarray:
        """float32 logits [len(forced), vocab] predicting each forced token, in one pass."""
        torch = self._torch
        ids = torch.tensor([list(token_ids) + list(forced[:-1])])
        with torch.inference_mode():
            out = self.model(ids, logits_to_keep=len(forced))
        return out.logits[0].float().numpy()
