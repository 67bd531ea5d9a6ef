"""Device buffers and events shared between two processes on one GPU (CUDA IPC), described
as raw bytes: what docs/device-cycle.md's transport between the services is built from.

``describe`` turns a CUDA tensor that owns its whole storage into bytes another process on
the same host passes to ``open_buffer`` to map the same memory (torch's own CUDA IPC record,
as ``torch.multiprocessing`` sends it, without pickle). Interprocess events go as their
``ipc_handle()`` bytes (``open_event``). ``send_frame``/``recv_frame`` length-prefix messages
on a stream socket, with a cap. Rules the callers keep:

- The process that reads a buffer allocates it and the writer maps it: a process that dies
  then leaves no mapping into memory its peer freed.
- A wait on another process's event waits for the last record made *before the wait was
  enqueued*: the recorder tells its peer (a notice on the socket) after each record, and the
  peer enqueues its wait only after that notice.
"""

from __future__ import annotations

import socket
import struct

import torch

_HEADER = struct.Struct("<Q")
_NUMBERS = struct.Struct("<qQQQ?")  # device, size, offset, counter offset, event sync required
_PART = struct.Struct("<I")
MAX_FRAME = 1 << 20  # bytes of one frame: handles and notices, never tensors


def describe(tensor: torch.Tensor) -> bytes:
    """The bytes another process needs to map ``tensor`` (CUDA, owning its whole storage)."""
    if tensor.device.type != "cuda":
        raise ValueError(f"describe: needs a CUDA tensor, not {tensor.device}")
    storage = tensor.untyped_storage()
    if tensor.storage_offset() != 0 or tensor.nbytes != storage.nbytes():
        raise ValueError("describe: the tensor must be its whole storage (allocate it alone)")
    device, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()
    parts = [_NUMBERS.pack(device, size, offset, counter_offset, sync), handle, counter, event]
    return b"".join(_PART.pack(len(p)) + p for p in parts)


def open_buffer(description: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``shape``/``dtype`` tensor over the memory ``description`` (``describe``) names;
    ValueError when the description is malformed or the memory is smaller than asked."""
    parts: list[bytes] = []
    at = 0
    while at < len(description) and len(parts) < 4:
        if at + _PART.size > len(description):
            raise ValueError("open_buffer: truncated description")
        (n,) = _PART.unpack_from(description, at)
        at += _PART.size
        if at + n > len(description):
            raise ValueError("open_buffer: truncated description")
        parts.append(description[at : at + n])
        at += n
    if len(parts) != 4 or at != len(description) or len(parts[0]) != _NUMBERS.size:
        raise ValueError("open_buffer: malformed description")
    device, size, offset, counter_offset, sync = _NUMBERS.unpack(parts[0])
    handle, counter, event = parts[1:]
    need = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if need > size:
        raise ValueError(f"open_buffer: {need} bytes asked of a {size}-byte buffer")
    torch.cuda.init()  # opening a handle before this process's first CUDA call crashes
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(
            device, handle, size, offset, counter, counter_offset, event, sync
        )
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage)
    return flat[:need].view(dtype).view(shape)


def open_event(handle: bytes, device: int | None = None) -> torch.cuda.Event:
    """Another process's interprocess event (its ``ipc_handle()``) on CUDA device ``device``
    (None: the current one)."""
    index = torch.cuda.current_device() if device is None else device
    return torch.cuda.Event.from_ipc_handle(index, handle)


def send_frame(conn: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_FRAME:
        raise ValueError(f"send_frame: {len(payload)} bytes is over {MAX_FRAME}")
    conn.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(conn: socket.socket) -> bytes:
    """One frame; ConnectionError when the peer closed, ValueError past ``MAX_FRAME``."""
    (n,) = _HEADER.unpack(recv_exactly(conn, _HEADER.size))
    if n > MAX_FRAME:
        raise ValueError(f"recv_frame: a {n}-byte frame is over {MAX_FRAME}")
    return recv_exactly(conn, n)


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(n - got)
        if not chunk:
            raise ConnectionError("peer closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
