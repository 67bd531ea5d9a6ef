"""Tensors on the wire: ``Tensor`` messages and chunked ``TensorFrame`` s.

Tensors travel as their raw row-major little-endian element bytes (docs/design.md section 6; bf16
as its uint16 bit pattern): a `Tensor` message for small ones, `TensorFrame` chunks of at most
4 MiB serialized for anything that grows with the prompt or the batch (built by
``tandem.wire.framing``). Decoding trusts nothing:
dtype, shape, sizes, chunk order and a byte cap (and, where the receiver knows it, the exact
dtype and shape it expects) are checked before a byte is copied, and every mismatch raises
`InvalidRequest` naming the field. A tensor's buffer grows with the chunks that arrive, never
with the size its first chunk announces, so frames that announce more than they carry cost
what they carry. There is no pickle and no `torch.load`
here; bytes become tensors only through `torch.frombuffer` on a private copy.

Hosts are little-endian (x86-64, aarch64), so element bytes are sent and received as they lie in
memory; importing this module on a big-endian host fails rather than corrupting tensors.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.errors import InvalidRequest
from tandem.v1 import common_pb2
from tandem.v1.common_pb2 import Tensor, TensorFrame

if sys.byteorder != "little":  # lifted by byte-swapping in _encode/_decode when one is needed
    raise ImportError("tandem.wire supports little-endian hosts only")

MAX_FRAME_BYTES = 4 * 1024 * 1024  # default cap on one TensorFrame's serialized size
MAX_NDIM = 8  # more dimensions than any tensor of the contract needs; bounds hostile shapes

_DTYPES: dict[common_pb2.Dtype, torch.dtype] = {
    common_pb2.DTYPE_FLOAT32: torch.float32,
    common_pb2.DTYPE_FLOAT16: torch.float16,
    common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    common_pb2.DTYPE_INT32: torch.int32,
    common_pb2.DTYPE_INT64: torch.int64,
    common_pb2.DTYPE_BOOL: torch.bool,
    common_pb2.DTYPE_FLOAT64: torch.float64,
    common_pb2.DTYPE_UINT8: torch.uint8,
    common_pb2.DTYPE_INT8: torch.int8,
    common_pb2.DTYPE_INT16: torch.int16,
}
_PROTO_DTYPES: dict[torch.dtype, common_pb2.Dtype] = {v: k for k, v in _DTYPES.items()}

_I64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Expected:
    """The dtype and shape a receiver knows a tensor must have (negotiated on its stream)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def proto_dtype(dtype: torch.dtype) -> common_pb2.Dtype:
    """The `Dtype` enum value of a torch dtype; ValueError if the wire cannot carry it."""
    try:
        return _PROTO_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no wire representation") from None


