"""Host-side helpers shared by the kernel wrappers (no triton import)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_trusted = threading.local()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def size_block(n: int, floor: int = 16) -> int:
    """A block for ``n`` elements that varies step to step (tree nodes, requests, splits): at
    least ``floor``, so the usual sizes share one compiled variant (a block is a compile-time
    constant, and compiling a new one mid-serving stalls every request for about a second)."""
    return max(floor, next_pow2(n))


def checks_values(t: Tensor) -> bool:
    """Whether a wrapper may validate the values of its inputs, which reads device memory on
    the host: not while a CUDA graph is being captured, nor inside ``trusted_values()``.
    Shapes, dtypes and devices are checked always; a captured or trusted launch relies on
    inputs validated where they were made."""
    if getattr(_trusted, "depth", 0):
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


@contextmanager
def trusted_values() -> Iterator[None]:
    """Kernel wrappers called in this block (on this thread) skip the value checks that read
    their inputs back to the host (each one a device synchronisation). For callers whose
    inputs come from host data they validated themselves: the engine's verification, whose
    trees passed ``Tree.check`` where they crossed the draft/target boundary."""
    _trusted.depth = getattr(_trusted, "depth", 0) + 1
    try:
        yield
    finally:
        _trusted.depth -= 1


def expect_device(name: str, t: Tensor, device: torch.device) -> None:
    """Raise ValueError unless `t` lives on `device` (a kernel reads every input there)."""
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
