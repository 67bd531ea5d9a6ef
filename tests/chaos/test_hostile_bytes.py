"""Hostile bytes and missing credentials against the three services as production starts them
(real processes, telemetry set up as ``python -m <service>`` sets it up): a message that does
not parse gets INVALID_ARGUMENT naming the request on every method, unary and streaming, of
every service; a public call without a valid bearer token gets UNAUTHENTICATED on every method,
the streaming ``Generate`` included; the services go on serving."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import grpc
import pytest

from tandem.apps.launch import Stack
from tandem.serving.security import token_metadata
from tandem.v1 import common_pb2, draft_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2
from tests.helpers.stacks import cpu_stack, random_family

pytestmark = pytest.mark.e2e

TOKEN = secrets.token_urlsafe(24)
AUTH = token_metadata(TOKEN)
INVALID_UTF8 = gateway_pb2.GenerateRequest(text="abc").SerializeToString().replace(b"c", b"\xff")
GARBAGE = {
    "random": b"\xff\xff\xff\xff\xff\xff",
    "truncated": gateway_pb2.GenerateRequest(text="def f():").SerializeToString()[:-2],
    "bad-utf8": INVALID_UTF8,
}
GATEWAY = "/tandem.v1.GatewayService/"
# service, method, call kind, request type
METHODS = [
    ("gateway", f"{GATEWAY}Generate", "unary_stream", gateway_pb2.GenerateRequest),
    ("gateway", f"{GATEWAY}Abort", "unary", gateway_pb2.AbortRequest),
    ("gateway", f"{GATEWAY}GetServerInfo", "unary", gateway_pb2.GetServerInfoRequest),
    ("gateway", f"{GATEWAY}GetModelInfo", "unary", gateway_pb2.GetModelInfoRequest),
    ("target", "/tandem.v1.TargetService/Control", "stream", target_pb2.ControlRequest),
    ("target", "/tandem.v1.TargetService/GetInfo", "unary", target_pb2.TargetServiceGetInfoRequest),
    ("draft", "/tandem.v1.DraftService/Speculate", "stream", draft_pb2.SpeculateRequest),
    ("draft", "/tandem.v1.DraftService/GetInfo", "unary", draft_pb2.DraftServiceGetInfoRequest),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    root = tmp_path_factory.mktemp("hostile")
    target, eagle3 = random_family(root)
    running: Stack = cpu_stack(
        target,
        eagle3,
        extra_gateway_args=[f"--auth-token={TOKEN}"],  # a token may start with "-"
    )
    running.start(log_dir=root / "logs")
    try:
        yield {svc.name: svc.port for svc in running.services}
    finally:
        running.stop()


def _raw(
    port: int, method: str, payload: bytes, *, kind: str, metadata: tuple[tuple[str, str], ...]
) -> tuple[grpc.StatusCode, str]:
    """The status and details of one call with ``payload`` as the request's bytes (one message
    of the request stream for a stream)."""

    async def call() -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                if kind == "unary":
                    await channel.unary_unary(method)(payload, metadata=metadata, timeout=30)
                elif kind == "unary_stream":
                    stream = channel.unary_stream(method)(payload, metadata=metadata, timeout=30)
                    async for _ in stream:
                        pass
                else:
                    requests = iter([payload])
                    stream = channel.stream_stream(method)(requests, metadata=metadata, timeout=30)
                    async for _ in stream:
                        pass
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    return asyncio.run(call())


def _parses(message_type: type, payload: bytes) -> bool:
    try:
        message_type.FromString(payload)  # type: ignore[attr-defined]
    except Exception:
        return False
    return True


@pytest.mark.parametrize("garbage", sorted(GARBAGE))
def test_undecodable_messages_are_invalid_argument_everywhere(
    stack: dict[str, int], garbage: str
) -> None:
    payload = GARBAGE[garbage]
    refused = [m for m in METHODS if not _parses(m[3], payload)]
    assert refused, "garbage that every request type parses tests nothing"
    answers = {
        method: _raw(
            stack[name], method, payload, kind=kind, metadata=AUTH if name == "gateway" else ()
        )
        for name, method, kind, _ in refused
    }
    wrong = {
        method: answer
        for method, answer in answers.items()
        if answer[0] != grpc.StatusCode.INVALID_ARGUMENT or "undecodable" not in answer[1]
    }
    assert not wrong, wrong


def test_every_public_method_needs_the_token(stack: dict[str, int]) -> None:
    requests = {
        "Generate": gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7])),
        "Abort": gateway_pb2.AbortRequest(request_ids=["x"]),
        "GetServerInfo": gateway_pb2.GetServerInfoRequest(),
        "GetModelInfo": gateway_pb2.GetModelInfoRequest(),
    }
    for metadata in [(), (("authorization", "Bearer not-the-token"),)]:
        for name, request in requests.items():
            kind = "unary_stream" if name == "Generate" else "unary"
            payload = request.SerializeToString()
            code, _ = _raw(
                stack["gateway"], f"{GATEWAY}{name}", payload, kind=kind, metadata=metadata
            )
            assert code == grpc.StatusCode.UNAUTHENTICATED, (name, metadata, code)


def test_the_stack_serves_after_the_hostile_calls(stack: dict[str, int]) -> None:
    async def generate() -> list[int]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack['gateway']}") as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7, 8]),
                sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=8, ignore_eos=True
                ),
            )
            tokens: list[int] = []
            async for response in stub.Generate(request, metadata=AUTH):
                if response.WhichOneof("payload") == "chunk":
                    tokens += response.chunk.token_ids
            return tokens

    assert len(asyncio.run(generate())) == 8
