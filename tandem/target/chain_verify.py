"""The target's half of a device-chain step (``tandem/target/device_chain.py``).

One target launch: the verify bucket over ``Chains`` (node i of row b at KV index and position
``base[b] + i``: a chain needs no KV move), its ids, positions, slots and lengths written on the
device; the greedy verdict (``top1`` at every node, the accepted prefix, the new tokens and
their log-probabilities; with a simulator, the accept length it draws for each row's prompt
and position, ``tandem.spec.simulate``); the verdict's copy into
pinned memory for the host; ``Outcome`` for the draft (the old base, the accept lengths, the
new tokens, every node's target features); ``base`` advanced. The host reads a step's verdict
after launching the next one.

With the target's graphs captured, all of that but the page tables' growth and the verdict's
copy out is one CUDA graph per bucket (captured at the bucket's first
launch, over the bucket's own state buffers and the ``Outcome`` bound then; ``DeviceChain.warm``
launches every bucket once before a run needs it): one launch a step instead of about fifty
small kernels and a replay.

Sampled rows (``tandem/target/chain_sampling.py``) take the target's processed distribution
and their own generator's coins and noise, drawn before the launch; a run with any sampled row
replays the graph of its filters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

import kernels
from tandem.graphs.base import Bucket, capture_graph
from tandem.kv import KVCache
from tandem.request import Request
from tandem.sampling import SamplingBatch, process_logits
from tandem.spec.chain import Chains, Outcome, grow_tables, share_on_cpu
from tandem.spec.simulate import AcceptSimulator, unit_tensor
from tandem.spec.types import Tree, valid_depth
from tandem.spec.verify import draw_randomness
from tandem.target.chain_sampling import ChainSampling, Filters, sampled_verdict
from tandem.target.graphs import TargetGraphRunner

_RING = 3  # verdict slots in pinned memory: at most two steps are unread at once


@dataclass
class Verdict:
    """One row of a read step."""

    accepted: int
    drafted: int  # drafts in the verified chain
    new_tokens: list[int]  # accepted drafts + the bonus token
    logprobs: list[float]  # target log-probability of each


@dataclass
class _Static:
    """A bucket's state buffers: what its captured step reads and writes, kept across runs."""

    base: torch.Tensor  # [bs] int64: KV index of each row's node 0
    alive: torch.Tensor  # [bs] bool
    drafted: torch.Tensor  # [bs] bool: rows the draft drafts for (the others opted out)
    keys: torch.Tensor  # [bs] int64: each row's simulator key (tandem.spec.simulate)
    verdict: torch.Tensor  # [bs, 2 + 2(S+1)] float64: accepted, drafted, tokens, logprobs
    chains: Chains
    # Per filters (None: every row greedy), the captured step and the data_ptr of the Outcome
    # it writes.
    graphs: dict[Filters | None, tuple[torch.cuda.CUDAGraph, int]] = field(default_factory=dict)
    sampled: torch.Tensor | None = None  # [bs] bool: rows that sample (allocated at first use)
    coins: torch.Tensor | None = None  # [bs, coin_block] float32
    race: torch.Tensor | None = None  # [bs, V] float32: the bonus race's Exp(1) noise


@dataclass
class _Launched:
    slot: int  # its verdict's row of the pinned ring
    copied: torch.cuda.Event | None  # recorded after the verdict's copy (None off CUDA)


