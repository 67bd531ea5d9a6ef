"""Thin grpc.aio servicer of the target: proto <-> domain, nothing else."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from tandem import wire
from tandem.errors import InvalidRequest
from tandem.request import FinishReason
from tandem.target.engine import MAX_LANES
from tandem.v1 import target_pb2, target_pb2_grpc
from target_service.engine import Abort, Admit, Detach, Move, Refuse, TargetLoop
from target_service.streams import StreamScope

logger = logging.getLogger(__name__)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, loop: TargetLoop, info: target_pb2.TargetServiceGetInfoResponse) -> None:
        self.loop = loop
        self.info = info
        self._ids = itertools.count(1)
        self._default_max_new = info.max_model_len

    async def Control(
        self,
        request_iterator: AsyncIterator[target_pb2.ControlRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[target_pb2.ControlResponse]:
        stream_id = next(self._ids)
        scope = StreamScope(stream_id)  # its ids are its own
        outbox: asyncio.Queue[target_pb2.ControlResponse] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(message: target_pb2.ControlResponse) -> None:
            event_loop.call_soon_threadsafe(outbox.put_nowait, message)

        self.loop.attach(stream_id, sink)
        reader = asyncio.create_task(self._read(stream_id, scope, request_iterator))
        get: asyncio.Task[target_pb2.ControlResponse] | None = None
        logger.info("gateway stream %d attached", stream_id)
        try:
            while True:
                get = asyncio.create_task(outbox.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    yield scope.outward(get.result())
                    continue
                reader.result()  # re-raise a reader error
                return  # the gateway closed its side
        finally:
            # Also when the stream is cancelled inside the wait: a pending get left behind is
            # destroyed later ("Task was destroyed but it is pending!").
            if get is not None:
                get.cancel()
            reader.cancel()
            self.loop.submit(Detach(stream_id))
            logger.info("gateway stream %d detached", stream_id)

    async def _read(
        self,
        stream_id: int,
        scope: StreamScope,
        requests: AsyncIterator[target_pb2.ControlRequest],
    ) -> None:
        async for request in requests:
            which = request.WhichOneof("command")
            if which == "admit":
                try:
                    command: Admit | Refuse = self._admit(stream_id, scope, request.admit)
                except InvalidRequest as exc:  # that request is refused, not the stream
                    command = Refuse(stream_id, scope.inward(request.admit.request_id), exc)
                self.loop.submit(command)
            elif which == "abort":
                try:
                    reason = wire.finish_reason_from_proto(request.abort.finish_reason)
                except InvalidRequest as exc:  # the requests end, as aborted
                    logger.warning("abort with %s; aborting", exc)
                    reason = None
                self.loop.submit(
                    Abort(scope.inward_all(request.abort.request_ids), reason or FinishReason.ABORT)
                )
            elif which == "lane_assignment":
                move = request.lane_assignment
                if move.lane_id >= MAX_LANES:
                    logger.warning("ignoring a move to lane %d of %d", move.lane_id, MAX_LANES)
                    continue
                self.loop.submit(Move(scope.inward_all(move.request_ids), move.lane_id))
            else:
                logger.debug("ignoring control command %s (not implemented yet)", which)

    def _admit(self, stream_id: int, scope: StreamScope, admit: target_pb2.AdmitCommand) -> Admit:
        if not admit.request_id:
            raise InvalidRequest("admit.request_id", "must not be empty")
        params = wire.sampling_from_proto(
            admit.sampling, default_max_new_tokens=self._default_max_new, field="admit.sampling"
        )
        speculate = not (admit.speculation.HasField("enabled") and not admit.speculation.enabled)
        return Admit(
            stream_id=stream_id,
            request_id=scope.inward(admit.request_id),
            prompt_ids=list(admit.prompt_token_ids),
            params=params,
            speculate=speculate,
            lane=admit.lane_id,
            trace_context=dict(admit.trace_context.carrier),
        )

    async def GetInfo(
        self,
        request: target_pb2.TargetServiceGetInfoRequest,
        context: grpc.aio.ServicerContext,
    ) -> target_pb2.TargetServiceGetInfoResponse:
        info = target_pb2.TargetServiceGetInfoResponse()
        info.CopyFrom(self.info)
        info.status.CopyFrom(self.loop.status())  # "now", as the contract says
        return info
