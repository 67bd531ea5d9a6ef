"""Request lifecycle through the three real processes: cancelling half of 32 streams leaves the
others unchanged and frees every page on both services; each invalid field is named and the
server keeps serving; beyond the admission bound a request is refused with RESOURCE_EXHAUSTED;
SIGTERM lets in-flight requests finish and refuses new ones."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem.apps.demo import free_port
from tandem.apps.launch import Stack, build_stack
from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.target.engine import Engine
from tandem.testing.random_model import make_checkpoint
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.e2e

NEW_TOKENS = 24
STREAMS = 32


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("life") / "target", "llama", seed=3)


def start(target: Path, tmp: Path, *gateway_args: str) -> Stack:
    stack = build_stack(
        target=target,
        draft=target,  # the target as its own draft: real trees, drafts accepted
        draft_kind="model",
        mtp_mode="chain",
        spec_args=["--spec-steps", "3"],
        page_size=16,
        device="cpu",
        dtype="float32",
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        draft_deadline_s=10.0,
        extra_gateway_args=gateway_args,
    )
    stack.start(log_dir=tmp / "logs")
    return stack


def request(ids: list[int], max_new_tokens: int = NEW_TOKENS) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True
        ),
    )


async def collect(call: Any) -> tuple[list[int], Any]:
    tokens: list[int] = []
    complete = None
    while (response := await call.read()) is not grpc.aio.EOF:  # read(): some were read before
        if response.WhichOneof("payload") == "chunk":
            tokens += response.chunk.token_ids
        elif response.WhichOneof("payload") == "complete":
            complete = response.complete
    return tokens, complete


def prompts() -> list[list[int]]:
    return [[(31 * i + 7 * j) % 900 + 4 for j in range(2 + i % 9)] for i in range(STREAMS)]


def test_cancelling_half_of_32_streams_frees_every_page(target: Path, tmp_path: Path) -> None:
    engine = Engine(EngineConfig(model=target, max_num_seqs=STREAMS))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reference = [r.token_ids for r in engine.generate(prompts(), params)]
    stack = start(target, tmp_path)
    port = stack.services[-1].port

    async def scenario() -> tuple[list[list[int]], gateway_pb2.GetServerInfoResponse, int]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)

            async def cancelled(ids: list[int]) -> None:
                call = stub.Generate(request(ids))
                first = await call.read()
                assert first.WhichOneof("payload") == "chunk"
                call.cancel()

            runs = [
                cancelled(p) if i % 2 == 0 else collect(stub.Generate(request(p)))
                for i, p in enumerate(prompts())
            ]
            done = await asyncio.gather(*runs)
            lanes = 0
            info = await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # the target reports its pools every 0.25 s
                info = await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())
                lanes = max(lanes, len(info.lanes))
                if info.target_kv_usage.pages_used == 0 and info.draft_kv_usage.pages_used == 0:
                    break
                await asyncio.sleep(0.1)
            outputs = [d[0] for i, d in enumerate(done) if i % 2 == 1]  # type: ignore[index]
            return outputs, info, lanes

    try:
        outputs, info, _ = asyncio.run(scenario())
    finally:
        stack.stop()
    assert outputs == [r for i, r in enumerate(reference) if i % 2 == 1]
    assert info.target_kv_usage.pages_total > 0 and info.draft_kv_usage.pages_total > 0
    assert info.target_kv_usage.pages_used == 0, info
    assert info.draft_kv_usage.pages_used == 0, info
    assert info.num_running == 0


def test_invalid_fields_are_named_and_serving_goes_on(target: Path, tmp_path: Path) -> None:
    stack = start(target, tmp_path)
    port = stack.services[-1].port

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            model = await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
            vocab, context = model.vocab_size, model.max_model_len
            bad = [
                (gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds()), "token_ids"),
                (request([5, vocab]), "token_ids"),
                (request(list(range(4, 4 + context))), "token_ids"),
                (request([5], max_new_tokens=0), "sampling.max_new_tokens"),
            ]
            for field, value in (("temperature", -1.0), ("top_p", 1.5)):
                invalid = request([5])
                setattr(invalid.sampling, field, value)
                bad.append((invalid, f"sampling.{field}"))
            for message, field in bad:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(stub.Generate(message))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
                assert (info.value.details() or "").startswith(f"{field}:"), info.value
            tokens, complete = await collect(stub.Generate(request([5, 6, 7])))
            assert len(tokens) == NEW_TOKENS and complete.usage.draft_tokens > 0

    try:
        asyncio.run(scenario())
    finally:
        stack.stop()


def test_admission_bound_then_sigterm_drains(target: Path, tmp_path: Path) -> None:
    stack = start(target, tmp_path, "--max-running", "2", "--max-queue", "1", "--grace", "60")
    gateway = stack.services[-1]
    many = 400  # long enough to be in flight when the signal comes

    async def scenario() -> tuple[list[tuple[list[int], Any]], grpc.StatusCode, grpc.StatusCode]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            calls = [stub.Generate(request([5 + i, 6], max_new_tokens=many)) for i in range(3)]
            runs = [asyncio.create_task(collect(c)) for c in calls]  # two run, one waits
            deadline = time.monotonic() + 10
            info = await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())
            while info.num_waiting < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                info = await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())
            assert info.num_waiting >= 1 and not any(r.done() for r in runs)
            with pytest.raises(grpc.aio.AioRpcError) as over:
                await collect(stub.Generate(request([9])))
            exhausted = over.value.code()
            assert gateway.proc is not None
            gateway.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await collect(stub.Generate(request([10])))
            assert not all(r.done() for r in runs)  # still in flight after the signal
            return list(await asyncio.gather(*runs)), exhausted, late.value.code()

    try:
        results, exhausted, late = asyncio.run(scenario())
        assert gateway.proc is not None
        assert gateway.proc.wait(60) == 0  # drained, then exited cleanly
    finally:
        stack.stop()
    assert exhausted == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert late == grpc.StatusCode.UNAVAILABLE
    for tokens, complete in results:  # every in-flight request finished in full
        assert len(tokens) == many and complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
