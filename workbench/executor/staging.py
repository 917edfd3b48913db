"""Pinned staging: every host-to-device copy of a step's inputs, as one copy from persistent
buffers per consumer: the model's (ModelRunner.prepare) and the sampler's
(SamplingMetadataBuilder.build: its per-row parameter columns, histories and a grammar's
bitmask). Nothing else in the package copies from the host to a device.

Why. A non-blocking host-to-device copy is only queued when the call returns; the copy engine
reads the source when it gets to it. From pageable memory torch_npu queues the raw host
pointer, so a temporary (`torch.tensor(...).to(dev, non_blocking=True)`) can be freed or
refilled before it is read, and the device gets garbage; a blocking copy instead waits for
the whole queue, which is what asynchronous launches exist to avoid. So the runner writes a
step's inputs (token ids, positions, slots, logits rows, query_start_loc, seq_lens, the block
table) into one persistent host buffer, pinned where the platform pins
(`Platform.pinned`), and copies it with one non-blocking copy into one persistent device
buffer; the step's tensors are views of it.

Layout. Each step packs its arrays one after another, each starting on a 16-byte boundary
(Triton compiles a kernel variant per pointer alignment), so the copy covers what the step
uses and no more: its block table is [num_reqs, width of its longest table], not
[max_num_seqs, max blocks per sequence]. The buffers are bytes; each array has its own
dtype (int64 unless told: the type the CPU kernels read; the sampler's columns are float32,
a bitmask int32).

Refilling. With async scheduling (engine/pipeline.py) step N+1 is prepared while step N's
copy may still be queued, so the buffer N was copied from must not be refilled yet. Two
host buffers alternate, and each records an event after its copy; a buffer is refilled only
after waiting on its event. The pipeline waits for step N before it prepares step N+2, so
that wait finds the event done and costs nothing: it is the guarantee, the alternation is
what makes it free. The device buffer is one: device work is ordered on the stream, so step
N+1's copy into it lands after step N's kernels have read it.

On a platform without memory of its own (the CPU) nothing is copied: the step's tensors
are views of the host buffer, and the two buffers still alternate, so step N's tensors stay
intact while step N+1 is prepared.
"""
from __future__ import annotations

import numpy as np
import torch

ALIGN = 16
"""Bytes: where each array starts."""

NUMPY_DTYPES = {torch.long: np.int64, torch.float32: np.float32, torch.int32: np.int32,
                torch.bool: np.bool_}
"""The dtypes an array may have, as numpy names them."""


class StagingBuffers:
    """Persistent host buffers (two, alternating, pinned on accelerators) and one device
    buffer, of bytes, holding one step's inputs. A step calls `fill` (numpy views to write),
    then `commit` (one copy; the tensors the step reads). The buffers grow, once, for a step
    larger than the capacity (bytes) they were sized for."""

    def __init__(self, platform, capacity: int):
        self.platform = platform
        self.copies = platform.has_device_memory
        """Whether the step's tensors live on the device (else they are the host views)."""
        self._host: list[torch.Tensor] = []
        self._events: list[object | None] = [None, None]
        """What each host buffer's last copy recorded: wait on it before refilling."""
        self._device: torch.Tensor | None = None
        self._flip = 0
        self._parts: list[tuple[int, int, torch.dtype]] = []
        """(byte offset, length, dtype) of each array of the step being filled."""
        self._total = 0
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        for i, event in enumerate(self._events):      # nothing in flight reads the old ones
            if event is not None:
                event.synchronize()
                self._events[i] = None
        self.capacity = capacity
        self._host = [self.platform.pinned(torch.zeros(capacity, dtype=torch.uint8))
                      for _ in range(2)]
        self._views = [h.numpy() for h in self._host]
        if self.copies:
            self._device = torch.zeros(capacity, dtype=torch.uint8, device=self.platform.device)

    def fill(self, sizes: list[int], dtypes: list[torch.dtype] | None = None
             ) -> list[np.ndarray]:
        """Start a step whose arrays have these lengths (and dtypes: int64 where None):
        switch to the other host buffer (waiting, if it must, for its last copy) and return a
        writable numpy view per array. Whatever a view is not written holds an earlier step's
        values."""
        parts, at = [], 0
        for n, dtype in zip(sizes, dtypes or [torch.long] * len(sizes)):
            parts.append((at, n, dtype))
            at += -(-n * dtype.itemsize // ALIGN) * ALIGN
        if at > self.capacity:
            self._allocate(max(at, 2 * self.capacity))
        self._flip ^= 1
        event = self._events[self._flip]
        if event is not None:
            event.synchronize()
            self._events[self._flip] = None
        self._parts, self._total = parts, at
        view = self._views[self._flip]
        return [view[a:a + n * t.itemsize].view(NUMPY_DTYPES[t]) for a, n, t in parts]

    def commit(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copy what `fill` handed out to the device, in one non-blocking copy from the
        pinned buffer, and return the arrays as the step's tensors (on the device) and as
        host tensors (the same memory `fill` wrote; on the CPU both are the host views)."""
        host = self._host[self._flip]
        on_host = [host[a:a + n * t.itemsize].view(t) for a, n, t in self._parts]
        if not self.copies:
            return on_host, on_host
        self._device[:self._total].copy_(host[:self._total], non_blocking=True)
        self._events[self._flip] = self.platform.record_event()
        return [self._device[a:a + n * t.itemsize].view(t) for a, n, t in self._parts], on_host
