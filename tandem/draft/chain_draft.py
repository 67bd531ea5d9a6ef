"""The draft's half of a device-chain step (``tandem/target/device_chain.py``), and the two
hand-off buffers between the halves.

``Outcome`` is what a verification hands the draft and ``Chains`` what the draft hands the
next verification, both on the device. Each is allocated by the half that reads it (the draft
owns ``Outcome``: its features are the extend bucket's own feature rows) and written by the
other, as docs/device-cycle.md plans for two processes; in one process both halves launch on
one stream, so stream order is the only hand-off.

One draft launch: the extend bucket over each row's accepted pairs (pair k, k <= accepted, is
new token k at position and KV index ``base + 1 - shift + k``; later rows store nothing and see
nothing), then the loop bucket from the new base ``base + accepted + 1``, whose chain goes into
``Chains``. Positions, slots and lengths are computed on the device from ``Outcome``; the page
tables are written once at ``begin`` and grown on the stream as pages are reserved. With the
draft's graphs captured, a launch is one CUDA graph per bucket (captured at the bucket's first
launch, over the bucket's ``Outcome`` and the ``Chains`` bound then, which the target's
``DeviceChain.warm`` makes happen before a run needs it): extend and loop with everything
between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import kernels
from tandem.draft.buffers import PAD_BASE, Staged
from tandem.draft.graphs import DraftGraphRunner
from tandem.draft.schedule import chain_schedule
from tandem.draft.state import ModelDraftState
from tandem.graphs.base import WORD_BITS, Bucket, capture_graph, mask_words
from tandem.spec.chain import Chains, DraftHalf, Outcome, grow_tables, share_on_cpu


class DraftChain(DraftHalf):
    """A one-module drafter's share of a run, over its state and graph runner: its pool, its
    buckets' inputs, its host state."""

    def __init__(self, state: ModelDraftState, graphs: DraftGraphRunner, num_steps: int) -> None:
        assert len(state.modules) == 1 and graphs.state is state
        self.state = state
        self.graphs = graphs
        self.graphs.ensure_steps(num_steps)
        self.num_steps = num_steps
        self.width = num_steps + 1
        self.device = self.graphs.device
        self.shift = state.modules[0].shift
        self.schedule = chain_schedule(num_steps, 1, state.mode)
        self.scratch = self.schedule.totals[0]  # the loop's scratch entries a request
        self.alloc = state.kvs[0].allocator
        self.request_ids: list[str] = []
        self._bucket = Bucket(1, self.width)
        self._pages: list[int] = []  # per row: pages written into the buckets' tables
        self._chain_words = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.outcome: Outcome | None = None
        self.chains: Chains | None = None
        self._outcomes: dict[Bucket, Outcome] = {}  # kept across runs: graphs write them
        self._graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, int]] = {}  # graph, Chains ptr
        self.steps: dict[Bucket, int] = {}  # steps launched per bucket
        self._pool: Any = None  # the graphs' memory pool, once one is captured
        self.failed = ""  # in process a launch does not fail (``RemoteChain``'s can)

    def ready(self) -> bool:
        """Whether a run may start (in process: always; ``RemoteChain``'s may not)."""
        return True

    def has_bucket(self, batch_size: int) -> bool:
        """Whether the draft's graphs have buckets of ``batch_size`` rows (a run needs one)."""
        return batch_size in self.graphs.batch_sizes

    def eligible(self, request_id: str, num_tokens: int) -> bool:
        """Whether the drafter holds ``request_id`` in step with ``num_tokens`` committed
        tokens, as a chain of this run's S."""
        seq = self.state.seqs.get(request_id)
        return (
            seq is not None
            and seq.spec.topk == 1
            and seq.spec.num_steps == self.num_steps
            and seq.last_out[0] is not None
            and len(seq.tokens) == num_tokens
        )

    def begin(
        self, request_ids: Sequence[str], bucket: Bucket, *, features_width: int | None = None
    ) -> Outcome:
        """Stages the buckets' static inputs for a run of ``request_ids`` (reserved already)
        and returns the ``Outcome`` buffers the target half writes."""
        self.request_ids = list(request_ids)
        self._bucket = bucket
        bs, w = bucket.batch_size, self.width
        pages = [self.alloc.pages(rid) for rid in self.request_ids]
        extend = self.graphs.extends[bucket]
        staged = Staged(ints=dict(extend.empty.ints), pages=dict(extend.empty.pages))
        chain = mask_words(range(-1, w - 1), -(-w // WORD_BITS))
        staged.ints["mask0"] = chain * bs
        staged.ints["rows"] = list(range(bs * w))
        staged.pages["pages0"] = pages
        self.graphs.static.stage(extend, staged)
        self._chain_words = extend.modules[0].backend.graph_meta.masked()[1].clone()
        loop = self.graphs.loops[bucket]
        staged = Staged(ints=dict(loop.empty.ints), pages=dict(loop.empty.pages))
        words = self.schedule.num_words
        for t, step in enumerate(self.schedule.steps):
            rows = mask_words(range(-1, step.prev + len(step.depths) - 1), words)
            staged.ints[f"mask{t}"] = rows[step.prev * words :] * bs
        if "pages0" in staged.pages:  # S=1: the extend drafts the only draft, no loop step
            staged.pages["pages0"] = pages
        self.graphs.static.stage(loop, staged)
        self._pages = [len(p) for p in pages]
        outcome = self._outcomes.get(bucket)
        if outcome is None:
            dev = self.device
            outcome = Outcome(
                base=torch.zeros(bs, dtype=torch.int64, device=dev),
                accepted=torch.zeros(bs, dtype=torch.int64, device=dev),
                new=torch.zeros(bs, w, dtype=torch.int64, device=dev),
                alive=torch.zeros(bs, dtype=torch.bool, device=dev),
                features=None if extend.features is None else extend.features[: bs * w],
            )
            share_on_cpu(outcome.base, outcome.accepted, outcome.new, outcome.alive)
            if outcome.features is not None:
                share_on_cpu(outcome.features)  # the extend bucket's rows, moved in place
            self._outcomes[bucket] = outcome
        self.outcome = outcome
        return outcome

    def needs(self, num_tokens: int, unread: int) -> int:
        """Tokens of capacity a row needs before a launch with ``unread`` steps unread: the
        extend writes up to ``L + (unread+1)(S+1) - shift``, the loop's scratch past it."""
        return num_tokens + (unread + 1) * self.width - self.shift + self.scratch

    def reserve(self, lengths: Sequence[int], unread: int) -> bool:
        """Grows every row to ``needs``; False (nothing changed) when the pool cannot."""
        return self.alloc.extend_all(
            [
                (rid, max(0, self.needs(n, unread) - self.alloc.num_tokens(rid)))
                for rid, n in zip(self.request_ids, lengths, strict=True)
            ]
        )

    def _sync_pages(self) -> None:
        bucket = self._bucket
        extend, loop = self.graphs.extends[bucket], self.graphs.loops[bucket]
        tables = [extend.modules[0].backend.graph_meta.page_table]
        if loop.backends:  # every loop step shares one table (S=1: no loop step)
            tables.append(loop.backends[0].graph_meta.page_table)
        for i, rid in enumerate(self.request_ids):
            self._pages[i] = grow_tables(tables, i, self.alloc.pages(rid), self._pages[i])

    @torch.inference_mode()
    def launch(self) -> bool:
        """Queues the extend over ``outcome`` and the loop that writes ``chains`` (True)."""
        assert self.outcome is not None and self.chains is not None
        self._sync_pages()
        bucket = self._bucket
        self.steps[bucket] = self.steps.get(bucket, 0) + 1
        if not self.graphs.use_graphs:
            self._step()
            return True
        graph, bound = self._graphs.get(bucket, (None, 0))
        if graph is None or bound != self.chains.tokens.data_ptr():
            # Capture runs the step once first: run twice, a step writes what it wrote.
            if self._pool is None:  # one for every bucket's graph (as TargetChain._pool)
                self._pool = torch.cuda.graph_pool_handle()
            graph = capture_graph(self.device, self._pool, self._step)
            self._graphs[bucket] = (graph, self.chains.tokens.data_ptr())
        graph.replay()
        return True

    def _step(self) -> None:
        """The captured region: extend inputs, extend, loop inputs, loop, the next chains.
        Reads and writes only the buckets' buffers, ``Outcome`` and ``Chains``."""
        assert self.outcome is not None and self.chains is not None
        out, graphs, bucket = self.outcome, self.graphs, self._bucket
        bs, w = bucket.batch_size, self.width
        page_size = self.alloc.page_size
        extend = graphs.extends[bucket]
        buf = extend.modules[0]
        meta = buf.backend.graph_meta
        prefix_lens, tree_mask = meta.masked()
        paged_inputs = kernels.ops(self.device).paged_inputs
        # The extend: pair k at base + 1 - shift + k, the first accepted + 1 of a row kept.
        buf.input_ids.copy_(out.new.view(-1))
        paged_inputs(
            out.base, out.accepted, out.alive, meta.page_table, meta.slot_mapping,
            meta.seq_lens, prefix_lens, buf.positions, self._chain_words, tree_mask,
            page_size=page_size, shift=1 - self.shift, count_accepted=True,
        )  # fmt: skip
        buf.last_rows.copy_(torch.arange(bs, device=self.device) * w + out.accepted)
        graphs.forward_static(extend)
        loop = graphs.loops[bucket]
        base = out.base + out.accepted + 1
        loop.base.copy_(torch.where(out.alive, base, PAD_BASE))
        # Each loop step's scratch past the committed pairs (base + 1 - shift of them).
        for t, step in enumerate(self.schedule.steps):
            meta = loop.backends[t].graph_meta
            paged_inputs(
                out.base, out.accepted, out.alive, meta.page_table, meta.slot_mapping,
                meta.seq_lens, meta.masked()[0], page_size=page_size,
                shift=2 - self.shift, offset=step.prev, prefix_accepted=True,
            )  # fmt: skip
        graphs.last_in[0][:bs].copy_(graphs.last_out[0][:bs])
        graphs.forward_static(loop)
        result = loop.result[:, :bs]
        bonus = out.new.gather(1, out.accepted[:, None])
        self.chains.tokens.copy_(torch.cat([bonus, result[0].long()], 1))
        self.chains.valid.copy_(result[2] != 0)

    def commit(self, request_id: str, tokens: list[int]) -> None:
        """A read step's committed tokens, appended to the drafter's host copy."""
        self.state.seqs[request_id].tokens.extend(tokens)

    def cancel(self) -> None:
        """Ends a run none of whose steps was launched: the rows' reservations go back and
        the drafter's host state is as it was."""
        for rid in self.request_ids:
            seq = self.state.seqs.get(rid)
            if seq is not None:
                self.alloc.truncate(rid, len(seq.tokens) - self.shift)
        self.request_ids = []
        self.outcome = self.chains = None

    def end(self, finished: Sequence[bool]) -> None:
        """The drafter's host state of the last launched step (every step read): KV length,
        last output and kept feature per row; ``finished`` rows leave the drafter."""
        assert self.outcome is not None
        n, w = len(self.request_ids), self.width
        accepted = self.outcome.accepted[:n].tolist()
        last_out = self.graphs.last_out[0][:n].clone()
        features = self.outcome.features
        for i, rid in enumerate(self.request_ids):
            if finished[i]:
                self.state.release(rid)
                continue
            seq = self.state.seqs[rid]
            self.alloc.truncate(rid, len(seq.tokens) - self.shift)
            seq.last_out[0] = last_out[i]
            if features is not None:  # the last accepted node's, as trim_features keeps
                row = i * w + accepted[i]
                seq.features = features[row : row + 1].clone()
                seq.feature_start = len(seq.tokens) - 2
        self.request_ids = []
        self.outcome = self.chains = None
