"""Torch reference attention over the paged KV cache (CPU and GPU; any mask).

The oracle for the Triton kernels and the CPU path. It loops over requests on the host, which is
fine for a reference and for CPU serving of small models; the GPU path uses the kernels.
"""

from __future__ import annotations

import torch

from tandem.attention.metadata import AttentionMetadata


class TorchAttention:
    """Stores new K/V through ``slot_mapping``, then attends per request through the page table."""

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
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        page_size = meta.page_size
        mask_offset = 0
        q_start = 0
        for i, (q_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            if q_len == 0:
                continue
            prefix_len = seq_len - q_len
            idx = torch.arange(seq_len, device=q.device)
            slots = meta.page_table[i, idx // page_size].to(torch.int64) * page_size
            slots += idx % page_size
            keys = k_cache[slots].to(torch.float32)  # [seq_len, num_kv_heads, head_dim]
            values = v_cache[slots].to(torch.float32)
            qi = q[q_start : q_start + q_len].to(torch.float32)  # [q_len, num_heads, head_dim]
            # [num_kv_heads, group, q_len, head_dim] x [num_kv_heads, head_dim, seq_len]
            qi = qi.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            scores = torch.matmul(qi, keys.permute(1, 2, 0).unsqueeze(1)) * scale
            allowed = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
            if meta.custom_mask is not None:
                block = meta.custom_mask[mask_offset : mask_offset + q_len * q_len]
                allowed[:, prefix_len:] = block.view(q_len, q_len)
            else:
                allowed[:, prefix_len:] = torch.ones(
                    q_len, q_len, dtype=torch.bool, device=q.device
                ).tril_()
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            # [num_kv_heads, group, q_len, head_dim] -> [q_len, num_heads, head_dim]
            attn = torch.matmul(probs, values.permute(1, 0, 2).unsqueeze(1))
            out[q_start : q_start + q_len] = attn.permute(2, 0, 1, 3).reshape(
                q_len, num_heads, head_dim
            )
            q_start += q_len
            mask_offset += q_len * q_len
        return out


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
