"""tandem.wire: tensors and frames survive the wire bit-exactly, and bad input is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import wire
from tandem.errors import InvalidRequest
from tandem.v1 import common_pb2, draft_pb2
from tandem.v1.common_pb2 import Tensor, TensorFrame
from tandem.wire.framing import add_frames

MiB = 1024 * 1024
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
]


def _raw(t: torch.Tensor) -> bytes:
    """The element bytes of t, so NaNs and -0.0 compare bit-exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.device.type == "cpu"
    assert _raw(a) == _raw(b)


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        if t.numel() >= 4:  # values a lossy path would lose or normalise
            flat = t.view(-1)
            flat[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


def test_every_wire_dtype_is_mapped() -> None:
    values = {v for v in common_pb2.Dtype.values() if v != common_pb2.DTYPE_UNSPECIFIED}
    assert {wire.proto_dtype(d) for d in DTYPES} == values
    for d in DTYPES:
        assert wire.torch_dtype(wire.proto_dtype(d)) == d


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (5, 33)], ids=str)
def test_tensor_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _sample(dtype, shape)
    msg = Tensor.FromString(wire.tensor_to_proto(t).SerializeToString())
    assert list(msg.shape) == list(shape)
    _assert_same(wire.tensor_from_proto(msg, max_bytes=MiB), t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (0, 4), (300, 7)], ids=str)
def test_frames_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _sample(dtype, shape)
    frames = wire.tensor_to_frames("hidden_states", t, max_chunk_bytes=512)
    wired = [TensorFrame.FromString(f.SerializeToString()) for f in frames]
    _assert_same(wire.tensor_from_frames(wired, max_bytes=MiB), t)


@pytest.mark.parametrize("max_chunk_bytes", [512, wire.MAX_FRAME_BYTES])
def test_add_frames_builds_tensor_to_frames_frames_in_place(max_chunk_bytes: int) -> None:
    """Frames appended to a message's repeated field are the ones tensor_to_frames builds,
    chunked (512 bytes) or whole."""
    t = _sample(torch.bfloat16, (300, 7))
    expected = wire.tensor_to_frames("hidden_states", t, max_chunk_bytes=max_chunk_bytes)
    msg = draft_pb2.VerifyOutcome()
    add_frames(msg.hidden_states, "hidden_states", t, max_chunk_bytes=max_chunk_bytes)
    assert list(msg.hidden_states) == expected
    assert (len(expected) > 1) == (max_chunk_bytes == 512)
    _assert_same(wire.tensor_from_frames(msg.hidden_states, max_bytes=MiB), t)


@pytest.mark.parametrize("max_chunk_bytes", [256, 4096, wire.MAX_FRAME_BYTES])
@pytest.mark.parametrize("shape", [(0, 5), (3, 7), (300, 7)])
def test_encoded_frames_know_their_serialized_size(
    max_chunk_bytes: int, shape: tuple[int, ...]
) -> None:
    """An EncodedFrame's ``size`` is what the frame serializes to (a message is sized without
    serialising its frames), and it builds the frame tensor_to_frames builds."""
    t = _sample(torch.bfloat16, shape)
    encoded = wire.encode_frames("hidden_states", t, max_chunk_bytes)
    expected = wire.tensor_to_frames("hidden_states", t, max_chunk_bytes=max_chunk_bytes)
    msg = draft_pb2.PromptFrames(request_id="r")
    for frame in encoded:
        frame.add_to(msg.frames)
    assert list(msg.frames) == expected
    assert [f.size for f in encoded] == [f.ByteSize() for f in expected]
    assert all(f.size <= max_chunk_bytes for f in encoded)


def test_bfloat16_travels_as_little_endian_uint16_bits() -> None:
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)  # bits 0x3F80, 0xC000
    msg = wire.tensor_to_proto(t)
    assert msg.dtype == common_pb2.DTYPE_BFLOAT16
    assert msg.data == b"\x80\x3f\x00\xc0"


