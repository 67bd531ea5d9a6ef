"""Triton's mode for kernel tests, fixed before any ``kernels.*`` module defines a kernel.

Without CUDA, Triton runs interpreted on CPU tensors; ``TRITON_INTERPRET`` is read when
``@triton.jit`` runs, so this module must be imported before the kernel modules (test modules
import it first). With CUDA the kernels compile and the same tests run on the GPU. The mode is
fixed per process: a GPU host runs an interpreted suite as a separate pytest invocation with
``TRITON_INTERPRET=1`` set in the environment.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")


def check_mode(kernel: object) -> None:
    """Raises if ``kernel`` was defined in the other mode (its module was imported before
    this one), which would fail later with a less readable error."""
    from triton.runtime.interpreter import InterpretedFunction  # type: ignore[import-untyped,unused-ignore]

    if isinstance(kernel, InterpretedFunction) != INTERPRETED:
        module = getattr(kernel, "__module__", "?")
        raise RuntimeError(
            f"{module} was imported before tests.kernels._interpret set TRITON_INTERPRET="
            f"{int(INTERPRETED)}; import tests.kernels._interpret first ({sys.argv[0]})"
        )
