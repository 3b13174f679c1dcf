from __future__ import annotations

import json

import pytest

from exo_split.errors import BadCheckpoint, IncompatiblePeer
from exo_split.spec import ModelSpec, differences, load_spec, require_compatible, spec_from_config

BASE = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
    "vocab_size": 1000,
}


def test_old_and_new_rope_layouts_give_the_same_spec():
    old = {
        **BASE,
        "rope_theta": 5e5,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    new = {
        **BASE,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    a, b = spec_from_config(old), spec_from_config(new)
    assert a == b and a.fingerprint == b.fingerprint
    assert a.rope_theta == 5e5 and dict(a.rope_scaling)["rope_type"] == "llama3"


def test_defaults_and_derived_fields():
    s = spec_from_config(BASE)
    assert s.head_dim == 32 and s.rope_theta == 10000.0 and s.rope_scaling == ()
    assert s.kv_bytes_per_token == 2 * 4 * 2 * 32 * 2
    q2 = spec_from_config({**BASE, "model_type": "qwen2"})
    assert q2.qkv_bias and not q2.qk_norm
    q3 = spec_from_config({**BASE, "model_type": "qwen3", "head_dim": 64})
    assert q3.qk_norm and q3.head_dim == 64


def test_fingerprint_changes_with_the_maths_not_the_name():
    a = spec_from_config(BASE, name="a")
    assert spec_from_config(BASE, name="b").fingerprint == a.fingerprint
    for field, value in [
        ("rope_theta", 1e6),
        ("num_key_value_heads", 4),
        ("rms_norm_eps", 1e-5),
        ("tie_word_embeddings", True),
        ("vocab_size", 1001),
    ]:
        assert spec_from_config({**BASE, field: value}).fingerprint != a.fingerprint, field


def test_mismatch_names_the_differing_fields():
    a = spec_from_config(BASE)
    b = spec_from_config({**BASE, "rope_theta": 1e6, "num_hidden_layers": 5})
    assert differences(a, b) == ["n_layers: 4 != 5", "rope_theta: 10000.0 != 1000000.0"]
    with pytest.raises(IncompatiblePeer, match="n_layers: 4 != 5; rope_theta"):
        require_compatible(a, b)
    require_compatible(a, spec_from_config(BASE))


def test_round_trip_through_a_dict():
    s = spec_from_config({**BASE, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    assert ModelSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s


@pytest.mark.parametrize(
    "config, match",
    [
        ({**BASE, "model_type": "gpt2"}, "unsupported architecture 'gpt2'"),
        ({k: v for k, v in BASE.items() if k != "hidden_size"}, "hidden_size"),
        (
            {**BASE, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
            "unsupported rope type 'dynamic'",
        ),
    ],
)
def test_unsupported_configs_are_refused(config, match):
    with pytest.raises(BadCheckpoint, match=match):
        spec_from_config(config)


def test_bad_directories(tmp_path):
    with pytest.raises(BadCheckpoint, match="is not a directory"):
        load_spec(tmp_path / "missing")
    with pytest.raises(BadCheckpoint, match="no config.json"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(BadCheckpoint, match="no \\*.safetensors"):
        load_spec(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(BadCheckpoint, match="no tokenizer.json"):
        load_spec(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BadCheckpoint, match="cannot read"):
        load_spec(tmp_path)


def test_a_test_checkpoint_reads_like_transformers_wrote_it(checkpoint):
    s = load_spec(checkpoint("llama"))
    assert s.architecture == "llama" and s.rope_theta == 50000.0
    assert dict(s.rope_scaling)["original_max_position_embeddings"] == 256
    assert load_spec(checkpoint("qwen3")).head_dim == 32
