"""The KV connector vLLM loads by module path (kv_connector_module_path): it hands each
layer's KV of an exo-split prefill to the node's frame sender as vLLM computes it.

vLLM runs in the node's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker), so its
scheduler-side and worker-side connector instances and the backend share the job registry of
vllm_kv.py: a request carries its job's id in SamplingParams.extra_args, the scheduler side
maps vLLM's request id to that job and lists, per step, the request's blocks and the
positions the step computes; the worker side, called by every attention layer after it
wrote its KV (save_kv_layer, on the forward's own thread), hands the job the layer, which
emits the plan's pieces that layer now holds (vllm_kv.Job). The layout is chosen from what
vLLM reports (vllm_kv.layout_of).

With tensor parallelism (the node's relay named in kv_connector_extra_config) each worker
runs in a process of its own: the scheduler side passes the job's plan in the metadata, each
worker's side keeps a Job of its own over its heads and sends its pieces to the node's relay
(vllm_relay.py), which puts them together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from exo_split.backends.vllm_kv import FP8, JOB_KEY, Dequant, Job, layout_of, lookup
from exo_split.backends.vllm_relay import PLAN_KEY, RELAY_KEY, WorkerLink

_LAYER = re.compile(r"\.(\d+)\.")  # model.layers.{i}.self_attn.attn


@dataclass
class _Step:
    req_id: str
    job_id: str
    blocks: list[int]
    start: int  # positions [start, end) computed in this step
    end: int
    plan: dict | None = None  # tensor-parallel: the job's pieces and dtype (its first step)


@dataclass
class ExoSplitMetadata(KVConnectorMetadata):
    steps: list[_Step] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # jobs whose requests ended


class ExoSplitConnector(KVConnectorBase_V1):
    """vLLM's view of exo-split: a producer that saves every layer of the requests that carry
    a job (extra_args[JOB_KEY]) and loads nothing."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._requests: dict[str, tuple[str, list[int]]] = {}  # req id -> (job id, blocks)
        self._ended: list[str] = []  # jobs whose requests ended since the last metadata
        self._layouts: dict[int, str] = {}
        self._cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self._dequant: dict[int, Dequant] = {}  # an fp8 cache's, per layer
        model = vllm_config.model_config
        self._heads = model.get_num_kv_heads(vllm_config.parallel_config)  # this worker's
        self._head_dim = model.get_head_size()
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._relay: str | None = extra.get(RELAY_KEY)  # tensor-parallel: the node's socket
        self._link: WorkerLink | None = None
        self._jobs: dict[str, Job] = {}  # tensor-parallel: this worker's jobs

    # Scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False  # a producer: nothing to load

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output) -> ExoSplitMetadata:
        meta = ExoSplitMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            extra = (new.sampling_params.extra_args or {}) if new.sampling_params else {}
            job_id = extra.get(JOB_KEY)
            if job_id is None:
                continue
            self._requests[new.req_id] = (job_id, list(new.block_ids[0]))
            start = new.num_computed_tokens
            meta.steps.append(_Step(new.req_id, job_id, list(new.block_ids[0]), start,
                                    start + scheduled[new.req_id], extra.get(PLAN_KEY)))  # fmt: skip
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._requests:
                continue
            job_id, blocks = self._requests[req_id]
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted, then resumed: its blocks anew
                blocks[:] = list(new[0]) if new is not None else []
            elif new is not None:
                blocks += list(new[0])
            start = cached.num_computed_tokens[i]
            meta.steps.append(_Step(req_id, job_id, list(blocks), start,
                                    start + scheduled[req_id]))  # fmt: skip
        meta.finished, self._ended = self._ended, []
        return meta

    def request_finished(self, request, block_ids):
        """vLLM calls this before the request's id is in a step's finished_req_ids: the job
        is ended here, and the workers hear of it in the next step's metadata."""
        job = self._requests.pop(request.request_id, None)
        if job is not None:
            self._ended.append(job[0])
        return False, None  # every piece was copied out during the forward

    # Worker side --------------------------------------------------------------------------

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for job_id in getattr(meta, "finished", ()):
            self._jobs.pop(job_id, None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ExoSplitMetadata) or not meta.steps:
            return
        match = _LAYER.search(layer_name)
        if match is None:
            return
        layer = int(match.group(1))
        for step in meta.steps:
            job = lookup(step.job_id) if self._relay is None else self._worker_job(step)
            if job is None:
                continue
            failed = job.error is not None
            if not job.layout:
                try:
                    job.layout = self._layout(layer, layer_name, kv_layer)
                except ValueError as exc:
                    job.error = exc
            if job.layout and self._cache_dtype in FP8:
                job.dequant[layer] = self._fp8(layer, layer_name)
            if job.layout:
                job.layer_saved(layer, kv_layer, step.blocks, step.start, step.end,
                                self._block_size)  # fmt: skip
            if self._link is not None and job.error is not None and not failed:
                self._link.fail(step.job_id, str(job.error))

    def _worker_job(self, step: _Step) -> Job | None:
        """Tensor-parallel: this worker's Job for the step's job, made from the plan its
        first step carries; its pieces (this worker's heads) go to the node's relay."""
        job = self._jobs.get(step.job_id)
        if job is None and step.plan is not None:
            if self._link is None:
                from vllm.distributed import get_tensor_model_parallel_rank

                self._link = WorkerLink(self._relay, get_tensor_model_parallel_rank())
            link, job_id = self._link, step.job_id
            pieces = [(int(a), int(b), int(c)) for a, b, c in step.plan["pieces"]]
            job = Job(pieces, lambda kv: link.send(job_id, kv), step.plan["dtype"])
            self._jobs[job_id] = job
        return job

    def _fp8(self, layer: int, layer_name: str) -> Dequant:
        """The layer's fp8 format and scales (the attention layer's, as its kernels use them)."""
        if layer not in self._dequant:
            from vllm.forward_context import get_forward_context

            attn = get_forward_context().no_compile_layers.get(layer_name)
            self._dequant[layer] = Dequant(FP8[self._cache_dtype],
                                           float(getattr(attn, "_k_scale_float", 1.0)),
                                           float(getattr(attn, "_v_scale_float", 1.0)))  # fmt: skip
        return self._dequant[layer]

    def _layout(self, layer: int, layer_name: str, kv_layer) -> str:
        if layer not in self._layouts:
            from vllm.forward_context import get_forward_context

            attn = get_forward_context().no_compile_layers.get(layer_name)
            impl = getattr(attn, "attn_backend", None)
            name = impl.get_name() if impl is not None else type(attn).__name__
            self._layouts[layer] = layout_of(name, getattr(attn, "isa", None),
                                             tuple(kv_layer.shape), self._heads,
                                             self._head_dim,
                                             str(kv_layer.dtype).removeprefix("torch."),
                                             self._cache_dtype)  # fmt: skip
        return self._layouts[layer]

    def wait_for_save(self) -> None:
        return  # every piece was gathered in save_kv_layer
