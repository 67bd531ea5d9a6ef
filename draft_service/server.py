"""The draft service's gRPC face: ``DraftService`` (``Speculate``, ``GetInfo``) over the
engine, plus health and reflection.

The servicer only converts: proto -> domain (through ``tandem.wire``, which validates), one
engine step, domain -> proto; each stream's protocol state is ``session.py``'s ``StreamSteps``,
and what a stream needs of the service its ``StreamContext`` (``context.py``), which the local
socket's streams share.
A malformed stream ends with INVALID_ARGUMENT; a malformed request inside a good message only
drops that request. When a stream ends, for any reason, every request it admitted is
released.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc

from draft_service.config import DraftServiceConfig
from draft_service.context import StreamContext
from draft_service.engine import DraftEngine, DraftInfo
from draft_service.local import LocalStreams
from draft_service.session import StreamSteps
from tandem import __version__, wire
from tandem.serving import security
from tandem.serving.rpc import (
    Health,
    add_health,
    bind,
    format_address,
    make_server,
    maybe_add_reflection,
)
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServiceServicer(draft_pb2_grpc.DraftServiceServicer):
    """Thin servicer: proto <-> domain around :class:`DraftEngine` steps."""

    def __init__(self, context: StreamContext, config: DraftServiceConfig) -> None:
        self.context = context
        self.engine = context.engine
        self.config = config

    async def _info(self, context: grpc.aio.ServicerContext) -> DraftInfo:
        if self.engine.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the draft model is loading")
        assert self.engine.info is not None
        return self.engine.info

    async def Speculate(
        self,
        request_iterator: AsyncIterator[draft_pb2.SpeculateRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[draft_pb2.SpeculateResponse]:
        info = await self._info(context)
        async for response in self.steps(info, request_iterator, context.peer()):
            yield response

    async def steps(
        self,
        info: DraftInfo,
        request_iterator: AsyncIterator[draft_pb2.SpeculateRequest],
        peer: str,
    ) -> AsyncGenerator[draft_pb2.SpeculateResponse]:
        """One gRPC Speculate stream: a response per request, in order, each step on the
        engine's worker. InvalidRequest ends the stream."""
        stream = StreamSteps(self.context, info, peer)
        try:
            async for request in request_iterator:
                work = stream.begin(request)
                result = await self.engine.step(
                    stream.stream_id, work.admits, work.outcomes, work.released
                )
                yield stream.finish(request, work, result)
        finally:
            stream.close()

    async def GetInfo(
        self, request: draft_pb2.DraftServiceGetInfoRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftServiceGetInfoResponse:
        info = await self._info(context)
        kv = await self.engine.kv_usage()
        return draft_pb2.DraftServiceGetInfoResponse(
            draft_kind=wire.draft_kind_to_proto(info.kind),
            model_id=info.model_id,
            target_model_id=info.target_model_id,
            vocab_size=info.vocab_size,
            target_vocab_size=info.target_vocab_size,
            target_layer_ids=info.target_layer_ids,
            hidden_size=info.hidden_size,
            hidden_dtype=wire.proto_dtype(info.hidden_dtype),
            speculation=wire.spec_to_proto(self.config.max_spec, info.kind),
            kv_usage=common_pb2.KvUsage(
                pages_used=kv.pages_used, pages_total=kv.pages_total, page_size=kv.page_size
            ),
            version=__version__,
            local_socket=self.config.local_socket or "",
            instance_id=self.context.instance_id,
        )


@dataclass
class DraftServer:
    """A started server: listening, NOT_SERVING until :meth:`load` has run."""

    server: grpc.aio.Server
    port: int
    health: Health
    engine: DraftEngine
    config: DraftServiceConfig
    context: StreamContext  # what every stream shares, the gRPC and the local ones
    local: LocalStreams | None = None  # the local socket's server, when configured

    @property
    def address(self) -> str:
        return format_address(self.config.host, self.port)

    async def load(self) -> DraftInfo:
        """Loads and warms up the drafter, then reports SERVING."""
        info = await self.engine.load()
        await self.health.set_serving()
        return info

    async def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, drain open streams for ``grace`` seconds, close the engine."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.grace_s if grace is None else grace)
        await self.close()

    async def close(self) -> None:
        """After the gRPC server has stopped: ends the local streams, closes the engine."""
        if self.local is not None:
            await self.local.stop()
        self.engine.close()


async def start(config: DraftServiceConfig) -> DraftServer:
    """Builds and starts the server (run inside the loop that serves it); the model is not
    loaded yet, so health answers NOT_SERVING and Speculate/GetInfo UNAVAILABLE."""
    server = make_server(max_message_bytes=config.max_message_bytes)
    engine = DraftEngine(config.draft)
    context = StreamContext.create(engine, config)
    servicer = DraftServiceServicer(context, config)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    health = add_health(server, [SERVICE_NAME])
    maybe_add_reflection(server, [SERVICE_NAME], config.reflection)
    credentials = None if config.tls is None else security.server_credentials(config.tls)
    port = bind(server, config.bind_address, credentials)
    await server.start()
    local = None
    if config.local_socket is not None:
        local = LocalStreams(context, config.local_socket)
        try:
            await local.start()
        except BaseException:
            await server.stop(None)
            raise
    started = DraftServer(
        server=server,
        port=port,
        health=health,
        engine=engine,
        config=config,
        context=context,
        local=local,
    )
    logger.info("draft service listening on %s", started.address)
    return started
