"""Continuous batching: which requests run this step and how many tokens each.

Every step builds one flat batch: running requests first (a decode is its draft tree, or one
token without a tree; an unfinished prompt is its next chunk), then waiting requests while the
token budget, the sequence cap and the KV pool allow. Prefill chunks and decodes mix freely
because attention handles ragged query lengths. A tree that does not fit the budget or the pool
is dropped (that step decodes one token): speculation never preempts. When the pool cannot grow
a running request by one token, the newest running request gives back its pages and returns to
the front of the queue; it is recomputed later, so nothing is lost.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.errors import InvalidRequest, NotFound
from tandem.kv import PageAllocator
from tandem.request import FinishReason, Request, RequestOutput, RequestStatus, TopLogprobs
from tandem.spec.types import NoTree


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per request, this step

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the draft must forget, preempted or aborted since the engine last took them.
        self._released: list[str] = []
        # Requests whose pages a device-chain run still writes: kept when they finish, until
        # ``unpin`` (the run's steps in flight compute their rows to the end).
        self._pinned: set[str] = set()

    def pin(self, request_ids: list[str]) -> None:
        """Keeps these requests' KV pages when they finish, until ``unpin``."""
        self._pinned.update(request_ids)

    def unpin(self, requests: list[Request]) -> None:
        """Lets these requests' pages go as usual; a finished one's go now."""
        for req in requests:
            self._pinned.discard(req.request_id)
            if req.finished:
                self.allocator.free(req.request_id)

    def add(self, req: Request) -> None:
        """Queues a request after checking that it can ever fit in the pool and the context."""
        if req.num_tokens >= self.max_model_len:
            raise InvalidRequest(
                "prompt_ids", f"{req.num_tokens} tokens leave no room in max_model_len"
            )
        worst = min(req.num_tokens + req.params.max_new_tokens, self.max_model_len)
        if self.allocator.pages_needed(None, worst) > self.allocator.num_pages:
            raise InvalidRequest(
                "max_new_tokens",
                f"{worst} tokens need more KV pages than the pool has "
                f"({self.allocator.num_pages} pages of {self.allocator.page_size})",
            )
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def all_end_within(self, tokens: int) -> bool:
        """Whether nothing waits and every running request reaches its length limit
        (``max_new_tokens`` or the context) within ``tokens`` more tokens."""
        if self.waiting or not self.running:
            return False
        limit = self.max_model_len
        return all(r.length_limit(limit) - r.num_tokens <= tokens for r in self.running)

    def any_speculate(self) -> bool:
        """Whether a running or waiting request may speculate (none opted out of it)."""
        return any(r.speculate for r in self.running) or any(r.speculate for r in self.waiting)

    def can_take_waiting(self) -> bool:
        """Whether a waiting request could be scheduled now as far as sequences go (running
        requests below ``max_num_seqs``); one that could not waits for a finish anyway."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def step_full(self) -> bool:
        """Whether the waiting requests already fill a step (its sequences or its tokens), so
        a request arriving now would wait for a later step anyway."""
        if len(self.running) + len(self.waiting) >= self.max_num_seqs:
            return True
        tokens = sum(r.num_tokens - r.num_computed for r in self.waiting)
        return tokens >= self.max_num_batched_tokens

    def schedule(self, lane: int | None = None, *, unparked: bool = False) -> ScheduledBatch:
        """This step's batch: the running requests of ``lane`` (all when None; ``unparked``:
        not those whose prompt a draft service is still taking in), then waiting requests of
        any lane. A prompt is no lane's yet: prefilled in the first step with room,
        a burst split over two lanes takes as few steps as its tokens need (the gateway assigns
        lanes at admission, so a burst's first step held one lane's share of it: one extra
        2048-token step a bs-32 round); it decodes in its own lane from then on."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        for req in [r for r in self.running if lane is None or r.lane == lane]:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier request of this step
            if unparked and req.parked:
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if req.tree is not None and (
                len(req.tree) > budget
                or not self.allocator.can_extend(req.request_id, self._kv_need(req, len(req.tree)))
            ):
                req.tree, req.miss = None, NoTree.CAPACITY
            if req.tree is not None:
                n = len(req.tree)
            num_running = len(self.running)
            if not self._reserve(req, n):
                preempted = True
                break  # req itself was preempted: it was the newest
            preempted = preempted or len(self.running) < num_running
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        while budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            # Waiting requests, first come first served; the pool is tight after a preemption,
            # so the running requests finish first then.
            if not self.waiting:
                break
            new = self.waiting[0]
            n = min(new.num_tokens, budget)
            if not self.allocator.can_allocate(n):
                break
            self.allocator.allocate(new.request_id, n)
            self.waiting.remove(new)
            new.status = RequestStatus.RUNNING
            self.running.append(new)
            batch.requests.append(new)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def recompute(self, req: Request) -> None:
        """Preempts a running request (its KV is recomputed with its next prefill, which
        gathers the features a draft needs to take it in again); others are left alone."""
        if req.status is RequestStatus.RUNNING:
            self._preempt(req)

    def has_ready(self, lane: int | None) -> bool:
        """Whether a step of ``lane`` (all when None) has something to run besides parked
        requests: a running request not parked, or a prompt waiting."""
        lane_reqs = [r for r in self.running if lane is None or r.lane == lane]
        return bool(self.waiting) or any(not r.parked for r in lane_reqs)

    def lanes_with_work(self) -> set[int]:
        return {r.lane for r in self.running} | {r.lane for r in self.waiting}

    def _kv_need(self, req: Request, n: int) -> int:
        return req.num_computed + n - self.allocator.num_tokens(req.request_id)

    def _reserve(self, req: Request, n: int) -> bool:
        """Grows ``req``'s KV to hold ``n`` more tokens, preempting the newest running requests
        until it fits. False if ``req`` itself had to go."""
        need = self._kv_need(req, n)
        while need > 0 and not self.allocator.can_extend(req.request_id, need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            self.allocator.extend(req.request_id, need)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.free(req.request_id)
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        req.tree = None
        req.parked = False
        req.draft_features = []
        self._release(req)
        self.waiting.appendleft(req)

    def postprocess(
        self,
        batch: ScheduledBatch,
        new_tokens: list[list[int]],
        new_logprobs: list[list[float]],
        new_top_logprobs: Sequence[list[TopLogprobs] | None] = (),
    ) -> list[RequestOutput]:
        """Appends each request's committed tokens (and, where given, their top log-probabilities)
        up to the first that finishes it (later ones are dropped) and finishes requests that
        stop. KV progress is the caller's."""
        outputs = []
        tops = new_top_logprobs or [None] * len(new_tokens)
        for req, tokens, logprobs, top in zip(
            batch.requests, new_tokens, new_logprobs, tops, strict=True
        ):
            if not tokens:
                continue  # a prompt chunk that does not end the prompt
            kept = 0
            for token, logprob in zip(tokens, logprobs, strict=True):
                req.output_ids.append(token)
                req.output_logprobs.append(logprob)
                if top is not None:
                    req.output_top_logprobs.append(top[kept])
                kept += 1
                reason = self._finish_reason(req, token)
                if reason is not None:
                    self._finish(req, reason)
                    break
            outputs.append(
                RequestOutput(
                    request_id=req.request_id,
                    new_token_ids=tokens[:kept],
                    new_logprobs=logprobs[:kept],
                    new_top_logprobs=top[:kept] if top is not None else [],
                    finished=req.finished,
                    finish_reason=req.finish_reason,
                )
            )
        return outputs

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if len(req.output_ids) >= params.max_new_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.running.remove(req)
        if req.request_id not in self._pinned:
            self.allocator.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.tree = None

    def abort(self, request_id: str) -> Request:
        """Ends a waiting or running request and frees its pages."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.status = RequestStatus.FINISHED
                req.finish_reason = FinishReason.ABORT
                self._release(req)
                return req
        for req in self.running:
            if req.request_id == request_id:
                self._finish(req, FinishReason.ABORT)
                self._release(req)
                return req
        raise NotFound(f"request {request_id!r} is not running or waiting")

    def take_released(self) -> list[str]:
        """The requests the draft must forget (preempted or aborted) since the last call."""
        released, self._released = self._released, []
        return released

    def _release(self, req: Request) -> None:
        if req.in_draft:
            self._released.append(req.request_id)
            req.in_draft = False
