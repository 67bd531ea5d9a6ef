"""``tandem.clock.StreamClock``: the device time of a stretch of work without a synchronisation
at its end (CUDA), the host's time elsewhere."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.clock import StreamClock


def timed(clock: StreamClock, work_s: float) -> tuple[int, int]:
    """``clock`` around ``work_s`` of sleep, bracketed by the host's clock: (the time from
    start's return to stop's call, the time from start's call to stop's return). The clock's
    reading lies between them, however loaded the host."""
    before = time.perf_counter_ns()
    clock.start()
    started = time.perf_counter_ns()
    time.sleep(work_s)
    stopping = time.perf_counter_ns()
    clock.stop()
    return stopping - started, time.perf_counter_ns() - before


def test_cpu_clock_is_the_host_time_between_start_and_stop() -> None:
    clock = StreamClock("cpu")
    inner, outer = timed(clock, 0.02)
    time.sleep(0.05)  # after stop: not counted
    elapsed = clock.elapsed_ns()
    assert 20_000_000 <= inner <= elapsed <= outer


def test_cpu_clock_restarts() -> None:
    """Each start begins a new stretch: the second reading is the second stretch alone."""
    clock = StreamClock("cpu")
    timed(clock, 0.03)
    assert clock.elapsed_ns() >= 30_000_000
    inner, outer = timed(clock, 0.0)
    assert inner <= clock.elapsed_ns() <= outer


@pytest.mark.gpu
def test_cuda_clock_times_the_device_and_does_not_wait_at_stop() -> None:
    clock = StreamClock("cuda")
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    host = time.perf_counter_ns()
    clock.start()
    for _ in range(50):  # tens of ms of device work, microseconds to launch
        x = x @ x
        x = x / x.norm()
    clock.stop()
    stopped = time.perf_counter_ns()
    launched = stopped - host
    torch.cuda.synchronize()
    waited = time.perf_counter_ns() - stopped  # the work still queued when stop returned
    elapsed = clock.elapsed_ns()
    total = time.perf_counter_ns() - host
    assert launched < elapsed  # stop did not wait for the work
    assert waited <= elapsed <= total  # it counts the work the host waited for, and no more
