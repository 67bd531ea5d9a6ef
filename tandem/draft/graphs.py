"""CUDA-graph runner for the draft (docs/design.md section 7): the chain loop and the extend.

**Draft loop** (K=1 chains, N=S+1): all S steps of a batch in one captured region per bucket
(``batch_size`` requests, width N). Step 0 takes the top-1 of module 0's last committed output;
step ``s`` runs module ``m = min(s, M-1)`` over the pairs it has not drafted yet (one pair once
the module is running; the nodes of depth 1..s on a chain-MTP head's first step), then the top-1
of its output at depth ``s``. Argmax and log-probability (``kernels.ops(device).top1``), the
draft-to-target id map, the next step's token and hidden all stay on the device; the host reads
ids, log-probabilities and valid flags once, after the replay, and builds the chain as the
host path does (``trees.py``; an invalid row ends it at that depth). Scratch KV slots for
every step are reserved before the replay and truncated after it.

**Draft extend**: the pairs a verification completed (1..S+1 new tokens per request) through
every module, at buckets ``batch_size x (S+1)``. Module 0 projects the staged target features
(``project_target``, inside the graph); a chain-MTP head gathers its hidden from the previous
head's outputs of this replay or that head's last output before it. The last output of every
module and request is written into the runner's ``last_out`` buffers and copied out.

What a replay may and may not do (SGLang #25015, #22041): inputs are static buffers the host
refills (one packed staging tensor, one host-to-device copy; target features and last outputs
are copied into their float buffers); positions are ``base + (depth - shift)`` with constant
per-step offsets, never incremented in place; carried state (each head's output, the previous
head's hidden for chained MTP) lives in tensors of the replay or in the runner's own buffers,
never in attributes swapped during capture. Padding as in ``tandem/target/graphs.py``: slot -1
and empty mask rows for padded rows, ``seq_len = prefix_len = 0`` for padding requests.
``capture=False`` ("eager static") runs the same buffers without capturing (CPU tests).

**Tree loop** (K>1, one-module drafts): a whole EAGLE-2 tree in one captured region per bucket
and tree shape, frontier selection and scratch masks on the device (``tree_graphs.py``).

Known limits: a step runs eagerly (whole step, so trees equal the eager path's) when requests
differ in S (or, for trees, in K or N), a tree is drafted by several modules (chained MTP), a
request lacks context for a pair, a pool lacks room for every scratch slot, or the batch exceeds
the largest bucket; ``mode="target"`` with several MTP heads always runs eagerly (its heads read
target features at shifted positions, not staged here); admissions (prompts) extend eagerly. An
S or tree shape not captured at start is captured on first use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

import kernels
from tandem.draft.buffers import (
    PAD_BASE,
    ExtendEntry,
    LoopEntry,
    StaticInputs,
    TreeEntry,
    build_extend_entry,
    build_loop_entry,
    build_tree_entry,
)
from tandem.draft.plan import plan_extend, plan_loop
from tandem.draft.schedule import TreeShape, chain_schedule
from tandem.draft.state import DraftSeq, ModelDraftState, Update
from tandem.draft.tree_graphs import read_trees, tree_forward, tree_values
from tandem.graphs.base import Bucket, capture_all
from tandem.models import ForwardContext
from tandem.spec.types import Tree, valid_depth

if TYPE_CHECKING:
    from tandem.attention.triton_backend import TritonAttention

logger = logging.getLogger(__name__)


class DraftGraphRunner:
    """Static buffers, buckets, capture and replay of a model drafter's chains and extends,
    over its ``ModelDraftState``."""

    def __init__(
        self,
        state: ModelDraftState,
        *,
        batch_sizes: Sequence[int],
        max_model_len: int,
        num_steps: Sequence[int] = (),
        tree_shapes: Sequence[TreeShape] = (),
        capture: bool = True,
        attention: TritonAttention | None = None,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError("batch_sizes: need at least one size, all >= 1")
        if max_model_len < 1 or any(s < 1 for s in num_steps):
            raise ValueError("max_model_len, num_steps: must be >= 1")
        if not self.supports(state):
            raise ValueError("state: target-mode MTP with several heads has no draft graphs")
        self.state = state
        self.device = state.kvs[0].k_caches[0].device
        if capture and self.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, not {self.device}")
        self.use_graphs = capture
        from tandem.attention.triton_backend import TritonAttention

        self.attention = attention or TritonAttention()
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_model_len = max_model_len
        self.static = StaticInputs(self.device)
        modules = state.modules
        self.hidden_dtype = next(modules[0].parameters()).dtype
        max_bs = self.batch_sizes[-1]
        # Each module's last committed output (in) and the extend's new one (out): [bs, H_d].
        self.last_in = [self._zeros(max_bs, m.hidden_size or 1) for m in modules]
        self.last_out = [self._zeros(max_bs, m.hidden_size or 1) for m in modules]
        self.loops: dict[Bucket, LoopEntry] = {}  # width = S + 1
        self.extends: dict[Bucket, ExtendEntry] = {}  # width = S + 1
        self.steps: list[int] = []  # the S values with buckets
        self.trees: dict[tuple[int, TreeShape], TreeEntry] = {}  # (batch size, shape)
        self.tree_shapes: list[TreeShape] = []  # the shapes with buckets
        self.replays: dict[tuple[str, Bucket], int] = {}  # ("loop" | "extend" | "tree", bucket)
        self.eager_steps = 0  # chain or tree batches sent to the host path (context, room)
        for s in sorted(set(num_steps)):
            self.ensure_steps(s)
        for shape in sorted(set(tree_shapes)):
            self.ensure_tree(shape)

    @staticmethod
    def supports(state: ModelDraftState) -> bool:
        return len(state.modules) == 1 or state.mode == "chain"

    @property
    def captured(self) -> bool:
        """Whether every bucket replays a graph (False in eager static mode)."""
        entries = [*self.loops.values(), *self.extends.values(), *self.trees.values()]
        return bool(entries) and all(e.graph is not None for e in entries)

    # -- draft loop --------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, request_ids: list[str]) -> dict[str, Tree] | None:
        """The chain of every request through its bucket's graph; None when the step has to
        run eagerly (see the module docstring)."""
        d = self.state
        seqs = [d.seqs[r] for r in request_ids]
        if not seqs or not d.fast_top1:
            return None
        num_steps = seqs[0].spec.num_steps
        bs = next((b for b in self.batch_sizes if b >= len(seqs)), None)
        if bs is None:
            return None
        if seqs[0].spec.topk > 1:
            return self._draft_trees(request_ids, seqs, bs)
        if any(s.spec.topk != 1 or s.spec.num_steps != num_steps for s in seqs):
            return None
        schedule = chain_schedule(num_steps, len(d.modules), d.mode)
        plan = plan_loop(d, request_ids, schedule, self._max_pages(num_steps + 1))
        if plan is None:
            self.eager_steps += 1
            return None
        self.ensure_steps(num_steps)
        entry = self.loops[Bucket(bs, num_steps + 1)]
        started = time.perf_counter_ns()
        for m, total in enumerate(schedule.totals):
            for request_id in request_ids if total else ():
                d.kvs[m].allocator.extend(request_id, total)
        self.static.stage(entry, plan.values(entry, d.kvs))
        for m in schedule.roots:
            self.last_in[m][: len(seqs)].copy_(torch.stack([s.last_out[m] for s in seqs]))  # type: ignore[misc]
        self._replay("loop", entry)
        ids, _, valid = entry.result[:, : len(seqs)].tolist()
        d.model_ns += time.perf_counter_ns() - started
        trees = {}
        for i, (request_id, seq) in enumerate(zip(request_ids, seqs, strict=True)):
            for m, kv in enumerate(d.kvs):
                kv.allocator.truncate(request_id, max(0, len(seq.tokens) - d.modules[m].shift))
            # The chain stops above the first step with NaN/inf logits, as on the host. What
            # CandidatePool.to_tree gives for a chain (scores only fall along it), built
            # directly: this loop runs per request and step on the host.
            depth = min(valid_depth(valid[i]), seq.spec.tree_size - 1)
            trees[request_id] = Tree.chain([seq.tokens[-1], *(int(t) for t in ids[i][:depth])])
        return trees

    def _draft_trees(
        self, request_ids: list[str], seqs: list[DraftSeq], bs: int
    ) -> dict[str, Tree] | None:
        """The tree of every request through its bucket's tree loop (``tree_graphs.py``);
        None when the step has to run on the host: several modules, requests of different
        tree shapes, K above the draft's vocabulary, or what sends a chain there."""
        d = self.state
        shape = TreeShape.of(seqs[0].spec)
        if len(d.modules) != 1 or any(TreeShape.of(s.spec) != shape for s in seqs):
            return None
        if shape.topk > d.modules[0].vocab_size:
            return None
        scratch = (shape.num_steps - 1) * shape.topk
        plan = plan_loop(d, request_ids, shape.schedule(), self._max_pages(scratch + 1))
        if plan is None:
            self.eager_steps += 1
            return None
        self.ensure_tree(shape)
        entry = self.trees[(bs, shape)]
        started = time.perf_counter_ns()
        alloc = d.kvs[0].allocator
        for request_id in request_ids if scratch else ():
            alloc.extend(request_id, scratch)
        self.static.stage(entry, tree_values(plan, entry, d))
        self.last_in[0][: len(seqs)].copy_(torch.stack([s.last_out[0] for s in seqs]))  # type: ignore[misc]
        self._replay("tree", entry)
        rows = entry.result[: len(seqs)].tolist()
        d.model_ns += time.perf_counter_ns() - started
        shift = d.modules[0].shift
        for request_id, seq in zip(request_ids, seqs, strict=True):
            alloc.truncate(request_id, max(0, len(seq.tokens) - shift))
        trees = read_trees(entry, [s.tokens[-1] for s in seqs], rows)
        return dict(zip(request_ids, trees, strict=True))

    def _loop_forward(self, entry: LoopEntry) -> None:
        """The captured region of a draft loop: reads the staged inputs and ``last_in``, writes
        scratch KV of real rows and ``entry.result`` ([3, bs, S]: ids, logprobs, valid)."""
        d, bs = self.state, entry.bucket.batch_size
        ops = kernels.ops(self.device)
        picked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def pick(m: int, out: torch.Tensor) -> torch.Tensor:  # [bs, H_d] -> [bs] target ids
            module = d.modules[m]
            ids, logprobs, valid = ops.top1(module.compute_logits(out))
            target_ids = module.to_target_ids(ids)
            picked.append((target_ids, logprobs, valid))
            return target_ids

        outs: dict[tuple[int, int], torch.Tensor] = {}  # (module, depth) -> [bs, H_d]
        tokens = {1: pick(0, self.last_in[0][:bs])}  # depth -> [bs] target ids

        def hidden_of(source: tuple[int, int]) -> torch.Tensor:  # [bs, H_d]
            m, depth = source
            return self.last_in[m][:bs] if depth == 0 else outs[source]

        for s, step in enumerate(entry.schedule.steps, 1):
            module, w = d.modules[step.module], len(step.depths)
            token_ids = torch.stack([tokens[depth] for depth in step.depths], 1).reshape(-1)
            hidden = None
            if module.uses_hidden:
                rows = [hidden_of(src) for src in step.sources]
                hidden = torch.stack(rows, 1).reshape(bs * w, -1)
            positions = (entry.base[:, None] + entry.offsets[s - 1][None, :]).reshape(-1)
            ctx = ForwardContext(
                kv=d.kvs[step.module], meta=entry.placeholder, backend=entry.backends[s - 1]
            )
            out = module(token_ids, hidden, positions, ctx).view(bs, w, -1)
            for k, depth in enumerate(step.depths):
                outs[(step.module, depth)] = out[:, k]
            tokens[s + 1] = pick(step.module, outs[(step.module, s)])
        columns = [torch.stack(col, 1).double() for col in zip(*picked, strict=True)]
        entry.result.copy_(torch.stack(columns))

    # -- draft extend ------------------------------------------------------------------------

    @torch.inference_mode()
    def extend(self, updates: list[Update], starts: dict[str, int]) -> list[Update]:
        """Runs the committed pairs of the requests that fit a bucket (tokens and features
        already appended by the drafter); returns the updates left for the eager path."""
        d = self.state
        fits = [u for u in updates if starts[u[0]] > 0 and len(u[1]) >= 1]
        if not fits:
            return updates
        num_steps = max(d.seqs[u[0]].spec.num_steps for u in fits)
        bs = next((b for b in self.batch_sizes if b >= len(fits)), None)
        if bs is None or max(len(u[1]) for u in fits) > num_steps + 1:
            return updates
        ids = [u[0] for u in fits]
        plan = plan_extend(d, ids, starts, num_steps + 1, self._max_pages(num_steps + 1))
        if plan is None:
            return updates
        self.ensure_steps(num_steps)
        entry = self.extends[Bucket(bs, num_steps + 1)]
        started = time.perf_counter_ns()
        for m, counts in enumerate(plan.counts):
            for request_id, count in zip(ids, counts, strict=True):
                d.kvs[m].allocator.extend(request_id, count)  # KVExhausted: the step drops all
        self.static.stage(entry, plan.values(entry, d.kvs))
        if plan.features is not None:
            assert entry.features is not None
            rows = entry.rows[: plan.features.shape[0]]
            entry.features.index_copy_(0, rows, plan.features.to(entry.features.dtype))
        for m, olds in enumerate(plan.last_in):
            for i, old in enumerate(olds):
                if old is not None:
                    self.last_in[m][i].copy_(old)
        self._replay("extend", entry)
        news = [buf[: len(ids)].clone() for buf in self.last_out]
        d.model_ns += time.perf_counter_ns() - started
        for m, counts in enumerate(plan.counts):
            for i, (request_id, count) in enumerate(zip(ids, counts, strict=True)):
                if count:
                    d.seqs[request_id].last_out[m] = news[m][i]
        done = set(ids)
        return [u for u in updates if u[0] not in done]

    def _extend_forward(self, entry: ExtendEntry) -> None:
        """The captured region of an extend: every module over the staged pairs; writes their
        KV (real rows) and each request's last output into ``last_out``."""
        d, bs = self.state, entry.bucket.batch_size
        prev: torch.Tensor | None = None  # [bs * width, H_d], the previous module's outputs
        for m, (module, buf) in enumerate(zip(d.modules, entry.modules, strict=True)):
            hidden = None
            if module.uses_hidden and m == 0:
                assert entry.features is not None
                hidden = module.project_target(entry.features)
            elif module.uses_hidden:
                assert prev is not None and buf.sources is not None
                hidden = torch.cat([self.last_in[m - 1][:bs], prev]).index_select(0, buf.sources)
            ctx = ForwardContext(kv=d.kvs[m], meta=entry.placeholder, backend=buf.backend)
            out = module(buf.input_ids, hidden, buf.positions, ctx)
            self.last_out[m][:bs].copy_(out.index_select(0, buf.last_rows))
            prev = out

    # -- buckets and capture -----------------------------------------------------------------

    def _max_pages(self, new: int) -> int:
        """Pages of a request's page table: the longest context plus ``new`` entries (S+1 for
        a chain or an extend), at most the smallest pool (no request holds more)."""
        kvs = self.state.kvs
        longest = -(-(self.max_model_len + new) // kvs[0].spec.page_size)
        return min(longest, *(kv.allocator.num_pages for kv in kvs))

    def ensure_steps(self, num_steps: int) -> None:
        """Buckets for S = ``num_steps`` (and, with graphs, their capture), once."""
        if num_steps in self.steps:
            return
        d = self.state
        schedule = chain_schedule(num_steps, len(d.modules), d.mode)
        width, max_pages = num_steps + 1, self._max_pages(num_steps + 1)
        features = None
        if d.modules[0].uses_hidden:
            features = self._zeros(self.batch_sizes[-1] * width, d.feature_size())
        new: list[Entry] = []
        for bs in self.batch_sizes:
            bucket = Bucket(bs, width)
            args = (self.attention, self.device, max_pages, PAD_BASE)
            self.loops[bucket] = build_loop_entry(d, bucket, schedule, *args)
            self.extends[bucket] = build_extend_entry(d, bucket, features, *args)
            new += [self.loops[bucket], self.extends[bucket]]
        self.steps.append(num_steps)
        if self.use_graphs:
            self._capture(f"S={num_steps}", new)

    def ensure_tree(self, shape: TreeShape) -> None:
        """Tree-loop buckets for ``shape`` (and, with graphs, their capture), once."""
        if shape in self.tree_shapes:
            return
        if len(self.state.modules) != 1:
            raise ValueError("tree graphs: need a one-module draft")
        max_pages = self._max_pages((shape.num_steps - 1) * shape.topk + 1)
        new: list[Entry] = []
        for bs in self.batch_sizes:
            args = (self.attention, self.device, max_pages, PAD_BASE)
            self.trees[(bs, shape)] = build_tree_entry(self.state, bs, shape, *args)
            new.append(self.trees[(bs, shape)])
        self.tree_shapes.append(shape)
        if self.use_graphs:
            what = f"K={shape.topk}, S={shape.num_steps}, N={shape.tree_size}"
            self._capture(what, new)

    def _capture(self, what: str, entries: list[Entry]) -> None:
        order = sorted(entries, key=lambda e: e.bucket, reverse=True)  # one pool per call
        jobs = [
            (
                f"{_kind(e)}, {what}, {e.bucket.batch_size} requests",
                partial(self.static.stage, e, e.empty),
                partial(self._forward, e),
            )
            for e in order
        ]
        summary = f"{len(order)} draft CUDA graphs ({what}, batch sizes {self.batch_sizes})"
        graphs = capture_all(self.device, jobs, logger, "draft CUDA graph", summary)
        for entry, graph in zip(order, graphs, strict=True):
            entry.graph = graph

    def _forward(self, entry: Entry) -> None:
        if isinstance(entry, LoopEntry):
            self._loop_forward(entry)
        elif isinstance(entry, TreeEntry):
            tree_forward(self.state, entry, self.last_in[0])
        else:
            self._extend_forward(entry)

    def forward_static(self, entry: LoopEntry | ExtendEntry) -> None:
        """``entry``'s forward on its static inputs, run (or captured) by the caller: what a
        graph of the caller's own holds around it (``tandem/draft/chain_draft.py``)."""
        self._forward(entry)

    def _replay(self, kind: str, entry: Entry) -> None:
        if entry.graph is not None:
            entry.graph.replay()
        else:
            self._forward(entry)
        key = (kind, entry.bucket)
        self.replays[key] = self.replays.get(key, 0) + 1

    def _zeros(self, rows: int, width: int) -> torch.Tensor:
        return torch.zeros(rows, width, dtype=self.hidden_dtype, device=self.device)


Entry = LoopEntry | ExtendEntry | TreeEntry


def _kind(entry: Entry) -> str:
    return {LoopEntry: "loop", ExtendEntry: "extend", TreeEntry: "tree"}[type(entry)]
