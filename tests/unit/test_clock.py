"""``tandem.clock.StreamClock``: the device time of a stretch of work without a synchronisation
at its end (CUDA), the host's time elsewhere."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.clock import StreamClock


def test_cpu_clock_is_the_host_time_between_start_and_stop() -> None:
    clock = StreamClock("cpu")
    clock.start()
    time.sleep(0.02)
    clock.stop()
    time.sleep(0.05)  # after stop: not counted
    elapsed = clock.elapsed_ns()
    assert 20_000_000 <= elapsed < 45_000_000


def test_cpu_clock_restarts() -> None:
    clock = StreamClock("cpu")
    clock.start()
    time.sleep(0.03)
    clock.stop()
    first = clock.elapsed_ns()
    clock.start()
    clock.stop()
    assert clock.elapsed_ns() < first


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
    launched = time.perf_counter_ns() - host
    elapsed = clock.elapsed_ns()
    total = time.perf_counter_ns() - host
    assert launched < elapsed  # stop did not wait for the work
    assert elapsed <= total
    assert elapsed > 1_000_000
