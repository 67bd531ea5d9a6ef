"""Paged attention with a tree mask (kernels.md 1.7): prefill, chunked prefill, verify, draft
tree steps and decode in one kernel family. Torch twin: `kernels/reference_attention.py`.

Stage 1, grid (bs * q_tiles, num_kv_heads, num_splits): a program takes a tile of one
request's query tokens times the G query heads of one KV head (packed into the M dimension, so
K/V are read once per group) and one split of the request's KV indices, walks its keys through
the page table with an online softmax, and writes the normalised output (one split) or a
partial output plus its log-sum-exp. Stage 2, grid (num_tokens, num_heads), merges the splits.
Grids come from static bounds (`max_q_len`, `num_splits`); programs read the real lengths on
the device and return early, so nothing here syncs with the host and a launch can be captured
in a CUDA graph.

Visibility (as `TorchAttention`): a token sees its request's committed prefix and what its
mask row allows, causal over the new tokens when there is no mask. The mask is packed per
token into int64 words (`pack_tree_mask`); a tree of N <= 64 nodes takes one word per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped,unused-ignore]
import triton.language as tl  # type: ignore[import-untyped,unused-ignore]
from torch import Tensor

from kernels.reference_attention import check_pack_args

_WORD_BITS = tl.constexpr(64)  # mask bits per word
_LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Per-call values are not specialised: Triton compiles a variant per int argument that is 1 or
# a multiple of 16, and the page table's row stride (its width: the longest request's pages)
# crosses those classes as contexts grow, costing a compile (about a second) mid-serving.
@triton.jit(do_not_specialize=["num_q_tiles", "num_splits", "stride_pt", "stride_mt"])
def _tree_attention_kernel(
    q_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim]
    k_ptr: tl.tensor,  # [num_slots, num_kv_heads, head_dim]
    v_ptr: tl.tensor,  # [num_slots, num_kv_heads, head_dim]
    out_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim] (one split)
    part_o_ptr: tl.tensor,  # [num_tokens, num_heads, num_splits, head_dim] fp32 (several splits)
    part_lse_ptr: tl.tensor,  # [num_tokens, num_heads, num_splits] fp32, base-2 log-sum-exp
    page_table_ptr: tl.tensor,  # [bs, max_pages] int32
    cu_q_ptr: tl.tensor,  # [bs + 1] int64
    seq_lens_ptr: tl.tensor,  # [bs] int64
    prefix_lens_ptr: tl.tensor,  # [bs] int64 (read with HAS_MASK)
    mask_ptr: tl.tensor,  # [num_tokens, num_words] int64 (read with HAS_MASK)
    qk_scale: tl.float32,  # softmax scale * log2(e)
    num_q_tiles: tl.int64,
    num_splits: tl.int64,
    stride_qt: tl.int64,
    stride_qh: tl.int64,
    stride_ks: tl.int64,
    stride_kh: tl.int64,
    stride_vs: tl.int64,
    stride_vh: tl.int64,
    stride_ot: tl.int64,
    stride_oh: tl.int64,
    stride_pt: tl.int64,
    stride_mt: tl.int64,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    req = pid // num_q_tiles
    first = (pid % num_q_tiles) * BLOCK_Q
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_start
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # KV entries before this step's tokens

    offs_m = tl.arange(0, BLOCK_M)
    row = first + offs_m // GROUP  # query index within the request
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (row < q_len)
    token = q_start + row  # int64
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    if HAS_MASK:
        prefix = tl.load(prefix_lens_ptr + req)
        kv_end = seq_len
    else:  # causal: the tile's last row bounds its keys
        kv_end = ctx_len + tl.minimum(first + BLOCK_Q, q_len)
    chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, kv_end)

    pt_row = page_table_ptr + req.to(tl.int64) * stride_pt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # KV indices of this key tile
        pos_ok = pos < kv_hi
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
        k = tl.load(
            k_ptr + slot[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
            mask=pos_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        seen = row_ok[:, None] & pos_ok[None, :]
        if HAS_MASK:
            col = tl.maximum(pos - prefix, 0)  # column in the mask rows (clamped: no bad shift)
            in_tree = (pos >= prefix)[None, :]
            word = tl.load(
                mask_ptr + token[:, None] * stride_mt + (col // _WORD_BITS)[None, :],
                mask=seen & in_tree,
                other=0,
            )
            bit = (word >> (col % _WORD_BITS).to(tl.int64)[None, :]) & 1
            seen = seen & tl.where(in_tree, bit != 0, True)
        else:
            seen = seen & (pos[None, :] <= (ctx_len + row)[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=pos_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    saw = l_i > 0
    o = acc / tl.where(saw, l_i, 1.0)[:, None]  # a row that saw nothing keeps acc = 0
    if SPLIT:
        part = (token * NUM_HEADS + head) * num_splits + split
        lse = tl.where(saw, m_i + tl.log2(tl.where(saw, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(
            part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            o,
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_o_ptr: tl.tensor,  # [num_tokens, num_heads, num_splits, head_dim] fp32
    part_lse_ptr: tl.tensor,  # [num_tokens, num_heads, num_splits] fp32
    out_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim]
    num_splits: tl.int64,
    stride_ot: tl.int64,
    stride_oh: tl.int64,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * NUM_HEADS + head) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
    o = tl.load(
        part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=(w > 0)[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        res.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


@triton.jit(do_not_specialize=["num_words"])  # per-step values: no recompiles
def _pack_tree_mask_kernel(
    mask_ptr: tl.tensor,  # [sum(q_len_i * width_i)] uint8 (a bool tensor's bytes)
    row_offsets_ptr: tl.tensor,  # [num_tokens] int64
    row_widths_ptr: tl.tensor,  # [num_tokens] int64
    out_ptr: tl.tensor,  # [num_tokens, num_words] int64
    num_words: tl.int64,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    word = tl.program_id(1)
    offset = tl.load(row_offsets_ptr + token)
    width = tl.load(row_widths_ptr + token)
    bits = tl.arange(0, _WORD_BITS)
    col = word * _WORD_BITS + bits
    inside = col < width
    flags = tl.load(mask_ptr + offset + col, mask=inside, other=0)
    values = tl.where(inside & (flags != 0), 1, 0).to(tl.int64) << bits.to(tl.int64)
    tl.store(out_ptr + token * num_words + word, tl.sum(values, 0))  # distinct bits: sum = OR


def pack_tree_mask(
    custom_mask: Tensor,  # [sum(q_len_i * width_i)] bool, row-major blocks (AttentionMetadata)
    row_offsets: Tensor,  # [num_tokens] int64, where each token's row starts in custom_mask
    row_widths: Tensor,  # [num_tokens] int64, its row's width (seq_len - prefix_len)
    num_words: int,
) -> Tensor:  # [num_tokens, num_words] int64
    """Packs each token's mask row into little-endian int64 words (bit `c % 64` of word
    `c // 64` = column `c`; 0 past the width). Rows must fit: width <= 64 * num_words."""
    check_pack_args(custom_mask, row_offsets, row_widths, num_words)
    for name, t in (("row_offsets", row_offsets), ("row_widths", row_widths)):
        if t.device != custom_mask.device or t.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous tensor on {custom_mask.device}")
    num_tokens = row_offsets.shape[0]
    out = torch.empty(num_tokens, num_words, dtype=torch.int64, device=custom_mask.device)
    if num_tokens:
        _pack_tree_mask_kernel[(num_tokens, num_words)](
            custom_mask.contiguous().view(torch.uint8), row_offsets, row_widths, out, num_words
        )
    return out


def default_num_splits(
    *,
    batch_size: int,
    max_q_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_kv_len: int,
    num_sms: int,
) -> int:
    """Splits of the KV walk: when the batch alone does not fill the GPU (small batch, long
    context, short query tiles), enough programs for about two waves, each split covering at
    least 64 keys (one key tile: on an H100 at batch size 1 and 200 keys, one split takes 9.6 us,
    2 take 7.8 and 4 take 6.1)."""
    blocks = _blocks(max_q_len, num_heads // num_kv_heads, head_dim)
    num_programs = batch_size * triton.cdiv(max_q_len, blocks.q) * num_kv_heads
    if num_programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, max(num_programs, 1))
    return max(1, min(32, by_occupancy, triton.cdiv(max_kv_len, 64)))


@dataclass(frozen=True)
class _Blocks:
    """Tile sizes of one launch. Rows of a query tile are (token, head in group) pairs:
    BLOCK_M >= 16 for `tl.dot`, `q` tokens of G heads each. Shared memory per program stays
    under about 128 KB (two pipeline stages of K and V tiles plus the query tile)."""

    d: int
    m: int
    q: int
    n: int
    num_warps: int


def _blocks(max_q_len: int, group: int, head_dim: int, itemsize: int = 2) -> _Blocks:
    block_d = max(16, triton.next_power_of_2(head_dim))
    cap = 128 if block_d <= 128 else 64
    block_m = max(
        16, triton.next_power_of_2(group), min(cap, triton.next_power_of_2(max_q_len * group))
    )
    block_n = 64 if block_d <= 128 and itemsize <= 2 else 32
    num_warps = 8 if block_m * block_d >= 128 * 128 else 4
    return _Blocks(d=block_d, m=block_m, q=block_m // group, n=block_n, num_warps=num_warps)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def tree_attention(
    q: Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_slots, num_kv_heads, head_dim]
    page_table: Tensor,  # [bs, max_pages] int32
    query_start_loc: Tensor,  # [bs + 1] int64
    seq_lens: Tensor,  # [bs] int64, KV length including this step's tokens
    prefix_lens: Tensor | None,  # [bs] int64, entries every token sees (with tree_mask)
    tree_mask: Tensor | None,  # [num_tokens, num_words] int64 (None: causal)
    *,
    scale: float,
    page_size: int,
    max_q_len: int,
    num_splits: int = 1,
    out: Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    batch_invariant: bool = False,
) -> Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each query token over its request's paged KV; the new tokens' K/V must
    already be in the cache. Visibility is documented in `kernels/reference_attention.py`.
    `max_q_len` must bound every request's query count and `num_splits` (>= 1) sets the
    split-KV count; both size the grid, so they are the static bounds of a captured launch.

    ``batch_invariant`` (with one split): the query tile of a one-token query whatever
    `max_q_len` is, so a token's output is bit-identical whether it is decoded alone, verified
    among a tree's tokens (at the KV index its decode would have) or prefilled: its keys are
    walked in the same key tiles from index 0, with the same tile shapes, and keys it may not
    see add exact zeros. Without it the tile grows with `max_q_len` and the split count
    follows the batch, and the sums' order with them.
    Shapes, dtypes and strides are checked here; lengths and slots are not (that would read
    the device): `tree_attention_ref` checks those."""
    _check(q.ndim == 3 and k_cache.ndim == 3, "q, k_cache: expected 3-D tensors")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    _check(v_cache.shape == k_cache.shape, "v_cache: expected the shape of k_cache")
    _check(k_cache.shape[2] == head_dim, "k_cache: head_dim differs from q's")
    _check(num_heads % num_kv_heads == 0, "q: num_heads is not a multiple of num_kv_heads")
    _check(q.dtype in _FLOAT_DTYPES, f"q: unsupported dtype {q.dtype}")
    _check(k_cache.dtype == q.dtype == v_cache.dtype, "k_cache, v_cache: dtype differs from q's")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check(t.stride(2) == 1, f"{name}: head_dim must be contiguous")
        _check(t.device == q.device, f"{name}: not on {q.device}")
    bs = seq_lens.shape[0]
    _check(page_table.ndim == 2 and page_table.shape[0] == bs, "page_table: expected [bs, pages]")
    _check(page_table.dtype == torch.int32, "page_table: expected int32")
    _check(page_table.stride(1) == 1, "page_table: rows must be contiguous")
    _check(query_start_loc.shape == (bs + 1,), "query_start_loc: expected [bs + 1]")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        _check(t.dtype == torch.int64 and t.is_contiguous(), f"{name}: expected contiguous int64")
    for t in (page_table, query_start_loc, seq_lens):
        _check(t.device == q.device, f"metadata tensors: expected them on {q.device}")
    _check(
        (tree_mask is None) == (prefix_lens is None), "prefix_lens: given exactly with tree_mask"
    )
    if tree_mask is not None and prefix_lens is not None:
        _check(tree_mask.ndim == 2 and tree_mask.shape[0] == num_tokens, "tree_mask: [T, words]")
        _check(tree_mask.dtype == torch.int64, "tree_mask: expected int64 words")
        _check(tree_mask.stride(1) == 1, "tree_mask: rows must be contiguous")
        _check(prefix_lens.shape == (bs,), "prefix_lens: expected [bs]")
        _check(prefix_lens.dtype == torch.int64, "prefix_lens: expected int64")
        _check(tree_mask.device == prefix_lens.device == q.device, f"tree_mask: not on {q.device}")
    _check(page_size >= 1, f"page_size: must be >= 1, got {page_size}")
    _check(max_q_len >= 1, f"max_q_len: must be >= 1, got {max_q_len}")
    _check(num_splits >= 1, f"num_splits: must be >= 1, got {num_splits}")
    _check(not batch_invariant or num_splits == 1, "batch_invariant: needs num_splits == 1")
    if out is None:
        out = torch.empty_like(q)
    _check(out.shape == q.shape and out.dtype == q.dtype, "out: expected q's shape and dtype")
    _check(out.stride(2) == 1 and out.device == q.device, "out: head_dim must be contiguous")
    if num_tokens == 0 or bs == 0:
        return out

    group = num_heads // num_kv_heads
    blocks = _blocks(1 if batch_invariant else max_q_len, group, head_dim, q.element_size())
    num_q_tiles = triton.cdiv(max_q_len, blocks.q)
    split = num_splits > 1
    part_o = part_lse = out  # placeholders: never touched without SPLIT
    if split:
        part_o = torch.empty(
            num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    mask = tree_mask if tree_mask is not None else seq_lens  # placeholders without a mask
    prefixes = prefix_lens if prefix_lens is not None else seq_lens
    _tree_attention_kernel[(bs * num_q_tiles, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_o,
        part_lse,
        page_table,
        query_start_loc,
        seq_lens,
        prefixes,
        mask,
        scale * _LOG2E,
        num_q_tiles,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        mask.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=blocks.d,
        BLOCK_M=blocks.m,
        BLOCK_Q=blocks.q,
        BLOCK_N=blocks.n,
        PAGE_SIZE=page_size,
        HAS_MASK=tree_mask is not None,
        SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=blocks.num_warps,
        num_stages=2,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_o,
            part_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=blocks.d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            num_warps=1 if blocks.d <= 64 else 2,
        )
    return out
