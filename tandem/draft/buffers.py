"""Static buffers of the draft graphs' buckets (``graphs.py``): one packed int64 input
tensor per bucket (filled from a shared host staging buffer by one copy per step), views into it
for each forward's ``GraphMetadata``, token ids, positions and gather indices, and the output
buffers a captured region writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.attention import AttentionMetadata
from tandem.draft.schedule import ChainSchedule, TreeShape
from tandem.draft.state import ModelDraftState
from tandem.graphs.base import (
    WORD_BITS,
    Bucket,
    Layout,
    Staging,
    graph_attention,
    page_table_elements,
    placeholder_metadata,
    write_page_table,
)
from tandem.kv import KVCache

if TYPE_CHECKING:
    from tandem.attention.triton_backend import GraphAttention, TritonAttention

# Base position of a padding request: its positions base + depth - shift stay >= 0.
PAD_BASE = 64


@dataclass
class Staged:
    """A step's int64 inputs by span name, and page-table rows per page-table span."""

    ints: dict[str, list[int]] = field(default_factory=dict)
    pages: dict[str, list[list[int]]] = field(default_factory=dict)


@dataclass(kw_only=True)
class _Entry:
    bucket: Bucket
    layout: Layout
    inputs: torch.Tensor  # [layout.total] int64 on the device
    max_pages: int
    placeholder: AttentionMetadata  # never read: GraphAttention reads the bucket's buffers
    empty: Staged  # padding requests only: what capture runs
    graph: torch.cuda.CUDAGraph | None = None


@dataclass(kw_only=True)
class LoopEntry(_Entry):
    schedule: ChainSchedule
    base: torch.Tensor  # [bs] int64, the target position of node 0 (L - 1)
    offsets: list[torch.Tensor]  # per step [w] int64, depth - shift of its pairs
    backends: list[GraphAttention]  # per step
    result: torch.Tensor  # [3, bs, S] float64: target ids, logprobs, valid


@dataclass
class ExtendBuffers:
    backend: GraphAttention
    input_ids: torch.Tensor  # [bs * width] int64
    positions: torch.Tensor  # [bs * width] int64
    last_rows: torch.Tensor  # [bs] int64, each request's last real row
    sources: torch.Tensor | None  # [bs * width] int64 rows of cat(last_in, previous outputs)


@dataclass(kw_only=True)
class ExtendEntry(_Entry):
    modules: list[ExtendBuffers]
    rows: torch.Tensor  # [bs * width] int64, where the staged feature rows go
    features: torch.Tensor | None  # [bs * width, F] target features (module 0's input)


