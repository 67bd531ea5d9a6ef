"""The public `GatewayService`: a thin grpc.aio servicer over the target's control stream.

`Generate` reads the prompt within its bounds (`gateway.prompt`), validates the request
(`prepare`), takes an admission slot, admits the request at the target, and turns its commits
into chunks (incremental text, stop strings matched here) and one completion. Everything that
ends a request early goes back to the target as an `AbortCommand`: a matched stop string (finish
STOP), an `Abort` call, a client that went away or stopped reading (finish ABORT;
`gateway.slow_readers`), so the target frees the request's pages at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.rpc import code_pb2  # type: ignore[import-untyped]

from gateway import samples
from gateway.admission import Admission, Overloaded, Withdrawn
from gateway.config import GatewayConfig
from gateway.detokenize import IncrementalDetokenizer, StopStringMatcher
from gateway.failover import Failover
from gateway.job import Job, prepare
from gateway.lanes import LanePlanner, Move
from gateway.observe import GatewayObserver
from gateway.prompt import PromptReader
from gateway.scope import JobKey, OwnedIds
from gateway.screen import screen_generate
from gateway.slow_readers import CUT_OFF_CODE, ReadWatch
from gateway.target_client import RequestStream, TargetClient, TargetUnavailable
from tandem import __version__
from tandem.serving import rpc
from tandem.serving.principal import Principals
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2

logger = logging.getLogger(__name__)

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
_UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: Any,  # a transformers tokenizer
        client: TargetClient,
        admission: Admission,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.prompts = PromptReader(tokenizer)
        self.client = client
        self.admission = admission
        self.failover = Failover(client, config.failover_wait_s)
        self.started_ns = time.monotonic_ns()
        self._jobs: dict[JobKey, Job] = {}  # queued or running, by principal and request id
        self.principals = Principals(
            tokens=bool(config.auth_tokens),
            client_certs=config.tls is not None and config.tls.require_client_cert,
        )
        self.lanes = LanePlanner(config.two_lane_batch)  # by target id
        self.observe = GatewayObserver(
            model=lambda: self.client.info.model_id if self.client.info else "",
            queue=lambda: (self.admission.num_running, self.admission.num_waiting),
            connected=lambda: self.client.connected,
        )
        self._seq = itertools.count(1)
        self.groups = samples.Groups()  # n > 1 requests' completions (gateway.samples)

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        principal, info = self.principals.of(context), self.client.info
        self.groups.refuse_running(principal, request, taken=self._jobs)
        if request.n <= 1:
            async for response in self._generate(request, context):
                yield response
            return
        text = request.WhichOneof("prompt") == "text"  # tokenized once, for every completion
        ids = await self.prompts.read(request, info) if text and info is not None else None
        request_id, subs = samples.split(request, ids)
        with self.groups.running(principal, request_id, subs):
            async for response in samples.interleave(self._generate, request_id, subs, context):
                yield response

    async def _generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        received_ns = time.monotonic_ns()
        principal = self.principals.of(context)
        try:  # InvalidRequest goes to the error interceptor: INVALID_ARGUMENT + BadRequest
            info = self.client.info
            if info is None:
                raise TargetUnavailable("the target has not connected yet")
            if not self.client.connected:  # only requests accepted before a loss wait for it
                raise TargetUnavailable(self.client.lost)
            prompt_ids = await self.prompts.read(request, info)  # tokenized off the loop
            job = prepare(
                request,
                prompt_ids=prompt_ids,
                info=info,
                config=self.config,
                running=OwnedIds(self._jobs, principal),
                received_ns=received_ns,
                seq=next(self._seq),
            )
        except TargetUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        job.key = (principal, job.request_id)
        self._jobs[job.key] = job
        job.span = self.observe.start(job.request_id, job.admit)
        watch = ReadWatch(self.config.slow_reader_timeout_s, lambda: self._cut_off(job, watch))
        try:
            async for response in self._run(job, context):
                watch.writing()
                yield response  # returns once the transport took it (flow control)
                watch.written()
                if watch.expired and not job.finished:
                    await context.abort(CUT_OFF_CODE, watch.reason)
        finally:
            watch.written()
            self._close(job)

    def screen(self, data: bytes) -> None:
        """A Generate request's bytes, checked before they are parsed (``gateway.screen``)."""
        if (info := self.client.info) is not None:
            screen_generate(
                data,
                max_model_len=info.max_model_len,
                bytes_per_token=self.prompts.bytes_per_token,
            )

    def _cut_off(self, job: Job, watch: ReadWatch) -> None:
        logger.warning("request %s: %s", job.request_id, watch.reason)
        self._close(job, watch.reason)

    def _close(self, job: Job, why: str = "no completion sent") -> None:
        """Ends a request here, once: its span, its admission slot and lane, and at the target
        (aborted there unless it finished)."""
        if job.closed:
            return
        job.closed = True
        if job.span is not None:  # ended without a completion: an error, a cancel, a cut-off
            usage = common_pb2.Usage(
                prompt_tokens=len(job.prompt_ids), completion_tokens=len(job.completion_ids)
            )
            self._end_span(job, common_pb2.FINISH_REASON_ABORT, usage, why)
        del self._jobs[job.key]
        self.admission.release(job.origin)
        if job.admitted and not job.finished:
            # The client went away (cancellation) or the servicer failed: free the target.
            self.client.abort([job.target_id], common_pb2.FINISH_REASON_ABORT)
        self.client.forget(job.target_id)
        self.failover.forget(job.origin)
        self._send_moves(self.lanes.finish(job.target_id))

    async def _run(
        self, job: Job, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        try:
            await self.admission.acquire(job.origin)
        except Overloaded as exc:
            await rpc.abort_overloaded(context, str(exc), self.config.retry_after_s)
        except Withdrawn:
            job.finished = True
            yield self._complete(job, common_pb2.FINISH_REASON_ABORT)
            return
        lane, moves = self.lanes.admit(job.target_id)
        job.admit.lane_id = lane
        if job.span is not None:
            job.span.add_event("admitted", {"tandem.lane": lane})
        try:
            stream = self.client.admit(job.admit)
        except TargetUnavailable as exc:  # lost while the request was queued: it waits too
            previous = job.target_id
            try:
                finish = await self.failover.resume(job, exc)
            except TargetUnavailable as gone:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(gone))
            if finish is not None:
                job.finished = True
                yield self._complete(job, finish)
                return
            stream = await self._readmit(job, previous, context)
        self._send_moves(moves)
        job.admitted = True
        job.admitted_ns = time.monotonic_ns()
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, job.prompt_ids, skip_special_tokens=job.skip_special_tokens
        )
        stops = StopStringMatcher(job.stop_strings)
        sent_any = False
        while True:
            try:
                # After a stop string the target owes one final commit; do not wait forever.
                timeout = None if stops.matched is None else self.config.target_timeout_s
                commit = await asyncio.wait_for(stream.next(), timeout)
            except (TimeoutError, TargetUnavailable) as exc:
                if stops.matched is not None:  # the outcome was decided before the failure
                    job.finished = True
                    yield self._complete(job, common_pb2.FINISH_REASON_STOP, None, stops.matched)
                    return
                previous = job.target_id  # the timeout only runs after a stop string
                try:
                    finish = await self.failover.resume(job, TargetUnavailable(str(exc)))
                except TargetUnavailable as gone:
                    job.finished = True
                    commit = target_pb2.Commit(finish_reason=common_pb2.FINISH_REASON_ERROR)
                    commit.error.code, commit.error.message = code_pb2.UNAVAILABLE, str(gone)
                else:
                    if finish is None:
                        stream = await self._readmit(job, previous, context)
                        continue
                    job.finished = True
                    yield self._complete(job, finish)
                    return
            if commit.finish_reason == common_pb2.FINISH_REASON_ERROR:
                job.finished = True
                error = commit.error
                code = _STATUS_CODES.get(error.code, grpc.StatusCode.INTERNAL)
                logger.warning("request %s failed: %s %s", job.request_id, code.name, error.message)
                if sent_any:  # a failure after the stream started: say so in the stream too
                    yield gateway_pb2.GenerateResponse(
                        request_id=job.request_id,
                        error=gateway_pb2.GenerateError(
                            code=error.code, message=error.message, field=error.field
                        ),
                    )
                reason = f"{error.field}: {error.message}" if error.field else error.message
                usage = common_pb2.Usage(
                    prompt_tokens=len(job.prompt_ids), completion_tokens=len(job.completion_ids)
                )
                self._end_span(job, common_pb2.FINISH_REASON_ERROR, usage, f"{code.name} {reason}")
                await context.abort(code, reason or "the target failed the request")
            if stops.matched is None:
                chunk = self._chunk(job, commit, detokenizer, stops)
                if chunk is not None:
                    sent_any = True
                    yield chunk
                if stops.matched is not None and commit.finish_reason == _UNSPECIFIED:
                    self.client.abort([job.target_id], common_pb2.FINISH_REASON_STOP)
            if commit.finish_reason != _UNSPECIFIED:
                job.finished = True
                yield self._complete(job, commit.finish_reason, commit, stops.matched)
                return

    async def _readmit(
        self, job: Job, previous: str, context: grpc.aio.ServicerContext
    ) -> RequestStream:
        """Admits a request's continuation (``Failover.resume`` made ``job.admit`` it, under a
        new id) in a lane; UNAVAILABLE if the target went again in between."""
        admit = job.admit
        moves = self.lanes.finish(previous)
        admit.lane_id, more = self.lanes.admit(admit.request_id)
        try:
            stream = self.client.admit(admit)
        except TargetUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self._send_moves([*moves, *more])
        return stream

    def _send_moves(self, moves: list[Move]) -> None:
        for move in moves:
            logger.debug("lane %d <- %d requests", move.lane, len(move.request_ids))
            self.client.assign(move.request_ids, move.lane)

    def _chunk(
        self,
        job: Job,
        commit: target_pb2.Commit,
        detokenizer: IncrementalDetokenizer,
        stops: StopStringMatcher,
    ) -> gateway_pb2.GenerateResponse | None:
        """The chunk for one commit's tokens; tokens after a matched stop string are dropped."""
        token_ids = list(commit.token_ids)
        if job.stop_strings:
            # Token by token, so the chunk ends with the token that completed the match.
            text = ""
            for n, token_id in enumerate(token_ids, start=1):
                text += stops.feed(detokenizer.add([token_id]))
                if stops.matched is not None:
                    token_ids = token_ids[:n]
                    break
        elif job.detokenize:
            text = detokenizer.add(token_ids)
        else:
            text = ""
        if commit.finish_reason != _UNSPECIFIED and stops.matched is None:
            text += stops.feed(detokenizer.flush()) + stops.flush()
        if not token_ids and not text:
            return None
        job.completion_ids.extend(token_ids)
        if job.first_chunk_ns == 0:
            job.first_chunk_ns = time.monotonic_ns()
            if job.span is not None:
                job.span.add_event("first_token")
        chunk = gateway_pb2.GenerateChunk(
            token_ids=token_ids,
            text=text if job.detokenize else "",
            # Only when asked for: the target reports them for every commit.
            logprobs=list(commit.logprobs)[: len(token_ids)] if job.admit.sampling.logprobs else [],
            top_logprobs=list(commit.top_logprobs)[: len(token_ids)],
        )
        if job.continuous_usage:
            chunk.usage.prompt_tokens = len(job.prompt_ids)
            chunk.usage.completion_tokens = len(job.completion_ids)
        return gateway_pb2.GenerateResponse(request_id=job.request_id, chunk=chunk)

    def _complete(
        self,
        job: Job,
        finish_reason: common_pb2.FinishReason,
        commit: target_pb2.Commit | None = None,
        stop_string: str | None = None,
    ) -> gateway_pb2.GenerateResponse:
        now = time.monotonic_ns()
        usage = common_pb2.Usage()  # the target's totals, with the counts the client received
        if commit is not None and commit.HasField("usage"):
            usage.CopyFrom(commit.usage)
        usage.prompt_tokens, usage.completion_tokens = len(job.prompt_ids), len(job.completion_ids)
        complete = gateway_pb2.GenerateComplete(
            finish_reason=common_pb2.FINISH_REASON_STOP if stop_string else finish_reason,
            usage=usage,
            queue_ns=(job.admitted_ns or now) - job.received_ns,
            ttft_ns=(job.first_chunk_ns - job.received_ns) if job.first_chunk_ns else 0,
            total_ns=now - job.received_ns,
        )
        last = job.completion_ids[-1] if job.completion_ids else None
        if stop_string is not None:
            complete.stop_string = stop_string
        elif finish_reason == common_pb2.FINISH_REASON_STOP and last in job.stop_token_ids:
            complete.stop_token_id = last
        reason = common_pb2.FinishReason.Name(complete.finish_reason)
        logger.info("request %s: %s, %d tokens", job.request_id, reason, len(job.completion_ids))
        self._end_span(job, complete.finish_reason, usage)
        return gateway_pb2.GenerateResponse(request_id=job.request_id, complete=complete)

    def _end_span(
        self,
        job: Job,
        reason: common_pb2.FinishReason,
        usage: common_pb2.Usage,
        error: str | None = None,
    ) -> None:
        if job.span is None:
            return
        span, job.span = job.span, None
        self.observe.finish(
            span,
            reason,
            usage,
            received_ns=job.received_ns,
            first_chunk_ns=job.first_chunk_ns,
            now_ns=time.monotonic_ns(),
            error=error,
        )

    async def Abort(
        self, request: gateway_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AbortResponse:
        aborted: list[str] = []
        principal = self.principals.of(context)  # only the caller's own requests
        for asked in dict.fromkeys(request.request_ids):
            # An n > 1 request's id reaches each of its completions (gateway.samples).
            hits = [self._abort((principal, i)) for i in self.groups.expand(principal, asked)]
            if any(hits):
                aborted.append(asked)
        return gateway_pb2.AbortResponse(aborted_request_ids=aborted)

    def _abort(self, key: JobKey) -> bool:
        job = self._jobs.get(key)
        if job is None or job.finished or job.aborting:
            return False
        job.aborting = True
        self.failover.abort(job.origin)
        if not job.admitted:
            self.admission.withdraw(job.origin)
        else:
            self.client.abort([job.target_id], common_pb2.FINISH_REASON_ABORT)
        return True

    async def GetModelInfo(
        self, request: gateway_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetModelInfoResponse:
        try:
            info = await self.client.get_info()
        except TargetUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        response = gateway_pb2.GetModelInfoResponse(
            model_id=info.model_id,
            tokenizer_id=str(self.config.tokenizer),
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            eos_token_ids=list(info.eos_token_ids),
            draft_kind=info.draft_kind,
        )
        if self.tokenizer.bos_token_id is not None:
            response.bos_token_id = self.tokenizer.bos_token_id
        return response

    async def GetServerInfo(
        self, request: gateway_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetServerInfoResponse:
        # The target's word, only while its stream is up: never numbers from before an outage.
        status = self.client.status if self.client.connected else None
        info = self.client.info or target_pb2.TargetServiceGetInfoResponse()
        speculation = common_pb2.SpeculationParams(
            enabled=info.draft_kind != common_pb2.DRAFT_KIND_UNSPECIFIED, draft_kind=info.draft_kind
        )
        speculation.MergeFrom(info.speculation)  # S, K, N as configured at the target
        stats = self.client.last_stats
        if stats is not None and stats.HasField("speculation"):
            speculation.MergeFrom(stats.speculation)
        lanes = [
            gateway_pb2.LaneInfo(
                lane_id=lane,
                num_requests=size,
                speculation=speculation,
                accept_length=self.client.lane_accept_length.get(lane, 0.0),
            )
            for lane, size in enumerate(self.lanes.sizes())
        ]
        response = gateway_pb2.GetServerInfoResponse(
            version=__version__,
            speculation=speculation,
            lanes=lanes,
            num_waiting=self.admission.num_waiting,
            uptime_ns=time.monotonic_ns() - self.started_ns,
            target_connected=self.client.connected,
            spec_policy=info.spec_policy,
            max_running=self.admission.max_running,
            max_queue=self.admission.max_queue,
        )
        if status is not None:
            response.verify_steps = status.verify_steps
            response.drafted_steps = status.drafted_steps
            response.steps_without_tree.CopyFrom(status.steps_without_tree)
            response.draft_state = status.draft_state
            response.target_kv_usage.CopyFrom(status.kv_usage)
            response.num_running = status.num_running
            response.num_waiting += status.num_waiting
            if status.HasField("draft_kv_usage"):
                response.draft_kv_usage.CopyFrom(status.draft_kv_usage)
        return response
