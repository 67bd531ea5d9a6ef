"""The two buffers a device-chain step's halves hand off through
(``tandem/target/device_chain.py``): ``Outcome``, what a verification hands the draft, and
``Chains``, what the draft hands the next verification, both on the device. Each is allocated by the
half that reads it and written by the other (docs/device-cycle.md); in one process both halves
launch on one stream, so stream order is the only hand-off. Also the helpers both halves use on
them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.graphs.base import Bucket


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


class DraftHalf(ABC):
    """The draft's share of a run, as the target's half drives it: ``begin`` a run of rows,
    then per step ``reserve`` and ``launch`` (queued behind the target's half) and ``commit``
    what each read step accepted, and ``end`` it once every step is read."""

    request_ids: list[str]  # the run's requests, in row order
    outcome: Outcome | None  # the run's bucket's, written by the target's half
    chains: Chains | None  # the target's, bound for the run: the draft writes them
    failed: str  # why the run's last step went without the draft ('' when it did not)
    steps: dict[Bucket, int]  # steps launched per bucket
    # Changes when the draft's buffers are mapped afresh (a new link to a draft service): the
    # graphs captured over the old ones capture again (``DeviceChain.warm``).
    epoch: int = 0

    @abstractmethod
    def ready(self) -> bool:
        """Whether a run may start now."""

    @abstractmethod
    def eligible(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request, with ``num_tokens`` committed, may join a run."""

    @abstractmethod
    def begin(
        self, request_ids: Sequence[str], bucket: Bucket, *, features_width: int | None
    ) -> Outcome | None:
        """Stages a run of ``request_ids`` in ``bucket`` (``features_width``: the target
        features per token it hands over, None for token-only drafts); the ``Outcome`` the
        target writes, or None when the draft cannot take the run (the ordinary cycle goes
        on)."""

    @abstractmethod
    def reserve(self, lengths: Sequence[int], unread: int) -> bool:
        """Reserves the draft's pages for the next launch (rows with ``lengths`` committed,
        ``unread`` steps launched and not read); False when its pool is full."""

    @abstractmethod
    def launch(self) -> bool:
        """Queues the draft's half of a step behind the target's; False (and ``failed`` says
        why) when it did not."""

    @abstractmethod
    def commit(self, request_id: str, tokens: list[int]) -> None:
        """A read step's tokens for the request: accepted drafts and the bonus token."""

    @abstractmethod
    def end(self, finished: Sequence[bool]) -> None:
        """Ends the run once every step is read; ``finished`` rows leave the draft."""


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
