"""The ITL section's pieces that need no network namespaces: mlx-lm's baseline decoding from
a handed-off state (bench/driver.py) and the section's figures (bench/itl.py). The whole
section runs in test_bench.py's quick bench."""

from __future__ import annotations

import pytest
from reference import prompt_ids

from exo_split.backends import load_backend
from exo_split.bench import driver, itl
from exo_split.handoff import split_generate
from exo_split.sampling import GREEDY, Sampling, sample


@pytest.fixture(scope="module")
def q4(llama, tmp_path_factory):
    from mlx_lm.convert import convert

    out = tmp_path_factory.mktemp("bench-itl") / "q4"
    convert(str(llama), str(out), quantize=True, q_bits=4, q_group_size=32)
    return out


@pytest.mark.parametrize("weights", ["full", "q4"])
def test_mlx_lm_from_a_handoff_decodes_the_split_tokens(llama, q4, weights):
    """Greedy, generate_step from the handed-off cache gives the split's tokens: same KV,
    same token 0, same model (the 4-bit copy decoding a full-precision prefill too)."""
    model = llama if weights == "full" else q4
    ids = prompt_ids(40, 2)
    split = split_generate(
        load_backend("torch", llama, device="cpu"),
        load_backend("mlx", model, device="cpu"),
        ids,
        max_tokens=12,
        sampling=GREEDY,
    )
    theirs = driver.mlx_lm_generate(str(model), ids, 12, prefill_model=str(llama))
    assert theirs["tokens"] == split.tokens and len(theirs["token_times"]) == 12
    assert set(theirs["cpu"]) == {"main", "compute", "mlx"}


def test_mlx_lm_from_a_handoff_samples_token_0_by_the_prefill_rule(llama):
    """At a temperature, token 0 is the prefill node's pick (sampling.sample at step 0); the
    steps after it are mlx-lm's own sampler's."""
    ids, s = prompt_ids(40, 3), Sampling(temperature=0.8, seed=7)
    torch = load_backend("torch", llama, device="cpu")
    first, _ = sample(torch.prefill(ids).logits, s, 0)
    theirs = driver.mlx_lm_generate(
        str(llama), ids, 10, temperature=0.8, seed=7, prefill_model=str(llama)
    )
    assert theirs["tokens"][0] == first and len(theirs["tokens"]) == 10


def _sample(weights, temperature, repeat, split, mlx_lm, same=True):
    cpu = {"host_s": 0.001, "mlx_s": 0.01}
    return {"weights": weights, "temperature": temperature, "repeat": repeat,
            "split_itl_p50_s": split, "mlx_lm_itl_p50_s": mlx_lm, "split_cpu": cpu,
            "mlx_lm_cpu": cpu, "same_tokens": same, "host_checked": 3 if temperature else 0,
            "host_corrected": 0, "decode_steps": 15}  # fmt: skip


def test_the_section_reports_ratios_per_variant_the_4_bit_speed_and_the_target():
    samples = []
    for rep in range(3):
        samples += [
            _sample("full", 0.0, rep, 0.0102, 0.0100),
            _sample("full", 0.8, rep, 0.0110 + rep * 0.001, 0.0100, same=rep != 1),
            _sample("q4", 0.0, rep, 0.0051, 0.0050),
            _sample("q4", 0.8, rep, 0.0050, 0.0050),
        ]
    doc = itl.summarize(samples, (1.0, 2.0), 512, 16)
    rows = {(r["weights"], r["temperature"]): r for r in doc["rows"]}
    assert rows["full", 0.0]["ratio"] == pytest.approx(1.02)
    assert rows["full", 0.8]["ratio"] == pytest.approx(1.2)  # the median of 1.1, 1.2, 1.3
    assert (rows["full", 0.8]["ratio_min"], rows["full", 0.8]["ratio_max"]) == pytest.approx(
        (1.1, 1.3)
    )
    assert rows["full", 0.8]["same_tokens"] is False and rows["q4", 0.0]["same_tokens"] is True
    assert rows["full", 0.8]["host_checked"] == 9 and rows["full", 0.8]["decode_steps"] == 45
    # 4-bit over full precision, in tok/s (1 / ITL): the median over repeats and samplings.
    assert doc["q_speed"]["split"] == pytest.approx(2.1)  # 2, 2, 2, 2.2, 2.4, 2.6
    assert doc["q_speed"]["mlx_lm"] == pytest.approx(2.0)
    # The target is judged on full precision, greedy and T=0.8: the worst of the two.
    assert doc["target"]["worst_full_precision"] == pytest.approx(1.2)
    assert doc["target"]["met"] is False
    card = itl.render(doc | {"config": itl.SHORT_STEP_CONFIG})
    assert "MISSED" in card and "32,000" in card and "n/a" in card
