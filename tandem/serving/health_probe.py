"""``python -m tandem.serving.health_probe``: one gRPC health check, for container health checks
(compose.yaml) and scripts, in place of the Go ``grpc_health_probe`` binary.

    python -m tandem.serving.health_probe --address 127.0.0.1:50052 [--service NAME] [--timeout 2]
        [--tls-ca CA --tls-cert CERT --tls-key KEY --tls-server-name NAME]

Exit status 0 when the service answers SERVING, 1 otherwise (NOT_SERVING, unknown service,
unreachable, timeout, bad flags); exactly one line on stdout says which. Every flag has a
``TANDEM_PROBE_*`` environment default (named in ``--help``), so a container that turns TLS on
sets them once and its health-check command stays the same. Health needs no bearer token
(``tandem.serving.security``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import settings
from tandem.serving import security
from tandem.serving.rpc import channel_options
from tandem.settings import Flags, SettingsParser, setting

_PROBE_MESSAGE_BYTES = 1 << 20  # a health reply is a few bytes


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """What to check; TLS is a ``security.ClientTLS`` (its flags without a peer's prefix)."""

    address: str = setting(help="HOST:PORT of the server to check", env="ADDRESS")
    service: str = setting(
        "", help="service name to check; empty = the server as a whole", env="SERVICE"
    )
    timeout_s: float = setting(
        2.0, help="seconds to wait for the answer", env="TIMEOUT", flag="timeout"
    )

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("address: must not be empty")


ENV = "TANDEM_PROBE_"
PROBE = Flags(ProbeConfig, ("address", "service", "timeout_s"), env_prefix=ENV)
TLS = Flags(security.ClientTLS, ("ca", "cert", "key", "server_name"), env_prefix=ENV)


def build_parser() -> SettingsParser:
    """The probe's flags with their TANDEM_PROBE_* defaults (a bad variable raises ValueError
    naming it)."""
    return settings.build_parser(
        "python -m tandem.serving.health_probe", "One gRPC health check.", PROBE, TLS
    )


def check(
    address: str, *, service: str = "", timeout_s: float = 2.0, tls: security.ClientTLS | None
) -> tuple[bool, str]:
    """(serving, one-line verdict) for one Check call."""
    options = [
        *channel_options(_PROBE_MESSAGE_BYTES),
        *security.tls_channel_options(tls),
        ("grpc.enable_retries", 0),
    ]
    if tls is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, security.channel_credentials(tls), options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            reply = stub.Check(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            name = code.name if code is not None else "ERROR"
            details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
            return False, f"{name} {address}: {details.splitlines()[0] if details else ''}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    label = f"{address} {service}".rstrip()
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{status} {label}"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse(argv)
    except SystemExit as exc:  # --help is 0; any usage error is unhealthy, never Docker's 2
        return 0 if exc.code in (0, None) else 1
    except ValueError as exc:  # a bad TANDEM_PROBE_* value
        print(f"ERROR {exc}", flush=True)
        return 1
    try:
        probe = ProbeConfig(**PROBE.pick(vars(args)))
        tls = None
        if args.tls_ca is not None or args.tls_cert is not None or args.tls_key is not None:
            tls = security.ClientTLS(**TLS.pick(vars(args)))
        serving, verdict = check(
            probe.address, service=probe.service, timeout_s=probe.timeout_s, tls=tls
        )
    except ValueError as exc:
        serving, verdict = False, f"ERROR {exc}"
    print(verdict, flush=True)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
