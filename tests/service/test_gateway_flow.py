"""The gateway's flow control and health over gRPC, against `EchoTarget`
(tests/helpers/gateway.py): admission, queueing and overload, aborts from the client and
refusals from the target, a target that dies and comes back, health before the target
connects, and the model and server info."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2_grpc

from gateway.__main__ import SERVICE_NAME, start_gateway
from gateway.config import GatewayConfig
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2
from tests.helpers.gateway import (
    ABORT,
    EOS,
    LENGTH,
    MAX_MODEL_LEN,
    NOT_SERVING,
    SERVING,
    VOCAB,
    EchoTarget,
    free_port,
    generate,
    health_status,
    ids_request,
    rich_status,
    run,
    stack,
    start_target,
    wait_until,
)


def test_overload_queueing_and_abort(words: Path) -> None:
    async def body() -> None:
        async with stack(words, max_running=1, max_queue=1, step_s=0.001) as s:
            s.target.paused = True
            first = s.stub.Generate(gateway_pb2.GenerateRequest(request_id="a", text="w5"))
            await wait_until(lambda: len(s.target.admits) == 1)
            second = s.stub.Generate(gateway_pb2.GenerateRequest(request_id="b", text="w6"))
            await wait_until(lambda: s.gateway.servicer.admission.num_waiting == 1)
            info = await s.stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())
            assert info.num_waiting == 1 and info.lanes[0].num_requests == 1

            with pytest.raises(grpc.aio.AioRpcError) as overload:
                await generate(s.stub, gateway_pb2.GenerateRequest(text="w7"))
            assert overload.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            (detail,) = rich_status(overload.value).details
            retry = error_details_pb2.RetryInfo()
            assert detail.Unpack(retry) and retry.retry_delay.ToNanoseconds() > 0

            with pytest.raises(grpc.aio.AioRpcError) as reuse:
                await generate(s.stub, gateway_pb2.GenerateRequest(request_id="a", text="w8"))
            assert reuse.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (reuse.value.details() or "").startswith("request_id:")

            # Abort the queued request (it never reaches the target), then the running one.
            response = await s.stub.Abort(gateway_pb2.AbortRequest(request_ids=["b", "nope"]))
            assert list(response.aborted_request_ids) == ["b"]
            (message,) = [m async for m in second]
            assert message.request_id == "b" and message.complete.finish_reason == ABORT
            response = await s.stub.Abort(gateway_pb2.AbortRequest(request_ids=["a"]))
            assert list(response.aborted_request_ids) == ["a"]
            (message,) = [m async for m in first]
            assert message.complete.finish_reason == ABORT
            (admit,) = s.target.admits
            assert admit.request_id.startswith("a#")
            assert [(list(a.request_ids), a.finish_reason) for a in s.target.aborts] == [
                ([admit.request_id], ABORT)
            ]
            # The slots are free again.
            s.target.paused = False
            _, complete = await generate(s.stub, ids_request([5], max_new_tokens=2))
            assert complete.finish_reason == LENGTH

    run(body)


def test_client_cancel_aborts_at_the_target(words: Path) -> None:
    async def body() -> None:
        async with stack(words, step_s=0.005) as s:
            request = ids_request([5, 6], max_new_tokens=MAX_MODEL_LEN - 2)
            request.request_id = "gone"
            call = s.stub.Generate(request)
            first = await call.read()
            assert first.chunk.token_ids
            call.cancel()
            await wait_until(lambda: bool(s.target.aborts))
            (admit,) = s.target.admits
            assert [(list(a.request_ids), a.finish_reason) for a in s.target.aborts] == [
                ([admit.request_id], ABORT)
            ]
            admission = s.gateway.servicer.admission
            await wait_until(lambda: admission.num_running == 0)
            assert s.gateway.client.num_in_flight == 0
            assert s.gateway.client.num_connects == 1
            # The id is free again at once, though the target may still be finishing "gone".
            request.sampling.max_new_tokens = 2
            _, complete = await generate(s.stub, request)
            assert complete.finish_reason == LENGTH

    run(body)


def test_target_refusal_reaches_the_client(words: Path) -> None:
    async def body() -> None:
        async with stack(words) as s:
            s.target.refuse = target_pb2.Commit(
                finish_reason=common_pb2.FINISH_REASON_ERROR,
                error=common_pb2.ErrorStatus(
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    message="too long for the pool",
                    field="prompt_ids",
                ),
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(s.stub, ids_request([5, 6]))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == "prompt_ids: too long for the pool"
            assert s.gateway.servicer.admission.num_running == 0

    run(body)


def test_target_death_fails_requests_quickly_and_reconnects(words: Path) -> None:
    async def body() -> None:  # failover off (test_gateway_failover.py has it on)
        async with stack(words, step_s=0.01, failover_wait_s=0) as s:
            assert await health_status(s.health) == SERVING
            call = s.stub.Generate(ids_request([5, 6], max_new_tokens=MAX_MODEL_LEN - 2))
            assert (await call.read()).chunk.token_ids
            s.target.paused = True
            queued = s.stub.Generate(ids_request([7], max_new_tokens=4))
            await wait_until(lambda: len(s.target.admits) == 2)
            port = int(s.gateway.client.address.rsplit(":", 1)[1])
            started = time.monotonic()
            await s.target_server.stop(0)
            # Started: the error message, then the status; not started: the status only.
            error = await call.read()
            assert error.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await queued.read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 2.0
            assert await health_status(s.health) == NOT_SERVING
            assert await health_status(s.health, SERVICE_NAME) == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(s.stub, ids_request([5]))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

            # The target comes back on the same address: the gateway reconnects.
            s.target_server, _ = await start_target(EchoTarget(), port)
            await s.gateway.client.wait_connected(10.0)
            assert await health_status(s.health) == SERVING
            _, complete = await generate(s.stub, ids_request([5], max_new_tokens=3))
            assert complete.finish_reason == LENGTH

    run(body)


def test_health_is_not_serving_until_the_target_connects(words: Path) -> None:
    async def body() -> None:
        port = free_port()
        config = GatewayConfig(
            target_addr=f"127.0.0.1:{port}", tokenizer=words, host="127.0.0.1", port=0
        )
        gateway = await start_gateway(config)
        target_server = None
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                await asyncio.sleep(0.2)
                assert await health_status(health) == NOT_SERVING
                assert await health_status(health, SERVICE_NAME) == NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await generate(stub, ids_request([5]))
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE

                target_server, _ = await start_target(EchoTarget(), port)
                await gateway.client.wait_connected(10.0)
                assert await health_status(health) == SERVING
                assert await health_status(health, SERVICE_NAME) == SERVING
        finally:
            await gateway.stop(0)
            if target_server is not None:
                await target_server.stop(0)

    run(body)


def test_model_and_server_info(words: Path) -> None:
    async def body() -> None:
        async with stack(words, tokens_per_step=3) as s:
            model = await s.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
            assert (model.model_id, model.vocab_size, model.max_model_len) == (
                "echo",
                VOCAB,
                MAX_MODEL_LEN,
            )
            assert list(model.eos_token_ids) == [EOS] and model.bos_token_id == 1
            assert model.tokenizer_id == str(words)
            assert model.draft_kind == common_pb2.DRAFT_KIND_NGRAM
            await generate(s.stub, ids_request([5, 6, 7], max_new_tokens=9))
            info = await s.stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())
            assert info.version and info.uptime_ns > 0
            assert info.draft_state == common_pb2.DRAFT_STATE_HEALTHY
            assert info.target_kv_usage.pages_total == 100
            assert info.target_kv_usage.pages_used == 3
            assert not info.HasField("draft_kv_usage")
            assert info.speculation.enabled
            assert info.speculation.draft_kind == common_pb2.DRAFT_KIND_NGRAM
            assert info.speculation.num_steps == 2
            (lane,) = info.lanes
            assert lane.lane_id == 0 and lane.accept_length == pytest.approx(3.0)
            assert (info.num_running, info.num_waiting) == (0, 0)

    run(body)