def test_non_contiguous_and_grad_inputs_are_encoded_by_value() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6).requires_grad_()
    view = base.t()[1:, ::2]  # [5, 2], non-contiguous
    out = wire.tensor_from_proto(wire.tensor_to_proto(view), max_bytes=MiB)
    assert torch.equal(out, view.detach())
    assert out.is_contiguous()


def test_decoded_tensor_owns_its_memory() -> None:
    msg = wire.tensor_to_proto(torch.zeros(4, dtype=torch.int32))
    out = wire.tensor_from_proto(msg, max_bytes=MiB)
    out += 7  # writable, and must not write through to the message
    assert msg.data == bytes(16)


def test_unencodable_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="no wire representation"):
        wire.tensor_to_proto(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="strided"):
        wire.tensor_to_proto(torch.zeros(2, 2).to_sparse())


def test_large_tensor_chunks_under_4_mib_and_reassembles() -> None:
    t = torch.randn(2500, 1024, dtype=torch.float32)  # 10,240,000 bytes
    frames = wire.tensor_to_frames("hidden_states", t)
    assert len(frames) == 3
    assert all(f.ByteSize() < 4 * MiB for f in frames)
    assert all(len(f.data) % 64 == 0 for f in frames[:-1])  # no element split across frames
    assert [f.chunk_index for f in frames] == [0, 1, 2]
    assert {f.num_chunks for f in frames} == {3}
    assert {f.total_bytes for f in frames} == {t.numel() * 4}
    offsets = [f.byte_offset for f in frames]
    assert offsets == [0, len(frames[0].data), len(frames[0].data) + len(frames[1].data)]
    assert list(frames[0].shape) == [2500, 1024]
    assert all(f.dtype == common_pb2.DTYPE_UNSPECIFIED and not f.shape for f in frames[1:])
    out = wire.tensor_from_frames(frames, max_bytes=16 * MiB)
    _assert_same(out, t)


def test_frame_size_bound_counts_the_header() -> None:
    shape = (3, 5, 7, 11)
    t = torch.ones(shape, dtype=torch.float64)
    for max_chunk_bytes in (256, 300, 1000, 4096):
        frames = wire.tensor_to_frames("x" * 40, t, max_chunk_bytes=max_chunk_bytes)
        assert all(f.ByteSize() <= max_chunk_bytes for f in frames)
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        wire.tensor_to_frames("x" * 40, t, max_chunk_bytes=100)


def test_assembler_is_reusable_across_tensors() -> None:
    a, b = _sample(torch.float16, (40, 9), seed=1), _sample(torch.int64, (13,), seed=2)
    assembler = wire.FrameAssembler(max_bytes=MiB)
    results: list[torch.Tensor] = []
    for t in (a, b):
        for frame in wire.tensor_to_frames("h", t, max_chunk_bytes=256):
            assert not results or assembler.in_progress or frame.chunk_index == 0
            out = assembler.add(frame)
            if out is not None:
                results.append(out)
    assert not assembler.in_progress
    _assert_same(results[0], a)
    _assert_same(results[1], b)


# ---- validation: every path raises InvalidRequest naming the field ----


