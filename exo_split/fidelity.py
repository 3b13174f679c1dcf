"""The fidelity self-test behind `exo-split check`: does a split give the tokens a single
machine would?

For a few built-in prompts, every installed pairing (torch->mlx, mlx->torch, torch->torch,
mlx->mlx) generates greedily through the real handoff and is compared with
- the decode side's backend run alone (prefill and decode on it), and
- transformers' `generate()` on the same checkpoint, on the CPU in the check's dtype (the
  independent reference), plus a teacher-forced pass: the reference sequence is fed through the pairing
  (prefill on A, inject into B, B.step over the reference tokens) and its logits are
  compared with the reference's.

A quantized decode side (`--decode-model` an mlx_lm.convert copy of `--model`: the
mixed pair of a full-precision prefill node and a 4- or 8-bit decode node) is also compared
with mlx-lm running the quantized checkpoint alone (its generate_step and one teacher-forced
forward pass, loaded with the RoPE settings mlx-lm would miss in a transformers-5 config):
top-1 agreement and max logit error over the tokens mlx-lm generates. Against transformers
the figures are the quantization's error, reported without a bar; the bar is agreement with
the quantized model alone (`QUANT_TOP1_BARS`), which differs from the pair only by the
prompt's KV and token 0, both computed at full precision.

The pass bar (DESIGN §3): in float32 the greedy tokens are identical; in float16/bfloat16
kernels differ by about one ulp and sequences can part at near-ties, so the bar is
teacher-forced top-1 agreement >= 90%. The reference runs in the check's dtype, not
float32: against float32, bfloat16 weight rounding alone costs ~10% top-1 on small models
even for torch->torch, which says nothing about the split. No printing here: `run_check` returns a CheckReport
and the CLI renders it. torch/transformers are imported lazily, only for the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exo_split.backends import Backend, load_backend
from exo_split.errors import BadCheckpoint, ExoSplitError
from exo_split.handoff import prefill_into, split_generate
from exo_split.models.reference import Reference
from exo_split.sampling import GREEDY
from exo_split.spec import (
    ModelSpec,
    Quantization,
    check_request,
    load_quantization,
    load_spec,
    require_compatible,
)
from exo_split.tokenizer import TextCodec

log = logging.getLogger(__name__)

PROMPT_LENGTHS = (1, 40, 300)
PAIRINGS = (("torch", "mlx"), ("mlx", "torch"), ("torch", "torch"), ("mlx", "mlx"))
CHECKED = ("torch", "mlx")  # the backends that prefill and decode (vllm only prefills)
HALF_TOP1_BAR = 0.90
# float32: the largest |logit difference| from transformers, teacher-forced and for token 0,
# relative to the largest |reference logit| (at least 1). A monotone transform of the logits
# (a missing logit scale or soft-cap) keeps greedy tokens and fails this.
FLOAT32_LOGIT_BOUND = 1e-3
# A quantized decode side vs the quantized model alone, by bits (at least): SmolLM2-135M's
# mixed pair agrees 98% (8-bit) and 84% (4-bit) over natural text (docs/BENCHMARKS.md).
QUANT_TOP1_BARS = ((8, 0.90), (4, 0.75), (0, 0.50))

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PromptResult:
    """One pairing on one prompt."""

    prompt_tokens: int
    tokens: tuple[int, ...]  # the pairing's greedy tokens
    baseline_tokens: tuple[int, ...]  # the decode side's backend alone
    reference_tokens: tuple[int, ...] | None  # transformers generate(); None: not installed
    mismatch_vs_baseline: int | None  # first differing position, None if identical
    mismatch_vs_reference: int | None
    top1_agreement: float | None  # teacher-forced, vs the reference logits
    max_logit_diff: float | None  # teacher-forced, all positions
    first_logit_diff: float | None  # the prefill side's logits for generated token 0
    # A quantized decode side: teacher-forced over mlx-lm-alone's greedy tokens, vs its logits.
    top1_vs_decode_alone: float | None = None
    max_logit_diff_vs_decode_alone: float | None = None
    reference_logit_max: float | None = None  # max |logit| of the reference's rows


@dataclass(frozen=True)
class PairingResult:
    prefill: str
    decode: str
    prompts: tuple[PromptResult, ...]
    passed: bool
    reason: str | None  # why it failed, None when it passed

    @property
    def name(self) -> str:
        return f"{self.prefill}->{self.decode}"

    @property
    def agrees_with_baseline(self) -> bool:
        return all(p.mismatch_vs_baseline is None for p in self.prompts)

    @property
    def agrees_with_reference(self) -> bool | None:
        if any(p.reference_tokens is None for p in self.prompts):
            return None
        return all(p.mismatch_vs_reference is None for p in self.prompts)

    @property
    def top1_agreement(self) -> float | None:
        """Over all teacher-forced positions of all prompts."""
        return _pooled([(p.top1_agreement, len(p.tokens)) for p in self.prompts])

    @property
    def max_logit_diff(self) -> float | None:
        diffs = [p.max_logit_diff for p in self.prompts]
        return None if None in diffs else max(diffs)

    @property
    def first_logit_diff(self) -> float | None:
        diffs = [p.first_logit_diff for p in self.prompts]
        return None if None in diffs else max(diffs)

    @property
    def top1_vs_decode_alone(self) -> float | None:
        return _pooled([(p.top1_vs_decode_alone, len(p.tokens)) for p in self.prompts])

    @property
    def max_logit_diff_vs_decode_alone(self) -> float | None:
        diffs = [p.max_logit_diff_vs_decode_alone for p in self.prompts]
        return None if None in diffs else max(diffs)

    def first_mismatch(self, against: str) -> tuple[int, int] | None:
        """(prompt tokens, position) of the first disagreement with "baseline" or "reference"."""
        for p in self.prompts:
            pos = p.mismatch_vs_baseline if against == "baseline" else p.mismatch_vs_reference
            if pos is not None:
                return p.prompt_tokens, pos
        return None


def _pooled(scored: list[tuple[float | None, int]]) -> float | None:
    if not scored or any(a is None for a, _ in scored):
        return None
    return sum(a * n for a, n in scored) / max(1, sum(n for _, n in scored))


@dataclass(frozen=True)
class CheckReport:
    model_dir: str
    decode_model_dir: str | None
    dtype: str
    max_tokens: int
    bar: str  # the pass bar used, in words
    prompt_lengths: tuple[int, ...]
    pairings: tuple[PairingResult, ...]
    skipped: tuple[str, ...]  # "mlx: <why>" for each backend that could not run
    reference: str | None  # what the reference was, None when there was none
    notes: tuple[str, ...] = ()
    decode_quantization: dict | None = None  # the decode side's Quantization.to_dict()

    @property
    def passed(self) -> bool:
        return bool(self.pairings) and all(p.passed for p in self.pairings)

    @property
    def failing(self) -> list[PairingResult]:
        return [p for p in self.pairings if not p.passed]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        for d, p in zip(out["pairings"], self.pairings, strict=True):
            d |= {
                "name": p.name,
                "agrees_with_baseline": p.agrees_with_baseline,
                "agrees_with_reference": p.agrees_with_reference,
                "top1_agreement": p.top1_agreement,
                "max_logit_diff": p.max_logit_diff,
                "first_logit_diff": p.first_logit_diff,
                "top1_vs_decode_alone": p.top1_vs_decode_alone,
                "max_logit_diff_vs_decode_alone": p.max_logit_diff_vs_decode_alone,
            }
        return out


def prompt_lengths(spec: ModelSpec, max_tokens: int) -> tuple[int, ...]:
    """PROMPT_LENGTHS, capped to what the context (and a sliding window) can hold."""
    check_request(spec, 1, max_tokens)
    room = spec.max_position_embeddings - max_tokens
    if spec.position_limit:
        room = min(room, spec.position_limit - max_tokens)
    lengths = PROMPT_LENGTHS
    if spec.layer_types and spec.sliding_window:  # below, at and well past the window
        lengths = (*lengths, 3 * spec.sliding_window)
    return tuple(sorted({min(n, room) for n in lengths}))


def prompt_ids(n: int, vocab_size: int) -> list[int]:
    """A deterministic prompt of n token ids in range (same n, same ids, every run)."""
    return np.random.default_rng(n).integers(0, vocab_size, n).tolist()


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where a and b differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(logits: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, max |logit difference|) of two [positions, vocab] arrays."""
    top1 = float((logits.argmax(-1) == reference.argmax(-1)).mean())
    return top1, float(np.abs(logits - reference).max())


