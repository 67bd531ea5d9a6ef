"""The engine's device-chain steps (the rules are in ``tandem/target/device_chain.py``): a run
of speculative chain steps, each launched before the last one is read.

``ChainSteps`` is a part of ``Engine`` (its base class, beside ``AheadSteps``) kept in its own
file: it works on the engine's state, declared below as the engine provides it.
"""

from __future__ import annotations

import time

from tandem.clock import StepTiming
from tandem.kv import KVCache
from tandem.request import RequestOutput
from tandem.spec.base import Drafter
from tandem.spec.simulate import AcceptSimulator
from tandem.spec.types import SpecConfig, SpecStats
from tandem.target import ahead
from tandem.target.device_chain import ChainRead, DeviceChain, unsupported
from tandem.target.exchange import DraftExchange
from tandem.target.policy import SpecPolicy
from tandem.target.runner import ModelRunner
from tandem.target.scheduler import ScheduledBatch, Scheduler


class ChainSteps:
    """``Engine``'s steps through a ``DeviceChain``."""

    # The engine's state these steps use (tandem/target/engine.py sets it).
    chain: DeviceChain | None
    drafter: Drafter | None
    spec: SpecConfig | None
    runner: ModelRunner
    kv: KVCache
    simulator: AcceptSimulator | None
    max_model_len: int
    exchange: DraftExchange | None
    in_flight: ahead.InFlight | None
    scheduler: Scheduler
    policy: SpecPolicy | None
    last_speculated: bool
    last_stats: SpecStats
    last_timing: StepTiming

    def _policy_ns(self, started: int) -> int:
        raise NotImplementedError

    def enable_device_chain(self) -> DeviceChain:
        """Runs steady greedy chain speculation as device-chain steps
        (``tandem/target/device_chain.py``); ValueError says why this engine cannot."""
        problem = unsupported(self.drafter, self.spec, self.runner.graphs)
        if problem or self.drafter is None or self.spec is None:
            raise ValueError(f"device_chain: {problem}")
        assert self.runner.graphs is not None
        self.chain = DeviceChain(
            target=self.runner.graphs,
            kv=self.kv,
            drafter=self.drafter,
            spec=self.spec,
            simulator=self.simulator,
            max_model_len=self.max_model_len,
        )
        return self.chain

    def _chain_ready(self, lanes: set[int], lane: int) -> bool:
        """Whether a device-chain run may start now: one lane, the draft holding nothing back
        and owing no answer, no decode step in flight, the requests in the steady state."""
        exchange, chain = self.exchange, self.chain
        return (
            chain is not None
            and exchange is not None
            and lanes == {lane}
            and self.in_flight is None
            and not exchange.awaiting
            and not exchange.catching_up
            and chain.can_start(self.scheduler)
        )

    def _chain_step(self, policy_batch: int, started: int) -> list[RequestOutput]:
        """Launches the run's next step, reads the oldest unread one and commits it; a run
        that cannot launch (a pool is full, the draft did not answer) or whose request
        finished ends here. Where the unread steps may finish every request by length, the
        read comes first and nothing is launched ahead (``DeviceChain.may_all_finish``)."""
        chain = self.chain
        assert chain is not None and chain.active
        problem = "" if chain.unread and chain.may_all_finish() else chain.launch()
        waited = time.perf_counter_ns()
        self.last_stats = SpecStats()
        outputs = self._commit_chain(chain.read())
        wait_ns = time.perf_counter_ns() - waited
        self.last_speculated = True
        reason = problem or chain.stop_reason(self.scheduler)
        if problem or (reason and not chain.unread):
            outputs = _merge(outputs + self._end_chain(reason))
        # Otherwise a run that must end (a request finished, a prompt waits) still has the
        # step launched ahead to read: this step's tokens go out now, a finished request's
        # last ones among them, and the next call reads that step and ends the run
        # (``_drain_chain``) rather than hold them back for a step's time.
        self.last_timing = StepTiming(total_ns=time.perf_counter_ns() - started, forward_ns=wait_ns)
        if self.policy is not None:
            committed = sum(len(out.new_token_ids) for out in outputs)
            self.policy.record(policy_batch, committed, self._policy_ns(started))
        return outputs

    def _start_chain(self, policy_batch: int, started: int) -> list[RequestOutput] | None:
        """Starts a run with the running requests' trees (None when the pools cannot hold
        it: the ordinary step goes on) and steps it once."""
        chain = self.chain
        assert chain is not None
        if not chain.start(list(self.scheduler.running)):
            return None
        return self._chain_step(policy_batch, started)

    def _drain_chain(self, started: int, reason: str) -> list[RequestOutput]:
        """Reads every unread step of the run and ends it; the ordinary step runs at the next
        call."""
        self.last_stats = SpecStats()
        outputs = _merge(self._end_chain(reason))
        self.last_timing = StepTiming(total_ns=time.perf_counter_ns() - started)
        return outputs

    def _end_chain(self, reason: str) -> list[RequestOutput]:
        chain = self.chain
        assert chain is not None
        outputs: list[RequestOutput] = []
        while chain.unread:
            outputs += self._commit_chain(chain.read())
        chain.end(reason)
        return outputs

    def _commit_chain(self, reads: list[ChainRead]) -> list[RequestOutput]:
        """A read step's tokens and statistics (its KV progress is the chain's)."""
        for read in reads:
            for stats in (read.request.stats, self.last_stats):
                stats.record(read.drafted, read.accepted)
        batch = ScheduledBatch(
            requests=[r.request for r in reads], num_new_tokens=[len(r.new_tokens) for r in reads]
        )
        return self.scheduler.postprocess(
            batch, [r.new_tokens for r in reads], [r.logprobs for r in reads]
        )


def _merge(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request: the tokens of several read steps, in order."""
    merged: dict[str, RequestOutput] = {}
    for out in outputs:
        seen = merged.get(out.request_id)
        if seen is not None:
            out = RequestOutput(
                request_id=out.request_id,
                new_token_ids=seen.new_token_ids + out.new_token_ids,
                new_logprobs=seen.new_logprobs + out.new_logprobs,
                finished=out.finished,
                finish_reason=out.finish_reason,
            )
        merged[out.request_id] = out
    return list(merged.values())
