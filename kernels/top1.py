"""Fused argmax + log-softmax of the best tokens (kernels.md section 2): `top1` and `topk`.
Torch twins: `top1_ref`, `topk_ref` in `reference.py`.

The vocabulary is split so that a small batch still fills the GPU. Stage 1, grid
(rows, num_splits): a program walks its chunk in tiles with a running max, the sum of exp(x - max)
rescaled whenever the max grows, the first index of the max, and a count of NaN/+inf entries
(which then count as -inf). Stage 2, grid (rows,): merges the splits: the global max, the lowest
index reaching it (splits are in vocabulary order), the rescaled sums. One split (large batches)
writes the result from stage 1.

`topk` keeps, per split, the k best (value, index) pairs in descending value and ascending index
order, found in k rounds over the chunk (round r takes the best entry after round r-1's in that
order), and stage 2 runs the same rounds over the splits' candidates. Grids and splits come from
shapes only: no host sync, so the launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._launch import cdiv, next_pow2
from kernels.reference import _check_k, _check_logits, topk_ref

_BLOCK = 1024  # vocabulary tile: 8 bf16 per thread with 4 warps
# Enough programs to cover the SMs several times at batch 1 (kernels.md's H200 sweep: 128
# splits at 1 row, 32 at 64 rows); a large batch gets one program per row.
_TARGET_PROGRAMS = 2048
_TOPK_MAX = 32  # larger k: the reference's sort, which is faster there than k rounds
_MAX_CANDIDATES = 4096  # splits * k read by one topk merge program
_NO_INDEX = tl.constexpr(2**63 - 1)  # sorts after every real index


@triton.jit(do_not_specialize=["num_splits"])  # chunk stays specialised: aligned loads
def _top1_partial_kernel(
    logits_ptr: tl.tensor,  # [R, V], unit stride along V
    part_m_ptr: tl.tensor,  # [R, num_splits] fp32 chunk max
    part_d_ptr: tl.tensor,  # [R, num_splits] fp32 sum of exp(x - chunk max)
    part_idx_ptr: tl.tensor,  # [R, num_splits] int64 first index of the chunk max
    part_bad_ptr: tl.tensor,  # [R, num_splits] int32 NaN/+inf count
    ids_ptr: tl.tensor,  # [R] int64 (SINGLE)
    logprob_ptr: tl.tensor,  # [R] fp32 (SINGLE)
    valid_ptr: tl.tensor,  # [R] bool (SINGLE)
    vocab: tl.int64,
    row_stride: tl.int64,
    chunk: tl.int64,
    num_splits: tl.int64,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    row_ptr = logits_ptr + row * row_stride
    lanes = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    d = tl.full([], 0.0, tl.float32)
    idx = tl.full([], 0, tl.int64)
    bad = tl.full([], 0, tl.int32)
    for off in range(start, end, BLOCK):
        offs = off + lanes
        # Masked lanes are -inf: they can tie an all -inf tile but never beat the max.
        x = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        # Explicit NaN test: compiled tl.max skips NaN (vLLM #21876).
        broken = (x != x) | (x == float("inf"))
        bad += tl.sum(broken.to(tl.int32), axis=0)
        x = tl.where(broken, float("-inf"), x)
        tile_max = tl.max(x, axis=0)
        tile_arg = tl.min(tl.where(x == tile_max, offs, vocab), axis=0)
        m_new = tl.maximum(m, tile_max)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)  # exp(-inf - -inf) would be NaN
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        idx = tl.where(tile_max > m, tile_arg, idx)  # strictly greater: first index wins ties
        m = m_new
    if SINGLE:
        valid = (m > float("-inf")) & (bad == 0)
        tl.store(ids_ptr + row, tl.where(valid, idx, 0))
        log_d = tl.log(tl.where(valid, d, 1.0))  # d = 0 in an invalid row
        tl.store(logprob_ptr + row, tl.where(valid, -log_d, float("-inf")))
        tl.store(valid_ptr + row, valid)
    else:
        at = row * num_splits + split
        tl.store(part_m_ptr + at, m)
        tl.store(part_d_ptr + at, d)
        tl.store(part_idx_ptr + at, idx)
        tl.store(part_bad_ptr + at, bad)


@triton.jit(do_not_specialize=["num_splits"])  # per-step values: no recompiles
def _top1_merge_kernel(
    part_m_ptr: tl.tensor,
    part_d_ptr: tl.tensor,
    part_idx_ptr: tl.tensor,
    part_bad_ptr: tl.tensor,
    ids_ptr: tl.tensor,  # [R] int64
    logprob_ptr: tl.tensor,  # [R] fp32
    valid_ptr: tl.tensor,  # [R] bool
    num_splits: tl.int64,
    BLOCK_S: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    inside = s < num_splits
    at = row * num_splits + s
    m = tl.load(part_m_ptr + at, mask=inside, other=float("-inf"))
    d = tl.load(part_d_ptr + at, mask=inside, other=0.0)
    idx = tl.load(part_idx_ptr + at, mask=inside, other=0)
    bad = tl.sum(tl.load(part_bad_ptr + at, mask=inside, other=0), axis=0)
    top = tl.max(m, axis=0)
    best = tl.min(tl.where(inside & (m == top), idx, _NO_INDEX), axis=0)
    shift = tl.where(top > float("-inf"), top, 0.0)
    total = tl.sum(tl.where(m > float("-inf"), d * tl.exp(m - shift), 0.0), axis=0)
    valid = (top > float("-inf")) & (bad == 0)
    tl.store(ids_ptr + row, tl.where(valid, best, 0))
    log_total = tl.log(tl.where(valid, total, 1.0))  # total = 0 in an invalid row
    tl.store(logprob_ptr + row, tl.where(valid, -log_total, float("-inf")))
    tl.store(valid_ptr + row, valid)


def default_splits(num_rows: int, vocab: int, block: int = _BLOCK) -> int:
    """Vocabulary splits per row: about `_TARGET_PROGRAMS` programs, at least a tile each."""
    return max(1, min(cdiv(vocab, block), cdiv(_TARGET_PROGRAMS, max(num_rows, 1))))


def top1(logits: Tensor, *, chunk_size: int = 4096) -> tuple[Tensor, Tensor, Tensor]:
    """`top1_ref` on the GPU: `logits` [R, V] -> `ids` [R] int64, `logprob` [R] fp32, `valid`
    [R] bool. `chunk_size` is validated as the reference does; the kernel tiles the vocabulary
    its own way, which changes the logprob's rounding only."""
    _check_logits(logits, chunk_size)
    return launch_top1(logits)


