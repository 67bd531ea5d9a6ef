"""Speculative chain steps launched before the last verdict is read: stage 1 of
docs/device-cycle.md, in process.

An ordinary speculative step (``Engine.step``) reads the verification on the host, commits,
and hands the outcome to the drafter, which stages its extend and draft loop from host numbers
and reads the chain back before the next verify is staged: the GPU waits for the host twice a
cycle. A run of device-chain steps keeps the cycle's state on the device instead, per request:

- ``base``: the KV index and RoPE position of node 0, the verified token (L - 1);
- ``tokens``: the chain to verify next ([bs, S+1]: node 0, then the drafts) and ``valid``:
  which drafts the draft loop found finite (a chain ends at its first invalid draft).

One launch queues, with no host read in between: the target's verify graph, its ids,
positions, slots and lengths written from ``base`` on the device (a chain needs no KV move:
node i already sits at L-1+i); the greedy verdict (``top1`` per node, the accepted prefix, the
new tokens and their log-probabilities, or the simulated accept length) and its copy to pinned
memory; the draft's extend over the accepted pairs (rows past the accept length store nothing
and see nothing); the draft loop from the new base, whose chain is the next step's input. The
host launches step r+1 before it reads step r, so the GPU runs the steps back to back.

What the host knows a step late, and how it stays exact:

- KV pages, in both pools, are reserved for the worst case of every unread step (S+1 tokens
  each) before a launch, and new pages go into the graphs' page tables on the stream.
- A request that finishes (EOS, stop, length, abort) is known when its step is read; the step
  launched meanwhile computed a row for it, which is dropped, and the run ends.
- When the run ends, the host state an ordinary step reads is rebuilt from the last launched
  step: the target's KV length, the drafter's KV length, last output and kept feature, and each
  request's next tree (its tokens were appended as the steps were read).

A run starts only in the steady state (``can_start``): every running request decoding
greedily without penalties in one lane, each tracked by an in-process ``ModelDrafter`` with
draft graphs and one module (EAGLE-3, EAGLE, a standalone LM) and holding a chain tree, no
prompt waiting, graph buckets for the batch, room for three more steps under every request's
limits. The engine ends it when any of that changes (``tandem/engine_chain.py``).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

import kernels
from tandem.graph_buffers import WORD_BITS, Bucket, mask_words
from tandem.graphs import TargetGraphRunner
from tandem.kv import KVCache
from tandem.request import Request
from tandem.scheduler import Scheduler
from tandem.spec.draft_plan import PAD_BASE, Staged, chain_schedule
from tandem.spec.drafter import ModelDrafter
from tandem.spec.simulate import AcceptSimulator
from tandem.spec.types import SpecConfig, Tree

logger = logging.getLogger(__name__)

_RING = 3  # verdict slots in pinned memory: at most two steps are unread at once
_STEPS_AHEAD = 3  # steps of room a request needs to start or go on (two unread, one more)


@dataclass
class ChainRead:
    """One request's outcome of one step, as the host reads it."""

    request: Request
    new_tokens: list[int]  # accepted drafts + the bonus token
    logprobs: list[float]  # target log-probability of each
    drafted: int  # drafts in the verified chain
    accepted: int


@dataclass
class _Launched:
    slot: int  # its verdict's row of the pinned ring
    copied: torch.cuda.Event | None  # recorded after the verdict's copy (None off CUDA)


def unsupported(drafter: object, spec: SpecConfig | None, target: TargetGraphRunner | None) -> str:
    """Why an engine cannot run device-chain steps ('' when it can)."""
    if spec is None or spec.topk != 1:
        return "needs chains (topk 1)"
    if not isinstance(drafter, ModelDrafter) or drafter.graphs is None:
        return "needs an in-process drafter with draft graphs"
    if len(drafter.modules) != 1:
        return "needs a one-module draft (EAGLE-3, EAGLE, a standalone LM)"
    if target is None or spec.num_steps + 1 not in target.widths:
        return "needs the target's CUDA graphs (cuda_graphs) with a bucket width of S+1"
    return ""


