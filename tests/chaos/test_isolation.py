"""Isolation between callers, against the three services as production starts them (real
processes, ``tandem.apps.launch.build_stack`` as ``tandem serve`` builds them): a client with
another bearer token can neither abort a request by its id nor learn that the id is running; a
second Control stream to the target can neither abort nor collide with the gateway's requests;
the services' metrics listen on loopback."""

from __future__ import annotations

import asyncio
import os
import secrets
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tandem.apps.demo import free_port
from tandem.apps.launch import Stack
from tandem.serving.security import token_metadata
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc
from tests.helpers.stacks import cpu_stack, random_family

pytestmark = pytest.mark.e2e

ALICE, BOB = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
LONG = 80  # tokens: running for seconds on the test model, while the other side tries


@dataclass(frozen=True)
class Ports:
    gateway: int
    target: int
    metrics: dict[str, int]  # service -> its Prometheus port


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    root = tmp_path_factory.mktemp("isolation")
    target, eagle3 = random_family(root)
    tokens = root / "tokens"
    tokens.write_text(f"# two clients\n{ALICE}\n{BOB}\n")
    metrics = {name: free_port() for name in ("gateway", "target", "draft")}
    variables = {f"TANDEM_{name.upper()}_METRICS_PORT": str(p) for name, p in metrics.items()}
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)  # the services inherit them, as from a shell
    running: Stack = cpu_stack(
        target,
        eagle3,
        extra_gateway_args=["--auth-token-file", str(tokens)],
    )
    try:
        running.start(log_dir=root / "logs")
        ports = {svc.name: svc.port for svc in running.services}
        yield Ports(gateway=ports["gateway"], target=ports["target"], metrics=metrics)
    finally:
        running.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _request(request_id: str, max_new_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7, 8]),
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


async def _generate(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    request: gateway_pb2.GenerateRequest,
    token: str,
    started: asyncio.Event | None = None,
) -> tuple[int, int]:
    """(finish reason, tokens received) of one Generate call."""
    received = 0
    async for response in stub.Generate(request, metadata=token_metadata(token), timeout=60):
        if response.WhichOneof("payload") == "chunk":
            received += len(response.chunk.token_ids)
            if started is not None:
                started.set()
        elif response.WhichOneof("payload") == "complete":
            return response.complete.finish_reason, received
    raise AssertionError("the stream ended without a completion")


def test_another_principal_cannot_abort_or_probe_my_request(stack: Ports) -> None:
    async def run() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.gateway}") as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            started = asyncio.Event()
            mine = asyncio.create_task(_generate(stub, _request("shared", LONG), ALICE, started))
            await asyncio.wait_for(started.wait(), 30)
            # Bob names Alice's id: nothing is aborted, exactly as for an id nobody runs.
            bob = token_metadata(BOB)
            answer = await stub.Abort(
                gateway_pb2.AbortRequest(request_ids=["shared"]), metadata=bob
            )
            assert list(answer.aborted_request_ids) == []
            # Bob may use the same id: no "already running" tells him Alice's is.
            assert await _generate(stub, _request("shared", 4), BOB) == (
                common_pb2.FINISH_REASON_LENGTH,
                4,
            )
            # Alice's own duplicate check still holds.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _generate(stub, _request("shared", 4), ALICE)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "already running" in (refused.value.details() or "")
            assert not mine.done()
            assert await mine == (common_pb2.FINISH_REASON_LENGTH, LONG)
            # And Alice can abort what is hers.
            started = asyncio.Event()
            other = asyncio.create_task(_generate(stub, _request("other", LONG), ALICE, started))
            await asyncio.wait_for(started.wait(), 30)
            alice = token_metadata(ALICE)
            answer = await stub.Abort(
                gateway_pb2.AbortRequest(request_ids=["other"]), metadata=alice
            )
            assert list(answer.aborted_request_ids) == ["other"]
            assert (await other)[0] == common_pb2.FINISH_REASON_ABORT

    asyncio.run(run())


def test_a_second_control_stream_cannot_abort_the_gateways_requests(stack: Ports) -> None:
    async def run() -> None:
        gateway = grpc.aio.insecure_channel(f"127.0.0.1:{stack.gateway}")
        target = grpc.aio.insecure_channel(f"127.0.0.1:{stack.target}")
        async with gateway, target:
            stub = gateway_pb2_grpc.GatewayServiceStub(gateway)
            started = asyncio.Event()
            victim = asyncio.create_task(_generate(stub, _request("victim", LONG), ALICE, started))
            await asyncio.wait_for(started.wait(), 30)
            # The gateway's ids at the target are the client's id and a sequence number:
            # guess every one of them, then admit one of the same ids on this stream.
            guesses = [f"victim#{n}" for n in range(1, 500)]
            admit = target_pb2.AdmitCommand(
                request_id="victim#1",
                prompt_token_ids=[5, 6, 7],
                sampling=common_pb2.SamplingParams(max_new_tokens=3, ignore_eos=True),
                speculation=common_pb2.SpeculationParams(enabled=False),
            )
            commands = [
                target_pb2.ControlRequest(
                    abort=target_pb2.AbortCommand(
                        request_ids=guesses, finish_reason=common_pb2.FINISH_REASON_ABORT
                    )
                ),
                target_pb2.ControlRequest(admit=admit),
            ]
            done = asyncio.Event()

            async def send() -> AsyncIterator[target_pb2.ControlRequest]:
                for command in commands:
                    yield command
                await done.wait()  # a stream whose sender leaves is detached: its requests end

            control = target_pb2_grpc.TargetServiceStub(target).Control(send())
            own: list[target_pb2.Commit] = []
            async for response in control:
                commits = [c for c in response.step.commits if c.request_id == "victim#1"]
                own += commits
                if any(c.finish_reason for c in commits):
                    break
            done.set()
            control.cancel()
            # Its own request ran under its own id; the gateway's went on untouched.
            assert own[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert sum(len(c.token_ids) for c in own) == 3
            assert await victim == (common_pb2.FINISH_REASON_LENGTH, LONG)

    asyncio.run(run())


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) of TCP sockets listening on
    ``port``."""
    found = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def _only_loopback(port: int) -> bool:
    # 127.0.0.1, as IPv4 or (gRPC's dual-stack sockets) as IPv4-mapped IPv6
    addresses = _listening(port)
    return bool(addresses) and addresses <= {"0100007F", "0000000000000000FFFF00000100007F"}


def test_metrics_and_ports_listen_on_loopback(stack: Ports) -> None:
    for service, port in stack.metrics.items():
        assert _only_loopback(port), (service, _listening(port))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200 and b"# TYPE" in reply.read(), service
    # tandem serve keeps the gateway local too (--gateway-host widens it)
    assert _only_loopback(stack.gateway), _listening(stack.gateway)