class TargetChain:
    """The target's share of a run: its pool, its verify bucket's inputs, the verdicts."""

    def __init__(
        self,
        target: TargetGraphRunner,
        kv: KVCache,
        num_steps: int,
        simulator: AcceptSimulator | None,
        coin_block: int | None = None,
    ) -> None:
        """``coin_block``: the coins a sampled row draws per step (the engine's tree size, as
        its ordinary step draws them; S+1 when not given)."""
        self.target = target
        self.alloc = kv.allocator
        self.num_steps = num_steps
        self.width = num_steps + 1
        self.device = target.device
        self.on_cuda = self.device.type == "cuda"
        self.simulator = simulator  # perf only: tandem.spec.simulate
        self._thresholds = torch.tensor(
            simulator.thresholds if simulator is not None else [], dtype=torch.float64
        ).to(self.device)
        max_bs = max(target.batch_sizes)
        self._verdicts = torch.zeros(
            _RING, max_bs, 2 + 2 * self.width, dtype=torch.float64, pin_memory=self.on_cuda
        )
        self._next_slot = 0
        self._j = torch.arange(self.width, device=self.device)
        self.unread: deque[_Launched] = deque()
        self.request_ids: list[str] = []
        self._bucket = Bucket(1, self.width)
        self._pages: list[int] = []
        self._statics: dict[Bucket, _Static] = {}
        self._graph_pool: Any = None  # every graph's, once one is captured (``_pool``)
        self.steps: dict[Bucket, int] = {}  # steps launched per bucket
        self.sampled_steps = 0  # steps launched with a sampled row
        self.captures = 0  # graphs captured (a bucket's, per filters and Outcome bound)
        self.chains: Chains | None = None
        self.outcome: Outcome | None = None
        self.sampling = ChainSampling(self.device, coin_block or self.width)
        # The current run's sampled rows: their filters and parameters, and per row its
        # generator (None: greedy); None when every row is greedy.
        self._filters: tuple[Filters, SamplingBatch] | None = None
        self._generators: list[torch.Generator | None] = []

    def reserve(self, rows: Sequence[tuple[str, int]], unread: int) -> bool:
        """KV capacity for a launch with ``unread`` steps unread, per row (request id, length
        L as last read): its verify writes up to ``L - 1 + (unread+1)(S+1) - 1``. False
        (nothing changed) when the pool cannot."""
        reach = (unread + 1) * self.width
        return self.alloc.extend_all(
            [(rid, max(0, n + reach - self.alloc.num_tokens(rid))) for rid, n in rows]
        )

    def chains_for(self, bucket: Bucket) -> Chains:
        """The ``Chains`` buffers of ``bucket`` (the draft half writes them), nothing written."""
        return self._static(bucket).chains

    def begin(self, reqs: Sequence[Request], bucket: Bucket, drafted: int | None = None) -> Chains:
        """Stages the verify bucket for a run of ``reqs`` (reserved already) with their trees
        as the first step's chains, and returns the ``Chains`` buffers the draft half writes.
        ``drafted``: the first rows the draft drafts for (all when not given); the others
        opted out of speculation: each verifies node 0 alone, whatever the draft writes."""
        drafted = len(reqs) if drafted is None else drafted
        self.request_ids = [r.request_id for r in reqs]
        self._bucket = bucket
        bs, n, w = bucket.batch_size, len(reqs), self.width
        tokens, valid, chains = [], [], []
        for row, req in enumerate(reqs):
            if row < drafted:
                assert req.tree is not None
                node0, drafts = req.tree.tokens[0], list(req.tree.tokens[1:])
            else:
                node0, drafts = req.tokens[-1], []
            tokens.append([node0, *drafts, *[0] * (w - 1 - len(drafts))])
            valid.append([k < len(drafts) for k in range(self.num_steps)])
            chains.append(Tree.chain(tokens[-1]))
        missing = bs - n
        static = self._static(bucket)
        static.alive.copy_(torch.tensor([True] * n + [False] * missing))
        static.drafted.copy_(torch.tensor([True] * drafted + [False] * (bs - drafted)))
        static.base.copy_(torch.tensor([r.num_computed for r in reqs] + [0] * missing))
        if self.simulator is not None:
            keys = [self.simulator.key(r) for r in reqs]
            static.keys.copy_(torch.tensor(keys + [0] * missing, dtype=torch.int64))
        static.chains.tokens.copy_(torch.tensor(tokens + [[0] * w] * missing))
        static.chains.valid.copy_(torch.tensor(valid + [[False] * self.num_steps] * missing))
        self.chains = static.chains
        self._filters = self.sampling.stage(reqs, bs, w)
        self._generators = [r.generator for r in reqs]  # None for greedy requests
        if self._filters is not None:
            unseeded = [r.request_id for r in reqs if not r.params.greedy and not r.generator]
            assert not unseeded, f"sampled without a random stream: {unseeded}"
            sampled = [not r.params.greedy for r in reqs] + [False] * missing
            self._sampling_buffers(static).copy_(torch.tensor(sampled))
        # Everything staged once (query starts, chain masks, rows, the page tables as now);
        # a run of no request (``DeviceChain.warm``) stages padding rows alone.
        if reqs:
            plan = self.target.plan(self.request_ids, [r.num_computed for r in reqs], chains)
        else:
            plan = self.target.empty(bucket)
        assert plan is not None and plan.bucket == bucket
        self.target.stage(plan)
        self._pages = [len(p) for p in plan.pages]
        return self.chains

    def _static(self, bucket: Bucket) -> _Static:
        static = self._statics.get(bucket)
        if static is None:
            bs, w, dev = bucket.batch_size, self.width, self.device
            static = _Static(
                base=torch.zeros(bs, dtype=torch.int64, device=dev),
                alive=torch.zeros(bs, dtype=torch.bool, device=dev),
                drafted=torch.zeros(bs, dtype=torch.bool, device=dev),
                keys=torch.zeros(bs, dtype=torch.int64, device=dev),
                verdict=torch.zeros(bs, 2 + 2 * w, dtype=torch.float64, device=dev),
                chains=Chains(
                    tokens=torch.zeros(bs, w, dtype=torch.int64, device=dev),
                    valid=torch.zeros(bs, self.num_steps, dtype=torch.bool, device=dev),
                ),
            )
            share_on_cpu(static.chains.tokens, static.chains.valid)
            self._statics[bucket] = static
        return static

    def _pool(self) -> Any:
        """One memory pool for every graph of this half: they replay one at a time on one
        stream and keep nothing in it past a replay (what they hand on is in ``_Static`` and
        ``Outcome``), so each may reuse the others' temporaries (``DeviceChain.warm``
        captures them largest first)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def _sampling_buffers(self, static: _Static) -> torch.Tensor:
        """The bucket's sampled-row mask, allocated with its coins and noise at first use."""
        if static.sampled is None:
            bs, vocab = static.base.shape[0], self.target.logits.shape[-1]
            static.sampled = torch.zeros(bs, dtype=torch.bool, device=self.device)
            static.coins = torch.zeros(bs, self.sampling.coin_block, device=self.device)
            static.race = torch.ones(bs, vocab, device=self.device)
        return static.sampled

    @torch.inference_mode()
    def launch(self) -> None:
        """Queues the verify over ``chains``, the verdict and its copy out, and ``outcome``."""
        assert self.chains is not None and self.outcome is not None
        bucket = self._bucket
        static = self._statics[bucket]
        table = self.target.buffers(bucket).backend.graph_meta.page_table
        for i, rid in enumerate(self.request_ids):
            self._pages[i] = grow_tables([table], i, self.alloc.pages(rid), self._pages[i])
        if self._filters is not None:
            assert static.coins is not None and static.race is not None
            draw_randomness(self._generators, static.coins, static.race)
            self.sampled_steps += 1
        if self.target.use_graphs:
            key = None if self._filters is None else self._filters[0]
            graph, bound = static.graphs.get(key, (None, 0))
            if graph is None or bound != self.outcome.base.data_ptr():
                base = static.base.clone()  # capture runs the step once: it must not count
                graph = capture_graph(self.device, self._pool(), partial(self._step, static))
                static.base.copy_(base)
                static.graphs[key] = (graph, self.outcome.base.data_ptr())
                self.captures += 1
            graph.replay()
        else:
            self._step(static)
        slot = self._next_slot
        self._next_slot = (slot + 1) % _RING
        self._verdicts[slot, : bucket.batch_size].copy_(static.verdict, non_blocking=self.on_cuda)
        copied = torch.cuda.Event() if self.on_cuda else None
        if copied is not None:
            copied.record()
        self.unread.append(_Launched(slot=slot, copied=copied))
        self.steps[bucket] = self.steps.get(bucket, 0) + 1

    def _step(self, static: _Static) -> None:
        """The captured region: verify inputs, the verify forward, the verdict, the outcome.
        Reads and writes only the bucket's buffers, its ``_Static`` and the ``Outcome``."""
        assert self.outcome is not None
        bucket, w, s = self._bucket, self.width, self.num_steps
        bs, j, alive, base = bucket.batch_size, self._j, static.alive, static.base
        entry = self.target.buffers(bucket)
        meta = entry.backend.graph_meta
        entry.input_ids.copy_(static.chains.tokens.view(-1))
        ops = kernels.ops(self.device)
        ops.paged_inputs(  # node i of a chain at base + i: no KV moves
            base, None, alive, meta.page_table, meta.slot_mapping, meta.seq_lens,
            meta.masked()[0], entry.positions, page_size=self.alloc.page_size,
        )  # fmt: skip
        self.target.forward_static(bucket)
        logits = self.target.logits[: bs * w]
        if self._filters is not None:  # greedy rows: their logits in float32, unchanged
            logits = process_logits(logits, self._filters[1], None)
        ids, logprobs, _ = ops.top1(logits)
        choice = ids.view(bs, w)
        drafts = static.chains.tokens[:, 1:]
        valid = static.chains.valid & static.drafted[:, None]
        depth = torch.cumprod(valid.long(), 1).sum(1)
        if self.simulator is not None:  # the host's draw (AcceptSimulator.draw), on the device
            u = unit_tensor(static.keys, base)
            drawn = (u[:, None] < self._thresholds[None, :]).sum(1)
            accepted = torch.minimum(drawn, depth)
        else:  # greedy: a draft is accepted while it is the target's choice at its parent
            accepted = torch.cumprod(((drafts == choice[:, :s]) & valid).long(), 1).sum(1)
        # Sampled rows' own verdict and bonus tokens (a greedy row's bonus is the choice).
        sampled = static.sampled if self._filters is not None and self.simulator is None else None
        if sampled is not None:
            assert static.coins is not None and static.race is not None
            drawn_accepted, bonus = sampled_verdict(
                logits, drafts, valid, static.coins, static.race
            )
            accepted = torch.where(sampled, drawn_accepted, accepted)
        shifted = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], 1)
        new = torch.where(j < accepted[:, None], shifted, choice)  # [bs, S+1]
        if sampled is not None:
            is_bonus = sampled[:, None] & (j == accepted[:, None])
            new = torch.where(is_bonus, bonus[:, None], new)
        # A token's log-probability: its logit minus logsumexp = argmax logit - argmax logprob.
        rows = logits.view(bs, w, -1)
        top = rows.gather(2, choice[..., None])[..., 0]
        new_logprobs = rows.gather(2, new[..., None])[..., 0] - (top - logprobs.view(bs, w))
        parts = [accepted[:, None], depth[:, None], new, new_logprobs]
        static.verdict.copy_(torch.cat([part.double() for part in parts], 1))
        out = self.outcome
        out.base.copy_(base)
        out.accepted.copy_(accepted)
        out.new.copy_(new)
        out.alive.copy_(alive & static.drafted)  # the draft stores nothing of the others
        if out.features is not None:
            features = self.target.features
            assert features is not None, "target features are not captured"
            out.features.copy_(features[: bs * w])
        base.add_(accepted + 1)

    def read(self, count: int) -> list[Verdict]:
        """Waits for the oldest unread step's verdict (not for anything launched after it);
        its first ``count`` rows."""
        launched = self.unread.popleft()
        if launched.copied is not None:
            launched.copied.synchronize()
        w = self.width
        verdicts = []
        for row in self._verdicts[launched.slot, :count].tolist():
            accepted = int(row[0])
            verdicts.append(
                Verdict(
                    accepted=accepted,
                    drafted=int(row[1]),
                    new_tokens=[int(t) for t in row[2 : 3 + accepted]],
                    logprobs=row[2 + w : 3 + w + accepted],
                )
            )
        return verdicts

    def next_trees(self, count: int) -> list[Tree]:
        """The chains the last launched step drafted, as trees (first ``count`` rows)."""
        assert self.chains is not None
        tokens = self.chains.tokens[:count].tolist()
        valid = self.chains.valid[:count].tolist()
        return [
            Tree.chain(row[: valid_depth(ok) + 1]) for row, ok in zip(tokens, valid, strict=True)
        ]

    def end(self) -> None:
        self.request_ids = []
        self.chains = self.outcome = None
        self._filters, self._generators = None, []
