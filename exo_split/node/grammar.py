"""Constrained decoding on the decode node: a request's grammar as a token mask per step.

The API layers describe what the output must be as a grammar in llguidance's JSON form
(transport/tools.py builds them: a JSON schema for response_format, a Lark grammar with
embedded schemas for a required tool call); this module compiles it against the model's
tokenizer with llguidance (Rust; ~10-20 us per mask on SmolLM2's 49K vocabulary, measured
by `exo-split bench --grammar`) and hands the decode loop a `Constraint`
(backends/base.py): `allowed()` is the mask for the next token, `accept(t)` moves the
grammar on. The mask is applied to the logits before the one sampling rule, so a
constrained pick is the rule's pick on the logits with every disallowed token at -inf:
greedy keeps the unconstrained token wherever the mask allows it.

The first token of a constrained request is picked by the decode node (the prefill ends
one position early and the decode loop computes the prompt's last position itself), so
the prefill node needs to know nothing about grammars.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from exo_split.errors import ExoSplitError


class BadGrammar(ExoSplitError):
    """A grammar that does not compile (a schema llguidance cannot express, a bad pattern),
    or a model whose tokenizer cannot be constrained: the request's 400."""


class Grammars:
    """The node's grammar compiler: llguidance's view of the tokenizer, built once (about
    0.2 s for a 49K vocabulary) on first use, then shared by every request."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_ids: frozenset[int]):
        self.path = Path(model_dir) / "tokenizer.json"
        self.vocab_size, self.eos_ids = vocab_size, eos_ids
        self._tokenizer = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                if not self.path.is_file():
                    raise BadGrammar(
                        f"constrained output needs the model's tokenizer.json ({self.path} is "
                        "missing)"
                    )
                if not self.eos_ids:
                    raise BadGrammar("constrained output needs the model's end-of-turn token")
                self._tokenizer = llguidance.LLTokenizer(
                    self.path.read_text(), n_vocab=self.vocab_size, eos_token=min(self.eos_ids)
                )
            return self._tokenizer

    def compile(self, grammar: dict) -> GrammarConstraint:
        """A fresh constraint for one request; BadGrammar with llguidance's reason."""
        import llguidance

        tokenizer = self._llg_tokenizer()
        text = json.dumps(grammar)
        try:
            matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        except (ValueError, RuntimeError) as exc:
            raise BadGrammar(f"the output format cannot be enforced: {exc}") from exc
        if matcher.is_error():
            raise BadGrammar(f"the output format cannot be enforced: {matcher.get_error()}")
        return GrammarConstraint(matcher, self.vocab_size)


class GrammarConstraint:
    """One request's grammar state (the `Constraint` of backends/base.py)."""

    def __init__(self, matcher, vocab_size: int):
        self._m, self.vocab_size = matcher, vocab_size
        self._bits = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)
        self.masks = 0  # masks computed (the report's count)

    def allowed(self) -> np.ndarray:
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self.masks += 1
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def accept(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            # The mask forbade it: only a pick outside the mask gets here (a bug, not input).
            raise RuntimeError(f"token {token} is outside the grammar: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        return self._m.is_stopped()

    @property
    def complete(self) -> bool:
        """Whether what was accepted so far is a whole sentence of the grammar."""
        return self._m.is_accepting() or self._m.is_stopped()
