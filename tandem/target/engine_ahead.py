"""The engine's decode-ahead steps (the rules are in ``tandem/target/ahead.py``): launch a plain
decode step from the last one's choices on the device, then read the last one.

``AheadSteps`` is a part of ``Engine`` (its base class) kept in its own file: it works on the
engine's state, declared below as the engine provides it.
"""

from __future__ import annotations

import time

from tandem.clock import StepTiming
from tandem.request import Request, RequestOutput
from tandem.spec.base import Drafter
from tandem.spec.types import SpecStats
from tandem.target import ahead
from tandem.target.exchange import DraftExchange
from tandem.target.policy import SpecPolicy
from tandem.target.runner import ModelRunner
from tandem.target.scheduler import ScheduledBatch, Scheduler
from tandem.transfer import device_ints

MAX_LANES = 2


class AheadSteps:
    """``Engine``'s steps that decode ahead, and the reads of a step in flight."""

    # The engine's state these steps use (tandem/target/engine.py sets it).
    drafter: Drafter | None
    runner: ModelRunner
    scheduler: Scheduler
    exchange: DraftExchange | None
    policy: SpecPolicy | None
    in_flight: ahead.InFlight | None
    ahead_steps: int
    last_lane: int
    last_speculated: bool
    last_stats: SpecStats
    last_timing: StepTiming
    _ahead_wait_ns: int

    def _take_released(self) -> list[str]:
        raise NotImplementedError

    def _policy_ns(self, started: int) -> int:
        raise NotImplementedError

    def _step_ahead(
        self, reqs: list[Request], policy_batch: int, started: int, *, ingesting: bool = False
    ) -> list[RequestOutput]:
        """Launches a plain decode step of ``reqs``, then reads the one in flight before it."""
        exchange, flight = self.exchange, self.in_flight
        if exchange is not None:
            exchange.skip(self.scheduler.running, MAX_LANES)  # answers drafted meanwhile: stale
        batch = ScheduledBatch(requests=reqs, num_new_tokens=[1] * len(reqs))
        layers = self.drafter.target_layer_ids if self.drafter is not None else ()
        if flight is None:
            inputs = self.runner.prepare(batch)  # the first step's tokens are on the host
        else:
            ids = flight.ids
            if len(reqs) < len(flight.batch):
                kept = set(reqs)
                index = [i for i, req in enumerate(flight.batch.requests) if req in kept]
                ids = ids[device_ints(index, ids.device)]
            inputs = self.runner.prepare_ahead(batch, ids)
        inputs.ahead = True
        forward_started = time.perf_counter_ns()
        outputs = self.runner.forward(inputs, layers)
        for req in reqs:
            req.num_computed += 1
        self.in_flight = ahead.launch(batch, inputs, outputs)
        self.ahead_steps += 1
        forward_ns = time.perf_counter_ns() - forward_started
        self.last_stats = SpecStats()  # what the read below commits, if any
        results = self._read_ahead(flight) if flight is not None else []
        self.last_speculated = False
        self.last_timing = StepTiming(
            total_ns=time.perf_counter_ns() - started,
            forward_ns=forward_ns + self._ahead_wait_ns,
        )
        # A launch that reads nothing (the first after a speculative step) is time in this
        # mode too: a switch to K=0 (a draft service taking in prompts, say) pays it.
        if self.policy is not None and policy_batch and (results or flight is None):
            committed = sum(len(out.new_token_ids) for out in results)
            held = self.exchange.held_tokens() if self.exchange is not None else 0
            self.policy.record(
                policy_batch, committed, self._policy_ns(started), ingesting=ingesting, held=held
            )
        return results

    def _drain_ahead(self, started: int) -> list[RequestOutput]:
        """Reads the step in flight and launches nothing."""
        flight, self.in_flight = self.in_flight, None
        assert flight is not None
        results = self._read_ahead(flight)
        self.last_timing = StepTiming(
            total_ns=time.perf_counter_ns() - started, forward_ns=self._ahead_wait_ns
        )
        return results

    def _read_ahead(self, flight: ahead.InFlight) -> list[RequestOutput]:
        """Commits a step in flight: its tokens, the statistics, and (K=0 with a draft) its
        outcomes for the exchange to hold."""
        waited = time.perf_counter_ns()
        verified = flight.read()
        self._ahead_wait_ns = time.perf_counter_ns() - waited
        live = [i for i, v in enumerate(verified) if v is not None]
        batch = ScheduledBatch(
            requests=[flight.batch.requests[i] for i in live], num_new_tokens=[1] * len(live)
        )
        self.last_stats = SpecStats()
        for req in batch.requests:
            for stats in (req.stats, self.last_stats):
                stats.record(0, 0)  # a decode step without a draft
        done = [verified[i] for i in live]
        results = self.scheduler.postprocess(
            batch,
            [v.new_tokens for v in done],  # type: ignore[union-attr]
            [v.logprobs for v in done],  # type: ignore[union-attr]
        )
        if self.exchange is not None:
            lane = self.exchange.free_lane(MAX_LANES)
            self.last_lane = lane if lane is not None else 0
            self.exchange.submit(
                self.last_lane,
                flight.batch,
                flight.inputs,
                flight.outputs,
                verified,
                self._take_released(),
                draft=False,
                send=lane is not None,
            )
        return results
