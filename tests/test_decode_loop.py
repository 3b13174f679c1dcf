"""The pipelined MLX decode loop (backends/mlx_decode.py): which tokens it gives, and that it
stops, cancels and synchronizes as Backend.decode promises. No timings are asserted.

The references are independent of the loop: the one-step-at-a-time loop (`step` + the host
rule), mlx-lm's own generate_step from the same handed-off cache, and transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from reference import reference_generate

from exo_split.backends import DecodeStats, load_backend
from exo_split.backends import mlx_decode as md
from exo_split.backends.base import serial_decode
from exo_split.sampling import GREEDY, Sampling, pick


@pytest.fixture(scope="module")
def mlx_llama(llama):
    return load_backend("mlx", llama, device="cpu")


def ids_(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 512, n).tolist()


def prefilled(backend, ids, max_tokens):
    done = backend.prefill(ids, capacity=len(ids) + max_tokens)
    return done.cache, done.logits


def serial(backend, ids, first, n, sampling):
    cache, _ = prefilled(backend, ids, n)
    return list(serial_decode(backend, cache, first, max_tokens=n, sampling=sampling))


def mlx_lm(backend, ids, first, n):
    cache, _ = prefilled(backend, ids, n)
    steps = generate_step(mx.array([first]), backend.model, max_tokens=n - 1, prompt_cache=cache)
    return [int(t) for t, _ in steps]


def test_greedy_is_the_serial_loop_mlx_lm_and_transformers(llama, mlx_llama):
    ids, n = ids_(40), 24
    cache, logits = prefilled(mlx_llama, ids, n)
    first = pick(logits, GREEDY, 0)
    ours = list(mlx_llama.decode(cache, first, max_tokens=n, sampling=GREEDY))
    assert len(ours) == n - 1
    assert ours == serial(mlx_llama, ids, first, n, GREEDY) == mlx_lm(mlx_llama, ids, first, n)
    # The split: torch prefill (float32), KV injected into MLX, the loop decodes.
    torch_b = load_backend("torch", llama)
    cache = mlx_llama.new_cache(len(ids) + n)
    done = torch_b.prefill(ids, on_layer=lambda kv: mlx_llama.inject(cache, kv))
    first = pick(done.logits, GREEDY, 0)
    split = [first, *mlx_llama.decode(cache, first, max_tokens=n, sampling=GREEDY)]
    assert split == reference_generate(llama, ids, n)


@pytest.mark.parametrize(
    "sampling",
    [Sampling(0.8, seed=0), Sampling(1.3, seed=5), Sampling(0.9, seed=3, top_p=0.9)],
    ids=["t0.8", "t1.3", "t0.9-top0.9"],
)
def test_sampled_tokens_are_the_host_rule_on_the_same_logits(mlx_llama, sampling):
    ids, n = ids_(30, 1), 40
    cache, logits = prefilled(mlx_llama, ids, n)
    first = pick(logits, sampling, 0)
    stats = DecodeStats()
    ours = list(mlx_llama.decode(cache, first, max_tokens=n, sampling=sampling, stats=stats))
    assert ours == serial(mlx_llama, ids, first, n, sampling)
    # (`corrected <= checked` stood here: true by construction. Whether a correction ran is
    # this model's business; that the host's token wins when one does is the next test's.)
    assert stats.steps == n - 1


def test_a_host_correction_discards_the_step_queued_with_the_wrong_token(mlx_llama, monkeypatch):
    """Make the graph pick wrong, and flag it, at the 5th step built: the loop must take the
    host's token, undo the step already queued with the wrong one, and go on exactly as the
    reference."""
    sampling, ids, n = Sampling(0.8, seed=4), ids_(30, 2), 20
    real = md.GraphSampler.pick
    built = {"n": 0}

    def wrong_at_5(self, logits, u):
        out = real(self, logits, u)
        built["n"] += 1
        if built["n"] == 5:
            return mx.stack([(out[:, 0] + 1) % logits.shape[-1], mx.ones_like(out[:, 1])], -1)
        return out

    monkeypatch.setattr(md.GraphSampler, "pick", wrong_at_5)
    cache, logits = prefilled(mlx_llama, ids, n)
    first = pick(logits, sampling, 0)
    stats = DecodeStats()
    ours = list(mlx_llama.decode(cache, first, max_tokens=n, sampling=sampling, stats=stats))
    assert stats.corrected == 1
    assert cache[0].offset == len(ids) + n - 1  # tokens 0..n-2 fed; the wrong one undone
    monkeypatch.setattr(md.GraphSampler, "pick", real)
    assert ours == serial(mlx_llama, ids, first, n, sampling)


def test_stops_after_a_stop_id_at_max_tokens_and_on_request(mlx_llama):
    ids, n = ids_(20, 3), 30
    cache, logits = prefilled(mlx_llama, ids, n)
    first = pick(logits, GREEDY, 0)
    ref = list(mlx_llama.decode(cache, first, max_tokens=n, sampling=GREEDY))
    assert len(ref) == n - 1
    stop = ref[6]
    cache, _ = prefilled(mlx_llama, ids, n)
    got = list(mlx_llama.decode(cache, first, max_tokens=n, sampling=GREEDY, stop_ids={stop}))
    assert got == ref[: ref.index(stop) + 1]
    # The step fed with the stop token was queued before the stop was known: its KV is in.
    assert cache[0].offset == len(ids) + len(got) + 1
    assert list(mlx_llama.decode(cache, stop, max_tokens=n, sampling=GREEDY, stop_ids={stop})) == []
    assert list(mlx_llama.decode(cache, first, max_tokens=1, sampling=GREEDY)) == []
    cache, _ = prefilled(mlx_llama, ids, n)
    seen: list[int] = []
    for token in mlx_llama.decode(cache, first, max_tokens=n, sampling=Sampling(0.8),
                                  should_stop=lambda: len(seen) >= 3):  # fmt: skip
        seen.append(token)
    assert len(seen) == 3
    assert cache[0].offset == len(ids) + 4  # 3 fed after the first + the one in flight, done


def test_closing_the_loop_early_lets_the_queued_step_finish(mlx_llama):
    ids, n = ids_(20, 5), 50
    cache, _ = prefilled(mlx_llama, ids, n)
    gen = mlx_llama.decode(cache, 5, max_tokens=n, sampling=Sampling(0.8, seed=1))
    next(gen), next(gen)
    gen.close()
    assert cache[0].offset == len(ids) + 3
    mx.eval([c.keys for c in cache])  # nothing is left half-built


def test_warm_up_runs_every_kind_of_pick_and_leaves_the_model_as_it_was(mlx_llama):
    ids, n = ids_(20, 9), 12
    cache, logits = prefilled(mlx_llama, ids, n)
    before = list(mlx_llama.decode(cache, 5, max_tokens=n, sampling=Sampling(0.8)))
    kinds = []
    real = md.decode_steps

    def spy(model, cache, first, *, sampling, **kw):
        kinds.append((sampling.temperature, sampling.top_p, cache[0].offset))
        return real(model, cache, first, sampling=sampling, **kw)

    md.decode_steps = spy
    try:
        assert mlx_llama.warm() > 0
    finally:
        md.decode_steps = real
    assert {(t, p) for t, p, _ in kinds} == {(0.0, 1.0), (0.8, 1.0), (0.8, 0.9)}
    assert {o for *_, o in kinds} == set(md.WARM_KEY_LENGTHS)
    assert mlx_llama.wired_bytes is None  # the CPU has nothing to wire
    cache, _ = prefilled(mlx_llama, ids, n)
    assert list(mlx_llama.decode(cache, 5, max_tokens=n, sampling=Sampling(0.8))) == before


_FIRST_DECODE = """
import json, os, sys
import numpy as np
from exo_split.backends import load_backend
from exo_split.kv import LayerKV
from exo_split.sampling import GREEDY, Sampling

