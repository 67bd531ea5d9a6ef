"""The connection side of ``RemoteDrafter`` (``tandem/link/remote.py``): the client's event
loop thread, connecting (GetInfo, then the draft's local socket when it reports one this host
can open, else the gRPC ``Speculate`` stream), the gRPC stream's writes and reads, the state
(CONNECTING, HEALTHY, UNHEALTHY) and reconnecting with tenacity. ``DraftStreams`` holds it;
``RemoteDrafter`` adds the ``Drafter`` interface the engine thread calls.

Thread rule: everything here runs on the client's loop thread, except the state and dropped ids
(read from any thread) and ``_local``, which the loop sets when a local stream is up and the
engine thread takes over from then on (``draft_client.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading

import grpc
import torch
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from tandem import wire
from tandem.link.local import SHARING, Answer, LocalLink, parse_trees
from tandem.link.messages import Outgoing, StreamState
from tandem.serving.rpc import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from tandem.serving.security import ClientTLS, open_channel
from tandem.spec.base import DraftState
from tandem.spec.types import DraftAdmit, VerifyOutcome
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

logger = logging.getLogger(__name__)

_SPECULATE = "/tandem.v1.DraftService/Speculate"  # the stub's method, with _serialize


# Resolved by the reader with the answer (None when the stream broke), on the client's loop:
# the engine thread waits on it directly (one wake-up, none when the answer is already in).
Waiter = concurrent.futures.Future[Answer | None]
Sent = tuple[int, Waiter | None]


class DraftStreams:
    """Connection state and the loop thread of one client of a draft service."""

    def __init__(
        self,
        address: str,
        *,
        num_target_layers: int | None,
        deadline_s: float,
        connect_timeout_s: float,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        model_id: str,
        tls: ClientTLS | None,
        backoff_initial_s: float,
        backoff_max_s: float,
        max_backlog: int,
        local_stream: bool,
        device: str | None = None,
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
        # The target's device: on a local stream whose draft shares a prompt buffer this
        # device can use, prompt features go through it (``LocalLink.share_prompts``).
        self.device = None if device is None else torch.device(device)
        self.target_layer_ids: tuple[int, ...] = ()
        self._backoff = wait_exponential_jitter(
            multiplier=backoff_initial_s, max=backoff_max_s, jitter=backoff_initial_s
        )
        # Counters, for metrics and tests.
        self.late_steps = 0  # steps whose answer missed the deadline
        self._late_responses = 0  # answers discarded (gRPC stream, and local links gone)
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
        self._waiters: dict[int, Waiter | None] = {}
        self._discard: set[int] = set()  # unanswered steps whose answers nobody waits for
        self._next_step = 1
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="draft-client")
        self._thread.daemon = True

    def _start(self) -> None:
        """Starts the loop thread and the first connection (once the subclass is set up)."""
        self._thread.start()
        self._loop.call_soon_threadsafe(self._reconnect)

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

    # -- loop thread: one step on the gRPC stream ------------------------------------------

    async def _send(
        self,
        lane: int,
        admits: list[DraftAdmit],
        outcomes: list[VerifyOutcome],
        released: list[str],
        copied: torch.cuda.Event | None = None,
    ) -> Sent:
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
            waiter: Waiter | None = None if self._discard else concurrent.futures.Future()
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

    # -- loop thread: connecting -----------------------------------------------------------

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
                if self.device is not None and link.share_prompts(self.device):
                    logger.info("prompt features go through the draft's shared buffer")
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
            if first is grpc.aio.EOF or first.hello.protocol_version != wire.PROTOCOL_VERSION:
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
        # On this link only, with the target's device known: the transport that shares it
        # (device-chain runs, the prompt buffer); the draft takes it if its device is the same
        # type.
        sharing = None if self.device is None else SHARING.get(self.device.type)
        if sharing is not None:
            hello.tensor_transports.append(sharing)
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


def _serialize(message: draft_pb2.SpeculateRequest | Outgoing) -> bytes:
    """The stream's serializer: a hello as it is, a step joined with its prompt frames."""
    return message.SerializeToString()


def _describe(exc: BaseException | None) -> str:
    """One line for a log: gRPC errors as CODE: details."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
