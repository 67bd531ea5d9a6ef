"""The gateway's side of `TargetService.Control`: one long-lived stream, many requests.

`TargetClient` opens the stream at start and keeps it open: it reconnects with exponential
backoff (tenacity) whenever the target is gone, and reports each change of connection to a
callback (the gateway's health). Commands go out through a queue, so `admit` and `abort` never
block and can be called from a cancelled task. Commits come back on the same stream and are
routed to one asyncio queue per request; when the stream breaks, every request in flight gets
`TargetUnavailable` at once (docs/design.md section 8: no hang), and the target, seeing the stream
end, aborts them and frees their pages. The servicer then carries them over to the target that
comes back (`gateway/failover.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from tandem.errors import TandemError
from tandem.serving import rpc
from tandem.serving.security import ClientTLS, open_channel
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)

# Keep the channel's own reconnect backoff short, so that the tenacity backoff below decides
# how soon the gateway notices a target that came back (the C-core default grows to 120 s).
_RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
_MIN_RECONNECT_S = 0.05
_ACCEPT_LENGTH_DECAY = 0.9  # weight of the past in the accept-length moving average


class TargetUnavailable(TandemError):
    """The target is not connected, or the control stream broke (UNAVAILABLE)."""


CommitOrError = target_pb2.Commit | TargetUnavailable


@dataclass
class RequestStream:
    """One admitted request's view of the control stream: its commits, in order, ending with
    the commit that carries a finish reason, or with TargetUnavailable."""

    request_id: str
    commits: asyncio.Queue[CommitOrError] = field(default_factory=asyncio.Queue)

    async def next(self) -> target_pb2.Commit:
        item = await self.commits.get()
        if isinstance(item, TargetUnavailable):
            raise item
        return item


class TargetClient:
    """The control stream to one target, with reconnection; one per gateway."""

    def __init__(
        self,
        address: str,
        *,
        on_connection_change: Callable[[bool], Awaitable[None]] | None = None,
        rpc_timeout_s: float = 5.0,
        backoff_max_s: float = 2.0,
        max_message_bytes: int = rpc.DEFAULT_MAX_MESSAGE_BYTES,
        tls: ClientTLS | None = None,
    ) -> None:
        self.address = address
        self.tls = tls  # TLS (mTLS with a client certificate) to the target; None = plain
        self._on_connection_change = on_connection_change
        self._rpc_timeout_s = rpc_timeout_s
        self._backoff_max_s = backoff_max_s
        self._max_message_bytes = max_message_bytes
        self._channel: grpc.aio.Channel | None = None
        self._stub: target_pb2_grpc.TargetServiceStub | None = None
        self._task: asyncio.Task[None] | None = None
        self._outbox: asyncio.Queue[target_pb2.ControlRequest] | None = None
        self._streams: dict[str, RequestStream] = {}
        self._connected = asyncio.Event()
        # The latest word from the target, for GetModelInfo / GetServerInfo.
        self.info: target_pb2.TargetServiceGetInfoResponse | None = None
        self.status: target_pb2.TargetStatus | None = None
        self.last_stats: target_pb2.StepStats | None = None
        self.accept_length = 0.0  # moving average of committed tokens per request and step
        self.lane_accept_length: dict[int, float] = {}  # the same, per lane
        self.num_connects = 0  # control streams opened so far (1 + reconnections)
        self._lost: tuple[float, str] | None = None  # when and why the last stream broke

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def lost(self) -> str:
        """Why the target is not connected, for an UNAVAILABLE's message."""
        if self._lost is None:
            return f"target {self.address} is not connected"
        at, reason = self._lost
        ago = time.monotonic() - at
        return f"target {self.address} is not connected (lost {ago:.1f} s ago: {reason})"

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        """Starts connecting in the background; returns at once."""
        if self._task is not None:
            raise RuntimeError("TargetClient already started")
        options = [*rpc.channel_options(self._max_message_bytes), *_RECONNECT_OPTIONS]
        self._channel = open_channel(self.address, tls=self.tls, options=options)
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)
        self._task = asyncio.create_task(self._run(), name="target-control")

    async def wait_connected(self, timeout_s: float | None = None) -> None:
        await asyncio.wait_for(self._connected.wait(), timeout_s)

    async def close(self) -> None:
        """Closes the stream (the target aborts what ran on it) and fails what is in flight."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._fail_all(TargetUnavailable("gateway is shutting down"))
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def admit(self, admit: target_pb2.AdmitCommand) -> RequestStream:
        """Sends an admit; the returned stream yields the request's commits."""
        if self._outbox is None or not self.connected:
            raise TargetUnavailable(self.lost)
        if admit.request_id in self._streams:
            raise ValueError(f"request {admit.request_id!r} is already in flight")
        stream = RequestStream(admit.request_id)
        self._streams[admit.request_id] = stream
        self._outbox.put_nowait(target_pb2.ControlRequest(admit=admit))
        return stream

    def abort(self, request_ids: Iterable[str], finish_reason: common_pb2.FinishReason) -> None:
        """Asks the target to finish requests with `finish_reason` (ABORT, or STOP for a stop
        string); their final commits follow. A no-op while disconnected: the target already
        aborted everything of the broken stream."""
        ids = [rid for rid in request_ids if rid in self._streams]
        if not ids or self._outbox is None:
            return
        abort = target_pb2.AbortCommand(request_ids=ids, finish_reason=finish_reason)
        self._outbox.put_nowait(target_pb2.ControlRequest(abort=abort))

    def assign(self, request_ids: Iterable[str], lane: int) -> None:
        """Moves running requests to ``lane`` from their next step (a no-op while
        disconnected)."""
        ids = [rid for rid in request_ids if rid in self._streams]
        if not ids or self._outbox is None:
            return
        move = target_pb2.LaneAssignment(request_ids=ids, lane_id=lane)
        self._outbox.put_nowait(target_pb2.ControlRequest(lane_assignment=move))

    def forget(self, request_id: str) -> None:
        """Stops routing commits to a request that the gateway has finished with."""
        self._streams.pop(request_id, None)

    async def get_info(self) -> target_pb2.TargetServiceGetInfoResponse:
        """A fresh TargetService.GetInfo; TargetUnavailable if the target does not answer."""
        if self._stub is None:
            raise TargetUnavailable("target client not started")
        try:
            info: target_pb2.TargetServiceGetInfoResponse = await self._stub.GetInfo(
                target_pb2.TargetServiceGetInfoRequest(), timeout=self._rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise TargetUnavailable(f"target GetInfo failed: {_describe(exc)}") from exc
        self.info = info
        if info.HasField("status"):
            self.status = info.status
        return info

    async def _run(self) -> None:
        while True:
            call = await self._connect()
            self._connected.set()
            self.num_connects += 1
            await self._notify(True)
            try:
                async for response in call:
                    self._dispatch(response)
                reason = "target closed the control stream"
            except grpc.aio.AioRpcError as exc:
                reason = f"control stream broke: {_describe(exc)}"
            except Exception as exc:  # a bug here must not strand the gateway without a target
                logger.exception("control stream to %s failed", self.address)
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                self._connected.clear()
                self._outbox = None
                call.cancel()
                self.status = self.last_stats = None  # unknown until the target speaks again
            logger.warning("target %s lost: %s; reconnecting", self.address, reason)
            self._lost = (time.monotonic(), reason)
            self._fail_all(TargetUnavailable(f"target {self.address} unavailable: {reason}"))
            await self._notify(False)
            # A target that answers GetInfo but drops Control at once must not make a hot loop.
            await asyncio.sleep(_MIN_RECONNECT_S)

    async def _connect(self) -> grpc.aio.StreamStreamCall:
        """GetInfo until the target answers (backing off), then opens the control stream."""

        def log_retry(state: RetryCallState) -> None:
            # A target loading a big model is unreachable for minutes: log now and then.
            level = logging.INFO if state.attempt_number % 20 == 1 else logging.DEBUG
            error = state.outcome.exception() if state.outcome is not None else None
            logger.log(level, "target %s not reachable (%s); retrying", self.address, error)

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TargetUnavailable),
            wait=wait_exponential(multiplier=0.05, max=self._backoff_max_s),
            before_sleep=log_retry,
        )
        async for attempt in retrying:
            with attempt:
                await self.get_info()
        assert self._stub is not None
        self._outbox = asyncio.Queue()
        call = self._stub.Control(_drain(self._outbox))
        logger.info("control stream to target %s open", self.address)
        return call

    def _dispatch(self, response: target_pb2.ControlResponse) -> None:
        which = response.WhichOneof("event")
        if which == "status":
            self.status = response.status
            return
        if which != "step":
            return
        step = response.step
        self.last_stats = step.stats
        if step.stats.batch_size:
            per_request = step.stats.num_committed_tokens / step.stats.batch_size
            self.accept_length = _average(self.accept_length, per_request)
            lane = self.lane_accept_length.get(step.lane_id, 0.0)
            self.lane_accept_length[step.lane_id] = _average(lane, per_request)
        for commit in step.commits:
            stream = self._streams.get(commit.request_id)
            if stream is None:
                continue  # finished or abandoned at the gateway: late commits are dropped
            stream.commits.put_nowait(commit)
            if commit.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                del self._streams[commit.request_id]

    async def _notify(self, connected: bool) -> None:
        if self._on_connection_change is not None:
            await self._on_connection_change(connected)

    def _fail_all(self, error: TargetUnavailable) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.commits.put_nowait(error)


def _average(mean: float, value: float) -> float:
    """An exponential moving average that starts at its first value."""
    decay = _ACCEPT_LENGTH_DECAY if mean else 0.0
    return decay * mean + (1 - decay) * value


async def _drain(
    outbox: asyncio.Queue[target_pb2.ControlRequest],
) -> AsyncIterator[target_pb2.ControlRequest]:
    """The request side of one control stream: whatever the gateway queues, in order."""
    while True:
        yield await outbox.get()


def _describe(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name} {exc.details() or ''}".strip()
