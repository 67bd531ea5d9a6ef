"""The local stream: a ``Speculate`` stream over a Unix socket, for a target and a draft on one
host (docs/design.md section 6: co-located services may take a faster path, negotiated, with gRPC
as the fallback; docs/architecture.md, "Local stream").

A draft started with ``--local-socket PATH`` reports the path and its process's random
``instance_id`` in GetInfo. A target that can open the path sends the stream's hello there; the
draft's hello repeats its ``instance_id``, so the target knows the socket belongs to the
service it asked. Otherwise the target uses the gRPC stream, as before.

Frames: an 8-byte little-endian length, then that many bytes of a serialised
``SpeculateRequest`` (target -> draft) or ``SpeculateResponse`` (draft -> target). A length
above the receiver's ``max_message_bytes`` ends the stream. Everything else is the gRPC
stream's protocol: the hello first, the same messages and validation, answers in step order.

What it saves is machinery around the bytes, not the bytes (docs/performance.md has the
numbers): the target's engine thread builds and writes its step and reads the answer itself,
with no hop to the client's event loop and none through gRPC's threads; on the draft, the
engine's worker thread reads the socket, runs the step and answers (``draft_service/local.py``).

:class:`LocalLink` is the target's end of the socket; ``tandem/link/local_transport.py`` drives
it as the drafter's transport. Its sends come from the engine thread, or from the client's loop
for a step handed there (in order: while such a send is pending, later ones queue behind it);
its reads come from the engine thread only. The socket is private to the draft's user (mode
0600); no pickle, only protobuf.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import torch
from google.protobuf.message import DecodeError, Message

from tandem.link import ipc
from tandem.link.messages import Answer, Outgoing, StreamState, parse_trees
from tandem.link.prompt_ring import PromptRing
from tandem.spec.types import DraftAdmit, VerifyOutcome
from tandem.v1 import common_pb2, draft_pb2

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<Q")
# How a local stream shares memory of each device type (both services on it): chosen in the
# hellos, for device-chain runs (tandem/link/chain_remote.py) and shared prompt buffers.
SHARING = {"cuda": draft_pb2.TENSOR_TRANSPORT_CUDA_IPC, "cpu": draft_pb2.TENSOR_TRANSPORT_SHM}


def device_uuid(device: torch.device) -> str:
    """A CUDA device's UUID (the same GPU in every process, whatever its index there); ''
    for other devices. The hellos compare it before they choose CUDA IPC."""
    if device.type != "cuda":
        return ""
    index = torch.cuda.current_device() if device.index is None else device.index
    return _cuda_uuid(index)


@functools.cache
def _cuda_uuid(index: int) -> str:
    """Read once per device: ``LocalLink.shares`` asks at every device-chain check."""
    return str(torch.cuda.get_device_properties(index).uuid)


def sharing_transport(device: torch.device, offered: Sequence[int], target_device: str) -> int:
    """The transport a draft on ``device`` shares it by with a target that ``offered`` these
    and named its GPU ``target_device`` (0: none, tensors go inline): its device type's, for
    CUDA only when the target is on this very GPU (CUDA IPC maps one GPU's memory)."""
    wanted = SHARING.get(device.type, 0)
    if wanted not in offered:
        return 0
    if device.type == "cuda" and target_device != device_uuid(device):
        return 0
    return wanted


MAX_PATH_BYTES = 107  # sun_path holds 108 bytes with the terminating NUL
_RECV_BYTES = 1 << 20
_SOCKET_BUFFER_BYTES = 4 << 20  # asked for; the kernel may cap it (net.core.wmem_max)


def encode(message: Message | Outgoing) -> bytes:
    """One frame: the length, then the serialised message."""
    payload = message.SerializeToString()
    return HEADER.pack(len(payload)) + payload


def check_path(path: str) -> str:
    """``path`` if a Unix socket can be bound there (length), else ValueError."""
    if not path:
        raise ValueError("local socket: the path must not be empty")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise ValueError(f"local socket: {path!r} is longer than {MAX_PATH_BYTES} bytes")
    return path


class FrameBuffer:
    """Reassembles frames from the bytes a socket gives, in any split."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def pop(self) -> bytes | None:
        """The next whole frame's payload, or None until it has arrived; ConnectionError for
        a length above ``max_bytes``."""
        if len(self._buf) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buf)
        if length > self.max_bytes:
            raise ConnectionError(f"a {length}-byte frame exceeds the {self.max_bytes} cap")
        end = HEADER.size + length
        if len(self._buf) < end:
            return None
        payload = bytes(self._buf[HEADER.size : end])
        del self._buf[:end]
        return payload


class LocalLink:
    """The target's end of one local stream (see the module docstring for which thread does
    what). Once broken (``broken`` says why) it sends and reads nothing more."""

    def __init__(
        self,
        sock: socket.socket,
        stream: StreamState,
        *,
        path: str,
        max_message_bytes: int,
        max_backlog: int,
        on_dropped: Callable[[list[str]], None],
    ) -> None:
        self.sock = sock
        self.stream = stream
        self.path = path
        self.max_backlog = max_backlog
        self._on_dropped = on_dropped
        self._frames = FrameBuffer(max_message_bytes)
        self._send_lock = threading.Lock()  # one message at a time, built in send order
        self._lock = threading.Lock()  # the step bookkeeping below
        self._next_step = 1
        self._unanswered: set[int] = set()
        self._discard: set[int] = set()  # unanswered steps whose answers nobody waits for
        self._answers: dict[int, Answer] = {}  # arrived, not taken yet
        self.hello = draft_pb2.SpeculateHello()  # the draft's
        self.kv_usage = common_pb2.KvUsage()
        self.late_responses = 0
        self.broken: str | None = None
        self._chain_answers: list[draft_pb2.SpeculateResponse] = []  # ChainReady/StepDone
        self.ring: PromptRing | None = None  # the draft's prompt buffer (``share_prompts``)

    @classmethod
    def connect(
        cls,
        path: str,
        hello: draft_pb2.SpeculateHello,
        *,
        instance_id: str,
        timeout_s: float,
        max_backlog: int,
        on_dropped: Callable[[list[str]], None],
    ) -> LocalLink:
        """Opens the socket and exchanges hellos (blocking, up to ``timeout_s``, which also
        bounds every later write). The draft's hello is ``hello``; the caller sets ``stream``
        once it knows the draft's limits. ConnectionError when the draft there is not the one
        with ``instance_id``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
            sock.settimeout(timeout_s)
            sock.connect(path)
            link = cls(
                sock,
                StreamState(budget=0, frame_bytes=0, hidden_dtype=torch.float32),
                path=path,
                max_message_bytes=hello.max_message_bytes,
                max_backlog=max_backlog,
                on_dropped=on_dropped,
            )
            sock.sendall(encode(draft_pb2.SpeculateRequest(hello=hello)))
            first = link._read_one(time.monotonic() + timeout_s)
            if first is None or first.hello.protocol_version != hello.protocol_version:
                raise ConnectionError(f"the draft's hello is missing or unsupported: {first}")
            if first.hello.instance_id != instance_id:
                raise ConnectionError(
                    f"{path} is served by draft {first.hello.instance_id or '?'}, not the "
                    f"{instance_id} that GetInfo reported"
                )
        except BaseException:
            sock.close()
            raise
        link.hello = first.hello
        return link

    # -- sending (engine thread, or the client's loop for a deferred step) -----------------

    def send(
        self,
        lane: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
        deadline_ns: int,
    ) -> tuple[int, bool]:
        """Builds and writes one lane's step: (its step_id, whether its answer will be used);
        (0, False) when nothing was sent (broken, now or before)."""
        with self._send_lock:
            if self.broken is not None:
                return 0, False
            with self._lock:
                if len(self._unanswered) >= self.max_backlog:
                    self._fail(f"{len(self._unanswered)} steps unanswered")
                    return 0, False
                step_id, self._next_step = self._next_step, self._next_step + 1
                wanted = not self._discard  # behind a late answer this one is late too
                self._unanswered.add(step_id)
                if not wanted:
                    self._discard.add(step_id)
            request = draft_pb2.SpeculateRequest(
                step_id=step_id, lane_id=lane, deadline_ns=deadline_ns
            )
            message = self.stream.build(request, list(admits), list(outcomes), list(released))
            try:
                self.sock.sendall(encode(message))
            except OSError as exc:
                self._fail(f"send failed: {exc!r}")
                return 0, False
            return step_id, wanted

    def post(self, request: draft_pb2.SpeculateRequest) -> bool:
        """Writes a message that is not a step (device-chain runs,
        ``tandem/link/chain_remote.py``); False when the link is (now) broken."""
        with self._send_lock:
            if self.broken is not None:
                return False
            try:
                self.sock.sendall(encode(request))
            except OSError as exc:
                self._fail(f"send failed: {exc!r}")
                return False
            return True

    def call(
        self,
        request: draft_pb2.SpeculateRequest,
        deadline: float,
        answers: Callable[[draft_pb2.SpeculateResponse], bool],
    ) -> draft_pb2.SpeculateResponse | None:
        """Posts a ChainBegin or ChainStep and reads until the chain answer for which
        ``answers`` holds is in (engine thread; others, late answers to earlier calls, are
        dropped); None when ``deadline`` passes first or the link breaks."""
        self._chain_answers.clear()
        if not self.post(request):
            return None
        while True:
            while self._chain_answers:
                answer = self._chain_answers.pop(0)
                if answers(answer):
                    return answer
                logger.debug("a late chain answer dropped: %s", answer)
            if self.broken is not None:
                return None
            if self._read_one(deadline) is None and time.monotonic() >= deadline:
                return None

    # -- reading (engine thread) -----------------------------------------------------------

    def wait(self, step_id: int, deadline: float) -> Answer | None:
        """The answer of ``step_id``, reading until it is in; None when ``deadline``
        (time.monotonic()) passes first or the link breaks."""
        while True:
            with self._lock:
                answer = self._answers.pop(step_id, None)
            if answer is not None or self.broken is not None:
                return answer
            if self._read_one(deadline) is None and time.monotonic() >= deadline:
                return None

    def drain(self) -> None:
        """Handles every answer that has arrived, without waiting."""
        while self.broken is None and self._read_one(0.0) is not None:
            pass

    def has(self, step_id: int) -> bool:
        """Whether ``step_id``'s answer is in (``drain`` first to see what has arrived)."""
        with self._lock:
            return step_id in self._answers

    def late(self, step_id: int) -> None:
        """``step_id``'s collect gave up: its answer is discarded when it comes."""
        with self._lock:
            if step_id in self._unanswered:
                self._discard.add(step_id)

    def share_prompts(self, device: torch.device) -> bool:
        """Maps the draft's prompt buffer when its hello shared one that ``device`` can use
        (its transport is this device's): prompt features then travel through it. False
        (inline frames) otherwise."""
        size = self.hello.prompt_buffer_bytes
        if not self.hello.prompt_buffer or not self.shares(device):
            return False
        try:
            buffer = ipc.open_buffer(bytes(self.hello.prompt_buffer), (size,), torch.uint8)
        except (ValueError, RuntimeError) as exc:
            logger.warning("the draft's prompt buffer cannot be mapped (%s); sending inline", exc)
            return False
        self.ring = PromptRing(buffer)
        self.stream.stage = self.ring.stage
        return True

    @property
    def chain_transport(self) -> int:
        """The transport the draft's hello chose for device-chain runs
        (``TENSOR_TRANSPORT_CUDA_IPC`` or ``_SHM``), 0 when none."""
        chosen = set(self.hello.tensor_transports) & set(SHARING.values())
        return chosen.pop() if len(chosen) == 1 else 0

    def shares(self, device: torch.device) -> bool:
        """Whether the transport the hellos chose shares ``device`` with the draft (for CUDA:
        the draft's hello names this GPU)."""
        if self.chain_transport != SHARING.get(device.type):
            return False
        return device.type != "cuda" or self.hello.device_uuid == device_uuid(device)

    @property
    def backlogged(self) -> bool:
        """Whether answers are still to come that nobody will use (the draft is late)."""
        return bool(self._discard)

    def _read_one(self, deadline: float) -> draft_pb2.SpeculateResponse | None:
        """Reads until one response is handled (returned) or ``deadline`` passes (None); a
        deadline of 0 only takes what has arrived. Breaks the link on EOF or a bad frame."""
        while self.broken is None:
            try:
                payload = self._frames.pop()
                if payload is not None:
                    response = draft_pb2.SpeculateResponse.FromString(payload)
                    self._handle(response)
                    return response
                remaining = max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([self.sock], [], [], remaining)
                if not ready:
                    return None
                data = self.sock.recv(_RECV_BYTES)
                if not data:
                    raise ConnectionError("the draft closed the local stream")
                self._frames.feed(data)
            except (OSError, ConnectionError, DecodeError, ValueError) as exc:
                self._fail(repr(exc))
        return None

    def _handle(self, response: draft_pb2.SpeculateResponse) -> None:
        dropped = list(response.dropped_request_ids)
        if dropped:
            with self._send_lock:  # the stream state is the sender's
                self.stream.forget(dropped)
            self._on_dropped(dropped)
        if response.HasField("kv_usage"):
            self.kv_usage = response.kv_usage
        if response.HasField("hello"):
            return
        if response.HasField("chain_ready") or response.HasField("chain_step_done"):
            self._chain_answers.append(response)
            return
        if self.ring is not None:
            self.ring.release(response.step_id)
        with self._lock:
            if response.step_id not in self._unanswered:
                logger.warning("draft answered unknown step %d", response.step_id)
                return
            self._unanswered.discard(response.step_id)
            if response.step_id in self._discard:
                self._discard.discard(response.step_id)
                self.late_responses += 1
                return
            self._answers[response.step_id] = Answer(
                parse_trees(response, self.stream.tracked), response.model_ns
            )

    # -- end -------------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            self.close()

    def close(self) -> None:
        """Ends the stream (the draft releases its requests)."""
        if self.broken is None:
            self.broken = "closed"
        with contextlib.suppress(OSError):  # not connected (any more)
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
