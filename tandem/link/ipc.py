"""Buffers and events shared between two processes on one host, described as raw bytes: what
docs/device-cycle.md's transport between the services is built from.

``describe`` turns a tensor into bytes another process passes to ``open_buffer`` to map the
same memory: a CUDA tensor through CUDA IPC (torch's own record, as ``torch.multiprocessing``
sends it, without pickle), a CPU tensor in shared memory (``share_memory_()``) through torch's
shared-memory files, the stand-in the CPU tests use. A view describes its storage and where it
sits in it. Interprocess CUDA events go as their ``ipc_handle()`` bytes (``open_event``); CPU
work is done when the host moves on, so a notice alone orders it. ``send_frame``/``recv_frame``
length-prefix messages on a stream socket, with a cap. Rules the callers keep:

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
_VIEW = struct.Struct("<QQ")  # the view's offset and bytes in its storage
_CUDA = struct.Struct("<qQQQ?")  # device, size, offset, counter offset, event sync required
_PART = struct.Struct("<I")
MAX_FRAME = 1 << 20  # bytes of one frame: handles and notices, never tensors


def describe(tensor: torch.Tensor) -> bytes:
    """The bytes another process needs to map ``tensor``'s memory (a contiguous CUDA tensor,
    or a contiguous CPU tensor in shared memory)."""
    if not tensor.is_contiguous():
        raise ValueError("describe: the tensor must be contiguous")
    storage = tensor.untyped_storage()
    view = _VIEW.pack(tensor.storage_offset() * tensor.element_size(), tensor.nbytes)
    if tensor.device.type == "cuda":
        device, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()
        numbers = _CUDA.pack(device, size, offset, counter_offset, sync)
        return _join([b"cuda", view, numbers, handle, counter, event])
    if tensor.device.type == "cpu":
        if not tensor.is_shared():
            raise ValueError("describe: a CPU tensor must be in shared memory (share_memory_())")
        manager, handle, size = storage._share_filename_cpu_()
        return _join([b"cpu", view, manager, handle, struct.pack("<Q", size)])
    raise ValueError(f"describe: {tensor.device} memory cannot be shared")


def open_buffer(description: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``shape``/``dtype`` tensor over the memory ``description`` (``describe``) names;
    ValueError when the description is malformed or names fewer bytes than asked."""
    parts = _split(description)
    if len(parts) < 2 or len(parts[1]) != _VIEW.size:
        raise ValueError("open_buffer: malformed description")
    start, nbytes = _VIEW.unpack(parts[1])
    need = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if need > nbytes:
        raise ValueError(f"open_buffer: {need} bytes asked of a {nbytes}-byte buffer")
    if parts[0] == b"cuda" and len(parts) == 6 and len(parts[2]) == _CUDA.size:
        device, size, offset, counter_offset, sync = _CUDA.unpack(parts[2])
        handle, counter, event = parts[3:]
        torch.cuda.init()  # opening a handle before this process's first CUDA call crashes
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(
                device, handle, size, offset, counter, counter_offset, event, sync
            )
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    elif parts[0] == b"cpu" and len(parts) == 5 and len(parts[4]) == 8:
        manager, handle = parts[2], parts[3]
        (size,) = struct.unpack("<Q", parts[4])
        storage = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, size)
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        raise ValueError("open_buffer: malformed description")
    if start + nbytes > storage.nbytes():
        raise ValueError("open_buffer: the view lies outside its storage")
    flat = flat.set_(storage)
    return flat[start : start + need].view(dtype).view(shape)


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


def _join(parts: list[bytes]) -> bytes:
    return b"".join(_PART.pack(len(p)) + p for p in parts)


def _split(description: bytes) -> list[bytes]:
    parts: list[bytes] = []
    at = 0
    while at < len(description):
        if at + _PART.size > len(description) or len(parts) >= 8:
            raise ValueError("open_buffer: malformed description")
        (n,) = _PART.unpack_from(description, at)
        at += _PART.size
        if at + n > len(description):
            raise ValueError("open_buffer: malformed description")
        parts.append(description[at : at + n])
        at += n
    return parts
