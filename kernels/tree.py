"""Trees and verification (kernels.md sections 3 and 4): `build_tree`, `verify_greedy`,
`verify_sampling` and `accepted_slots`. Torch twins of the same names (`*_ref`) in
`reference.py`; trees are padded per request as described there.

One program per request. `build_tree` holds the tree in registers: each node walks up its
parent chain once (N x N ancestor tile), and the child links are row minima of "parent equals"
tiles. The verify kernels walk the accepted path with scalar loads; `verify_sampling` reads the
target distribution of a node only where a child is tested, plus one pass over the vocabulary
for the bonus (the exponential race over the residual) at the node where the walk stops.

Every link a kernel follows must point forward inside its request, so a walk ends and never
reads out of bounds even on unchecked input. Value checks (`checks_values`) read the inputs on
the host and raise the reference's errors; they are skipped while a CUDA graph is captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._launch import checks_values, size_block
from kernels.reference import (
    _check_accepted_slots,
    _check_greedy,
    _check_sampling,
    _check_tree,
)

_BLOCK_V = 1024
_NO_INDEX = tl.constexpr(2**63 - 1)


@triton.jit(do_not_specialize=["n"])  # per-step values: no recompiles
def _build_tree_kernel(
    parents_ptr: tl.tensor,  # [bs, N] int64
    num_nodes_ptr: tl.tensor,  # [bs] int64
    depth_ptr: tl.tensor,  # [bs, N] int64
    mask_ptr: tl.tensor,  # [bs, N, N] bool
    first_child_ptr: tl.tensor,  # [bs, N] int64
    next_sibling_ptr: tl.tensor,  # [bs, N] int64
    n: tl.int64,
    BLOCK_N: tl.constexpr,
) -> None:
    b = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK_N).to(tl.int64)
    count = tl.minimum(tl.load(num_nodes_ptr + b), n)
    real = nodes < count
    row_ptr = parents_ptr + b * n
    par = tl.load(row_ptr + nodes, mask=real & (nodes > 0), other=-1)
    par = tl.where((par >= 0) & (par < nodes), par, -1)  # unchecked input: no backward walk
    # Ancestors: every node climbs its parent chain, marking each node it passes.
    cur = tl.where(real, nodes, -1)
    depth = tl.zeros([BLOCK_N], tl.int64)
    sees = tl.zeros([BLOCK_N, BLOCK_N], tl.int1)
    while tl.max(cur, axis=0) >= 0:
        sees = sees | (nodes[None, :] == cur[:, None])
        up = tl.load(row_ptr + cur, mask=cur > 0, other=-1)
        up = tl.where((up >= 0) & (up < cur), up, -1)
        depth += (up >= 0).to(tl.int64)
        cur = up
    # first_child[x] = lowest i with parent x; next_sibling[i] = lowest j > i with i's parent.
    child_of = par[None, :] == nodes[:, None]  # [x, i]
    first = tl.min(tl.where(child_of, nodes[None, :], _NO_INDEX), axis=1)
    sibling = (par[None, :] == par[:, None]) & (nodes[None, :] > nodes[:, None])  # [i, j]
    sibling = sibling & (par[:, None] >= 0)
    nxt = tl.min(tl.where(sibling, nodes[None, :], _NO_INDEX), axis=1)
    inside = nodes < n
    out = b * n + nodes
    tl.store(depth_ptr + out, depth, mask=inside)
    tl.store(first_child_ptr + out, tl.where(first == _NO_INDEX, -1, first), mask=inside)
    tl.store(next_sibling_ptr + out, tl.where(nxt == _NO_INDEX, -1, nxt), mask=inside)
    cells = (b * n + nodes[:, None]) * n + nodes[None, :]
    tl.store(mask_ptr + cells, sees, mask=inside[:, None] & inside[None, :])


def build_tree(parents: Tensor, num_nodes: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`build_tree_ref` on the GPU: `parents` [bs, N], `num_nodes` [bs] int64 -> `depth`
    [bs, N], `mask` [bs, N, N] bool, `first_child`, `next_sibling` [bs, N] int64."""
    _check_tree(parents, num_nodes, values=checks_values(parents))
    bs, n = parents.shape
    parents, num_nodes = parents.contiguous(), num_nodes.contiguous()
    dev = parents.device
    depth = torch.empty(bs, n, dtype=torch.int64, device=dev)
    mask = torch.empty(bs, n, n, dtype=torch.bool, device=dev)
    first_child = torch.empty(bs, n, dtype=torch.int64, device=dev)
    next_sibling = torch.empty(bs, n, dtype=torch.int64, device=dev)
    if bs:
        _build_tree_kernel[(bs,)](
            parents, num_nodes, depth, mask, first_child, next_sibling, n,
            BLOCK_N=size_block(n),
        )  # fmt: skip
    return depth, mask, first_child, next_sibling


