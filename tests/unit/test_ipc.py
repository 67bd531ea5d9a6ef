"""``tandem/link/ipc.py``: buffers and events shared by two processes on one GPU.

On CPU: what is refused (a CPU tensor, a view, malformed or short descriptions, frames over the
cap) and the framing over a real socket pair. On the GPU: a child process maps a buffer this
process allocated, writes it behind its own stream, records an interprocess event and sends a
notice; this process waits on that event on its stream and reads what the child wrote.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.link import ipc


def test_frames_round_trip_and_the_cap_holds() -> None:
    a, b = socket.socketpair()
    with a, b:
        ipc.send_frame(a, b"notice")
        ipc.send_frame(a, b"")
        assert ipc.recv_frame(b) == b"notice"
        assert ipc.recv_frame(b) == b""
        with pytest.raises(ValueError, match="over"):
            ipc.send_frame(a, bytes(ipc.MAX_FRAME + 1))
        a.sendall((ipc.MAX_FRAME + 1).to_bytes(8, "little"))
        with pytest.raises(ValueError, match="over"):
            ipc.recv_frame(b)
    c, d = socket.socketpair()
    with d:
        c.sendall((4).to_bytes(8, "little") + b"ab")
        c.close()
        with pytest.raises(ConnectionError):
            ipc.recv_frame(d)


def test_what_cannot_be_described_or_opened() -> None:
    with pytest.raises(ValueError, match="shared memory"):
        ipc.describe(torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous"):
        ipc.describe(torch.zeros(4, 4).share_memory_().t())
    for junk in (b"", b"\x01\x00\x00\x00", b"\xff\xff\xff\xff" + b"x" * 8):
        with pytest.raises(ValueError, match="description"):
            ipc.open_buffer(junk, (1,), torch.uint8)
    described = ipc.describe(torch.zeros(4, dtype=torch.int64).share_memory_())
    with pytest.raises(ValueError, match="bytes asked"):
        ipc.open_buffer(described, (5,), torch.int64)


CPU_CHILD = textwrap.dedent(
    """
    import socket, sys, torch
    from tandem.link import ipc
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sys.argv[1])
    whole = ipc.open_buffer(ipc.recv_frame(conn), (64,), torch.int64)
    view = ipc.open_buffer(ipc.recv_frame(conn), (2, 8), torch.float32)
    whole.copy_(torch.arange(64) * 5)
    view.fill_(1.5)
    ipc.send_frame(conn, b"written")
    assert ipc.recv_frame(conn) == b"done"
    """
)


@pytest.mark.e2e
def test_a_child_writes_shared_cpu_buffers_this_process_reads(tmp_path: Path) -> None:
    whole = torch.zeros(64, dtype=torch.int64).share_memory_()  # the reader allocates
    table = torch.zeros(4, 8).share_memory_()
    with _child(tmp_path, CPU_CHILD) as conn:
        ipc.send_frame(conn, ipc.describe(whole))
        ipc.send_frame(conn, ipc.describe(table[1:3]))  # a view: rows 1 and 2 only
        assert ipc.recv_frame(conn) == b"written"  # CPU writes are done when it says so
        assert torch.equal(whole, torch.arange(64) * 5)
        assert table[1:3].eq(1.5).all() and table[0].eq(0).all() and table[3].eq(0).all()
        ipc.send_frame(conn, b"done")


@contextlib.contextmanager
def _child(tmp_path: Path, code: str) -> Iterator[socket.socket]:
    """A child process running ``code`` connected to this one over a Unix socket."""
    path = tmp_path / "ipc.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    child = subprocess.Popen([sys.executable, "-c", code, str(path)])
    try:
        server.settimeout(120)
        conn, _ = server.accept()
        with conn:
            yield conn
    finally:
        assert child.wait(timeout=120) == 0
        server.close()


CHILD = textwrap.dedent(
    """
    import socket, sys, torch
    from tandem.link import ipc
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sys.argv[1])
    buf = ipc.open_buffer(ipc.recv_frame(conn), (1024,), torch.int64)
    event = torch.cuda.Event(interprocess=True)
    torch.cuda._sleep(50_000_000)  # the write lands well after the notice is sent
    buf.copy_(torch.arange(1024, device="cuda") * 3)
    event.record()
    ipc.send_frame(conn, event.ipc_handle())
    assert ipc.recv_frame(conn) == b"done"
    """
)


@pytest.mark.gpu
@pytest.mark.e2e
def test_a_child_writes_a_buffer_this_process_reads_behind_its_event(tmp_path: Path) -> None:
    buf = torch.zeros(1024, dtype=torch.int64, device="cuda")  # the reader allocates
    with _child(tmp_path, CHILD) as conn:
        ipc.send_frame(conn, ipc.describe(buf))
        with pytest.raises(ValueError, match="bytes asked"):
            ipc.open_buffer(ipc.describe(buf), (2048,), torch.int64)
        event = ipc.open_event(ipc.recv_frame(conn))
        torch.cuda.current_stream().wait_event(event)
        copy = buf.clone()  # enqueued behind the wait: sees the child's write
        assert torch.equal(copy, torch.arange(1024, device="cuda") * 3)
        ipc.send_frame(conn, b"done")
