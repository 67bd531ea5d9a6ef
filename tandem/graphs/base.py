"""Pieces shared by the CUDA-graph runners (``tandem/target/graphs.py`` and
``tandem/target/prefill_graphs.py`` for the target, ``tandem/draft/graphs.py`` for the draft):
bucket shapes, the packed int64 staging layout that one host-to-device copy fills, tree-mask words,
the capture of one graph and of a runner's set of graphs."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.attention import AttentionMetadata, GraphMetadata
from tandem.kv import KVCache

if TYPE_CHECKING:  # triton is imported when a runner is built, never by importing this module
    from tandem.attention.triton_backend import GraphAttention, TritonAttention
    from tandem.models import DecoderLM

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


class Staging:
    """The pinned host buffer (on CUDA) a runner writes a step's packed inputs into, grown on
    demand, and the one non-blocking copy to the device per step; the copy's event keeps the
    next step from rewriting the buffer before the copy has read it."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self._host = torch.zeros(0, dtype=torch.int64)
        self._copied = torch.cuda.Event() if self.on_cuda else None

    def host(self, total: int) -> np.ndarray:  # [>= total] int64
        """The buffer to write, once the last step's copy has read it."""
        if self._copied is not None:
            self._copied.synchronize()
        if self._host.numel() < total:
            self._host = torch.zeros(total, dtype=torch.int64, pin_memory=self.on_cuda)
        return self._host.numpy()

    def upload(self, inputs: torch.Tensor, total: int) -> None:
        """Copies the first ``total`` elements into ``inputs`` (on the device)."""
        inputs[:total].copy_(self._host[:total], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


def placeholder_metadata(kv: KVCache) -> AttentionMetadata:
    """A forward context's metadata in a captured region, never read: the bucket's
    ``GraphAttention`` reads its static buffers instead."""
    device = kv.k_caches[0].device
    return AttentionMetadata.build(
        page_size=kv.spec.page_size,
        query_lens=[],
        seq_lens=[],
        page_table=torch.zeros(0, 0, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
    )


def graph_attention(
    attention: TritonAttention,
    kv: KVCache,
    *,
    num_heads: int,
    batch_size: int,  # the bucket's requests (the split count's occupancy estimate)
    width: int,
    max_pages: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    page_table: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> GraphAttention:
    """A bucket's attention backend over its static buffers: ``attention``'s split policy for
    the longest context the bucket may see (``max_pages``), its batch invariance."""
    from tandem.attention.triton_backend import GraphAttention

    meta = GraphMetadata(
        page_size=kv.spec.page_size,
        width=width,
        num_splits=attention.graph_splits(
            batch_size=batch_size,
            width=width,
            num_heads=num_heads,
            num_kv_heads=kv.spec.num_kv_heads,
            head_dim=kv.spec.head_dim,
            max_kv_len=max_pages * kv.spec.page_size,
            device=kv.k_caches[0].device,
        ),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        prefix_lens=prefix_lens,
        tree_mask=tree_mask,
        page_table=page_table,
        slot_mapping=slot_mapping,
    )
    return GraphAttention(meta, batch_invariant=attention.batch_invariant)


def features_buffer(
    model: DecoderLM, layers: Sequence[int], rows: int, device: torch.device
) -> torch.Tensor | None:  # [rows, len(layers) * hidden]
    """Where a runner's graphs write the target features of ``layers`` (None without any)."""
    if not layers:
        return None
    size = len(layers) * model.config.hidden_size
    return torch.zeros(rows, size, dtype=model.embed_tokens.weight.dtype, device=device)


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
            no_collection(),
            torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"),
        ):
            forward()
    return graph


@contextmanager
def no_collection() -> Iterator[None]:
    """No automatic garbage collection in this block (``torch.cuda.graph`` collects once before
    it captures): a collection inside a capture runs the finalizers of whatever it frees on
    the capturing thread, and one that calls CUDA (an event, a pinned buffer, an IPC mapping)
    invalidates the capture (cudaErrorStreamCaptureInvalidated, reported at a later launch).
    Captures that failed so in tests/spec/test_cuda_spec.py had collections running inside
    them; that these caused the failures is not proven."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_all(
    device: torch.device,
    jobs: Sequence[tuple[str, Callable[[], None], Callable[[], None]]],  # what, stage, forward
    log: logging.Logger,
    label: str,
    summary: str,
) -> list[torch.cuda.CUDAGraph]:
    """Captures one graph per job, in order, into one pool (largest first, so that the others
    reuse its memory): ``stage`` fills the graph's static inputs (padding only: a capture
    touches no live KV), then ``forward`` is captured (``capture_graph``). Logs ``"<label>
    k/n: <what> in t s"`` per graph and ``"captured <summary> in t s: MiB taken, GiB free of
    total"`` at the end."""
    torch.cuda.synchronize(device)
    free_before, total = torch.cuda.mem_get_info(device)
    pool = torch.cuda.graph_pool_handle()
    started = time.perf_counter()
    graphs = []
    for k, (what, stage, forward) in enumerate(jobs, 1):
        t0 = time.perf_counter()
        stage()
        graphs.append(capture_graph(device, pool, forward))
        log.info("%s %d/%d: %s in %.2f s", label, k, len(jobs), what, time.perf_counter() - t0)
    torch.cuda.synchronize(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    log.info(
        "captured %s in %.1f s: %.0f MiB, %.1f of %.1f GiB free",
        summary,
        time.perf_counter() - started,
        (free_before - free_after) / 2**20,
        free_after / 2**30,
        total / 2**30,
    )
    return graphs
