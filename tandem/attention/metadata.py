"""Attention metadata: how a flat batch of query tokens maps onto requests and paged KV."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class AttentionMetadata:
    """Per-step description of a ragged batch, shared by every layer of one forward.

    Device tensors feed kernels; the ``*_cpu`` lists are the same numbers already on the host
    (the scheduler computed them), so planning never needs a device sync.
    """

    page_size: int
    query_start_loc: torch.Tensor  # [bs + 1] int64, prefix sums of query lengths (cu_q_lens)
    seq_lens: torch.Tensor  # [bs] int64, KV length of each request including this step's tokens
    page_table: torch.Tensor  # [bs, max_pages] int32, padded with the null page 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, KV slot each new token is written to
    # [sum(q_len_i ** 2)] bool, row-major [q_len_i, q_len_i] block per request: entry (r, c) says
    # whether new token r sees new token c. None means causal for every request.
    custom_mask: torch.Tensor | None = None
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    def __post_init__(self) -> None:
        if len(self.query_lens_cpu) != len(self.seq_lens_cpu):
            raise ValueError("query_lens_cpu: length differs from seq_lens_cpu")
        for q_len, seq_len in zip(self.query_lens_cpu, self.seq_lens_cpu, strict=True):
            if q_len < 0 or seq_len < q_len:
                raise ValueError(f"seq_lens_cpu: {seq_len} is shorter than its {q_len} new tokens")

    @property
    def batch_size(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @classmethod
    def build(
        cls,
        *,
        page_size: int,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        page_table: torch.Tensor,  # [bs, max_pages] int32
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        masks: Sequence[torch.Tensor | None] | None = None,  # per request [q_len, q_len] bool
    ) -> AttentionMetadata:
        """Builds metadata from host-side lengths; ``masks`` entries of None are causal."""
        device = slot_mapping.device
        cu = [0]
        for q_len in query_lens:
            cu.append(cu[-1] + q_len)
        custom_mask = None
        if masks is not None and any(m is not None for m in masks):
            custom_mask = build_custom_mask(masks, query_lens).to(device)
        return cls(
            page_size=page_size,
            query_start_loc=torch.tensor(cu, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int64, device=device),
            page_table=page_table,
            slot_mapping=slot_mapping,
            custom_mask=custom_mask,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )


def build_custom_mask(
    masks: Sequence[torch.Tensor | None], query_lens: Sequence[int]
) -> torch.Tensor:  # [sum(q_len_i ** 2)] bool
    """Packs per-request [q_len, q_len] masks (None = causal) into the flat layout."""
    if len(masks) != len(query_lens):
        raise ValueError("masks: one entry per request expected")
    blocks = []
    for mask, q_len in zip(masks, query_lens, strict=True):
        if mask is None:
            mask = torch.ones(q_len, q_len, dtype=torch.bool).tril_()
        elif tuple(mask.shape) != (q_len, q_len):
            raise ValueError(f"masks: shape {tuple(mask.shape)} != ({q_len}, {q_len})")
        blocks.append(mask.to(device="cpu", dtype=torch.bool).reshape(-1))
    if not blocks:
        return torch.zeros(0, dtype=torch.bool)
    return torch.cat(blocks)
