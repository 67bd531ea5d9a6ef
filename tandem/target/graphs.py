"""CUDA-graph runner for the target's decode and verify steps (docs/design.md section 7).

A step in which every request verifies a tree (plain decoding: a tree of one node) replays the
graph of its bucket: ``batch_size`` requests, the smallest captured size that holds the batch,
of ``width`` rows each, 1 when every tree has one node, else the smallest captured width that
holds the largest tree (the spec tree size N). Shorter trees and missing requests pad. Any other
step (a prompt chunk, a tree wider than every width, more requests than the largest bucket)
runs eagerly.

What a replay may and may not do (SGLang #25015, #22041; docs/design.md section 3):

- Inputs live in static buffers that the host refills before each replay: one packed staging
  tensor, one host-to-device copy. Positions come from the committed length and the tree
  depths, computed on the host; the captured region increments nothing, and it writes only the
  KV of real rows and the runner's own output buffers, so replaying it again with the same
  inputs gives the same result.
- Padding: rows past a tree's size have slot -1 (``store_kv`` skips them) and an empty mask row
  (they see the prefix); padding requests have ``seq_len = prefix_len = 0`` (they see nothing).
  Every padded row yields finite values that nobody reads.
- Outputs (logits, captured target features) are written inside the graph into buffers the
  runner owns, and the real rows are gathered into new tensors right after the replay, before
  the next replay overwrites them.

``capture=False`` ("eager static") runs the same buffers and padding without capturing, for
CPU tests (Triton interpreted) and for debugging a graph against its own eager twin.

Known limits: the page table is uploaded whole (``batch_size x max_pages`` int32) with every
step; a device-resident page table updated on allocation lifts that. A change of the captured
feature layers (a remote draft announces them when it connects) recaptures every bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from tandem.graphs.base import (
    WORD_BITS,
    Bucket,
    Layout,
    Staging,
    capture_all,
    features_buffer,
    graph_attention,
    mask_words,
    page_table_elements,
    placeholder_metadata,
    write_page_table,
)
from tandem.kv import KVCache
from tandem.models import DecoderLM, ForwardContext
from tandem.spec.types import Tree

if TYPE_CHECKING:  # triton is imported when a runner is built, never by importing this module
    from tandem.attention.triton_backend import GraphAttention, TritonAttention

logger = logging.getLogger(__name__)


@dataclass
class GraphBatch:
    """One step in a bucket's padded layout, as host lists (``TargetGraphRunner.plan``)."""

    bucket: Bucket
    input_ids: list[int]  # [num_tokens] (request i's row j at i * width + j)
    positions: list[int]  # [num_tokens]
    slot_mapping: list[int]  # [num_tokens], -1 for padding rows
    tree_mask: list[int]  # [num_tokens * num_words] signed int64 words of ancestor bits
    seq_lens: list[int]  # [batch_size], 0 for padding requests
    prefix_lens: list[int]  # [batch_size]
    pages: list[list[int]]  # per real request, its pages in logical order
    rows: list[int]  # [num_rows] the real rows, in the flat order of the eager batch
    # One-token decodes whose tokens are still on the device ([requests] int64, written over
    # input_ids after staging; ``tandem.target.ahead``), or None.
    device_ids: torch.Tensor | None = None


def _layout(bucket: Bucket, num_words: int, max_pages: int) -> Layout:
    """Where a bucket's inputs sit in the packed int64 staging buffer."""
    bs, t = bucket.batch_size, bucket.num_tokens
    return Layout.packed(
        {
            "input_ids": t,
            "positions": t,
            "slot_mapping": t,
            "rows": t,
            "query_start_loc": bs + 1,
            "seq_lens": bs,
            "prefix_lens": bs,
            "tree_mask": t * num_words,
            "page_table": page_table_elements(bs, max_pages),
        }
    )


