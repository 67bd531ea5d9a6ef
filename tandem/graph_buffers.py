"""Pieces shared by the CUDA-graph runners (``tandem/graphs.py`` for the target,
``tandem/spec/draft_graphs.py`` for the draft): bucket shapes, the packed int64 staging layout
that one host-to-device copy fills, tree-mask words, and the capture of one graph."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

WORD_BITS = 64


@dataclass(frozen=True, order=True)
class Bucket:
    """One captured shape: ``batch_size`` requests of ``width`` query rows."""

    batch_size: int
    width: int

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.width


@dataclass
class Layout:
    """Where a bucket's inputs sit in a packed int64 staging buffer: ``(offset, numel)`` per
    input, in int64 elements; an int32 page table takes half an element per entry."""

    spans: dict[str, tuple[int, int]]
    total: int

    @classmethod
    def packed(cls, sizes: dict[str, int]) -> Layout:
        """Spans one after the other, in the order of ``sizes``."""
        spans, offset = {}, 0
        for name, size in sizes.items():
            spans[name] = (offset, size)
            offset += size
        return cls(spans=spans, total=offset)


def page_table_elements(batch_size: int, max_pages: int) -> int:
    """int64 elements that hold a ``[batch_size, max_pages]`` int32 page table."""
    return -(-batch_size * max_pages // 2)


def write_page_table(
    host: np.ndarray,  # [total] int64, the staging buffer
    span: tuple[int, int],
    max_pages: int,
    batch_size: int,
    pages: Sequence[Sequence[int]],  # per real request, its pages in logical order
) -> None:
    """Writes the page table rows into their span, padded with the null page 0."""
    offset, size = span
    table = host[offset : offset + size].view(np.int32)[: batch_size * max_pages]
    table = table.reshape(batch_size, max_pages)
    table[:] = 0
    for i, row in enumerate(pages):
        table[i, : len(row)] = row


def mask_words(parents: Sequence[int], num_words: int) -> list[int]:  # [N * num_words]
    """Each node's ancestor bits (bit j = node j, itself included) as signed int64 words."""
    bits: list[int] = []
    for i, parent in enumerate(parents):
        bits.append((bits[parent] if parent >= 0 else 0) | 1 << i)
    words = []
    for row in bits:
        for k in range(num_words):
            word = row >> (k * WORD_BITS) & (1 << WORD_BITS) - 1
            words.append(word - (1 << WORD_BITS) if word >> (WORD_BITS - 1) else word)
    return words


def capture_graph(
    device: torch.device, pool: Any, forward: Callable[[], None]
) -> torch.cuda.CUDAGraph:
    """Runs ``forward`` once outside the capture (it compiles the kernels and warms cuBLAS),
    then captures it into a graph that allocates from ``pool`` (``torch.cuda.graph_pool_handle()``,
    whose type torch keeps private). Both run in inference mode, whatever the caller's: with
    grad on and parameters that ask for it, ``fused_ops`` would record the eager references
    (a draft's graphs captured at load did, about 120 more kernels a bs-1 draft step)."""
    with torch.inference_mode():
        forward()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (the draft client's) may touch CUDA.
        with (
            torch.cuda.device(device),
            torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"),
        ):
            forward()
    return graph
