"""Sizes checked before work: the gateway's screen of a Generate request's bytes and its prompt
reader, the frame assembler's expected header and its buffer that grows with what arrives, and
the slow-reader watch."""

from __future__ import annotations

import asyncio
import tracemalloc
from pathlib import Path

import pytest
import torch

from gateway.prompt import PromptReader
from gateway.screen import MAX_FIELDS, OTHER_BYTES, screen_generate
from gateway.slow_readers import ReadWatch
from tandem import wire
from tandem.errors import InvalidRequest
from tandem.models.tokenizer import load_tokenizer
from tandem.testing.random_model import write_tokenizer
from tandem.v1 import common_pb2, gateway_pb2, target_pb2

LEN = 512  # the model's context in these tests
INFO = target_pb2.TargetServiceGetInfoResponse(max_model_len=LEN, vocab_size=1000)


def _screen(request: gateway_pb2.GenerateRequest | bytes) -> None:
    data = request if isinstance(request, bytes) else request.SerializeToString()
    screen_generate(data, max_model_len=LEN, bytes_per_token=16)


def _field(exc: pytest.ExceptionInfo[InvalidRequest]) -> str:
    return exc.value.field


def test_the_screen_passes_what_the_model_can_serve() -> None:
    sampling = common_pb2.SamplingParams(stop_strings=["x" * 256] * 8, max_new_tokens=3)
    _screen(gateway_pb2.GenerateRequest(text="é" * (LEN * 8), sampling=sampling))
    _screen(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[2**32 - 1] * LEN)))
    unpacked = b"".join(b"\x08" + wire.varint(2**32 - 1) for _ in range(LEN))  # ids, unpacked
    field = wire.length_tag(gateway_pb2.GenerateRequest, "token_ids")
    _screen(field + wire.varint(len(unpacked)) + unpacked)
    _screen(b"\xff\xff\xff")  # not a message: the parser refuses it


def test_the_screen_refuses_by_size_naming_the_field() -> None:
    with pytest.raises(InvalidRequest) as text:
        _screen(gateway_pb2.GenerateRequest(text="a" * (LEN * 16 + 1)))
    assert _field(text) == "text"
    many = gateway_pb2.TokenIds(ids=[5] * (LEN * 6 + 1))  # (the reader counts them exactly)
    with pytest.raises(InvalidRequest) as ids:
        _screen(gateway_pb2.GenerateRequest(token_ids=many))
    assert _field(ids) == "token_ids"
    stops = common_pb2.SamplingParams(stop_token_ids=list(range(OTHER_BYTES)))
    with pytest.raises(InvalidRequest) as sampling:
        _screen(gateway_pb2.GenerateRequest(text="a", sampling=stops))
    assert _field(sampling) == "sampling"
    repeated = gateway_pb2.GenerateRequest(request_id="a").SerializeToString()
    with pytest.raises(InvalidRequest) as fields:
        _screen(repeated * (MAX_FIELDS + 1))
    assert _field(fields) == "request"


def test_the_prompt_reader_counts_and_measures_before_it_reads(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 1000)
    reader = PromptReader(load_tokenizer(tmp_path))

    async def read(request: gateway_pb2.GenerateRequest) -> list[int]:
        return await reader.read(request, INFO)

    try:
        assert asyncio.run(read(gateway_pb2.GenerateRequest(text="w5 w6"))) == [1, 5, 6]
        for request, field in [
            (gateway_pb2.GenerateRequest(text="w5 " * LEN * 6), "text"),  # bytes, untokenized
            (gateway_pb2.GenerateRequest(text="w5 " * LEN), "text"),  # tokens, once tokenized
            (
                gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[5] * LEN)),
                "token_ids",
            ),
            (gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1000])), "token_ids"),
            (gateway_pb2.GenerateRequest(), "prompt"),
        ]:
            with pytest.raises(InvalidRequest) as exc:
                asyncio.run(read(request))
            assert _field(exc) == field, exc.value
    finally:
        reader.close()


def _first_chunk(shape: list[int], dtype: common_pb2.Dtype, total: int) -> common_pb2.TensorFrame:
    return common_pb2.TensorFrame(
        name="h",
        chunk_index=0,
        num_chunks=2,
        total_bytes=total,
        dtype=dtype,
        shape=shape,
        data=bytes(64),
    )


def test_frames_must_announce_the_expected_header() -> None:
    expect = wire.Expected(torch.float32, (4, 8))
    assembler = wire.FrameAssembler(max_bytes=expect.nbytes, path="p", expect=expect)
    f32, f64 = common_pb2.DTYPE_FLOAT32, common_pb2.DTYPE_FLOAT64
    for frame, field in [
        (_first_chunk([4, 8], f64, 256), "p.dtype"),
        (_first_chunk([400, 8], f32, 12800), "p.shape"),
        (_first_chunk([4, 8, 1], f32, 128), "p.shape"),
    ]:
        with pytest.raises(InvalidRequest) as exc:
            assembler.add(frame)
        assert _field(exc) == field
    assert assembler.add(_first_chunk([4, 8], f32, 128)) is None
    last = common_pb2.TensorFrame(
        name="h", chunk_index=1, num_chunks=2, byte_offset=64, total_bytes=128, data=bytes(64)
    )
    out = assembler.add(last)
    assert out is not None and out.shape == (4, 8) and out.dtype == torch.float32


def test_a_tensors_buffer_grows_with_what_arrives() -> None:
    assembler = wire.FrameAssembler(max_bytes=1 << 40)
    big = _first_chunk([256 << 20], common_pb2.DTYPE_UINT8, 256 << 20)  # 256 MiB announced
    tracemalloc.start()
    try:
        assert assembler.add(big) is None and assembler.in_progress
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated for 64 received"


def test_the_read_watch_fires_once_a_write_waits_too_long() -> None:
    fired: list[bool] = []

    async def run() -> ReadWatch:
        watch = ReadWatch(0.05, lambda: fired.append(True))
        watch.writing()
        await asyncio.sleep(0.01)
        watch.written()  # taken in time
        await asyncio.sleep(0.1)
        assert not fired and not watch.expired
        watch.writing()
        await asyncio.sleep(0.1)  # not taken
        return watch

    watch = asyncio.run(run())
    assert fired == [True] and watch.expired
    assert "cut off" in watch.reason