@triton.jit
def _forward_link(link_ptr: tl.tensor, at: tl.tensor, count: tl.tensor) -> tl.tensor:
    """The link stored for node `at`, or -1 unless it points forward inside the request."""
    link = tl.load(link_ptr + at)
    return tl.where((link > at) & (link < count), link, -1)


@triton.jit(do_not_specialize=["n", "width"])  # per-step values: no recompiles
def _verify_greedy_kernel(
    tokens_ptr: tl.tensor,  # [bs, N] int64
    target_ptr: tl.tensor,  # [bs, N] int64
    first_child_ptr: tl.tensor,  # [bs, N] int64
    next_sibling_ptr: tl.tensor,  # [bs, N] int64
    num_nodes_ptr: tl.tensor,  # [bs] int64
    accept_index_ptr: tl.tensor,  # [bs, W] int64
    accept_len_ptr: tl.tensor,  # [bs] int64
    bonus_ptr: tl.tensor,  # [bs] int64
    n: tl.int64,
    width: tl.int64,
    BLOCK_W: tl.constexpr,
) -> None:
    b = tl.program_id(0).to(tl.int64)
    row = b * n
    count = tl.minimum(tl.load(num_nodes_ptr + b), n)
    lanes = tl.arange(0, BLOCK_W).to(tl.int64)
    path = tl.where(lanes == 0, 0, -1).to(tl.int64)
    last = tl.full([], 0, tl.int64)
    level = tl.full([], 1, tl.int64)
    child = _forward_link(first_child_ptr + row, last, count)
    while (child >= 0) & (level < width):
        want = tl.load(target_ptr + row + last)
        # The first child (ascending) whose token is the target's choice at `last`.
        found = tl.full([], 0, tl.int1)
        while (child >= 0) & (found == 0):
            found = tl.load(tokens_ptr + row + child) == want
            child = tl.where(found, child, _forward_link(next_sibling_ptr + row, child, count))
        path = tl.where(lanes == level, child, path)  # child is -1 when none matched
        last = tl.where(child >= 0, child, last)
        level += (child >= 0).to(tl.int64)
        child = tl.where(child >= 0, _forward_link(first_child_ptr + row, child, count), -1)
    tl.store(accept_index_ptr + b * width + lanes, path, mask=lanes < width)
    tl.store(accept_len_ptr + b, level)
    tl.store(bonus_ptr + b, tl.load(target_ptr + row + last))


