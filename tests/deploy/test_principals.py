"""Request ids are scoped to the client certificate under mutual TLS: a real gateway
(``start_gateway``) in front of the service tests' EchoTarget (paused, so requests stay
running), two clients with certificates of one CA and different names. One cannot abort the
other's request nor learn that its id runs; each aborts its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from gateway.__main__ import Gateway, start_gateway
from gateway.config import GatewayConfig
from tandem.models.tokenizer import load_tokenizer
from tandem.serving.security import ClientTLS, ServerTLS, open_channel
from tandem.testing.random_model import write_tokenizer
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.deploy.helpers import run
from tests.deploy.pki import PKI, Issued
from tests.helpers.gateway import EchoTarget, start_target


@asynccontextmanager
async def mtls_gateway(pki: PKI, tokenizer_dir: Path) -> AsyncIterator[tuple[Gateway, EchoTarget]]:
    target = EchoTarget()
    target.paused = True  # requests run until aborted
    target_server, target_port = await start_target(target)
    config = GatewayConfig(
        target_addr=f"127.0.0.1:{target_port}",
        tokenizer=tokenizer_dir,
        host="127.0.0.1",
        port=0,
        tls=ServerTLS(
            cert=pki.server.cert,
            key=pki.server.key,
            client_ca=pki.ca.cert,
            require_client_cert=True,
        ),
    )
    started = await start_gateway(config, tokenizer=load_tokenizer(tokenizer_dir))
    try:
        await started.client.wait_connected(10.0)
        yield started, target
    finally:
        await started.stop(None)
        await target_server.stop(None)


def test_a_client_certificate_sees_and_aborts_only_its_own_requests(
    pki: PKI, tmp_path: Path
) -> None:
    write_tokenizer(tmp_path / "tokenizer", 64)
    alice_cert = pki.ca.issue("alice", hosts=("alice.clients.example",))
    bob_cert = pki.ca.issue("bob", hosts=("bob.clients.example",))

    def tls(issued: Issued) -> ClientTLS:
        return ClientTLS(ca=pki.ca.cert, cert=issued.cert, key=issued.key)

    async def body() -> None:
        async with mtls_gateway(pki, tmp_path / "tokenizer") as (gateway, target):
            address = f"127.0.0.1:{gateway.port}"
            alice_channel = open_channel(address, tls=tls(alice_cert))
            bob_channel = open_channel(address, tls=tls(bob_cert))
            async with alice_channel, bob_channel:
                alice = gateway_pb2_grpc.GatewayServiceStub(alice_channel)
                bob = gateway_pb2_grpc.GatewayServiceStub(bob_channel)
                request = gateway_pb2.GenerateRequest(
                    request_id="x",
                    token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]),
                    sampling=common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True),
                )

                async def finish(stub: gateway_pb2_grpc.GatewayServiceStub) -> int:
                    async for response in stub.Generate(request, timeout=30):
                        if response.WhichOneof("payload") == "complete":
                            return int(response.complete.finish_reason)
                    return -1

                alices = asyncio.create_task(finish(alice))
                while len(target.admits) < 1:
                    await asyncio.sleep(0.01)
                # Bob names Alice's id: nothing, as for an id nobody runs.
                aborted = await bob.Abort(gateway_pb2.AbortRequest(request_ids=["x"]))
                assert list(aborted.aborted_request_ids) == []
                # Bob runs the same id: no "already running" tells him Alice's is.
                bobs = asyncio.create_task(finish(bob))
                while len(target.admits) < 2:
                    await asyncio.sleep(0.01)
                assert target.admits[0].request_id != target.admits[1].request_id
                # Alice's own duplicate check holds.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await finish(alice)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                # Each aborts its own, and only its own.
                aborted = await bob.Abort(gateway_pb2.AbortRequest(request_ids=["x"]))
                assert list(aborted.aborted_request_ids) == ["x"]
                assert await bobs == common_pb2.FINISH_REASON_ABORT
                assert not alices.done()
                aborted = await alice.Abort(gateway_pb2.AbortRequest(request_ids=["x"]))
                assert list(aborted.aborted_request_ids) == ["x"]
                assert await alices == common_pb2.FINISH_REASON_ABORT

    run(body)
