"""Attention metadata: how a flat batch of query tokens maps onto requests and paged KV."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.transfer import to_device


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
    # [sum(q_len_i * (seq_len_i - prefix_len_i))] bool, one row-major [q_len_i, seq_len_i -
    # prefix_len_i] block per request: entry (r, c) says whether new token r sees KV index
    # prefix_len_i + c. None means causal over the new tokens for every request.
    custom_mask: torch.Tensor | None = None
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # KV indices [0, prefix_len_i) are visible to every new token of request i; None means
    # prefix_len_i = seq_len_i - q_len_i (the mask covers exactly the new tokens). A shorter
    # prefix lets the mask also hide earlier entries: tree drafting keeps all drafted nodes
    # in KV and lets each one see only its ancestors.
    prefix_lens_cpu: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.query_lens_cpu) != len(self.seq_lens_cpu):
            raise ValueError("query_lens_cpu: length differs from seq_lens_cpu")
        for q_len, seq_len in zip(self.query_lens_cpu, self.seq_lens_cpu, strict=True):
            if q_len < 0 or seq_len < q_len:
                raise ValueError(f"seq_lens_cpu: {seq_len} is shorter than its {q_len} new tokens")
        if self.prefix_lens_cpu is not None:
            if len(self.prefix_lens_cpu) != len(self.seq_lens_cpu):
                raise ValueError("prefix_lens_cpu: length differs from seq_lens_cpu")
            for prefix, q_len, seq_len in zip(
                self.prefix_lens_cpu, self.query_lens_cpu, self.seq_lens_cpu, strict=True
            ):
                if not 0 <= prefix <= seq_len - q_len:
                    raise ValueError(f"prefix_lens_cpu: {prefix} outside [0, {seq_len - q_len}]")

    def prefix_len(self, i: int) -> int:
        """KV entries of request ``i`` that all its new tokens see."""
        if self.prefix_lens_cpu is not None:
            return self.prefix_lens_cpu[i]
        return self.seq_lens_cpu[i] - self.query_lens_cpu[i]

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
        # per request [q_len, seq_len - prefix_len] bool (None = causal over the new tokens)
        masks: Sequence[torch.Tensor | None] | None = None,
        prefix_lens: Sequence[int] | None = None,
    ) -> AttentionMetadata:
        """Builds metadata from host-side lengths; ``masks`` entries of None are causal."""
        device = slot_mapping.device
        cu = [0]
        for q_len in query_lens:
            cu.append(cu[-1] + q_len)
        if prefix_lens is None:
            prefix_lens = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
        custom_mask = None
        if masks is not None and any(m is not None for m in masks):
            widths = [s - p for s, p in zip(seq_lens, prefix_lens, strict=True)]
            custom_mask = to_device(build_custom_mask(masks, query_lens, widths), device)
        return cls(
            page_size=page_size,
            query_start_loc=to_device(torch.tensor(cu, dtype=torch.int64), device),
            seq_lens=to_device(torch.tensor(list(seq_lens), dtype=torch.int64), device),
            page_table=page_table,
            slot_mapping=slot_mapping,
            custom_mask=custom_mask,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            prefix_lens_cpu=list(prefix_lens),
        )


@dataclass(kw_only=True)
class GraphMetadata:
    """A CUDA-graph bucket's metadata: ``bs`` requests of ``width`` query rows each, every
    request masked (prefix + tree mask), or every request causal when ``tree_mask`` and
    ``prefix_lens`` are None (``tandem.target.prefill_graphs``: a prompt chunk). The tensors are the
    graph runner's static buffers, refilled in place before each replay; nothing here lives on
    the host, because a captured forward must not read lengths there. A request with fewer real
    rows pads the rest (slot -1, mask 0); a padding request has ``seq_len = prefix_len = 0``
    and sees nothing."""

    page_size: int
    width: int  # query rows per request: the kernel's grid bound (max_q_len)
    num_splits: int  # split-KV count, fixed at capture (a grid bound too)
    query_start_loc: torch.Tensor  # [bs + 1] int64, 0, width, 2 * width, ...
    seq_lens: torch.Tensor  # [bs] int64, prefix + real rows (0 for a padding request)
    prefix_lens: torch.Tensor | None  # [bs] int64, KV entries every row sees (None: causal)
    tree_mask: torch.Tensor | None  # [bs * width, num_words] int64, ancestor bits per row
    page_table: torch.Tensor  # [bs, max_pages] int32, padded with the null page
    slot_mapping: torch.Tensor  # [bs * width] int64, -1 for padding rows (not stored)

    def masked(self) -> tuple[torch.Tensor, torch.Tensor]:  # prefix_lens, tree_mask
        """The mask inputs of a masked bucket (every decode/verify/draft bucket)."""
        if self.prefix_lens is None or self.tree_mask is None:
            raise ValueError("a causal bucket has no tree mask")
        return self.prefix_lens, self.tree_mask


def build_custom_mask(
    masks: Sequence[torch.Tensor | None],
    query_lens: Sequence[int],
    widths: Sequence[int] | None = None,
) -> torch.Tensor:  # [sum(q_len_i * width_i)] bool
    """Packs per-request [q_len, width] masks into the flat layout. ``width`` defaults to
    ``q_len``; None masks are causal over the last ``q_len`` columns (earlier ones visible)."""
    if len(masks) != len(query_lens):
        raise ValueError("masks: one entry per request expected")
    if widths is None:
        widths = query_lens
    blocks = []
    for mask, q_len, width in zip(masks, query_lens, widths, strict=True):
        if mask is None:
            mask = causal_mask(q_len, width)
        elif tuple(mask.shape) != (q_len, width):
            raise ValueError(f"masks: shape {tuple(mask.shape)} != ({q_len}, {width})")
        blocks.append(mask.to(device="cpu", dtype=torch.bool).reshape(-1))
    if not blocks:
        return torch.zeros(0, dtype=torch.bool)
    return torch.cat(blocks)


def causal_mask(q_len: int, width: int) -> torch.Tensor:  # [q_len, width] bool
    """Row r sees columns ``<= width - q_len + r``: the last ``q_len`` columns are the new
    tokens, earlier ones visible to all. (A comparison, not ``Tensor.tril_``, which is slow on
    some CPUs for bool masks of verify-tree sizes.)"""
    return torch.arange(width)[None, :] <= torch.arange(width - q_len, width)[:, None]
