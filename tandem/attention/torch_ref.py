"""Torch reference attention over the paged KV cache (CPU and GPU; any mask).

The oracle for the Triton kernels and the CPU path. Requests are padded to the longest query
and KV length of the batch, so each layer is a handful of batched ops; the padded layout
(slots, visibility) is built once per forward and shared by every layer. The math itself is
``kernels.reference_attention.dense_attention_ref``, which the kernels' oracle shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference_attention import dense_attention_ref
from tandem.attention.metadata import AttentionMetadata, causal_mask


@dataclass
class _Dense:
    """The batch padded to [bs, max_q] queries over [bs, max_seq] KV entries."""

    slots: torch.Tensor  # [bs, max_seq] int64 KV slot of each entry (the null page past seq_len)
    allowed: torch.Tensor  # [bs, max_q, max_seq] bool, which entries each query sees
    token_req: torch.Tensor  # [num_tokens] int64 request of each flat token
    token_row: torch.Tensor  # [num_tokens] int64 its query index within the request


class TorchAttention:
    """Stores new K/V through ``slot_mapping``, then attends through the page table."""

    def __init__(self) -> None:
        self._cache: tuple[AttentionMetadata, _Dense] | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        dense = self._dense(meta, q.device)
        return dense_attention_ref(
            q,
            k_cache,
            v_cache,
            dense.slots,
            dense.allowed,
            dense.token_req,
            dense.token_row,
            scale,
        )

    def _dense(self, meta: AttentionMetadata, device: torch.device) -> _Dense:
        if self._cache is not None and self._cache[0] is meta:
            return self._cache[1]
        bs = meta.batch_size
        max_q = max(meta.query_lens_cpu)
        max_seq = max(meta.seq_lens_cpu)
        page_size = meta.page_size
        seq_lens = torch.tensor(meta.seq_lens_cpu, device=device)  # [bs]
        idx = torch.arange(max_seq, device=device)  # [max_seq]
        live = idx[None, :] < seq_lens[:, None]  # [bs, max_seq]
        pages = meta.page_table.to(device).gather(
            1, (idx // page_size).clamp(max=meta.page_table.shape[1] - 1).expand(bs, -1)
        )  # [bs, max_seq]
        slots = torch.where(live, pages.to(torch.int64) * page_size + idx % page_size, 0)
        allowed = torch.zeros(bs, max_q, max_seq, dtype=torch.bool)
        token_req: list[int] = []
        token_row: list[int] = []
        offset = 0
        for i, (q_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            prefix = meta.prefix_len(i)
            width = seq_len - prefix
            allowed[i, :q_len, :prefix] = True
            if meta.custom_mask is not None:
                block = meta.custom_mask[offset : offset + q_len * width].cpu()
                allowed[i, :q_len, prefix:seq_len] = block.view(q_len, width)
                offset += q_len * width
            else:
                causal = causal_mask(q_len, width)
                allowed[i, :q_len, prefix:seq_len] = causal
            token_req += [i] * q_len
            token_row += range(q_len)
        # Padded query rows see the null slot only, so their softmax stays finite.
        allowed[:, :, 0] |= ~allowed.any(dim=-1)
        dense = _Dense(
            slots=slots,
            allowed=allowed.to(device),
            token_req=torch.tensor(token_req, dtype=torch.int64, device=device),
            token_row=torch.tensor(token_row, dtype=torch.int64, device=device),
        )
        self._cache = (meta, dense)
        return dense


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Writes each token's K/V into its slot."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
