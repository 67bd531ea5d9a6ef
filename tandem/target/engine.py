"""The verifier engine: one step at a time, collect trees -> schedule -> forward -> verify ->
commit -> hand the outcome to the draft.

Without a drafter it is the target-only engine (every decode is a tree of one node). With one,
each step hands the draft what the verification committed and, at the lane's next step, takes
back the trees it drafted meanwhile, through the same calls the draft service answers over gRPC.

``Engine.step`` plans a step (``StepPlan``: the lanes with work and whose turn it is, speculate
or K=0, the batch size the adaptive policy counts it at), runs it in the first step mode that
takes it, and records its time and the policy's measure once (``StepResult``). The modes, in
order: device-chain runs (``chain_mode.py``, while one is active), plain decoding ahead
(``ahead_mode.py``), the ordinary synchronous step (``sync_mode.py``, which takes every plan).

Lanes (docs/design.md section 5): every request belongs to a lane, and a speculating step runs
one lane's requests. Steps take the lanes with work in turn, so with two lanes the draft drafts
lane B (submitted at the end of B's step) while the target verifies lane A. A tree only
answers the submission it was drafted for: a request that stepped again in between (it moved
lanes, or its tree was late) decodes that step without one, so lane moves are safe at any
time. The target service wraps this loop on its own thread; ``tandem generate`` drives it
directly.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tandem.config import EngineConfig
from tandem.errors import InvalidRequest
from tandem.models import DecoderLM
from tandem.request import FinishReason, Request, TopLogprobs
from tandem.sampling import SamplingParams, make_generator
from tandem.spec.base import Drafter
from tandem.spec.simulate import AcceptSimulator
from tandem.spec.types import NoTree, SpecConfig, SpecStats, StepCounts
from tandem.target.ahead_mode import AheadMode
from tandem.target.chain_mode import ChainMode
from tandem.target.device_chain import DeviceChain, unsupported
from tandem.target.exchange import DraftExchange
from tandem.target.policy import NeverSpeculate, SpecPolicy
from tandem.target.runner import ModelRunner
from tandem.target.scheduler import Scheduler
from tandem.target.setup import enable_graphs, kv_pool, prepared_model
from tandem.target.step import MAX_LANES, StepMode, StepPlan, StepResult
from tandem.target.sync_mode import SyncMode

logger = logging.getLogger(__name__)

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
    top_logprobs: list[TopLogprobs]  # per generated token where params.top_logprobs asked
    finish_reason: FinishReason
    num_preemptions: int
    stats: SpecStats


class Engine:
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
        self.model = model = prepared_model(model, config)
        self.drafter = drafter
        self.spec = spec
        mc = model.config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.kv = kv_pool(config, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.max_model_len)
        self.runner = ModelRunner(model, self.kv, batch_invariant=config.batch_invariant)
        if config.use_cuda_graphs:
            enable_graphs(self.runner, config, drafter, spec, self.max_model_len)
        self.scheduler = Scheduler(
            self.kv.allocator,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=mc.eos_token_ids,
        )
        self.simulator: AcceptSimulator | None = None  # perf only: tandem.spec.simulate
        if config.simulate_accept_length is not None:
            if spec is None:
                raise ValueError("simulate_accept_length: needs speculation (a drafter)")
            self.simulator = AcceptSimulator(config.simulate_accept_length, spec.num_steps)
        self._requests: dict[str, Request] = {}
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
        # Adaptive speculation: per batch size, speculate or decode with K=0 (policy.py).
        self.policy: SpecPolicy | None = None
        if self.exchange is not None and config.spec_policy == "adaptive":
            self.policy = SpecPolicy()
        elif self.exchange is not None and config.spec_policy == "k0":
            self.policy = NeverSpeculate()
        self.ahead = AheadMode(
            scheduler=self.scheduler,
            runner=self.runner,
            drafter=drafter,
            exchange=self.exchange,
            overlap=config.overlap,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            coin_block=spec.tree_size if spec is not None else 1,
        )
        self.sync = SyncMode(
            scheduler=self.scheduler,
            runner=self.runner,
            kv=self.kv,
            drafter=drafter,
            exchange=self.exchange,
            chain=None,
            # Coins per verify step: a fixed block, so the random stream never depends on
            # the tree.
            coin_block=spec.tree_size if spec is not None else 1,
            simulator=self.simulator,
        )
        self.chained: ChainMode | None = None  # device-chain runs, when enabled
        self.modes: list[StepMode] = [self.ahead, self.sync]
        self._lane = MAX_LANES - 1  # the lane the last step ran (lane 0 goes first)
        self.step_counts = StepCounts()  # decode steps with and without a draft token
        self._last_step_end: int | None = None  # perf_counter_ns when the last step returned
        # On where it can run unless set (EngineConfig.device_chain); set on, it must run.
        if config.device_chain or (config.device_chain is None and not self.device_chain_problem()):
            self.enable_device_chain()

    def device_chain_problem(self) -> str:
        """Why this engine cannot run device-chain steps ('' when it can)."""
        if self.exchange is None:
            return "needs a drafter"
        return unsupported(self.drafter, self.spec, self.runner.graphs)

    def enable_device_chain(self) -> DeviceChain:
        """Runs steady greedy chain speculation as device-chain steps
        (``tandem/target/device_chain.py``); ValueError says why this engine cannot."""
        problem = self.device_chain_problem()
        if problem or self.drafter is None or self.spec is None or self.exchange is None:
            raise ValueError(f"device_chain: {problem}")
        assert self.runner.graphs is not None
        chain = DeviceChain(
            target=self.runner.graphs,
            kv=self.kv,
            drafter=self.drafter,
            spec=self.spec,
            simulator=self.simulator,
            max_model_len=self.max_model_len,
        )
        self.chained = self.sync.chain = ChainMode(chain, self.scheduler, self.exchange)
        self.modes = [self.chained, self.ahead, self.sync]
        return chain

    @property
    def chain(self) -> DeviceChain | None:
        """The device chain, when device-chain steps are on."""
        return self.chained.chain if self.chained is not None else None

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
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequest("logit_bias", f"ids must be in [0, {vocab})")
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
            min_tokens_block=self._min_tokens_block(params),
        )
        self.scheduler.add(req)
        self._requests[request_id] = req
        return request_id

    def _min_tokens_block(self, params: SamplingParams) -> tuple[int, ...]:
        if not params.min_tokens:
            return ()
        eos = () if params.ignore_eos else tuple(self.scheduler.eos_token_ids)
        vocab = self.model.config.vocab_size
        return tuple(sorted({t for t in (*params.stop_token_ids, *eos) if t < vocab}))

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

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
        step's tokens went out first: ``ChainMode``)."""
        chain = self.chain
        return self.scheduler.has_unfinished() or (chain is not None and chain.active)

    def step(self) -> StepResult:
        """Plans one step, runs it in the first mode that takes it (a mode with launched
        steps it cannot go on with reads them instead), and records its time and the
        policy's measure."""
        started = time.perf_counter_ns()
        drafter, exchange = self.drafter, self.exchange
        draft_model_ns = drafter.model_ns if drafter is not None else 0
        if exchange is not None:
            exchange.wait_ns = 0
        try:
            plan = self._plan()
            result = next(r for mode in self.modes if (r := mode.run(plan)) is not None)
            timing = replace(
                result.timing,
                total_ns=time.perf_counter_ns() - started,
                draft_wait_ns=exchange.wait_ns if exchange is not None else 0,
                draft_model_ns=drafter.model_ns - draft_model_ns if drafter is not None else 0,
            )
            result = replace(result, timing=timing)
            if self.policy is not None and plan.policy_batch and result.measured:
                self.policy.record(
                    plan.policy_batch,
                    result.num_committed,
                    self._policy_ns(started),
                    settled=result.settled,
                    held=exchange.held_tokens() if exchange is not None else 0,
                )
            self._lane = result.lane
            self.step_counts.add(result.stats)
            return result
        finally:
            self._last_step_end = time.perf_counter_ns()

    def _plan(self) -> StepPlan:
        lanes = frozenset(self.scheduler.lanes_with_work())
        lane = min(lanes, key=lambda n: (n - self._lane - 1) % MAX_LANES, default=self._lane)
        if not lanes:  # only launched steps are left to read: nothing to decide
            return StepPlan(
                lanes=lanes,
                lane=lane,
                last_lane=self._lane,
                speculate=False,
                policy_batch=0,
            )
        exchange, scheduler = self.exchange, self.scheduler
        speculate = exchange is not None
        plain: NoTree | None = None  # why the step runs K=0, if it does
        # The policy's batch size is the size the batch is growing to: requests arriving over
        # a few prompt steps are not admitted to the draft (their features sent) by a small
        # batch's choice when the full one decodes plainly. Steps are measured at it too.
        growing = len(scheduler.running) + len(scheduler.waiting)
        policy_batch = max(1, min(growing, self.config.max_num_seqs))
        if speculate and not scheduler.any_speculate():
            # Every request opted out: plain decoding, which the policy neither chooses nor
            # measures (policy_batch 0): such steps say nothing about speculation.
            speculate, policy_batch, plain = False, 0, NoTree.OPTED_OUT
        elif self.policy is not None:
            speculate = self.policy.speculate(policy_batch)
            # Speculation resumes with a catch-up (the draft takes in what K=0 held): not for
            # a batch that ends within a few steps, whose catch-up would not pay back. Such
            # steps go unmeasured.
            resuming = speculate and exchange is not None and exchange.catching_up
            if resuming and scheduler.all_end_within(RESUME_MIN_TOKENS):
                speculate, policy_batch = False, 0
            plain = None if speculate else NoTree.POLICY
        if speculate and self.drafter is not None and self.drafter.behind():
            # A late answer is still to come: plain steps (outcomes held) until it is in, so
            # the draft is not sent more steps to queue behind it; not measured.
            speculate, policy_batch, plain = False, 0, NoTree.LATE
        return StepPlan(
            lanes=lanes,
            lane=lane,
            last_lane=self._lane,
            speculate=speculate,
            policy_batch=policy_batch,
            plain=plain,
        )

    def _policy_ns(self, started: int) -> int:
        """A step's time for the policy: since the last step ended (what the caller did in
        between, and a thread holding the GIL meanwhile, is this mode's too: a draft client
        sending new prompts can stall the target's loop between steps), from its own start
        after a pause of a second or more."""
        since = self._last_step_end
        if since is None or started - since > _MAX_POLICY_GAP_NS:
            since = started
        return time.perf_counter_ns() - since

    def pop_finished(self, request_id: str) -> GenerationResult:
        req = self._requests.pop(request_id)
        assert req.finish_reason is not None, "pop_finished on a running request"
        return GenerationResult(
            request_id=req.request_id,
            prompt_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            logprobs=list(req.output_logprobs),
            top_logprobs=list(req.output_top_logprobs),
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
            result = self.step()
            if progress is not None:
                progress(result.num_committed)
        self.flush_draft()
        return [self.pop_finished(i) for i in ids]

    def flush_draft(self) -> None:
        """Collects every lane's outstanding answer and tells the draft about requests
        released since (aborted while idle, say), so it frees their pages now rather than
        with the next step. Called when no request runs: a device-chain run whose requests
        all finished (its last step still unread) ends here, with nothing to commit; device-chain
        graphs not captured yet (a draft service just connected) are captured here."""
        chained = self.chained
        if chained is not None and chained.chain.active and not self.scheduler.has_unfinished():
            chained.end("every request finished")
        released = self.scheduler.take_released()
        if self.exchange is not None:
            self.exchange.flush(released, self._lane)
        if chained is not None and not self.has_unfinished() and chained.chain.needs_warming():
            try:
                chained.chain.warm()  # every bucket's graphs, before a run needs one
            except Exception:  # a capture that fails here (memory) must not end the caller's loop
                logger.exception("device chain: warming failed; device-chain steps are off")
                self.chained = self.sync.chain = None
                self.modes = [self.ahead, self.sync]


def _check_lane(lane: int) -> None:
    if not 0 <= lane < MAX_LANES:
        raise InvalidRequest("lane_id", f"must be in [0, {MAX_LANES}), got {lane}")
