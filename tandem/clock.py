"""How long a stretch of device work took, without waiting for it.

On CUDA, two timing events bracket the work on the device's current stream and are read once
the host has waited for that stream past them anyway (a step's one read of its outcome): a
host synchronisation only to time the forward would hold back the host work that otherwise
runs beside it (the verification's launches, a large share of a small batch's speculative
step).
Elsewhere the host's clock: CPU work runs synchronously. ``StepTiming`` is where an engine
step's time went.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


class StreamClock:
    """Times one stretch of work at a time: ``start()``, the work, ``stop()``, and after the
    host has read something the work produced, ``elapsed_ns()``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if self.device.type == "cuda":
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
        self._started = 0
        self._host_ns = 0

    def start(self) -> None:
        if self._events is not None:
            self._events[0].record(torch.cuda.current_stream(self.device))
        else:
            self._started = time.perf_counter_ns()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self.device))
        else:
            self._host_ns = time.perf_counter_ns() - self._started

    def elapsed_ns(self) -> int:
        """The device time from ``start`` to ``stop`` (waits for ``stop``'s point of the
        stream if the host has not yet: call it after the step's read); the host time between
        them elsewhere."""
        if self._events is None:
            return self._host_ns
        begin, end = self._events
        end.synchronize()
        return round(begin.elapsed_time(end) * 1e6)


@dataclass(frozen=True)
class StepTiming:
    """Where one step's time went (ns; the host's clock except ``forward_ns``)."""

    total_ns: int = 0
    forward_ns: int = 0  # the target's forward: device time on CUDA (StreamClock)
    draft_wait_ns: int = 0  # in Drafter.submit/collect: the draft's work or waiting for it
    draft_model_ns: int = 0  # the draft model's compute that this step's trees cost

    @property
    def overhead_ns(self) -> int:
        """Everything outside model compute: host bookkeeping, serialisation, transport."""
        return self.total_ns - self.forward_ns - self.draft_model_ns
