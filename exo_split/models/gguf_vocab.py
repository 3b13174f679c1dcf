"""The tokenizer a GGUF file describes, as Hugging Face tokenizer files (no torch).

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges or scores, token
types, special ids and the chat template as metadata. This module reads those into a `Vocab`
and rebuilds what llama.cpp runs on it:

- `gpt2` (byte-level BPE: Llama 3, Qwen2/3, SmolLM2, Mistral Nemo): tokens + merges; the
  split regex comes from `tokenizer.ggml.pre`, which llama.cpp itself requires to be known,
  so an unknown one is refused here too rather than tokenized with a guess.
- `llama` (SentencePiece BPE: Llama 2, Mistral 7B v0.1-v0.3): tokens + scores; merges are
  rebuilt best-score-first, with byte fallback. As in llama.cpp, a space is prefixed to
  every text fragment that starts the prompt or follows a special token.

Anything else (WordPiece, Unigram, RWKV, ...) is refused with the model name it found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from exo_split.errors import BadCheckpoint

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split regexes as in the models' own tokenizer.json files (llama.cpp writes equivalents).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (GPT-4o, gpt-oss): tekken's words with English contractions kept on them, and numbers
# in groups of up to three digits.
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTION
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTION
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level vocabulary splits text before BPE (one family of `tokenizer.ggml.pre`)."""

    regex: str | None  # None: GPT-2's own regex (ByteLevel use_regex=True)
    split_digits: bool = False
    ignore_merges: bool = False  # a whole pre-token found in the vocab is used as is
    nfc: bool = False
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token key


_GPT2 = PreTokenizer(None)
_PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "mpt", "olmo", "phi-2"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), PreTokenizer(None, True)),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"),
        PreTokenizer(_LLAMA3, ignore_merges=True, add_bos=True),
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer(_LLAMA3)),
    # Qwen's tokenizer.json NFC-normalizes; the model was trained on that.
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), PreTokenizer(_QWEN2, nfc=True)),
    "tekken": PreTokenizer(_TEKKEN, ignore_merges=True, add_bos=True),
    "gpt-4o": PreTokenizer(_O200K, ignore_merges=True),
}
SUPPORTED_TOKENIZERS = ("gpt2", "llama")

# Turn-ending tokens llama.cpp also stops on, besides the file's eos/eot/eom ids.
_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
)


@dataclass(frozen=True)
class Vocab:
    """The tokenizer metadata of a GGUF file, as plain values."""

    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    scores: tuple[float, ...] | None
    merges: tuple[str, ...] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    eot_id: int | None
    eom_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | list[dict[str, str]] | None

    def token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def vocab_from_metadata(meta: dict[str, Any]) -> Vocab:
    """Read and check the tokenizer keys; raises BadCheckpoint on what we cannot rebuild."""
    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZERS:
        raise BadCheckpoint(
            f"unsupported GGUF tokenizer {model!r}: exo-split converts 'gpt2' (byte-level BPE) "
            f"and 'llama' (SentencePiece BPE) vocabularies"
        )
    tokens = tuple(meta.get("tokenizer.ggml.tokens") or ())
    if not tokens:
        raise BadCheckpoint("the GGUF has no tokenizer.ggml.tokens: no vocabulary to convert")
    types = tuple(meta.get("tokenizer.ggml.token_type") or (NORMAL,) * len(tokens))
    scores = meta.get("tokenizer.ggml.scores")
    merges = meta.get("tokenizer.ggml.merges")
    pre_name = meta.get("tokenizer.ggml.pre")
    default_bos = True
    if model == "gpt2":
        if not merges:
            raise BadCheckpoint("byte-level BPE vocabulary without tokenizer.ggml.merges")
        if pre_name is None:
            raise BadCheckpoint(
                "the GGUF names no pre-tokenizer (tokenizer.ggml.pre): llama.cpp would guess "
                "and warn of degraded output; exo-split refuses to guess"
            )
        if pre_name not in _PRE_TOKENIZERS:
            raise BadCheckpoint(
                f"unsupported pre-tokenizer {pre_name!r} (tokenizer.ggml.pre): exo-split knows "
                + ", ".join(sorted(_PRE_TOKENIZERS))
            )
        default_bos = _PRE_TOKENIZERS[pre_name].add_bos
    else:
        if scores is None or len(scores) != len(tokens):
            raise BadCheckpoint(
                f"SentencePiece vocabulary needs one score per token: {len(tokens)} tokens, "
                f"{0 if scores is None else len(scores)} scores"
            )
        if meta.get("tokenizer.ggml.precompiled_charsmap") or meta.get(
            "tokenizer.ggml.remove_extra_whitespaces"
        ):
            raise BadCheckpoint(
                "SentencePiece normalization rules (precompiled_charsmap / "
                "remove_extra_whitespaces) are not supported: expected an identity normalizer"
            )
    if len(types) != len(tokens):
        raise BadCheckpoint(f"{len(tokens)} tokens but {len(types)} token types")

    def ident(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    return Vocab(
        model=model,
        pre=pre_name,
        tokens=tokens,
        types=tuple(int(t) for t in types),
        scores=None if scores is None else tuple(float(s) for s in scores),
        merges=None if merges is None else tuple(merges),
        bos_id=ident("bos_token_id"),
        eos_id=ident("eos_token_id"),
        unk_id=ident("unknown_token_id"),
        pad_id=ident("padding_token_id"),
        eot_id=ident("eot_token_id"),
        eom_id=ident("eom_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", model == "llama")),
        chat_template=_chat_template(meta),
    )


