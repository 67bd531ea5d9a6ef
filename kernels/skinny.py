"""`linear`: ``F.linear(x, weight, bias)`` with the rows of small decode batches (at most
``MAX_ROWS``, bf16/fp16) through `skinny_linear`, the rest through cuBLAS; with
``batch_invariant``, every CUDA batch through `skinny_linear` (below). Torch twin: `linear_ref`
(``F.linear``).

`skinny_linear`: ``x @ weight.T`` for a few rows of ``x`` (decode: one row per request), one
memory-bound pass over the weight with fp32 accumulation and one rounding to the output dtype,
and no split-K reduction kernel. On an H100 at one row (bench/skinny_sweep.py, 8B shapes, us
per call against cuBLAS): qkv 19.4 / 21.4, o_proj 13.8 / 14.1, gate_up 78.2 / 79.4, down
40.9 / 42.3. A row's result does not depend on the other rows (up to ``MAX_ROWS``).

Grid (row tiles of 16, output column tiles): past 16 rows, the row tiles of one column tile
launch side by side and share its weight reads through L2. Each program streams its
``BLOCK_N`` weight columns through ``BLOCK_K`` steps and multiplies with ``tl.dot`` (rows
padded to 16: the tensor cores idle, the weight reads bound the time). The weight may be
stored either way (``[out, in]`` row-major, or the transpose of a row-major ``[in, out]``,
``DecoderLM.use_transposed_weights``): loads follow its strides.

Batch invariance: a row's sums run in one order (``BLOCK_K`` steps of one ``tl.dot`` shape,
tiles chosen from the weight's shape alone), whatever the other rows are and however many, so
a row's output is bit-identical at any batch size. cuBLAS picks other tiles and split-K for
other row counts, so a token verified among S+1 rows and decoded alone can differ in the last
bits. ``linear(..., batch_invariant=True)`` therefore sends every batch here (prefill too, at
tensor-core tiles of 16 rows: the price of the mode; EngineConfig.batch_invariant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels._launch import cdiv, expect_device

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SKINNY_DTYPES = (torch.float16, torch.bfloat16)  # what ``linear`` sends to the kernel
BLOCK_M = 16
MAX_ROWS = BLOCK_M  # more rows read the weight once per 16: cuBLAS from there


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, batch_invariant: bool = False
) -> Tensor:
    """``F.linear`` (`linear_ref`); 2-D bf16/fp16 inputs of at most ``MAX_ROWS`` rows run
    `skinny_linear` with tiles chosen for the weight's shape. With ``batch_invariant``, every
    2-D CUDA input of one float dtype with its weight (any rows, any weight layout) does."""
    if batch_invariant and _invariant_path(x, weight):
        return skinny_linear(x, weight, bias, **invariant_config(weight.shape[0], x.dtype))
    if x.dim() != 2 or x.dtype not in _SKINNY_DTYPES or not 0 < x.shape[0] <= MAX_ROWS:
        return F.linear(x, weight, bias)
    if weight.dtype != x.dtype or not x.is_cuda or weight.stride(0) != 1:
        # Only weights stored transposed (the target's, DecoderLM.use_transposed_weights): the
        # layout the tiles were measured on.
        return F.linear(x, weight, bias)
    return skinny_linear(x, weight, bias, **_config(weight.shape[0]))


def _invariant_path(x: Tensor, weight: Tensor) -> bool:
    return x.dim() == 2 and x.is_cuda and x.dtype in _DTYPES and weight.dtype == x.dtype


def invariant_config(n: int, dtype: torch.dtype) -> dict[str, int]:
    """`linear`'s tiles under ``batch_invariant``: `_config`'s (the sums' order), with fewer
    pipeline stages for float32 (twice the bytes a stage: the others overflow shared memory)."""
    config = _config(n)
    if dtype == torch.float32:
        config["num_stages"] = 2
    return config


def _config(n: int) -> dict[str, int]:
    """Tiles for ``n`` output columns (the fastest of bench/skinny_sweep.py on an H100)."""
    if n >= 16384:  # gate_up
        return {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}
    if n <= 4096:  # o_proj, down
        return {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 6}
    return {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 6}  # qkv


@triton.jit(do_not_specialize=["num_rows"])  # per-step values: no recompiles
def _skinny_kernel(  # type: ignore[no-untyped-def]  # ints unannotated: specialised
    x_ptr: tl.tensor,  # [num_rows, K]
    w_ptr: tl.tensor,  # [N, K] (any strides)
    bias_ptr: tl.tensor,  # [N] (read only with HAS_BIAS)
    y_ptr: tl.tensor,  # [num_rows, N] contiguous
    num_rows: tl.int64,
    n,  # unannotated: Triton specialises ints of 1 and multiples of 16 (vector loads)
    k,
    x_stride,
    w_stride_n,
    w_stride_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
) -> None:
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + inner
        x = tl.load(
            x_ptr + rows[:, None] * x_stride + kk[None, :],
            mask=(rows < num_rows)[:, None] & (kk < k)[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + kk[:, None] * w_stride_k + cols[None, :] * w_stride_n,
            mask=(kk < k)[:, None] & (cols < n)[None, :],
            other=0.0,
        )
        acc = tl.dot(x, w, acc, input_precision="ieee")  # fp32: no TF32 rounding
    if HAS_BIAS:  # added before the one rounding, as cuBLAS's epilogue does
        acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * n + cols[None, :]
    tl.store(
        out, acc.to(y_ptr.dtype.element_ty), mask=(rows < num_rows)[:, None] & (cols < n)[None, :]
    )


def skinny_linear(
    x: Tensor,  # [num_rows, K]
    weight: Tensor,  # [N, K]
    bias: Tensor | None = None,  # [N]
    *,
    block_n: int = 32,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 4,
) -> Tensor:  # [num_rows, N], x's dtype
    """``x @ weight.T + bias``, one rounding; ``x``'s rows need unit stride along K."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: expected [M, K], [N, K]"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"x, weight: expected one dtype of {_DTYPES}; got {x.dtype}, {weight.dtype}"
        )
    expect_device("weight", weight, x.device)
    if bias is not None:
        if bias.shape != (weight.shape[0],) or bias.dtype != x.dtype:
            raise ValueError(
                f"bias {tuple(bias.shape)} {bias.dtype}: expected ({weight.shape[0]},) {x.dtype}"
            )
        expect_device("bias", bias, x.device)
        bias = bias.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    num_rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(num_rows, n))
    grid = (cdiv(num_rows, BLOCK_M), cdiv(n, block_n))
    _skinny_kernel[grid](
        x, weight, weight if bias is None else bias, y, num_rows, n, k,
        x.stride(0), weight.stride(0), weight.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return y
