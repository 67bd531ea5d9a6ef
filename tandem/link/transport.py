"""The seam between ``RemoteDrafter`` (``tandem/link/remote.py``) and the stream it speaks over.

``Transport`` is one way of reaching the draft service: the gRPC ``Speculate`` stream
(``tandem/link/grpc_transport.py``), the local socket (``tandem/link/local_transport.py``), or
none while the client connects (``Offline``). ``RemoteDrafter`` keeps what is the same on every
stream (lanes, deadlines, the state, dropped requests, fallback counting) and asks the transport
that ``DraftConnection`` (``tandem/link/connection.py``) has up for what differs: sending a step,
waiting for its answer by the deadline and discarding late ones, the backlog, where a step's
features go (to the host, or from the device into the draft's shared buffer), the draft's KV
usage, and the link device-chain runs use.

A transport tells the drafter what it sees through ``Events``; a broken one tells the
connection (its ``lost`` callback), which drops the requests it tracked and reconnects.
``send``, ``wait``, ``in_flight`` and ``poll`` are the engine thread's; a transport may hand a
step to the client's loop thread, whose future is then ``Submission.sending``.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from tandem import transfer
from tandem.link.local import LocalLink
from tandem.link.messages import Answer, StreamState
from tandem.spec.base import DraftState
from tandem.spec.types import DraftAdmit, VerifyOutcome
from tandem.v1 import common_pb2

SAFETY_S = 1.0  # beyond the deadline, the engine thread stops waiting even for a blocked send

# Resolved by the gRPC stream's reader with the answer (None when the stream broke): the engine
# thread waits on it directly (one wake-up, none when the answer is already in).
Waiter = concurrent.futures.Future[Answer | None]


class Events(Protocol):
    """What the streams tell the drafter they serve, from the client's loop or the engine
    thread."""

    state: DraftState  # read on answers; written through set_state
    target_layer_ids: tuple[int, ...]  # what the draft needs, set when a stream comes up

    def set_state(self, state: DraftState) -> None: ...

    def report_dropped(self, request_ids: list[str]) -> None:
        """Requests whose draft state is lost; they are not sent to the draft again."""

    def step_late(self) -> None:
        """A step's answer missed its deadline: counted, and UNHEALTHY until the late answers
        are in."""


@dataclass(frozen=True, slots=True)
class Submission:
    """One lane's step, from ``Transport.send`` until its lane collects it."""

    transport: Transport  # the stream it went out on (a later one may be up by now)
    deadline: float  # time.monotonic() after which the answer is late
    step_id: int = 0  # 0: nothing was sent (or not yet: see ``sending``)
    wanted: bool = False  # whether its answer will be used (not sent behind a late one)
    answer: Waiter | None = None  # gRPC: resolved with the answer (local: read from the link)
    # While the client's loop still builds and writes the message: the step once it is out.
    sending: concurrent.futures.Future[Submission] | None = None


class Transport(ABC):
    """One stream to the draft service as the engine thread uses it. ``stream`` is what it has
    told the draft (the requests it tracks, the prompts still to send)."""

    name = ""  # for logs
    connected = True  # a stream to the draft (Offline: none)

    def __init__(self, stream: StreamState, events: Events) -> None:
        self.stream = stream
        self.events = events

    @property
    @abstractmethod
    def kv_usage(self) -> common_pb2.KvUsage:
        """The draft's pool after its last answer."""

    @property
    @abstractmethod
    def late_responses(self) -> int:
        """Answers this stream discarded: late, or sent behind a late one."""

    @property
    def shares_prompts(self) -> bool:
        """Whether prompts go through a buffer the draft shares on this host."""
        return False

    @abstractmethod
    def send(
        self,
        lane: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
        deadline: float,
        deadline_ns: int,
    ) -> Submission:
        """Sends one lane's step (the draft gives up on it ``deadline_ns`` after receipt), or
        hands it to the client's loop and returns; steps go out in the order they are sent."""

    @abstractmethod
    def wait(self, step: Submission) -> Answer | None:
        """``step``'s answer (sent: no ``sending``), waiting up to its deadline; None when it
        is late (``Events.step_late``: its answer is discarded when it comes), was not wanted
        or not sent, or the stream broke."""

    @abstractmethod
    def in_flight(self, step: Submission) -> bool:
        """Whether ``step`` (sent) is still being answered."""

    def poll(self) -> None:
        """Handles what arrived meanwhile without waiting (late answers, a closed stream)."""
        return None

    @property
    def behind(self) -> bool:
        """Whether an answer that missed its deadline is still to come (after ``poll``)."""
        return False

    def chain_link(self, device: torch.device) -> LocalLink | None:
        """The local link, when its hellos chose a transport that shares ``device`` with the
        draft (device-chain runs, ``tandem/link/chain_remote.py``); None otherwise."""
        return None

    async def close(self) -> None:
        """Ends the stream, on the client's loop (the draft frees its requests)."""
        return None


class Offline(Transport):
    """No stream: connecting, or reconnecting after one broke. A step sends nothing and its
    admits are reported dropped; its collect returns no trees at once."""

    name = "offline"
    connected = False

    def __init__(self, events: Events, kv_usage: common_pb2.KvUsage) -> None:
        super().__init__(StreamState(budget=0, frame_bytes=0, hidden_dtype=torch.float32), events)
        self._kv_usage = kv_usage  # empty: unknown while no stream is up

    @property
    def kv_usage(self) -> common_pb2.KvUsage:
        return self._kv_usage

    @property
    def late_responses(self) -> int:
        return 0

    def send(
        self,
        lane: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
        deadline: float,
        deadline_ns: int,
    ) -> Submission:
        self.events.report_dropped([a.request_id for a in admits])
        return Submission(self, deadline)

    def wait(self, step: Submission) -> Answer | None:
        return None

    def in_flight(self, step: Submission) -> bool:
        return False


def features_to_host(
    admits: Sequence[DraftAdmit], outcomes: Sequence[VerifyOutcome], dtype: torch.dtype
) -> tuple[list[DraftAdmit], list[VerifyOutcome], torch.cuda.Event | None]:
    """The step's features on the host in the draft's ``dtype``, in one copy that the engine
    thread does not wait for (the event marks it done; whoever writes the step waits)."""
    items: list[DraftAdmit | VerifyOutcome] = [*admits, *outcomes]
    staged = [x for x in items if x.features is not None]
    if not staged:
        return list(admits), list(outcomes), None
    host, copied = transfer.to_host([x.features for x in staged], dtype)  # type: ignore[misc]
    moved = {id(x): replace(x, features=h) for x, h in zip(staged, host, strict=True)}
    new = [moved.get(id(x), x) for x in items]
    return new[: len(admits)], new[len(admits) :], copied  # type: ignore[return-value]