def compiled():
    return sorted(f for _, _, fs in os.walk(os.environ["TMPDIR"]) for f in fs)

backend = load_backend("mlx", sys.argv[1], device="cpu")
backend.warm()
warmed = compiled()
spec, rng = backend.spec, np.random.default_rng(0)
for sampling in (GREEDY, Sampling(0.8), Sampling(0.8, top_p=0.9)):
    cache = backend.new_cache(300)
    for layer in range(spec.n_layers):  # an injected handoff of 280 positions
        k = rng.standard_normal((spec.n_kv_heads, 280, spec.head_dim)).astype(np.float32)
        backend.inject(cache, LayerKV(layer, 0, k, k.copy(), "float32"))
    list(backend.decode(cache, 5, max_tokens=8, sampling=sampling))
print(json.dumps({"warmed": warmed, "after": compiled()}))
"""


def test_after_the_warm_up_the_first_decode_compiles_nothing(llama, tmp_path):
    """On the CPU, MLX compiles mx.compile'd functions (mlx-lm's swiglu) to C++ on first use,
    once per machine: a fresh process with an empty compile cache shows what each phase
    built. The warm-up must have built everything a decode after a handoff runs."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _FIRST_DECODE, str(llama)], env=env,
                         capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["warmed"], "the warm-up compiled nothing: the check would be empty"
    assert doc["after"] == doc["warmed"]


def test_the_decode_stream_is_one_per_device():
    assert md.decode_stream() is md.decode_stream()


