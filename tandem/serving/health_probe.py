"""``python -m tandem.serving.health_probe``: one gRPC health check, for container health checks
(compose.yaml) and scripts, in place of the Go ``grpc_health_probe`` binary.

    python -m tandem.serving.health_probe --address 127.0.0.1:50052 [--service NAME] [--timeout 2]
        [--tls-ca CA --tls-cert CERT --tls-key KEY --tls-server-name NAME]

Exit status 0 when the service answers SERVING, 1 otherwise (NOT_SERVING, unknown service,
unreachable, timeout, bad flags); exactly one line on stdout says which. Every flag has a
``TANDEM_PROBE_*`` environment default, so a container that turns TLS on sets them once and
its health-check command stays the same. Health needs no bearer token (``tandem.serving.security``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.serving import security
from tandem.serving.rpc import channel_options, env_default

_PROBE_MESSAGE_BYTES = 1 << 20  # a health reply is a few bytes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tandem.serving.health_probe", description="One gRPC health check."
    )
    address = env_default("TANDEM_PROBE_ADDRESS", None)
    p.add_argument("--address", default=address, required=address is None, help="HOST:PORT")
    p.add_argument(
        "--service",
        default=env_default("TANDEM_PROBE_SERVICE", ""),
        help="service name to check; empty = the server as a whole",
    )
    p.add_argument(
        "--timeout", type=float, default=env_default("TANDEM_PROBE_TIMEOUT", 2.0), help="seconds"
    )
    p.add_argument("--tls-ca", type=Path, default=env_default("TANDEM_PROBE_TLS_CA", None))
    p.add_argument("--tls-cert", type=Path, default=env_default("TANDEM_PROBE_TLS_CERT", None))
    p.add_argument("--tls-key", type=Path, default=env_default("TANDEM_PROBE_TLS_KEY", None))
    p.add_argument("--tls-server-name", default=env_default("TANDEM_PROBE_TLS_SERVER_NAME", None))
    return p


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
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help is 0; any usage error is unhealthy, never Docker's 2
        return 0 if exc.code in (0, None) else 1
    except ValueError as exc:  # a bad TANDEM_PROBE_* value
        print(f"ERROR {exc}", flush=True)
        return 1
    try:
        tls = None
        if args.tls_ca is not None or args.tls_cert is not None or args.tls_key is not None:
            tls = security.ClientTLS(
                ca=args.tls_ca,
                cert=args.tls_cert,
                key=args.tls_key,
                server_name=args.tls_server_name,
            )
        serving, verdict = check(
            args.address, service=args.service, timeout_s=args.timeout, tls=tls
        )
    except ValueError as exc:
        serving, verdict = False, f"ERROR {exc}"
    print(verdict, flush=True)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
