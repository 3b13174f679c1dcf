"""rope.py: YaRN runs where both libraries compute the same rotation (checked against
transformers on a tiny checkpoint); what they would compute differently is refused."""

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
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "long factors at every length"),
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
