"""Bearer-token authentication on the gateway's public API: a real gateway (``start_gateway``)
in front of the service tests' EchoTarget, over TLS and over plain loopback. Missing or wrong
tokens get UNAUTHENTICATED on unary and streaming calls; the right one is served; health needs
no token."""

from __future__ import annotations

import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from gateway.__main__ import Gateway, start_gateway
from gateway.config import GatewayConfig
from tandem.models.tokenizer import load_tokenizer
from tandem.serving.security import (
    BearerTokenAuth,
    ClientTLS,
    ServerTLS,
    load_tokens,
    open_channel,
    token_metadata,
)
from tandem.testing.random_model import write_tokenizer
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.deploy.helpers import check, health_server, probe, run
from tests.deploy.pki import PKI
from tests.helpers.gateway import EchoTarget, start_target

TOKEN = secrets.token_urlsafe(32)
OTHER_TOKEN = secrets.token_urlsafe(32)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path, 64)
    return path


@asynccontextmanager
async def gateway(tokenizer_dir: Path, **overrides: object) -> AsyncIterator[Gateway]:
    target_server, target_port = await start_target(EchoTarget())
    config = GatewayConfig(
        target_addr=f"127.0.0.1:{target_port}",
        tokenizer=tokenizer_dir,
        host="127.0.0.1",
        port=0,
        **overrides,  # type: ignore[arg-type]
    )
    started = await start_gateway(config, tokenizer=load_tokenizer(tokenizer_dir))
    try:
        await started.client.wait_connected(10.0)
        yield started
    finally:
        await started.stop(None)
        await target_server.stop(None)


async def calls(
    channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = ()
) -> tuple[grpc.StatusCode, grpc.StatusCode, list[int]]:
    """(GetModelInfo's code, Generate's code, generated ids) on one channel."""
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    try:
        await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), metadata=metadata, timeout=10)
        unary = grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        unary = exc.code()
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True),
    )
    ids: list[int] = []
    try:
        async for response in stub.Generate(request, metadata=metadata, timeout=10):
            if response.WhichOneof("payload") == "chunk":
                ids += response.chunk.token_ids
        streaming = grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        streaming = exc.code()
    return unary, streaming, ids


@pytest.mark.e2e
def test_gateway_over_tls_wants_the_right_token(pki: PKI, tokenizer_dir: Path) -> None:
    tls = ServerTLS(cert=pki.server.cert, key=pki.server.key)
    client_tls = ClientTLS(ca=pki.ca.cert)

    async def body() -> None:
        async with gateway(tokenizer_dir, tls=tls, auth_tokens=(TOKEN,)) as gw:
            address = f"127.0.0.1:{gw.port}"
            async with open_channel(address, tls=client_tls) as channel:
                assert await calls(channel) == (UNAUTHENTICATED, UNAUTHENTICATED, [])
            async with open_channel(address, tls=client_tls, token=OTHER_TOKEN) as channel:
                assert await calls(channel) == (UNAUTHENTICATED, UNAUTHENTICATED, [])
            async with open_channel(address, tls=client_tls, token=TOKEN) as channel:
                unary, streaming, ids = await calls(channel)
                assert (unary, streaming) == (grpc.StatusCode.OK, grpc.StatusCode.OK)
                assert ids == [5, 6, 7, 5]  # EchoTarget repeats the prompt
            # Health is exempt: probes hold no token.
            assert await check(address, tls=client_tls) == "SERVING"
            status, line = await probe("--address", address, "--tls-ca", str(pki.ca.cert))
            assert (status, line.split()[0]) == (0, "SERVING")

    run(body)


def test_token_over_plain_loopback_and_as_call_metadata(tokenizer_dir: Path) -> None:
    async def body() -> None:
        async with gateway(tokenizer_dir, auth_tokens=(OTHER_TOKEN, TOKEN)) as gw:
            address = f"127.0.0.1:{gw.port}"
            async with open_channel(address, token=TOKEN) as channel:  # local credentials
                assert (await calls(channel))[:2] == (grpc.StatusCode.OK, grpc.StatusCode.OK)
            async with open_channel(address) as channel:
                assert (await calls(channel, token_metadata(OTHER_TOKEN)))[2] == [5, 6, 7, 5]
                bad = (("authorization", f"Basic {TOKEN}"),)
                assert (await calls(channel, bad))[:2] == (UNAUTHENTICATED, UNAUTHENTICATED)
                assert (await calls(channel))[:2] == (UNAUTHENTICATED, UNAUTHENTICATED)

    run(body)


