"""Triton kernels (GPU path), each with a torch reference of the same signature in reference.py
(reference_fused.py for the fused decoder-layer ops, reference_attention.py for attention).

`ops(device)` picks an implementation of every op for a device: the Triton kernels on CUDA
(when triton is installed), the references elsewhere. Triton is imported on first use of the
kernels only, so a CPU-only install without triton runs the references. Tests run the kernels
on CPU tensors through Triton's interpreter by calling `triton_ops()` with `TRITON_INTERPRET=1`
set before the first kernel module is imported (`tests/kernels/_interpret.py`).

Contracts (argument names and order, outputs, validation errors) are the references'; where a
kernel departs from its reference, its wrapper's docstring says how.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from kernels._launch import trusted_values as trusted_values  # re-exported
from kernels.reference import (
    accepted_slots_ref,
    build_tree_ref,
    compact_accepted_ref,
    sample_ref,
    store_kv_ref,
    top1_ref,
    topk_ref,
    verify_greedy_ref,
    verify_sampling_ref,
)
from kernels.reference_fused import (
    add_rms_norm_ref,
    linear_ref,
    rms_norm_ref,
    rope_ref,
    silu_mul_ref,
)
from kernels.reference_paged import paged_inputs_ref

_Triple = tuple[Tensor, Tensor, Tensor]
_Pair = tuple[Tensor, Tensor]


@dataclass(frozen=True, kw_only=True)
class Ops:
    """One implementation of every op; each field has its reference's signature."""

    name: str  # "reference" or "triton"
    top1: Callable[..., _Triple]  # top1_ref
    topk: Callable[..., _Triple]  # topk_ref
    sample: Callable[[Tensor, Tensor, Tensor], Tensor]  # sample_ref
    build_tree: Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor, Tensor]]
    verify_greedy: Callable[..., _Triple]  # verify_greedy_ref
    verify_sampling: Callable[..., _Triple]  # verify_sampling_ref
    accepted_slots: Callable[..., tuple[Tensor, Tensor]]  # accepted_slots_ref
    compact_accepted: Callable[[list[Tensor], Tensor, Tensor], None]  # compact_accepted_ref
    store_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]  # store_kv_ref
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]  # rms_norm_ref
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], _Pair]  # add_rms_norm_ref
    rope: Callable[[Tensor, Tensor, Tensor, Tensor], _Pair]  # rope_ref
    silu_mul: Callable[[Tensor], Tensor]  # silu_mul_ref
    linear: Callable[..., Tensor]  # linear_ref
    paged_inputs: Callable[..., None]  # paged_inputs_ref


REFERENCE = Ops(
    name="reference",
    top1=top1_ref,
    topk=topk_ref,
    sample=sample_ref,
    build_tree=build_tree_ref,
    verify_greedy=verify_greedy_ref,
    verify_sampling=verify_sampling_ref,
    accepted_slots=accepted_slots_ref,
    compact_accepted=compact_accepted_ref,
    store_kv=store_kv_ref,
    rms_norm=rms_norm_ref,
    add_rms_norm=add_rms_norm_ref,
    rope=rope_ref,
    silu_mul=silu_mul_ref,
    linear=linear_ref,
    paged_inputs=paged_inputs_ref,
)


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@cache
def triton_ops() -> Ops:
    """The Triton kernels (imports triton and defines the kernels on the first call)."""
    from kernels.fused import add_rms_norm, rms_norm, rope, silu_mul
    from kernels.kv import compact_accepted, store_kv
    from kernels.paged import paged_inputs
    from kernels.sample import sample
    from kernels.skinny import linear
    from kernels.top1 import top1, topk
    from kernels.tree import accepted_slots, build_tree, verify_greedy, verify_sampling

    return Ops(
        name="triton",
        top1=top1,
        topk=topk,
        sample=sample,
        build_tree=build_tree,
        verify_greedy=verify_greedy,
        verify_sampling=verify_sampling,
        accepted_slots=accepted_slots,
        compact_accepted=compact_accepted,
        store_kv=store_kv,
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        rope=rope,
        silu_mul=silu_mul,
        linear=linear,
        paged_inputs=paged_inputs,
    )


def uses_triton(device: torch.device | str) -> bool:
    """Whether `ops(device)` gives the Triton kernels: CUDA devices with triton installed."""
    return torch.device(device).type == "cuda" and triton_available()


def ops(device: torch.device | str) -> Ops:
    """The kernels for `device`: Triton on CUDA, the torch references elsewhere."""
    return triton_ops() if uses_triton(device) else REFERENCE
