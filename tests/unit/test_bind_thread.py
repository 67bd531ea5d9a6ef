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


def _top1_on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | Exception:
    out: list[tuple[torch.Tensor, torch.Tensor] | Exception] = []

    def run() -> None:
        try:
            bind_thread(device)
            assert torch.cuda.current_device() == device.index
            logits = torch.randn(3, 1001, device=device)
            ids, _, _ = kernels.triton_ops().top1(logits)
            out.append((ids.cpu(), logits.argmax(dim=-1).cpu()))
        except Exception as exc:  # reported to the test's thread
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def test_a_plain_cuda_device_leaves_the_current_one() -> None:
    before = torch.cuda.current_device()
    bind_thread("cuda")  # no index: nothing to bind (torch.cuda.set_device would refuse it)
    bind_thread("cpu")
    assert torch.cuda.current_device() == before


def test_a_bound_thread_runs_triton_kernels_on_the_last_device() -> None:
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    result = _top1_on(device)
    assert not isinstance(result, Exception), result
    ids, expected = result
    assert torch.equal(ids, expected)
