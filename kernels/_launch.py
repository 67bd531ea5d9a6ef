"""Host-side helpers shared by the kernel wrappers (no triton import)."""

from __future__ import annotations

import torch
from torch import Tensor


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def checks_values(t: Tensor) -> bool:
    """Whether a wrapper may validate the values of its inputs, which reads device memory on
    the host: not while a CUDA graph is being captured. Shapes, dtypes and devices are checked
    always; a captured launch relies on inputs validated where they were made."""
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def expect_device(name: str, t: Tensor, device: torch.device) -> None:
    """Raise ValueError unless `t` lives on `device` (a kernel reads every input there)."""
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
