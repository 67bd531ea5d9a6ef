"""The gRPC ``Speculate`` stream as a ``Transport`` (``tandem/link/transport.py``).

The engine thread's ``send`` starts the step's features' copy to the host and hands the step
to the client's loop, which builds and writes it once the copy is done, in submission order; a
reader task on the loop resolves each answer's future, which the engine thread waits on up to
the step's deadline. A step that misses it is marked on the loop, so its answer is discarded
when it comes and later steps, sent behind it, are not waited for (the draft answers in
order). ``max_backlog`` unanswered steps, a failed write or a failed read break the stream:
its waiters see None and the connection (``tandem/link/connection.py``) takes over.

Thread rule: ``send``, ``wait`` and ``in_flight`` run on the engine thread and touch only
futures; everything else runs on the client's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import grpc
import torch

from tandem.link.messages import Answer, StreamState, parse_trees
from tandem.link.transport import SAFETY_S, Events, Submission, Transport, Waiter, features_to_host
from tandem.spec.base import DraftState
from tandem.spec.types import DraftAdmit, VerifyOutcome
from tandem.v1 import common_pb2, draft_pb2

logger = logging.getLogger(__name__)


class GrpcTransport(Transport):
    """One established gRPC stream (hellos exchanged) and its reader."""

    name = "gRPC"

    def __init__(
        self,
        channel: grpc.aio.Channel,
        call: grpc.aio.StreamStreamCall,
        stream: StreamState,
        *,
        events: Events,
        lost: Callable[[Transport, str], None],
        loop: asyncio.AbstractEventLoop,
        max_backlog: int,
        kv_usage: common_pb2.KvUsage,
    ) -> None:
        """Starts the reader; on the client's loop."""
        super().__init__(stream, events)
        self._channel = channel
        self._call: grpc.aio.StreamStreamCall | None = call  # None once given up
        self._lost = lost
        self._loop = loop
        self.max_backlog = max_backlog
        self._kv_usage = kv_usage
        self._late_responses = 0
        self._order_lock = asyncio.Lock()  # messages built in submission order
        self._write_lock = asyncio.Lock()  # one write at a time on the stream
        self._waiters: dict[int, Waiter | None] = {}  # unanswered steps
        self._discard: set[int] = set()  # unanswered steps whose answers nobody waits for
        self._next_step = 1
        self._reader = loop.create_task(self._read(call))

    @property
    def kv_usage(self) -> common_pb2.KvUsage:
        return self._kv_usage

    @property
    def late_responses(self) -> int:
        return self._late_responses

    # -- engine thread ---------------------------------------------------------------------

    def send(
        self,
        lane: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
        deadline: float,
        deadline_ns: int,
    ) -> Submission:
        """Hands the step to the loop and returns: the engine thread goes on (launches the
        next step) while the loop serialises the features and writes them."""
        admits, outcomes, copied = features_to_host(admits, outcomes, self.stream.hidden_dtype)
        step = self._send(lane, admits, outcomes, list(released), copied, deadline, deadline_ns)
        sending = asyncio.run_coroutine_threadsafe(step, self._loop)
        return Submission(self, deadline, sending=sending)

    def wait(self, step: Submission) -> Answer | None:
        if step.answer is None:
            return None
        try:
            return step.answer.result(timeout=max(0.0, step.deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            late = asyncio.run_coroutine_threadsafe(self._late(step.step_id), self._loop)
            with contextlib.suppress(concurrent.futures.TimeoutError):
                late.result(timeout=SAFETY_S)  # counted and marked before the engine goes on
            return None

    def in_flight(self, step: Submission) -> bool:
        return step.answer is not None and not step.answer.done()

    @property
    def behind(self) -> bool:
        return bool(self._discard)  # the loop's set, read whole: a snapshot is enough

    # -- loop thread -----------------------------------------------------------------------

    async def _send(
        self,
        lane: int,
        admits: list[DraftAdmit],
        outcomes: list[VerifyOutcome],
        released: list[str],
        copied: torch.cuda.Event | None,
        deadline: float,
        deadline_ns: int,
    ) -> Submission:
        """Writes one lane's step once its features are on the host (``copied``): the step
        as sent (no step id when nothing was; no answer future when it will be discarded)."""
        # Steps are built in submission order, each once its copy is done (a later step
        # without features must not overtake it: a release before its admit, say). Nothing
        # yields between leaving this lock and taking the write lock, so writes keep the order.
        async with self._order_lock:
            # A copy not done yet is waited for on the loop's executor (the reader runs
            # meanwhile): polling its event from the loop would sleep far longer than the
            # copy takes (asyncio's timeouts are coarse).
            if copied is not None and not copied.query():
                await self._loop.run_in_executor(None, copied.synchronize)
            call = self._call
            if call is None:
                self.events.report_dropped([a.request_id for a in admits])
                return Submission(self, deadline)
            request = draft_pb2.SpeculateRequest(
                step_id=self._next_step, lane_id=lane, deadline_ns=deadline_ns
            )
            self._next_step += 1
            message = self.stream.build(request, admits, outcomes, released)
            if len(self._waiters) >= self.max_backlog:
                self._broken(f"{len(self._waiters)} steps unanswered")
                return Submission(self, deadline)
            # Behind a late answer this one is late too (the draft answers in order).
            waiter: Waiter | None = None if self._discard else concurrent.futures.Future()
            self._waiters[request.step_id] = waiter
            if waiter is None:
                self._discard.add(request.step_id)
        try:
            async with self._write_lock:
                await call.write(message)
        except Exception as exc:
            if call is self._call:
                self._broken(f"send failed: {describe(exc)}")
            return Submission(self, deadline)
        return Submission(self, deadline, request.step_id, waiter is not None, waiter)

    async def _late(self, step_id: int) -> None:
        """A wait timed out: the answer, if still to come, is discarded when it does."""
        if step_id in self._waiters:
            self._discard.add(step_id)
        self.events.step_late()

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise ConnectionError("the draft ended the stream")
                self._on_response(response)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if call is self._call:
                self._broken(describe(exc))

    def _on_response(self, response: draft_pb2.SpeculateResponse) -> None:
        dropped = list(response.dropped_request_ids)
        self.stream.forget(dropped)
        self.events.report_dropped(dropped)
        self._kv_usage = response.kv_usage
        if response.step_id not in self._waiters:
            logger.warning("draft answered unknown step %d", response.step_id)
            return
        waiter = self._waiters.pop(response.step_id)
        late = response.step_id in self._discard
        self._discard.discard(response.step_id)
        if not self._discard and self.events.state is DraftState.UNHEALTHY:
            self.events.set_state(DraftState.HEALTHY)  # before the counter: readers poll it
        if late:
            self._late_responses += 1  # its step already gave up: discard the trees
        elif waiter is not None and not waiter.done():
            answer = Answer(parse_trees(response, self.stream.tracked), response.model_ns)
            waiter.set_result(answer)

    def _broken(self, reason: str) -> None:
        """Gives the stream up: the connection drops its requests and reconnects; every
        waiter sees None."""
        call, self._call = self._call, None
        self._lost(self, reason)
        for waiter in self._waiters.values():
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
        self._discard.clear()
        self._loop.create_task(self._teardown(call))

    async def _teardown(self, call: grpc.aio.StreamStreamCall | None) -> None:
        if self._reader is not asyncio.current_task():
            self._reader.cancel()
        if call is not None:
            call.cancel()
        await self._channel.close()

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is None:
            return  # given up already: torn down by ``_broken``
        await self._teardown(call)
        await asyncio.gather(self._reader, return_exceptions=True)


def describe(exc: BaseException | None) -> str:
    """One line for a log: gRPC errors as CODE: details."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