def test_torch_decodes_with_the_same_contract(llama, mlx_llama):
    """Every pairing decodes: torch's Backend.decode is the serial loop, same tokens."""
    torch_b = load_backend("torch", llama)
    ids, n = ids_(20, 11), 16
    for sampling in (GREEDY, Sampling(0.8, seed=2)):
        done = torch_b.prefill(ids, capacity=len(ids) + n)
        first = pick(done.logits, sampling, 0)
        stats = DecodeStats()
        ours = list(torch_b.decode(done.cache, first, max_tokens=n, sampling=sampling,
                                   stats=stats))  # fmt: skip
        assert ours == serial(torch_b, ids, first, n, sampling) and stats.steps == n - 1
    assert torch_b.warm() > 0 and torch_b.quantization is None


_WORKER_EXIT = """
import sys
from concurrent.futures import ThreadPoolExecutor
from exo_split.backends import load_backend
from exo_split.sampling import Sampling

compute = ThreadPoolExecutor(1)
backend = compute.submit(load_backend, "mlx", sys.argv[1], device="cpu").result()

def decode():
    cache = backend.prefill(list(range(3, 40)), capacity=80).cache
    return list(backend.decode(cache, 5, max_tokens=30, sampling=Sampling(0.8)))

compute.submit(decode).result()
compute.submit(backend.close).result()
compute.shutdown()
"""


def test_a_process_whose_worker_thread_decoded_exits_cleanly_after_close(llama):
    """MLX's streams made on a worker thread can abort the process at exit (`terminate
    called without an active exception`, 134: most runs without close()); after close() on
    that thread, every run exits 0."""
    for _ in range(4):
        out = subprocess.run([sys.executable, "-c", _WORKER_EXIT, str(llama)],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0 and "terminate called" not in out.stderr, out.stderr[-2000:]


class _Subsets:
    """A constraint that allows a pseudo-random half of the vocabulary per step (a function of
    the tokens accepted so far) and is done after `length` tokens: the loop's mechanics under
    a mask, independent of any grammar engine (node/grammar.py's is tested in test_tools)."""

    def __init__(self, vocab: int, length: int):
        self.vocab, self.length, self.tokens = vocab, length, []

    def allowed(self) -> np.ndarray:
        rng = np.random.default_rng([len(self.tokens), *self.tokens[-2:]])
        return rng.random(self.vocab) < 0.5

    def accept(self, token: int) -> None:
        assert self.allowed()[token], "a token outside the mask was picked"
        self.tokens.append(token)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.length


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=0.9, seed=4, top_p=0.8)])
def test_a_masked_loop_from_the_prompts_last_token_is_the_host_rule_on_masked_logits(
    mlx_llama, sampling
):
    """start=0 with a constraint: the cache holds the prompt but its last token, the loop
    computes step 0 itself; every token equals the host rule on the masked logits of the
    one-step loop, and the loop ends when the constraint is done."""
    ids, n = ids_(30, seed=9), 16
    vocab = mlx_llama.spec.vocab_size
    runs = []
    for loop in ("pipelined", "serial"):
        cache, _ = prefilled(mlx_llama, ids[:-1], n)
        kw = dict(max_tokens=n, sampling=sampling, constraint=_Subsets(vocab, 10), start=0)
        steps = (mlx_llama.decode(cache, ids[-1], **kw) if loop == "pipelined"
                 else serial_decode(mlx_llama, cache, ids[-1], **kw))  # fmt: skip
        runs.append(list(steps))
    assert runs[0] == runs[1] and len(runs[0]) == 10
    free = serial(mlx_llama, ids[:-1], ids[-1], n, sampling)
    assert runs[0] != free[: len(runs[0])]  # the mask changed the answer


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=0.9, seed=4, top_p=0.8)])
def test_adjusted_logits_in_the_graph_are_the_host_rule_on_the_adjusted_logits(mlx_llama, sampling):
    """Penalties and logit_bias computed in the graph (float32) give the tokens the host
    rule gives on sampling.Adjust's float32 logits, step for step, sampled ones included."""
    from exo_split.sampling import Adjust

    ids, n = ids_(30, seed=11), 20
    vocab = mlx_llama.spec.vocab_size
    runs = []
    for loop in ("pipelined", "serial"):
        adjust = Adjust(vocab, bias={7: 3.0, 9: -2.5}, presence=0.8, frequency=0.6,
                        repetition=1.4, prompt=tuple(ids))  # fmt: skip
        cache, _ = prefilled(mlx_llama, ids[:-1], n)
        kw = dict(max_tokens=n, sampling=sampling, adjust=adjust, start=0)
        steps = (mlx_llama.decode(cache, ids[-1], **kw) if loop == "pipelined"
                 else serial_decode(mlx_llama, cache, ids[-1], **kw))  # fmt: skip
        runs.append(list(steps))
    assert runs[0] == runs[1] and len(runs[0]) == n
    cache, _ = prefilled(mlx_llama, ids[:-1], n)
    free = list(mlx_llama.decode(cache, ids[-1], max_tokens=n, sampling=sampling, start=0))
    assert runs[0] != free
