"""Draft side of the cycle: the model-based drafter (the interface is in ``base.py``).

One call per step mirrors the wire (``draft.proto``): the target hands over new requests,
the outcomes of its last verification and released ids; the drafter extends its own paged KV
with the committed tokens and answers with the next tree of every request it tracks.

``ModelDrafter`` runs one or more :class:`DraftModule` s. EAGLE-3, EAGLE-1 and a standalone LM
are one module; MTP is one module per head. Module ``m`` expands the nodes at depth
``min(d, M-1)``; head ``m`` consumes token ``t_j`` at position ``j - 1 - m`` with, as hidden,
the target feature of that position (``target`` mode) or head ``m-1``'s output there
(``chain`` mode); past the last head, and always for EAGLE, a module feeds on its own output at
the parent. Every module keeps the committed pairs in its KV; a tree's pairs go after them as
scratch entries that each see only their ancestors (exact tree attention) and are dropped after
drafting.

With graphs enabled (``enable_graphs``), chains (K=1) draft all S steps in one CUDA graph per
batch bucket and committed pairs after a verification extend through one graph per bucket
(``draft_graphs.py``); what no bucket takes runs on the host path below.

Known limit: for trees (K>1) candidate bookkeeping runs on the host between draft steps (one
device read per step): EAGLE-2's data-dependent frontier is not in the draft graphs yet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

import kernels
from tandem.attention import AttentionMetadata, backend_for
from tandem.errors import KVExhausted
from tandem.kv import KVCache
from tandem.models import ForwardContext
from tandem.models.draft import DraftModule
from tandem.spec.base import Drafter
from tandem.spec.chain import DraftHalf
from tandem.spec.tree import CandidatePool, scratch_mask, softmax_topk
from tandem.spec.types import DraftAdmit, SpecConfig, Tree, VerifyOutcome
from tandem.transfer import to_device

if TYPE_CHECKING:
    from tandem.draft.graphs import DraftGraphRunner

logger = logging.getLogger(__name__)


@dataclass
class _Seq:
    """What the drafter keeps per request."""

    spec: SpecConfig
    tokens: list[int]  # committed tokens; the last is the verified token
    features: torch.Tensor | None  # [w, F] target features of positions feature_start...
    feature_start: int
    last_out: list[torch.Tensor | None]  # per module: output of its last committed pair [H_d]
    scratch: list[dict[int, tuple[int, torch.Tensor]]] = field(default_factory=list)


@dataclass
class _Pair:
    """One pair to run through a module: which request, token, position and hidden."""

    request_id: str
    token: int
    position: int
    hidden: torch.Tensor | None  # [H_d]
    node: int | None = None  # pool index when it is a tree node (scratch entry)


@dataclass
class _Run:
    """A request's tokens to run through a module in one forward, their positions, and their
    hiddens ([len(tokens), H], or None for a module without hidden input)."""

    request_id: str
    tokens: list[int]
    positions: list[int]
    hidden: torch.Tensor | None


class ModelDrafter(Drafter):
    def __init__(
        self,
        modules: Sequence[DraftModule],
        kvs: Sequence[KVCache],
        *,
        target_layer_ids: tuple[int, ...],
        mode: str = "chain",
        device: torch.device | str = "cpu",
        fast_top1: bool = True,
    ) -> None:
        if not modules or len(modules) != len(kvs):
            raise ValueError("modules: one KV cache per module expected")
        if mode not in ("chain", "target"):
            raise ValueError(f"mode: {mode!r} is not chain or target")
        self.modules = list(modules)
        self.kvs = list(kvs)
        self.target_layer_ids = target_layer_ids
        self.mode = mode
        self.device = device
        # K=1 takes argmax and its exact probability from one pass over the logits (top1);
        # False takes the softmax + topk path instead (kept to show both give the same trees).
        self.fast_top1 = fast_top1
        self.backend = backend_for(device)
        self.seqs: dict[str, _Seq] = {}
        self._dropped: list[str] = []
        self.graphs: DraftGraphRunner | None = None

    def enable_graphs(
        self,
        *,
        batch_sizes: Sequence[int],
        max_model_len: int,
        num_steps: Sequence[int] = (),
        capture: bool = True,
    ) -> DraftGraphRunner:
        """Runs chains and extends that fit a bucket through CUDA graphs, captured now for
        each S in ``num_steps`` and on first use for any other S (``capture=False``: the same
        static buffers run eagerly, on any device; Triton interpreted on CPU)."""
        from tandem.attention.triton_backend import TritonAttention  # imports triton
        from tandem.draft.graphs import DraftGraphRunner

        attention = self.backend if isinstance(self.backend, TritonAttention) else None
        self.graphs = DraftGraphRunner(
            self,
            batch_sizes=batch_sizes,
            max_model_len=max_model_len,
            num_steps=num_steps,
            capture=capture,
            attention=attention,
        )
        return self.graphs

    def use_graphs(
        self,
        *,
        batch_sizes: Sequence[int],
        max_model_len: int,
        num_steps: Sequence[int] = (),
        capture: bool = True,
    ) -> bool:
        from tandem.draft.graphs import DraftGraphRunner

        if not DraftGraphRunner.supports(self):
            logger.info("draft graphs: not available for target-mode MTP; drafting eagerly")
            return False
        self.enable_graphs(
            batch_sizes=batch_sizes,
            max_model_len=max_model_len,
            num_steps=num_steps,
            capture=capture,
        )
        return True

    def chain_problem(self) -> str:
        if self.graphs is None:
            return super().chain_problem()
        if len(self.modules) != 1:
            return "needs a one-module draft (EAGLE-3, EAGLE, a standalone LM)"
        return ""

    def chain_half(self, num_steps: int, device: torch.device) -> DraftHalf:
        from tandem.draft.chain_draft import DraftChain

        problem = self.chain_problem()
        if problem:
            raise ValueError(f"device chain: {problem}")
        return DraftChain(self, num_steps)

    def num_tracked(self) -> int:
        return len(self.seqs)

    def take_dropped(self) -> list[str]:
        dropped, self._dropped = self._dropped, []
        return dropped

    @torch.inference_mode()
    def step(
        self,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> dict[str, Tree]:
        for request_id in released:
            self._release(request_id)
        updates: list[tuple[str, list[int], torch.Tensor | None]] = []
        for admit in admits:
            self._release(admit.request_id)  # a re-admission starts over
            self.seqs[admit.request_id] = _Seq(
                spec=admit.spec,
                tokens=[],
                features=None,
                feature_start=0,
                last_out=[None] * len(self.modules),
            )
            for kv in self.kvs:
                kv.allocator.allocate(admit.request_id, 0)
            updates.append((admit.request_id, admit.token_ids, admit.features))
        for outcome in outcomes:
            if outcome.request_id in self.seqs:
                new = [*outcome.accepted_token_ids, outcome.bonus_token_id]
                updates.append((outcome.request_id, new, outcome.features))
        ids = [request_id for request_id, _, _ in updates]
        try:
            self._extend(updates)
        except KVExhausted:
            logger.warning("draft KV pool is full: dropping %d requests", len(ids))
            for request_id in ids:
                self._release(request_id)
            self._dropped += ids
            return {}
        return self._draft(ids)

    def release(self, request_id: str) -> None:
        """Forgets ``request_id`` and frees its KV (unknown ids are ignored)."""
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        if self.seqs.pop(request_id, None) is not None:
            for kv in self.kvs:
                kv.allocator.free(request_id)

    # -- committed pairs -------------------------------------------------------------------

    def _extend(self, updates: list[tuple[str, list[int], torch.Tensor | None]]) -> None:
        """Appends committed tokens (and their features) and runs every module over the pairs
        that became complete."""
        starts: dict[str, int] = {}
        for request_id, new_tokens, features in updates:
            seq = self.seqs[request_id]
            starts[request_id] = len(seq.tokens)
            seq.tokens.extend(new_tokens)
            if features is not None:
                self._add_features(seq, features)
        rest = updates  # what no graph bucket takes runs here
        if self.graphs is not None:
            rest = self.graphs.extend(updates, starts)
        # Per request, module m-1's outputs of this extend: (first, output before, outputs).
        prev_outs: dict[str, tuple[int, torch.Tensor | None, torch.Tensor]] = {}
        for m, module in enumerate(self.modules if rest else ()):
            runs: list[_Run] = []
            firsts: list[int] = []
            for request_id, _, _ in rest:
                seq = self.seqs[request_id]
                first = max(starts[request_id], module.shift)
                firsts.append(first)
                hidden = self._committed_hiddens(m, seq, first, prev_outs.get(request_id))
                positions = list(range(first - module.shift, len(seq.tokens) - module.shift))
                runs.append(_Run(request_id, seq.tokens[first:], positions, hidden))
            outs = self._forward(m, runs)
            for run, first, out in zip(runs, firsts, outs, strict=True):
                seq = self.seqs[run.request_id]
                prev_outs[run.request_id] = (first, seq.last_out[m], out)
                if out.shape[0]:
                    seq.last_out[m] = out[-1]
        for request_id, _, _ in updates:
            self._trim_features(self.seqs[request_id])

    def _committed_hiddens(
        self,
        m: int,
        seq: _Seq,
        first: int,
        prev: tuple[int, torch.Tensor | None, torch.Tensor] | None,
    ) -> torch.Tensor | None:
        """Hidden inputs ([n, H]) of module ``m``'s committed pairs consuming ``t_first ...``,
        as one tensor: target features go through ``project_target`` once for the whole run (a
        long catch-up after K=0 steps is one matmul and no per-token work on the host)."""
        module, n = self.modules[m], len(seq.tokens) - first
        if n <= 0 or not module.uses_hidden:
            return None
        if m == 0 or self.mode == "target":
            assert seq.features is not None, "a hidden-consuming draft got no target features"
            row = first - 1 - m - seq.feature_start
            assert row >= 0 and row + n <= seq.features.shape[0], "features are not kept"
            return module.project_target(seq.features[row : row + n])
        # Chain mode: pair t_j feeds on module m-1's output of the pair before it.
        assert prev is not None, "chain head extended before the head it feeds on"
        prev_first, before, outs = prev  # before: module m-1's output preceding prev_first
        start = first - prev_first  # index into [before, *outs]
        if start > 0:
            return outs[start - 1 : start - 1 + n]
        assert before is not None, "chain head has no output to feed on"
        return torch.cat([before[None], outs[: n - 1]])

    def _add_features(self, seq: _Seq, features: torch.Tensor) -> None:
        features = features.to(self.device)
        if seq.features is None:
            # Features start at the position of the first token of this update minus one.
            seq.feature_start = len(seq.tokens) - 1 - features.shape[0]
            seq.features = features
        else:
            seq.features = torch.cat([seq.features, features])

    def _trim_features(self, seq: _Seq) -> None:
        """Keeps the last M features: all that target-mode heads can still ask for."""
        if seq.features is None:
            return
        keep = len(self.modules)
        drop = max(0, seq.features.shape[0] - keep)
        seq.features = seq.features[drop:]
        seq.feature_start += drop

    def _feature(self, seq: _Seq, m: int, position: int) -> torch.Tensor:
        assert seq.features is not None, "a hidden-consuming draft got no target features"
        row = position - seq.feature_start
        assert 0 <= row < seq.features.shape[0], f"feature {position} is not kept"
        return self.modules[m].project_target(seq.features[row : row + 1])[0]

    def _run(
        self,
        m: int,
        pairs: list[list[_Pair]],
        masks: list[torch.Tensor] | None,
    ) -> list[list[torch.Tensor]]:
        """One forward of module ``m`` over each request's pairs, appended to its KV; with
        ``masks`` ([pairs, scratch entries] per request) they are scratch entries seeing the
        committed prefix plus what their mask row allows. Returns outputs per request."""
        module = self.modules[m]
        runs = []
        for chunk in pairs:
            hidden = None
            if module.uses_hidden and chunk:
                hidden = torch.stack([p.hidden for p in chunk])  # type: ignore[misc]
            runs.append(
                _Run(
                    chunk[0].request_id if chunk else "",
                    [p.token for p in chunk],
                    [p.position for p in chunk],
                    hidden,
                )
            )
        return [list(rows.unbind(0)) for rows in self._forward(m, runs, masks)]

    def _forward(
        self, m: int, runs: list[_Run], masks: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """One forward of module ``m`` over every run's tokens, appended to its request's KV
        (scratch entries under ``masks``, as ``_run``). Returns each run's outputs, [n, H_d]."""
        module, kv = self.modules[m], self.kvs[m]
        alloc = kv.allocator
        live = [i for i, run in enumerate(runs) if run.tokens]
        if not live:
            return [torch.empty(0) for _ in runs]
        starts, ends, prefixes = [], [], []
        for i in live:
            run = runs[i]
            start = alloc.num_tokens(run.request_id)
            alloc.extend(run.request_id, len(run.tokens))
            starts.append(start)
            ends.append(start + len(run.tokens))
            scratch = 0 if masks is None else masks[i].shape[1] - len(run.tokens)
            prefixes.append(start - scratch)
        live_ids = [runs[i].request_id for i in live]
        meta = AttentionMetadata.build(
            page_size=alloc.page_size,
            query_lens=[len(runs[i].tokens) for i in live],
            seq_lens=ends,
            page_table=alloc.page_table(live_ids, device=self.device),
            slot_mapping=kv.slot_mapping_tensor(live_ids, starts, ends),
            masks=None if masks is None else [masks[i] for i in live],
            prefix_lens=prefixes,
        )
        token_list = [t for i in live for t in runs[i].tokens]
        position_list = [p for i in live for p in runs[i].positions]
        token_ids, positions = to_device(torch.tensor([token_list, position_list]), self.device)
        hidden = None
        if module.uses_hidden:
            parts = [runs[i].hidden for i in live]
            hidden = parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type]
        ctx = ForwardContext(kv=kv, meta=meta, backend=self.backend)
        started = time.perf_counter_ns()
        out = module(token_ids, hidden, positions, ctx)
        self.model_ns += time.perf_counter_ns() - started
        split = iter(out.split([len(runs[i].tokens) for i in live]))
        return [next(split) if run.tokens else out[:0] for run in runs]

    # -- trees -----------------------------------------------------------------------------

    def _draft(self, request_ids: list[str]) -> dict[str, Tree]:
        """Next trees. A chain batch that fits a graph bucket drafts there; trees (K>1), and
        chains no bucket takes, run this host loop: top-K read back after every step, EAGLE-2
        frontier and scratch masks built here (``draft_graphs.py`` says what lifts it)."""
        if self.graphs is not None:
            trees = self.graphs.draft(request_ids)
            if trees is not None:
                return trees
        pools: dict[str, CandidatePool] = {}
        for request_id in request_ids:
            seq = self.seqs[request_id]
            pools[request_id] = CandidatePool(verified_token=seq.tokens[-1])
            seq.scratch = [{} for _ in self.modules]
        roots = [r for r in request_ids if self.seqs[r].last_out[0] is not None]
        for r in request_ids:
            if r not in roots:
                pools[r].stopped = True  # too little context for a first pair yet
        if roots:
            outs = torch.stack([self.seqs[r].last_out[0] for r in roots])  # type: ignore[misc]
            self._expand(0, roots, [[-1] for _ in roots], outs, pools)
        max_steps = max((self.seqs[r].spec.num_steps for r in request_ids), default=0)
        for step in range(1, max_steps):
            active = [
                r
                for r in request_ids
                if not pools[r].stopped and step < self.seqs[r].spec.num_steps
            ]
            if not active:
                break
            self._draft_step(step, active, pools)
        trees = {}
        for request_id in request_ids:
            seq = self.seqs[request_id]
            for m, kv in enumerate(self.kvs):
                committed = max(0, len(seq.tokens) - self.modules[m].shift)
                kv.allocator.truncate(request_id, committed)
            seq.scratch = []
            pool = pools[request_id]
            n = min(seq.spec.tree_size, len(pool.tokens) + 1)
            trees[request_id] = pool.to_tree(n)
        return trees

    def _draft_step(self, step: int, active: list[str], pools: dict[str, CandidatePool]) -> None:
        """Expands each active request's frontier (nodes at depth ``step``)."""
        m = min(step, len(self.modules) - 1)
        module = self.modules[m]
        pairs: list[list[_Pair]] = []
        masks: list[torch.Tensor] = []
        for request_id in active:
            seq, pool = self.seqs[request_id], pools[request_id]
            base = len(seq.tokens) - 1  # target position of node 0
            scratch = seq.scratch[m]
            chunk: list[_Pair] = []
            for x in pool.frontier:
                for y in pool.path(x):
                    if y in scratch or any(p.node == y for p in chunk):
                        continue
                    position = base + pool.depths[y] - module.shift
                    if position < 0:
                        pool.stopped = True
                        break
                    hidden = self._tree_hidden(m, seq, pool, y)
                    chunk.append(_Pair(request_id, pool.tokens[y], position, hidden, node=y))
            if chunk and not self.kvs[m].allocator.can_extend(request_id, len(chunk)):
                pool.stopped = True  # no room for scratch entries: propose what we have
            if pool.stopped:
                chunk = []
            pairs.append(chunk)
            masks.append(scratch_mask(scratch, [p.node for p in chunk], pool))
        outs = self._run(m, pairs, masks)
        alloc = self.kvs[m].allocator
        rows: list[str] = []
        parents: list[list[int]] = []
        frontier_outs: list[torch.Tensor] = []
        for request_id, chunk, out in zip(active, pairs, outs, strict=True):
            if not chunk:
                continue
            seq, pool = self.seqs[request_id], pools[request_id]
            end = alloc.num_tokens(request_id)
            for i, (pair, row) in enumerate(zip(chunk, out, strict=True)):
                assert pair.node is not None
                seq.scratch[m][pair.node] = (end - len(chunk) + i, row)
            rows.append(request_id)
            parents.append(list(pool.frontier))
            frontier_outs.extend(seq.scratch[m][x][1] for x in pool.frontier)
        if rows:
            self._expand(m, rows, parents, torch.stack(frontier_outs), pools)

    def _expand(
        self,
        m: int,
        request_ids: list[str],
        parents: list[list[int]],
        outs: torch.Tensor,  # [sum(len(parents)), H_d], one row per parent, in order
        pools: dict[str, CandidatePool],
    ) -> None:
        """Top-K children of every parent; the K best new candidates become the frontier."""
        module = self.modules[m]
        started = time.perf_counter_ns()
        logits = module.compute_logits(outs)
        k = max(self.seqs[r].spec.topk for r in request_ids)
        ops = kernels.ops(logits.device)  # Triton on CUDA, the torch references elsewhere
        if k == 1 and self.fast_top1:
            ids, logprobs, valid = ops.top1(logits)
            ids, logprobs = ids[:, None], logprobs[:, None]
        elif k == 1:
            ids, logprobs, valid = softmax_topk(logits, 1)
        else:
            ids, logprobs, valid = ops.topk(logits, min(k, logits.shape[-1]))
        ids = module.to_target_ids(ids)
        ids_host, logprobs_host, valid_host = ids.tolist(), logprobs.tolist(), valid.tolist()
        self.model_ns += time.perf_counter_ns() - started
        row = 0
        for request_id, request_parents in zip(request_ids, parents, strict=True):
            pool, topk = pools[request_id], self.seqs[request_id].spec.topk
            added: list[int] = []
            for parent in request_parents:
                if not valid_host[row]:
                    pool.stopped = True  # NaN/inf logits: nothing from this row is proposed
                else:
                    added += pool.add_children(
                        parent, ids_host[row][:topk], logprobs_host[row][:topk]
                    )
                row += 1
            pool.select_frontier(added, topk)
            if not added:
                pool.stopped = True

    def _tree_hidden(self, m: int, seq: _Seq, pool: CandidatePool, y: int) -> torch.Tensor | None:
        """Hidden input of module ``m``'s pair that consumes tree node ``y``."""
        if not self.modules[m].uses_hidden:
            return None
        depth = pool.depths[y]
        if m >= 1 and depth <= m:
            if self.mode == "target":
                return self._feature(seq, m, len(seq.tokens) - 2 + depth - m)
            ancestor = pool.path(y)[depth - 2] if depth >= 2 else None
            if ancestor is None:
                return seq.last_out[m - 1]
            return seq.scratch[m - 1][ancestor][1]
        parent = pool.parents[y]
        if parent < 0:
            return seq.last_out[m]
        return seq.scratch[m][parent][1]
