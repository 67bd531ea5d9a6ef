"""``RemoteDrafter``: the `Drafter` interface over a ``Speculate`` stream to the draft service.

The target's engine thread calls ``submit(lane, ...)`` and later ``collect(lane)``, exactly as
it calls an in-process drafter. Underneath, a background thread runs an asyncio loop that owns
the channel and the stream: ``submit`` sends one SpeculateRequest for the lane and returns;
``collect`` waits for the response with that step_id until the submission's deadline
(``deadline_s`` after it was sent; docs/design.md section 8). Between the two the target verifies
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

Local stream (``tandem.link.local``): when GetInfo reports a local socket that this host can
open (and the client has no TLS and ``local_stream`` is on), the stream runs there instead,
and the engine thread writes each step and reads its answer itself: ``submit``, ``collect``,
``in_flight`` and ``wait_sent`` work on the ``LocalLink`` directly, and only a step whose
features are still being copied is handed to the client's loop, which sends it once the copy is
done. Deadlines, late answers, the backlog, dropped requests and reconnecting behave as on the
gRPC stream; a link that breaks reconnects through the same loop (local again when it can).

The client's loop thread, connecting and the gRPC stream's reads and writes are
``tandem/link/grpc_stream.py`` (``DraftStreams``, the base class); this module is the engine
thread's side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from tandem import transfer
from tandem.link.chain_remote import RemoteChain
from tandem.link.grpc_stream import DraftStreams, Sent, Waiter
from tandem.link.local import LocalLink
from tandem.link.messages import StreamState, shares_outcomes
from tandem.serving.rpc import DEFAULT_MAX_MESSAGE_BYTES
from tandem.serving.security import ClientTLS
from tandem.spec.base import Drafter, DraftState, DraftStatus
from tandem.spec.chain import DraftHalf
from tandem.spec.types import DraftAdmit, Tree, VerifyOutcome

logger = logging.getLogger(__name__)

T = TypeVar("T")
_COPY_SPIN_S = 0.0003  # local stream: how long the engine thread looks at a feature copy
_SAFETY_S = 1.0  # beyond the deadline, the engine thread stops waiting even for a blocked send


@dataclass(frozen=True)
class _Submission:
    """One lane's message on the stream, until its lane collects it."""

    step_id: int
    deadline: float  # time.monotonic() after which the answer is late
    # None when the answer will be discarded (sent behind a late one) or nothing was sent.
    answer: Waiter | None
    # While the client's loop still builds and writes the message (``submit`` does not wait
    # for it): what ``_send`` returns, (step_id, answer), once it is out.
    sending: concurrent.futures.Future[Sent] | None = None
    # Sent on a local stream: its answer is read from this link (``answer`` is unused).
    link: LocalLink | None = None
    wanted: bool = True  # local: whether the answer will be used (not behind a late one)


class RemoteDrafter(DraftStreams, Drafter):
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
        device: str | None = None,
    ) -> None:
        super().__init__(
            address,
            num_target_layers=num_target_layers,
            deadline_s=deadline_s,
            connect_timeout_s=connect_timeout_s,
            max_message_bytes=max_message_bytes,
            model_id=model_id,
            tls=tls,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            max_backlog=max_backlog,
            local_stream=local_stream,
            device=device,
        )
        self.fallback_steps = 0  # collects that returned no trees: late, backlogged or down
        self._lanes: dict[int, _Submission | None] = {}  # engine thread: lane -> uncollected
        # Local steps handed to the loop (features still copying); later ones queue behind.
        self._deferred: list[concurrent.futures.Future[Sent]] = []
        self._start()

    # -- engine thread ---------------------------------------------------------------------

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
        (admits, or prompt frames still to send) or outcome features for the draft's buffer,
        whose build and write take the engine thread milliseconds at large batches (writing
        into the buffer waits for the device)."""
        if link.broken is not None:
            self._local_lost(link)
            self._report_dropped([a.request_id for a in admits])
            return _Submission(0, deadline, None)
        link.drain()  # a late answer that has come in no longer holds this step back
        # With the draft's buffer, prompts go through it from the device, and so do a step's
        # outcome features when there are enough of them (written there on the loop).
        shared = link.ring is not None and shares_outcomes(outcomes)
        copied = None
        if link.ring is None:
            admits, outcomes, copied = self._features_to_host(admits, outcomes, link.stream)
        elif not shared:
            _, outcomes, copied = self._features_to_host([], outcomes, link.stream)
        self._deferred = [f for f in self._deferred if not f.done()]
        prompts = bool(admits) or bool(link.stream.outbox) or shared
        if not prompts and not self._deferred and (copied is None or _done_soon(copied)):
            deadline_ns = int(self.deadline_s * 1e9)
            step_id, wanted = link.send(lane, admits, outcomes, released, deadline_ns)
            if not step_id:
                self._local_lost(link)
            return _Submission(step_id, deadline, None, link=link, wanted=wanted)
        sending = self._submit(
            self._send_local(link, lane, list(admits), list(outcomes), list(released), copied)
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
    ) -> Sent:
        """A deferred local step, on the loop: sent once its copy is done, in order (the
        order lock), as ``_send`` does. The second value only marks (not None) that the
        answer is wanted: the engine thread reads it from the link."""
        async with self._order_lock:
            if copied is not None and not copied.query():
                await self._loop.run_in_executor(None, copied.synchronize)
            step_id, wanted = link.send(
                lane, admits, outcomes, released, int(self.deadline_s * 1e9)
            )
        marker: Waiter | None = concurrent.futures.Future() if wanted else None
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
        self._settle(link)
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
        self._settle(link)

    def _settle(self, link: LocalLink) -> None:
        """After reading from ``link``: a broken one is given up; once no late answer is
        outstanding, the draft is HEALTHY again."""
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

    @property
    def shares_prompts(self) -> bool:  # type: ignore[override]
        link = self._local
        return link is not None and link.ring is not None

    def chain_link(self, device: torch.device) -> LocalLink | None:
        """The local link, when its hellos chose a transport that shares ``device`` with the
        draft (device-chain runs, ``tandem/link/chain_remote.py``); None otherwise."""
        link = self._local
        if link is None or link.broken is not None or not link.shares(device):
            return None
        return link

    def chain_problem(self) -> str:
        return ""  # it says at each run's start whether it takes the run

    def chain_half(self, num_steps: int, device: torch.device) -> DraftHalf:
        return RemoteChain(
            num_steps,
            device,
            chain_link=lambda: self.chain_link(device),
            deadline_s=self.deadline_s,
        )

    def status(self) -> DraftStatus:
        kv = self.kv_usage
        return DraftStatus(
            state=self.state,
            kv_pages_total=kv.pages_total,
            kv_pages_used=kv.pages_used,
            kv_page_size=kv.page_size,
            fallback_steps=self.fallback_steps,
        )

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


def _done_soon(copied: torch.cuda.Event) -> bool:
    """Whether a feature copy is done within ``_COPY_SPIN_S``: at bs 1 it is queued on an idle
    stream and takes microseconds, less than a hand-off to the loop; behind another lane's
    forward it is not, and the loop waits for it instead."""
    end = time.perf_counter() + _COPY_SPIN_S
    while not copied.query():
        if time.perf_counter() >= end:
            return False
    return True
