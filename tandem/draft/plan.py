"""Host side of the draft graphs (``graphs.py``): a step's inputs in its bucket's padded
layout (``buffers.py`` holds the buffers, ``schedule.py`` says which pairs a chain step runs),
or None when a request needs the host path. Plans read the drafter's ``ModelDraftState``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.draft.buffers import PAD_BASE, ExtendEntry, LoopEntry, Staged
from tandem.draft.schedule import ChainSchedule
from tandem.draft.state import ModelDraftState
from tandem.graphs.base import WORD_BITS, mask_words
from tandem.kv import KVCache


def _fits(kv: KVCache, request_id: str, extra: int, max_pages: int) -> bool:
    alloc = kv.allocator
    return len(alloc.pages(request_id)) + alloc.pages_needed(request_id, extra) <= max_pages


@dataclass
class LoopPlan:
    """A draft loop's per-request numbers; ``values`` reads slots once scratch is reserved."""

    request_ids: list[str]
    bases: list[int]  # L - 1 per request
    committed: list[list[int]]  # per module, per request: KV entries before the scratch

    def values(self, entry: LoopEntry, kvs: Sequence[KVCache]) -> Staged:
        bs, n = entry.bucket.batch_size, len(self.request_ids)
        words, missing = entry.schedule.num_words, bs - n
        staged = Staged(ints={"base": [*self.bases, *[PAD_BASE] * missing]})
        for t, step in enumerate(entry.schedule.steps):
            m, w, prev = step.module, len(step.depths), step.prev
            alloc = kvs[m].allocator
            parents = range(-1, prev + w - 1)
            rows = mask_words(parents, words)[prev * words :]
            slots: list[int] = []
            seq_lens, prefixes, mask = [], [], []
            for request_id, c in zip(self.request_ids, self.committed[m], strict=True):
                slots += alloc.slot_mapping(request_id, c + prev, c + prev + w)
                seq_lens.append(c + prev + w)
                prefixes.append(c)
                mask += rows
            staged.ints |= {
                f"slots{t}": [*slots, *[-1] * (missing * w)],
                f"seq{t}": [*seq_lens, *[0] * missing],
                f"prefix{t}": [*prefixes, *[0] * missing],
                f"qsl{t}": list(range(0, bs * w + 1, w)),
                f"mask{t}": [*mask, *[0] * (missing * w * words)],
            }
            staged.pages[f"pages{m}"] = [alloc.pages(r) for r in self.request_ids]
        return staged


def plan_loop(
    state: ModelDraftState, request_ids: list[str], schedule: ChainSchedule, max_pages: int
) -> LoopPlan | None:
    """The loop's numbers, or None when a request needs the host path: no last output to
    start from, a pair at a negative position, or no room for every scratch slot."""
    bases = []
    for request_id in request_ids:
        seq = state.seqs[request_id]
        if any(seq.last_out[k] is None for k in schedule.roots):
            return None
        base = len(seq.tokens) - 1
        for step in schedule.steps:
            if base + step.depths[0] - state.modules[step.module].shift < 0:
                return None
        bases.append(base)
    for kv, total in zip(state.kvs, schedule.totals, strict=True):
        if not total:
            continue
        alloc = kv.allocator
        if sum(alloc.pages_needed(r, total) for r in request_ids) > alloc.num_free_pages:
            return None
        if not all(_fits(kv, r, total, max_pages) for r in request_ids):
            return None
    committed = [[kv.allocator.num_tokens(r) for r in request_ids] for kv in state.kvs]
    return LoopPlan(request_ids, bases, committed)


