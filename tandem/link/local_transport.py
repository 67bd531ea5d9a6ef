"""The local socket (``tandem/link/local.py``) as a ``Transport`` (``tandem/link/transport.py``).

The engine thread writes each step on the ``LocalLink`` and reads its answer itself, with no
hop to the client's loop. A step goes to the loop instead (which sends it once its features are
on the host, in order: later steps queue behind it) while its features are still being copied,
while an earlier step waits there, and when it carries prompts (admits, or prompt frames still
to send) or outcome features for the draft's shared buffer: building and writing those holds
the engine thread long at large batches (writing into the buffer waits for the device).

With the draft's prompt buffer mapped (``LocalLink.share_prompts``), prompt features go
through it from the device, and so do a step's outcome features when there are enough of them
(``tandem.link.messages.shares_outcomes``); otherwise they are copied to the host first. A
link found broken (reading or sending) is reported to the connection once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Sequence

import torch

from tandem.link.local import LocalLink
from tandem.link.messages import Answer, shares_outcomes
from tandem.link.transport import Events, Submission, Transport, features_to_host
from tandem.spec.base import DraftState
from tandem.spec.types import DraftAdmit, VerifyOutcome
from tandem.v1 import common_pb2

_COPY_SPIN_S = 0.0003  # how long the engine thread looks at a feature copy before deferring


class LocalTransport(Transport):
    """One established local stream (``link``, hellos exchanged)."""

    def __init__(
        self,
        link: LocalLink,
        *,
        events: Events,
        lost: Callable[[Transport, str], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(link.stream, events)
        self.link = link
        self.name = f"local socket {link.path}"
        self._lost = lost
        self._loop = loop
        self._order_lock = asyncio.Lock()  # deferred steps go out in submission order
        self._deferred: list[concurrent.futures.Future[Submission]] = []  # on the loop

    @property
    def kv_usage(self) -> common_pb2.KvUsage:
        return self.link.kv_usage

    @property
    def late_responses(self) -> int:
        return self.link.late_responses

    @property
    def shares_prompts(self) -> bool:
        return self.link.ring is not None

    def send(
        self,
        lane: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
        deadline: float,
        deadline_ns: int,
    ) -> Submission:
        """Sends the step from this thread, or hands it to the loop (module docstring)."""
        link = self.link
        if link.broken is not None:
            self._lost(self, link.broken)
            self.events.report_dropped([a.request_id for a in admits])
            return Submission(self, deadline)
        link.drain()  # a late answer that has come in no longer holds this step back
        shared = link.ring is not None and shares_outcomes(outcomes)
        copied = None
        if link.ring is None:
            admits, outcomes, copied = features_to_host(admits, outcomes, link.stream.hidden_dtype)
        elif not shared:
            _, outcomes, copied = features_to_host([], outcomes, link.stream.hidden_dtype)
        self._deferred = [f for f in self._deferred if not f.done()]
        prompts = bool(admits) or bool(link.stream.outbox) or shared
        if not prompts and not self._deferred and (copied is None or _done_soon(copied)):
            step_id, wanted = link.send(lane, admits, outcomes, released, deadline_ns)
            if not step_id:
                self._lost(self, link.broken or "send failed")
            return Submission(self, deadline, step_id, wanted)
        step = self._send_later(
            lane, list(admits), list(outcomes), list(released), copied, deadline, deadline_ns
        )
        sending = asyncio.run_coroutine_threadsafe(step, self._loop)
        self._deferred.append(sending)
        return Submission(self, deadline, sending=sending)

    async def _send_later(
        self,
        lane: int,
        admits: list[DraftAdmit],
        outcomes: list[VerifyOutcome],
        released: list[str],
        copied: torch.cuda.Event | None,
        deadline: float,
        deadline_ns: int,
    ) -> Submission:
        """A deferred step, on the loop: sent once its copy is done, in order (the engine
        thread reads its answer from the link)."""
        async with self._order_lock:
            if copied is not None and not copied.query():
                await self._loop.run_in_executor(None, copied.synchronize)
            step_id, wanted = self.link.send(lane, admits, outcomes, released, deadline_ns)
        return Submission(self, deadline, step_id, wanted)

    def wait(self, step: Submission) -> Answer | None:
        link = self.link
        answer = None
        if step.step_id and step.wanted:
            answer = link.wait(step.step_id, step.deadline)
            if answer is None and link.broken is None:
                link.late(step.step_id)
                self.events.step_late()
        else:
            link.drain()  # answers nobody waits for still clear the backlog
        self._settle()
        return answer

    def in_flight(self, step: Submission) -> bool:
        if not step.step_id or not step.wanted:
            return False
        self.link.drain()
        return not self.link.has(step.step_id) and self.link.broken is None

    def poll(self) -> None:
        """Reads what has arrived, so a late answer is discarded, and a closed connection
        seen, while the engine idles (the gRPC stream's reader needs no such help)."""
        self.link.drain()
        self._settle()

    @property
    def behind(self) -> bool:
        return self.link.backlogged

    def _settle(self) -> None:
        """After reading: a broken link is given up; once no late answer is outstanding, the
        draft is HEALTHY again."""
        link = self.link
        if link.broken is not None:
            self._lost(self, link.broken)
        elif not link.backlogged and self.events.state is DraftState.UNHEALTHY:
            self.events.set_state(DraftState.HEALTHY)

    def chain_link(self, device: torch.device) -> LocalLink | None:
        link = self.link
        if link.broken is not None or not link.shares(device):
            return None
        return link

    async def close(self) -> None:
        self.link.close()


def _done_soon(copied: torch.cuda.Event) -> bool:
    """Whether a feature copy is done within ``_COPY_SPIN_S``: a small step's copy queued on an
    idle stream is done sooner than a hand-off to the loop would take; behind another lane's
    forward it is not, and the loop waits for it instead."""
    end = time.perf_counter() + _COPY_SPIN_S
    while not copied.query():
        if time.perf_counter() >= end:
            return False
    return True
