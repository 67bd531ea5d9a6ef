"""The ordinary step: collect the lane's trees, schedule, forward, verify, commit, hand the
outcome to the draft. Every other mode falls back to it; it takes every plan.

With a drafter, a speculating step runs one lane (the draft drafts the other meanwhile) and
may start a device-chain run instead (``ChainMode.start``) once its trees are in. A K=0 step
(the adaptive policy) steps every lane at once without
waiting on the draft: the answers drafted meanwhile are stale by then.
"""

from __future__ import annotations

from tandem.clock import StepTiming, StreamClock
from tandem.kv import KVCache
from tandem.spec.base import Drafter
from tandem.spec.simulate import AcceptSimulator
from tandem.spec.types import SpecStats
from tandem.spec.verify import commit, verify_rows
from tandem.target.chain_mode import ChainMode
from tandem.target.exchange import DraftExchange
from tandem.target.runner import ModelRunner
from tandem.target.scheduler import Scheduler
from tandem.target.step import MAX_LANES, StepMode, StepPlan, StepResult


class SyncMode(StepMode):
    """Steps whose outcome the host reads before anything else is launched."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        runner: ModelRunner,
        kv: KVCache,
        drafter: Drafter | None,
        exchange: DraftExchange | None,
        chain: ChainMode | None,
        coin_block: int,
        simulator: AcceptSimulator | None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv = kv
        self.drafter = drafter
        self.exchange = exchange
        self.chain = chain
        self.coin_block = coin_block  # coins per verify step: a fixed block (spec/verify.py)
        self.simulator = simulator
        self.clock = StreamClock(runner.device)  # the step's forward
        self.overlapped = 0  # steps whose forward ran while another lane was drafted

    def run(self, plan: StepPlan) -> StepResult:
        if not plan.lanes:
            return StepResult(outputs=[], lane=plan.last_lane)
        exchange, lane = self.exchange, plan.lane
        if exchange is not None:
            exchange.readmit(self.scheduler)
        step_lane: int | None = lane
        can_send = True
        # Trees are missing while the draft catches up after K=0: the policy skips such steps.
        catching_up = exchange is not None and plan.speculate and exchange.catching_up
        if exchange is not None and plan.speculate:
            exchange.collect_idle(set(plan.lanes))
            exchange.collect_moved(lane)
            exchange.collect(lane)
            exchange.settle_intake(block=not self.scheduler.has_ready(lane))
            started = self.chain.start(plan) if self.chain is not None else None
            if started is not None:
                return started
        elif exchange is not None:
            # K=0: every lane steps at once (lanes pay only while a draft drafts beside the
            # target), never waiting on the draft; a merged step reports its sending lane.
            send_lane = exchange.skip(self.scheduler.running, MAX_LANES)
            step_lane = None
            lane = send_lane if send_lane is not None else 0
            can_send = send_lane is not None
        batch = self.scheduler.schedule(step_lane, unparked=plan.speculate)
        if not batch:
            return StepResult(outputs=[], lane=lane, speculated=plan.speculate)
        decoding = [req.decoding for req in batch.requests]
        inputs = self.runner.prepare(batch)
        # Read every step: a remote draft announces its layers when it (re)connects.
        layers = self.drafter.target_layer_ids if self.drafter is not None else ()
        if exchange is not None and exchange.other_lane_in_flight(lane):
            self.overlapped += 1
        self.clock.start()
        outputs = self.runner.forward(inputs, layers)
        self.clock.stop()
        verified = verify_rows(  # reads the outcome: the forward is done
            outputs.logits, inputs.trees, batch.requests, self.coin_block, self.simulator
        )
        forward_ns = self.clock.elapsed_ns()
        stats = SpecStats()
        commit(self.kv, batch.requests, batch.num_new_tokens, decoding, verified, stats, plan.plain)
        results = self.scheduler.postprocess(
            batch,
            [v.new_tokens if v else [] for v in verified],
            [v.logprobs if v else [] for v in verified],
            [v.top_logprobs if v else None for v in verified],
        )
        if exchange is not None:
            exchange.submit(
                lane,
                batch,
                inputs,
                outputs,
                verified,
                self.scheduler.take_released(),
                draft=plan.speculate,
                send=can_send,
                alone=plan.lanes == {lane},
            )
        return StepResult(
            outputs=results,
            stats=stats,
            timing=StepTiming(forward_ns=forward_ns),
            lane=lane,
            speculated=plan.speculate,
            measured=all(decoding),
            settled=not catching_up,
        )