def mlx_lm_alone(backend: Backend, token_ids: Sequence[int], max_tokens: int):
    """mlx-lm on its own with `backend`'s model (an MLX backend: mlx-lm's model classes,
    loaded with the checkpoint's true RoPE settings): greedy tokens from its generate_step,
    and the logits predicting each of them from one teacher-forced forward pass.
    Returns (tokens, float32 logits [max_tokens, vocab])."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    ids = [int(t) for t in token_ids]
    tokens = [int(t) for t, _ in generate_step(mx.array(ids), backend.model, max_tokens=max_tokens)]
    logits = backend.model(mx.array([ids + tokens[:-1]]))[0, len(ids) - 1 :]
    return tokens, np.array(logits.astype(mx.float32))


def teacher_forced_logits(
    prefill: Backend, decode: Backend, token_ids: Sequence[int], forced: Sequence[int]
) -> np.ndarray:
    """Logits [len(forced), vocab] predicting each forced token: row 0 from `prefill`'s
    prefill, then `decode` steps over forced[:-1] from the handed-over cache."""
    cache, logits = prefill_into(prefill, decode, token_ids, capacity=len(token_ids) + len(forced))
    rows = [logits]
    rows += [decode.step(cache, t) for t in forced[:-1]]
    return np.stack(rows).astype(np.float32)


def _load_reference(
    model_dir, eos_ids, dtype: str, progress: Progress
) -> tuple[Reference | None, str]:
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as exc:
        return None, f"transformers is not installed ({exc.name}): no independent reference"
    progress(f"loading the transformers reference ({dtype}, cpu) ...")
    note = f"transformers {transformers.__version__} generate(), {dtype}, cpu"
    return Reference(model_dir, eos_ids, dtype), note


def _load_side(
    model_dir, dtype: str, progress: Progress, *, quantized: bool = False,
    names: Sequence[str] = CHECKED,
) -> tuple[dict[str, Backend], list[str]]:  # fmt: skip
    """Every installed backend of `names` on `model_dir`; the ones that are not installed,
    with why."""
    loaded, skipped = {}, []
    for name in names:
        if quantized and name == "torch":
            skipped.append("torch: it runs full-precision checkpoints, this one is quantized")
            continue
        progress(f"loading {name} backend ({dtype}) from {model_dir} ...")
        try:
            loaded[name] = load_backend(name, model_dir, dtype=dtype)
        except BadCheckpoint:
            raise
        except ExoSplitError as exc:  # load_backend's "not installed"
            skipped.append(f"{name}: {exc}")
            progress(f"skipping {name}: {exc}")
    return loaded, skipped


def quant_bar(bits: int) -> float:
    return next(bar for at_least, bar in QUANT_TOP1_BARS if bits >= at_least)


def _verdict(
    results: Sequence[PromptResult], dtype: str, quant: Quantization | None = None
) -> str | None:
    """Why a pairing fails the bar, or None when it passes."""
    if quant is not None:
        top1 = _pooled([(p.top1_vs_decode_alone, len(p.tokens)) for p in results])
        if top1 is not None and top1 < quant_bar(quant.bits):
            return (
                f"teacher-forced top-1 agreement with mlx-lm running the {quant.bits}-bit "
                f"checkpoint alone {top1:.0%} < {quant_bar(quant.bits):.0%}"
            )
        return None
    if dtype == "float32":
        for p in results:
            if p.mismatch_vs_reference is not None:
                return f"tokens differ from transformers (prompt {p.prompt_tokens}, position {p.mismatch_vs_reference})"
            if p.mismatch_vs_baseline is not None:
                return f"tokens differ from the decode backend alone (prompt {p.prompt_tokens}, position {p.mismatch_vs_baseline})"
        for p in results:
            bound = FLOAT32_LOGIT_BOUND * max(1.0, p.reference_logit_max or 0.0)
            worst = max(p.first_logit_diff or 0.0, p.max_logit_diff or 0.0)
            if worst > bound:
                return (
                    f"greedy tokens agree but logits differ from transformers by up to "
                    f"{worst:.2e} > {bound:.2e} (prompt {p.prompt_tokens})"
                )
        return None
    scored = [p for p in results if p.top1_agreement is not None]
    if not scored:  # no reference: all we can compare with is the decode backend alone
        bad = [p for p in results if p.mismatch_vs_baseline is not None]
        return (
            f"tokens differ from the decode backend alone (prompt {bad[0].prompt_tokens})"
            if bad
            else None
        )
    n = sum(len(p.tokens) for p in scored)
    top1 = sum(p.top1_agreement * len(p.tokens) for p in scored) / max(1, n)
    if top1 < HALF_TOP1_BAR:
        return f"teacher-forced top-1 agreement {top1:.0%} < {HALF_TOP1_BAR:.0%}"
    return None


def _bar(dtype: str, has_reference: bool, quant: Quantization | None = None) -> str:
    if quant is not None:
        return (
            f"{quant.bits}-bit decode side: teacher-forced top-1 agreement with mlx-lm running "
            f"the quantized checkpoint alone >= {quant_bar(quant.bits):.0%} (vs transformers at "
            "full precision: reported, the quantization's own error)"
        )
    if dtype == "float32":
        if not has_reference:
            return "float32: greedy tokens identical to the decode backend alone"
        return (
            "float32: greedy tokens identical to transformers generate() and the decode "
            f"backend alone; logits within {FLOAT32_LOGIT_BOUND:g} x max(1, max |logit|) of "
            "transformers' (token 0 and teacher-forced)"
        )
    if has_reference:
        return (
            f"{dtype}: teacher-forced top-1 agreement with transformers ({dtype}) >= "
            f"{HALF_TOP1_BAR:.0%} (kernels differ by ~1 ulp, greedy sequences may part at near-ties)"
        )
    return f"{dtype}: greedy tokens identical to the decode backend alone (no reference installed)"


def run_check(
    model_dir: str | Path,
    decode_model_dir: str | Path | None = None,
    *,
    dtype: str = "float32",
    max_tokens: int = 16,
    progress: Progress | None = None,
    prefill_backend: str | None = None,
) -> CheckReport:
    """Run every installed pairing on the built-in prompts and compare (see module doc).
    `prefill_backend` (e.g. "vllm", which only prefills): the pairings of that prefill side
    with every installed decode backend instead.

    Raises IncompatiblePeer when `decode_model_dir` holds a different model (config), and
    BadCheckpoint for a directory that cannot be loaded.
    """
    say = progress or log.info
    spec = load_spec(model_dir)
    quant = None
    if decode_model_dir is not None:
        require_compatible(spec, load_spec(decode_model_dir), what="the decode model")
        quant = load_quantization(decode_model_dir)
    lengths = prompt_lengths(spec, max_tokens)
    eos_ids = TextCodec(model_dir).eos_ids

    only = (prefill_backend,) if prefill_backend is not None else CHECKED
    side_a, skipped = _load_side(model_dir, dtype, say, names=only)
    side_b = side_a
    if prefill_backend is not None and decode_model_dir is None:
        side_b, skipped_b = _load_side(model_dir, dtype, say)
        skipped += [f"{s} (decode side)" for s in skipped_b]
    if decode_model_dir is not None:
        side_b, skipped_b = _load_side(decode_model_dir, dtype, say, quantized=quant is not None)
        skipped += [f"{s} (decode side)" for s in skipped_b]
    if quant is not None and "mlx" not in side_b:
        raise ExoSplitError(
            f"{decode_model_dir} is quantized ({quant.describe()}): only the MLX backend runs it",
            hint="pip install 'exo-split[mlx]'",
        )
    pairings = [(a, b) for a, b in PAIRINGS if a in side_a and b in side_b]
    if prefill_backend is not None:
        pairings = [(a, b) for a in side_a for b in CHECKED if b in side_b]
    if not pairings:
        raise ExoSplitError(
            "no backend could run: " + "; ".join(skipped),
            hint="pip install 'exo-split[torch]' and/or 'exo-split[mlx]'",
        )
    reference, ref_note = _load_reference(model_dir, eos_ids, dtype, say)

    runs: dict[tuple[int, int, int], list[int]] = {}

    def greedy(p: Backend, d: Backend, ids: list[int]) -> list[int]:
        key = (id(p), id(d), len(ids))
        if key not in runs:
            runs[key] = split_generate(
                p, d, ids, max_tokens=max_tokens, sampling=GREEDY, stop_ids=eos_ids
            ).tokens
        return runs[key]

    per_pairing: dict[tuple[str, str], list[PromptResult]] = {pair: [] for pair in pairings}
    for n in lengths:
        ids = prompt_ids(n, spec.vocab_size)
        ref_tokens = ref_logits = None
        if reference is not None:
            say(f"prompt of {n} tokens: transformers reference ...")
            ref_tokens = reference.generate(ids, max_tokens)
            ref_logits = reference.teacher_forced_logits(ids, ref_tokens)
        alone = None
        if quant is not None:
            say(f"prompt of {n} tokens: mlx-lm alone on the quantized checkpoint ...")
            alone = mlx_lm_alone(side_b["mlx"], ids, max_tokens)
        for a, b in pairings:
            say(f"prompt of {n} tokens: {a}->{b} ...")
            prefill, decode = side_a[a], side_b[b]
            tokens = greedy(prefill, decode, ids)
            baseline = greedy(side_b[b], side_b[b], ids)
            top1 = max_diff = first_diff = top1_q = max_q = ref_max = None
            if ref_logits is not None:
                logits = teacher_forced_logits(prefill, decode, ids, ref_tokens)
                top1, max_diff = agreement(logits, ref_logits)
                first_diff = float(np.abs(logits[0] - ref_logits[0]).max())
                ref_max = float(np.abs(ref_logits).max())
            if alone is not None:
                logits = teacher_forced_logits(prefill, decode, ids, alone[0])
                top1_q, max_q = agreement(logits, alone[1])
            per_pairing[a, b].append(
                PromptResult(
                    prompt_tokens=n,
                    tokens=tuple(tokens),
                    baseline_tokens=tuple(baseline),
                    reference_tokens=None if ref_tokens is None else tuple(ref_tokens),
                    mismatch_vs_baseline=first_mismatch(tokens, baseline),
                    mismatch_vs_reference=None
                    if ref_tokens is None
                    else first_mismatch(tokens, ref_tokens),
                    top1_agreement=top1,
                    max_logit_diff=max_diff,
                    first_logit_diff=first_diff,
                    top1_vs_decode_alone=top1_q,
                    max_logit_diff_vs_decode_alone=max_q,
                    reference_logit_max=ref_max,
                )
            )

    results = []
    for (a, b), prompts in per_pairing.items():
        reason = _verdict(prompts, dtype, quant)
        results.append(PairingResult(a, b, tuple(prompts), reason is None, reason))
    notes = [] if reference is not None else [ref_note]
    if decode_model_dir is not None:
        notes.append(
            "two sides: prefill backends load --model, decode backends --decode-model; the "
            "reference runs --model, the baseline (decode backend alone) --decode-model"
        )
    if quant is not None:
        notes.append(
            f"decode side {quant.describe()}: token 0 and the prompt's KV come from the "
            "full-precision prefill, so greedy tokens may part from the quantized model's own "
            "from the first one; q-alone columns: teacher-forced over mlx-lm's own tokens on "
            "the quantized checkpoint"
        )
    return CheckReport(
        model_dir=str(model_dir),
        decode_model_dir=None if decode_model_dir is None else str(decode_model_dir),
        dtype=dtype,
        max_tokens=max_tokens,
        bar=_bar(dtype, reference is not None, quant),
        prompt_lengths=lengths,
        pairings=tuple(results),
        skipped=tuple(skipped),
        reference=ref_note if reference is not None else None,
        notes=tuple(notes),
        decode_quantization=quant.to_dict() if quant is not None else None,
    )