def verify_greedy(
    tokens: Tensor,
    target_ids: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    num_nodes: Tensor,
    accept_width: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`verify_greedy_ref` on the GPU: -> `accept_index` [bs, accept_width] int64 (-1 padded),
    `accept_len` [bs] int64, `bonus` [bs] int64."""
    _check_greedy(
        tokens, target_ids, first_child, next_sibling, num_nodes, accept_width,
        values=checks_values(tokens),
    )  # fmt: skip
    bs, n = tokens.shape
    dev = tokens.device
    accept_index = torch.empty(bs, accept_width, dtype=torch.int64, device=dev)
    accept_len = torch.empty(bs, dtype=torch.int64, device=dev)
    bonus = torch.empty(bs, dtype=torch.int64, device=dev)
    if bs:
        _verify_greedy_kernel[(bs,)](
            tokens.contiguous(), target_ids.contiguous(), first_child.contiguous(),
            next_sibling.contiguous(), num_nodes.contiguous(),
            accept_index, accept_len, bonus, n, accept_width,
            BLOCK_W=size_block(accept_width), num_warps=1,
        )  # fmt: skip
    return accept_index, accept_len, bonus


# Per-step values: no recompiles (the strides over nodes change with a step's tree size).
@triton.jit(do_not_specialize=["n", "width", "probs_stride_b", "coins_stride"])
def _verify_sampling_kernel(
    tokens_ptr: tl.tensor,  # [bs, N] int64
    probs_ptr: tl.tensor,  # [bs, N, V] fp32, unit stride along V
    coins_ptr: tl.tensor,  # [bs, N]
    noise_ptr: tl.tensor,  # [bs, V], unit stride along V
    first_child_ptr: tl.tensor,  # [bs, N] int64
    next_sibling_ptr: tl.tensor,  # [bs, N] int64
    num_nodes_ptr: tl.tensor,  # [bs] int64
    accept_index_ptr: tl.tensor,  # [bs, W] int64
    accept_len_ptr: tl.tensor,  # [bs] int64
    bonus_ptr: tl.tensor,  # [bs] int64
    n: tl.int64,
    vocab: tl.int64,
    width: tl.int64,
    probs_stride_b: tl.int64,
    probs_stride_n: tl.int64,
    coins_stride: tl.int64,
    noise_stride: tl.int64,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
) -> None:
    b = tl.program_id(0).to(tl.int64)
    row = b * n
    count = tl.minimum(tl.load(num_nodes_ptr + b), n)
    lanes = tl.arange(0, BLOCK_W).to(tl.int64)
    sib_lanes = tl.arange(0, BLOCK_N).to(tl.int64)
    v_lanes = tl.arange(0, BLOCK_V)
    path = tl.where(lanes == 0, 0, -1).to(tl.int64)
    last = tl.full([], 0, tl.int64)
    level = tl.full([], 1, tl.int64)
    bonus = tl.full([], 0, tl.int64)
    walking = tl.full([], 1, tl.int1)
    while walking:
        p_ptr = probs_ptr + b * probs_stride_b + last * probs_stride_n
        u = tl.load(coins_ptr + b * coins_stride + last)
        # One coin over the ordered children: accept c_k if u < p(c_1) + ... + p(c_k), in fp32
        # and in the reference's order; a token repeated among siblings is skipped.
        cum = tl.full([], 0.0, tl.float32)
        seen = tl.full([BLOCK_N], -1, tl.int64)  # tokens of the children tested so far
        num_seen = tl.full([], 0, tl.int64)
        accepted = tl.full([], -1, tl.int64)
        last_positive = tl.full([], -1, tl.int64)
        child = _forward_link(first_child_ptr + row, last, count)
        while (child >= 0) & (accepted < 0):
            tok = tl.load(tokens_ptr + row + child)
            repeated = tl.sum((seen == tok).to(tl.int32), axis=0) > 0
            take = (tok >= 0) & (tok < vocab) & (repeated == 0)
            p_tok = tl.load(p_ptr + tl.where(take, tok, 0), mask=take, other=0.0)
            cum = tl.where(take, cum + p_tok, cum)
            seen = tl.where(tl.where(take, sib_lanes == num_seen, False), tok, seen)
            num_seen += take.to(tl.int64)
            last_positive = tl.where(take & (p_tok > 0), child, last_positive)
            accepted = tl.where(take & (u < cum), child, accepted)
            nxt = _forward_link(next_sibling_ptr + row, child, count)
            child = tl.where(accepted >= 0, -1, nxt)
        if accepted < 0:
            # Bonus: argmax residual / noise over the residual's positive entries (others -1),
            # first index among ties. The residual is p without the children's tokens: a lane
            # holding one of them is dropped to -1 when it would win its tile.
            best = tl.full([], float("-inf"), noise_ptr.dtype.element_ty)
            best_at = tl.full([], 0, tl.int64)
            for off in range(0, vocab, BLOCK_V):
                offs = off + v_lanes
                inside = offs < vocab
                r = tl.load(p_ptr + offs, mask=inside, other=0.0)
                e = tl.load(noise_ptr + b * noise_stride + offs, mask=inside, other=1.0)
                race = tl.where(inside, tl.where(r > 0, r / e, -1.0), float("-inf"))
                tile_best = tl.max(race, axis=0)
                tile_at = tl.min(tl.where(race == tile_best, offs, vocab), axis=0).to(tl.int64)
                hit = tl.sum((seen == tile_at).to(tl.int32), axis=0) > 0
                while (tile_best > best) & (tile_best > -1.0) & hit:
                    race = tl.where(offs == tile_at, -1.0, race)
                    tile_best = tl.max(race, axis=0)
                    tile_at = tl.min(tl.where(race == tile_best, offs, vocab), axis=0)
                    tile_at = tile_at.to(tl.int64)
                    hit = tl.sum((seen == tile_at).to(tl.int32), axis=0) > 0
                best_at = tl.where(tile_best > best, tile_at, best_at)
                best = tl.maximum(best, tile_best)
            # No positive residual although the coin beat every child: rounding (the children
            # hold all the mass), where exact arithmetic accepts the last positive child.
            accepted = tl.where(best > -1.0, -1, last_positive)
            bonus = tl.where(accepted < 0, best_at, bonus)
        walking = (accepted >= 0) & (level < width)
        path = tl.where(tl.where(walking, lanes == level, False), accepted, path)
        last = tl.where(walking, accepted, last)
        level += walking.to(tl.int64)
    tl.store(accept_index_ptr + b * width + lanes, path, mask=lanes < width)
    tl.store(accept_len_ptr + b, level)
    tl.store(bonus_ptr + b, bonus)


def verify_sampling(
    tokens: Tensor,
    target_probs: Tensor,
    coins: Tensor,
    residual_noise: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    num_nodes: Tensor,
    accept_width: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`verify_sampling_ref` on the GPU (lossless tree speculative sampling; same coins, same
    residual race) -> `accept_index` [bs, accept_width], `accept_len` [bs], `bonus` [bs]."""
    _check_sampling(
        tokens, target_probs, coins, residual_noise, first_child, next_sibling, num_nodes,
        accept_width, values=checks_values(tokens),
    )  # fmt: skip
    bs, n, vocab = target_probs.shape
    dev = tokens.device
    # As torch promotes them against the fp32 sums and probabilities: 16-bit coins and noise
    # widen to fp32 exactly; fp64 stays fp64.
    if coins.dtype != torch.float64:
        coins = coins.float()
    if coins.stride(1) != 1:
        coins = coins.contiguous()
    if residual_noise.dtype != torch.float64:
        residual_noise = residual_noise.float()
    if target_probs.stride(2) != 1:
        target_probs = target_probs.contiguous()
    if residual_noise.stride(1) != 1:
        residual_noise = residual_noise.contiguous()
    accept_index = torch.empty(bs, accept_width, dtype=torch.int64, device=dev)
    accept_len = torch.empty(bs, dtype=torch.int64, device=dev)
    bonus = torch.empty(bs, dtype=torch.int64, device=dev)
    if bs:
        _verify_sampling_kernel[(bs,)](
            tokens.contiguous(), target_probs, coins, residual_noise,
            first_child.contiguous(), next_sibling.contiguous(), num_nodes.contiguous(),
            accept_index, accept_len, bonus,
            n, vocab, accept_width, target_probs.stride(0), target_probs.stride(1),
            coins.stride(0), residual_noise.stride(0),
            BLOCK_W=size_block(accept_width), BLOCK_N=size_block(n), BLOCK_V=_BLOCK_V,
        )  # fmt: skip
    return accept_index, accept_len, bonus


@triton.jit(do_not_specialize=["bs", "width", "max_pages"])  # per-step values: no recompiles
def _accepted_slots_kernel(
    page_table_ptr: tl.tensor,  # [bs, max_pages] int32
    base_lens_ptr: tl.tensor,  # [bs] int64
    accept_index_ptr: tl.tensor,  # [bs, W] int64
    accept_len_ptr: tl.tensor,  # [bs] int64
    src_ptr: tl.tensor,  # [M] int64
    dst_ptr: tl.tensor,  # [M] int64
    bs: tl.int64,
    width: tl.int64,
    max_pages: tl.int64,
    page_size: tl.int64,
    BLOCK_W: tl.constexpr,
    BLOCK_B: tl.constexpr,
) -> None:
    b = tl.program_id(0).to(tl.int64)
    # Output offset: the accept lengths of the requests before b (no cumsum launch).
    before = tl.arange(0, BLOCK_B)
    start = tl.sum(tl.load(accept_len_ptr + before, mask=before < b, other=0), axis=0)
    j = tl.arange(0, BLOCK_W).to(tl.int64)
    used = j < tl.minimum(tl.load(accept_len_ptr + b), width)
    node = tl.load(accept_index_ptr + b * width + j, mask=used, other=0)
    base = tl.load(base_lens_ptr + b)
    src_pos = base + node
    dst_pos = base + j
    pages = page_table_ptr + b * max_pages
    src_at = src_pos // page_size
    dst_at = dst_pos // page_size
    src_page = tl.load(pages + src_at, mask=used & (src_at >= 0) & (src_at < max_pages), other=0)
    dst_page = tl.load(pages + dst_at, mask=used & (dst_at >= 0) & (dst_at < max_pages), other=0)
    src = src_page.to(tl.int64) * page_size + src_pos % page_size
    dst = dst_page.to(tl.int64) * page_size + dst_pos % page_size
    tl.store(src_ptr + start + j, src, mask=used)
    tl.store(dst_ptr + start + j, dst, mask=used)


def accepted_slots(
    page_table: Tensor,
    base_lens: Tensor,
    accept_index: Tensor,
    accept_len: Tensor,
    page_size: int,
) -> tuple[Tensor, Tensor]:
    """`accepted_slots_ref` on the GPU -> `src_slots`, `dst_slots` [sum(accept_len)] int64.

    The output length is data-dependent: one host read of sum(accept_len), so this one cannot
    be captured in a CUDA graph (a fixed [bs, W] layout with -1 placeholders could)."""
    _check_accepted_slots(
        page_table, base_lens, accept_index, accept_len, page_size,
        values=checks_values(page_table),
    )  # fmt: skip
    bs, width = accept_index.shape
    dev = accept_index.device
    total = int(accept_len.sum()) if bs else 0
    src = torch.empty(total, dtype=torch.int64, device=dev)
    dst = torch.empty(total, dtype=torch.int64, device=dev)
    if total:
        _accepted_slots_kernel[(bs,)](
            page_table.contiguous(), base_lens.contiguous(), accept_index.contiguous(),
            accept_len.contiguous(), src, dst, bs, width, page_table.shape[1], page_size,
            BLOCK_W=size_block(width), BLOCK_B=size_block(bs, 64), num_warps=1,
        )  # fmt: skip
    return src, dst
