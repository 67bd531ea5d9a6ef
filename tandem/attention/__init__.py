"""Attention backends.

A backend writes the new tokens' K/V into the paged cache and attends each query token to its
request's KV through the page table. One metadata layout covers prefill, chunked prefill, decode
and tree verification: request ``i`` contributes ``q_len_i`` new tokens, stored at logical KV
indices ``[seq_len_i - q_len_i, seq_len_i)``; every new token sees the whole prefix before them
and those new tokens its row of the per-request mask allows (causal when no mask is given).
RoPE positions are separate from KV indices, which is what lets a tree's nodes sit at
``L - 1 + depth`` while occupying consecutive KV slots.

``backend_for(device)`` picks the backend: ``TritonAttention`` (``triton_backend.py``) on CUDA,
``TorchAttention`` elsewhere. A CUDA-graph bucket runs ``GraphAttention`` over its
``GraphMetadata`` (static buffers, fixed shapes; Triton only).
"""

from tandem.attention.backend import AttentionBackend, backend_for
from tandem.attention.metadata import AttentionMetadata, GraphMetadata, build_custom_mask
from tandem.attention.torch_ref import TorchAttention

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "GraphMetadata",
    "TorchAttention",
    "backend_for",
    "build_custom_mask",
]