@dataclass
class _Entry:
    """A bucket's views into the static buffers, and its graph once captured."""

    bucket: Bucket
    layout: Layout
    backend: GraphAttention  # over the bucket's GraphMetadata
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    rows: torch.Tensor  # [num_tokens] int64 (the first num_rows are the step's)
    graph: torch.cuda.CUDAGraph | None = None


class TargetGraphRunner:
    """Static buffers, buckets, capture and replay of ``DecoderLM`` decode/verify steps."""

    def __init__(
        self,
        model: DecoderLM,
        kv: KVCache,
        *,
        batch_sizes: Sequence[int],
        widths: Sequence[int],
        max_model_len: int,
        attention: TritonAttention | None = None,
        capture: bool = True,
    ) -> None:
        if not batch_sizes or not widths or min(*batch_sizes, *widths) < 1:
            raise ValueError("batch_sizes, widths: need at least one size each, all >= 1")
        self.model = model
        self.kv = kv
        self.device = kv.k_caches[0].device
        if capture and self.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, not {self.device}")
        self.use_graphs = capture
        from tandem.attention.triton_backend import TritonAttention

        # The eager backend's split policy (a fixed count, or the heuristic) sizes the buckets.
        self.attention = attention or TritonAttention()
        self.batch_sizes = sorted(set(batch_sizes))
        self.widths = sorted(set(widths))
        self.buckets = [Bucket(b, w) for w in self.widths for b in self.batch_sizes]
        page_size = kv.spec.page_size
        self.num_words = -(-self.widths[-1] // WORD_BITS)
        # A verified tree sits at KV indices [L - 1, L - 1 + width) with L <= max_model_len.
        self.max_pages = -(-(max_model_len + self.widths[-1]) // page_size)
        layouts = {b: _layout(b, self.num_words, self.max_pages) for b in self.buckets}
        size = max(layout.total for layout in layouts.values())
        self._staging = Staging(self.device)
        self._inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
        c = model.config
        max_tokens = self.batch_sizes[-1] * self.widths[-1]
        self._logits = torch.zeros(max_tokens, c.vocab_size, device=self.device)
        self._features: torch.Tensor | None = None  # [max_tokens, F] once layers are known
        self.layers: tuple[int, ...] = ()
        self.replays: dict[Bucket, int] = {}  # steps run per bucket (graph or eager static)
        self.num_captures = 0  # rounds of capture (one at start, one per change of layers)
        self._entries = {b: self._entry(b, layouts[b]) for b in self.buckets}
        self._placeholder = placeholder_metadata(kv)

    # -- planning (host only) ---------------------------------------------------------------

    def bucket_for(self, batch_size: int, max_tree: int) -> Bucket | None:
        """The smallest bucket that holds ``batch_size`` trees of at most ``max_tree`` nodes."""
        bs = next((b for b in self.batch_sizes if b >= batch_size), None)
        width = next((w for w in self.widths if w >= max_tree), None)
        if bs is None or width is None:
            return None
        return Bucket(bs, width)

    def plan(
        self, request_ids: Sequence[str], starts: Sequence[int], trees: Sequence[Tree]
    ) -> GraphBatch | None:
        """The step in its bucket's layout (None when no bucket fits). Request ``i`` verifies
        ``trees[i]`` at KV indices ``starts[i] + node``, RoPE positions ``starts[i] + depth``;
        its slots must be reserved already."""
        if not trees:
            return None
        bucket = self.bucket_for(len(trees), max(len(t) for t in trees))
        if bucket is None:
            return None
        alloc, width, words = self.kv.allocator, bucket.width, self.num_words
        batch = GraphBatch(bucket, [], [], [], [], [], [], [], [])
        for i, (request_id, start, tree) in enumerate(zip(request_ids, starts, trees, strict=True)):
            n, pad = len(tree), width - len(tree)
            batch.input_ids += [*tree.tokens, *[0] * pad]
            batch.positions += [*(start + d for d in tree.depths), *[0] * pad]
            batch.slot_mapping += [*alloc.slot_mapping(request_id, start, start + n), *[-1] * pad]
            batch.tree_mask += [*mask_words(tree.parents, words), *[0] * (pad * words)]
            batch.seq_lens.append(start + n)
            batch.prefix_lens.append(start)
            batch.pages.append(alloc.pages(request_id))
            batch.rows += range(i * width, i * width + n)
        missing = bucket.batch_size - len(trees)
        batch.input_ids += [0] * (missing * width)
        batch.positions += [0] * (missing * width)
        batch.slot_mapping += [-1] * (missing * width)
        batch.tree_mask += [0] * (missing * width * words)
        batch.seq_lens += [0] * missing
        batch.prefix_lens += [0] * missing
        return batch

    # -- capture ----------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self, layers: Sequence[int] = ()) -> None:
        """Sets the target layers whose features every step returns, and (with graphs) captures
        every bucket for them, largest first so that smaller graphs reuse the pool."""
        self.layers = tuple(layers)
        self._features = features_buffer(self.model, self.layers, len(self._logits), self.device)
        if not self.use_graphs:
            return
        for entry in self._entries.values():
            entry.graph = None  # frees the old pool once every graph of it is gone
        order = sorted(self.buckets, key=lambda b: (b.num_tokens, b), reverse=True)
        jobs = [
            (
                f"{b.batch_size} requests x {b.width} rows",
                partial(self._stage, self._entries[b], self.empty(b)),
                partial(self._forward, self._entries[b]),
            )
            for b in order
        ]
        summary = (
            f"{len(order)} CUDA graphs (batch sizes {self.batch_sizes}, widths {self.widths}, "
            f"layers {list(self.layers)})"
        )
        graphs = capture_all(self.device, jobs, logger, "CUDA graph", summary)
        for bucket, graph in zip(order, graphs, strict=True):
            self._entries[bucket].graph = graph
        self.num_captures += 1

    @property
    def captured(self) -> bool:
        """Whether every bucket replays a graph (False in eager static mode)."""
        return all(entry.graph is not None for entry in self._entries.values())

    # -- running ----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(
        self, batch: GraphBatch, layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [num_rows, vocab] fp32, [num_rows, F]
        """Stages ``batch``, replays its bucket (or runs it eagerly on the static buffers) and
        returns new tensors with the logits and features of the real rows."""
        if tuple(layers) != self.layers:
            logger.info("target feature layers %s -> %s", list(self.layers), list(layers))
            self.capture(layers)
        entry = self._entries[batch.bucket]
        self._stage(entry, batch)
        if batch.device_ids is not None:
            assert batch.bucket.width == 1, "device ids are one token per request"
            entry.input_ids[: len(batch.device_ids)].copy_(batch.device_ids)
        self.replay(batch.bucket)
        rows = entry.rows[: len(batch.rows)]
        logits = self._logits.index_select(0, rows)
        features = None if self._features is None else self._features.index_select(0, rows)
        return logits, features

    # -- device-written steps (tandem/target/device_chain.py) -----------------------------------

    def stage(self, batch: GraphBatch) -> None:
        """Stages ``batch`` into its bucket without running it: a caller that then writes the
        per-step inputs on the device (``buffers``) and replays (``replay``)."""
        self._stage(self._entries[batch.bucket], batch)

    def buffers(self, bucket: Bucket) -> _Entry:
        """The bucket's static input views (ids, positions, its ``GraphMetadata``)."""
        return self._entries[bucket]

    @torch.inference_mode()
    def replay(self, bucket: Bucket) -> None:
        """Runs the bucket on its static inputs as they are; the outputs stay in ``logits``
        and ``features`` (rows ``i * width + node``) until the next run."""
        entry = self._entries[bucket]
        if entry.graph is not None:
            entry.graph.replay()
        else:
            self._forward(entry)
        self.replays[bucket] = self.replays.get(bucket, 0) + 1

    def forward_static(self, bucket: Bucket) -> None:
        """The bucket's forward on its static inputs, run (or captured) by the caller: what a
        graph of the caller's own holds around it (``tandem/target/chain_verify.py``)."""
        self._forward(self._entries[bucket])

    @property
    def logits(self) -> torch.Tensor:  # [max_tokens, vocab] float32
        return self._logits

    @property
    def features(self) -> torch.Tensor | None:  # [max_tokens, F]
        return self._features

    def _forward(self, entry: _Entry) -> None:
        """The captured region: the model over the bucket's static inputs, outputs into the
        runner's buffers. Reads the inputs, writes KV of real rows and the outputs, no more."""
        ctx = ForwardContext(kv=self.kv, meta=self._placeholder, backend=entry.backend)
        out = self.model(entry.input_ids, entry.positions, ctx, self.layers)
        num_tokens = entry.bucket.num_tokens
        self._logits[:num_tokens].copy_(self.model.compute_logits(out.hidden))
        if self._features is not None:
            self._features[:num_tokens].copy_(torch.cat(out.captured, dim=-1))

    def _stage(self, entry: _Entry, batch: GraphBatch) -> None:
        """Writes ``batch`` into the host staging buffer, then one copy to the device."""
        layout, bucket = entry.layout, entry.bucket
        host = self._staging.host(layout.total)
        values = {
            "input_ids": batch.input_ids,
            "positions": batch.positions,
            "slot_mapping": batch.slot_mapping,
            "query_start_loc": range(0, bucket.num_tokens + 1, bucket.width),
            "seq_lens": batch.seq_lens,
            "prefix_lens": batch.prefix_lens,
            "tree_mask": batch.tree_mask,
        }
        for name, value in values.items():
            offset, size = layout.spans[name]
            host[offset : offset + size] = value
        offset, _ = layout.spans["rows"]
        host[offset : offset + len(batch.rows)] = batch.rows
        write_page_table(
            host, layout.spans["page_table"], self.max_pages, bucket.batch_size, batch.pages
        )
        self._staging.upload(self._inputs, layout.total)

    # -- buffers ----------------------------------------------------------------------------

    def _entry(self, bucket: Bucket, layout: Layout) -> _Entry:
        def view(name: str) -> torch.Tensor:
            offset, size = layout.spans[name]
            return self._inputs[offset : offset + size]

        bs, num_tokens = bucket.batch_size, bucket.num_tokens
        page_table = view("page_table").view(torch.int32)[: bs * self.max_pages]
        backend = graph_attention(
            self.attention,
            self.kv,
            num_heads=self.model.config.num_heads,
            batch_size=bs,
            width=bucket.width,
            max_pages=self.max_pages,
            query_start_loc=view("query_start_loc"),
            seq_lens=view("seq_lens"),
            prefix_lens=view("prefix_lens"),
            tree_mask=view("tree_mask").view(num_tokens, self.num_words),
            page_table=page_table.view(bs, self.max_pages),
            slot_mapping=view("slot_mapping"),
        )
        return _Entry(
            bucket=bucket,
            layout=layout,
            backend=backend,
            input_ids=view("input_ids"),
            positions=view("positions"),
            rows=view("rows"),
        )

    def empty(self, bucket: Bucket) -> GraphBatch:
        """A batch of padding requests only: what capture runs (it touches no live KV)."""
        t, bs = bucket.num_tokens, bucket.batch_size
        return GraphBatch(
            bucket=bucket,
            input_ids=[0] * t,
            positions=[0] * t,
            slot_mapping=[-1] * t,
            tree_mask=[0] * (t * self.num_words),
            seq_lens=[0] * bs,
            prefix_lens=[0] * bs,
            pages=[],
            rows=[],
        )


def graph_widths(tree_size: int | None) -> tuple[int, ...]:
    """Rows per request to capture: 1 (decode), and the spec tree size N when speculating."""
    return (1,) if tree_size is None or tree_size == 1 else (1, tree_size)
