"""``transfer.bind_thread``: a thread that runs a model on the last CUDA device launches its
Triton kernels there (a thread starts on cuda:0, and Triton launches on the current device
whatever its arguments' device: a draft service on cuda:1 failed its first kernel)."""

from __future__ import annotations

import threading

import pytest
import torch

import kernels
from tandem.transfer import bind_thread

pytestmark = pytest.mark.gpu


def _top1_on(device: torch.device, bind: bool) -> tuple[torch.Tensor, torch.Tensor] | Exception:
    out: list[tuple[torch.Tensor, torch.Tensor] | Exception] = []

    def run() -> None:
        try:
            if bind:
                bind_thread(device)
            logits = torch.randn(3, 1001, device=device)
            ids, _, _ = kernels.triton_ops().top1(logits)
            out.append((ids.cpu(), logits.argmax(dim=-1).cpu()))
        except Exception as exc:  # reported to the test's thread
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def test_a_bound_thread_runs_triton_kernels_on_the_last_device() -> None:
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    result = _top1_on(device, bind=True)
    assert not isinstance(result, Exception), result
    ids, expected = result
    assert torch.equal(ids, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_an_unbound_thread_cannot_launch_on_a_second_device() -> None:
    """Why the binding exists (if Triton ever launches on its arguments' device, this test
    says the binding is no longer needed)."""
    result = _top1_on(torch.device("cuda", 1), bind=False)
    assert isinstance(result, Exception)
