"""CUDA graphs of the target's prompt chunks (docs/design.md section 7).

An eager forward is bound by the host's launches: an 8B-shaped target's forward is several
hundred kernels, each launched from Python, so a short prefill keeps the GPU busy a fraction of
its step (docs/performance.md). A step whose only work is one request's prompt chunk
(a prompt arriving alone: every request's time to first token at batch size 1) therefore
replays a graph captured at the smallest token count that holds the chunk (``widths``, default
16 .. 512); any other step runs as before (eagerly, or in ``tandem.target.graphs``' decode/verify
buckets).

The replay follows ``tandem.target.graphs``' rules (SGLang #25015, #22041; docs/design.md 3):

- Inputs live in one packed static buffer that one host-to-device copy refills: the chunk's
  tokens, positions and KV slots, its request's page table row, its lengths, its last row.
- Attention is causal (``GraphMetadata`` without a tree mask). Rows past the chunk belong to a
  padding request of the same width whose slots are -1 (nothing stored) and whose keys are the
  null page's zeros, so every padded row yields finite values that nobody reads.
- The logits of the chunk's last row (the next token's, when the chunk ends the prompt) and
  the captured target features of every row are written into the runner's buffers inside the
  graph and copied out right after the replay.

``capture=False`` runs the same buffers and padding without capturing (CPU tests, Triton
interpreted). The graphs' logits and features equal the eager step's up to the order of float
sums: the GEMMs see ``width`` rows instead of the chunk's, and the split-KV count is fixed for
the longest context (with ``EngineConfig.batch_invariant`` neither changes a row's bits).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from tandem.graphs.base import (
    Layout,
    Staging,
    capture_all,
    features_buffer,
    graph_attention,
    page_table_elements,
    placeholder_metadata,
    write_page_table,
)
from tandem.kv import KVCache
from tandem.models import DecoderLM, ForwardContext

if TYPE_CHECKING:  # triton is imported when a runner is built, never by importing this module
    from tandem.attention.triton_backend import GraphAttention, TritonAttention

logger = logging.getLogger(__name__)


@dataclass
class PrefillBatch:
    """One prompt chunk in its width's padded layout (``PrefillGraphRunner.plan``)."""

    width: int
    input_ids: list[int]  # [width]
    positions: list[int]  # [width]
    slot_mapping: list[int]  # [width], -1 past the chunk
    seq_len: int  # the request's KV length after the chunk
    num_tokens: int  # the chunk's length
    pages: list[int]  # the request's pages in logical order
    last: bool  # the chunk ends the prompt: its last row's logits are wanted


@dataclass
class _Entry:
    """A width's views into the static buffers, and its graph once captured."""

    width: int
    layout: Layout
    backend: GraphAttention
    input_ids: torch.Tensor  # [width] int64
    positions: torch.Tensor  # [width] int64
    last_row: torch.Tensor  # [1] int64
    graph: torch.cuda.CUDAGraph | None = None


def _layout(width: int, max_pages: int) -> Layout:
    """Where a width's inputs sit in the packed int64 staging buffer: the chunk is request 0,
    the padding rows request 1."""
    return Layout.packed(
        {
            "input_ids": width,
            "positions": width,
            "slot_mapping": width,
            "query_start_loc": 3,
            "seq_lens": 2,
            "last_row": 1,
            "page_table": page_table_elements(2, max_pages),
        }
    )


