"""Torch references of the fused decoder-layer ops in `fused.py`: RMSNorm, residual add + RMSNorm,
rotate-half RoPE on q and k, SiLU(gate) * up; and of the projections (`skinny.py`: linear).

These are the eager formulas `tandem/models/decoder.py` has always run, op for op, so the CPU
path (and every CUDA path the Triton kernels do not take: autograd, autocast) computes exactly
what it computed before the kernels existed. In a 16-bit dtype every op rounds its result to
that dtype (torch computes each elementwise op in float32 and rounds once); the kernels
reproduce those roundings. Shapes accept any leading dimensions; the kernels take the 2-D/3-D
forms the signatures name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_ref(
    x: Tensor,  # [num_tokens, hidden]
    weight: Tensor,  # [hidden]
    eps: float,
) -> Tensor:  # [num_tokens, hidden]
    """RMS norm in float32, cast back to x's dtype before the weight (as transformers does)."""
    check_norm(x, weight)
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm_ref(
    x: Tensor,  # [num_tokens, hidden], the sublayer's output
    residual: Tensor,  # [num_tokens, hidden], the residual stream before it
    weight: Tensor,  # [hidden]
    eps: float,
) -> tuple[Tensor, Tensor]:  # normed, new_residual: [num_tokens, hidden] each
    """`new_residual = residual + x` (in their dtype) and `rms_norm_ref(new_residual)`."""
    check_norm(x, weight, residual)
    new_residual = residual + x
    return rms_norm_ref(new_residual, weight, eps), new_residual


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x [num_tokens, heads, head_dim]; cos/sin [num_tokens, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_ref(
    q: Tensor,  # [num_tokens, num_heads, head_dim]
    k: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: Tensor,  # [num_tokens, head_dim]
    sin: Tensor,  # [num_tokens, head_dim]
) -> tuple[Tensor, Tensor]:  # q_out, k_out: q's and k's shapes
    """Rotate-half RoPE: `x * cos + cat(-x2, x1) * sin` with x = (x1, x2) split in halves."""
    check_rope(q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def linear_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, batch_invariant: bool = False
) -> Tensor:
    """``F.linear``: what every projection computes off the GPU. ``batch_invariant`` is the
    kernel's (`kernels.skinny.linear`); torch's CPU GEMMs do not promise it."""
    del batch_invariant
    return F.linear(x, weight, bias)


def silu_mul_ref(gate_up: Tensor) -> Tensor:  # [num_tokens, 2 * inter] -> [num_tokens, inter]
    """`silu(gate) * up` with gate the first half of the last dimension, up the second."""
    check_silu_mul(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def check_norm(x: Tensor, weight: Tensor, residual: Tensor | None = None) -> None:
    """The shape contract of `rms_norm` / `add_rms_norm` (references and kernels)."""
    if x.dim() < 1:
        raise ValueError("x: expected [num_tokens, hidden], got a scalar")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight: expected shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"residual: expected x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )


def check_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """The shape contract of `rope` (references and kernels)."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q: head_dim {head_dim} is odd (rotate-half needs two halves)")
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(
            f"k: expected [{num_tokens}, num_kv_heads, {head_dim}], got {tuple(k.shape)}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (num_tokens, head_dim):
            raise ValueError(f"{name}: expected ({num_tokens}, {head_dim}), got {tuple(t.shape)}")


def check_silu_mul(gate_up: Tensor) -> None:
    """The shape contract of `silu_mul` (references and kernels)."""
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: expected an even last dimension, got {tuple(gate_up.shape)}")
