"""The local stream (``tandem.link.local``, ``draft_service.local``) on its own: framing,
the socket's life (private mode, stale and live sockets), what the draft does with a bad
connection, and when a client takes it. Steps through it run in test_remote_drafter.py, where
every RemoteDrafter test runs over both streams."""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from draft_service.__main__ import parse_config
from draft_service.config import DraftServiceConfig
from tandem import wire
from tandem.errors import InvalidRequest
from tandem.link import messages
from tandem.link.local import (
    HEADER,
    FrameBuffer,
    LocalLink,
    check_path,
    device_uuid,
    encode,
    sharing_transport,
)
from tandem.link.messages import StreamState
from tandem.link.prompt_ring import PromptRing
from tandem.link.remote import RemoteDrafter
from tandem.spec.types import VerifyOutcome
from tandem.v1 import draft_pb2
from tests.helpers.draft_service import (
    LAYERS,
    SPEC,
    Ckpts,
    Feed,
    ServerThread,
    check_outcomes_through_the_buffer,
    serve,
    wait_until,
)


def _hello() -> draft_pb2.SpeculateHello:
    return draft_pb2.SpeculateHello(protocol_version=1, max_message_bytes=1 << 20)


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(path)
    return sock


def _read_frame(sock: socket.socket) -> bytes | None:
    """One frame's payload; None when the draft closed the connection."""
    buffer = FrameBuffer(1 << 20)
    while (payload := buffer.pop()) is None:
        data = sock.recv(1 << 16)
        if not data:
            return None
        buffer.feed(data)
    return payload


@pytest.fixture
def served(ckpts: Ckpts, tmp_path: Path) -> Iterator[ServerThread]:
    s = serve(ckpts, local_socket=str(tmp_path / "draft.sock"))
    yield s
    s.stop()


def test_frames_reassemble_in_any_split_and_cap_their_size() -> None:
    messages = [draft_pb2.SpeculateRequest(step_id=i, lane_id=i % 2) for i in range(1, 4)]
    stream = b"".join(encode(m) for m in messages)
    for split in (1, 3, 8, 9, len(stream)):
        buffer, got = FrameBuffer(1 << 10), []
        for i in range(0, len(stream), split):
            buffer.feed(stream[i : i + split])
            while (payload := buffer.pop()) is not None:
                got.append(draft_pb2.SpeculateRequest.FromString(payload))
        assert got == messages
    buffer = FrameBuffer(16)
    buffer.feed(HEADER.pack(17))
    with pytest.raises(ConnectionError, match="exceeds the 16"):
        buffer.pop()


def test_socket_paths_are_checked() -> None:
    assert check_path("/tmp/d.sock") == "/tmp/d.sock"
    with pytest.raises(ValueError, match="longer than 107"):
        check_path("/" + "x" * 107)
    with pytest.raises(ValueError, match="empty"):
        check_path("")
    config = parse_config(["--target", "t", "--draft-kind", "ngram", "--local-socket", "/s"])
    assert config.local_socket == "/s"
    assert parse_config(["--target", "t", "--draft-kind", "ngram"]).local_socket is None


def test_socket_is_private_and_reported(served: ServerThread) -> None:
    path = served.server.config.local_socket
    assert path is not None
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    remote = RemoteDrafter(served.address, num_target_layers=LAYERS)
    try:
        assert remote.wait_ready(20)
        assert remote.info is not None and remote.info.local_socket == path
        assert remote.info.instance_id == served.server.local.context.instance_id  # type: ignore[union-attr]
        assert remote.local_connects == 1
    finally:
        remote.close()
    served.stop()
    assert not os.path.exists(path)  # removed at stop
    served.stop = lambda: None  # type: ignore[method-assign]


