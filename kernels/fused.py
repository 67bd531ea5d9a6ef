"""Fused elementwise ops of a decoder layer: `rms_norm`, `add_rms_norm`, `rope`, `silu_mul`.
Torch twins (the eager formulas of `tandem/models/decoder.py`): `reference_fused.py`.

Eager torch runs RMSNorm as about 8 kernels, RoPE as about 5 per tensor and SiLU * up as 2;
at batch 1 inside a CUDA graph each still costs 2-3 us, so a layer's elementwise work cost more
than its GEMMs' memory time. Each op here is one launch (`rope` rotates q and k in one).

Numerics: the kernels repeat every rounding of the eager formulas. Torch computes each
elementwise op of a 16-bit tensor in float32 and rounds the result to the tensor's dtype; so do
these kernels, op for op (`_round`), and a product of two 16-bit values is exact in float32, so
its single rounding is the same as torch's. The transcendental functions are the ones torch's
CUDA kernels call: `rsqrt` (`rsqrt.approx.f32`, as `rsqrtf`) and libdevice `expf` (Triton's
`tl.exp` is a faster, less accurate `ex2.approx`), with IEEE division (`div_rn`); launches pass
`enable_fp_fusion=False` so no multiply-add is contracted into an FMA that eager torch, one
kernel per op, cannot form. Hence on CUDA, in every dtype:

- `rope`, `silu_mul`: bit-identical to the eager formulas.
- `rms_norm`, `add_rms_norm`: the residual sum is bit-identical; the sum of squares is reduced
  in another order than torch's reduction kernel, so the mean square may differ by float32
  rounding; everything after it (`* 1/H` as torch's CUDA mean does, `+ eps`, `rsqrt`, the
  products and roundings) follows the eager formula. Outputs agree exactly whenever the two mean
  squares do, else within about one rounding of the output dtype.

On CPU (Triton's interpreter, tests only) `exp` is numpy's and the mean square is reduced in
yet another order, so results agree with the references up to float rounding; the interpreter
computes bfloat16 wrongly, so interpreted tests use fp32/fp16.

Not in place: `add_rms_norm` writes a new residual rather than updating its input. In-place
saves no memory traffic (both read x and residual and write two rows), and the model keeps the
residual stream of captured layers (`DecoderLM.forward`'s `capture_layers`), which an in-place
update would overwrite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from kernels._launch import cdiv, expect_device, next_pow2
from kernels.reference_fused import check_norm, check_rope, check_silu_mul

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 4096  # elements one program of the norm / rope kernels holds (rows x hidden)
_MAX_HIDDEN = 65536  # a row is one register tile; a looped two-pass kernel would lift this
_SILU_BLOCK = 1024


@triton.jit
def _round(x: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
    """float32 `x` rounded to `dtype` (nearest even) and widened back: one eager op's result."""
    return x.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["num_rows"])  # per-step values: no recompiles