def torch_dtype(dtype: common_pb2.Dtype, *, path: str = "") -> torch.dtype:
    """The torch dtype of a `Dtype` enum value; InvalidRequest if it is unknown or unset."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise InvalidRequest(_field(path, "dtype"), f"unsupported dtype {dtype}") from None


def tensor_to_proto(t: torch.Tensor) -> Tensor:
    """Encode a tensor (any device, any strides) as one `Tensor` message."""
    dtype, shape, data = _encode(t)
    return Tensor(dtype=dtype, shape=shape, data=data)


def tensor_from_proto(msg: Tensor, *, max_bytes: int, path: str = "") -> torch.Tensor:
    """Decode a `Tensor` message into a new CPU tensor that owns its memory.

    `path` is the message's place in its request (e.g. "outcomes[2].logits"), prefixed to the
    field named by an InvalidRequest.
    """
    dtype, shape = _check_header(
        msg.dtype, msg.shape, len(msg.data), max_bytes=max_bytes, path=path, size_field="data"
    )
    return _decode(bytearray(msg.data), dtype, shape, path=path)


def tensor_from_frames(
    frames: Iterable[TensorFrame],
    *,
    max_bytes: int,
    path: str = "",
    shared: Callable[[int, int], torch.Tensor] | None = None,
    expect: Expected | None = None,
) -> torch.Tensor:
    """Decode exactly one tensor from all of its frames (e.g. a repeated TensorFrame field);
    ``shared`` and ``expect`` as for ``FrameAssembler``."""
    assembler = FrameAssembler(max_bytes=max_bytes, path=path, shared=shared, expect=expect)
    result: torch.Tensor | None = None
    for frame in frames:
        if result is not None:
            raise InvalidRequest(_field(path, "chunk_index"), "frames after the last chunk")
        result = assembler.add(frame)
    if result is None:
        raise InvalidRequest(path or "frames", "incomplete tensor: its last chunk is missing")
    return result


class FrameAssembler:
    """Rebuilds tensors from their `TensorFrame`s, one tensor at a time, checking each frame.

    Frames of a tensor must arrive in order. Chunk 0 announces the dtype, shape and total size,
    checked against `max_bytes` (and `expect`, the dtype and shape the stream negotiated, where
    given) before anything is copied; the buffer then grows chunk by chunk. `add` returns the
    tensor with its last chunk and the assembler is then ready for the next tensor; after an
    InvalidRequest it drops the partial tensor and is likewise ready for a chunk 0.
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        path: str = "",
        shared: Callable[[int, int], torch.Tensor] | None = None,
        expect: Expected | None = None,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.path = path
        self.expect = expect
        # A tensor in a shared buffer (``shared_offset``): (offset, bytes) -> a uint8 copy of
        # them; InvalidRequest when they lie outside it. None: such frames are refused.
        self.shared = shared
        self.reset()

    def reset(self) -> None:
        """Drop any partial tensor."""
        self._buffer: bytearray | None = None  # [total_bytes] raw element bytes
        self._name = ""
        self._num_chunks = 0
        self._total_bytes = 0
        self._dtype = torch.uint8
        self._shape: tuple[int, ...] = ()
        self._next_index = 0
        self._received = 0

    @property
    def in_progress(self) -> bool:
        """Whether a tensor has started and is waiting for more chunks."""
        return self._buffer is not None

    def add(self, frame: TensorFrame) -> torch.Tensor | None:
        """Take the next frame; return the finished tensor with its last chunk, else None (a
        CPU tensor, or for a shared frame the copy ``shared`` makes, on its device)."""
        if frame.WhichOneof("payload") == "shared_offset":
            return self._shared(frame)
        try:
            if self._buffer is None:
                self._start(frame)
            else:
                self._check_continuation(frame)
            self._append(frame)
        except InvalidRequest:
            self.reset()
            raise
        if self._next_index < self._num_chunks:
            return None
        assert self._buffer is not None
        tensor = _decode(self._buffer, self._dtype, self._shape, path=self.path)
        self.reset()
        return tensor

    def _start(self, frame: TensorFrame) -> None:
        if frame.chunk_index != 0:
            raise InvalidRequest(
                self._field("chunk_index"), f"a tensor starts at chunk 0, got {frame.chunk_index}"
            )
        if frame.num_chunks < 1:
            raise InvalidRequest(self._field("num_chunks"), "must be at least 1")
        self._dtype, self._shape = self._header(frame)
        if frame.num_chunks > max(1, frame.total_bytes):
            raise InvalidRequest(
                self._field("num_chunks"),
                f"{frame.num_chunks} chunks for {frame.total_bytes} bytes; chunks are not empty",
            )
        self._name = frame.name
        self._num_chunks = frame.num_chunks
        self._total_bytes = frame.total_bytes
        # Grown by each chunk (``_append``): memory follows the bytes received, not the bytes
        # announced (a large buffer's realloc moves pages, not bytes).
        self._buffer = bytearray()

    def _header(self, frame: TensorFrame) -> tuple[torch.dtype, tuple[int, ...]]:
        """A first chunk's dtype and shape, checked against ``expect`` first, then against
        its size and ``max_bytes``."""
        expect = self.expect
        if expect is not None:
            dtype = torch_dtype(frame.dtype, path=self.path)
            if dtype != expect.dtype:
                raise InvalidRequest(
                    self._field("dtype"), f"{dtype}, the stream negotiated {expect.dtype}"
                )
            if len(frame.shape) != len(expect.shape) or tuple(frame.shape) != expect.shape:
                shown = list(frame.shape[: MAX_NDIM + 1])
                raise InvalidRequest(
                    self._field("shape"), f"{shown}, expected {list(expect.shape)}"
                )
        return _check_header(
            frame.dtype,
            frame.shape,
            frame.total_bytes,
            max_bytes=self.max_bytes,
            path=self.path,
            size_field="total_bytes",
        )

    def _shared(self, frame: TensorFrame) -> torch.Tensor:
        """A whole tensor in one frame whose bytes lie in the shared buffer."""
        if self.shared is None:
            raise InvalidRequest(self._field("shared_offset"), "no shared buffer on this stream")
        if self._buffer is not None:
            self.reset()
            raise InvalidRequest(self._field("shared_offset"), "inside an inline tensor's chunks")
        if frame.chunk_index != 0 or frame.num_chunks != 1 or frame.byte_offset != 0:
            raise InvalidRequest(self._field("num_chunks"), "a shared tensor is one whole chunk")
        dtype, shape = self._header(frame)
        if dtype == torch.bool:
            raise InvalidRequest(self._field("dtype"), "bool tensors are sent inline")
        raw = self.shared(frame.shared_offset, frame.total_bytes)
        return raw.view(dtype).reshape(shape)

    def _check_continuation(self, frame: TensorFrame) -> None:
        if frame.name != self._name:
            raise InvalidRequest(
                self._field("name"), f"expected a chunk of {self._name!r}, got {frame.name!r}"
            )
        if frame.chunk_index != self._next_index:
            raise InvalidRequest(
                self._field("chunk_index"),
                f"expected chunk {self._next_index}, got {frame.chunk_index}",
            )
        if frame.num_chunks != self._num_chunks:
            raise InvalidRequest(
                self._field("num_chunks"), f"changed from {self._num_chunks} to {frame.num_chunks}"
            )
        if frame.total_bytes != self._total_bytes:
            raise InvalidRequest(
                self._field("total_bytes"),
                f"changed from {self._total_bytes} to {frame.total_bytes}",
            )
        if frame.dtype != common_pb2.DTYPE_UNSPECIFIED:
            raise InvalidRequest(self._field("dtype"), "set only in chunk 0")
        if frame.shape:
            raise InvalidRequest(self._field("shape"), "set only in chunk 0")

    def _append(self, frame: TensorFrame) -> None:
        assert self._buffer is not None
        if frame.WhichOneof("payload") != "data":
            raise InvalidRequest(self._field("data"), "missing: only inline bytes are supported")
        if frame.byte_offset != self._received:
            raise InvalidRequest(
                self._field("byte_offset"), f"expected {self._received}, got {frame.byte_offset}"
            )
        data = frame.data  # each read copies the bytes out of the message
        size = len(data)
        end = self._received + size
        is_last = frame.chunk_index == self._num_chunks - 1
        if end > self._total_bytes:
            raise InvalidRequest(self._field("data"), f"chunk ends past total_bytes, at {end}")
        if size == 0 and self._total_bytes > 0:
            raise InvalidRequest(self._field("data"), "empty chunk")
        if is_last and end != self._total_bytes:
            raise InvalidRequest(
                self._field("data"), f"last chunk ends at byte {end} of {self._total_bytes}"
            )
        if not is_last and end == self._total_bytes:
            raise InvalidRequest(
                self._field("num_chunks"), f"data complete at chunk {frame.chunk_index}"
            )
        self._buffer += data
        self._received = end
        self._next_index += 1

    def _field(self, name: str) -> str:
        return _field(self.path, name)


