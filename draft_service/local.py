"""The draft's end of the local stream (``tandem.local_stream`` has the protocol): Speculate
streams over a Unix socket, served on the gRPC server's event loop by the same code as the gRPC
stream (``DraftServiceServicer.steps``), so validation, sessions and engine steps are shared.

The socket is created private to this user (mode 0600) at the configured path; a stale socket
left there by a process that died is replaced, any other file is refused. A malformed frame or
message ends that connection (logged; the target falls back or reconnects); when a connection
ends, its stream's requests are released as for a gRPC stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from tandem.errors import InvalidRequest
from tandem.local_stream import HEADER, check_path, encode
from tandem.v1 import draft_pb2

if TYPE_CHECKING:
    from draft_service.server import DraftServiceServicer

logger = logging.getLogger(__name__)


class LocalStreams:
    """Listens on ``path`` and serves each connection as one Speculate stream."""

    def __init__(self, servicer: DraftServiceServicer, path: str, max_message_bytes: int) -> None:
        self.servicer = servicer
        self.path = check_path(path)
        self.max_message_bytes = max_message_bytes
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        _remove_stale(self.path)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window for other users
        try:
            self._server = await asyncio.start_unix_server(
                self._serve, path=self.path, limit=self.max_message_bytes + HEADER.size
            )
        finally:
            os.umask(old_umask)
        logger.info("local Speculate streams on %s", self.path)

    async def stop(self) -> None:
        """Stops listening, ends every connection (their requests are released) and removes
        the socket."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            info = self.servicer.engine.info
            if info is None:
                logger.info("local stream refused: the draft model is loading")
                return
            requests = _requests(reader, self.max_message_bytes)
            steps = self.servicer.steps(info, requests, f"unix:{self.path}")
            async with contextlib.aclosing(steps):  # its finally releases the stream's requests
                async for response in steps:
                    writer.write(encode(response))
                    await writer.drain()
        except InvalidRequest as exc:
            logger.info("local stream ended: %s", exc)
        except (ConnectionError, asyncio.IncompleteReadError, DecodeError) as exc:
            logger.info("local stream ended: %r", exc)
        except asyncio.CancelledError:
            pass
        except Exception:
            logger.exception("local stream failed")
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _requests(
    reader: asyncio.StreamReader, max_bytes: int
) -> AsyncIterator[draft_pb2.SpeculateRequest]:
    """The connection's requests until it ends between frames; ConnectionError for an
    oversized frame, IncompleteReadError for one cut short."""
    while True:
        try:
            header = await reader.readexactly(HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return  # closed between frames: the stream's normal end
            raise
        (length,) = HEADER.unpack(header)
        if length > max_bytes:
            raise ConnectionError(f"a {length}-byte frame exceeds the {max_bytes} cap")
        yield draft_pb2.SpeculateRequest.FromString(await reader.readexactly(length))


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
