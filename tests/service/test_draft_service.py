"""The draft service in-process (grpc.aio on 127.0.0.1:0, its own loop thread) as its
clients see it on the wire: health and GetInfo, streams that break the protocol, a bad
request in a message, errors and their statuses, and the command line. The RemoteDrafter
talking to it: test_remote_drafter.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.rpc import code_pb2, error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from draft_service.__main__ import parse_config
from draft_service.config import DraftServiceConfig
from tandem import wire
from tandem.errors import CheckpointError, InvalidRequest, KVExhausted, NotFound
from tandem.serving import rpc
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from tests.helpers.draft_service import (
    FEATURES,
    HIDDEN,
    LAYERS,
    SPEC,
    VOCAB,
    Ckpts,
    ServerThread,
    wait_until,
)


def test_health_and_info(ckpts: Ckpts) -> None:
    s = ServerThread(DraftServiceConfig(draft=ckpts.draft_config()), load=False)
    try:
        with grpc.insecure_channel(s.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest
            assert health.Check(check()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            s.run(s.server.load())
            assert health.Check(check()).status == health_pb2.HealthCheckResponse.SERVING
            name = check(service="tandem.v1.DraftService")
            assert health.Check(name).status == health_pb2.HealthCheckResponse.SERVING
            info = stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest())
        assert info.draft_kind == common_pb2.DRAFT_KIND_EAGLE3
        local = ckpts.local()
        # draft.proto's -1 is transformers' hidden_states[LAYERS], the final normed state
        wire_ids = tuple(-1 if i == LAYERS else i for i in local.target_layer_ids)
        assert tuple(info.target_layer_ids) == wire_ids
        assert (info.hidden_size, info.vocab_size, info.target_vocab_size) == (HIDDEN, 512, VOCAB)
        assert info.hidden_dtype == common_pb2.DTYPE_FLOAT32
        assert info.kv_usage.pages_total == 256 and info.kv_usage.pages_used == 0
    finally:
        s.stop()


def _abort_status(requests: list[draft_pb2.SpeculateRequest], address: str) -> Any:
    with grpc.insecure_channel(address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Speculate(iter(requests)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    return bad.field_violations[0].field


def test_stream_without_hello_is_invalid(server: ServerThread) -> None:
    assert _abort_status([draft_pb2.SpeculateRequest(step_id=1)], server.address) == "hello"
    hello = draft_pb2.SpeculateHello(protocol_version=2)
    field = _abort_status([draft_pb2.SpeculateRequest(hello=hello)], server.address)
    assert field == "hello.protocol_version"


def test_bad_request_in_a_message_drops_only_that_request(server: ServerThread) -> None:
    spec = wire.spec_to_proto(SPEC)

    def admit(request_id: str, ids: list[int]) -> draft_pb2.DraftAdmit:
        return draft_pb2.DraftAdmit(
            request_id=request_id, prompt_token_ids=ids[:-1], verified_token_id=ids[-1],
            speculation=spec,
        )  # fmt: skip

    def frames(request_id: str, rows: int) -> draft_pb2.PromptFrames:
        tensor = torch.randn(rows, FEATURES)
        return draft_pb2.PromptFrames(
            request_id=request_id, frames=wire.tensor_to_frames("hidden_states", tensor)
        )

    hello = draft_pb2.SpeculateHello(protocol_version=1)
    good = draft_pb2.VerifyOutcome(request_id="good", bonus_token_id=5, committed_len=99)
    good.hidden_states.extend(wire.tensor_to_frames("hidden_states", torch.randn(1, FEATURES)))
    ghost = draft_pb2.VerifyOutcome(request_id="ghost", bonus_token_id=5, committed_len=9)
    requests = [
        draft_pb2.SpeculateRequest(hello=hello),
        draft_pb2.SpeculateRequest(
            step_id=1,
            new_requests=[admit("good", [7, 8, 9, 10]), admit("bad", [7, VOCAB])],
            prompt_frames=[frames("good", 3), frames("bad", 1)],
        ),
        draft_pb2.SpeculateRequest(step_id=2, outcomes=[ghost, good]),  # good: wrong length
    ]
    with grpc.insecure_channel(server.address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        first, second, third = stub.Speculate(iter(requests))
    assert first.hello.protocol_version == 1 and first.hello.max_message_bytes > 0
    assert list(first.hello.tensor_transports) == [draft_pb2.TENSOR_TRANSPORT_INLINE]
    assert second.step_id == 1 and [t.request_id for t in second.trees] == ["good"]
    assert list(second.dropped_request_ids) == ["bad"]
    assert second.kv_usage.pages_used > 0 and second.total_ns >= second.draft_ns > 0
    assert list(third.dropped_request_ids) == ["ghost", "good"] and not third.trees
    wait_until(lambda: server.num_tracked() == 0)


def test_unexpected_errors_are_internal(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def boom() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(server.server.engine, "kv_usage", boom)
    with grpc.insecure_channel(server.address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest())
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "internal error: RuntimeError: boom"


def test_status_mapping() -> None:
    status = rpc.status_for(InvalidRequest("sampling.top_p", "must be in (0, 1]"))
    bad = error_details_pb2.BadRequest()
    assert status.code == code_pb2.INVALID_ARGUMENT and status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "sampling.top_p"
    assert rpc.status_for(NotFound("req-1")).code == code_pb2.NOT_FOUND
    exhausted = rpc.status_for(KVExhausted("need 4 pages"))
    assert exhausted.code == code_pb2.RESOURCE_EXHAUSTED
    assert exhausted.details[0].Is(error_details_pb2.RetryInfo.DESCRIPTOR)
    assert rpc.status_for(CheckpointError("no config")).code == code_pb2.INTERNAL
    assert rpc.status_for(KeyError("x")).message == "internal error: KeyError: 'x'"


def test_env_defaults_and_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_DRAFT_TARGET", str(tmp_path))
    monkeypatch.setenv("TANDEM_DRAFT_KIND", "ngram")
    monkeypatch.setenv("TANDEM_DRAFT_PORT", "5678")
    monkeypatch.setenv("TANDEM_DRAFT_REFLECTION", "yes")
    config = parse_config(["--grace", "2.5"])
    assert (config.draft.kind, config.draft.target, config.port) == ("ngram", tmp_path, 5678)
    assert config.reflection and config.grace_s == 2.5
    assert parse_config(["--port", "0", "--no-reflection"]).port == 0
    monkeypatch.setenv("TANDEM_DRAFT_PORT", "http")
    with pytest.raises(ValueError, match="TANDEM_DRAFT_PORT"):
        parse_config([])
    monkeypatch.setenv("TANDEM_DRAFT_PORT", "1")
    with pytest.raises(SystemExit):
        parse_config(["--draft-kind", "eagle3"])  # eagle3 needs --draft
    with pytest.raises(ValueError, match="TANDEM_"):
        rpc.env_default("DRAFT_PORT", 0)
    assert parse_config([]).draft.cuda_graphs is None  # on for CUDA devices, off on CPU
    assert not parse_config([]).draft.use_cuda_graphs
    assert parse_config(
        ["--device", "cuda", "--draft-kind", "eagle3", "--draft", "d"]
    ).draft.use_cuda_graphs
    assert parse_config(["--device", "cuda", "--no-cuda-graphs"]).draft.cuda_graphs is False
    with pytest.raises(SystemExit):
        parse_config(["--cuda-graphs"])  # CUDA graphs on a CPU device
    monkeypatch.setenv("TANDEM_DRAFT_CUDA_GRAPHS", "off")
    assert parse_config(["--device", "cuda"]).draft.cuda_graphs is False
    assert parse_config([]).draft.transposed_weights is None  # on for CUDA devices
    assert parse_config(["--device", "cuda"]).draft.use_transposed_weights
    assert parse_config(["--transposed-weights"]).draft.use_transposed_weights  # CPU, asked
    monkeypatch.setenv("TANDEM_DRAFT_TRANSPOSED_WEIGHTS", "off")
    assert not parse_config(["--device", "cuda"]).draft.use_transposed_weights
    assert rpc.parse_address("[::1]:50051") == ("::1", 50051)
    assert rpc.format_address("::1", 50051) == "[::1]:50051"
    with pytest.raises(ValueError, match="HOST:PORT"):
        rpc.parse_address("localhost")