def launch_top1(
    logits: Tensor,  # [R, V]
    num_splits: int | None = None,
    block: int | None = None,
    num_warps: int = 4,
) -> tuple[Tensor, Tensor, Tensor]:
    """The launches behind `top1`, with the tiling exposed for `bench/kernels_bench.py`."""
    num_rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = block or min(_BLOCK, max(16, next_pow2(vocab)))
    num_splits = num_splits or default_splits(num_rows, vocab, block)
    chunk = cdiv(cdiv(vocab, num_splits), block) * block
    num_splits = cdiv(vocab, chunk)  # no empty split
    dev = logits.device
    ids = torch.empty(num_rows, dtype=torch.int64, device=dev)
    logprob = torch.empty(num_rows, dtype=torch.float32, device=dev)
    valid = torch.empty(num_rows, dtype=torch.bool, device=dev)
    if num_rows == 0:
        return ids, logprob, valid
    single = num_splits == 1
    shape = (num_rows, 1 if single else num_splits)
    part_m = torch.empty(shape, dtype=torch.float32, device=dev)
    part_d = torch.empty(shape, dtype=torch.float32, device=dev)
    part_idx = torch.empty(shape, dtype=torch.int64, device=dev)
    part_bad = torch.empty(shape, dtype=torch.int32, device=dev)
    _top1_partial_kernel[(num_rows, num_splits)](
        logits, part_m, part_d, part_idx, part_bad, ids, logprob, valid,
        vocab, logits.stride(0), chunk, num_splits,
        BLOCK=block, SINGLE=single, num_warps=num_warps,
    )  # fmt: skip
    if not single:
        _top1_merge_kernel[(num_rows,)](
            part_m, part_d, part_idx, part_bad, ids, logprob, valid, num_splits,
            BLOCK_S=next_pow2(cdiv(vocab, block)), num_warps=1,  # the most splits: one variant
        )  # fmt: skip
    return ids, logprob, valid


