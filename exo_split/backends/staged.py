"""What the torch and vllm prefill backends share: the node's staging ring, its slots' size in
positions, the wire frames it can always fill, and one request's Stager (torch_staging.py).

A backend using it has `spec`, `dtype`, `torch_device`, `ops` (CpuOps or CudaOps), `ring`
and `slot_timeout`."""

from __future__ import annotations

from exo_split.backends.base import OnLayer
from exo_split.backends.torch_staging import (
    DEFAULT_STAGING_BYTES,
    DEFAULT_STAGING_SLOTS,
    CpuOps,
    Stager,
    StagingRing,
)
from exo_split.errors import ExoSplitError
from exo_split.kv import itemsize


class StagedBackend:
    def set_staging(
        self,
        budget_bytes: int = DEFAULT_STAGING_BYTES,
        slots: int = DEFAULT_STAGING_SLOTS,
        *,
        copy: bool | None = None,
    ) -> StagingRing:
        """Allocate the node's staging ring now: `slots` host buffers sharing `budget_bytes`
        (pinned on CUDA), reused by every request. Call it between requests only (at start-up:
        pinning memory synchronizes the device). On the CPU, pieces are views of the cache and
        need no ring unless `copy=True` (the GPU's path with plain memory, as the tests run)."""
        if self.torch_device.type != "cuda":
            self.ops = CpuOps(copy=bool(copy))
        elif copy is False:
            raise ValueError("on CUDA every piece is copied to host memory: copy=False is not possible")  # fmt: skip
        slot_bytes = budget_bytes // max(1, slots)
        if self.ops.copy and slots < 2:
            raise ExoSplitError(
                f"a staging ring of {slots} slot cannot overlap copying with sending: it needs "
                "at least 2 (a frame may straddle two slots)",
                hint="use the default of 4 slots",
            )
        if self.ops.copy:
            per_token = self._bytes_per_token()
            if slot_bytes < per_token:
                raise ExoSplitError(
                    f"a staging slot of {slot_bytes:,} bytes ({budget_bytes:,} / {slots}) holds "
                    f"no position: one takes {per_token:,} bytes of K and V",
                    hint="raise the staging budget",
                )
            self.ring = StagingRing(slots, slot_bytes, self.ops.alloc)
        else:
            self.ring = StagingRing(None, slot_bytes, None)
        return self.ring

    def _bytes_per_token(self) -> int:
        return self.spec.layer_bytes_per_token(itemsize(self.dtype))

    def frame_positions_limit(self) -> int | None:
        """The most positions one wire frame may hold so that the ring can always fill it:
        a frame waits for every part of it, each part holds a slot, so a frame larger than
        the ring's slots would wait for a slot its own parts hold (until the slot timeout,
        issue 18 M2). (slots - 1) slots' worth spans at most every slot, even when it does
        not start on a slot's first position (a window's floor). None: no ring bound."""
        per_slot = self._piece_tokens()
        if per_slot is None:
            return None
        return (self.ring.n_slots - 1) * per_slot

    def _piece_tokens(self) -> int | None:
        """The most positions one piece holds: one ring slot's worth (None: no slots)."""
        return self.ring.slot_bytes // self._bytes_per_token() if self.ring.bounded else None

    def _stager(self, clock, on_layer: OnLayer, should_stop) -> Stager:
        return Stager(self.ring, self.ops, clock, on_layer, self.dtype,
                      piece_tokens=self._piece_tokens(), should_stop=should_stop,
                      slot_timeout=self.slot_timeout)  # fmt: skip
