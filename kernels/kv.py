"""Writes into the paged KV pool (kernels.md sections 1.7 and 4): `store_kv` (new tokens' K/V
to their slots) and `compact_accepted` (accepted nodes' KV to contiguous slots). Torch twins:
`store_kv_ref`, `compact_accepted_ref` in `reference.py`.

`store_kv`: grid (num_tokens, row tiles); a token whose slot lies outside the pool (-1 marks a
padding token of a graph bucket) writes nothing, where the reference raises. No host sync.

`compact_accepted`: sources and destinations overlap (path [0, 2, 3] moves 2 -> 1 and 3 -> 2),
so a program owns one column tile of one cache for every pair: it loads all its sources, waits
at a barrier, then stores (the reference's gather-then-scatter). Programs never share an
element, so no ordering between programs is needed. Caches of one dtype and row size go in one
launch, addressed as element offsets from the lowest of their base pointers.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._launch import cdiv, checks_values, expect_device, next_pow2, size_block
from kernels.reference import _check_compact, _check_store_kv

_STORE_BLOCK = 1024
_TILE_ELEMENTS = 4096  # pairs x columns one compaction program holds in registers


@triton.jit
def _store_kv_kernel(
    k_ptr: tl.tensor,  # [num_tokens, row] (row = num_kv_heads * head_dim, unit stride)
    v_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,  # [num_slots, row]
    v_cache_ptr: tl.tensor,
    slot_mapping_ptr: tl.tensor,  # [num_tokens] int64
    k_stride: tl.int64,
    v_stride: tl.int64,
    num_slots: tl.int64,
    row: tl.int64,
    BLOCK: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_mapping_ptr + token)
    ok = tl.where((slot >= 0) & (slot < num_slots), cols < row, False)
    k = tl.load(k_ptr + token * k_stride + cols, mask=ok)
    v = tl.load(v_ptr + token * v_stride + cols, mask=ok)
    tl.store(k_cache_ptr + slot * row + cols, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + slot * row + cols, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def _rows(t: Tensor) -> Tensor:
    """`t` [num_tokens, H, D] with each token's H x D row contiguous (a copy otherwise): a
    slice of a fused QKV projection passes as it is."""
    return t if t[0].is_contiguous() else t.contiguous()


def store_kv(
    k: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_mapping: Tensor,  # [num_tokens] int64
) -> None:
    """`store_kv_ref` on the GPU: each token's K/V into its slot, in the caches' dtype; tokens
    whose slot is outside [0, num_slots) are skipped."""
    _check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    others = {"v": v, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    for name, t in others.items():
        expect_device(name, t, k.device)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache, v_cache: expected contiguous pools")
    num_tokens, heads, dim = k.shape
    if num_tokens == 0:
        return
    k, v = _rows(k), _rows(v)
    row = heads * dim
    block = min(_STORE_BLOCK, next_pow2(row))
    _store_kv_kernel[(num_tokens, cdiv(row, block))](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), k.stride(0), v.stride(0),
        k_cache.shape[0], row, BLOCK=block,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])  # per-step values: no recompiles
def _compact_kernel(
    base_ptr: tl.tensor,  # the group's cache with the lowest address
    offsets_ptr: tl.tensor,  # [num_caches] int64 element offset of each cache from base_ptr
    src_ptr: tl.tensor,  # [M] int64
    dst_ptr: tl.tensor,  # [M] int64
    num_pairs: tl.int64,
    num_slots: tl.int64,
    row: tl.int64,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    cache = base_ptr + tl.load(offsets_ptr + tl.program_id(0))
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    pairs = tl.arange(0, BLOCK_M)
    live = pairs < num_pairs
    src = tl.load(src_ptr + pairs, mask=live, other=0)
    dst = tl.load(dst_ptr + pairs, mask=live, other=0)
    move = live & (src != dst) & (src >= 0) & (src < num_slots) & (dst >= 0) & (dst < num_slots)
    cell = move[:, None] & (cols < row)[None, :]
    values = tl.load(cache + src[:, None] * row + cols[None, :], mask=cell)
    tl.debug_barrier()  # every load of this tile lands before any store
    tl.store(cache + dst[:, None] * row + cols[None, :], values, mask=cell)


@lru_cache(maxsize=64)
def _offsets(pointers: tuple[int, ...], itemsize: int, device: torch.device) -> Tensor:
    """[num_caches] int64 element offsets from the lowest pointer (cached: pools stay put)."""
    base = min(pointers)
    return torch.tensor([(p - base) // itemsize for p in pointers], device=device)


def compact_accepted(caches: list[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    """`compact_accepted_ref` on the GPU: `cache[dst] = cache[src]` for every cache
    [num_slots, ...] and pair of `src_slots`, `dst_slots` [M] int64, load-all-then-store."""
    _check_compact(caches, src_slots, dst_slots, values=checks_values(src_slots))
    num_pairs = src_slots.shape[0]
    if num_pairs == 0 or not caches:
        return
    groups: dict[tuple[torch.dtype, int, int], list[Tensor]] = {}
    for layer, cache in enumerate(caches):
        expect_device(f"caches[{layer}]", cache, src_slots.device)
        if not cache.is_contiguous():
            raise ValueError(f"caches[{layer}]: expected a contiguous tensor")
        row = cache.numel() // len(cache) if len(cache) else 0
        groups.setdefault((cache.dtype, len(cache), row), []).append(cache)
    pointers = [c.data_ptr() for c in caches if c.numel()]
    if len(set(pointers)) != len(pointers):
        raise ValueError("caches: a tensor appears twice (its pairs would move twice)")
    src, dst = src_slots.contiguous(), dst_slots.contiguous()
    block_m = size_block(num_pairs, 64)  # one program holds every pair (load all, then store)
    for (_, num_slots, row), group in groups.items():
        if num_slots == 0 or row == 0:
            continue
        group_pointers = tuple(c.data_ptr() for c in group)
        base = group[group_pointers.index(min(group_pointers))]
        offsets = _offsets(group_pointers, base.element_size(), base.device)
        block_d = max(1, min(next_pow2(row), _TILE_ELEMENTS // block_m))
        _compact_kernel[(len(group), cdiv(row, block_d))](
            base, offsets, src, dst, num_pairs, num_slots, row,
            BLOCK_M=block_m, BLOCK_D=block_d,
        )  # fmt: skip
