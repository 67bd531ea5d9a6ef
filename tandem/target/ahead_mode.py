"""The engine's decode-ahead steps (the rules are in ``tandem/target/ahead.py``): launch a
plain decode step from the last one's choices on the device, then read the last one."""

from __future__ import annotations

import time

from tandem.clock import StepTiming
from tandem.request import Request, RequestOutput
from tandem.spec.base import Drafter
from tandem.spec.types import NoTree, SpecStats
from tandem.target import ahead
from tandem.target.exchange import DraftExchange
from tandem.target.runner import ModelRunner
from tandem.target.scheduler import ScheduledBatch, Scheduler
from tandem.target.step import MAX_LANES, StepMode, StepPlan, StepResult
from tandem.transfer import device_ints


class AheadMode(StepMode):
    """Plain decode steps, each launched before the last one is read."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        runner: ModelRunner,
        drafter: Drafter | None,
        exchange: DraftExchange | None,
        overlap: bool,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        coin_block: int = 1,
    ) -> None:
        """``coin_block``: the coins a sampled request's ordinary step draws (``ahead``)."""
        self.scheduler = scheduler
        self.runner = runner
        self.drafter = drafter
        self.exchange = exchange
        self.overlap = overlap  # False: this mode only reads (it never launches)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.coin_block = coin_block
        self.in_flight: ahead.InFlight | None = None  # the step launched and not read yet
        self.launches = 0  # steps launched before the last one was read

    def run(self, plan: StepPlan) -> StepResult | None:
        """Launches a step of ``plan`` when every running request may decode ahead; else
        reads the step in flight (the ordinary step runs at the next call); None when there
        is none."""
        if not plan.speculate and self.overlap:
            reqs = ahead.next_requests(
                self.scheduler,
                self.in_flight,
                max_model_len=self.max_model_len,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
            )
            if reqs is not None:
                return self._launch(reqs, plan)
        if self.in_flight is None:
            return None
        flight, self.in_flight = self.in_flight, None
        outputs, stats, lane, wait_ns = self._read(flight, plan.last_lane)
        return StepResult(
            outputs=outputs, stats=stats, timing=StepTiming(forward_ns=wait_ns), lane=lane
        )

    def _launch(self, reqs: list[Request], plan: StepPlan) -> StepResult:
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
        launched = time.perf_counter_ns()
        outputs = self.runner.forward(inputs, layers)
        for req in reqs:
            req.num_computed += 1
        self.in_flight = ahead.launch(batch, inputs, outputs, self.coin_block)
        self.in_flight.plain = plan.plain or NoTree.POLICY
        self.launches += 1
        forward_ns = time.perf_counter_ns() - launched
        results: list[RequestOutput] = []
        stats, lane, wait_ns = SpecStats(), plan.last_lane, 0
        if flight is not None:
            results, stats, lane, wait_ns = self._read(flight, plan.last_lane)
        # A launch that reads nothing (the first after a speculative step) is time in this
        # mode too: a switch to K=0 (a draft service taking in prompts, say) pays it.
        return StepResult(
            outputs=results,
            stats=stats,
            timing=StepTiming(forward_ns=forward_ns + wait_ns),
            lane=lane,
            measured=bool(results) or flight is None,
        )

    def _read(
        self, flight: ahead.InFlight, lane: int
    ) -> tuple[list[RequestOutput], SpecStats, int, int]:
        """Commits a step in flight: its tokens, the statistics, and (K=0 with a draft) its
        outcomes for the exchange to hold. Returns those, the lane its submission went on
        (``lane`` when there is no draft) and the wait for the device."""
        waited = time.perf_counter_ns()
        verified = flight.read()
        wait_ns = time.perf_counter_ns() - waited
        live = [i for i, v in enumerate(verified) if v is not None]
        batch = ScheduledBatch(
            requests=[flight.batch.requests[i] for i in live], num_new_tokens=[1] * len(live)
        )
        stats = SpecStats()
        for req in batch.requests:
            for counts in (req.stats, stats):
                counts.record(0, 0, flight.plain)  # a decode step without a draft
        done = [verified[i] for i in live]
        results = self.scheduler.postprocess(
            batch,
            [v.new_tokens for v in done],  # type: ignore[union-attr]
            [v.logprobs for v in done],  # type: ignore[union-attr]
        )
        if self.exchange is not None:
            free = self.exchange.free_lane(MAX_LANES)
            lane = free if free is not None else 0
            self.exchange.submit(
                lane,
                flight.batch,
                flight.inputs,
                flight.outputs,
                verified,
                self.scheduler.take_released(),
                draft=False,
                send=free is not None,
            )
        return results, stats, lane, wait_ns
