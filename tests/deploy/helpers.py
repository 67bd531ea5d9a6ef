"""Helpers of the deployment tests: a health-only server on loopback, health checks through
``tandem.serving.security.open_channel`` and through the probe as a real process."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.serving import rpc
from tandem.serving.security import ClientTLS, ServerTLS, open_channel, server_credentials

TEST_SERVICE = "tandem.v1.TestService"


def run(coro_fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))


@asynccontextmanager
async def health_server(
    tls: ServerTLS | None = None,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    serving_now: bool = True,
    host: str = "127.0.0.1",
) -> AsyncIterator[tuple[int, rpc.Health]]:
    """A real grpc.aio server from ``rpc.make_server`` with health only."""
    server = rpc.make_server(interceptors=interceptors)
    health = rpc.add_health(server, [TEST_SERVICE])
    if serving_now:
        await health.set_serving()
    credentials = None if tls is None else server_credentials(tls)
    port = rpc.bind(server, f"{host}:0", credentials)
    await server.start()
    try:
        yield port, health
    finally:
        await server.stop(None)


async def check(
    address: str, *, tls: ClientTLS | None = None, token: str | None = None
) -> grpc.StatusCode | str:
    """The health status name when served, else the RPC's status code."""
    async with open_channel(address, tls=tls, token=token) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


async def probe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``python -m tandem.serving.health_probe ARGS`` as a real process: (exit status, stdout)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tandem.serving.health_probe",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode()
