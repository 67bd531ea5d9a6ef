"""Tensors into `TensorFrame` s (the sending side of ``tandem.wire.frames``): chunked frames
of at most a cap serialized, built into a message's repeated field, or kept encoded
(`EncodedFrame`) for a message joined from bytes."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.message import Message

from tandem.v1 import common_pb2
from tandem.v1.common_pb2 import TensorFrame
from tandem.wire.frames import MAX_FRAME_BYTES, _element_bytes, proto_dtype

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_DATA_FIELD_OVERHEAD = 1 + 10  # tag of TensorFrame.data + the longest length varint
_CHUNK_ALIGN = 64  # chunk sizes are a multiple of every itemsize, so no element is split


def tensor_to_frames(
    name: str, t: torch.Tensor, *, max_chunk_bytes: int = MAX_FRAME_BYTES
) -> list[TensorFrame]:
    """Split a tensor into frames whose serialized size (`ByteSize()`) is <= max_chunk_bytes.

    Chunk 0 carries dtype and shape; every chunk carries name, counts and offsets. An empty
    tensor is one frame with no data.
    """
    return [
        TensorFrame(**frame.header, data=frame.data.tobytes())
        for frame in encode_frames(name, t, max_chunk_bytes)
    ]


def add_frames(
    frames: RepeatedCompositeFieldContainer[TensorFrame],
    name: str,
    t: torch.Tensor,
    *,
    max_chunk_bytes: int = MAX_FRAME_BYTES,
) -> None:
    """Appends `tensor_to_frames`'s frames to a repeated TensorFrame field, built in place:
    appending a built frame copies its bytes once more (a step's outcome features cross the
    host several times already)."""
    for frame in encode_frames(name, t, max_chunk_bytes):
        frame.add_to(frames)


@dataclass(frozen=True)
class EncodedFrame:
    """One `TensorFrame` encoded, not in a message: its header fields and ``data``, the
    chunk's bytes, so a frame waiting to be sent costs no message of its own. ``add_to``
    builds it into a repeated field (one copy of the data); ``pieces`` are its serialized
    bytes, for a message joined from bytes (``tandem.link.messages.Outgoing``: upb would copy
    the data into the message and again in its encoder). ``size`` is the serialized size,
    known without serialising the data (upb's ``ByteSize`` encodes the whole message: a
    frame's 4 MiB again)."""

    header: dict[str, Any]
    data: memoryview  # the chunk's bytes in the tensor's memory: it must not change until sent

    @functools.cached_property
    def head(self) -> bytes:
        """The serialized fields before the data: the header, the data field's tag and
        length (built on first use: frames built into a message never need it); a shared
        frame's whole serialization (it has no data)."""
        if "shared_offset" in self.header:
            return TensorFrame(**self.header).SerializeToString()
        return TensorFrame(**self.header).SerializeToString() + _DATA_TAG + varint(len(self.data))

    @property
    def size(self) -> int:
        return len(self.head) + len(self.data)

    def add_to(self, frames: RepeatedCompositeFieldContainer[TensorFrame]) -> None:
        if "shared_offset" in self.header:
            frames.add(**self.header)
            return
        frames.add(**self.header, data=self.data.tobytes())

    def pieces(self) -> tuple[bytes, memoryview]:
        return self.head, self.data


def encode_frames(
    name: str, t: torch.Tensor, max_chunk_bytes: int = MAX_FRAME_BYTES
) -> list[EncodedFrame]:
    """`tensor_to_frames`'s frames as `EncodedFrame` s, their data views of the tensor's bytes
    (a copy first where it is not a contiguous CPU tensor): nothing is copied until a message
    is built or joined."""
    dtype, shape, flat = _element_bytes(t)
    chunk_bytes = _chunk_payload_bytes(name, dtype, tuple(shape), max_chunk_bytes)
    total_bytes = flat.size
    num_chunks = max(1, -(-total_bytes // chunk_bytes))
    frames = []
    for index in range(num_chunks):
        offset = index * chunk_bytes
        header: dict[str, Any] = {
            "name": name,
            "chunk_index": index,
            "num_chunks": num_chunks,
            "byte_offset": offset,
            "total_bytes": total_bytes,
        }
        if index == 0:
            header |= {"dtype": dtype, "shape": shape}
        data = flat[offset : offset + chunk_bytes].data  # a memoryview of the array
        frames.append(EncodedFrame(header=header, data=data))
    return frames


def shared_frame(name: str, t: torch.Tensor, offset: int) -> EncodedFrame:
    """The one frame of ``t`` (already written at byte ``offset`` of the buffer the receiver
    shared) that names where it lies instead of carrying its bytes."""
    header: dict[str, Any] = {
        "name": name,
        "chunk_index": 0,
        "num_chunks": 1,
        "byte_offset": 0,
        "total_bytes": t.numel() * t.element_size(),
        "dtype": proto_dtype(t.dtype),
        "shape": list(t.shape),
        "shared_offset": offset,
    }
    return EncodedFrame(header=header, data=memoryview(b""))


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def length_tag(message: type[Message], field: str) -> bytes:
    """The tag of a length-delimited field (a string, bytes or message) of ``message``."""
    return varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


_DATA_TAG = length_tag(TensorFrame, "data")


@functools.lru_cache(maxsize=256)
def _chunk_payload_bytes(
    name: str, dtype: common_pb2.Dtype, shape: tuple[int, ...], max_chunk_bytes: int
) -> int:
    """Data bytes per chunk so that a frame's serialized size stays <= max_chunk_bytes
    (cached: a step's outcomes repeat a few shapes, and sizing a header builds a message)."""
    widest_header = TensorFrame(
        name=name,
        chunk_index=_U32_MAX,
        num_chunks=_U32_MAX,
        byte_offset=_U64_MAX,
        total_bytes=_U64_MAX,
        dtype=dtype,
        shape=shape,
    ).ByteSize()
    payload = (max_chunk_bytes - widest_header - _DATA_FIELD_OVERHEAD) // _CHUNK_ALIGN
    if payload < 1:
        raise ValueError(
            f"max_chunk_bytes={max_chunk_bytes} leaves no room for data after a "
            f"{widest_header}-byte frame header"
        )
    return payload * _CHUNK_ALIGN
