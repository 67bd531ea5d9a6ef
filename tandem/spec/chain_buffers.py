"""The two buffers a device-chain step's halves hand off through
(``tandem/target/device_chain.py``): ``Outcome``, what a verification hands the draft, and
``Chains``, what the draft hands the next verification, both on the device. Each is allocated by the
half that reads it and written by the other (docs/device-cycle.md); in one process both halves
launch on one stream, so stream order is the only hand-off. Also the helpers both halves use on
them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Outcome:
    """One verification for the draft ([bs] rows of the run's bucket; rows past the run pad)."""

    base: torch.Tensor  # [bs] int64: KV index (and position) of each verified chain's node 0
    accepted: torch.Tensor  # [bs] int64: drafts accepted
    new: torch.Tensor  # [bs, S+1] int64: accepted drafts then the bonus (later rows unused)
    alive: torch.Tensor  # [bs] bool: rows of the run's requests
    features: torch.Tensor | None  # [bs * (S+1), F]: target features of every node


@dataclass
class Chains:
    """The chain of every row for the next verification."""

    tokens: torch.Tensor  # [bs, S+1] int64: node 0 (the verified token), then the drafts
    valid: torch.Tensor  # [bs, S] bool: drafts with finite logits (a chain ends at the first not)


def share_on_cpu(*tensors: torch.Tensor) -> None:
    """CPU buffers another process may map move to shared memory (``tandem/link/ipc.py``'s
    stand-in for CUDA IPC); on CUDA nothing is needed."""
    for tensor in tensors:
        if tensor.device.type == "cpu":
            tensor.share_memory_()


def grow_tables(tables: Sequence[torch.Tensor], row: int, pages: list[int], written: int) -> int:
    """Writes ``pages[written:]`` into row ``row`` of every page table ([bs, max_pages]
    int32 on the device) behind the stream, from pinned memory; returns the pages written."""
    if len(pages) <= written:
        return written
    new = torch.tensor(pages[written:], dtype=torch.int32)
    on_cuda = tables[0].device.type == "cuda"
    new = new.pin_memory() if on_cuda else new
    for table in tables:
        table[row, written : len(pages)].copy_(new, non_blocking=on_cuda)
    return len(pages)
