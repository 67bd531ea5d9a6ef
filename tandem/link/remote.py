"""``RemoteDrafter``: the `Drafter` interface over a ``Speculate`` stream to the draft service.

The target's engine thread calls ``submit(lane, ...)`` and later ``collect(lane)``, exactly as
it calls an in-process drafter. ``submit`` sends one step for the lane (or hands it to the
client's loop thread) and returns; ``collect`` waits for its answer until the submission's
deadline (``deadline_s`` after it was submitted; docs/design.md section 8). Between the two the
target verifies the other lane, so with two lanes the draft's work hides behind the target's.

- late: ``collect`` returns {} (the engine decodes that lane without speculation) and the answer
  is discarded when it comes. The draft still applied that step's outcomes, so both sides stay
  in step; while a late answer is outstanding, further submissions are sent without waiting
  (their collect returns {} at once, their answers are discarded), so a slow draft costs one
  deadline, not one per step. ``max_backlog`` unanswered steps count as a broken stream.
- broken stream or unreachable draft: every request this client tracked is reported by
  ``take_dropped()``, the state goes UNHEALTHY and the client reconnects in the background
  (exponential backoff with jitter, until ``close()``). Meanwhile ``submit`` sends nothing and
  reports the admits it gets as dropped. New admits speculate again once it is back.

Until the first connection ``target_layer_ids`` are empty and admits carry no features (the
draft drops them), so wait for ``wait_ready()`` before serving.

This class keeps what is the same on every stream: the lanes and their submissions, deadlines,
the state, dropped requests and fallback counting. What differs (the gRPC stream, the local
socket) is its connection's current ``Transport`` (``tandem/link/transport.py``);
``DraftConnection`` (``tandem/link/connection.py``) connects and reconnects.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence

import torch

from tandem.link.chain_remote import RemoteChain
from tandem.link.connection import DraftConnection
from tandem.link.local import LocalLink
from tandem.link.transport import SAFETY_S, Submission, Transport
from tandem.serving.rpc import DEFAULT_MAX_MESSAGE_BYTES
from tandem.serving.security import ClientTLS
from tandem.spec.base import Drafter, DraftState, DraftStatus
from tandem.spec.chain import DraftHalf
from tandem.spec.types import DraftAdmit, Tree, VerifyOutcome
from tandem.v1 import common_pb2, draft_pb2

logger = logging.getLogger(__name__)

INTAKE_TOKENS_PER_DEADLINE = 256  # prompt tokens a step's message takes in per deadline_s
# A step's deadline is at least deadline_s and at least this many times the answer time seen
# lately, up to MAX_DEADLINE_FACTOR times deadline_s: a draft slower than deadline_s at its work
# (trees on a CPU, a large batch) is waited for like an in-process one once one late answer has
# come; a stalled one is still given up on, and reported, after deadline_s.
DEADLINE_FACTOR = 8.0
MAX_DEADLINE_FACTOR = 32.0


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
        device: str | None = None,
    ) -> None:
        if deadline_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("deadline_s/connect_timeout_s: must be > 0")
        self.deadline_s = deadline_s  # per step; may be changed between steps
        self.state = DraftState.CONNECTING  # read from any thread; written through set_state
        self.late_steps = 0  # steps whose answer missed the deadline
        self.fallback_steps = 0  # collects that returned no trees: late, backlogged or down
        self._healthy = threading.Event()
        self._dropped: list[str] = []
        self._dropped_lock = threading.Lock()
        self._lanes: dict[int, Submission] = {}  # engine thread: lane -> uncollected step
        self._sent_at: dict[int, float] = {}  # lane -> when its uncollected step was submitted
        self.answer_s = 0.0  # a moving average of the time from submission to answer
        self._late: tuple[Transport, float] | None = None  # a late step due: (stream, sent at)
        self.connection = DraftConnection(
            address,
            events=self,
            num_target_layers=num_target_layers,
            connect_timeout_s=connect_timeout_s,
            max_message_bytes=max_message_bytes,
            model_id=model_id,
            tls=tls,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            max_backlog=max_backlog,
            local_stream=local_stream,
            device=device,
            deadline_s=lambda: self.deadline_s,
        )
        self.connection.start()

    # -- engine thread ---------------------------------------------------------------------

    def submit(
        self,
        lane: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> None:
        """Sends the step on the current stream, or hands it to the client's loop, and
        returns: the engine thread goes on (launches the next step) meanwhile. Steps go out in
        submission order; ``collect`` and ``in_flight`` see the send."""
        if self.connection.closed:
            raise RuntimeError("RemoteDrafter is closed")
        # A draft takes in new prompts at a rate of its own: their tokens extend the deadline.
        admitted = sum(len(a.token_ids) for a in admits)
        deadline_s = self.step_deadline_s() * (1.0 + admitted / INTAKE_TOKENS_PER_DEADLINE)
        now = time.monotonic()
        deadline = now + deadline_s
        self._sent_at[lane] = now
        transport = self.connection.transport
        self.connection.note_send()
        self._lanes[lane] = transport.send(
            lane, admits, outcomes, released, deadline, int(deadline_s * 1e9)
        )

    def _sent(self, lane: int, step: Submission) -> Submission:
        """``step`` once its message is out (waiting for the send, up to its deadline and a
        safety margin: a send blocked past that decodes without its answer)."""
        if step.sending is None:
            return step
        wait_s = max(0.0, step.deadline - time.monotonic()) + SAFETY_S
        try:
            sent = step.sending.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            logger.warning("draft step still sending after its deadline; decoding without it")
            sent = Submission(step.transport, step.deadline)
        if lane in self._lanes:
            self._lanes[lane] = sent
        return sent

    def collect(self, lane: int) -> dict[str, Tree]:
        step = self._lanes.pop(lane, None)
        if step is None:
            return {}
        step = self._sent(lane, step)
        late_steps = self.late_steps
        answer = step.transport.wait(step)
        sent_at = self._sent_at.pop(lane, None)
        if answer is None:
            self.fallback_steps += 1
            if self.late_steps > late_steps and self._late is None and sent_at is not None:
                self._late = (step.transport, sent_at)  # ``behind`` times its answer
            return {}
        if sent_at is not None:
            took = time.monotonic() - sent_at
            self.answer_s = took if not self.answer_s else 0.8 * self.answer_s + 0.2 * took
        self.model_ns += answer.model_ns
        return answer.trees

    def step_deadline_s(self) -> float:
        """The deadline of a step without prompts: ``deadline_s``, or more for a draft whose
        answers have lately taken longer (see ``DEADLINE_FACTOR``)."""
        learned = min(DEADLINE_FACTOR * self.answer_s, MAX_DEADLINE_FACTOR * self.deadline_s)
        return max(self.deadline_s, learned)

    def behind(self) -> bool:
        if self._late is None:
            return False  # no step went late since the last answer was in: nothing to read
        transport = self.connection.transport
        transport.poll()
        if transport.behind:
            return True
        # The late answer is in: what it took, to within a step, is what the next steps allow
        # (a slow draft is waited for from now on). Not when the stream broke.
        late_transport, sent_at = self._late
        if late_transport is transport:
            self.answer_s = max(self.answer_s, time.monotonic() - sent_at)
        self._late = None
        return False

    def in_flight(self, lane: int) -> bool:
        step = self._lanes.get(lane)
        if step is None:
            return False
        if step.sending is not None:
            if not step.sending.done():
                return True
            step = self._sent(lane, step)
        return step.transport.in_flight(step)

    def wait_sent(self, lane: int) -> None:
        step = self._lanes.get(lane)
        if step is not None:
            self._sent(lane, step)

    def poll(self) -> None:
        self.connection.transport.poll()

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
        return self.connection.transport.shares_prompts

    def chain_link(self, device: torch.device) -> LocalLink | None:
        """The local link, when its hellos chose a transport that shares ``device`` with the
        draft (device-chain runs, ``tandem/link/chain_remote.py``); None otherwise."""
        return self.connection.transport.chain_link(device)

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
        return len(self.connection.transport.stream.tracked)

    def close(self) -> None:
        """Ends the stream (the draft frees this client's requests) and stops the thread."""
        if self.connection.closed:
            return
        self.connection.close()
        self._healthy.clear()

    # -- the connection's facts ------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> bool:
        """Blocks until the stream is up (HEALTHY); False after ``timeout_s``."""
        return self._healthy.wait(timeout_s)

    @property
    def kv_usage(self) -> common_pb2.KvUsage:
        """The draft's pool after its last answer."""
        return self.connection.transport.kv_usage

    @property
    def late_responses(self) -> int:
        """Answers discarded: late, or sent behind a late one (every stream so far)."""
        return self.connection.late_responses

    @property
    def connects(self) -> int:
        """Streams established."""
        return self.connection.connects

    @property
    def local_connects(self) -> int:
        """Streams established on the draft's local socket."""
        return self.connection.local_connects

    @property
    def info(self) -> draft_pb2.DraftServiceGetInfoResponse | None:
        """The draft's GetInfo on the last connection."""
        return self.connection.info

    # -- events from the connection and its transports (any thread) ------------------------

    def set_state(self, state: DraftState) -> None:
        if state is DraftState.HEALTHY and self.connection.stalled:
            return  # the idle probe's verdict stands until the draft answers it
        if state is not self.state:
            logger.info("draft state %s -> %s", self.state.name, state.name)
        self.state = state
        if state is DraftState.HEALTHY:
            self._healthy.set()
        else:
            self._healthy.clear()

    def report_dropped(self, request_ids: list[str]) -> None:
        if request_ids:
            with self._dropped_lock:
                self._dropped.extend(request_ids)

    def step_late(self) -> None:
        self.late_steps += 1
        self.set_state(DraftState.UNHEALTHY)
