"""TLS and mutual TLS through ``tandem.serving.security`` on real grpc.aio servers
(``rpc.make_server`` + ``rpc.bind``) with certificates made in the test: the right credentials are
served, wrong or missing ones refused; bad files are refused at startup with the path and the
reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tandem.serving import rpc, security
from tandem.serving.security import ClientTLS, ServerTLS
from tests.deploy.helpers import check, health_server, run
from tests.deploy.pki import CA, PKI

REFUSED = grpc.StatusCode.UNAVAILABLE  # a failed handshake never reaches a handler


def test_tls_client_trusting_the_right_ca_is_served_others_refused(pki: PKI) -> None:
    async def body() -> None:
        async with health_server(ServerTLS(cert=pki.server.cert, key=pki.server.key)) as (port, _):
            address = f"127.0.0.1:{port}"
            assert await check(address, tls=ClientTLS(ca=pki.ca.cert)) == "SERVING"
            assert await check(f"localhost:{port}", tls=ClientTLS(ca=pki.ca.cert)) == "SERVING"
            assert await check(address, tls=ClientTLS(ca=pki.other_ca.cert)) == REFUSED
            assert await check(address) == REFUSED  # plain text to a TLS port

    run(body)


def test_a_server_from_an_untrusted_ca_is_refused(pki: PKI) -> None:
    foreign = ServerTLS(cert=pki.foreign_server.cert, key=pki.foreign_server.key)

    async def body() -> None:
        async with health_server(foreign) as (port, _):
            tls = ClientTLS(ca=pki.ca.cert, cert=pki.client.cert, key=pki.client.key)
            assert await check(f"127.0.0.1:{port}", tls=tls) == REFUSED

    run(body)


def test_server_name_override_checks_the_expected_name(pki: PKI) -> None:
    """A certificate for "target" (compose's service name) reached by IP: served when the
    client expects "target", refused when it expects the address or another name."""

    async def body() -> None:
        async with health_server(ServerTLS(cert=pki.named.cert, key=pki.named.key)) as (port, _):
            address = f"127.0.0.1:{port}"
            expect = ClientTLS(ca=pki.ca.cert, server_name="target")
            assert await check(address, tls=expect) == "SERVING"
            assert await check(address, tls=ClientTLS(ca=pki.ca.cert)) == REFUSED
            wrong = ClientTLS(ca=pki.ca.cert, server_name="draft")
            assert await check(address, tls=wrong) == REFUSED

    run(body)


def test_mtls_refuses_no_certificate_and_a_foreign_one_serves_the_right_one(pki: PKI) -> None:
    mtls = ServerTLS(
        cert=pki.server.cert,
        key=pki.server.key,
        client_ca=pki.ca.cert,
        require_client_cert=True,
    )

    async def body() -> None:
        async with health_server(mtls) as (port, _):
            address = f"127.0.0.1:{port}"
            right = ClientTLS(ca=pki.ca.cert, cert=pki.client.cert, key=pki.client.key)
            assert await check(address, tls=right) == "SERVING"
            assert await check(address, tls=ClientTLS(ca=pki.ca.cert)) == REFUSED
            foreign = ClientTLS(
                ca=pki.ca.cert, cert=pki.foreign_client.cert, key=pki.foreign_client.key
            )
            assert await check(address, tls=foreign) == REFUSED
            assert await check(address) == REFUSED

    run(body)


# ---- files and flags refused at startup ----


def test_server_tls_names_unreadable_and_mismatched_files(pki: PKI, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    with pytest.raises(ValueError, match=r"cert: cannot read .*missing\.pem"):
        ServerTLS(cert=missing, key=pki.server.key)
    with pytest.raises(ValueError, match="is not the private key of"):
        ServerTLS(cert=pki.server.cert, key=pki.client.key)
    with pytest.raises(ValueError, match="not a PEM certificate"):
        ServerTLS(cert=pki.server.key, key=pki.server.key)
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        ServerTLS(cert=empty, key=pki.server.key)
    with pytest.raises(ValueError, match=r"client_ca: .* holds no PEM certificate"):
        ServerTLS(
            cert=pki.server.cert,
            key=pki.server.key,
            client_ca=pki.server.key,
            require_client_cert=True,
        )
    with pytest.raises(ValueError, match="require_client_cert: needs client_ca"):
        ServerTLS(cert=pki.server.cert, key=pki.server.key, require_client_cert=True)
    with pytest.raises(ValueError, match="client_ca: only used with require_client_cert"):
        ServerTLS(cert=pki.server.cert, key=pki.server.key, client_ca=pki.ca.cert)


def test_encrypted_keys_and_half_client_pairs_are_refused(tmp_path: Path) -> None:
    locked = CA("locked", tmp_path).issue("server", key_password=b"secret")
    with pytest.raises(ValueError, match="encrypted"):
        ServerTLS(cert=locked.cert, key=locked.key)
    with pytest.raises(ValueError, match="go together"):
        ClientTLS(cert=locked.cert)
    with pytest.raises(ValueError, match="server_name"):
        ClientTLS(server_name=" ")


def test_bind_names_an_address_it_cannot_listen_on(pki: PKI) -> None:
    async def body() -> None:
        async with health_server() as (port, _):
            server = rpc.make_server()
            credentials = security.server_credentials(
                ServerTLS(cert=pki.server.cert, key=pki.server.key)
            )
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                rpc.bind(server, f"127.0.0.1:{port}", credentials)

    run(body)


def test_gateway_refuses_a_missing_or_mismatched_certificate(
    pki: PKI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.__main__ import parse_args

    common = ["--target-addr", "127.0.0.1:50052", "--tokenizer", str(tmp_path)]
    missing = tmp_path / "nope" / "gateway.pem"
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*common, "--tls-cert", str(missing), "--tls-key", str(pki.server.key)])
    assert exit_info.value.code == 2
    assert f"cannot read {missing}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*common, "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.client.key)])
    assert "is not the private key of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*common, "--target-tls-cert", str(pki.client.cert)])
    assert "go together" in capsys.readouterr().err
    config = parse_args(
        [
            *common,
            *("--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)),
            *("--target-tls-ca", str(pki.ca.cert), "--target-tls-server-name", "target"),
        ]
    )
    assert config.tls == ServerTLS(cert=pki.server.cert, key=pki.server.key)
    assert config.target_tls == ClientTLS(ca=pki.ca.cert, server_name="target")


def test_draft_service_flags_and_environment(
    pki: PKI, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from draft_service.__main__ import parse_config

    common = ["--target", "t", "--draft-kind", "ngram"]
    with pytest.raises(SystemExit):
        parse_config([*common, "--tls-cert", str(pki.server.cert)])
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config([*common, "--require-client-cert"])
    assert "client certificates need TLS" in capsys.readouterr().err
    monkeypatch.setenv("TANDEM_DRAFT_TLS_CERT", str(pki.server.cert))
    monkeypatch.setenv("TANDEM_DRAFT_TLS_KEY", str(pki.server.key))
    monkeypatch.setenv("TANDEM_DRAFT_TLS_CLIENT_CA", str(pki.ca.cert))
    monkeypatch.setenv("TANDEM_DRAFT_REQUIRE_CLIENT_CERT", "1")
    config = parse_config(common)
    assert config.tls == ServerTLS(
        cert=pki.server.cert, key=pki.server.key, client_ca=pki.ca.cert, require_client_cert=True
    )


@pytest.mark.slow
@pytest.mark.e2e
def test_target_service_process_refuses_a_missing_certificate(pki: PKI, tmp_path: Path) -> None:
    """The real ``python -m target_service``: exit 2 with the path and the reason, no
    traceback, before any model is loaded."""
    missing = tmp_path / "target.pem"
    argv = ["--target", str(tmp_path), "--tls-cert", str(missing), "--tls-key", str(pki.server.key)]
    done = subprocess.run(
        [sys.executable, "-m", "target_service", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"cannot read {missing}" in done.stderr
    assert "Traceback" not in done.stderr
    argv = ["--target", str(tmp_path), "--draft-tls-ca", str(pki.server.key)]
    done = subprocess.run(
        [sys.executable, "-m", "target_service", *argv, "--draft-addr", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "holds no PEM certificate" in done.stderr
