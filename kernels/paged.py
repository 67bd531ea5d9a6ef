"""`paged_inputs` (torch twin: `paged_inputs_ref` in `reference_paged.py`): a graph bucket's
per-step inputs computed on the device from each row's base, in one launch per bucket instead
of a dozen elementwise kernels (a device-chain step writes them for the target's verify, the
draft's extend and each draft-loop step: about 100 one-microsecond kernels a cycle before).

Grid (bs,): a program owns one row (its ``w`` tokens, their slots and mask rows, its lengths).
Index math in int64 (kernels.md, the offset trap). No host sync; a page index past the table
is clamped as the reference clamps it (only tokens that are not kept can reach one).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kernels._launch import expect_device, next_pow2
from kernels.reference_paged import check_paged_inputs


@triton.jit
def _paged_inputs_kernel(  # type: ignore[no-untyped-def]  # ints unannotated: specialised
    base_ptr: tl.tensor,  # [bs] int64
    accepted_ptr: tl.tensor,  # [bs] int64 (read only with PREFIX_ACC or COUNT_ACC)
    alive_ptr: tl.tensor,  # [bs] bool
    table_ptr: tl.tensor,  # [bs, max_pages] int32
    slot_ptr: tl.tensor,  # [bs * w]
    seq_ptr: tl.tensor,  # [bs]
    prefix_ptr: tl.tensor,  # [bs]
    pos_ptr: tl.tensor,  # [bs * w] (written only with HAS_POS)
    src_ptr: tl.tensor,  # [bs * w, WORDS] int64 (read only with HAS_MASK)
    dst_ptr: tl.tensor,  # [bs * w, WORDS] int64 (written only with HAS_MASK)
    table_stride: tl.int64,
    max_pages: tl.int64,
    page_size: tl.int64,
    shift: tl.int64,
    offset: tl.int64,
    w,
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    PREFIX_ACC: tl.constexpr,
    COUNT_ACC: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_MASK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    alive = tl.load(alive_ptr + row) != 0
    prefix = tl.load(base_ptr + row) + shift
    if PREFIX_ACC or COUNT_ACC:
        accepted = tl.load(accepted_ptr + row)
    if PREFIX_ACC:
        prefix += accepted
    count = accepted + 1 if COUNT_ACC else w + tl.zeros_like(prefix)
    j = tl.arange(0, BLOCK_W).to(tl.int64)
    in_row = j < w
    index = prefix + offset + j
    keep = in_row & (j < count) & alive
    page_index = tl.minimum(tl.maximum(index // page_size, 0), max_pages - 1)
    page = tl.load(table_ptr + row * table_stride + page_index, mask=in_row, other=0).to(tl.int64)
    slot = tl.where(keep, page * page_size + index % page_size, -1)
    tl.store(slot_ptr + row * w + j, slot.to(slot_ptr.dtype.element_ty), mask=in_row)
    live = alive.to(tl.int64)
    tl.store(seq_ptr + row, ((prefix + offset + count) * live).to(seq_ptr.dtype.element_ty))
    tl.store(prefix_ptr + row, (prefix * live).to(prefix_ptr.dtype.element_ty))
    if HAS_POS:
        tl.store(pos_ptr + row * w + j, index.to(pos_ptr.dtype.element_ty), mask=in_row)
    if HAS_MASK:
        words = tl.arange(0, BLOCK_WORDS).to(tl.int64)
        cell = in_row[:, None] & (words < WORDS)[None, :]
        at = (row * w + j)[:, None] * WORDS + words[None, :]
        bits = tl.load(src_ptr + at, mask=cell, other=0)
        tl.store(dst_ptr + at, tl.where(keep[:, None], bits, 0), mask=cell)


def paged_inputs(
    base: Tensor,
    accepted: Tensor | None,
    alive: Tensor,
    page_table: Tensor,
    slot_mapping: Tensor,
    seq_lens: Tensor,
    prefix_lens: Tensor,
    positions: Tensor | None = None,
    mask_src: Tensor | None = None,
    mask_dst: Tensor | None = None,
    *,
    page_size: int,
    shift: int = 0,
    offset: int = 0,
    prefix_accepted: bool = False,
    count_accepted: bool = False,
) -> None:
    """`paged_inputs_ref` on the GPU, one program a row; every output must be contiguous."""
    w = check_paged_inputs(
        base, accepted, alive, page_table, slot_mapping, seq_lens, prefix_lens, positions,
        mask_src, mask_dst, page_size=page_size, needs_accepted=prefix_accepted or count_accepted,
    )  # fmt: skip
    outputs = {"slot_mapping": slot_mapping, "seq_lens": seq_lens, "prefix_lens": prefix_lens}
    inputs = {"accepted": accepted, "alive": alive, "page_table": page_table}
    extra = {"positions": positions, "mask_src": mask_src, "mask_dst": mask_dst}
    for name, t in {**outputs, **inputs, **extra}.items():
        if t is not None:
            expect_device(name, t, base.device)
    for name, t in {**outputs, **extra}.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    if page_table.stride(1) != 1:
        raise ValueError("page_table: expected unit stride along the pages")
    words = 1 if mask_src is None else mask_src.shape[1]
    _paged_inputs_kernel[(base.shape[0],)](
        base, base if accepted is None else accepted, alive, page_table,
        slot_mapping, seq_lens, prefix_lens,
        slot_mapping if positions is None else positions,
        base if mask_src is None else mask_src, base if mask_dst is None else mask_dst,
        page_table.stride(0), page_table.shape[1], page_size, shift, offset, w,
        WORDS=words, BLOCK_W=next_pow2(w), BLOCK_WORDS=next_pow2(words),
        PREFIX_ACC=prefix_accepted, COUNT_ACC=count_accepted,
        HAS_POS=positions is not None, HAS_MASK=mask_src is not None,
    )  # fmt: skip