class DeviceChain:
    """The device state of a run of chain steps, its launches and its reads."""

    def __init__(
        self,
        *,
        target: TargetGraphRunner,
        kv: KVCache,
        drafter: ModelDrafter,
        spec: SpecConfig,
        simulator: AcceptSimulator | None,
        max_model_len: int,
    ) -> None:
        problem = unsupported(drafter, spec, target)
        if problem:
            raise ValueError(f"device chain: {problem}")
        assert drafter.graphs is not None
        self.target = target
        self.kv = kv
        self.drafter = drafter
        self.graphs = drafter.graphs
        self.num_steps = spec.num_steps
        self.width = spec.num_steps + 1
        self.max_model_len = max_model_len
        self.device = target.device
        self.on_cuda = self.device.type == "cuda"
        self.shift = drafter.modules[0].shift
        self.schedule = chain_schedule(self.num_steps, 1, drafter.mode)
        self.scratch = self.schedule.totals[0]  # the loop's scratch entries a request
        self.mu = 0.0
        self.generator: torch.Generator | None = None
        if simulator is not None:
            self.mu = simulator.mu
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(0)
        self.graphs.ensure_steps(self.num_steps)
        max_bs = max(target.batch_sizes)
        self._verdicts = torch.zeros(
            _RING, max_bs, 2 + 2 * self.width, dtype=torch.float64, pin_memory=self.on_cuda
        )
        self._next_slot = 0
        self._j = torch.arange(self.width, device=self.device)
        self.reqs: list[Request] = []  # the run's requests, in row order ([] when idle)
        self.unread: deque[_Launched] = deque()
        self.runs = 0  # runs started
        self.launches = 0  # steps launched
        self._run_launches = 0  # launches before the current run
        self._bucket = Bucket(1, self.width)
        self._target_pages: list[int] = []  # per row: pages written into the graphs' tables
        self._draft_pages: list[int] = []
        # Device state of the run ([bs] rows; rows past the requests pad).
        self._alive = torch.zeros(0, dtype=torch.bool, device=self.device)
        self._base = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._tokens = torch.zeros(0, self.width, dtype=torch.int64, device=self.device)
        self._valid = torch.zeros(0, self.num_steps, dtype=torch.bool, device=self.device)
        self._accepted = torch.zeros(0, dtype=torch.int64, device=self.device)

    @property
    def active(self) -> bool:
        return bool(self.reqs)

    # -- when ---------------------------------------------------------------------------------

    def _limit(self, req: Request) -> int:
        return min(self.max_model_len, len(req.prompt_ids) + req.params.max_new_tokens)

    def has_room(self, req: Request) -> bool:
        """Room for the steps a run may have launched past the last read, and one more."""
        return req.num_tokens + _STEPS_AHEAD * self.width <= self._limit(req)

    def _eligible(self, req: Request) -> bool:
        p, tree, seq = req.params, req.tree, self.drafter.seqs.get(req.request_id)
        return (
            req.decoding
            and req.in_draft
            and p.greedy
            and p.repetition_penalty == 1.0
            and tree is not None
            and len(tree) <= self.width
            and tree.parents == (-1, *range(len(tree) - 1))
            and seq is not None
            and seq.spec.topk == 1
            and seq.spec.num_steps == self.num_steps
            and seq.last_out[0] is not None
            and len(seq.tokens) == req.num_tokens
            and self.has_room(req)
        )

    def can_start(self, scheduler: Scheduler) -> bool:
        """Whether the running requests are in the steady state a run needs (module
        docstring); the caller checks lanes and the exchange."""
        running = scheduler.running
        if self.active or scheduler.waiting or not running:
            return False
        if self.target.bucket_for(len(running), self.width) is None:
            return False
        return all(self._eligible(req) for req in running)

    def stop_reason(self, scheduler: Scheduler) -> str:
        """Why the run may not launch another step ('' when it may)."""
        if scheduler.waiting:
            return "a prompt is waiting"
        if any(req.finished for req in self.reqs):
            return "a request finished"
        if not all(self.has_room(req) for req in self.reqs):
            return "a request is near its length limit"
        return ""

    # -- launching ----------------------------------------------------------------------------

    def start(self, reqs: list[Request]) -> bool:
        """Stages a run of ``reqs`` (their trees are the first step's) and launches its first
        step; False (nothing changed) when the pools cannot hold the reservation."""
        bucket = self.target.bucket_for(len(reqs), self.width)
        assert bucket is not None and bucket.width == self.width
        self.reqs = list(reqs)
        self._bucket = bucket
        if not self._reserve(0):
            self.reqs = []
            return False
        bs, n, w, dev = bucket.batch_size, len(reqs), self.width, self.device
        chains = []
        tokens, valid = [], []
        for req in reqs:
            assert req.tree is not None
            drafts = list(req.tree.tokens[1:])
            tokens.append([req.tree.tokens[0], *drafts, *[0] * (w - 1 - len(drafts))])
            valid.append([k < len(drafts) for k in range(self.num_steps)])
            chains.append(Tree(tokens=tuple(tokens[-1]), parents=(-1, *range(w - 1))))
        missing = bs - n
        self._alive = torch.tensor([True] * n + [False] * missing, device=dev)
        self._base = torch.tensor([r.num_computed for r in reqs] + [0] * missing, device=dev)
        self._tokens = torch.tensor(tokens + [[0] * w] * missing, device=dev)
        self._valid = torch.tensor(valid + [[False] * self.num_steps] * missing, device=dev)
        # The target's bucket: everything staged once, the page tables as they are now.
        plan = self.target.plan(
            [r.request_id for r in reqs], [r.num_computed for r in reqs], chains
        )
        assert plan is not None and plan.bucket == bucket
        self.target.stage(plan)
        self._target_pages = [len(p) for p in plan.pages]
        self._stage_draft()
        self.runs += 1
        self._run_launches = self.launches
        logger.debug("device chain: run %d of %d requests starts", self.runs, len(reqs))
        self._launch()
        return True

    def launch(self) -> bool:
        """Launches the next step; False (nothing launched) when a pool is full."""
        if not self._reserve(len(self.unread)):
            return False
        self._launch()
        return True

    def _reserve(self, unread: int) -> bool:
        """KV capacity for the step to launch with ``unread`` steps not read yet: its verify
        writes up to L-1 + (unread+1)(S+1) - 1, its draft loop's scratch past that."""
        t_alloc, d_alloc = self.kv.allocator, self.drafter.kvs[0].allocator
        reach = (unread + 1) * self.width
        needs = []
        for req in self.reqs:
            rid = req.request_id
            t_need = req.num_tokens + reach - t_alloc.num_tokens(rid)
            d_need = req.num_tokens + reach - self.shift + self.scratch - d_alloc.num_tokens(rid)
            needs.append((rid, max(0, t_need), max(0, d_need)))
        t_pages = sum(t_alloc.pages_needed(rid, t) for rid, t, _ in needs)
        d_pages = sum(d_alloc.pages_needed(rid, d) for rid, _, d in needs)
        if t_pages > t_alloc.num_free_pages or d_pages > d_alloc.num_free_pages:
            return False
        for rid, t, d in needs:
            t_alloc.extend(rid, t)
            d_alloc.extend(rid, d)
        return True

    def _stage_draft(self) -> None:
        """The draft buckets' static inputs (query starts, chain masks, page tables); what
        depends on the verdict is written on the device at every launch."""
        graphs, bucket = self.graphs, self._bucket
        bs, w = bucket.batch_size, self.width
        ids = [r.request_id for r in self.reqs]
        alloc = self.drafter.kvs[0].allocator
        pages = [alloc.pages(rid) for rid in ids]
        extend = graphs.extends[bucket]
        staged = Staged(ints=dict(extend.empty.ints), pages=dict(extend.empty.pages))
        words = -(-w // WORD_BITS)
        chain = mask_words(range(-1, w - 1), words)
        staged.ints["mask0"] = chain * bs
        staged.ints["rows"] = list(range(bs * w))
        staged.pages["pages0"] = pages
        graphs.static.stage(extend, staged)
        self._chain_words = extend.modules[0].backend.graph_meta.tree_mask.clone()
        loop = graphs.loops[bucket]
        staged = Staged(ints=dict(loop.empty.ints), pages=dict(loop.empty.pages))
        for t, step in enumerate(self.schedule.steps):
            rows = mask_words(range(-1, step.prev + len(step.depths) - 1), self.schedule.num_words)
            staged.ints[f"mask{t}"] = rows[step.prev * self.schedule.num_words :] * bs
        staged.pages["pages0"] = pages
        graphs.static.stage(loop, staged)
        self._draft_pages = [len(p) for p in pages]

    def _sync_pages(self) -> None:
        """Writes pages reserved since the last launch into the graphs' page tables."""
        t_alloc, d_alloc = self.kv.allocator, self.drafter.kvs[0].allocator
        bucket = self._bucket
        t_table = self.target.buffers(bucket).backend.graph_meta.page_table
        extend, loop = self.graphs.extends[bucket], self.graphs.loops[bucket]
        d_tables = [extend.modules[0].backend.graph_meta.page_table]
        d_tables += [b.graph_meta.page_table for b in loop.backends[:1]]  # one pages0 view
        for i, req in enumerate(self.reqs):
            rid = req.request_id
            for alloc, tables, counts in (
                (t_alloc, [t_table], self._target_pages),
                (d_alloc, d_tables, self._draft_pages),
            ):
                pages = alloc.pages(rid)
                if len(pages) > counts[i]:
                    new = torch.tensor(pages[counts[i] :], dtype=torch.int32)
                    new = new.pin_memory() if self.on_cuda else new
                    for table in tables:
                        table[i, counts[i] : len(pages)].copy_(new, non_blocking=True)
                    counts[i] = len(pages)

    @torch.inference_mode()
    def _launch(self) -> None:
        """Queues one step: verify, verdict (and its copy out), draft extend, draft loop."""
        self._sync_pages()
        bucket, w, s = self._bucket, self.width, self.num_steps
        bs, j, alive = bucket.batch_size, self._j, self._alive
        # Verify: node i of request b at KV index and position base[b] + i.
        entry = self.target.buffers(bucket)
        meta = entry.backend.graph_meta
        index = self._base[:, None] + j
        entry.input_ids.copy_(self._tokens.view(-1))
        entry.positions.copy_(index.view(-1))
        keep = alive[:, None].expand(bs, w)
        page_size = self.kv.allocator.page_size
        meta.slot_mapping.copy_(_slots(meta.page_table, index, page_size, keep).view(-1))
        meta.seq_lens.copy_((self._base + w) * alive)
        meta.prefix_lens.copy_(self._base * alive)
        self.target.replay(bucket)
        # Verdict: the accepted prefix and the new tokens (greedy: the target's choices).
        logits = self.target.logits[: bs * w]
        ids, logprobs, _ = kernels.ops(self.device).top1(logits)
        choice = ids.view(bs, w)
        drafts = self._tokens[:, 1:]
        depth = torch.cumprod(self._valid.long(), 1).sum(1)
        if self.generator is not None:  # perf only: tandem.spec.simulate
            noise = torch.randn(bs, device=self.device, generator=self.generator)
            drawn = torch.floor(noise + self.mu + 0.5).long().clamp(0, s)
            accepted = torch.minimum(drawn, depth)
        else:
            match = (drafts == choice[:, :s]) & self._valid
            accepted = torch.cumprod(match.long(), 1).sum(1)
        shifted = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], 1)
        new = torch.where(j < accepted[:, None], shifted, choice)  # [bs, S+1]
        # A token's log-probability: its logit minus logsumexp = argmax logit - argmax logprob.
        rows = logits.view(bs, w, -1)
        top = rows.gather(2, choice[..., None])[..., 0]
        new_logprobs = rows.gather(2, new[..., None])[..., 0] - (top - logprobs.view(bs, w))
        parts = [accepted[:, None], depth[:, None], new, new_logprobs]
        verdict = torch.cat([part.double() for part in parts], 1)  # [bs, 2 + 2(S+1)]
        slot = self._next_slot
        self._next_slot = (slot + 1) % _RING
        self._verdicts[slot, :bs].copy_(verdict, non_blocking=self.on_cuda)
        copied = torch.cuda.Event() if self.on_cuda else None
        if copied is not None:
            copied.record()
        self.unread.append(_Launched(slot=slot, copied=copied))
        # Draft extend: pair k (k <= accepted) is new token k at position and KV index c + k.
        graphs = self.graphs
        extend = graphs.extends[bucket]
        buf = extend.modules[0]
        emeta = buf.backend.graph_meta
        first = self._base + 1 - self.shift
        position = first[:, None] + j
        pairs = (j <= accepted[:, None]) & alive[:, None]
        d_page_size = self.drafter.kvs[0].allocator.page_size
        buf.input_ids.copy_(new.view(-1))
        buf.positions.copy_(position.view(-1))
        emeta.slot_mapping.copy_(_slots(emeta.page_table, position, d_page_size, pairs).view(-1))
        emeta.seq_lens.copy_((first + accepted + 1) * alive)
        emeta.prefix_lens.copy_(first * alive)
        emeta.tree_mask.copy_(self._chain_words * pairs.view(-1, 1))
        buf.last_rows.copy_(torch.arange(bs, device=self.device) * w + accepted)
        if extend.features is not None:
            features = self.target.features
            assert features is not None, "target features are not captured"
            extend.features.copy_(features[: bs * w])
        graphs.replay("extend", extend)
        # Draft loop from the new base; its chain is the next step's tree.
        self._base = self._base + accepted + 1
        self._accepted = accepted
        loop = graphs.loops[bucket]
        loop.base.copy_(torch.where(alive, self._base, PAD_BASE))
        committed = self._base + 1 - self.shift
        for t, step in enumerate(self.schedule.steps):
            lmeta = loop.backends[t].graph_meta
            width = len(step.depths)
            scratch = committed[:, None] + step.prev + j[:width]
            mask = alive[:, None].expand(bs, width)
            lmeta.slot_mapping.copy_(_slots(lmeta.page_table, scratch, d_page_size, mask).view(-1))
            lmeta.seq_lens.copy_((committed + step.prev + width) * alive)
            lmeta.prefix_lens.copy_(committed * alive)
        graphs.last_in[0][:bs].copy_(graphs.last_out[0][:bs])
        graphs.replay("loop", loop)
        result = loop.result[:, :bs]
        bonus = new.gather(1, accepted[:, None])
        self._tokens = torch.cat([bonus, result[0].long()], 1)
        self._valid = result[2] != 0
        self.launches += 1

    # -- reading ------------------------------------------------------------------------------

    def read(self) -> list[ChainRead]:
        """Waits for the oldest unread step's verdict (not for anything launched after it)
        and commits its KV progress here and in the drafter; requests that finished since it
        was launched are skipped. The caller appends the tokens (``Scheduler.postprocess``)."""
        launched = self.unread.popleft()
        if launched.copied is not None:
            launched.copied.synchronize()
        w = self.width
        rows = self._verdicts[launched.slot, : len(self.reqs)].tolist()
        reads = []
        for req, row in zip(self.reqs, rows, strict=True):
            if req.finished:
                continue
            accepted = int(row[0])
            tokens = [int(t) for t in row[2 : 3 + accepted]]
            req.num_computed += accepted + 1
            self.drafter.seqs[req.request_id].tokens.extend(tokens)
            reads.append(
                ChainRead(
                    request=req,
                    new_tokens=tokens,
                    logprobs=row[2 + w : 3 + w + accepted],
                    drafted=int(row[1]),
                    accepted=accepted,
                )
            )
        return reads

    def end(self, reason: str) -> None:
        """Ends the run once every step is read: the host state of the last launched step
        (module docstring); finished requests leave the drafter."""
        assert not self.unread, "end: a step is still unread"
        logger.debug(
            "device chain: run %d ends after %d steps (%s)",
            self.runs,
            self.launches - self._run_launches,
            reason,
        )
        n, w = len(self.reqs), self.width
        tokens, valid = self._tokens[:n].tolist(), self._valid[:n].tolist()
        accepted = self._accepted[:n].tolist()
        last_out = self.graphs.last_out[0][:n].clone()
        features = self.graphs.extends[self._bucket].features
        d_alloc = self.drafter.kvs[0].allocator
        for i, req in enumerate(self.reqs):
            rid = req.request_id
            if req.finished:
                if req.in_draft:
                    self.drafter.release(rid)
                    req.in_draft = False
                continue
            self.kv.allocator.truncate(rid, req.num_computed)
            seq = self.drafter.seqs[rid]
            assert seq.tokens[-1] == tokens[i][0] == req.tokens[-1], "chain out of step"
            d_alloc.truncate(rid, len(seq.tokens) - self.shift)
            seq.last_out[0] = last_out[i]
            if features is not None:
                row = i * w + accepted[i]
                seq.features = features[row : row + 1].clone()
                seq.feature_start = len(seq.tokens) - 2
            depth = next((k for k in range(self.num_steps) if not valid[i][k]), self.num_steps)
            tree = Tree(tokens=tuple(tokens[i][: depth + 1]), parents=(-1, *range(depth)))
            req.tree = tree.prefix(max(1, self._limit(req) - req.num_computed))
        self.reqs = []


def _slots(
    table: torch.Tensor,  # [bs, max_pages] int32: each row's pages in logical order
    index: torch.Tensor,  # [bs, w] int64 logical KV indices
    page_size: int,
    keep: torch.Tensor,  # [bs, w] bool: rows whose KV is stored
) -> torch.Tensor:
    """Physical slots of ``index`` through the page table; -1 (store nothing) where not kept."""
    pages = index // page_size
    page = table.long().gather(1, pages.clamp(0, table.shape[1] - 1))
    return torch.where(keep, page * page_size + index % page_size, -1)