class PrefillGraphRunner:
    """Static buffers, capture and replay of one prompt chunk's ``DecoderLM`` forward."""

    def __init__(
        self,
        model: DecoderLM,
        kv: KVCache,
        *,
        widths: Sequence[int],
        max_model_len: int,
        attention: TritonAttention | None = None,
        capture: bool = True,
    ) -> None:
        if not widths or min(widths) < 1:
            raise ValueError("widths: need at least one token count, all >= 1")
        self.model = model
        self.kv = kv
        self.device = kv.k_caches[0].device
        if capture and self.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, not {self.device}")
        self.use_graphs = capture
        from tandem.attention.triton_backend import TritonAttention

        self.attention = attention or TritonAttention()
        self.widths = sorted(set(widths))
        self.max_pages = -(-max_model_len // kv.spec.page_size)
        layouts = {w: _layout(w, self.max_pages) for w in self.widths}
        size = max(layout.total for layout in layouts.values())
        self._staging = Staging(self.device)
        self._inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._logits = torch.zeros(1, model.config.vocab_size, device=self.device)
        self._features: torch.Tensor | None = None  # [max width, F] once layers are known
        self.layers: tuple[int, ...] = ()
        self.replays: dict[int, int] = {}  # chunks run per width (graph or eager static)
        self.num_captures = 0
        self._entries = {w: self._entry(w, layouts[w]) for w in self.widths}
        self._placeholder = placeholder_metadata(kv)

    def plan(
        self, request_id: str, start: int, tokens: Sequence[int], *, last: bool
    ) -> PrefillBatch | None:
        """The chunk ``tokens`` at KV indices and positions ``start ..`` in the smallest width
        that holds it (None when none does, or when the request holds more pages than a page
        table row of ``max_model_len`` tokens); its slots must be reserved already."""
        n = len(tokens)
        width = next((w for w in self.widths if w >= n), None)
        if width is None or n == 0:
            return None
        pad = width - n
        alloc = self.kv.allocator
        pages = alloc.pages(request_id)
        if len(pages) > self.max_pages:  # capacity reserved past the context: run it eagerly
            return None
        return PrefillBatch(
            width=width,
            input_ids=[*tokens, *[0] * pad],
            positions=[*range(start, start + n), *[0] * pad],
            slot_mapping=[*alloc.slot_mapping(request_id, start, start + n), *[-1] * pad],
            seq_len=start + n,
            num_tokens=n,
            pages=pages,
            last=last,
        )

    @torch.inference_mode()
    def capture(self, layers: Sequence[int] = ()) -> None:
        """Sets the target layers whose features a chunk returns and (with graphs) captures
        every width for them, widest first so that narrower graphs reuse the pool."""
        self.layers = tuple(layers)
        self._features = features_buffer(self.model, self.layers, self.widths[-1], self.device)
        if not self.use_graphs:
            return
        for entry in self._entries.values():
            entry.graph = None  # frees the old pool once every graph of it is gone
        order = self.widths[::-1]
        jobs = [
            (
                f"{w} tokens",
                partial(self._stage, self._entries[w], self._empty(w)),
                partial(self._forward, self._entries[w]),
            )
            for w in order
        ]
        summary = (
            f"{len(order)} prefill CUDA graphs (tokens {self.widths}, layers {list(self.layers)})"
        )
        graphs = capture_all(self.device, jobs, logger, "prefill CUDA graph", summary)
        for width, graph in zip(order, graphs, strict=True):
            self._entries[width].graph = graph
        self.num_captures += 1

    @property
    def captured(self) -> bool:
        """Whether every width replays a graph (False in eager static mode)."""
        return all(entry.graph is not None for entry in self._entries.values())

    @torch.inference_mode()
    def run(
        self, batch: PrefillBatch, layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [0 or 1, vocab] fp32, [num_tokens, F]
        """Stages ``batch``, replays its width (or runs it eagerly on the static buffers) and
        returns new tensors: the last row's logits when the chunk ends the prompt (else no
        rows), and every row's features."""
        if tuple(layers) != self.layers:
            logger.info("prefill feature layers %s -> %s", list(self.layers), list(layers))
            self.capture(layers)
        entry = self._entries[batch.width]
        self._stage(entry, batch)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            self._forward(entry)
        self.replays[batch.width] = self.replays.get(batch.width, 0) + 1
        logits = self._logits[: int(batch.last)].clone()
        n = batch.num_tokens
        features = None if self._features is None else self._features[:n].clone()
        return logits, features

    def _forward(self, entry: _Entry) -> None:
        """The captured region: the model over the width's static inputs, outputs into the
        runner's buffers. Reads the inputs, writes KV of the chunk's rows and the outputs."""
        ctx = ForwardContext(kv=self.kv, meta=self._placeholder, backend=entry.backend)
        out = self.model(entry.input_ids, entry.positions, ctx, self.layers)
        last = out.hidden.index_select(0, entry.last_row)
        self._logits.copy_(self.model.compute_logits(last))
        if self._features is not None:
            self._features[: entry.width].copy_(torch.cat(out.captured, dim=-1))

    def _stage(self, entry: _Entry, batch: PrefillBatch) -> None:
        """Writes ``batch`` into the host staging buffer, then one copy to the device."""
        layout, width, n = entry.layout, entry.width, batch.num_tokens
        host = self._staging.host(layout.total)
        values = {
            "input_ids": batch.input_ids,
            "positions": batch.positions,
            "slot_mapping": batch.slot_mapping,
            # The padding request's rows attend causally over null-page keys (zeros).
            "query_start_loc": (0, n, width),
            "seq_lens": (batch.seq_len, width - n),
            "last_row": (n - 1,),
        }
        for name, value in values.items():
            offset, size = layout.spans[name]
            host[offset : offset + size] = value
        write_page_table(host, layout.spans["page_table"], self.max_pages, 2, [batch.pages])
        self._staging.upload(self._inputs, layout.total)

    def _entry(self, width: int, layout: Layout) -> _Entry:
        def view(name: str) -> torch.Tensor:
            offset, size = layout.spans[name]
            return self._inputs[offset : offset + size]

        page_table = view("page_table").view(torch.int32)[: 2 * self.max_pages]
        backend = graph_attention(
            self.attention,
            self.kv,
            num_heads=self.model.config.num_heads,
            batch_size=1,
            width=width,
            max_pages=self.max_pages,
            query_start_loc=view("query_start_loc"),
            seq_lens=view("seq_lens"),
            prefix_lens=None,  # causal
            tree_mask=None,
            page_table=page_table.view(2, self.max_pages),
            slot_mapping=view("slot_mapping"),
        )
        return _Entry(
            width=width,
            layout=layout,
            backend=backend,
            input_ids=view("input_ids"),
            positions=view("positions"),
            last_row=view("last_row"),
        )

    def _empty(self, width: int) -> PrefillBatch:
        """A chunk that writes nothing and sees only the null page: what capture runs."""
        return PrefillBatch(
            width=width,
            input_ids=[0] * width,
            positions=[0] * width,
            slot_mapping=[-1] * width,
            seq_len=width,
            num_tokens=width,
            pages=[],
            last=True,
        )
