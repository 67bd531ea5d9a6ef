"""The in-process engine: collect trees -> schedule -> run -> verify -> commit -> submit, one
step at a time.

Without a drafter it is the target-only engine (every decode is a tree of one node). With one,
each step hands the draft what the verification committed and, at the lane's next step, takes
back the trees it drafted meanwhile, through the same calls the draft service answers over gRPC.

Lanes (docs/design.md section 5): every request belongs to a lane, and a step runs one lane's
requests. Steps take the lanes with work in turn, so with two lanes the draft drafts lane B
(submitted at the end of B's step) while the target verifies lane A. A tree only answers the
submission it was drafted for: a request that stepped again in between (it moved lanes, or its
tree was late) decodes that step without one, so lane moves are safe at any time. The target
service wraps this loop on its own thread; ``tandem generate`` drives it directly.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.clock import StepTiming, StreamClock
from tandem.config import EngineConfig
from tandem.errors import InvalidRequest
from tandem.kv import KVCache, KVCacheSpec
from tandem.models import DecoderLM, load_model
from tandem.request import FinishReason, Request, RequestOutput
from tandem.sampling import SamplingParams, make_generator
from tandem.spec.base import Drafter
from tandem.spec.simulate import AcceptSimulator
from tandem.spec.types import SpecConfig, SpecStats
from tandem.spec.verify import Verified, commit, verify_rows
from tandem.target import ahead
from tandem.target.device_chain import DeviceChain
from tandem.target.engine_ahead import MAX_LANES, AheadSteps
from tandem.target.engine_chain import ChainSteps
from tandem.target.exchange import DraftExchange
from tandem.target.graphs import graph_widths
from tandem.target.policy import NeverSpeculate, SpecPolicy
from tandem.target.runner import ModelInputs, ModelOutputs, ModelRunner
from tandem.target.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)

# Without a size, a CPU pool gets this budget (capped by what max_num_seqs full contexts need).
_CPU_KV_BYTES = 1 << 30
_MAX_POLICY_GAP_NS = 1_000_000_000  # between steps: longer is a pause, not a step's cost
# Adaptive policy: a batch whose requests all end within this many tokens stays at K=0 rather
# than resume speculation with a catch-up (it would not pay back).
RESUME_MIN_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    logprobs: list[float]  # target log-probability of each generated token
    finish_reason: FinishReason
    num_preemptions: int
    stats: SpecStats


class Engine(AheadSteps, ChainSteps):
    """Batches ragged requests through prefill (chunked) and decode, speculating when given a
    drafter."""

    def __init__(
        self,
        config: EngineConfig,
        model: DecoderLM | None = None,
        *,
        drafter: Drafter | None = None,
        spec: SpecConfig | None = None,
    ) -> None:
        if (drafter is None) != (spec is None):
            raise ValueError("spec: give a drafter and its SpecConfig together")
        self.config = config
        if model is None:
            model = load_model(config.model, dtype=config.torch_dtype, device=config.device)
        if config.use_transposed_weights:
            model.use_transposed_weights()
        if config.batch_invariant:
            model.use_batch_invariant()
        self.model = model
        self.drafter = drafter
        self.spec = spec
        mc = model.config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        kv_spec = KVCacheSpec(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            page_size=config.page_size,
            dtype=config.torch_dtype,
            device=config.device,
        )
        self.kv = KVCache(kv_spec, self._num_pages(kv_spec))
        logger.info(
            "KV pool: %d pages of %d tokens (%.1f MiB)",
            self.kv.allocator.num_pages,
            config.page_size,
            kv_spec.bytes_per_page * (self.kv.allocator.num_pages + 1) / 2**20,
        )
        self.runner = ModelRunner(model, self.kv, batch_invariant=config.batch_invariant)
        if config.use_cuda_graphs:
            self.runner.enable_graphs(
                batch_sizes=config.graph_batch_sizes,
                widths=graph_widths(spec.tree_size if spec is not None else None),
                max_model_len=self.max_model_len,
                capture_layers=drafter.target_layer_ids if drafter is not None else (),
            )
            if config.prefill_graph_widths:
                self.runner.enable_prefill_graphs(
                    widths=config.prefill_graph_widths,
                    max_model_len=self.max_model_len,
                    capture_layers=drafter.target_layer_ids if drafter is not None else (),
                )
            if drafter is not None and spec is not None:  # the draft follows the target
                drafter.use_graphs(
                    batch_sizes=config.graph_batch_sizes,
                    max_model_len=self.max_model_len,
                    num_steps=(spec.num_steps,),
                )
        self.scheduler = Scheduler(
            self.kv.allocator,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=mc.eos_token_ids,
        )
        # Coins per verify step: a fixed block, so the random stream never depends on the tree.
        self.coin_block = spec.tree_size if spec is not None else 1
        self.simulator: AcceptSimulator | None = None  # perf only: tandem.spec.simulate
        if config.simulate_accept_length is not None:
            if spec is None:
                raise ValueError("simulate_accept_length: needs speculation (a drafter)")
            self.simulator = AcceptSimulator(config.simulate_accept_length, spec.num_steps)
        self._requests: dict[str, Request] = {}
        self._released: list[str] = []  # finished or aborted since the draft last heard
        self._next_id = 0
        self.exchange: DraftExchange | None = None
        if drafter is not None and spec is not None:
            self.exchange = DraftExchange(
                drafter,
                spec,
                self._requests,
                vocab_size=mc.vocab_size,
                max_model_len=self.max_model_len,
            )
        # Adaptive speculation: per batch size, speculate or decode with K=0 (spec/policy.py).
        self.policy: SpecPolicy | None = None
        if self.exchange is not None and config.spec_policy == "adaptive":
            self.policy = SpecPolicy()
        elif self.exchange is not None and config.spec_policy == "k0":
            self.policy = NeverSpeculate()
        self.last_speculated = False  # whether the last step's lane ran with K > 0
        self.last_lane = MAX_LANES - 1  # the lane the last step ran (lane 0 goes first)
        self.last_stats = SpecStats()  # the last step's verifications, all requests together
        self.last_timing = StepTiming()
        self._forward_clock = StreamClock(self.runner.device)  # a verified step's forward
        self.overlapped_steps = 0  # steps whose forward ran while another lane was drafted
        self.in_flight: ahead.InFlight | None = None  # a plain decode step not read yet
        self.ahead_steps = 0  # steps launched before the last one was read
        self._ahead_wait_ns = 0  # the last read's wait for the device
        self._last_step_end: int | None = None  # perf_counter_ns when the last step returned
        self.chain: DeviceChain | None = None  # speculative steps launched ahead (device_chain)
        if config.device_chain:
            self.enable_device_chain()

    def _num_pages(self, spec: KVCacheSpec) -> int:
        c = self.config
        full = c.max_num_seqs * -(-self.max_model_len // c.page_size)
        if c.num_pages is not None:
            return c.num_pages
        if c.kv_cache_bytes is not None:
            return spec.pages_for_budget(c.kv_cache_bytes)
        if c.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(c.device))
            budget = int(free * c.gpu_memory_utilization)
        else:
            budget = _CPU_KV_BYTES
        return max(1, min(full, spec.pages_for_budget(budget)))

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        speculate: bool = True,
        lane: int = 0,
        trace_context: dict[str, str] | None = None,
    ) -> str:
        vocab = self.model.config.vocab_size
        _check_lane(lane)
        if not prompt_ids:
            raise InvalidRequest("prompt_ids", "empty prompt")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequest("prompt_ids", f"ids must be in [0, {vocab})")
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self._requests:
            raise InvalidRequest("request_id", f"{request_id!r} is already in use")
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            generator = make_generator(seed, self.config.device)
        req = Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            generator=generator,
            speculate=speculate and self.drafter is not None,
            lane=lane,
            trace_context=trace_context or {},
        )
        self.scheduler.add(req)
        self._requests[request_id] = req
        return request_id

    def abort(self, request_id: str) -> None:
        req = self.scheduler.abort(request_id)
        if req.in_draft:
            self._released.append(request_id)
            req.in_draft = False

    def set_lane(self, request_ids: Sequence[str], lane: int) -> None:
        """Moves requests to ``lane`` from their next step; unknown or finished ids are
        ignored (they may have just finished)."""
        _check_lane(lane)
        for request_id in request_ids:
            req = self._requests.get(request_id)
            if req is not None and not req.finished:
                req.lane = lane

    def lane_sizes(self) -> dict[int, int]:
        """Unfinished requests per lane."""
        sizes: dict[int, int] = {}
        for req in self._requests.values():
            if not req.finished:
                sizes[req.lane] = sizes.get(req.lane, 0) + 1
        return sizes

    def has_unfinished(self) -> bool:
        """Requests to step, or a device-chain run still to read and end (its last read
        step's tokens went out first: ``ChainSteps._chain_step``)."""
        return self.scheduler.has_unfinished() or (self.chain is not None and self.chain.active)

    def step(self) -> list[RequestOutput]:
        """Steps the next lane with work (in turn): its trees, one forward, its commits."""
        try:
            return self._step()
        finally:
            self._last_step_end = time.perf_counter_ns()

    def _policy_ns(self, started: int) -> int:
        """A step's time for the policy: since the last step ended (what the caller did in
        between, and a thread holding the GIL meanwhile, is this mode's too: a draft client
        sending new prompts stalled the target's loop 15-35 ms between steps), from its own
        start after a pause of a second or more."""
        since = self._last_step_end
        if since is None or started - since > _MAX_POLICY_GAP_NS:
            since = started
        return time.perf_counter_ns() - since

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter_ns()
        draft_model_before = self.drafter.model_ns if self.drafter is not None else 0
        exchange = self.exchange
        if exchange is not None:
            exchange.wait_ns = 0
        lanes = self.scheduler.lanes_with_work()
        if not lanes:
            if self.chain is not None and self.chain.active:
                return self._drain_chain(started, "no request left to step")
            return self._drain_ahead(started) if self.in_flight is not None else []
        speculate = exchange is not None
        # The policy's batch size is the size the batch is growing to: requests arriving over
        # a few prompt steps are not admitted to the draft (their features sent) by a small
        # batch's choice when the full one decodes plainly. Steps are measured at it too.
        growing = len(self.scheduler.running) + len(self.scheduler.waiting)
        policy_batch = max(1, min(growing, self.config.max_num_seqs))
        if speculate and not self.scheduler.any_speculate():
            # Every request opted out: plain decoding, which the policy neither chooses nor
            # measures (policy_batch 0): such steps say nothing about speculation.
            speculate, policy_batch = False, 0
        elif self.policy is not None:
            speculate = self.policy.speculate(policy_batch)
            # Speculation resumes with a catch-up (the draft takes in what K=0 held): not for
            # a batch that ends within a few steps (a bs-6 tail after a K=0 round took 78 ms
            # for 41 tokens that K=0 decodes in 28). Such steps go unmeasured.
            resuming = speculate and exchange is not None and exchange.catching_up
            if resuming and self.scheduler.all_end_within(RESUME_MIN_TOKENS):
                speculate, policy_batch = False, 0
        # A draft service taking in new prompts is not waited for: the batch decodes with K=0
        # meanwhile, steps the policy does not measure.
        ingesting = speculate and exchange is not None and exchange.ingesting()
        speculate = speculate and not ingesting
        chain = self.chain
        if chain is not None and chain.active:
            reason = chain.stop_reason(self.scheduler) if speculate else "K=0 (policy or ingest)"
            if not reason:
                return self._chain_step(policy_batch, started)
            return self._drain_chain(started, reason)  # the ordinary step runs at the next call
        if not speculate and self.config.overlap:
            reqs = ahead.next_requests(
                self.scheduler,
                self.in_flight,
                max_model_len=self.max_model_len,
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
            )
            if reqs is not None:
                return self._step_ahead(reqs, policy_batch, started, ingesting=ingesting)
        if self.in_flight is not None:
            return self._drain_ahead(started)  # the ordinary step runs at the next call
        lane = min(lanes, key=lambda n: (n - self.last_lane - 1) % MAX_LANES)
        self.last_lane = lane
        self.last_stats = SpecStats()
        step_lane: int | None = lane
        can_send = True
        # Trees are missing while the draft catches up after K=0: the policy skips such steps.
        catching_up = exchange is not None and speculate and exchange.catching_up
        if exchange is not None and speculate:
            exchange.collect_idle(lanes)
            exchange.collect(lane)
            if chain is not None and self._chain_ready(lanes, lane):
                chained = self._start_chain(policy_batch, started)
                if chained is not None:
                    self.last_lane = lane
                    return chained
        elif exchange is not None:
            # K=0: every lane steps at once (lanes pay only while a draft drafts beside the
            # target), never waiting on the draft; a merged step reports its sending lane.
            send_lane = exchange.skip(self.scheduler.running, MAX_LANES)
            step_lane = None
            lane = self.last_lane = send_lane if send_lane is not None else 0
            can_send = send_lane is not None
        self.last_speculated = speculate
        batch = self.scheduler.schedule(step_lane)
        if not batch:
            return []
        decoding = [req.decoding for req in batch.requests]
        inputs = self.runner.prepare(batch)
        # Read every step: a remote draft announces its layers when it (re)connects.
        layers = self.drafter.target_layer_ids if self.drafter is not None else ()
        if exchange is not None and exchange.other_lane_in_flight(lane):
            self.overlapped_steps += 1
        self._forward_clock.start()
        outputs = self.runner.forward(inputs, layers)
        self._forward_clock.stop()
        verified = self._verify(batch, inputs, outputs)  # reads the outcome: the forward is done
        forward_ns = self._forward_clock.elapsed_ns()
        self._commit(batch, decoding, verified)
        results = self.scheduler.postprocess(
            batch,
            [v.new_tokens if v else [] for v in verified],
            [v.logprobs if v else [] for v in verified],
        )
        if exchange is not None:
            released = self._take_released()
            exchange.submit(
                lane,
                batch,
                inputs,
                outputs,
                verified,
                released,
                draft=speculate,
                send=can_send,
                alone=lanes == {lane},
            )
        self.last_timing = StepTiming(
            total_ns=time.perf_counter_ns() - started,
            forward_ns=forward_ns,
            draft_wait_ns=exchange.wait_ns if exchange is not None else 0,
            draft_model_ns=(self.drafter.model_ns - draft_model_before) if self.drafter else 0,
        )
        if self.policy is not None and policy_batch and all(decoding):
            committed = sum(len(out.new_token_ids) for out in results)
            self.policy.record(
                policy_batch,
                committed,
                self._policy_ns(started),
                settled=not catching_up,
                ingesting=ingesting,
                held=exchange.held_tokens() if exchange is not None else 0,
            )
        return results

    def _verify(
        self, batch: ScheduledBatch, inputs: ModelInputs, outputs: ModelOutputs
    ) -> list[Verified | None]:
        return verify_rows(
            outputs.logits, inputs.trees, batch.requests, self.coin_block, self.simulator
        )

    def _commit(
        self, batch: ScheduledBatch, decoding: list[bool], verified: list[Verified | None]
    ) -> None:
        commit(self.kv, batch.requests, batch.num_new_tokens, decoding, verified, self.last_stats)

    def pop_finished(self, request_id: str) -> GenerationResult:
        req = self._requests.pop(request_id)
        assert req.finish_reason is not None, "pop_finished on a running request"
        return GenerationResult(
            request_id=req.request_id,
            prompt_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            logprobs=list(req.output_logprobs),
            finish_reason=req.finish_reason,
            num_preemptions=req.num_preemptions,
            stats=req.stats,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        progress: Callable[[int], None] | None = None,
    ) -> list[GenerationResult]:
        """Runs prompts to completion; ``progress(num_new_tokens)`` is called after each step."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise InvalidRequest("params", "one SamplingParams per prompt expected")
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, per_prompt, strict=True):
                ids.append(self.add_request(prompt, sp))
        except InvalidRequest:
            for request_id in ids:  # all or nothing
                self.abort(request_id)
                self._requests.pop(request_id)
            raise
        while self.has_unfinished():
            outputs = self.step()
            if progress is not None:
                progress(sum(len(o.new_token_ids) for o in outputs))
        self.flush_draft()
        return [self.pop_finished(i) for i in ids]

    def flush_draft(self) -> None:
        """Collects every lane's outstanding answer and tells the draft about requests
        released since (aborted while idle, say), so it frees their pages now rather than
        with the next step. Called when no request runs: a device-chain run whose requests
        all finished (its last step still unread) ends here, with nothing to commit."""
        chain = self.chain
        if chain is not None and chain.active and not self.scheduler.has_unfinished():
            self._end_chain("every request finished")
        released = self._take_released()
        if self.exchange is not None:
            self.exchange.flush(released, self.last_lane)

    def _take_released(self) -> list[str]:
        """Requests the draft must forget: finished, aborted or preempted since it last heard."""
        released = [*self._released, *self.scheduler.preempted]
        self._released.clear()
        self.scheduler.preempted.clear()
        return released


def _check_lane(lane: int) -> None:
    if not 0 <= lane < MAX_LANES:
        raise InvalidRequest("lane_id", f"must be in [0, {MAX_LANES}), got {lane}")
