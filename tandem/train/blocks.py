"""Documents -> one token stream -> fixed-length blocks, and seeded batches over them.

Each document becomes ``[bos] + ids + [eos]`` (either special left out when the tokenizer has
none); documents are concatenated in the order of their sources' hashes (a fixed shuffle, so
held-out evaluation sees many packages, not the first few alphabetically) and the stream is
cut into blocks of ``seq_len`` tokens; the tail shorter than a block is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.train.corpus import Document, path_fraction

_ENCODE_CHUNK = 256  # documents per batch encode call


@dataclass(frozen=True)
class TokenData:
    """What a trainer reads: train and held-out blocks (and, for drafts, target-generated
    sequences of the same length)."""

    train: torch.Tensor  # [num_train_blocks, seq_len] int64
    heldout: torch.Tensor  # [num_heldout_blocks, seq_len] int64
    generated: torch.Tensor | None = None  # [num_generated, seq_len] int64 target continuations

    def __post_init__(self) -> None:
        if self.train.ndim != 2 or self.train.shape[0] == 0:
            raise ValueError("train: need at least one block (more data or a shorter seq_len)")
        if self.heldout.ndim != 2 or self.heldout.shape[1] != self.train.shape[1]:
            raise ValueError(f"heldout: blocks must be {self.train.shape[1]} tokens long")
        if self.generated is not None and self.generated.shape[1] != self.train.shape[1]:
            raise ValueError(f"generated: sequences must be {self.train.shape[1]} tokens long")

    @property
    def seq_len(self) -> int:
        return int(self.train.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.train.numel())

    def with_seq_len(self, seq_len: int) -> TokenData:
        """Blocks re-cut to ``seq_len`` (a divisor: split; otherwise: cropped)."""
        if seq_len == self.seq_len:
            return self
        if not 2 <= seq_len <= self.seq_len:
            raise ValueError(f"seq_len: must be in [2, {self.seq_len}], got {seq_len}")

        def recut(blocks: torch.Tensor) -> torch.Tensor:
            if self.seq_len % seq_len == 0:
                return blocks.reshape(-1, seq_len)
            return blocks[:, :seq_len].contiguous()

        generated = None if self.generated is None else recut(self.generated)
        return TokenData(recut(self.train), recut(self.heldout), generated)


def encode(docs: Sequence[Document], tokenizer: Any) -> list[torch.Tensor]:
    """Each document's ids with BOS/EOS, as int64 tensors (batch-encoded, fast tokenizer)."""
    backend = tokenizer.backend_tokenizer
    bos: list[int] = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    eos: list[int] = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    out: list[torch.Tensor] = []
    texts = [d for d in docs if d.token_ids is None]
    encoded: dict[str, list[int]] = {}
    for start in range(0, len(texts), _ENCODE_CHUNK):
        chunk = texts[start : start + _ENCODE_CHUNK]
        for doc, enc in zip(
            chunk,
            backend.encode_batch([d.text for d in chunk], add_special_tokens=False),
            strict=True,
        ):
            encoded[doc.source] = enc.ids
    for doc in docs:
        ids = list(doc.token_ids) if doc.token_ids is not None else encoded[doc.source]
        out.append(torch.tensor(bos + ids + eos, dtype=torch.int64))
    return out


def pack(docs: Sequence[Document], token_ids: Sequence[torch.Tensor], seq_len: int) -> torch.Tensor:
    """[num_blocks, seq_len]: the documents' ids in hash order, concatenated and cut."""
    if seq_len < 2:
        raise ValueError(f"seq_len: must be >= 2, got {seq_len}")
    order = sorted(range(len(docs)), key=lambda i: (path_fraction(docs[i].source), docs[i].source))
    if not order:
        return torch.zeros(0, seq_len, dtype=torch.int64)
    stream = torch.cat([token_ids[i] for i in order])
    usable = stream.numel() // seq_len * seq_len
    return stream[:usable].view(-1, seq_len).clone()


def token_data(
    train_docs: Sequence[Document], heldout_docs: Sequence[Document], tokenizer: Any, seq_len: int
) -> TokenData:
    """Train and held-out documents encoded and packed into blocks of ``seq_len``."""
    train = pack(train_docs, encode(train_docs, tokenizer), seq_len)
    heldout = pack(heldout_docs, encode(heldout_docs, tokenizer), seq_len)
    return TokenData(train, heldout)


class Batches:
    """Endless seeded batches of row indices: each source is walked through one random
    permutation per epoch; ``counts[i]`` rows of source ``i`` go into every batch."""

    def __init__(self, sizes: Sequence[int], counts: Sequence[int], seed: int) -> None:
        if len(sizes) != len(counts) or any(n < 1 for n in sizes) or sum(counts) < 1:
            raise ValueError("sizes/counts: one positive size per source and a non-empty batch")
        self.sizes, self.counts = list(sizes), list(counts)
        self.gen = torch.Generator().manual_seed(seed)
        self.orders = [torch.randperm(n, generator=self.gen) for n in self.sizes]
        self.cursors = [0] * len(sizes)

    def next(self) -> list[torch.Tensor]:
        """One index tensor per source (``counts[i]`` entries each)."""
        out = []
        for i, count in enumerate(self.counts):
            rows, taken = [], 0
            while taken < count:
                if self.cursors[i] == self.sizes[i]:
                    self.orders[i] = torch.randperm(self.sizes[i], generator=self.gen)
                    self.cursors[i] = 0
                take = min(count - taken, self.sizes[i] - self.cursors[i])
                rows.append(self.orders[i][self.cursors[i] : self.cursors[i] + take])
                self.cursors[i] += take
                taken += take
            out.append(torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64))
        return out
