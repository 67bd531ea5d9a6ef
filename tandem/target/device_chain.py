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
node i already sits at L-1+i); the verdict (``top1`` per node, the accepted prefix, the
new tokens and their log-probabilities, or the simulated accept length) and its copy to pinned
memory; the draft's extend over the accepted pairs (rows past the accept length store nothing
and see nothing); the draft loop from the new base, whose chain is the next step's input. The
host launches step r+1 before it reads step r, so the GPU runs the steps back to back.

What the host knows a step late, and how it stays exact:

- KV pages, in both pools, are reserved for the worst case of every unread step (S+1 tokens
  each) before a launch, and new pages go into the graphs' page tables on the stream.
- A request that finishes (EOS, stop, length, abort) is known when its step is read. Its row
  goes on being computed, its output dropped, its KV pages kept (``Scheduler.pin``) and
  reserved as before, until the run ends: when the live rows would fit a smaller bucket (the
  next run starts there), or at any other end. Where the unread steps may bring every live
  request to its length limit, nothing is launched before they are read
  (``may_all_finish``): a run then ends without a wasted step.
- When the run ends, the host state an ordinary step reads is rebuilt from the last launched
  step: the target's KV length, the drafter's KV length, last output and kept feature, and each
  request's next tree (its tokens were appended as the steps were read).

The target's half of a launch is ``tandem/target/chain_verify.py``; the draft's is whatever
its drafter hands over (``tandem.spec.chain.DraftHalf``: ``tandem/draft/chain_draft.py`` in
process, ``tandem/link/chain_remote.py`` for a draft service on the same device). They hand off
through two buffers on the device (``Outcome``, ``Chains``). This module drives both halves and
keeps the run's host bookkeeping.