def _tensor_msg(**overrides: object) -> Tensor:
    msg = wire.tensor_to_proto(torch.arange(6, dtype=torch.int32).reshape(2, 3))
    for key, value in overrides.items():
        if key == "shape":
            del msg.shape[:]
            msg.shape.extend(cast("list[int]", value))
        else:
            setattr(msg, key, value)
    return msg


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"dtype": common_pb2.DTYPE_UNSPECIFIED}, "dtype"),
        ({"dtype": 99}, "dtype"),
        ({"shape": [1] * 9}, "shape"),
        ({"shape": [2**63, 0]}, "shape"),
        ({"shape": [3, 3]}, "data"),
        ({"shape": []}, "data"),
        ({"data": b"\x00" * 23}, "data"),
        ({"dtype": common_pb2.DTYPE_INT64}, "data"),
        ({"dtype": common_pb2.DTYPE_BOOL, "shape": [2], "data": b"\x01\x02"}, "data"),
    ],
)
def test_tensor_validation(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        wire.tensor_from_proto(_tensor_msg(**overrides), max_bytes=MiB)
    assert info.value.field == field


def test_tensor_cap_and_path() -> None:
    msg = _tensor_msg()
    assert wire.tensor_from_proto(msg, max_bytes=24).shape == (2, 3)
    with pytest.raises(InvalidRequest) as info:
        wire.tensor_from_proto(msg, max_bytes=23, path="outcomes[2].logits")
    assert info.value.field == "outcomes[2].logits.data"
    assert "cap" in info.value.reason


def _frames() -> list[TensorFrame]:
    """Three frames of a [96, 2] float32 tensor (768 bytes; 256 data bytes per frame)."""
    t = torch.arange(192, dtype=torch.float32).reshape(96, 2)
    frames = wire.tensor_to_frames("hidden_states", t, max_chunk_bytes=350)
    assert [len(f.data) for f in frames] == [256, 256, 256]
    return frames


Mutation = Callable[[list[TensorFrame]], None]


def _set(index: int, **values: object) -> Mutation:
    def mutate(frames: list[TensorFrame]) -> None:
        for key, value in values.items():
            if key == "shape":
                frames[index].shape.extend(cast("list[int]", value))
            else:
                setattr(frames[index], key, value)

    return mutate


def _clear_payload(index: int) -> Mutation:
    return lambda frames: frames[index].ClearField("payload")


def _drop(index: int) -> Mutation:
    def mutate(frames: list[TensorFrame]) -> None:
        del frames[index]

    return mutate


def _swap(i: int, j: int) -> Mutation:
    def mutate(frames: list[TensorFrame]) -> None:
        frames[i], frames[j] = frames[j], frames[i]

    return mutate


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_drop(0), "chunk_index"),
        (_set(0, chunk_index=1), "chunk_index"),
        (_set(0, num_chunks=0), "num_chunks"),
        (_set(0, dtype=common_pb2.DTYPE_UNSPECIFIED), "dtype"),
        (_set(0, dtype=77), "dtype"),
        (_set(0, dtype=common_pb2.DTYPE_FLOAT64), "total_bytes"),
        (_set(0, shape=[5]), "total_bytes"),
        (_set(0, num_chunks=769), "num_chunks"),
        (_set(1, name="other"), "name"),
        (_swap(1, 2), "chunk_index"),
        (_drop(1), "chunk_index"),
        (_set(1, num_chunks=4), "num_chunks"),
        (_set(2, total_bytes=1024), "total_bytes"),
        (_set(1, dtype=common_pb2.DTYPE_FLOAT32), "dtype"),
        (_set(2, shape=[96, 2]), "shape"),
        (_clear_payload(1), "data"),
        (_set(1, byte_offset=0), "byte_offset"),
        (_set(1, data=b"\x00" * 600), "data"),
        (_set(2, data=b"\x00" * 300), "data"),
        (_set(1, data=b""), "data"),
        (_set(2, data=b"\x00" * 255), "data"),
        (_set(1, data=b"\x00" * 512), "num_chunks"),
        (_drop(2), "frames"),
    ],
)
def test_frame_validation(mutate: Mutation, field: str) -> None:
    frames = _frames()
    mutate(frames)
    with pytest.raises(InvalidRequest) as info:
        wire.tensor_from_frames(frames, max_bytes=MiB)
    assert info.value.field == field


def test_frames_complete_before_the_last_chunk() -> None:
    frames = _frames()
    frames[0].num_chunks = frames[1].num_chunks = frames[2].num_chunks = 4
    with pytest.raises(InvalidRequest) as info:
        wire.tensor_from_frames(frames, max_bytes=MiB)
    assert info.value.field == "num_chunks"


