"""vLLM as a prefill engine: its engine in the node's process, our connector
(vllm_connector.py) handing each layer's KV to the node's frame sender as vLLM computes it.

A prefill is one vLLM request of the prompt with max_tokens=1. Its first token follows
sampling.py's rule like every backend's: vLLM returns the raw logits of the last position
(logprobs=-1 with logprobs_mode="raw_logits", flat), and stream_prefill samples them. So the
first token is the node's choice by our rule, and the float32 logits can be compared with
transformers'; the decode node never needs vLLM's sampler.

vLLM's automatic prefix caching is this node's prefix cache: the node builds no PrefixCache
of its own for this backend (`own_prefix_cache`), and positions vLLM found cached are read
from its blocks like the ones it computes, so the decode node gets every position it lacks.
vLLM chunks the prompt by its own token budget (max_num_batched_tokens, set at start-up):
the plan's chunks follow that budget from position 0 (`prefill_chunks`); a request's own
chunk size cannot change it. This backend only prefills: it has no decode loop or cache of
its own (a decode node runs MLX or torch).

Engine arguments beyond ours come from EXO_SPLIT_VLLM_ARGS (JSON object; the node's
--engine-arg KEY=VALUE sets it): quantization, gpu_memory_utilization, kv_cache_memory_bytes,
max_model_len, max_num_batched_tokens, tensor_parallel_size. With tensor parallelism vLLM's
workers run in processes of their own and send their KV heads to this process's relay
(vllm_relay.py); the frames then carry each worker's head range.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# vLLM's engine core and worker in this process, so the connector reaches our jobs; set
# before vLLM is imported (it reads it then). Importing this module imports vLLM: where it is
# not installed, load_backend says so.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import vllm  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from exo_split.backends import vllm_kv as conn  # noqa: E402
from exo_split.backends import vllm_relay as relays
from exo_split.backends.base import Cancelled, Prefilled
from exo_split.backends.staged import StagedBackend
from exo_split.errors import BadCheckpoint, ExoSplitError
from exo_split.kv import LayerKV, chunk_sizes, streamed_chunks
from exo_split.layers import is_latent, recurrent_layers
from exo_split.spec import load_quantization, load_spec
from exo_split.transport.heads import even_ranges

log = logging.getLogger(__name__)
clock = time.perf_counter
DEFAULT_BUDGET = 2048  # max_num_batched_tokens: the chunk vLLM prefills at a time
ARGS_ENV = "EXO_SPLIT_VLLM_ARGS"
SUPPORTED = ("0.32.0",)  # the vLLM releases whose connector contract tests passed
_OURS = ("model", "dtype", "kv_transfer_config", "max_logprobs", "logprobs_mode")
RELAY_TIMEOUT_S = 60.0  # tensor-parallel: the workers' last pieces after the prefill's end


class VllmBackend(StagedBackend):
    name = "vllm"
    prefill_only = True  # no decode loop: the decode node decodes
    own_prefix_cache = True  # vLLM's automatic prefix caching
    stages_in_background = True  # prefill(background=True): the ring drains after it
    window_keep: tuple[int | None, ...] = ()

    def __init__(self, llm, spec, dtype: str, device: str, budget: int, quantization: str | None,
                 relay: relays.Relay | None = None, tp: int = 1):  # fmt: skip
        import torch

        from exo_split.backends.torch_staging import DEFAULT_SLOT_TIMEOUT_S, CpuOps, CudaOps

        self.llm, self.engine = llm, llm.llm_engine
        self.spec, self.dtype, self.device, self.budget = spec, dtype, device, budget
        self.max_len = llm.llm_engine.vllm_config.model_config.max_model_len
        # Pieces gathered on the GPU reach host memory through the node's pinned staging ring
        # on a side stream, after an event (staged.py, as the torch backend's); on the CPU
        # they are gathered to host memory on the forward's thread, unless set_staging(copy=
        # True) puts them through a ring too (the GPU's path, as the tests run it).
        self.torch_device = torch.device(device if device != "cuda" else "cuda:0")
        self.ops = CudaOps(self.torch_device) if device == "cuda" else CpuOps()
        self.slot_timeout = DEFAULT_SLOT_TIMEOUT_S
        self.set_staging()
        self.quantization = None  # an MLX-quantization record (spec.Quantization): none here
        self.engine_quantization = quantization  # vLLM's method (fp8, awq, ...) or None
        self.counts = {"prefills": 0, "prompt_tokens": 0, "prefix_hit_tokens": 0}
        # Tensor parallelism: each worker's heads reach us through the relay, one frame each
        self.relay, self.tp = relay, tp
        self.head_ranges = even_ranges(spec.n_kv_heads, tp) if tp > 1 else ()
        self.relay_timeout_s = RELAY_TIMEOUT_S
        cache_dtype = str(llm.llm_engine.vllm_config.cache_config.cache_dtype)
        self.kv_cache_dtype = cache_dtype if cache_dtype in conn.FP8 else None  # its KV: fp8

    @property
    def quantization_tag(self) -> str | None:
        """The node's advertised quantization: vLLM's method ("vllm:fp8"); None: full."""
        return f"vllm:{self.engine_quantization}" if self.engine_quantization else None

    def prefill_chunks(self, n_tokens: int, chunk: int | None) -> tuple[int, ...]:
        return chunk_sizes(n_tokens, self.budget)

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        chunk: int | None = None,
        on_layer: Callable[[LayerKV], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        capacity: int | None = None,
        cache: Any = None,
        emit_from: int = 0,
        background: bool = False,
    ) -> Prefilled:
        """Run the prompt through vLLM; hand on positions [emit_from, n) of every layer as
        the plan's pieces (chunk-major, then layer), or keep them (on_layer None) for
        stream_kv / export. `chunk` and `capacity` do not apply (vLLM's own budget, blocks).
        `background`: pieces still in the staging ring when the forward ends are staged
        after it returns (Prefilled.staging), as the torch backend's."""
        if cache is not None:
            raise ExoSplitError("the vllm backend keeps its prefix cache inside vLLM")
        n, start = len(token_ids), emit_from
        if not 0 <= start < n:
            raise ValueError(f"emit_from {start} outside a prompt of {n} positions")
        kept: list[LayerKV] = []
        layers = range(self.spec.n_layers)
        # The plan's pieces (stream_prefill's): vLLM's chunks from position 0, from `start` on;
        # without on_layer whole layers, handed on after the prefill.
        chunks = (
            streamed_chunks(0, chunk_sizes(n, self.budget), start) if on_layer else (n - start,)
        )
        pieces, at = [], start
        for size in chunks:
            pieces += [(layer, at, size) for layer in layers]
            at += size
        stop = should_stop or (lambda: False)
        stager = stage = None
        if on_layer is not None and self.ring.bounded and self.relay is None:
            clock_ = self.ops.begin()
            stager = self._stager(clock_, on_layer, stop)

            def stage(layer: int, at: int, k, v) -> None:  # the forward's thread
                stager.put(layer, at, k.shape[1], clock_.record(), (k[None], v[None]), base=at)

        job_id, extra = f"exo-split-{uuid.uuid4().hex}", {}
        if self.relay is not None:  # the workers' Jobs gather; the relay puts pieces together
            job = relays.RelayJob(pieces, self.tp, on_layer or kept.append, self.dtype)
            extra[relays.PLAN_KEY] = {"pieces": pieces, "dtype": self.dtype}
            self.relay.register(job_id, job)
        else:
            job = conn.Job(pieces, on_layer or kept.append, self.dtype, stop, stage=stage)
            conn.register(job_id, job)
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, flat_logprobs=True,
                                detokenize=False, extra_args={conn.JOB_KEY: job_id, **extra})  # fmt: skip
        finished = None
        try:
            try:
                self.engine.add_request(job_id, {"prompt_token_ids": list(token_ids)}, params)
            except ValueError as exc:  # vLLM's validation: longer than its max_model_len, ...
                raise ExoSplitError(f"vLLM refused the prompt of {n} tokens: {exc}") from exc
            while finished is None:
                for out in self.engine.step():
                    if out.request_id == job_id and out.finished:
                        finished = out
                if job.error is not None or stop():
                    break
                if finished is None and not self.engine.has_unfinished_requests():
                    raise ExoSplitError("vLLM dropped the prefill request")
            if self.relay is not None and not job.wait(self.relay_timeout_s, stop):
                job.fail(relays.RelayError(
                    f"vLLM's workers handed on {job.next_piece} of {len(pieces)} pieces within "
                    f"{self.relay_timeout_s:g} s of the prefill's end"))  # fmt: skip
            computed_at = clock()
        finally:
            if finished is None:
                self.engine.abort_request([job_id])
            conn.unregister(job_id)
            if self.relay is not None:
                self.relay.unregister(job_id)
            if stager is not None and (finished is None or job.error is not None):
                stager.abort()
        if isinstance(job.error, conn.Cancelled) or ((finished is None or not job.done) and stop()):
            raise Cancelled("prefill cancelled")
        if isinstance(job.error, ValueError):  # a layout or dtype the connector does not read
            raise ExoSplitError(str(job.error)) from job.error
        if job.error is not None:
            raise job.error
        if not job.done:
            if stager is not None:
                stager.abort()
            raise ExoSplitError(
                f"vLLM finished the prefill with {len(pieces) - job.next_piece} of "
                f"{len(pieces)} pieces not handed on: its hooks did not run for every layer "
                f"({len(job.saves)} calls)"
            )
        self.counts["prefills"] += 1
        self.counts["prompt_tokens"] += n
        self.counts["prefix_hit_tokens"] += int(finished.num_cached_tokens or 0)
        staging = None
        if stager is not None:
            if background and stager.threaded:
                staging = stager  # stream_prefill finishes it off the compute thread
            else:
                stager.finish()
        return Prefilled(cache=kept or None, logits=self._logits(finished),
                         computed_at=computed_at, staging=staging)  # fmt: skip

    def describe(self) -> dict:
        """GET /v1/info's stats.engine: vLLM's version, budget, quantization and counts
        (prefix_hit_tokens: positions vLLM found in its prefix cache and did not compute;
        relay_bytes: KV bytes tensor-parallel workers sent this process)."""
        relay = {"relay_bytes": self.relay.received_bytes} if self.relay is not None else {}
        return {"name": "vllm", "version": vllm.__version__, "max_num_batched_tokens": self.budget,
                "quantization": self.engine_quantization, "tensor_parallel_size": self.tp,
                "kv_cache_dtype": self.kv_cache_dtype,
                **self.counts, **relay}  # fmt: skip

    def _logits(self, out) -> np.ndarray:
        lp = out.outputs[0].logprobs
        logits = np.full(self.spec.vocab_size, -np.inf, dtype=np.float32)
        ids = np.asarray(lp.token_ids[lp.start_indices[0] : lp.end_indices[0]])
        vals = np.asarray(lp.logprobs[lp.start_indices[0] : lp.end_indices[0]], np.float32)
        inside = ids < self.spec.vocab_size  # vLLM may pad the vocabulary
        logits[ids[inside]] = vals[inside]
        return logits

    def stream_kv(self, cache, on_layer, *, chunk=None, should_stop=None, start_pos: int = 0):
        for kv in cache or ():
            if should_stop is not None and should_stop():
                raise Cancelled("prefill cancelled while sending")
            piece = kv.since(start_pos)
            if piece is not None:
                on_layer(piece)

    def export(self, cache) -> list[LayerKV]:
        return list(cache or ())

    def warm(self) -> float:
        """One prefill of a budget's length: vLLM's first request pays for its kernels."""
        t0 = clock()
        n = min(self.budget, max(1, self.max_len - 1), 256)
        ids = [3 % self.spec.vocab_size] * n
        self.prefill(ids, on_layer=lambda kv: None)
        return clock() - t0

    def memory(self) -> dict | None:
        return None

    def close(self) -> None:
        try:
            self.engine.engine_core.shutdown()
        except Exception as exc:  # the process is going anyway
            log.debug("vLLM shutdown: %s", exc)
        if self.relay is not None:
            self.relay.close()

    def _decode_only(self, *args, **kwargs):
        raise ExoSplitError(
            "the vllm backend only prefills: it has no decode loop",
            hint="point clients at the decode node (MLX or torch), which reaches this one",
        )

    decode = step = new_cache = inject = _decode_only


