"""The internal hops over mutual TLS, with the real clients: the target's RemoteDrafter to a real
draft service, and the gateway's TargetClient to a target server. The right client certificate
gets a working stream; none, or one from another CA, never connects."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from draft_service.config import DraftServiceConfig
from gateway.target_client import TargetClient
from tandem.link.remote import RemoteDrafter
from tandem.serving.security import ClientTLS, ServerTLS, server_credentials
from tandem.spec.base import DraftState
from tandem.v1 import target_pb2_grpc
from tests.deploy.pki import PKI
from tests.helpers.draft_service import (
    LAYERS,
    SPEC,
    Ckpts,
    Feed,
    ServerThread,
    ckpts,  # noqa: F401 (a fixture)
)
from tests.helpers.gateway import EchoTarget


def mtls(pki: PKI) -> ServerTLS:
    return ServerTLS(
        cert=pki.server.cert, key=pki.server.key, client_ca=pki.ca.cert, require_client_cert=True
    )


def test_remote_drafter_over_mtls(pki: PKI, ckpts: Ckpts, tmp_path: Path) -> None:  # noqa: F811
    # The draft also serves a local socket: a client with TLS settings never takes it (its
    # file permissions are not certificates), and one without still needs the TLS port first.
    config = DraftServiceConfig(
        draft=ckpts.draft_config(), tls=mtls(pki), local_socket=str(tmp_path / "draft.sock")
    )
    server = ServerThread(config)
    right = ClientTLS(ca=pki.ca.cert, cert=pki.client.cert, key=pki.client.key)
    wrong = [
        ClientTLS(ca=pki.ca.cert),  # no client certificate
        ClientTLS(ca=pki.ca.cert, cert=pki.foreign_client.cert, key=pki.foreign_client.key),
        None,  # plain text to a TLS port
    ]
    try:
        good = RemoteDrafter(server.address, num_target_layers=LAYERS, tls=right, deadline_s=10)
        try:
            assert good.wait_ready(20), "the right certificate did not connect"
            assert good.local_connects == 0 and not good.connection.local_stream
            feed = Feed(7)
            trees = good.step([feed.admit("a", 6)], [], [])
            assert set(trees) == {"a"} and len(trees["a"]) == SPEC.tree_size
        finally:
            good.close()
        for tls in wrong:
            bad = RemoteDrafter(
                server.address, num_target_layers=LAYERS, tls=tls, backoff_max_s=0.2
            )
            try:
                assert not bad.wait_ready(3), f"connected with {tls}"
                assert bad.state is DraftState.CONNECTING and bad.connects == 0
            finally:
                bad.close()
    finally:
        server.stop()


def test_target_client_over_mtls(pki: PKI) -> None:
    async def body() -> None:
        server = grpc.aio.server()
        target_pb2_grpc.add_TargetServiceServicer_to_server(EchoTarget(), server)
        port = server.add_secure_port("127.0.0.1:0", server_credentials(mtls(pki)))
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            right = ClientTLS(ca=pki.ca.cert, cert=pki.client.cert, key=pki.client.key)
            client = TargetClient(address, tls=right, backoff_max_s=0.2)
            await client.start()
            await client.wait_connected(10)
            assert client.info is not None
            await client.close()
            foreign = ClientTLS(
                ca=pki.ca.cert, cert=pki.foreign_client.cert, key=pki.foreign_client.key
            )
            for tls in (ClientTLS(ca=pki.ca.cert), foreign, None):
                client = TargetClient(address, tls=tls, backoff_max_s=0.2)
                await client.start()
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    await client.wait_connected(2)
                assert time.monotonic() - started >= 1.9 and client.info is None
                await client.close()
        finally:
            await server.stop(None)

    asyncio.run(body())
