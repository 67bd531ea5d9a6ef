"""Keeps a ``RemoteDrafter``'s stream to its draft service up and hands out its ``transport``.

``DraftConnection`` owns the client's event-loop thread. It connects for ever, with tenacity's
exponential backoff and jitter until ``close()``: GetInfo first (the target layers the draft
needs, checked against what the engine captures), then the draft's local socket when GetInfo
reports one this host can open (never with TLS: the socket has file permissions, not
certificates), else the gRPC ``Speculate`` stream and its hellos. The stream that comes up
becomes ``transport`` (before the state goes HEALTHY: a ready client sends on it); until then,
and after a stream breaks, ``transport`` is ``Offline``. A transport that breaks calls
``lost``, from whichever thread saw it: its requests are reported dropped, the state goes
UNHEALTHY and the loop connects again (local again when it can).

``target_layer_ids`` come from the draft's GetInfo on the first connection (draft.proto's -1,
the last normed hidden, becomes ``num_target_layers`` in transformers' numbering; without
``num_target_layers`` a draft that needs -1, as EAGLE-1 and MTP do, is refused). The layers then
stay fixed: a later connection whose draft needs other layers (or another hidden size) is
refused and retried, leaving the state UNHEALTHY, rather than feeding it features it was not
trained on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable

import grpc
import torch
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from tandem import wire
from tandem.link.grpc_transport import GrpcTransport, describe
from tandem.link.liveness import IdleProbe
from tandem.link.local import SHARING, LocalLink, device_uuid
from tandem.link.local_transport import LocalTransport
from tandem.link.messages import Outgoing, StreamState
from tandem.link.transport import Events, Offline, Transport
from tandem.serving.rpc import channel_options
from tandem.serving.security import ClientTLS, open_channel
from tandem.spec.base import DraftState
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

logger = logging.getLogger(__name__)

_SPECULATE = "/tandem.v1.DraftService/Speculate"  # the stub's method, with _serialize


class DraftConnection:
    """The connection of one client of a draft service (module docstring)."""

    def __init__(
        self,
        address: str,
        *,
        events: Events,
        num_target_layers: int | None,
        connect_timeout_s: float,
        max_message_bytes: int,
        model_id: str,
        tls: ClientTLS | None,
        backoff_initial_s: float,
        backoff_max_s: float,
        max_backlog: int,
        local_stream: bool,
        device: str | None,
        deadline_s: Callable[[], float],
    ) -> None:
        self.address = address
        self.num_target_layers = num_target_layers
        self.connect_timeout_s = connect_timeout_s
        self.max_message_bytes = max_message_bytes
        self.model_id = model_id
        self.tls = tls  # TLS (mTLS with a client certificate) to the draft; None = plain
        self.max_backlog = max_backlog
        self.local_stream = local_stream and tls is None
        # The target's device: on a local stream whose draft shares a prompt buffer this
        # device can use, prompt features go through it (``LocalLink.share_prompts``).
        self.device = None if device is None else torch.device(device)
        self._events = events
        self._backoff = wait_exponential_jitter(
            multiplier=backoff_initial_s, max=backoff_max_s, jitter=backoff_initial_s
        )
        self.transport: Transport = Offline(events, common_pb2.KvUsage())
        self.info: draft_pb2.DraftServiceGetInfoResponse | None = None
        self.connects = 0  # streams established
        self.local_connects = 0  # of which local streams
        self.closed = False
        self._late_before = 0  # answers the streams given up had discarded
        self._swap = threading.Lock()  # ``transport`` changes: a broken one is given up once
        self._connector: asyncio.Task[None] | None = None
        self.probe = IdleProbe(
            address,
            events=events,
            deadline_s=deadline_s,
            stream_up=lambda: self.transport.connected,
            tls=tls,
        )
        self._probing: asyncio.Task[None] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="draft-client")
        self._thread.daemon = True

    def start(self) -> None:
        """Starts the loop thread and the first connection."""
        self._thread.start()
        self._loop.call_soon_threadsafe(self._reconnect)
        self._loop.call_soon_threadsafe(self._start_probe)

    def note_send(self) -> None:
        """A step went out (engine thread): the stream is not idle, its deadline watches it."""
        self.probe.last_send = time.monotonic()
        self.probe.stalled = False

    @property
    def stalled(self) -> bool:
        """The idle probe found the draft stalled and has had no answer since."""
        return self.probe.stalled

    @property
    def late_responses(self) -> int:
        """Answers discarded: late, or sent behind a late one (every stream so far)."""
        return self._late_before + self.transport.late_responses

    def lost(self, transport: Transport, reason: str) -> None:
        """``transport`` broke (any thread; after the first call for it, nothing): its
        requests are dropped, the state goes UNHEALTHY, the loop reconnects."""
        with self._swap:
            if self.transport is not transport:
                return
            # The draft's pool is unknown until it answers again (it may come back empty).
            self.transport = Offline(self._events, common_pb2.KvUsage())
            self._late_before += transport.late_responses
        logger.warning(
            "draft stream to %s (%s) lost (%s); reconnecting", self.address, transport.name, reason
        )
        self._events.report_dropped(list(transport.stream.tracked))
        self._events.set_state(DraftState.UNHEALTHY)
        if not self.closed:
            self._loop.call_soon_threadsafe(self._reconnect)

    def close(self) -> None:
        """Ends the stream (the draft frees this client's requests) and stops the thread."""
        if self.closed:
            return
        self.closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    # -- loop thread -----------------------------------------------------------------------

    def _start_probe(self) -> None:
        if not self.closed:
            self._probing = self._loop.create_task(self.probe.run())

    def _reconnect(self) -> None:
        if not self.closed:
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
        logger.log(level, "draft at %s: %s; retrying", self.address, describe(exc))

    async def _connect_once(self) -> None:
        channel = open_channel(
            self.address, tls=self.tls, options=channel_options(self.max_message_bytes)
        )
        try:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            info = await stub.GetInfo(
                draft_pb2.DraftServiceGetInfoRequest(), timeout=self.connect_timeout_s
            )
            kv_usage = info.kv_usage  # the draft's pool now, until its first answer
            layer_ids = self._check_info(info)
            link = await self._open_local(info)
            if link is not None:
                await channel.close()
                link.stream = self._stream_state(info, layer_ids, link.hello.max_message_bytes)
                link.kv_usage = kv_usage
                if self.device is not None and link.share_prompts(self.device):
                    logger.info("prompt features go through the draft's shared buffer")
                self.local_connects += 1
                local = LocalTransport(link, events=self._events, lost=self.lost, loop=self._loop)
                self._up(local, info, layer_ids)
                logger.info("draft stream to %s up on its local socket %s", self.address, link.path)
                return
            call = channel.stream_stream(
                _SPECULATE,
                request_serializer=_serialize,
                response_deserializer=draft_pb2.SpeculateResponse.FromString,
            )()
            await call.write(draft_pb2.SpeculateRequest(hello=self._hello()))
            first = await asyncio.wait_for(call.read(), self.connect_timeout_s)
            if first is grpc.aio.EOF or first.hello.protocol_version != wire.PROTOCOL_VERSION:
                raise ConnectionError(f"the draft's hello is missing or unsupported: {first}")
        except BaseException:
            await channel.close()
            raise
        transport = GrpcTransport(
            channel,
            call,
            self._stream_state(info, layer_ids, first.hello.max_message_bytes),
            events=self._events,
            lost=self.lost,
            loop=self._loop,
            max_backlog=self.max_backlog,
            kv_usage=kv_usage,
        )
        self._up(transport, info, layer_ids)
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

    def _up(
        self,
        transport: Transport,
        info: draft_pb2.DraftServiceGetInfoResponse,
        layer_ids: tuple[int, ...],
    ) -> None:
        """A stream is up: the draft's needs, the transport, HEALTHY."""
        self.info = info
        self._events.target_layer_ids = layer_ids
        with self._swap:
            self.transport = transport
        self.connects += 1
        self.probe.stalled = False  # a new stream answered its hellos
        self._events.set_state(DraftState.HEALTHY)

    async def _open_local(self, info: draft_pb2.DraftServiceGetInfoResponse) -> LocalLink | None:
        """The draft's local stream, when it reports a socket this host can open; None (the
        gRPC stream, then) when it does not or the socket fails."""
        path = info.local_socket
        if not (self.local_stream and path and info.instance_id and os.path.exists(path)):
            return None
        hello = self._hello()
        # On this link only, with the target's device known: the transport that shares it
        # (device-chain runs, the prompt buffer); the draft takes it if its device is the same
        # (for CUDA: the same GPU, by UUID).
        sharing = None if self.device is None else SHARING.get(self.device.type)
        if sharing is not None:
            assert self.device is not None
            hello.tensor_transports.append(sharing)
            hello.device_uuid = device_uuid(self.device)
        connect = functools.partial(
            LocalLink.connect,
            path,
            hello,
            instance_id=info.instance_id,
            timeout_s=self.connect_timeout_s,
            max_backlog=self.max_backlog,
            on_dropped=self._events.report_dropped,
        )
        try:
            return await self._loop.run_in_executor(None, connect)
        except (OSError, ConnectionError) as exc:
            logger.warning("draft's local socket %s: %s; using the gRPC stream", path, exc)
            return None

    def _hello(self) -> draft_pb2.SpeculateHello:
        return draft_pb2.SpeculateHello(
            protocol_version=wire.PROTOCOL_VERSION,
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
        known = self._events.target_layer_ids
        if self.info is not None and (
            layer_ids != known or info.hidden_size != self.info.hidden_size
        ):
            raise ConnectionError(
                f"draft now needs layers {list(layer_ids)} x {info.hidden_size}; the engine "
                f"captures {list(known)} x {self.info.hidden_size}"
            )
        return layer_ids

    async def _shutdown(self) -> None:
        connector = self._connector
        if connector is not None:
            connector.cancel()
        if self._probing is not None:
            self._probing.cancel()
            await asyncio.gather(self._probing, return_exceptions=True)
        with self._swap:
            transport = self.transport
            self.transport = Offline(self._events, common_pb2.KvUsage())
            self._late_before += transport.late_responses
        await transport.close()
        if connector is not None:
            await asyncio.gather(connector, return_exceptions=True)


def _serialize(message: draft_pb2.SpeculateRequest | Outgoing) -> bytes:
    """The stream's serializer: a hello as it is, a step joined with its prompt frames."""
    return message.SerializeToString()
