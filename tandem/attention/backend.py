"""The attention-backend interface and the choice of backend for a device."""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.attention.metadata import AttentionMetadata
from tandem.attention.torch_ref import TorchAttention


class AttentionBackend(Protocol):
    """Stores the new tokens' K/V through ``meta.slot_mapping``, then attends every query
    token to its request's KV as the metadata describes (module docstring of the package)."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


def backend_for(device: torch.device | str, *, batch_invariant: bool = False) -> AttentionBackend:
    """The Triton kernels on CUDA (``batch_invariant``: their batch-invariant tiles, one KV
    split), the torch reference elsewhere. Triton is imported only here, so CPU-only installs
    never need it."""
    if torch.device(device).type == "cuda":
        from tandem.attention.triton_backend import TritonAttention

        return TritonAttention(batch_invariant=batch_invariant)
    return TorchAttention()
