"""Plain-torch twins of `kernels/attention.py`: the oracle of the Triton kernels.

`dense_attention_ref` is the math of `tandem.attention.TorchAttention` (which calls it), so the
CPU backend, this oracle and the kernel share one definition of the result. The functional
`tree_attention_ref` adds what the kernel's inputs mean: paged KV through the page table,
causal visibility or the packed mask, and all-masked rows. Inputs are validated on the host;
clarity comes before speed.

Visibility, for token `t` = row `r` of request `b` (`r = t - query_start_loc[b]`), over KV
indices `j < seq_lens[b]`:
- no `tree_mask`: causal, `j <= seq_lens[b] - q_len_b + r`;
- with `tree_mask` [num_tokens, num_words] int64: `j < prefix_lens[b]`, or bit `c % 64` of
  word `c // 64` of row `t` is set, where `c = j - prefix_lens[b]`.
KV index `j` lives at slot `page_table[b, j // page_size] * page_size + j % page_size`. A row
that sees nothing outputs zeros.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

_WORD_BITS = 64


def dense_attention_ref(
    q: Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_slots, num_kv_heads, head_dim]
    slots: Tensor,  # [bs, max_seq] int64, KV slot of each request's entries
    allowed: Tensor,  # [bs, max_q, max_seq] bool, every row with at least one entry set
    token_req: Tensor,  # [num_tokens] int64, request of each flat token
    token_row: Tensor,  # [num_tokens] int64, its query index within the request
    scale: float,
) -> Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of a ragged batch padded to [bs, max_q] queries over [bs, max_seq] entries,
    in float32, grouped-query heads sharing their KV head."""
    bs, max_q = allowed.shape[0], allowed.shape[1]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    keys = k_cache[slots].to(torch.float32)  # [bs, max_seq, num_kv_heads, head_dim]
    values = v_cache[slots].to(torch.float32)
    qp = q.new_zeros(bs, max_q, num_heads, head_dim, dtype=torch.float32)
    qp[token_req, token_row] = q.to(torch.float32)
    # [bs, kv, group, max_q, d] x [bs, kv, 1, d, max_seq] -> [bs, kv, group, max_q, max_seq]
    qp = qp.view(bs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    scores = torch.matmul(qp, keys.permute(0, 2, 3, 1).unsqueeze(2)) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # [bs, kv, group, max_q, max_seq] x [bs, kv, 1, max_seq, d] -> [bs, kv, group, max_q, d]
    attn = torch.matmul(probs, values.permute(0, 2, 1, 3).unsqueeze(2))
    attn = attn.permute(0, 3, 1, 2, 4).reshape(bs, max_q, num_heads, head_dim)
    return attn[token_req, token_row].to(q.dtype)


def pack_tree_mask_ref(
    custom_mask: Tensor,  # [sum(q_len_i * width_i)] bool, row-major blocks (AttentionMetadata)
    row_offsets: Tensor,  # [num_tokens] int64, where each token's row starts in custom_mask
    row_widths: Tensor,  # [num_tokens] int64, its row's width (seq_len - prefix_len)
    num_words: int,
) -> Tensor:  # [num_tokens, num_words] int64
    """Packs each token's mask row into little-endian int64 words: bit `c % 64` of word
    `c // 64` is column `c`; columns past the row's width are 0."""
    check_pack_args(custom_mask, row_offsets, row_widths, num_words)
    num_tokens = row_offsets.shape[0]
    if num_tokens and int(row_widths.max()) > num_words * _WORD_BITS:
        raise ValueError(f"row_widths: a row is wider than {num_words} words")
    if num_tokens and int((row_offsets + row_widths).max()) > custom_mask.numel():
        raise ValueError("row_offsets: a row runs past the end of custom_mask")
    cols = torch.arange(num_words * _WORD_BITS, device=custom_mask.device)  # [C]
    inside = cols[None, :] < row_widths[:, None]  # [T, C]
    index = torch.where(inside, row_offsets[:, None] + cols[None, :], 0)
    bits = (custom_mask[index] & inside).view(num_tokens, num_words, _WORD_BITS).long()
    weights = torch.ones(_WORD_BITS, dtype=torch.int64, device=custom_mask.device)
    weights = weights << torch.arange(_WORD_BITS, device=custom_mask.device)  # bit 63 wraps
    return (bits * weights).sum(dim=-1)  # distinct bits: the sum is their OR


def check_pack_args(
    custom_mask: Tensor, row_offsets: Tensor, row_widths: Tensor, num_words: int
) -> None:
    """Shape and dtype checks shared by `pack_tree_mask` and its reference."""
    if custom_mask.ndim != 1 or custom_mask.dtype != torch.bool:
        raise ValueError("custom_mask: expected a 1-D bool tensor")
    if row_offsets.ndim != 1 or row_offsets.dtype != torch.int64:
        raise ValueError("row_offsets: expected a 1-D int64 tensor")
    if row_widths.shape != row_offsets.shape or row_widths.dtype != torch.int64:
        raise ValueError("row_widths: expected int64, shaped like row_offsets")
    if num_words < 1:
        raise ValueError(f"num_words: must be >= 1, got {num_words}")


def tree_attention_ref(
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
    """Attention of each query token over its request's paged KV (module docstring).
    `max_q_len` bounds every request's query count; `num_splits` and `batch_invariant` only
    shape the kernel's work and are checked, not used."""
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    if batch_invariant and num_splits != 1:
        raise ValueError("batch_invariant: needs num_splits == 1")
    if page_size < 1:
        raise ValueError(f"page_size: must be >= 1, got {page_size}")
    num_tokens = q.shape[0]
    cu = query_start_loc.tolist()
    lens = seq_lens.tolist()
    bs = len(lens)
    if len(cu) != bs + 1 or cu[0] != 0 or cu[-1] != num_tokens:
        raise ValueError("query_start_loc: expected [bs + 1] prefix sums ending at num_tokens")
    q_lens = [b - a for a, b in itertools.pairwise(cu)]
    if any(n < 0 or n > max_q_len for n in q_lens):
        raise ValueError(f"query_start_loc: a query length is outside [0, {max_q_len}]")
    if any(s < n for s, n in zip(lens, q_lens, strict=True)):
        raise ValueError("seq_lens: shorter than the request's new tokens")
    if (tree_mask is None) != (prefix_lens is None):
        raise ValueError("prefix_lens: given exactly when tree_mask is")
    if bs and max(lens) > page_table.shape[1] * page_size:
        raise ValueError("seq_lens: past the end of the page table")
    prefixes = prefix_lens.tolist() if prefix_lens is not None else [0] * bs
    device = q.device
    max_seq = max(max(lens, default=1), 1)
    max_q = max(max(q_lens, default=1), 1)
    idx = torch.arange(max_seq, device=device)  # [max_seq]
    pages = (
        page_table.to(device)
        .long()
        .gather(1, (idx // page_size).clamp(max=max(page_table.shape[1] - 1, 0)).expand(bs, -1))
    )  # [bs, max_seq]
    live = idx[None, :] < seq_lens.to(device)[:, None]  # [bs, max_seq]
    slots = torch.where(live, pages * page_size + idx % page_size, 0)
    if bs and int(slots.max()) >= k_cache.shape[0]:
        raise ValueError("page_table: a slot is outside the KV cache")
    allowed = torch.zeros(bs, max_q, max_seq, dtype=torch.bool, device=device)
    token_req = torch.repeat_interleave(
        torch.arange(bs, device=device), torch.tensor(q_lens, device=device, dtype=torch.int64)
    )
    token_row = (
        torch.arange(num_tokens, device=device)
        - torch.tensor(cu[:-1], dtype=torch.int64, device=device)[token_req]
    )
    for b in range(bs):
        q_len, seq_len, prefix = q_lens[b], lens[b], prefixes[b]
        rows = torch.arange(q_len, device=device)[:, None]  # [q_len, 1]
        cols = torch.arange(seq_len, device=device)[None, :]  # [1, seq_len]
        if tree_mask is None:
            allowed[b, :q_len, :seq_len] = cols <= seq_len - q_len + rows
            continue
        if not 0 <= prefix <= seq_len:
            raise ValueError(f"prefix_lens: {prefix} outside [0, {seq_len}]")
        tree_cols = (cols - prefix).clamp(min=0)
        words = tree_mask[cu[b] : cu[b + 1]]  # [q_len, num_words]
        if words.shape[1] * _WORD_BITS < seq_len - prefix:
            raise ValueError("tree_mask: fewer words than the widest row needs")
        word = words.gather(1, (tree_cols // _WORD_BITS).expand(q_len, -1))
        bit = (word >> (tree_cols % _WORD_BITS)) & 1
        allowed[b, :q_len, :seq_len] = (cols < prefix) | (bit != 0)
    seen = allowed.any(dim=-1)  # [bs, max_q]
    allowed[:, :, 0] |= ~seen  # keeps the softmax finite; those rows are zeroed below
    result = dense_attention_ref(
        q, k_cache, v_cache, slots, allowed, token_req, token_row, scale
    )  # [num_tokens, num_heads, head_dim]
    result = result.masked_fill(~seen[token_req, token_row][:, None, None], 0)
    if out is None:
        return result
    out.copy_(result)
    return out
