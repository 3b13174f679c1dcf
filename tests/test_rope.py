"""rope.py: YaRN and longrope run where both libraries compute the same rotation (checked
against transformers on a tiny checkpoint); what they would compute differently is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from exo_split import rope
from exo_split.errors import BadCheckpoint
from exo_split.fidelity import run_check
from exo_split.spec import load_spec, spec_from_config

YARN = {"rope_type": "yarn", "rope_theta": 100000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 16.0, "beta_slow": 2.0}  # fmt: skip
# Phi-3.5/4-mini's longrope on the tiny phi3 (head_dim 16, half of it rotated: 4 pairs): a
# short and a long factor per pair, the context 8x the original (attention factor 1.15).
LONGROPE = {"rope_type": "longrope", "rope_theta": 20000.0, "partial_rotary_factor": 0.5,
            "short_factor": [2.25, 1.5, 1.125, 1.0], "long_factor": [6.5, 7.5, 5.5, 6.25],
            "original_max_position_embeddings": 512}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "extra"), [("qwen3", {}), ("llama", {}), ("qwen3", {"truncate": False})]
)
def test_yarn_matches_transformers(checkpoint, family, extra):
    """`truncate: false` (gpt-oss's, here on a dense family): the MLX side recomputes the
    frequencies mlx-lm would have truncated."""
    ckpt = checkpoint(family, rope_parameters=YARN | extra)
    spec = load_spec(ckpt)
    assert dict(spec.rope_scaling) == {k: v for k, v in (YARN | extra).items() if k != "rope_theta"}
    report = run_check(ckpt, max_tokens=8)
    assert report.passed, [p.reason for p in report.failing]


def test_yarn_changes_the_logits_so_the_check_can_see_it(checkpoint, tmp_path):
    from exo_split.models.reference import Reference

    ckpt = checkpoint("qwen3", rope_parameters=YARN)
    plain = shutil.copytree(ckpt, tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": YARN["rope_theta"]}
    (plain / "config.json").write_text(json.dumps(config))
    ids = list(range(3, 203))
    a = Reference(ckpt, frozenset()).teacher_forced_logits(ids, [5])
    b = Reference(plain, frozenset()).teacher_forced_logits(ids, [5])
    assert float(np.abs(a - b).max()) > 0.1


def test_a_missing_factor_is_derived_as_transformers_derives_it():
    s = rope.canonical({"rope_type": "yarn", "original_max_position_embeddings": 1024},
                       max_position_embeddings=8192)  # fmt: skip
    assert s["factor"] == 8.0


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({**YARN, "attention_factor": 2.0}, "transformers uses 2, mlx-lm would use 1.13863"),
        ({**YARN, "mscale": 0.707}, "attention scale"),  # mlx-lm uses mscale alone, not transformers
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "without original_max_position_embeddings"),
        ({**LONGROPE, "attention_factor": 2.0}, "longrope attention scale: transformers uses 2"),
        ({**LONGROPE, "factor": 2.0}, "longrope attention scale"),  # mlx-lm: the context ratio
        ({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
        ({"rope_type": "yarn", "factor": 2.0}, "without original_max_position_embeddings"),
    ],
)  # fmt: skip
def test_what_the_libraries_would_compute_differently_is_refused(scaling, message):
    with pytest.raises(BadCheckpoint, match=message):
        rope.canonical(dict(scaling), max_position_embeddings=4096)


def test_an_attention_factor_equal_to_the_derived_one_is_accepted():
    derived = 0.1 * np.log(4.0) + 1.0
    s = rope.canonical({**YARN, "attention_factor": float(derived)}, max_position_embeddings=4096)
    assert "attention_factor" not in s and s["factor"] == 4.0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "glm4", "cohere"])
def test_a_family_whose_mlx_module_ignores_rope_scaling_refuses_it(arch):
    from checkpoints import MORE_FAMILIES

    config = json.loads(MORE_FAMILIES[arch]().to_json_string())
    params = config.get("rope_parameters") or {}
    config["rope_parameters"] = {**params, **YARN}
    with pytest.raises(BadCheckpoint, match=f"mlx-lm's {arch} module builds a plain RoPE"):
        spec_from_config(config)


def test_truncate_false_is_part_of_the_maths_and_true_is_the_default():
    plain = rope.canonical(dict(YARN), max_position_embeddings=4096)
    assert rope.canonical({**YARN, "truncate": True}, max_position_embeddings=4096) == plain
    untruncated = rope.canonical({**YARN, "truncate": False}, max_position_embeddings=4096)
    assert untruncated == {**plain, "truncate": False}


def _phi3_longrope(checkpoint):
    return checkpoint("phi3", rope_parameters=LONGROPE, max_position_embeddings=4096,
                      original_max_position_embeddings=512)  # fmt: skip


def test_longrope_matches_transformers_up_to_its_original_context(checkpoint):
    """Both sides rotate with the short factors (transformers' choice while a forward ends
    within original_max_position_embeddings); a request reaching past it is refused, as
    transformers would then rotate each forward by its own length."""
    from exo_split.errors import PromptTooLong
    from exo_split.spec import ModelSpec, check_request

    ckpt = _phi3_longrope(checkpoint)
    spec = load_spec(ckpt)
    scaling = dict(spec.rope_scaling)
    assert scaling["short_factor"] == tuple(LONGROPE["short_factor"])
    assert spec.position_limit == 512
    again = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))  # the wire's copy
    assert again == spec and again.fingerprint == spec.fingerprint
    report = run_check(ckpt, max_tokens=8)
    assert report.passed, [p.reason for p in report.failing]
    assert report.prompt_lengths == (1, 40, 300)
    check_request(spec, 500, 12)
    with pytest.raises(PromptTooLong, match="exceeds 512 positions, where this model's longrope"):
        check_request(spec, 500, 13)


def test_mlx_lms_long_factors_would_leave_the_bound(checkpoint, monkeypatch):
    """mlx-lm builds longrope with the long factors at every length: without the MLX
    backend's swap to the short ones, its logits leave the float32 bound by far."""
    from exo_split.backends import mlx_backend
    from exo_split.fidelity import FLOAT32_LOGIT_BOUND

    ckpt = _phi3_longrope(checkpoint)
    monkeypatch.setattr(mlx_backend, "short_longrope", lambda model, spec: 0)
    report = run_check(ckpt, max_tokens=4)
    by_name = {p.name: p for p in report.pairings}
    worst = max(r.max_logit_diff / max(1.0, r.reference_logit_max)
                for r in by_name["torch->mlx"].prompts)  # fmt: skip
    assert worst > 10 * FLOAT32_LOGIT_BOUND
