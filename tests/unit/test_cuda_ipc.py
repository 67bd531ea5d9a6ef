"""``tandem/cuda_ipc.py``: buffers and events shared by two processes on one GPU.

On CPU: what is refused (a CPU tensor, a view, malformed or short descriptions, frames over the
cap) and the framing over a real socket pair. On the GPU: a child process maps a buffer this
process allocated, writes it behind its own stream, records an interprocess event and sends a
notice; this process waits on that event on its stream and reads what the child wrote.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tandem import cuda_ipc


def test_frames_round_trip_and_the_cap_holds() -> None:
    a, b = socket.socketpair()
    with a, b:
        cuda_ipc.send_frame(a, b"notice")
        cuda_ipc.send_frame(a, b"")
        assert cuda_ipc.recv_frame(b) == b"notice"
        assert cuda_ipc.recv_frame(b) == b""
        with pytest.raises(ValueError, match="over"):
            cuda_ipc.send_frame(a, bytes(cuda_ipc.MAX_FRAME + 1))
        a.sendall((cuda_ipc.MAX_FRAME + 1).to_bytes(8, "little"))
        with pytest.raises(ValueError, match="over"):
            cuda_ipc.recv_frame(b)
    c, d = socket.socketpair()
    with d:
        c.sendall((4).to_bytes(8, "little") + b"ab")
        c.close()
        with pytest.raises(ConnectionError):
            cuda_ipc.recv_frame(d)


def test_what_cannot_be_described_or_opened() -> None:
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ipc.describe(torch.zeros(4))
    for junk in (b"", b"\x01\x00\x00\x00", b"\xff\xff\xff\xff" + b"x" * 8):
        with pytest.raises(ValueError, match="description"):
            cuda_ipc.open_buffer(junk, (1,), torch.uint8)


CHILD = textwrap.dedent(
    """
    import socket, sys, torch
    from tandem import cuda_ipc
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sys.argv[1])
    buf = cuda_ipc.open_buffer(cuda_ipc.recv_frame(conn), (1024,), torch.int64)
    event = torch.cuda.Event(interprocess=True)
    torch.cuda._sleep(50_000_000)  # the write lands well after the notice is sent
    buf.copy_(torch.arange(1024, device="cuda") * 3)
    event.record()
    cuda_ipc.send_frame(conn, event.ipc_handle())
    assert cuda_ipc.recv_frame(conn) == b"done"
    """
)


@pytest.mark.gpu
def test_a_child_writes_a_buffer_this_process_reads_behind_its_event(tmp_path: Path) -> None:
    path = tmp_path / "ipc.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    buf = torch.zeros(1024, dtype=torch.int64, device="cuda")  # the reader allocates
    with pytest.raises(ValueError, match="whole storage"):
        cuda_ipc.describe(buf[1:])
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)])
    try:
        server.settimeout(120)
        conn, _ = server.accept()
        with conn:
            cuda_ipc.send_frame(conn, cuda_ipc.describe(buf))
            with pytest.raises(ValueError, match="bytes asked"):
                cuda_ipc.open_buffer(cuda_ipc.describe(buf), (2048,), torch.int64)
            event = cuda_ipc.open_event(cuda_ipc.recv_frame(conn))
            torch.cuda.current_stream().wait_event(event)
            copy = buf.clone()  # enqueued behind the wait: sees the child's write
            assert torch.equal(copy, torch.arange(1024, device="cuda") * 3)
            cuda_ipc.send_frame(conn, b"done")
    finally:
        assert child.wait(timeout=120) == 0
        server.close()
