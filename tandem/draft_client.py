"""``RemoteDrafter``: the `Drafter` interface over a ``Speculate`` stream to the draft service.

The target's engine thread calls ``submit(lane, ...)`` and later ``collect(lane)``, exactly as
it calls an in-process drafter. Underneath, a background thread runs an asyncio loop that owns
the channel and the stream: ``submit`` sends one SpeculateRequest for the lane and returns;
``collect`` waits for the response with that step_id until the submission's deadline
(``deadline_s`` after it was sent; DESIGN.md section 8). Between the two the target verifies
the other lane, so with two lanes the draft's work hides behind the target's.

- late: ``collect`` returns {} (the engine decodes that lane without speculation) and the answer
  is discarded when it comes. The draft still applied that step's outcomes, so both sides stay
  in step; while a late answer is outstanding, further submissions are sent without waiting
  (their collect returns {} at once, their answers are discarded), so a slow draft costs one
  deadline, not one per step. ``max_backlog`` unanswered steps count as a broken stream.
- broken stream or unreachable draft: every request this client tracked is reported by
  ``take_dropped()``, the state goes UNHEALTHY and a tenacity loop reconnects in the background
  (exponential backoff with jitter, until ``close()``). Meanwhile ``submit`` sends nothing and
  reports the admits it gets as dropped. New admits speculate again once it is back.

Prompt features travel as frames of at most 4 MiB; a request's admit goes out with its first
frame, the rest follow in the next messages when one message (the smaller of both sides'
``max_message_bytes``) cannot hold them. Outcomes for a request whose admit has not gone out
yet are merged into it (an admit of L tokens plus an outcome of k accepted tokens is the
admit of L + k + 1 tokens). The draft applies messages in stream order whatever their lane, so
frames and outcomes may continue in another lane's message.

``target_layer_ids`` come from the draft's GetInfo on the first connection (draft.proto's -1,
the last normed hidden, becomes ``num_target_layers`` in transformers' numbering; without
``num_target_layers`` a draft that needs -1, as EAGLE-1 and MTP do, is refused). Until then
they are empty and admits carry no features (the draft drops them), so wait for
``wait_ready()`` before serving. The layers then stay fixed: a later connection whose draft
needs other layers (or another hidden size) is refused and retried, leaving the state
UNHEALTHY, rather than feeding it features it was not trained on.

Local stream (``tandem.local_stream``): when GetInfo reports a local socket that this host can
open (and the client has no TLS and ``local_stream`` is on), the stream runs there instead,
and the engine thread writes each step and reads its answer itself: ``submit``, ``collect``,
``in_flight`` and ``wait_sent`` work on the ``LocalLink`` directly, and only a step whose
features are still being copied is handed to the client's loop, which sends it once the copy is
done. Deadlines, late answers, the backlog, dropped requests and reconnecting behave as on the
gRPC stream; a link that breaks reconnects through the same loop (local again when it can).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import functools
import logging
import os
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
import torch
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from tandem import transfer, wire
from tandem.draft_stream import Outgoing, StreamState
from tandem.local_stream import Answer, LocalLink, parse_trees
from tandem.security import ClientTLS, open_channel
from tandem.serving import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from tandem.spec.base import Drafter
from tandem.spec.types import DraftAdmit, Tree, VerifyOutcome
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
T = TypeVar("T")
_SPECULATE = "/tandem.v1.DraftService/Speculate"  # the stub's method, with _serialize
_COPY_SPIN_S = 0.0003  # local stream: how long the engine thread looks at a feature copy
_SAFETY_S = 1.0  # beyond the deadline, the engine thread stops waiting even for a blocked send


class DraftState(enum.IntEnum):
    """The draft as this client sees it (values are tandem.v1.DraftState's)."""

    CONNECTING = common_pb2.DRAFT_STATE_CONNECTING  # no stream established yet
    HEALTHY = common_pb2.DRAFT_STATE_HEALTHY  # answering within its deadlines
    UNHEALTHY = common_pb2.DRAFT_STATE_UNHEALTHY  # late, or gone and reconnecting


# Resolved by the reader with the answer (None when the stream broke), on the client's loop:
# the engine thread waits on it directly (one wake-up, none when the answer is already in).
_Waiter = concurrent.futures.Future[Answer | None]
_Sent = tuple[int, _Waiter | None]


@dataclass(frozen=True)
class _Submission:
    """One lane's message on the stream, until its lane collects it."""

    step_id: int
    deadline: float  # time.monotonic() after which the answer is late
    # None when the answer will be discarded (sent behind a late one) or nothing was sent.
    answer: _Waiter | None
    # While the client's loop still builds and writes the message (``submit`` does not wait
    # for it): what ``_send`` returns, (step_id, answer), once it is out.
    sending: concurrent.futures.Future[_Sent] | None = None
    # Sent on a local stream: its answer is read from this link (``answer`` is unused).
    link: LocalLink | None = None
    wanted: bool = True  # local: whether the answer will be used (not behind a late one)


class RemoteDrafter(Drafter):
    """A Drafter whose trees come from a draft service at ``address`` (HOST:PORT)."""

    remote = True  # the exchange paces what it sends per step

    def __init__(
        self,
        address: str,
        *,
        num_target_layers: int | None = None,
        deadline_s: float = 0.5,
        connect_timeout_s: float = 5.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        model_id: str = "",
        tls: ClientTLS | None = None,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        max_backlog: int = 8,
        local_stream: bool = True,
    ) -> None:
        if deadline_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("deadline_s/connect_timeout_s: must be > 0")
        self.address = address
        self.num_target_layers = num_target_layers
        self.deadline_s = deadline_s  # per step; may be changed between steps
        self.connect_timeout_s = connect_timeout_s
        self.max_message_bytes = max_message_bytes
        self.model_id = model_id
        self.tls = tls  # TLS (mTLS with a client certificate) to the draft; None = plain
        self.max_backlog = max_backlog
        # Use the draft's local socket when it reports one this host can open (never with TLS:
        # the socket has file permissions, not certificates).
        self.local_stream = local_stream and tls is None
        self._backoff = wait_exponential_jitter(
            multiplier=backoff_initial_s, max=backoff_max_s, jitter=backoff_initial_s
        )
        # Counters, for metrics and tests.
        self.late_steps = 0  # steps whose answer missed the deadline
        self._late_responses = 0  # gRPC stream: answers discarded
        self.fallback_steps = 0  # collects that returned no trees: late, backlogged or down
        self.connects = 0  # streams established
        self.local_connects = 0  # of which local streams
        self.info: draft_pb2.DraftServiceGetInfoResponse | None = None
        self._kv_usage = common_pb2.KvUsage()
        self._state = DraftState.CONNECTING
        self._healthy = threading.Event()
        self._dropped: list[str] = []
        self._dropped_lock = threading.Lock()
        self._closed = False
        # Loop-thread state: the stream and what the draft tracks for this client.
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connector: asyncio.Task[None] | None = None
        self._order_lock = asyncio.Lock()  # messages built in submission order
        self._write_lock = asyncio.Lock()  # one write at a time on the stream
        self._stream = StreamState(budget=0, frame_bytes=0, hidden_dtype=torch.float32)
        # The local stream, while it is up: set by the loop, used and given up by the engine.
        self._local: LocalLink | None = None
        # Local steps handed to the loop (features still copying); later ones queue behind.
        self._deferred: list[concurrent.futures.Future[_Sent]] = []
        self._waiters: dict[int, _Waiter | None] = {}
        self._discard: set[int] = set()  # unanswered steps whose answers nobody waits for
        self._lanes: dict[int, _Submission | None] = {}  # engine thread: lane -> uncollected
        self._next_step = 1
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="draft-client")
        self._thread.daemon = True
        self._thread.start()
        self._loop.call_soon_threadsafe(self._reconnect)

    # -- engine thread ---------------------------------------------------------------------

    @property
    def state(self) -> DraftState:
        return self._state

    @property
    def kv_usage(self) -> common_pb2.KvUsage:
        """The draft's pool after its last answer."""
        link = self._local
        return link.kv_usage if link is not None else self._kv_usage

    @property
    def late_responses(self) -> int:
        """Answers discarded: late, or sent behind a late one (both streams)."""
        link = self._local
        return self._late_responses + (link.late_responses if link is not None else 0)

    def wait_ready(self, timeout_s: float) -> bool:
        """Blocks until the stream is up (HEALTHY); False after ``timeout_s``."""
        return self._healthy.wait(timeout_s)

    def submit(
        self,
        lane: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> None:
        """Hands the message to the client's loop and returns: the engine thread goes on
        (launches the next step) while the loop serialises the features and writes them.
        Messages go out in submission order; ``collect`` and ``in_flight`` see the send."""
        if self._closed:
            raise RuntimeError("RemoteDrafter is closed")
        deadline = time.monotonic() + self.deadline_s
        link = self._local
        if link is not None:
            self._lanes[lane] = self._submit_local(link, deadline, lane, admits, outcomes, released)
            return
        admits, outcomes, copied = self._features_to_host(admits, outcomes, self._stream)
        sending = self._submit(self._send(lane, admits, outcomes, list(released), copied))
        self._lanes[lane] = _Submission(0, deadline, None, sending)

    def _features_to_host(
        self,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        stream: StreamState,
    ) -> tuple[list[DraftAdmit], list[VerifyOutcome], torch.cuda.Event | None]:
        """The step's features on the host in the draft's dtype, in one copy that the engine
        thread does not wait for (the event marks it done; the client's loop waits)."""
        items: list[DraftAdmit | VerifyOutcome] = [*admits, *outcomes]
        staged = [x for x in items if x.features is not None]
        if not staged:
            return list(admits), list(outcomes), None
        host, copied = transfer.to_host(
            [x.features for x in staged],  # type: ignore[misc]
            stream.hidden_dtype,
        )
        moved = {id(x): replace(x, features=h) for x, h in zip(staged, host, strict=True)}
        new = [moved.get(id(x), x) for x in items]
        return new[: len(admits)], new[len(admits) :], copied  # type: ignore[return-value]

    def _sent(self, lane: int, submission: _Submission) -> _Submission:
        """``submission`` once its message is out (waiting for the send, up to its deadline
        and a safety margin: a send blocked past that decodes without its answer)."""
        if submission.sending is None:
            return submission
        wait_s = max(0.0, submission.deadline - time.monotonic()) + _SAFETY_S
        try:
            step_id, answer = submission.sending.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            logger.warning("draft step still sending after its deadline; decoding without it")
            step_id, answer = 0, None
        wanted = submission.wanted
        if submission.link is not None:  # a local step the loop sent: answer says if wanted
            wanted, answer = answer is not None, None
        sent = _Submission(step_id, submission.deadline, answer, None, submission.link, wanted)
        if lane in self._lanes:
            self._lanes[lane] = sent
        return sent

    def collect(self, lane: int) -> dict[str, Tree]:
        submission = self._lanes.pop(lane, None)
        if submission is None:
            return {}
        submission = self._sent(lane, submission)
        if submission.link is not None:
            return self._collect_local(submission, submission.link)
        if submission.answer is None:
            self.fallback_steps += 1
            return {}
        wait_s = max(0.0, submission.deadline - time.monotonic())
        try:
            answer = submission.answer.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            late = self._submit(self._late(submission.step_id))
            with contextlib.suppress(concurrent.futures.TimeoutError):
                late.result(timeout=_SAFETY_S)  # counted and marked before the engine goes on
            answer = None
        if answer is None:
            self.fallback_steps += 1
            return {}
        self.model_ns += answer.model_ns
        return answer.trees

    # -- engine thread: the local stream ---------------------------------------------------

    def _submit_local(
        self,
        link: LocalLink,
        deadline: float,
        lane: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> _Submission:
        """Sends the step from this thread, or hands it to the loop: while its features are
        still being copied, while an earlier step waits there, and for a step with prompts
        (admits, or prompt frames still to send), whose build and write take the engine thread
        milliseconds at large batches."""
        if link.broken is not None:
            self._local_lost(link)
            self._report_dropped([a.request_id for a in admits])
            return _Submission(0, deadline, None)
        link.drain()  # a late answer that has come in no longer holds this step back
        admits, outcomes, copied = self._features_to_host(admits, outcomes, link.stream)
        self._deferred = [f for f in self._deferred if not f.done()]
        prompts = bool(admits) or bool(link.stream.outbox)
        if not prompts and not self._deferred and (copied is None or _done_soon(copied)):
            deadline_ns = int(self.deadline_s * 1e9)
            step_id, wanted = link.send(lane, admits, outcomes, released, deadline_ns)
            if not step_id:
                self._local_lost(link)
            return _Submission(step_id, deadline, None, link=link, wanted=wanted)
        sending = self._submit(
            self._send_local(link, lane, admits, outcomes, list(released), copied)
        )
        self._deferred.append(sending)
        return _Submission(0, deadline, None, sending, link=link)

    async def _send_local(
        self,
        link: LocalLink,
        lane: int,
        admits: list[DraftAdmit],
        outcomes: list[VerifyOutcome],
        released: list[str],
        copied: torch.cuda.Event | None,
    ) -> _Sent:
        """A deferred local step, on the loop: sent once its copy is done, in order (the
        order lock), as ``_send`` does. The second value only marks (not None) that the
        answer is wanted: the engine thread reads it from the link."""
        async with self._order_lock:
            if copied is not None and not copied.query():
                await self._loop.run_in_executor(None, copied.synchronize)
            step_id, wanted = link.send(
                lane, admits, outcomes, released, int(self.deadline_s * 1e9)
            )
        marker: _Waiter | None = concurrent.futures.Future() if wanted else None
        return step_id, marker

    def _collect_local(self, submission: _Submission, link: LocalLink) -> dict[str, Tree]:
        answer = None
        if submission.step_id and submission.wanted:
            answer = link.wait(submission.step_id, submission.deadline)
            if answer is None and link.broken is None:
                self.late_steps += 1
                link.late(submission.step_id)
                self._set_state(DraftState.UNHEALTHY)
        else:
            link.drain()  # answers nobody waits for still clear the backlog
        if link.broken is not None:
            self._local_lost(link)
        elif not link.backlogged and self._state is DraftState.UNHEALTHY:
            self._set_state(DraftState.HEALTHY)
        if answer is None:
            self.fallback_steps += 1
            return {}
        self.model_ns += answer.model_ns
        return answer.trees

    def poll(self) -> None:
        """Local stream (the gRPC stream's reader needs no help): reads what has arrived, so
        a late answer is discarded, and a closed connection seen, while the engine idles."""
        link = self._local
        if link is None:
            return
        link.drain()
        if link.broken is not None:
            self._local_lost(link)
        elif not link.backlogged and self._state is DraftState.UNHEALTHY:
            self._set_state(DraftState.HEALTHY)

    def _local_lost(self, link: LocalLink) -> None:
        """A broken local link, seen once: its requests are dropped, the loop reconnects."""
        with self._dropped_lock:
            if self._local is not link:
                return
            self._local = None
        logger.warning("local draft stream %s lost (%s); reconnecting", link.path, link.broken)
        self._late_responses += link.late_responses
        self._report_dropped(list(link.stream.tracked))
        self._set_state(DraftState.UNHEALTHY)
        if not self._closed:
            self._loop.call_soon_threadsafe(self._reconnect)

    def wait_sent(self, lane: int) -> None:
        submission = self._lanes.get(lane)
        if submission is not None:
            self._sent(lane, submission)

    def in_flight(self, lane: int) -> bool:
        submission = self._lanes.get(lane)
        if submission is None:
            return False
        if submission.sending is not None:
            if not submission.sending.done():
                return True
            submission = self._sent(lane, submission)
        link = submission.link
        if link is not None:
            if not submission.step_id or not submission.wanted:
                return False
            link.drain()
            return not link.has(submission.step_id) and link.broken is None
        return submission.answer is not None and not submission.answer.done()

    def step(
        self,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> dict[str, Tree]:
        """One lane-0 submission and its answer: a synchronous step."""
        self.submit(0, admits, outcomes, released)
        return self.collect(0)

    def take_dropped(self) -> list[str]:
        with self._dropped_lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def num_tracked(self) -> int:
        link = self._local
        return len((link.stream if link is not None else self._stream).tracked)

    def close(self) -> None:
        """Ends the stream (the draft frees this client's requests) and stops the thread."""
        if self._closed:
            return
        self._closed = True
        self._submit(self._shutdown()).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # -- loop thread: one step -------------------------------------------------------------

    async def _send(
        self,
        lane: int,
        admits: list[DraftAdmit],
        outcomes: list[VerifyOutcome],
        released: list[str],
        copied: torch.cuda.Event | None = None,
    ) -> _Sent:
        """Sends one lane's step once its features are on the host (``copied``); its step_id
        and the future its answer resolves (None when nothing was sent or the answer will be
        discarded)."""
        # Steps are built in submission order, each once its copy is done (a later step
        # without features must not overtake it: a release before its admit, say). Nothing
        # yields between leaving this lock and taking the write lock, so writes keep the order.
        async with self._order_lock:
            # A copy not done yet is waited for on the loop's executor (the reader runs
            # meanwhile): asyncio's epoll sleeps in whole milliseconds, so polling its event
            # every 50 us slept 1 ms a look.
            if copied is not None and not copied.query():
                await self._loop.run_in_executor(None, copied.synchronize)
            call = self._call
            if call is None:
                self._report_dropped([a.request_id for a in admits])
                return 0, None
            request = draft_pb2.SpeculateRequest(
                step_id=self._next_step, lane_id=lane, deadline_ns=int(self.deadline_s * 1e9)
            )
            self._next_step += 1
            message = self._stream.build(request, admits, outcomes, released)
            if len(self._waiters) >= self.max_backlog:
                self._broken(f"{len(self._waiters)} steps unanswered")
                return 0, None
            # Behind a late answer this one is late too (the draft answers in order).
            waiter: _Waiter | None = None if self._discard else concurrent.futures.Future()
            self._waiters[request.step_id] = waiter
            if waiter is None:
                self._discard.add(request.step_id)
        try:
            async with self._write_lock:
                await call.write(message)
        except Exception as exc:
            if call is self._call:
                self._broken(f"send failed: {_describe(exc)}")
            return 0, None
        return request.step_id, waiter

    async def _late(self, step_id: int) -> None:
        """A collect timed out: its answer, if still to come, is discarded when it does."""
        self.late_steps += 1
        if step_id in self._waiters:
            self._discard.add(step_id)
        self._set_state(DraftState.UNHEALTHY)

    # -- loop thread: the stream -----------------------------------------------------------

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
                self._broken(_describe(exc))

    def _on_response(self, response: draft_pb2.SpeculateResponse) -> None:
        dropped = list(response.dropped_request_ids)
        self._stream.forget(dropped)
        self._report_dropped(dropped)
        self._kv_usage = response.kv_usage
        if response.step_id not in self._waiters:
            logger.warning("draft answered unknown step %d", response.step_id)
            return
        waiter = self._waiters.pop(response.step_id)
        late = response.step_id in self._discard
        self._discard.discard(response.step_id)
        if not self._discard and self._state is DraftState.UNHEALTHY:
            self._set_state(DraftState.HEALTHY)  # before the counter: readers poll it
        if late:
            self._late_responses += 1  # its step already gave up: discard the trees
        elif waiter is not None and not waiter.done():
            answer = Answer(parse_trees(response, self._stream.tracked), response.model_ns)
            waiter.set_result(answer)

    def _broken(self, reason: str) -> None:
        """Forgets the stream: every tracked request is dropped; reconnects in the background."""
        logger.warning("draft stream to %s lost (%s); reconnecting", self.address, reason)
        self._report_dropped(list(self._stream.tracked))
        self._stream = StreamState(budget=0, frame_bytes=0, hidden_dtype=torch.float32)
        for waiter in self._waiters.values():
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
        self._discard.clear()
        self._set_state(DraftState.UNHEALTHY)
        self._loop.create_task(self._teardown(self._call, self._channel, self._reader))
        self._call = self._channel = self._reader = None
        self._reconnect()

    def _reconnect(self) -> None:
        if not self._closed:
            self._connector = self._loop.create_task(self._connect_forever())

    async def _connect_forever(self) -> None:
        retrying = AsyncRetrying(
            wait=self._backoff,
            retry=retry_if_exception_type(Exception),
            before_sleep=self._log_retry,
        )
        async for attempt in retrying:
            with attempt:
                await self._connect_once()

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        level = logging.WARNING if state.attempt_number == 1 else logging.DEBUG
        logger.log(level, "draft at %s: %s; retrying", self.address, _describe(exc))

    async def _connect_once(self) -> None:
        channel = open_channel(
            self.address, tls=self.tls, options=channel_options(self.max_message_bytes)
        )
        try:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            info = await stub.GetInfo(
                draft_pb2.DraftServiceGetInfoRequest(), timeout=self.connect_timeout_s
            )
            layer_ids = self._check_info(info)
            link = await self._open_local(info)
            if link is not None:
                await channel.close()
                link.stream = self._stream_state(info, layer_ids, link.hello.max_message_bytes)
                self._local = link  # before HEALTHY: a ready client sends on it
                self.local_connects += 1
                self._up(info, layer_ids)
                logger.info("draft stream to %s up on its local socket %s", self.address, link.path)
                return
            call = channel.stream_stream(
                _SPECULATE,
                request_serializer=_serialize,
                response_deserializer=draft_pb2.SpeculateResponse.FromString,
            )()
            await call.write(draft_pb2.SpeculateRequest(hello=self._hello()))
            first = await asyncio.wait_for(call.read(), self.connect_timeout_s)
            if first is grpc.aio.EOF or first.hello.protocol_version != PROTOCOL_VERSION:
                raise ConnectionError(f"the draft's hello is missing or unsupported: {first}")
        except BaseException:
            await channel.close()
            raise
        self._stream = self._stream_state(info, layer_ids, first.hello.max_message_bytes)
        self._channel, self._call = channel, call
        self._reader = self._loop.create_task(self._read(call))
        self._up(info, layer_ids)
        logger.info("draft stream to %s up (%s)", self.address, info.model_id or "ngram")

    def _stream_state(
        self,
        info: draft_pb2.DraftServiceGetInfoResponse,
        layer_ids: tuple[int, ...],
        peer_max_bytes: int,
    ) -> StreamState:
        """A new stream's state, within both sides' message limits."""
        peer_max = min(peer_max_bytes or self.max_message_bytes, self.max_message_bytes)
        return StreamState(
            budget=peer_max - max(1024, peer_max // 16),
            frame_bytes=min(wire.MAX_FRAME_BYTES, peer_max // 4),
            hidden_dtype=wire.torch_dtype(info.hidden_dtype) if layer_ids else torch.float32,
        )

    def _up(self, info: draft_pb2.DraftServiceGetInfoResponse, layer_ids: tuple[int, ...]) -> None:
        """A stream is up (its state installed): the draft's needs, HEALTHY."""
        self.info = info
        self.target_layer_ids = layer_ids
        self.connects += 1
        self._set_state(DraftState.HEALTHY)

    async def _open_local(self, info: draft_pb2.DraftServiceGetInfoResponse) -> LocalLink | None:
        """The draft's local stream, when it reports a socket this host can open; None (the
        gRPC stream, then) when it does not or the socket fails."""
        path = info.local_socket
        if not (self.local_stream and path and info.instance_id and os.path.exists(path)):
            return None
        hello = self._hello()
        connect = functools.partial(
            LocalLink.connect,
            path,
            hello,
            instance_id=info.instance_id,
            timeout_s=self.connect_timeout_s,
            max_backlog=self.max_backlog,
            on_dropped=self._report_dropped,
        )
        try:
            return await self._loop.run_in_executor(None, connect)
        except (OSError, ConnectionError) as exc:
            logger.warning("draft's local socket %s: %s; using the gRPC stream", path, exc)
            return None

    def _hello(self) -> draft_pb2.SpeculateHello:
        return draft_pb2.SpeculateHello(
            protocol_version=PROTOCOL_VERSION,
            tensor_transports=[draft_pb2.TENSOR_TRANSPORT_INLINE],
            max_message_bytes=self.max_message_bytes,
            model_id=self.model_id,
        )

    def _check_info(self, info: draft_pb2.DraftServiceGetInfoResponse) -> tuple[int, ...]:
        last = self.num_target_layers
        if last is None and -1 in info.target_layer_ids:
            raise ValueError("the draft needs the last hidden (-1): pass num_target_layers")
        layer_ids = tuple(
            last if i == -1 and last is not None else i for i in info.target_layer_ids
        )
        if any(i < 0 or (last is not None and i > last) for i in layer_ids):
            raise ValueError(f"draft asks for target layers {list(layer_ids)}; target has {last}")
        if self.info is not None and (
            layer_ids != self.target_layer_ids or info.hidden_size != self.info.hidden_size
        ):
            raise ConnectionError(
                f"draft now needs layers {list(layer_ids)} x {info.hidden_size}; the engine "
                f"captures {list(self.target_layer_ids)} x {self.info.hidden_size}"
            )
        return layer_ids

    async def _teardown(
        self,
        call: grpc.aio.StreamStreamCall | None,
        channel: grpc.aio.Channel | None,
        reader: asyncio.Task[None] | None,
    ) -> None:
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        if call is not None:
            call.cancel()
        if channel is not None:
            await channel.close()

    async def _shutdown(self) -> None:
        tasks = [t for t in (self._connector, self._reader) if t is not None]
        for task in tasks:
            task.cancel()
        await self._teardown(self._call, self._channel, None)
        await asyncio.gather(*tasks, return_exceptions=True)
        link, self._local = self._local, None
        if link is not None:
            link.close()
        self._call = self._channel = self._reader = None
        self._healthy.clear()

    def _set_state(self, state: DraftState) -> None:
        if state is not self._state:
            logger.info("draft state %s -> %s", self._state.name, state.name)
        self._state = state
        if state is DraftState.HEALTHY:
            self._healthy.set()
        else:
            self._healthy.clear()

    def _report_dropped(self, request_ids: list[str]) -> None:
        if request_ids:
            with self._dropped_lock:
                self._dropped.extend(request_ids)


def _done_soon(copied: torch.cuda.Event) -> bool:
    """Whether a feature copy is done within ``_COPY_SPIN_S``: at bs 1 it is queued on an idle
    stream and takes microseconds, less than a hand-off to the loop; behind another lane's
    forward it is not, and the loop waits for it instead."""
    end = time.perf_counter() + _COPY_SPIN_S
    while not copied.query():
        if time.perf_counter() >= end:
            return False
    return True


def _serialize(message: draft_pb2.SpeculateRequest | Outgoing) -> bytes:
    """The stream's serializer: a hello as it is, a step joined with its prompt frames."""
    return message.SerializeToString()


def _describe(exc: BaseException | None) -> str:
    """One line for a log: gRPC errors as CODE: details."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