def engine_args(
    model_dir: Path, dtype: str, device: str, relay: str | None = None
) -> dict[str, Any]:
    """vLLM's arguments: the node's, then EXO_SPLIT_VLLM_ARGS' (which may not set ours);
    `relay`: the socket tensor-parallel workers send their heads to."""
    from vllm.config import KVTransferConfig

    extra = json.loads(os.environ.get(ARGS_ENV) or "{}")
    if not isinstance(extra, dict):
        raise ExoSplitError(f"{ARGS_ENV} must be a JSON object of vLLM engine arguments")
    clash = sorted(set(extra) & set(_OURS))
    if clash:
        raise ExoSplitError(f"vLLM engine arguments {', '.join(clash)} are set by exo-split")
    if int(extra.get("pipeline_parallel_size", 1)) > 1:
        raise ExoSplitError(
            "the vllm backend does not support pipeline parallelism yet (tensor parallelism "
            "it does: tensor_parallel_size; docs/vllm.md)"
        )
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "enable_prefix_caching": True,
        "max_num_batched_tokens": DEFAULT_BUDGET,
        "max_logprobs": -1,
        "logprobs_mode": "raw_logits",
        "kv_transfer_config": KVTransferConfig(
            kv_connector="ExoSplitConnector",
            kv_connector_module_path="exo_split.backends.vllm_connector",
            kv_role="kv_producer",
            kv_connector_extra_config={relays.RELAY_KEY: relay} if relay else {},
        ),
    }
    if device == "cpu":
        args["enforce_eager"] = True
    return {**args, **extra}


