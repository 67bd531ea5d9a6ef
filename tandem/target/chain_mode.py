"""Device-chain steps (``tandem/target/device_chain.py``): a run of greedy chain steps, each
launched before the last one is read.

A run starts from an ordinary speculating step once the draft owes no answer and holds nothing
back and the requests are in the steady state (``DeviceChain.can_start``). A run takes every
lane: where another lane has work, its trees (being drafted while this lane's step was
collected) are waited for first, if its requests could join (``_merge``); the run's steps
overlap draft and target on the device, which is what two lanes do through the host.

Each step then launches the next one and reads the oldest unread one; where the unread steps
may finish every request by length, it reads first and launches nothing
(``DeviceChain.may_all_finish``). A run that must end (K=0 chosen, a prompt waiting, requests
finished until a smaller bucket would do, a pool full, the draft's half missing) reads what it
launched and ends; the ordinary step runs at the next call.
"""

from __future__ import annotations

import logging
import time

from tandem.clock import StepTiming
from tandem.request import RequestOutput
from tandem.spec.types import NoTree, SpecStats
from tandem.target.device_chain import ChainRead, DeviceChain
from tandem.target.exchange import DraftExchange
from tandem.target.scheduler import ScheduledBatch, Scheduler
from tandem.target.step import StepMode, StepPlan, StepResult, merge_outputs

logger = logging.getLogger(__name__)


class ChainMode(StepMode):
    """The engine's device-chain runs."""

    def __init__(self, chain: DeviceChain, scheduler: Scheduler, exchange: DraftExchange) -> None:
        self.chain = chain
        self.scheduler = scheduler
        self.exchange = exchange
        self.lane = 0  # the lane of the current (or last) run

    def run(self, plan: StepPlan) -> StepResult | None:
        if not self.chain.active:
            return None
        if not plan.lanes:
            return self.drain("no request left to step")
        reason = self.chain.stop_reason(self.scheduler) if plan.speculate else "K=0 (policy)"
        return self.drain(reason) if reason else self._step()

    def start(self, plan: StepPlan) -> StepResult | None:
        """After an ordinary speculating step collected its lane's trees: starts a run with
        them (and every other lane's, ``_merge``) and steps it once; None when a run may not
        start now (the ordinary step goes on): the draft owes an answer or catches up after
        K=0, the requests are not in the steady state, or the pools cannot hold the run."""
        exchange, chain = self.exchange, self.chain
        if plan.lanes != {plan.lane} and not self._merge(plan):
            return None
        ready = (
            not exchange.awaiting and not exchange.catching_up and chain.can_start(self.scheduler)
        )
        if not ready:
            if logger.isEnabledFor(logging.DEBUG):  # the reasons cost a pass over the batch
                logger.debug("device chain: no run yet (%s)", self._why_not())
            return None
        if chain.needs_warming():  # not warmed while idle (in process: the first run)
            chain.warm()
            if not chain.draft.ready():
                return None
        reqs = list(self.scheduler.running)
        self.scheduler.pin([r.request_id for r in reqs])
        if not chain.start(reqs):
            self.scheduler.unpin(reqs)
            return None
        self.lane = plan.lane
        return self._step()

    def _why_not(self) -> str:
        """Why ``start`` starts no run now, in words (the debug log)."""
        if self.exchange.awaiting:
            return "the draft owes an answer"
        if self.exchange.catching_up:
            return "the draft catches up"
        return self.chain.start_problem(self.scheduler)

    def _merge(self, plan: StepPlan) -> bool:
        """With two lanes: whether every lane's requests may run as one run once the other
        lanes' trees, being drafted now, are in; if so, collects them (waiting for them) and
        the run takes every lane. A run's steps overlap draft and target on the device, which
        is what two lanes do on the host."""
        exchange = self.exchange
        others = [lane for lane in plan.lanes if lane != plan.lane]
        if exchange.catching_up:
            return False
        pending = frozenset(rid for lane in others for rid in exchange.awaiting.get(lane, {}))
        if not self.chain.can_start(self.scheduler, pending):
            return False
        for lane in others:
            exchange.collect(lane)
        return True

    def _step(self) -> StepResult:
        """Launches the run's next step, reads the oldest unread one and commits it; a run
        that cannot launch (a pool is full, the draft did not answer) or whose live requests
        would fit a smaller bucket ends here."""
        chain = self.chain
        problem = "" if chain.unread and chain.may_all_finish() else chain.launch()
        waited = time.perf_counter_ns()
        stats = SpecStats()
        outputs = self._commit(chain.read(), stats)
        wait_ns = time.perf_counter_ns() - waited
        reason = problem or chain.stop_reason(self.scheduler)
        if problem or (reason and not chain.unread):
            outputs = merge_outputs(outputs + self._end(reason, stats))
        # Otherwise a run that must end (requests finished, a prompt waits) still has the
        # step launched ahead to read: this step's tokens go out now, a finished request's
        # last ones among them, and the next call reads that step and ends the run (a drain)
        # rather than hold them back for a step's time.
        return StepResult(
            outputs=outputs,
            stats=stats,
            timing=StepTiming(forward_ns=wait_ns),
            lane=self.lane,
            speculated=True,
            measured=True,
        )

    def drain(self, reason: str) -> StepResult:
        """Reads every unread step of the run and ends it."""
        stats = SpecStats()
        outputs = merge_outputs(self._end(reason, stats))
        return StepResult(outputs=outputs, stats=stats, lane=self.lane, speculated=True)

    def end(self, reason: str) -> None:
        """Ends the run when no request is left to step (its last steps read, nothing to
        commit)."""
        self._end(reason, SpecStats())

    def _end(self, reason: str, stats: SpecStats) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while self.chain.unread:
            outputs += self._commit(self.chain.read(), stats)
        reqs = self.chain.reqs
        self.chain.end(reason)
        self.scheduler.unpin(reqs)  # finished requests' pages go now
        return outputs

    def _commit(self, reads: list[ChainRead], stats: SpecStats) -> list[RequestOutput]:
        """A read step's tokens and statistics (its KV progress is the chain's)."""
        for read in reads:
            missed = NoTree.LATE if read.request.speculate else NoTree.OPTED_OUT
            for counts in (read.request.stats, stats):
                counts.record(read.drafted, read.accepted, missed)
        batch = ScheduledBatch(
            requests=[r.request for r in reads], num_new_tokens=[len(r.new_tokens) for r in reads]
        )
        return self.scheduler.postprocess(
            batch, [r.new_tokens for r in reads], [r.logprobs for r in reads]
        )
