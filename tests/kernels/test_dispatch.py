"""`kernels.ops`: which implementation runs where, the signature contract between every kernel
wrapper and its reference, CPU imports that never touch triton, and every kernel compiling for
sm_90 (in a subprocess, since this process may run Triton interpreted)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels import _interpret  # noqa: F401 (sets Triton's mode: import first)

# isort: split
import kernels

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_gets_the_references_and_cuda_the_kernels() -> None:
    assert kernels.ops("cpu") is kernels.REFERENCE
    assert kernels.uses_triton("cuda") == kernels.triton_available()
    if kernels.triton_available():
        assert kernels.ops("cuda") is kernels.triton_ops()
        assert kernels.triton_ops().name == "triton"


def test_every_kernel_has_its_reference_signature() -> None:
    ours = kernels.triton_ops()
    for field in dataclasses.fields(kernels.Ops):
        if field.name == "name":
            continue
        kernel, ref = getattr(ours, field.name), getattr(kernels.REFERENCE, field.name)
        assert kernel.__name__ == ref.__name__.removesuffix("_ref")
        params = inspect.signature(kernel).parameters
        ref_params = inspect.signature(ref).parameters
        assert [(p.name, p.kind, p.default) for p in params.values()] == [
            (p.name, p.kind, p.default) for p in ref_params.values()
        ], field.name


@pytest.mark.e2e
def test_cpu_paths_never_import_triton() -> None:
    code = (
        "import sys, torch\n"
        "import kernels, tandem.sampling, tandem.spec.verify, tandem.draft.drafter\n"
        "ops = kernels.ops('cpu')\n"
        "ops.top1(torch.randn(2, 9)); ops.topk(torch.randn(2, 9), 3)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="no NVIDIA backend"
)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernel tests compile them")
@pytest.mark.e2e
def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels._sm90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = done.stdout.splitlines()
    for kernel in ("_top1_partial", "_topk_merge", "_sample_merge", "_build_tree",
                   "_verify_greedy", "_verify_sampling", "_accepted_slots", "_store_kv",
                   "_compact", "_rms_norm", "_rope", "_silu_mul"):  # fmt: skip
        assert any(kernel in line for line in compiled), (kernel, compiled)