# --------------------------------------------------------------------------- topk


@triton.jit(do_not_specialize=["num_splits"])  # chunk stays specialised: aligned loads
def _topk_partial_kernel(
    logits_ptr: tl.tensor,  # [R, V], unit stride along V
    part_val_ptr: tl.tensor,  # [R, num_splits, K] fp32, descending
    part_idx_ptr: tl.tensor,  # [R, num_splits, K] int64 (_NO_INDEX: fewer than K entries)
    part_m_ptr: tl.tensor,  # [R, num_splits] fp32
    part_d_ptr: tl.tensor,  # [R, num_splits] fp32
    part_bad_ptr: tl.tensor,  # [R, num_splits] int32
    vocab: tl.int64,
    row_stride: tl.int64,
    chunk: tl.int64,
    num_splits: tl.int64,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    row_ptr = logits_ptr + row * row_stride
    lanes = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    d = tl.full([], 0.0, tl.float32)
    bad = tl.full([], 0, tl.int32)
    for off in range(start, end, BLOCK):
        offs = off + lanes
        x = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        broken = (x != x) | (x == float("inf"))
        bad += tl.sum(broken.to(tl.int32), axis=0)
        x = tl.where(broken, float("-inf"), x)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    at = row * num_splits + split
    tl.store(part_m_ptr + at, m)
    tl.store(part_d_ptr + at, d)
    tl.store(part_bad_ptr + at, bad)
    # Round r: the best entry strictly after round r-1's in (value desc, index asc) order.
    prev_v = tl.full([], float("inf"), tl.float32)
    prev_i = tl.full([], -1, tl.int64)
    for r in range(K):
        best_v = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], _NO_INDEX, tl.int64)
        for off in range(start, end, BLOCK):
            offs = off + lanes
            inside = offs < end
            x = tl.load(row_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
            x = tl.where((x != x) | (x == float("inf")), float("-inf"), x)
            after = (x < prev_v) | ((x == prev_v) & (offs > prev_i))
            eligible = inside & after
            tile_v = tl.max(tl.where(eligible, x, float("-inf")), axis=0)
            tile_i = tl.min(tl.where(eligible & (x == tile_v), offs.to(tl.int64), _NO_INDEX), 0)
            better = (tile_v > best_v) | ((tile_v == best_v) & (tile_i < best_i))
            best_v = tl.where(better, tile_v, best_v)
            best_i = tl.where(better, tile_i, best_i)
        tl.store(part_val_ptr + at * K + r, best_v)
        tl.store(part_idx_ptr + at * K + r, best_i)
        prev_v = best_v
        prev_i = best_i


@triton.jit(do_not_specialize=["num_splits"])  # per-step values: no recompiles
def _topk_merge_kernel(
    part_val_ptr: tl.tensor,
    part_idx_ptr: tl.tensor,
    part_m_ptr: tl.tensor,
    part_d_ptr: tl.tensor,
    part_bad_ptr: tl.tensor,
    ids_ptr: tl.tensor,  # [R, K] int64
    logprobs_ptr: tl.tensor,  # [R, K] fp32
    valid_ptr: tl.tensor,  # [R] bool
    num_splits: tl.int64,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_in = s < num_splits
    at = row * num_splits + s
    m = tl.load(part_m_ptr + at, mask=s_in, other=float("-inf"))
    d = tl.load(part_d_ptr + at, mask=s_in, other=0.0)
    bad = tl.sum(tl.load(part_bad_ptr + at, mask=s_in, other=0), axis=0)
    top = tl.max(m, axis=0)
    shift = tl.where(top > float("-inf"), top, 0.0)
    total = tl.sum(tl.where(m > float("-inf"), d * tl.exp(m - shift), 0.0), axis=0)
    valid = (top > float("-inf")) & (bad == 0)

    c = tl.arange(0, BLOCK_C)
    c_in = c < num_splits * K
    vals = tl.load(part_val_ptr + row * num_splits * K + c, mask=c_in, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + row * num_splits * K + c, mask=c_in, other=_NO_INDEX)
    real = c_in & (idxs != _NO_INDEX)
    kk = tl.arange(0, BLOCK_K)
    out_v = tl.full([BLOCK_K], float("-inf"), tl.float32)
    out_i = tl.full([BLOCK_K], 0, tl.int64)
    prev_v = tl.full([], float("inf"), tl.float32)
    prev_i = tl.full([], -1, tl.int64)
    for r in range(K):
        eligible = real & ((vals < prev_v) | ((vals == prev_v) & (idxs > prev_i)))
        best_v = tl.max(tl.where(eligible, vals, float("-inf")), axis=0)
        best_i = tl.min(tl.where(eligible & (vals == best_v), idxs, _NO_INDEX), axis=0)
        out_v = tl.where(kk == r, best_v, out_v)
        out_i = tl.where(kk == r, best_i, out_i)
        prev_v = best_v
        prev_i = best_i
    ids = tl.where(valid, out_i, kk.to(tl.int64))
    log_total = tl.log(tl.where(valid, total, 1.0))
    logprobs = tl.where(valid, (out_v - shift) - log_total, float("-inf"))
    tl.store(ids_ptr + row * K + kk, ids, mask=kk < K)
    tl.store(logprobs_ptr + row * K + kk, logprobs, mask=kk < K)
    tl.store(valid_ptr + row, valid)


def topk(logits: Tensor, k: int, *, chunk_size: int = 4096) -> tuple[Tensor, Tensor, Tensor]:
    """`topk_ref` on the GPU: `logits` [R, V] -> `ids` [R, k] int64 (descending, ties toward
    the lower id), `logprobs` [R, k] fp32, `valid` [R] bool. For k > 32 the reference runs
    (a sort), which beats k rounds over the vocabulary there."""
    _check_logits(logits, chunk_size)
    num_rows, vocab = logits.shape
    _check_k(k, vocab)
    if k > _TOPK_MAX:
        return topk_ref(logits, k, chunk_size=chunk_size)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = min(_BLOCK, max(16, next_pow2(vocab)))
    most_splits = min(cdiv(vocab, block), max(1, _MAX_CANDIDATES // k))  # blocks: one variant
    num_splits = min(default_splits(num_rows, vocab, block), most_splits)
    chunk = cdiv(cdiv(vocab, num_splits), block) * block
    num_splits = cdiv(vocab, chunk)
    dev = logits.device
    ids = torch.empty(num_rows, k, dtype=torch.int64, device=dev)
    logprobs = torch.empty(num_rows, k, dtype=torch.float32, device=dev)
    valid = torch.empty(num_rows, dtype=torch.bool, device=dev)
    if num_rows == 0:
        return ids, logprobs, valid
    part_val = torch.empty(num_rows, num_splits, k, dtype=torch.float32, device=dev)
    part_idx = torch.empty(num_rows, num_splits, k, dtype=torch.int64, device=dev)
    part_m = torch.empty(num_rows, num_splits, dtype=torch.float32, device=dev)
    part_d = torch.empty_like(part_m)
    part_bad = torch.empty(num_rows, num_splits, dtype=torch.int32, device=dev)
    _topk_partial_kernel[(num_rows, num_splits)](
        logits, part_val, part_idx, part_m, part_d, part_bad,
        vocab, logits.stride(0), chunk, num_splits, K=k, BLOCK=block,
    )  # fmt: skip
    _topk_merge_kernel[(num_rows,)](
        part_val, part_idx, part_m, part_d, part_bad, ids, logprobs, valid, num_splits,
        K=k, BLOCK_K=next_pow2(k), BLOCK_S=next_pow2(most_splits),
        BLOCK_C=next_pow2(most_splits * k), num_warps=4,
    )  # fmt: skip
    return ids, logprobs, valid
