"""Notices a stalled draft while no step goes out (docs/design.md section 8, "Draft deadline").

Under traffic the step deadline decides: an answer that misses it turns the state UNHEALTHY
(``RemoteDrafter.step_late``) until the late answers are in. An idle target sends no steps, so
a draft that stalls then (a stopped process, a wedged host) would look HEALTHY for ever, and the
first request after it would pay a deadline per lane to find out. So while the stream is up and
no step went out for a deadline, ``IdleProbe`` calls the draft's ``GetInfo`` with the step
deadline as its timeout: a missed answer turns the state UNHEALTHY, and keeps it so (``stalled``:
an idle local stream, finding no late answer outstanding, would call the draft healthy again)
until an answer, a step going out or a new stream says otherwise; the next answer turns it back
to HEALTHY (only what the probe itself declared: a late step's state is the stream's to clear).
A broken stream is the connection's business (``tandem/link/connection.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from tandem.link.transport import Events
from tandem.serving.rpc import channel_options
from tandem.serving.security import ClientTLS, open_channel
from tandem.spec.base import DraftState
from tandem.v1 import draft_pb2, draft_pb2_grpc

logger = logging.getLogger(__name__)

_PROBE_MESSAGE_BYTES = 1 << 20  # a GetInfo answer is a few hundred bytes
MIN_PERIOD_S = 0.1


class IdleProbe:
    """Probes the draft at ``address`` every deadline while the stream is idle; runs on the
    draft client's loop (``run``) until cancelled."""

    def __init__(
        self,
        address: str,
        *,
        events: Events,
        deadline_s: Callable[[], float],
        stream_up: Callable[[], bool],
        tls: ClientTLS | None,
    ) -> None:
        self.address = address
        self._events = events
        self._deadline_s = deadline_s  # the drafter's current step deadline
        self._stream_up = stream_up
        self._tls = tls
        self.last_send = time.monotonic()  # when a step last went out (engine thread writes)
        self.stalled = False  # the probe declared the draft UNHEALTHY
        self.misses = 0  # probes the draft did not answer in time, so far

    async def run(self) -> None:
        channel = open_channel(
            self.address, tls=self._tls, options=channel_options(_PROBE_MESSAGE_BYTES)
        )
        try:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            while True:
                period = max(MIN_PERIOD_S, self._deadline_s())
                await asyncio.sleep(period)
                if time.monotonic() - self.last_send < period or not self._stream_up():
                    self.stalled = False  # steps (or the connection) decide meanwhile
                    continue
                await self._probe(stub, period)
        finally:
            await channel.close()

    async def _probe(self, stub: draft_pb2_grpc.DraftServiceStub, timeout_s: float) -> None:
        try:
            await stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                return  # gone rather than stalled: the stream breaks and says so
            self.misses += 1
            if self._events.state is DraftState.HEALTHY:
                logger.warning("draft at %s did not answer within %.2f s", self.address, timeout_s)
                self.stalled = True
                self._events.set_state(DraftState.UNHEALTHY)
            return
        if self.stalled:
            self.stalled = False  # first: while it holds, nothing turns the state HEALTHY
            if self._events.state is DraftState.UNHEALTHY and self._stream_up():
                logger.info("draft at %s answers again", self.address)
                self._events.set_state(DraftState.HEALTHY)