@dataclass
class ExtendPlan:
    """An extend's pairs per module and request; ``values`` reads slots once reserved."""

    request_ids: list[str]
    firsts: list[list[int]]  # per module, per request: index of the first consumed token
    counts: list[list[int]]  # per module, per request: pairs
    committed: list[list[int]]  # per module, per request: KV entries before the pairs
    last_in: list[list[torch.Tensor | None]]  # per chained module m-1: last output before
    features: torch.Tensor | None  # [sum(counts[0]), F] module 0's feature rows, in order
    tokens: list[list[int]]  # per request: its committed tokens (new ones appended)
    shifts: list[int]  # per module

    def values(self, entry: ExtendEntry, kvs: Sequence[KVCache]) -> Staged:
        bs, width, n = entry.bucket.batch_size, entry.bucket.width, len(self.request_ids)
        words, missing = -(-width // WORD_BITS), bs - n
        chain = mask_words(range(-1, width - 1), words)
        pad_rows = missing * width
        feature_rows: list[int] = []
        staged = Staged()
        for m, (firsts, counts, committed) in enumerate(
            zip(self.firsts, self.counts, self.committed, strict=True)
        ):
            alloc, shift = kvs[m].allocator, self.shifts[m]
            ids: list[int] = []
            pos: list[int] = []
            slots: list[int] = []
            mask: list[int] = []
            sources: list[int] = []
            last: list[int] = []
            for i, request_id in enumerate(self.request_ids):
                first, count, c = firsts[i], counts[i], committed[i]
                tokens, pad = self.tokens[i], width - count
                ids += [*tokens[first : first + count], *[0] * pad]
                pos += [*range(first - shift, first - shift + count), *[0] * pad]
                slots += [*alloc.slot_mapping(request_id, c, c + count), *[-1] * pad]
                mask += [*chain[: count * words], *[0] * (pad * words)]
                last.append(i * width + max(count - 1, 0))
                if m == 0:
                    feature_rows += range(i * width, i * width + count)
                elif f"src{m}" in entry.layout.spans:
                    before = self.firsts[m - 1][i]
                    for j in range(first, first + count):
                        src = bs + i * width + j - 1 - before if j - 1 >= before else i
                        sources.append(src)
                    sources += [0] * pad
            seq_lens = [c + k for c, k in zip(committed, counts, strict=True)]
            staged.ints |= {
                f"ids{m}": [*ids, *[0] * pad_rows],
                f"pos{m}": [*pos, *[PAD_BASE] * pad_rows],
                f"slots{m}": [*slots, *[-1] * pad_rows],
                f"seq{m}": [*seq_lens, *[0] * missing],
                f"prefix{m}": [*committed, *[0] * missing],
                f"qsl{m}": list(range(0, bs * width + 1, width)),
                f"mask{m}": [*mask, *[0] * (pad_rows * words)],
                f"last{m}": [*last, *[0] * missing],
            }
            if f"src{m}" in entry.layout.spans:
                staged.ints[f"src{m}"] = [*sources, *[0] * pad_rows]
            staged.pages[f"pages{m}"] = [alloc.pages(r) for r in self.request_ids]
        staged.ints["rows"] = [*feature_rows, *[0] * (bs * width - len(feature_rows))]
        return staged


def plan_extend(
    state: ModelDraftState,
    request_ids: list[str],
    starts: dict[str, int],
    width: int,
    max_pages: int,
) -> ExtendPlan | None:
    """The extend's pairs (as the host path's extend forms them), or None when a request
    needs the host path: more pairs than ``width``, a page table past ``max_pages``, missing
    target features or a missing last output for a chained head."""
    modules, kvs = state.modules, state.kvs
    firsts: list[list[int]] = [[] for _ in modules]
    counts: list[list[int]] = [[] for _ in modules]
    committed: list[list[int]] = [[] for _ in modules]
    last_in: list[list[torch.Tensor | None]] = [[] for _ in modules[1:]]
    slices = []
    for request_id in request_ids:
        seq, start = state.seqs[request_id], starts[request_id]
        end = len(seq.tokens)
        for m, (module, kv) in enumerate(zip(modules, kvs, strict=True)):
            first = max(start, module.shift)
            count = max(0, end - first)
            if count > width or not _fits(kv, request_id, count, max_pages):
                return None
            firsts[m].append(first)
            counts[m].append(count)
            committed[m].append(kv.allocator.num_tokens(request_id))
            if m and module.uses_hidden:
                old = seq.last_out[m - 1]
                if old is None and count and first - 1 < firsts[m - 1][-1]:
                    return None
                last_in[m - 1].append(old)
        if modules[0].uses_hidden and counts[0][-1]:
            if seq.features is None:
                return None
            lo = firsts[0][-1] - 1 - seq.feature_start
            hi = end - 1 - seq.feature_start
            if lo < 0 or hi > seq.features.shape[0]:
                return None
            slices.append(seq.features[lo:hi])
    features = torch.cat(slices) if slices else None
    return ExtendPlan(
        request_ids=request_ids,
        firsts=firsts,
        counts=counts,
        committed=committed,
        last_in=last_in,
        features=features,
        tokens=[state.seqs[r].tokens for r in request_ids],
        shifts=[module.shift for module in modules],
    )