class StaticInputs:
    """The host staging buffer all buckets share (pinned on CUDA, grown on demand) and the
    one host-to-device copy per step into a bucket's packed inputs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging = Staging(device)

    def stage(self, entry: _Entry, staged: Staged) -> None:
        total = entry.layout.total
        host = self._staging.host(total)
        for name, values in staged.ints.items():
            offset, size = entry.layout.spans[name]
            assert len(values) == size, f"{name}: {len(values)} values for {size}"
            host[offset : offset + size] = values
        for name, rows in staged.pages.items():
            span = entry.layout.spans[name]
            write_page_table(host, span, entry.max_pages, entry.bucket.batch_size, rows)
        self._staging.upload(entry.inputs, total)


def _views(layout: Layout, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs = torch.zeros(layout.total, dtype=torch.int64, device=device)
    return inputs, {n: inputs[o : o + s] for n, (o, s) in layout.spans.items()}


def _backend(
    views: dict[str, torch.Tensor],
    tag: str,
    pages: str,
    bucket: Bucket,
    words: int,
    max_pages: int,
    kv: KVCache,
    heads: int,
    attention: TritonAttention,
) -> GraphAttention:
    bs, width = bucket.batch_size, bucket.width
    return graph_attention(
        attention,
        kv,
        num_heads=heads,
        batch_size=bs,
        width=width,
        max_pages=max_pages,
        query_start_loc=views[f"qsl{tag}"],
        seq_lens=views[f"seq{tag}"],
        prefix_lens=views[f"prefix{tag}"],
        tree_mask=views[f"mask{tag}"].view(bs * width, words),
        page_table=views[pages].view(torch.int32)[: bs * max_pages].view(bs, max_pages),
        slot_mapping=views[f"slots{tag}"],
    )


def _num_heads(state: ModelDraftState, m: int) -> int:
    module = state.modules[m]
    config = getattr(module, "config", None) or getattr(module, "model").config  # noqa: B009
    return int(config.num_heads)


def _attention_spans(tag: str, bs: int, width: int, words: int) -> dict[str, int]:
    t = bs * width
    return {
        f"slots{tag}": t,
        f"seq{tag}": bs,
        f"prefix{tag}": bs,
        f"qsl{tag}": bs + 1,
        f"mask{tag}": t * words,
    }


def _padding(tag: str, bs: int, width: int, words: int) -> dict[str, list[int]]:
    t = bs * width
    return {
        f"slots{tag}": [-1] * t,
        f"seq{tag}": [0] * bs,
        f"prefix{tag}": [0] * bs,
        f"qsl{tag}": list(range(0, t + 1, width)),
        f"mask{tag}": [0] * (t * words),
    }


def build_loop_entry(
    state: ModelDraftState,
    bucket: Bucket,
    schedule: ChainSchedule,
    attention: TritonAttention,
    device: torch.device,
    max_pages: int,
    pad_base: int,
) -> LoopEntry:
    bs, words = bucket.batch_size, schedule.num_words
    modules = sorted({s.module for s in schedule.steps})
    sizes = {"base": bs}
    empty = Staged(ints={"base": [pad_base] * bs})
    for t, step in enumerate(schedule.steps):
        sizes |= _attention_spans(str(t), bs, len(step.depths), words)
        empty.ints |= _padding(str(t), bs, len(step.depths), words)
    for m in modules:
        sizes[f"pages{m}"] = page_table_elements(bs, max_pages)
        empty.pages[f"pages{m}"] = []
    layout = Layout.packed(sizes)
    inputs, views = _views(layout, device)
    backends, offsets = [], []
    for t, step in enumerate(schedule.steps):
        m, w = step.module, len(step.depths)
        kv = state.kvs[m]
        shape = Bucket(bs, w)
        args = (shape, words, max_pages, kv, _num_heads(state, m), attention)
        backends.append(_backend(views, str(t), f"pages{m}", *args))
        shift = state.modules[m].shift
        offsets.append(torch.tensor([d - shift for d in step.depths], device=device))
    num_steps = len(schedule.steps) + 1
    return LoopEntry(
        bucket=bucket,
        layout=layout,
        inputs=inputs,
        max_pages=max_pages,
        placeholder=placeholder_metadata(state.kvs[0]),
        empty=empty,
        schedule=schedule,
        base=views["base"],
        offsets=offsets,
        backends=backends,
        result=torch.zeros(3, bs, num_steps, dtype=torch.float64, device=device),
    )


def build_extend_entry(
    state: ModelDraftState,
    bucket: Bucket,
    features: torch.Tensor | None,
    attention: TritonAttention,
    device: torch.device,
    max_pages: int,
    pad_base: int,
) -> ExtendEntry:
    bs, width, t = bucket.batch_size, bucket.width, bucket.num_tokens
    words = -(-width // WORD_BITS)
    sizes: dict[str, int] = {"rows": t}
    empty = Staged(ints={"rows": [0] * t})
    for m, module in enumerate(state.modules):
        sizes |= {f"ids{m}": t, f"pos{m}": t, f"last{m}": bs}
        sizes |= _attention_spans(str(m), bs, width, words)
        sizes[f"pages{m}"] = page_table_elements(bs, max_pages)
        empty.ints |= {f"ids{m}": [0] * t, f"pos{m}": [pad_base] * t, f"last{m}": [0] * bs}
        empty.ints |= _padding(str(m), bs, width, words)
        empty.pages[f"pages{m}"] = []
        if m and module.uses_hidden:
            sizes[f"src{m}"] = t
            empty.ints[f"src{m}"] = [0] * t
    layout = Layout.packed(sizes)
    inputs, views = _views(layout, device)
    buffers = []
    for m in range(len(state.modules)):
        args = (bucket, words, max_pages, state.kvs[m], _num_heads(state, m), attention)
        buffers.append(
            ExtendBuffers(
                backend=_backend(views, str(m), f"pages{m}", *args),
                input_ids=views[f"ids{m}"],
                positions=views[f"pos{m}"],
                last_rows=views[f"last{m}"],
                sources=views.get(f"src{m}"),
            )
        )
    return ExtendEntry(
        bucket=bucket,
        layout=layout,
        inputs=inputs,
        max_pages=max_pages,
        placeholder=placeholder_metadata(state.kvs[0]),
        empty=empty,
        modules=buffers,
        rows=views["rows"],
        features=None if features is None else features[:t],
    )


@dataclass(kw_only=True)
class TreeEntry(_Entry):
    shape: TreeShape
    base: torch.Tensor  # [bs] int64, the target position of node 0 (L - 1)
    offsets: list[torch.Tensor]  # per step [K] int64, depth - shift
    backends: list[GraphAttention]  # per step
    masks: list[torch.Tensor]  # per step [bs * K, words] int64, written inside the region
    bits: list[torch.Tensor]  # per step [K, words] int64, each row's own column
    result: torch.Tensor  # [bs, 3 (N-1) + 1] int64: chosen, their tokens, parents; count


def build_tree_entry(
    state: ModelDraftState,
    bs: int,
    shape: TreeShape,
    attention: TritonAttention,
    device: torch.device,
    max_pages: int,
    pad_base: int,
) -> TreeEntry:
    k, words = shape.topk, shape.num_words
    sizes = {"base": bs}
    empty = Staged(ints={"base": [pad_base] * bs})
    for t in range(shape.num_steps - 1):
        sizes |= _attention_spans(str(t), bs, k, words)
        empty.ints |= _padding(str(t), bs, k, words)
    sizes["pages0"] = page_table_elements(bs, max_pages)
    empty.pages["pages0"] = []
    layout = Layout.packed(sizes)
    inputs, views = _views(layout, device)
    backends, offsets, masks, bits = [], [], [], []
    shift = state.modules[0].shift
    for t in range(shape.num_steps - 1):
        args = (Bucket(bs, k), words, max_pages, state.kvs[0], _num_heads(state, 0), attention)
        backends.append(_backend(views, str(t), "pages0", *args))
        offsets.append(torch.full((k,), t + 1 - shift, dtype=torch.int64, device=device))
        masks.append(views[f"mask{t}"].view(bs * k, words))
        own = [_column_bit(t * k + i, words) for i in range(k)]  # row i: column t*K + i
        bits.append(torch.tensor(own, dtype=torch.int64, device=device))
    return TreeEntry(
        bucket=Bucket(bs, k),
        layout=layout,
        inputs=inputs,
        max_pages=max_pages,
        placeholder=placeholder_metadata(state.kvs[0]),
        empty=empty,
        shape=shape,
        base=views["base"],
        offsets=offsets,
        backends=backends,
        masks=masks,
        bits=bits,
        result=torch.zeros(bs, 3 * (shape.tree_size - 1) + 1, dtype=torch.int64, device=device),
    )


def _column_bit(column: int, words: int) -> list[int]:  # [words] signed int64
    """A mask row with only ``column`` set."""
    row = [0] * words
    bit = column % WORD_BITS
    row[column // WORD_BITS] = 1 << bit if bit < WORD_BITS - 1 else -(1 << bit)
    return row