def _rms_norm_kernel(
    x_ptr: tl.tensor,  # [num_rows, hidden] (row stride x_stride, unit column stride)
    residual_ptr: tl.tensor,  # [num_rows, hidden] (ADD only)
    weight_ptr: tl.tensor,  # [hidden]
    out_ptr: tl.tensor,  # [num_rows, hidden] contiguous
    new_residual_ptr: tl.tensor,  # [num_rows, hidden] contiguous (ADD only)
    num_rows: tl.int64,
    hidden: tl.int64,
    x_stride: tl.int64,
    residual_stride: tl.int64,
    inv_hidden: tl.float32,
    eps: tl.float32,
    ADD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    dense = rows[:, None] * hidden + cols[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if ADD:
        r = tl.load(
            residual_ptr + rows[:, None] * residual_stride + cols[None, :], mask=mask, other=0.0
        )
        x = _round(r.to(tl.float32) + x, dtype)  # torch's `residual + x` in x's dtype
        tl.store(new_residual_ptr + dense, x.to(dtype), mask=mask)
    mean_sq = tl.sum(x * x, axis=1) * inv_hidden  # torch's CUDA mean: sum * (1 / hidden)
    y = _round(x * tl.math.rsqrt(mean_sq + eps)[:, None], dtype)  # x32 * rsqrt(...), .to(dtype)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + dense, (w[None, :] * y).to(dtype), mask=mask)  # weight * that


def _norm_launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> list[Tensor]:
    """Checks, flattens leading dimensions and launches; returns [normed] or [normed, new]."""
    names = {"x": x, "weight": weight} | ({} if residual is None else {"residual": residual})
    for name, t in names.items():
        expect_device(name, t, x.device)
        if t.dtype != x.dtype or x.dtype not in _DTYPES:
            raise ValueError(f"{name}: expected x's dtype, one of {_DTYPES}; got {t.dtype}")
    hidden = x.shape[-1]
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"x: hidden size {hidden} exceeds {_MAX_HIDDEN}")
    rows = x.reshape(-1, hidden)  # a view unless the leading dimensions cannot merge
    res = rows if residual is None else residual.reshape(-1, hidden)
    if rows.stride(1) != 1 or res.stride(1) != 1 or weight.stride(0) != 1:
        rows, res, weight = rows.contiguous(), res.contiguous(), weight.contiguous()
    num_outs = 1 if residual is None else 2
    outs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(num_outs)]
    num_rows = rows.shape[0]
    if num_rows == 0 or hidden == 0:
        return outs
    block = next_pow2(hidden)
    tile_rows = max(1, _TILE // block)  # not from num_rows: one compiled variant per width
    _rms_norm_kernel[(cdiv(num_rows, tile_rows),)](
        rows, res, weight, outs[0], outs[-1], num_rows, hidden, rows.stride(0), res.stride(0),
        1.0 / hidden, eps, ADD=residual is not None, ROWS=tile_rows, BLOCK=block,
        num_warps=min(16, max(1, tile_rows * block // 512)), enable_fp_fusion=False,
    )  # fmt: skip
    return outs


def rms_norm(
    x: Tensor,  # [num_tokens, hidden] (any leading dimensions; unit column stride avoids a copy)
    weight: Tensor,  # [hidden], x's dtype
    eps: float,
) -> Tensor:  # [num_tokens, hidden] new, contiguous
    """`rms_norm_ref` in one launch (module docstring: exact up to the sum-of-squares order)."""
    check_norm(x, weight)
    (out,) = _norm_launch(x, None, weight, eps)
    return out


def add_rms_norm(
    x: Tensor,  # [num_tokens, hidden], the sublayer's output
    residual: Tensor,  # [num_tokens, hidden], x's dtype
    weight: Tensor,  # [hidden], x's dtype
    eps: float,
) -> tuple[Tensor, Tensor]:  # normed, new_residual: [num_tokens, hidden] each, new tensors
    """`add_rms_norm_ref` in one launch: the sum is bit-identical, the norm as `rms_norm`.
    Writes new outputs and leaves `residual` as it is (module docstring)."""
    check_norm(x, weight, residual)
    normed, new_residual = _norm_launch(x, residual, weight, eps)
    return normed, new_residual


@triton.jit
def _rope_heads(
    src_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim] (strides stride_t, stride_h, 1)
    dst_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim] contiguous
    token: tl.tensor,  # int64
    tile: tl.tensor,
    num_heads: tl.tensor,
    stride_t: tl.tensor,
    stride_h: tl.tensor,
    head_dim: tl.tensor,
    cos: tl.tensor,  # [BLOCK_D] float32
    sin: tl.tensor,  # [BLOCK_D] float32
    HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    dtype: tl.constexpr = dst_ptr.dtype.element_ty
    half = head_dim // 2
    heads = tile.to(tl.int64) * HEADS + tl.arange(0, HEADS)
    cols = tl.arange(0, BLOCK_D)
    partner = tl.where(cols < half, cols + half, cols - half)
    mask = (heads < num_heads)[:, None] & (cols < head_dim)[None, :]
    row = src_ptr + token * stride_t + heads[:, None] * stride_h
    x = tl.load(row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where((cols < half)[None, :], -xp, xp)  # cat(-x2, x1): negation is exact
    out = _round(x * cos[None, :], dtype) + _round(rotated * sin[None, :], dtype)
    dense = (token * num_heads + heads[:, None]) * head_dim + cols[None, :]
    tl.store(dst_ptr + dense, out.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim], unit stride along head_dim
    k_ptr: tl.tensor,  # [num_tokens, num_kv_heads, head_dim], unit stride along head_dim
    cos_ptr: tl.tensor,  # [num_tokens, head_dim], unit column stride
    sin_ptr: tl.tensor,  # [num_tokens, head_dim], unit column stride
    q_out_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim] contiguous
    k_out_ptr: tl.tensor,  # [num_tokens, num_kv_heads, head_dim] contiguous
    num_heads: tl.int64,
    num_kv_heads: tl.int64,
    head_dim: tl.int64,
    q_stride_t: tl.int64,
    q_stride_h: tl.int64,
    k_stride_t: tl.int64,
    k_stride_h: tl.int64,
    cos_stride: tl.int64,
    sin_stride: tl.int64,
    num_q_tiles: tl.int32,
    HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    """Grid (num_tokens, q head tiles + k head tiles): one tile of one token's heads."""
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + token * cos_stride + cols, mask=cols < head_dim, other=0.0)
    sin = tl.load(sin_ptr + token * sin_stride + cols, mask=cols < head_dim, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    if tile < num_q_tiles:
        _rope_heads(q_ptr, q_out_ptr, token, tile, num_heads, q_stride_t, q_stride_h, head_dim,
                    cos, sin, HEADS, BLOCK_D)  # fmt: skip
    else:
        _rope_heads(k_ptr, k_out_ptr, token, tile - num_q_tiles, num_kv_heads, k_stride_t,
                    k_stride_h, head_dim, cos, sin, HEADS, BLOCK_D)  # fmt: skip


def rope(
    q: Tensor,  # [num_tokens, num_heads, head_dim] (a view of a fused QKV output is fine)
    k: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: Tensor,  # [num_tokens, head_dim], q's dtype
    sin: Tensor,  # [num_tokens, head_dim], q's dtype
) -> tuple[Tensor, Tensor]:  # q_out, k_out: new contiguous tensors of q's and k's shapes
    """`rope_ref` on q and k in one launch, bit-identical. q and k may be strided views (the
    split of a fused QKV projection) as long as head_dim has unit stride; else they are copied."""
    check_rope(q, k, cos, sin)
    for name, t in {"q": q, "k": k, "cos": cos, "sin": sin}.items():
        expect_device(name, t, q.device)
        if t.dtype != q.dtype or q.dtype not in _DTYPES:
            raise ValueError(f"{name}: expected q's dtype, one of {_DTYPES}; got {t.dtype}")
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0 or head_dim == 0:
        return q_out, k_out
    block_d = next_pow2(head_dim)
    heads = max(1, min(next_pow2(max(num_heads, num_kv_heads)), _TILE // block_d))
    q_tiles, k_tiles = cdiv(num_heads, heads), cdiv(num_kv_heads, heads)
    _rope_kernel[(num_tokens, q_tiles + k_tiles)](
        q, k, cos, sin, q_out, k_out, num_heads, num_kv_heads, head_dim, q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), q_tiles,
        HEADS=heads, BLOCK_D=block_d, num_warps=min(8, max(1, heads * block_d // 256)),
        enable_fp_fusion=False,
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr: tl.tensor,  # [num_tokens, 2 * inter] (row stride `stride`, unit columns)
    out_ptr: tl.tensor,  # [num_tokens, inter] contiguous
    inter: tl.int64,
    stride: tl.int64,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # False in the interpreter, which has no libdevice
) -> None:
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + token * stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + token * stride + inter + cols, mask=mask, other=0.0)
    e = libdevice.exp(-gate) if LIBDEVICE else tl.exp(-gate)  # libdevice: expf, as torch's
    silu = _round(tl.math.div_rn(gate, 1.0 + e), dtype)  # F.silu: x / (1 + exp(-x)), rounded
    tl.store(out_ptr + token * inter + cols, (silu * up.to(tl.float32)).to(dtype), mask=mask)


def silu_mul(gate_up: Tensor) -> Tensor:  # [num_tokens, 2 * inter] -> [num_tokens, inter]
    """`silu_mul_ref` in one launch, bit-identical on CUDA. `gate_up` may have any row stride
    (unit column stride avoids a copy); the output is new and contiguous."""
    check_silu_mul(gate_up)
    if gate_up.dtype not in _DTYPES:
        raise ValueError(f"gate_up: expected a dtype in {_DTYPES}, got {gate_up.dtype}")
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0 or inter == 0:
        return out
    block = min(_SILU_BLOCK, next_pow2(inter))
    _silu_mul_kernel[(rows.shape[0], cdiv(inter, block))](
        rows, out, inter, rows.stride(0), BLOCK=block,
        LIBDEVICE=not isinstance(_silu_mul_kernel, InterpretedFunction),
        num_warps=max(1, min(4, block // 256)), enable_fp_fusion=False,
    )  # fmt: skip
    return out
