"""Incremental detokenization (tokenizer.TextStream): the streamed pieces, plus what `finish`
returns, are exactly the full detokenization, on the tokenizer kinds real checkpoints use."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from exo_split.models.tiny import build_tokenizer, words
from exo_split.tokenizer import TextStream

TEXTS = [
    "Héllo wörld — 你好 🙂 naïve café 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, 日本語のテキスト, 한국어 문장.",
    "emoji: 👩‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 e\u0301 (combining), tabs\tand\nnewlines\n\n  spaces  ",
]
SPECIALS = ["<unk>", "<s>", "</s>"]


def _byte_level_bpe() -> Tokenizer:
    """GPT-2 / Llama-3 / SmolLM2 style: bytes as characters, merges over them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 10, trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    return tok


def _metaspace_bpe() -> Tokenizer:
    """Llama-2 / Mistral style: SentencePiece spaces, and bytes as <0x..> tokens for every
    character outside the (here: ASCII) vocabulary."""
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for ch in "▁abcdefghijklmnopqrstuvwxyz,.()":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="never", split=False
    )
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    return tok


class _Codec:
    def __init__(self, tok: Tokenizer):
        self._tok = tok

    def detokenize(self, ids):
        return self._tok.decode(list(ids), skip_special_tokens=True)


@pytest.mark.parametrize("make", [_byte_level_bpe, _metaspace_bpe, lambda: build_tokenizer(600)],
                         ids=["byte-level", "metaspace", "word-level"])  # fmt: skip
def test_streamed_text_is_the_full_detokenization(make):
    tok = make()
    codec = _Codec(tok)
    rng = np.random.default_rng(0)
    special = tok.token_to_id("</s>")
    sequences = [tok.encode(t).ids for t in TEXTS]
    sequences += [tok.encode(t).ids + [special] + tok.encode(t[::-1]).ids for t in TEXTS]
    noise = [rng.integers(0, tok.get_vocab_size(), 80).tolist() for _ in range(60)]
    for k, ids in enumerate(sequences + noise):
        stream = TextStream(codec)
        pieces = [stream.push(i) for i in ids]
        full = codec.detokenize(ids)
        tail = stream.finish(full)
        if k >= len(sequences) and make is _metaspace_bpe:
            # Random byte tokens are invalid UTF-8, whose rendering depends on the bytes that
            # follow: no stream can agree with the final decode. It must only keep going.
            continue
        assert "".join(pieces) + tail == full
        assert full.startswith("".join(pieces))  # nothing streamed is ever taken back


def test_text_round_trips_through_the_stream():
    tok = _byte_level_bpe()
    stream = TextStream(_Codec(tok))
    assert "".join(stream.push(i) for i in tok.encode(TEXTS[0]).ids) == TEXTS[0]


def test_a_split_character_is_held_back_then_completed():
    tok = _metaspace_bpe()
    codec = _Codec(tok)
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in "🙂".encode()]  # one character, 4 tokens
    stream = TextStream(codec)
    assert [stream.push(i) for i in ids] == ["", "", "", "🙂"]
    stream = TextStream(codec)
    assert [stream.push(i) for i in ids[:2]] == ["", ""]
    assert stream.finish(codec.detokenize(ids[:2])) == codec.detokenize(
        ids[:2]
    )  # U+FFFD: shown at the end


def test_word_lists_never_repeat_and_keep_their_old_ids():
    w = words(40_000)
    assert len(set(w)) == 40_000
    assert w[:3] == ["ba", "be", "bi"] and w[112] == "beba" and w[12_655] == "bastou"
    tok = build_tokenizer(32_000)
    assert tok.get_vocab_size() == 32_000
    assert tok.decode([31_999]) == w[31_999 - 3]