def test_frames_after_the_last_chunk() -> None:
    frames = _frames()
    with pytest.raises(InvalidRequest) as info:
        wire.tensor_from_frames([*frames, frames[0]], max_bytes=MiB, path="prompt_frames[0]")
    assert info.value.field == "prompt_frames[0].chunk_index"


def test_no_frames() -> None:
    with pytest.raises(InvalidRequest) as info:
        wire.tensor_from_frames([], max_bytes=MiB, path="outcomes[0].hidden_states")
    assert info.value.field == "outcomes[0].hidden_states"


def test_frame_cap_is_checked_before_buffering() -> None:
    header = TensorFrame(
        name="h", chunk_index=0, num_chunks=1, total_bytes=2**40, dtype=common_pb2.DTYPE_UINT8
    )
    header.shape.append(2**40)
    assembler = wire.FrameAssembler(max_bytes=MiB, path="p")
    with pytest.raises(InvalidRequest) as info:
        assembler.add(header)
    assert info.value.field == "p.total_bytes"
    assert not assembler.in_progress


def test_bool_frames_reject_other_bytes() -> None:
    frames = wire.tensor_to_frames("mask", torch.ones(3, dtype=torch.bool))
    frames[0].data = b"\x01\x00\x05"
    with pytest.raises(InvalidRequest) as info:
        wire.tensor_from_frames(frames, max_bytes=MiB)
    assert info.value.field == "data"


def test_assembler_recovers_after_an_error() -> None:
    frames = _frames()
    assembler = wire.FrameAssembler(max_bytes=MiB)
    assert assembler.add(frames[0]) is None
    assert assembler.in_progress
    with pytest.raises(InvalidRequest):
        assembler.add(frames[2])
    assert not assembler.in_progress
    results = [assembler.add(f) for f in frames]
    assert results[:2] == [None, None]
    assert results[2] is not None and results[2].shape == (96, 2)
    with pytest.raises(ValueError, match="max_bytes"):
        wire.FrameAssembler(max_bytes=-1)


# ---- properties ----


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=4)))
    numel = 1
    for dim in shape:
        numel *= dim
    if dtype == torch.bool:
        data = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        size = numel * dtype.itemsize
        data = draw(st.binary(min_size=size, max_size=size))
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


@settings(max_examples=200, deadline=None)
@given(t=_tensors(), max_chunk_bytes=st.integers(256, 2048))
def test_round_trip_property(t: torch.Tensor, max_chunk_bytes: int) -> None:
    wire_msg = Tensor.FromString(wire.tensor_to_proto(t).SerializeToString())
    _assert_same(wire.tensor_from_proto(wire_msg, max_bytes=MiB), t)
    frames = wire.tensor_to_frames("t", t, max_chunk_bytes=max_chunk_bytes)
    assert all(f.ByteSize() <= max_chunk_bytes for f in frames)
    _assert_same(wire.tensor_from_frames(frames, max_bytes=MiB), t)


_random_frames = st.builds(
    TensorFrame,
    name=st.sampled_from(["h", "g"]),
    chunk_index=st.integers(0, 3),
    num_chunks=st.integers(0, 4),
    byte_offset=st.integers(0, 64),
    total_bytes=st.integers(0, 64),
    dtype=st.integers(0, 12),
    shape=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 8), max_size=3),
    data=st.binary(max_size=64),
)


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(_random_frames, min_size=1, max_size=4))
def test_arbitrary_frames_decode_or_raise_invalid_request(frames: list[TensorFrame]) -> None:
    try:
        out = wire.tensor_from_frames(frames, max_bytes=48)
    except InvalidRequest:
        return
    assert out.numel() * out.dtype.itemsize == frames[0].total_bytes <= 48