A run starts only in the steady state (``can_start``): every running request decoding with
plain parameters (``SamplingParams.plain``: greedy, or sampled with temperature and filters;
in any lane), each tracked by a drafter that takes the draft's half (``Drafter.chain_half``:
an in-process drafter with draft graphs and one module, or a draft service on this device)
and holding a chain tree (a request that opted out of speculation is a row of node 0 alone,
after the draft's rows: the draft never hears of it), no prompt waiting that could start
(one waiting for a free sequence slot waits for a finish anyway: ``can_take_waiting``), graph
buckets for the batch, context for three more steps (``max_new_tokens`` needs none: a request
that passes it finishes at the read, its extra tokens dropped). The engine ends it when any
of that changes (``tandem/target/chain_mode.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tandem.kv import KVCache
from tandem.request import Request
from tandem.spec.base import Drafter
from tandem.spec.simulate import AcceptSimulator
from tandem.spec.types import SpecConfig
from tandem.target.chain_verify import TargetChain
from tandem.target.graphs import TargetGraphRunner
from tandem.target.scheduler import Scheduler

logger = logging.getLogger(__name__)

_STEPS_AHEAD = 3  # steps of room a request needs to start or go on (two unread, one more)


@dataclass
class ChainRead:
    """One request's outcome of one step, as the host reads it."""

    request: Request
    new_tokens: list[int]  # accepted drafts + the bonus token
    logprobs: list[float]  # target log-probability of each
    drafted: int  # drafts in the verified chain
    accepted: int


def unsupported(
    drafter: Drafter | None, spec: SpecConfig | None, target: TargetGraphRunner | None
) -> str:
    """Why an engine cannot run device-chain steps ('' when it can)."""
    if spec is None or spec.topk != 1:
        return "needs chains (topk 1)"
    if target is None or spec.num_steps + 1 not in target.widths:
        return "needs CUDA graphs (a CUDA device, cuda_graphs on) with a bucket width of S+1"
    if drafter is None:
        return "needs a drafter"
    return drafter.chain_problem()


class DeviceChain:
    """A run of device-chain steps in one process: both halves, the requests, the reads."""

    def __init__(
        self,
        *,
        target: TargetGraphRunner,
        kv: KVCache,
        drafter: Drafter,
        spec: SpecConfig,
        simulator: AcceptSimulator | None,
        max_model_len: int,
    ) -> None:
        problem = unsupported(drafter, spec, target)
        if problem:
            raise ValueError(f"device chain: {problem}")
        self.target_graphs = target
        self.num_steps = spec.num_steps
        self.width = spec.num_steps + 1
        self.max_model_len = max_model_len
        self.target = TargetChain(target, kv, self.num_steps, simulator, spec.tree_size)
        self.draft = drafter.chain_half(spec.num_steps, target.device)
        self.lost = 0  # runs that ended without the draft's half of their last step
        self.reqs: list[Request] = []  # the run's requests, in row order ([] when idle)
        self.drafted = 0  # its first rows, the draft's; the rest opted out of speculation
        self.opted_out = 0  # rows of requests that opted out, over the runs started
        # Per row, its length as the device has it (L: node 0 is L - 1) after the last read
        # step: a live request's num_tokens; a finished request's row goes on growing.
        self.lengths: list[int] = []
        self.batch_size = 0  # the run's bucket
        self.runs = 0  # runs started
        self.warmed = 0  # buckets whose graphs ``warm`` captured, over its calls
        self._warm_epoch: int | None = None  # the draft's epoch the graphs were warmed for
        self.launches = 0  # steps launched
        self._run_launches = 0  # launches before the current run

    @property
    def active(self) -> bool:
        return bool(self.reqs)

    @property
    def unread(self) -> int:
        """Launched steps not read yet."""
        return len(self.target.unread)

    # -- when ---------------------------------------------------------------------------------

    def has_room(self, length: int) -> bool:
        """Context for the steps a run may have launched past the last read, and one more,
        from a row's ``length``. ``max_new_tokens`` needs no room: a step that passes it
        commits up to it (the rest is dropped when the tokens are appended) and the request
        finishes at that read."""
        return length + _STEPS_AHEAD * self.width <= self.max_model_len

    @property
    def live(self) -> int:
        """The run's rows whose request has not finished."""
        return sum(not req.finished for req in self.reqs)

    def _eligible(self, req: Request, pending: frozenset[str] = frozenset()) -> bool:
        """``pending``: requests whose trees are still being drafted (another lane's), taken
        as chains the draft will deliver. A request that opted out of speculation runs as a
        row whose chain is node 0 alone (plain decoding), which the draft does not see."""
        p, tree = req.params, req.tree
        if not req.speculate:
            return req.decoding and not req.parked and p.plain and self.has_room(req.num_tokens)
        has_chain = req.request_id in pending or (
            tree is not None and len(tree) <= self.width and tree.is_chain
        )
        return (
            req.decoding
            and req.in_draft
            and not req.parked
            and p.plain
            and has_chain
            and self.draft.eligible(req.request_id, req.num_tokens)
            and self.has_room(req.num_tokens)
        )

    def can_start(self, scheduler: Scheduler, pending: frozenset[str] = frozenset()) -> bool:
        """Whether the running requests are in the steady state a run needs (module
        docstring); the caller checks lanes and the exchange. ``pending``: as ``_eligible``
        (the caller collects those trees before the run starts)."""
        if self._blocked(scheduler):
            return False
        return all(self._eligible(req, pending) for req in scheduler.running)

    def start_problem(self, scheduler: Scheduler, pending: frozenset[str] = frozenset()) -> str:
        """Why a run may not start now ('' when it may): ``can_start``, in words (every
        request that is not in the steady state counted, by why)."""
        problem = self._blocked(scheduler)
        if problem:
            return problem
        late: dict[str, list[str]] = {}  # why -> requests
        for req in scheduler.running:
            if not self._eligible(req, pending):
                why = "no chain" if req.tree is None else "other"
                why = why if req.decoding else "prefilling"
                late.setdefault(why, []).append(req.request_id)
        return "; ".join(f"{why}: {len(ids)} ({ids[0]}, ...)" for why, ids in late.items())

    def _blocked(self, scheduler: Scheduler) -> str:
        """What stops a run whatever the requests' own state ('' when nothing does)."""
        running = scheduler.running
        if self.active:
            return "a run is active"
        if scheduler.can_take_waiting():
            return "a prompt is waiting"
        if not running:
            return "no request running"
        if not self.draft.ready():
            return "the draft's half is not ready"
        if self.target_graphs.bucket_for(len(running), self.width) is None:
            return f"no graph bucket for {len(running)} requests"
        if not any(req.speculate for req in running):
            return "no request speculates"
        return ""

    def may_all_finish(self) -> bool:
        """Whether the unread steps may bring every request of the run to its length limit
        (``max_new_tokens`` or the context: each step commits 1 to S+1 tokens). A step
        launched before they are read would then verify rows nobody reads, and the GPU would
        run it before whatever comes next (the next prompt's prefill): the engine reads first
        instead, and launches after the read if the run goes on. EOS and stop tokens cannot be
        foreseen; a request they finish still leaves one step launched ahead."""
        room = self.unread * self.width
        live = [req for req in self.reqs if not req.finished]
        return bool(live) and all(
            req.length_limit(self.max_model_len) - req.num_tokens <= room for req in live
        )

    def stop_reason(self, scheduler: Scheduler) -> str:
        """Why the run may not launch another step ('' when it may)."""
        if scheduler.can_take_waiting():  # one that cannot start yet waits for a finish anyway
            return "a prompt is waiting"
        if not self.live:
            return "every request finished"
        if self.live < len(self.reqs):
            # A finished request's row is computed on (its pages kept: Scheduler.pin) while
            # the live rows need the run's bucket; once a smaller bucket would take them,
            # the run ends (the next starts in that bucket).
            smaller = self.target_graphs.bucket_for(self.live, self.width)
            if smaller is None or smaller.batch_size < self.batch_size:
                return "requests finished"
        if not all(self.has_room(n) for n in self.lengths):
            return "a request is near the context length"
        return ""

    # -- warming ------------------------------------------------------------------------------

    def needs_warming(self) -> bool:
        """Whether ``warm`` has captures to do: graphs in use, no run active, the draft ready
        and its buffers not warmed over yet."""
        return (
            self.target_graphs.use_graphs
            and not self.active
            and self._warm_epoch != self.draft.epoch
            and self.draft.ready()
        )

    def warm(self) -> int:
        """Captures both halves' graphs of every bucket a run may take, largest first, by one
        step of a run of padding rows alone per bucket: nothing of a request is read or
        written (padding rows write the null page and the draft's scratch), and the step is
        not counted. A bucket's first run would capture them at its first launch, holding that
        step for a capture's time (docs/device-cycle.md), and the live rows of a batch that
        drains pass through several buckets. Returns the buckets warmed (one the draft
        refuses is skipped; a step the draft does not answer ends the warming)."""
        assert not self.active, "warm: a run is active"
        self._warm_epoch = self.draft.epoch
        features = self.target_graphs.features
        width = None if features is None else features.shape[1]
        counts = dict(self.target.steps), dict(self.draft.steps)
        warmed = 0
        for batch_size in sorted(self.target_graphs.batch_sizes, reverse=True):
            bucket = self.target_graphs.bucket_for(batch_size, self.width)
            assert bucket is not None
            self.draft.request_ids = []
            self.draft.reserve([], 0)
            self.draft.chains = self.target.chains_for(bucket)
            outcome = self.draft.begin([], bucket, features_width=width)
            if outcome is None:  # refused (a draft service without the bucket runs none)
                self.draft.chains = None
                continue
            self.target.begin([], bucket, 0)
            self.target.outcome = self.draft.outcome = outcome
            self.target.launch()
            launched = self.draft.launch()
            self.target.read(0)
            self.draft.end([])
            self.target.end()
            if not launched:
                break
            warmed += 1
        self.target.steps, self.draft.steps = counts
        self.warmed += warmed
        logger.info("device chain: %d buckets warmed", warmed)
        return warmed

    # -- launching and reading ----------------------------------------------------------------

    def start(self, reqs: list[Request]) -> bool:
        """Stages a run of ``reqs`` (their trees are the first step's) and launches its first
        step; False when the pools cannot hold the reservation (the run does not start)."""
        bucket = self.target_graphs.bucket_for(len(reqs), self.width)
        assert bucket is not None and bucket.width == self.width
        self.batch_size = bucket.batch_size
        # The draft's rows first; requests that opted out after them, padding rows to it.
        self.reqs = [r for r in reqs if r.speculate] + [r for r in reqs if not r.speculate]
        self.drafted = sum(r.speculate for r in reqs)
        self.lengths = [r.num_tokens for r in self.reqs]
        self.draft.request_ids = [r.request_id for r in self.reqs[: self.drafted]]
        if not self._reserve():
            self.reqs, self.lengths = [], []
            return False
        # The draft first: a draft service answers once its stream has finished what it had
        # queued (a late half of an abandoned run writes these chains), and only then are
        # the first step's chains written.
        self.draft.chains = self.target.chains_for(bucket)
        features = self.target_graphs.features
        width = None if features is None else features.shape[1]
        outcome = self.draft.begin(self.draft.request_ids, bucket, features_width=width)
        if outcome is None:  # a draft service refused: the ordinary cycle goes on
            for req in self.reqs:
                self.target.alloc.truncate(req.request_id, req.num_computed)
            self.draft.chains = None
            self.reqs, self.lengths = [], []
            return False
        self.target.begin(self.reqs, bucket, self.drafted)
        self.target.outcome = self.draft.outcome = outcome
        self.runs += 1
        self.opted_out += len(self.reqs) - self.drafted
        self._run_launches = self.launches
        log = logger.info if self.runs == 1 else logger.debug  # the first, then DEBUG
        log("device chain: run %d of %d requests starts", self.runs, len(self.reqs))
        self._launch()
        return True

    def launch(self) -> str:
        """Launches the next step; why the run must end ('' when it may go on): a pool is
        full (nothing launched), or the draft did not queue its half of this step or of the
        last one (whose chains the next verify would read: nothing is launched then)."""
        if self.draft.failed:
            return f"the draft: {self.draft.failed}"
        if not self._reserve():
            return "a KV pool is full"
        return self._launch()

    def _reserve(self) -> bool:
        unread, lengths = self.unread, self.lengths
        rows = [(r.request_id, n) for r, n in zip(self.reqs, lengths, strict=True)]
        drafted = lengths[: self.drafted]
        return self.target.reserve(rows, unread) and self.draft.reserve(drafted, unread)

    def _launch(self) -> str:
        self.target.launch()
        self.launches += 1
        if self.draft.launch():
            return ""
        self.lost += 1
        return f"the draft: {self.draft.failed}"

    def read(self) -> list[ChainRead]:
        """Waits for the oldest unread step's verdict and commits its KV progress here and
        in the drafter; requests that finished since it was launched are skipped. The caller
        appends the tokens (``Scheduler.postprocess``)."""
        reads = []
        verdicts = self.target.read(len(self.reqs))
        for row, (req, v) in enumerate(zip(self.reqs, verdicts, strict=True)):
            self.lengths[row] += v.accepted + 1
            if req.finished:
                continue
            req.num_computed += v.accepted + 1
            if row < self.drafted:
                self.draft.commit(req.request_id, v.new_tokens)
            reads.append(ChainRead(req, v.new_tokens, v.logprobs, v.drafted, v.accepted))
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
        lost = bool(self.draft.failed)
        trees = self.target.next_trees(len(self.reqs))
        finished = [req.finished for req in self.reqs]
        # An aborted request may be released twice: that is a no-op.
        self.draft.end(finished[: self.drafted])
        for row, (req, tree, done) in enumerate(zip(self.reqs, trees, finished, strict=True)):
            if done:
                req.in_draft = False
                continue
            self.target.alloc.truncate(req.request_id, req.num_computed)
            if row >= self.drafted:  # opted out: no tree, as before the run
                continue
            if lost:  # the draft released it: it decodes without trees until taken in again
                req.in_draft = False
                req.tree = None
                continue
            assert tree.tokens[0] == req.tokens[-1], "chain out of step"
            room = req.length_limit(self.max_model_len) - req.num_computed
            req.tree = tree.prefix(max(1, room))
        self.target.end()
        self.reqs, self.lengths = [], []