def load(model_dir: str | Path, *, dtype: str | None = None, device: str | None = None):
    if vllm.__version__ not in SUPPORTED:
        log.warning("vLLM %s: exo-split's connector was checked with %s only",
                    vllm.__version__, ", ".join(SUPPORTED))  # fmt: skip
    from vllm import LLM

    model_dir = Path(model_dir)
    spec = load_spec(model_dir)
    if recurrent_layers(spec):
        raise BadCheckpoint(
            f"{spec.architecture} has recurrent layers: the vllm backend's connector reads "
            "attention KV only, not vLLM's state cache",
            hint="prefill this model with --backend torch",
        )
    if is_latent(spec):
        raise BadCheckpoint(
            f"{spec.architecture} has latent attention (MLA): vLLM keeps the latent in its MLA "
            "cache layout, which the vllm backend's connector does not read yet",
            hint="prefill this model with --backend torch",
        )
    # float32, or a quantized checkpoint's scales' dtype (vLLM's 4-bit kernels refuse float32)
    quantized = load_quantization(model_dir)
    dtype = dtype or (quantized.scales_dtype if quantized else None) or "float32"
    from vllm.platforms import current_platform

    dev = device or current_platform.device_type
    if dev not in ("cpu", "cuda") and not dev.startswith("cuda"):
        raise ExoSplitError(f"the vllm backend runs on cpu or cuda, not {dev!r}")
    tp = relays.parallel_size(spec, json.loads(os.environ.get(ARGS_ENV) or "{}"))
    relay = relays.Relay() if tp > 1 else None
    args = engine_args(model_dir, dtype, dev, relay.path if relay else None)
    try:
        llm = LLM(**args)
    except (ValueError, RuntimeError, OSError, NotImplementedError) as exc:
        if relay is not None:
            relay.close()
        raise BadCheckpoint(f"vLLM cannot load {model_dir}: {exc}") from exc
    config = llm.llm_engine.vllm_config
    budget = config.scheduler_config.max_num_batched_tokens
    quant = getattr(config.model_config, "quantization", None)
    log.info("vllm backend: %s on %s in %s, chunks of %d", spec.name, dev, dtype, budget)
    return VllmBackend(llm, spec, dtype, "cuda" if dev.startswith("cuda") else dev, budget, quant,
                       relay, tp)  # fmt: skip
