"""The draft's end of the local stream (``tandem.link.local`` has the protocol): Speculate
streams over a Unix socket, served on the engine's worker thread (``draft_service.worker``):
the listening socket and every connection are watched there, and a readable connection's
steps are parsed, run (``DraftEngine.step_here``) and answered without leaving the thread.
Validation, sessions and responses are the gRPC stream's (``session.StreamSteps``); what a
stream needs of the service comes in its ``StreamContext``. A stream whose target shares this
draft's device gets a prompt buffer (``prompts.py``) and device-chain runs (``chain.py``).

The socket is created private to this user (mode 0600) at the configured path; a stale socket
left there by a process that died is replaced, a live one or any other file is refused. A
malformed frame or message ends that connection (logged; the target falls back or
reconnects); when a connection ends, its stream's requests are released as for a gRPC
stream. Answers are written with a bounded wait (``SEND_TIMEOUT_S``): a target that stops
reading loses its connection instead of holding the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat

from google.protobuf.message import DecodeError

from draft_service.chain import ChainPeer
from draft_service.context import StreamContext
from draft_service.prompts import PromptBuffer
from draft_service.session import StreamSteps
from draft_service.worker import Worker
from tandem.errors import InvalidRequest
from tandem.link.local import FrameBuffer, check_path, device_uuid, encode
from tandem.v1 import draft_pb2

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0
_RECV_BYTES = 1 << 20


class LocalStreams:
    """Listens on ``path``; each connection is one Speculate stream on the worker thread."""

    def __init__(self, context: StreamContext, path: str) -> None:
        self.context = context
        self.path = check_path(path)
        self._worker: Worker = context.engine.worker
        self._listener: socket.socket | None = None
        self._connections: set[_Connection] = set()  # worker thread only

    async def start(self) -> None:
        _remove_stale(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window for other users
        try:
            listener.bind(self.path)
        except BaseException:
            listener.close()
            raise
        finally:
            os.umask(old_umask)
        listener.listen(16)
        listener.setblocking(False)
        self._listener = listener
        await asyncio.wrap_future(self._worker.submit(self._worker.watch, listener, self._accept))
        logger.info("local Speculate streams on %s", self.path)

    async def stop(self) -> None:
        """Stops listening, ends every connection (their requests are released) and removes
        the socket."""
        if self._listener is None:
            return
        await asyncio.wrap_future(self._worker.submit(self._close_all))
        self._listener = None

    # -- on the worker thread --------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.settimeout(SEND_TIMEOUT_S)  # reads happen when readable; writes wait this long
        connection = _Connection(self, sock)
        self._connections.add(connection)
        self._worker.watch(sock, connection.on_readable)

    def _close_all(self) -> None:
        if self._listener is not None:
            self._worker.unwatch(self._listener)
            self._listener.close()
        for connection in list(self._connections):
            connection.close("the draft is stopping")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _closed(self, connection: _Connection) -> None:
        self._connections.discard(connection)


class _Connection:
    """One local stream: frames in, a step each, answers out (worker thread only)."""

    def __init__(self, streams: LocalStreams, sock: socket.socket) -> None:
        self.streams = streams
        self.sock = sock
        self.frames = FrameBuffer(streams.context.max_message_bytes)
        self.steps: StreamSteps | None = None
        self.chain: ChainPeer | None = None  # device-chain runs, when the hellos chose them
        self.closed = False

    def on_readable(self) -> None:
        try:
            data = self.sock.recv(_RECV_BYTES)
            if not data:
                self.close("the target closed it")
                return
            self.frames.feed(data)
            while not self.closed and (payload := self.frames.pop()) is not None:
                self._step(draft_pb2.SpeculateRequest.FromString(payload))
        except InvalidRequest as exc:
            self.close(str(exc))
        except (OSError, ConnectionError, DecodeError) as exc:
            self.close(repr(exc))

    def _step(self, request: draft_pb2.SpeculateRequest) -> None:
        context = self.streams.context
        if self.steps is None:
            info = context.engine.info
            if info is None:
                raise ConnectionError("the draft model is loading")
            self.steps = StreamSteps(context, info, f"unix:{self.streams.path}")
        if self._chain_message(request):
            return
        if self.chain is not None:
            self.chain.drop_unstarted()
        work = self.steps.begin(request)
        stream = self.steps.stream_id
        result = context.engine.step_here(stream, work.admits, work.outcomes, work.released)
        response = self.steps.finish(request, work, result)
        if response.HasField("hello"):  # the stream's first answer: does it share the device?
            self._share(context, response.hello, request.hello)
        self.sock.sendall(encode(response))

    def _share(
        self,
        context: StreamContext,
        hello: draft_pb2.SpeculateHello,
        theirs: draft_pb2.SpeculateHello,
    ) -> None:
        """A target that offered a transport this draft's device has (on this GPU, for CUDA)
        gets its prompt buffer and device-chain runs; the hello names both, and the GPU."""
        transport = context.sharing(list(theirs.tensor_transports), theirs.device_uuid)
        if not transport:
            return
        assert self.steps is not None
        hello.tensor_transports.append(transport)  # type: ignore[arg-type]
        hello.device_uuid = device_uuid(context.device)
        self.chain = ChainPeer(context, self.steps, transport)
        stream = self.steps.stream_id
        prompts = PromptBuffer.allocate(context.prompt_buffer_bytes, context.device, stream)
        if prompts is not None:
            self.steps.session.shared = prompts.read
            self.steps.session.settle = prompts.settle
            prompts.describe(hello)

    def _chain_message(self, request: draft_pb2.SpeculateRequest) -> bool:
        """A device-chain message (``draft_service.chain``) handled and answered; False for
        any other. One on a stream that did not agree to them ends it."""
        kind = _chain_kind(request)
        if kind is None:
            return False
        if self.chain is None:
            raise InvalidRequest(kind, "this stream's hellos chose no device-chain transport")
        if kind == "chain_begin":
            ready = self.chain.begin(request.chain_begin)
            self.sock.sendall(encode(draft_pb2.SpeculateResponse(chain_ready=ready)))
        elif kind == "chain_step":
            done = self.chain.step(request.chain_step)
            self.sock.sendall(encode(draft_pb2.SpeculateResponse(chain_step_done=done)))
        else:
            self.chain.end(request.chain_end)
        return True

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        logger.info("local stream ended: %s", reason)
        self.streams._worker.unwatch(self.sock)
        self.sock.close()
        if self.chain is not None:
            self.chain.close()
        if self.steps is not None:
            self.steps.close()
        self.streams._closed(self)


def _chain_kind(request: draft_pb2.SpeculateRequest) -> str | None:
    for kind in ("chain_begin", "chain_step", "chain_end"):
        if request.HasField(kind):
            return kind
    return None


def _remove_stale(path: str) -> None:
    """Removes a socket that a dead process left at ``path``; refuses a live one (another
    draft serves it) and anything that is not a socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"local socket: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: stale
            return
    raise FileExistsError(f"local socket: {path} is in use by another process")