def _field(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _encode(t: torch.Tensor) -> tuple[common_pb2.Dtype, list[int], bytes]:
    """(dtype enum, shape, row-major little-endian bytes) of a tensor."""
    dtype, shape, flat = _element_bytes(t)
    return dtype, shape, flat.tobytes()


def _element_bytes(t: torch.Tensor) -> tuple[common_pb2.Dtype, list[int], np.ndarray]:
    """(dtype enum, shape, the row-major little-endian bytes as a uint8 array that may share
    the tensor's memory) of a tensor."""
    if t.layout != torch.strided:
        raise ValueError(f"only strided tensors have a wire representation, got {t.layout}")
    dtype = proto_dtype(t.dtype)
    flat = t.detach().to("cpu").contiguous().reshape(-1)  # [numel]
    return dtype, list(t.shape), flat.view(torch.uint8).numpy()


def _check_header(
    dtype: common_pb2.Dtype,
    shape: Sequence[int],
    num_bytes: int,
    *,
    max_bytes: int,
    path: str,
    size_field: str,
) -> tuple[torch.dtype, tuple[int, ...]]:
    """Validate a tensor header against its byte count and cap; return torch dtype and shape."""
    torch_type = torch_dtype(dtype, path=path)
    if len(shape) > MAX_NDIM:
        raise InvalidRequest(
            _field(path, "shape"), f"{len(shape)} dimensions, at most {MAX_NDIM} allowed"
        )
    if any(dim > _I64_MAX for dim in shape):
        raise InvalidRequest(_field(path, "shape"), f"dimension too large in {list(shape)}")
    if num_bytes > max_bytes:
        raise InvalidRequest(
            _field(path, size_field), f"{num_bytes} bytes exceeds the cap of {max_bytes}"
        )
    expected = math.prod(shape) * torch_type.itemsize
    if expected != num_bytes:
        raise InvalidRequest(
            _field(path, size_field),
            f"shape {list(shape)} of {torch_type} needs {expected} bytes, got {num_bytes}",
        )
    return torch_type, tuple(shape)


def _decode(
    buffer: bytearray, dtype: torch.dtype, shape: tuple[int, ...], *, path: str
) -> torch.Tensor:
    """A CPU tensor viewing `buffer` (which it keeps alive); the header is already checked."""
    if not buffer:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        raw = torch.frombuffer(buffer, dtype=torch.uint8)  # [numel]
        if bool((raw > 1).any()):
            raise InvalidRequest(_field(path, "data"), "bool elements must be 0 or 1")
        return raw.view(torch.bool).reshape(shape)
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)