def test_stale_socket_is_replaced_live_one_and_files_refused(
    ckpts: Ckpts,
    tmp_path: Path,
) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(stale))  # bound, never listening: what a killed process leaves
    s = serve(ckpts, local_socket=str(stale))
    try:
        sock = _connect(str(stale))  # the new draft serves it
        sock.close()
        with pytest.raises(FileExistsError, match="in use"):
            serve(ckpts, local_socket=str(stale))
    finally:
        s.stop()
    regular = tmp_path / "file"
    regular.write_text("not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        serve(ckpts, local_socket=str(regular))
    assert regular.read_text() == "not a socket"


def test_bad_connections_end_and_release_their_requests(served: ServerThread) -> None:
    path = str(served.server.config.local_socket)
    # No hello first: the draft ends the connection.
    with _connect(path) as sock:
        sock.sendall(encode(draft_pb2.SpeculateRequest(step_id=1)))
        assert _read_frame(sock) is None
    # A frame over the draft's cap: ended before the draft reads it.
    with _connect(path) as sock:
        sock.sendall(struct.pack("<Q", served.server.config.max_message_bytes + 1))
        assert _read_frame(sock) is None
    # A good stream that admits a request and then goes away: the request is released.
    with _connect(path) as sock:
        sock.sendall(encode(draft_pb2.SpeculateRequest(hello=_hello())))
        first = draft_pb2.SpeculateResponse.FromString(_read_frame(sock) or b"")
        assert first.hello.instance_id == served.server.local.context.instance_id  # type: ignore[union-attr]
        request = draft_pb2.SpeculateRequest(step_id=1, speculation=wire.spec_to_proto(SPEC))
        state = StreamState(budget=1 << 20, frame_bytes=1 << 18, hidden_dtype=torch.float32)
        sock.sendall(encode(state.build(request, [Feed(7).admit("a", 6)], [], [])))
        answer = draft_pb2.SpeculateResponse.FromString(_read_frame(sock) or b"")
        assert answer.step_id == 1 and [t.request_id for t in answer.trees] == ["a"]
        assert served.num_tracked() == 1
    wait_until(lambda: served.num_tracked() == 0)


def test_clients_that_do_not_take_it(served: ServerThread) -> None:
    path = str(served.server.config.local_socket)
    # The socket belongs to another draft than the one GetInfo described: refused.
    with pytest.raises(ConnectionError, match="not the other"):
        LocalLink.connect(
            path,
            _hello(),
            instance_id="other",
            timeout_s=20,
            max_backlog=8,
            on_dropped=lambda ids: None,
        )
    # Turned off: the gRPC stream.
    remote = RemoteDrafter(served.address, num_target_layers=LAYERS, local_stream=False)
    try:
        assert remote.wait_ready(20) and remote.local_connects == 0 and remote.connects == 1
        assert remote.step([Feed(8).admit("a", 5)], [], []) != {}
    finally:
        remote.close()
    # (With TLS settings a client never takes it: tests/deploy/test_internal_tls.py.)


def test_unreachable_socket_falls_back_to_grpc(ckpts: Ckpts, tmp_path: Path) -> None:
    config = DraftServiceConfig(draft=ckpts.draft_config(), local_socket=str(tmp_path / "d.sock"))
    s = ServerThread(config)
    try:
        os.unlink(str(tmp_path / "d.sock"))  # as on another host: the path is not there
        remote = RemoteDrafter(s.address, num_target_layers=LAYERS)
        try:
            assert remote.wait_ready(20) and remote.local_connects == 0
            assert remote.step([Feed(9).admit("a", 5)], [], []) != {}
        finally:
            remote.close()
    finally:
        s.stop()


def test_prompt_ring_reuses_a_region_only_once_its_step_is_answered() -> None:
    ring = PromptRing(torch.zeros(100, dtype=torch.uint8))
    ten = torch.arange(10, dtype=torch.float32)  # 40 bytes

    def offset(step_id: int, tensor: torch.Tensor) -> int | None:
        """Where ``tensor`` was written, None without room."""
        frames = ring.stage(step_id, [tensor])
        return None if frames is None else frames[0].header["shared_offset"]

    assert offset(1, ten) == 0
    assert torch.equal(ring.buffer[:40].view(torch.float32), ten)
    assert offset(2, ten + 1) == 40
    assert offset(3, ten) is None  # step 1's bytes are still unread: no room
    ring.release(1)
    assert offset(3, ten + 2) == 0  # wrapped
    assert offset(4, torch.zeros(3)) is None  # would overwrite step 2's
    ring.release(2)
    assert offset(4, torch.zeros(3)) == 40
    assert offset(5, torch.zeros(30)) is None  # larger than the buffer


def test_a_shared_frame_is_read_from_the_buffer_and_checked() -> None:
    buffer = torch.zeros(64, dtype=torch.uint8)
    ring = PromptRing(buffer)
    features = torch.arange(12, dtype=torch.float32).view(3, 4)
    staged = ring.stage(1, [features])
    assert staged is not None
    (encoded,) = staged
    message = draft_pb2.PromptFrames(request_id="r")
    encoded.add_to(message.frames)
    again = draft_pb2.PromptFrames.FromString(message.SerializeToString())
    frame = again.frames[0]
    assert frame.WhichOneof("payload") == "shared_offset" and not frame.data

    def read(offset: int, nbytes: int) -> torch.Tensor:
        return buffer[offset : offset + nbytes].clone()

    out = wire.FrameAssembler(max_bytes=1024, shared=read).add(frame)
    assert out is not None and torch.equal(out, features)
    with pytest.raises(InvalidRequest, match="no shared buffer"):
        wire.FrameAssembler(max_bytes=1024).add(frame)
    with pytest.raises(InvalidRequest, match="total_bytes"):
        wire.FrameAssembler(max_bytes=16, shared=read).add(frame)
    frame.num_chunks = 2
    with pytest.raises(InvalidRequest, match="one whole chunk"):
        wire.FrameAssembler(max_bytes=1024, shared=read).add(frame)


def test_a_steps_outcome_features_share_one_region_or_go_inline() -> None:
    buffer = torch.zeros(1 << 14, dtype=torch.uint8)
    state = StreamState(budget=1 << 20, frame_bytes=1 << 18, hidden_dtype=torch.float32)
    state.stage = PromptRing(buffer).stage
    feed = Feed(4)
    state.build(draft_pb2.SpeculateRequest(step_id=1), [feed.admit("a", 3)], [], [])
    state.tracked["b"] = 5  # as if admitted before
    runs = [
        VerifyOutcome(
            request_id=r,
            accepted_token_ids=feed.ids(n),
            bonus_token_id=7,
            features=feed.feats(n + 1),
        )
        for r, n in (("a", 0), ("b", 1))
    ]

    def read(offset: int, nbytes: int) -> torch.Tensor:
        return buffer[offset : offset + nbytes].clone()

    def sent(step_id: int) -> list[draft_pb2.VerifyOutcome]:
        message = state.build(draft_pb2.SpeculateRequest(step_id=step_id), [], runs, [])
        outcomes = list(message.message().outcomes)
        for msg, run in zip(outcomes, runs, strict=True):
            got = wire.outcome_from_proto(msg, 1 << 20, shared=read)
            assert got.features is not None and torch.equal(got.features, run.features)
        return outcomes

    small = sent(2)  # below SHARED_OUTCOME_BYTES: inline
    assert all(f.WhichOneof("payload") == "data" for o in small for f in o.hidden_states)
    messages.SHARED_OUTCOME_BYTES, saved = 1, messages.SHARED_OUTCOME_BYTES
    try:
        shared = sent(3)  # one region, a frame each
        assert all(len(o.hidden_states) == 1 for o in shared)
        assert all(o.hidden_states[0].WhichOneof("payload") == "shared_offset" for o in shared)
        offsets = [[f.shared_offset for f in o.hidden_states] for o in shared]
        assert offsets[1][0] - offsets[0][0] == runs[0].features.numel() * 4  # type: ignore[union-attr]
        state.stage = PromptRing(torch.zeros(8, dtype=torch.uint8)).stage  # no room
        assert all(f.WhichOneof("payload") == "data" for o in sent(4) for f in o.hidden_states)
    finally:
        messages.SHARED_OUTCOME_BYTES = saved


def test_outcomes_through_the_drafts_buffer_give_the_same_trees(
    ckpts: Ckpts,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every step's outcome features (and a long run, as K=0 holds) written into the draft's
    shared buffer (shared memory here; CUDA IPC in tests/e2e/test_outcome_buffer_gpu.py): the
    draft reads them there and drafts what the in-process drafter does."""
    monkeypatch.setattr(messages, "SHARED_OUTCOME_BYTES", 1)
    served = serve(ckpts, local_socket=str(tmp_path / "d.sock"), prompt_buffer_mb=1)
    remote = RemoteDrafter(served.address, num_target_layers=LAYERS, device="cpu")
    try:
        check_outcomes_through_the_buffer(ckpts.local(), remote, "cpu")
    finally:
        remote.close()
        served.stop()


def test_shared_memory_is_chosen_when_offered_on_cpu() -> None:
    """On CPU the draft and target share memory by /dev/shm whatever GPU names say."""
    cpu = torch.device("cpu")
    offered = [draft_pb2.TENSOR_TRANSPORT_INLINE, draft_pb2.TENSOR_TRANSPORT_SHM]
    assert sharing_transport(cpu, offered, "") == draft_pb2.TENSOR_TRANSPORT_SHM
    assert sharing_transport(cpu, [draft_pb2.TENSOR_TRANSPORT_INLINE], "") == 0
    assert sharing_transport(cpu, [draft_pb2.TENSOR_TRANSPORT_CUDA_IPC], "") == 0


@pytest.mark.gpu
def test_cuda_ipc_is_chosen_for_the_drafts_own_gpu_only() -> None:
    """CUDA IPC maps one GPU's memory: a target on another GPU (another UUID) gets tensors
    inline and no device-chain runs, a target on this GPU gets CUDA IPC."""
    device = torch.device("cuda", torch.cuda.current_device())
    offered = [draft_pb2.TENSOR_TRANSPORT_INLINE, draft_pb2.TENSOR_TRANSPORT_CUDA_IPC]
    mine = device_uuid(device)
    assert mine and sharing_transport(device, offered, mine) == draft_pb2.TENSOR_TRANSPORT_CUDA_IPC
    assert sharing_transport(device, offered, "") == 0
    assert sharing_transport(device, offered, "GPU-00000000-0000-0000-0000-000000000000") == 0
    if torch.cuda.device_count() > 1:
        other = device_uuid(torch.device("cuda", (device.index + 1) % torch.cuda.device_count()))
        assert other != mine and sharing_transport(device, offered, other) == 0
