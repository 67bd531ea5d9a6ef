"""``python -m tandem.serving.health_probe`` as the compose health checks run it: a real process
against a real server; exit 0 only for SERVING, 1 for everything else, one line of output."""

from __future__ import annotations

import os
import socket

import pytest

from tandem.serving.security import ServerTLS
from tests.deploy.helpers import TEST_SERVICE, health_server, probe, run
from tests.deploy.pki import PKI

pytestmark = pytest.mark.e2e  # every test runs the probe as a process


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # nothing listens on it once the socket is closed


def one_line(output: str) -> str:
    lines = output.splitlines()
    assert len(lines) == 1, output
    return lines[0]


def test_exit_status_follows_the_serving_status() -> None:
    async def body() -> None:
        async with health_server(serving_now=False) as (port, health):
            address = f"127.0.0.1:{port}"
            status, out = await probe("--address", address)
            assert (status, one_line(out)) == (1, f"NOT_SERVING {address}")
            await health.set_serving()
            status, out = await probe("--address", address, "--timeout", "5")
            assert (status, one_line(out)) == (0, f"SERVING {address}")
            status, out = await probe("--address", address, "--service", TEST_SERVICE)
            assert (status, one_line(out)) == (0, f"SERVING {address} {TEST_SERVICE}")
            status, out = await probe("--address", address, "--service", "no.Such")
            assert status == 1 and one_line(out).startswith("NOT_FOUND")
            await health.enter_graceful_shutdown()  # what SIGTERM does first
            status, out = await probe("--address", address)
            assert (status, one_line(out)) == (1, f"NOT_SERVING {address}")
            env = {**os.environ, "TANDEM_PROBE_ADDRESS": address}
            assert (await probe(env=env))[0] == 1

    run(body)


def test_unreachable_and_bad_usage_exit_1() -> None:
    async def body() -> None:
        status, out = await probe("--address", f"127.0.0.1:{closed_port()}", "--timeout", "3")
        assert status == 1 and one_line(out).startswith("UNAVAILABLE")
        assert (await probe())[0] == 1  # usage error: 1 still (Docker reserves 2)
        assert (await probe("--address", "x:1", "--timeout", "soon"))[0] == 1
        status, out = await probe("--address", "127.0.0.1:1", "--tls-cert", "/nonexistent.pem")
        assert status == 1 and one_line(out).startswith("ERROR")
        assert (await probe("--help"))[0] == 0

    run(body)


def test_mtls_probe_needs_its_client_certificate(pki: PKI) -> None:
    mtls = ServerTLS(
        cert=pki.server.cert, key=pki.server.key, client_ca=pki.ca.cert, require_client_cert=True
    )

    async def body() -> None:
        async with health_server(mtls) as (port, _):
            address = f"127.0.0.1:{port}"
            ca = ("--tls-ca", str(pki.ca.cert))
            client = ("--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key))
            status, out = await probe("--address", address, *ca, *client)
            assert (status, one_line(out)) == (0, f"SERVING {address}")
            status, out = await probe("--address", address, *ca)
            assert status == 1 and one_line(out).startswith("UNAVAILABLE")
            assert (await probe("--address", address))[0] == 1  # plain text
            env = {  # the variables a TLS-enabled container sets once
                **os.environ,
                "TANDEM_PROBE_TLS_CA": str(pki.ca.cert),
                "TANDEM_PROBE_TLS_CERT": str(pki.client.cert),
                "TANDEM_PROBE_TLS_KEY": str(pki.client.key),
            }
            assert (await probe("--address", address, env=env))[0] == 0

    run(body)
