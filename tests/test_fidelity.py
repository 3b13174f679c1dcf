"""`exo-split check`, the fidelity self-test: it passes on a good checkpoint, and it fails
on two sides that disagree, whether the config says so (refused up front) or only the
weights do (caught by token and logit disagreement, which is the point of the test)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file

from exo_split import fidelity
from exo_split.cli.main import main
from exo_split.errors import ExoSplitError
from exo_split.fidelity import PromptResult, first_mismatch, prompt_lengths, run_check
from exo_split.spec import load_spec

PAIRINGS = ["torch->mlx", "mlx->torch", "torch->torch", "mlx->mlx"]


def test_check_passes_on_a_tiny_checkpoint(llama, capsys):
    assert main(["check", "--model", str(llama), "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["passed"] is True
    assert doc["prompt_lengths"] == [1, 40, 300]
    assert [p["name"] for p in doc["pairings"]] == PAIRINGS
    for p in doc["pairings"]:
        assert p["agrees_with_reference"] and p["agrees_with_baseline"]
        assert p["top1_agreement"] == 1.0
        assert p["max_logit_diff"] < 1e-3
        assert len(p["prompts"][0]["tokens"]) == 16
    assert "float32" in doc["bar"] and "identical" in doc["bar"]
    assert "all 4 pairings agree" in err


def test_check_table_on_two_identical_sides(llama, tmp_path, capsys):
    """--decode-model with an identical copy: every pairing is a real handoff between two
    loaded objects (torch->torch included), and all agree."""
    copy = shutil.copytree(llama, tmp_path / "copy")
    assert main(["check", "--model", str(llama), "--decode-model", str(copy)]) == 0
    out = capsys.readouterr().out
    for name in PAIRINGS:
        row = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert "pass" in row and "no @" not in row
    assert "bar: float32" in out


def test_check_refuses_a_decode_model_with_a_different_config(llama, tmp_path, capsys):
    copy = shutil.copytree(llama, tmp_path / "other-rope")
    config = json.loads((copy / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 12345.0
    (copy / "config.json").write_text(json.dumps(config))
    assert main(["check", "--model", str(llama), "--decode-model", str(copy)]) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert lines[0].startswith("exo-split: check failed:")
    assert "rope_theta: 50000.0 != 12345.0" in lines[0]
    assert "loading" not in err, "a config mismatch is refused before loading anything"
    assert "Traceback" not in err


def test_check_catches_a_decode_model_with_different_weights(llama, tmp_path, capsys):
    """Same config.json, one tensor perturbed: only the self-test's comparison can see it."""
    copy = shutil.copytree(llama, tmp_path / "other-weights")
    weights = copy / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.1.mlp.down_proj.weight"
    noise = np.random.default_rng(0).standard_normal(tensors[name].shape).astype(np.float32)
    tensors[name] = tensors[name] + 0.02 * noise
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert load_spec(copy) == load_spec(llama)  # the fingerprint cannot tell them apart

    assert main(["check", "--model", str(llama), "--decode-model", str(copy)]) == 1
    out, err = capsys.readouterr()
    failed = err.strip().splitlines()[-1]
    assert failed.startswith("exo-split: check failed: 4 of 4 pairings disagree")
    for pairing in PAIRINGS:
        assert f"{pairing}: tokens differ from transformers" in failed
    assert "FAIL" in out


def test_a_backend_that_is_not_installed_is_skipped_saying_so(llama, monkeypatch):
    real = fidelity.load_backend

    def only_torch(name, *args, **kwargs):
        if name == "mlx":
            raise ExoSplitError("the mlx backend is not installed (mlx missing)")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(fidelity, "load_backend", only_torch)
    report = run_check(llama, max_tokens=4)
    assert [p.name for p in report.pairings] == ["torch->torch"]
    assert report.passed
    assert report.skipped == ("mlx: the mlx backend is not installed (mlx missing)",)


def test_prompt_lengths_fit_the_context(checkpoint):
    assert prompt_lengths(load_spec(checkpoint("llama")), 16) == (1, 40, 300)
    assert prompt_lengths(load_spec(checkpoint("llama", max_position_embeddings=64)), 16) == (
        1,
        40,
        48,
    )


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def _result(tokens, ref, top1):
    return PromptResult(
        prompt_tokens=40,
        tokens=tuple(tokens),
        baseline_tokens=tuple(tokens),
        reference_tokens=tuple(ref),
        mismatch_vs_baseline=None,
        mismatch_vs_reference=first_mismatch(tokens, ref),
        top1_agreement=top1,
        max_logit_diff=0.1,
        first_logit_diff=0.01,
    )


def test_the_bar_depends_on_the_dtype():
    """float32: identical tokens; half precision: teacher-forced top-1 >= 90%, because
    greedy sequences can part at near-ties there."""
    parted = [_result([1, 2, 3, 4], [1, 2, 9, 9], top1=0.95)]
    assert fidelity._verdict(parted, "float32").startswith("tokens differ from transformers")
    assert fidelity._verdict(parted, "bfloat16") is None
    worse = [_result([1, 2, 3, 4], [1, 2, 9, 9], top1=0.85)]
    assert "top-1 agreement 85% < 90%" in fidelity._verdict(worse, "float16")


def test_check_in_half_precision_uses_the_top1_bar(llama, capsys):
    assert main(["check", "--model", str(llama), "--dtype", "float16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["bar"].startswith("float16: teacher-forced top-1 agreement")
    assert "float16" in doc["reference"]
    # Every pairing ran: a backend that failed to load in float16 is "skipped", not a pass.
    assert [p["name"] for p in doc["pairings"]] == PAIRINGS and doc["skipped"] == []
    assert all(p["top1_agreement"] >= 0.9 for p in doc["pairings"])


def test_float32_bounds_the_logits_not_only_the_tokens(llama, tmp_path, capsys):
    """A decode side whose output head is scaled by 1.01 (what a missing logit scale does):
    every argmax, so every greedy token, is unchanged; only the logit bound sees it."""
    copy = shutil.copytree(llama, tmp_path / "scaled-head")
    weights = copy / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * np.float32(1.01)
    save_file(tensors, str(weights), metadata={"format": "pt"})

    assert main(["check", "--model", str(llama), "--decode-model", str(copy), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for p in doc["pairings"]:
        assert p["agrees_with_reference"] and p["agrees_with_baseline"], p["name"]
        assert not p["passed"]
        assert p["reason"].startswith("greedy tokens agree but logits differ"), p["reason"]


def test_the_logit_bound_is_relative_to_the_logits_scale():
    ok = _result([1, 2], [1, 2], top1=1.0)
    scaled = dataclasses.replace(
        ok, max_logit_diff=0.004, first_logit_diff=0.0, reference_logit_max=5.0
    )
    assert fidelity._verdict([scaled], "float32") is None  # 0.004 <= 1e-3 x 5
    big = dataclasses.replace(scaled, max_logit_diff=0.006)
    assert "up to 6.00e-03 > 5.00e-03" in fidelity._verdict([big], "float32")
