"""Torch reference of `paged.py`'s `paged_inputs`: the per-step inputs of a graph bucket whose
rows are computed on the device from each row's base (device-chain steps,
``tandem/target/chain_verify.py`` and ``chain_draft.py``): positions, KV slots through the page
table, sequence and prefix lengths, and optionally the tree mask of the kept tokens.

Row ``i`` of a bucket of width ``w`` covers the KV indices ``prefix[i] + offset + j`` for
``j < w``, where ``prefix = base + shift (+ accepted with prefix_accepted)``; its first
``count[i]`` tokens are kept, ``count = accepted + 1`` with ``count_accepted``, else ``w``. A
row that is not ``alive`` (padding) keeps nothing and has both lengths 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_paged_inputs(
    base: Tensor,
    accepted: Tensor | None,
    alive: Tensor,
    page_table: Tensor,
    slot_mapping: Tensor,
    seq_lens: Tensor,
    prefix_lens: Tensor,
    positions: Tensor | None,
    mask_src: Tensor | None,
    mask_dst: Tensor | None,
    *,
    page_size: int,
    needs_accepted: bool,
) -> int:
    """The shape contract; returns the width ``w``."""
    bs = base.shape[0]
    if base.dim() != 1 or base.dtype != torch.int64:
        raise ValueError(f"base: expected [bs] int64, got {tuple(base.shape)} {base.dtype}")
    if needs_accepted and (accepted is None or accepted.shape != (bs,)):
        raise ValueError("accepted: expected [bs] int64 where counts or prefixes use it")
    if alive.shape != (bs,) or alive.dtype != torch.bool:
        raise ValueError(f"alive: expected [{bs}] bool, got {tuple(alive.shape)} {alive.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] < bs or page_table.shape[1] < 1:
        raise ValueError(f"page_table: expected [>= {bs}, >= 1], got {tuple(page_table.shape)}")
    if page_size < 1:
        raise ValueError(f"page_size: must be >= 1, got {page_size}")
    if bs == 0 or slot_mapping.dim() != 1 or slot_mapping.numel() % bs:
        raise ValueError(f"slot_mapping: expected [bs * w], got {tuple(slot_mapping.shape)}")
    w = slot_mapping.numel() // bs
    for name, t in (("seq_lens", seq_lens), ("prefix_lens", prefix_lens)):
        if t.shape != (bs,):
            raise ValueError(f"{name}: expected [{bs}], got {tuple(t.shape)}")
    if positions is not None and positions.shape != (bs * w,):
        raise ValueError(f"positions: expected [{bs * w}], got {tuple(positions.shape)}")
    if (mask_src is None) != (mask_dst is None):
        raise ValueError("mask_src, mask_dst: give both or neither")
    if (
        mask_src is not None
        and mask_dst is not None
        and (mask_src.dim() != 2 or mask_src.shape[0] != bs * w or mask_dst.shape != mask_src.shape)
    ):
        raise ValueError(
            f"mask_src, mask_dst: expected [{bs * w}, words] each, got "
            f"{tuple(mask_src.shape)} and {tuple(mask_dst.shape)}"
        )
    return w


def paged_inputs_ref(
    base: Tensor,  # [bs] int64
    accepted: Tensor | None,  # [bs] int64 (needed with count_accepted or prefix_accepted)
    alive: Tensor,  # [bs] bool
    page_table: Tensor,  # [>= bs, max_pages] int32: each row's pages in logical order
    slot_mapping: Tensor,  # [bs * w] int64, written: physical slot, -1 where not kept
    seq_lens: Tensor,  # [bs] int64, written: (prefix + offset + count) * alive
    prefix_lens: Tensor,  # [bs] int64, written: prefix * alive
    positions: Tensor | None = None,  # [bs * w] int64, written: prefix + offset + j
    mask_src: Tensor | None = None,  # [bs * w, words] int64: each token's full mask row
    mask_dst: Tensor | None = None,  # [bs * w, words] int64, written: mask_src where kept, else 0
    *,
    page_size: int,
    shift: int = 0,  # prefix = base + shift (+ accepted)
    offset: int = 0,  # the first token's KV index past the prefix
    prefix_accepted: bool = False,
    count_accepted: bool = False,  # keep accepted + 1 tokens a row, else all w
) -> None:
    """Writes the bucket's per-step inputs from ``base`` (module docstring)."""
    w = check_paged_inputs(
        base, accepted, alive, page_table, slot_mapping, seq_lens, prefix_lens, positions,
        mask_src, mask_dst, page_size=page_size, needs_accepted=prefix_accepted or count_accepted,
    )  # fmt: skip
    bs = base.shape[0]
    j = torch.arange(w, device=base.device)
    prefix = base + shift
    if prefix_accepted:
        assert accepted is not None
        prefix = prefix + accepted
    if count_accepted:
        assert accepted is not None
        count = accepted + 1
    else:
        count = torch.full_like(base, w)
    index = prefix[:, None] + offset + j  # [bs, w] logical KV indices
    keep = (j < count[:, None]) & alive[:, None]
    table = page_table[:bs]
    page = table.gather(1, (index // page_size).clamp(0, table.shape[1] - 1)).long()
    slot_mapping.copy_(torch.where(keep, page * page_size + index % page_size, -1).view(-1))
    seq_lens.copy_((prefix + offset + count) * alive)
    prefix_lens.copy_(prefix * alive)
    if positions is not None:
        positions.copy_(index.view(-1))
    if mask_src is not None and mask_dst is not None:
        mask_dst.copy_(mask_src * keep.view(-1, 1))
