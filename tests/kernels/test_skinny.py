"""`skinny_linear` (a few rows times a weight, kernels/skinny.py) against ``x @ weight.T``
with float32 accumulation: odd widths, 1 to 16 rows, both weight layouts, fp32/fp16
interpreted on CPU (bf16 too on the GPU); a row's result does not depend on the others; and
`linear`'s dispatch (decode-size bf16/fp16 batches on CUDA with transposed weights take the
kernel, everything else ``F.linear``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels import skinny
from kernels.skinny import _skinny_kernel, linear, skinny_linear

check_mode(_skinny_kernel)

SHAPES = [(40, 24), (130, 70), (257, 33)]  # (K, N): none a multiple of a tile
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
CONFIGS = [
    {"block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 3},
    {"block_n": 16, "block_k": 128, "num_warps": 2, "num_stages": 2},
]


def expected(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(x.dtype)  # one rounding


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # float32 accumulation in another order than float64: a few float32 ulps of the sum;
    # 16-bit outputs: one rounding of the output dtype either side.
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-4}
    return {"rtol": 1e-2 if dtype == torch.bfloat16 else 2e-3, "atol": 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_skinny_equals_the_matmul(dtype: torch.dtype, shape: tuple[int, int], rows: int) -> None:
    k, n = shape
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(n, k, generator=gen).to(DEVICE, dtype) / k**0.5
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    for w in (weight, weight.t().contiguous().t()):  # [out, in] and the transposed storage
        for config in CONFIGS:
            for b in (None, bias):
                out = skinny_linear(x, w, b, **config)
                assert out.shape == (rows, n) and out.dtype == dtype
                torch.testing.assert_close(out, expected(x, w, b), **tolerance(dtype))


def test_a_row_does_not_depend_on_the_others() -> None:
    """Bit for bit: a request's projection is the same alone or batched (up to 16 rows), so
    speculation's verify rows equal target-only's decode rows."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 130, generator=gen).to(DEVICE, torch.float16)
    w = (torch.randn(70, 130, generator=gen) / 12).to(DEVICE, torch.float16).t().contiguous().t()
    together = skinny_linear(x, w)
    for i in (0, 5, 15):
        assert torch.equal(skinny_linear(x[i : i + 1], w)[0], together[i])


def test_skinny_checks_its_inputs() -> None:
    x = torch.ones(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="expected"):
        skinny_linear(x, torch.ones(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        skinny_linear(x, torch.ones(4, 8, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, torch.ones(4, 8, device=DEVICE), torch.ones(5, device=DEVICE))
    bias = torch.arange(4.0, device=DEVICE)
    assert torch.equal(skinny_linear(x[:, :0], torch.ones(4, 0, device=DEVICE), bias)[1], bias)
    assert skinny_linear(x[:0], torch.ones(4, 8, device=DEVICE)).shape == (0, 4)


def test_linear_is_f_linear_off_the_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors, float32, more than MAX_ROWS rows or a weight stored [out, in]: cuBLAS (or
    the CPU) through ``F.linear``, bias included; the kernel is never called."""
    calls: list[int] = []
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a, **k: calls.append(1))
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(24, generator=gen)
    for rows, dtype in ((1, torch.float32), (17, torch.float16), (4, torch.float16)):
        x = torch.randn(rows, 40, generator=gen).to(dtype)
        w = torch.randn(24, 40, generator=gen).to(dtype)
        assert torch.equal(linear(x, w, bias.to(dtype)), F.linear(x, w, bias.to(dtype)))
    assert calls == []


@pytest.mark.gpu
def test_linear_takes_the_kernel_for_decode_batches_on_cuda() -> None:
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(6144, 4096, generator=gen) / 64).to("cuda", torch.bfloat16)
    w = w.t().contiguous().t()  # as DecoderLM.use_transposed_weights stores it
    bias = torch.randn(6144, generator=gen).to("cuda", torch.bfloat16)
    for rows in (1, 4, 16):
        x = torch.randn(rows, 4096, generator=gen).to("cuda", torch.bfloat16)
        ours = linear(x, w, bias)
        assert torch.equal(ours, skinny_linear(x, w, bias, **skinny._config(6144)))
        torch.testing.assert_close(ours, F.linear(x, w, bias), rtol=2e-2, atol=2e-2)
    x = torch.randn(17, 4096, generator=gen).to("cuda", torch.bfloat16)
    assert torch.equal(linear(x, w, bias), F.linear(x, w, bias))