def test_without_tokens_the_gateway_is_open(tokenizer_dir: Path) -> None:
    async def body() -> None:
        async with (
            gateway(tokenizer_dir) as gw,
            open_channel(f"127.0.0.1:{gw.port}") as channel,
        ):
            assert (await calls(channel))[:2] == (grpc.StatusCode.OK, grpc.StatusCode.OK)

    run(body)


def test_interceptor_on_make_server_exempts_health_only() -> None:
    """Through ``serving.make_server``'s interceptors: health passes without a token."""

    async def body() -> None:
        auth = BearerTokenAuth([TOKEN])
        async with health_server(interceptors=[auth]) as (port, _):
            assert await check(f"127.0.0.1:{port}") == "SERVING"
        auth = BearerTokenAuth([TOKEN], exempt_services=())
        async with health_server(interceptors=[auth]) as (port, _):
            assert await check(f"127.0.0.1:{port}") == UNAUTHENTICATED
            assert await check(f"127.0.0.1:{port}", token=TOKEN) == "SERVING"

    run(body)


def non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # UDP: picks the outgoing interface, sends nothing
        except OSError:
            return None
        address: str = s.getsockname()[0]
    return None if address.startswith("127.") else address


def test_no_token_in_clear_text_beyond_loopback() -> None:
    """Without TLS, ``open_channel`` hands a token only to a loopback peer."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address here")

    async def body() -> None:
        async with health_server(host="0.0.0.0") as (port, _):
            assert await check(f"127.0.0.1:{port}", token=TOKEN) == "SERVING"
            assert await check(f"{address}:{port}", token=TOKEN) == grpc.StatusCode.UNAVAILABLE
            assert await check(f"{address}:{port}") == "SERVING"  # reachable without a token

    run(body)


def test_authorization_header_parsing() -> None:
    auth = BearerTokenAuth([TOKEN, OTHER_TOKEN])
    assert auth.refusal([("authorization", f"Bearer {TOKEN}")]) is None
    assert auth.refusal([("authorization", f"bearer {OTHER_TOKEN}".encode())]) is None
    assert auth.refusal([]) == "missing bearer token (authorization metadata)"
    assert auth.refusal([("authorization", f"Bearer {TOKEN}x")]) == "invalid bearer token"
    assert auth.refusal([("authorization", "Bearer")]) == "authorization is not a bearer token"
    two = [("authorization", f"Bearer {TOKEN}")] * 2
    assert auth.refusal(two) == "more than one authorization header"
    with pytest.raises(ValueError, match="at least one token"):
        BearerTokenAuth([])


def test_tokens_from_a_value_and_a_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# rotated on Monday\n{TOKEN}\n\n  {OTHER_TOKEN}  \n{TOKEN}\n")
    assert load_tokens(None, path) == (TOKEN, OTHER_TOKEN)
    assert load_tokens(OTHER_TOKEN, path) == (OTHER_TOKEN, TOKEN)
    assert load_tokens() == ()
    with pytest.raises(ValueError, match="at least 16 characters"):
        load_tokens("short")
    path.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no token"):
        load_tokens(None, path)
    path.write_text("has a space in it, long enough\n")
    with pytest.raises(ValueError, match=r"tokens:1: a token is printable ASCII"):
        load_tokens(None, path)
    with pytest.raises(ValueError, match="auth_token_file: cannot read"):
        load_tokens(None, tmp_path / "missing")


def test_gateway_flags_and_environment_for_tokens(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.__main__ import parse_args

    common = ["--target-addr", "127.0.0.1:50052", "--tokenizer", str(tokenizer_dir)]
    assert parse_args(common).auth_tokens == ()
    path = tmp_path / "tokens"
    path.write_text(TOKEN + "\n")
    config = parse_args([*common, "--auth-token-file", str(path)])
    assert config.auth_tokens == (TOKEN,)
    assert TOKEN not in repr(config)  # configs get logged
    monkeypatch.setenv("TANDEM_GATEWAY_AUTH_TOKEN", OTHER_TOKEN)
    assert parse_args(common).auth_tokens == (OTHER_TOKEN,)
