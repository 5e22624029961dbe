"""Device counters read on the host without a host sync: the flush starts a copy, a later look
reads it once the device has made it.

`HostReadout.start(parts)` stacks the flush's device tensors (every layer's counters, the map) into
one device buffer (one kernel) and copies that into a pinned host buffer with one non-blocking copy,
then records an event on the stream. `Readout.ready()` asks the event without waiting (`query()`,
as the step clock does, clock.py); `Readout.read()` is called only once it is ready, so nothing here
waits for the device. On the CPU the copy is a plain one and is ready at once.

The counters it reads are cumulative (PairCounter: never zeroed), so a copy taken while the device
still adds to them loses no pair and counts none twice: the recorder subtracts the previous read.
Pinned buffers are reused once read (a pool), so after the first flushes nothing is allocated on
the host.

Sizes: parts are int64 tensors of any shape; T = their total number of elements.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch


class Readout:
    """One flush's copy on its way to the host: ready() never blocks; read() once it is ready."""

    def __init__(self, owner: "HostReadout", host: torch.Tensor, event: Any, layout: list[tuple[Hashable, tuple]],
                 keep: torch.Tensor | None):
        self._owner, self._host, self._event, self._layout = owner, host, event, layout
        self._keep = keep  # the device stack, alive until its copy is read

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Wait for the copy: only at shutdown, never on the step path."""
        if self._event is not None:
            self._event.synchronize()

    def read(self) -> dict[Hashable, np.ndarray]:
        """{key: array of its shape}, copied out of the host buffer (which goes back to the pool)."""
        if not self.ready():
            raise RuntimeError("read() before the device finished the copy")
        flat = self._host.numpy()
        out: dict[Hashable, np.ndarray] = {}
        offset = 0
        for key, shape in self._layout:
            size = int(np.prod(shape, dtype=np.int64))
            out[key] = flat[offset:offset + size].reshape(shape).copy()
            offset += size
        self._owner._give_back(self._host)
        self._host = self._keep = None
        return out


class HostReadout:
    """Starts the flush copies of one device's counters (see the module docstring)."""

    def __init__(self, device: torch.device | str, event_factory: Callable[[], Any] | None = None):
        """`event_factory`: the events that mark a copy done (CUDA's on a GPU); given on the CPU, the
        asynchronous path is taken there too (a test drives it with stand-in events)."""
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.asynchronous = on_gpu or event_factory is not None
        self._pin = on_gpu
        self.event_factory = event_factory or (torch.cuda.Event if on_gpu else None)
        self._pool: list[torch.Tensor] = []
        self.copies = 0  # device-to-host copies started (one per flush)

    def start(self, parts: Sequence[tuple[Hashable, torch.Tensor]], stream: Any = None) -> Readout:
        """Copy `parts` ((key, tensor) pairs, tensors on this device) to the host without waiting.
        `stream`: the CUDA stream the counters are updated on (the engine's), when the caller's
        thread is another one; the copy is ordered after the work already queued there."""
        layout = [(key, tuple(tensor.shape)) for key, tensor in parts]
        flat = [tensor.reshape(-1).to(torch.int64) for _, tensor in parts]
        total = sum(t.numel() for t in flat)
        self.copies += 1
        if not self.asynchronous:
            return Readout(self, torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int64), None, layout, None)
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            stack = torch.cat(flat)
            host = self._take(total)
            host.copy_(stack, non_blocking=True)
            event = self.event_factory()
            event.record()
        return Readout(self, host, event, layout, stack)

    def _take(self, size: int) -> torch.Tensor:
        for i, buffer in enumerate(self._pool):
            if buffer.numel() == size:
                return self._pool.pop(i)
        return torch.empty(size, dtype=torch.int64, pin_memory=self._pin)

    def _give_back(self, host: torch.Tensor) -> None:
        if self.asynchronous and len(self._pool) < 8:
            self._pool.append(host)