def _chat_template(meta: dict[str, Any]) -> str | list[dict[str, str]] | None:
    """The default template, plus named ones (tool_use, rag, ...) in transformers' list form."""
    default = meta.get("tokenizer.chat_template")
    named = {
        k.removeprefix("tokenizer.chat_template."): v
        for k, v in meta.items()
        if k.startswith("tokenizer.chat_template.") and isinstance(v, str)
    }
    if not named:
        return default
    if default is not None:
        named = {"default": default, **named}
    return [{"name": name, "template": text} for name, text in named.items()]


def build_tokenizer(vocab: Vocab) -> Tokenizer:
    tok = _byte_level(vocab) if vocab.model == "gpt2" else _sentencepiece(vocab)
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(vocab.tokens, vocab.types, strict=True)
            if kind == USER_DEFINED
        ]
    )
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(vocab.tokens, vocab.types, strict=True)
            if kind in (CONTROL, UNKNOWN)
        ]
    )
    template = _template_processor(vocab)
    if vocab.model == "gpt2":
        parts = [processors.ByteLevel(trim_offsets=False)] + ([template] if template else [])
        tok.post_processor = processors.Sequence(parts)
    elif template:
        tok.post_processor = template
    return tok


def _ids(vocab: Vocab) -> dict[str, int]:
    """token -> id; the first id wins when a file lists one spelling twice."""
    out: dict[str, int] = {}
    for i, t in enumerate(vocab.tokens):
        out.setdefault(t, i)
    return out


def _byte_level(vocab: Vocab) -> Tokenizer:
    spec = _PRE_TOKENIZERS[vocab.pre]
    all_ids = _ids(vocab)
    # Byte-level tokens never hold a real space (it is spelled 'Ġ'), so ' ' separates a merge.
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tok = Tokenizer(models.BPE(all_ids, merges, ignore_merges=spec.ignore_merges))
    if spec.regex is None:
        steps = [pre.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        steps = [
            pre.Split(Regex(spec.regex), behavior="isolated"),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    if spec.split_digits:
        steps.insert(0, pre.Digits(individual_digits=True))
    tok.pre_tokenizer = pre.Sequence(steps)
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(vocab: Vocab) -> Tokenizer:
    all_ids = _ids(vocab)
    has_bytes = any(kind == BYTE for kind in vocab.types)
    unk = vocab.token(vocab.unk_id)
    tok = Tokenizer(
        models.BPE(
            all_ids,
            sentencepiece_merges(vocab),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=has_bytes,
        )
    )
    space = [normalizers.Replace(" ", "\u2581")]
    if vocab.add_space_prefix:
        space.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(space)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def sentencepiece_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging: every split of a normal
    piece into two normal pieces, best piece score first (ties: lower ids first)."""
    normal = {
        t: i for i, (t, k) in enumerate(zip(vocab.tokens, vocab.types, strict=True)) if k == NORMAL
    }
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-vocab.scores[i], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _template_processor(vocab: Vocab) -> processors.TemplateProcessing | None:
    bos = vocab.token(vocab.bos_id) if vocab.add_bos else None
    eos = vocab.token(vocab.eos_id) if vocab.add_eos else None
    if bos is None and eos is None:
        return None

    def one(seq: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos, seq, eos) if t]

    return processors.TemplateProcessing(
        single=one("$A", 0),
        pair=one("$A", 0) + one("$B", 1),
        special_tokens=[(t, i) for t, i in ((bos, vocab.bos_id), (eos, vocab.eos_id)) if t],
    )


def end_of_turn_ids(vocab: Vocab) -> list[int]:
    """What generation stops on, as llama.cpp decides it: eos, eot, eom, and the known
    turn-ending tokens present in the vocabulary (ChatML's <|im_end|>, Llama 3's <|eot_id|>...)."""
    ids = [i for i in (vocab.eos_id, vocab.eot_id, vocab.eom_id) if i is not None]
    index = {t: i for i, t in enumerate(vocab.tokens) if t in _END_OF_TURN}
    ids += [index[t] for t in _END_OF_TURN if t in index]
    return list(dict.fromkeys(ids))


def tokenizer_config(vocab: Vocab, *, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, flags and the chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
    }
    for name, token_id in (
        ("bos_token", vocab.bos_id),
        ("eos_token", vocab.eos_id),
        ("unk_token", vocab.unk_id),
        ("pad_token", vocab.pad_id),
    ):
        if (token := vocab.token(token_id)) is not None:
            config[name] = token
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    return config
