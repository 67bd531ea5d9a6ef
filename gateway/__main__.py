"""``python -m gateway``: the public face. Loads the target's tokenizer, connects to the target's
control stream and serves `GatewayService` plus gRPC health.

Every flag has a ``TANDEM_GATEWAY_<FLAG>`` environment default (e.g. TANDEM_GATEWAY_PORT).
Health is NOT_SERVING while the target is not connected (at start, and whenever the stream
breaks until it is back); SIGTERM turns it NOT_SERVING and drains open calls for ``--grace``.

Security (``tandem.serving.security``, docs/operations.md): ``--tls-cert``/``--tls-key`` put the
public port on TLS, ``--auth-token``/``--auth-token-file`` require a bearer token on every call
except health, ``--target-tls-*`` secure the channel to the target (mTLS with a client certificate).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gateway.admission import Admission
from gateway.config import GatewayConfig
from gateway.server import GatewayServicer
from gateway.target_client import TargetClient
from tandem.models.tokenizer import load_tokenizer
from tandem.serving import rpc, security, telemetry
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger("gateway")

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``python -m gateway`` with its TANDEM_GATEWAY_* default."""
    env = rpc.env_default
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    p.add_argument(
        "--target-addr",
        default=env("TANDEM_GATEWAY_TARGET_ADDR", None),
        help="HOST:PORT of the target service",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=env("TANDEM_GATEWAY_TOKENIZER", None),
        help="the target checkpoint directory (its tokenizer files)",
    )
    p.add_argument("--host", default=env("TANDEM_GATEWAY_HOST", "0.0.0.0"))
    p.add_argument(
        "--port", type=int, default=env("TANDEM_GATEWAY_PORT", 50051), help="0 = any free port"
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=env("TANDEM_GATEWAY_MAX_RUNNING", 64),
        help="requests admitted at the target at once",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=env("TANDEM_GATEWAY_MAX_QUEUE", 256),
        help="requests waiting for admission; beyond it RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--two-lane-batch",
        type=int,
        default=env("TANDEM_GATEWAY_TWO_LANE_BATCH", 16),
        help="split running requests into two lanes (the draft drafts one while the target "
        "verifies the other) from this many on; 0 = always one lane",
    )
    p.add_argument(
        "--reflection",
        action=argparse.BooleanOptionalAction,
        default=env("TANDEM_GATEWAY_REFLECTION", False),
    )
    p.add_argument("--grace", type=float, default=env("TANDEM_GATEWAY_GRACE", 10.0))
    p.add_argument("--log-level", default=env("TANDEM_GATEWAY_LOG_LEVEL", "INFO"))
    auth = p.add_argument_group("authentication (public API; health is exempt)")
    auth.add_argument(
        "--auth-token",
        default=env("TANDEM_GATEWAY_AUTH_TOKEN", None),
        help="accepted bearer token; prefer the variable or --auth-token-file (argv is visible)",
    )
    auth.add_argument(
        "--auth-token-file",
        type=Path,
        default=env("TANDEM_GATEWAY_AUTH_TOKEN_FILE", None),
        help="file of accepted tokens, one per line (# comments)",
    )
    telemetry.add_metrics_argument(p, env("TANDEM_GATEWAY_METRICS_PORT", None))
    security.add_server_tls_arguments(p, "TANDEM_GATEWAY_")
    security.add_client_tls_arguments(p, "target", "TANDEM_GATEWAY_")
    return p


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    """Flags (and their environment defaults) -> a validated config; exits with usage on an
    invalid value, naming the field (unreadable or mismatched TLS files included)."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.target_addr is None:
        p.error("--target-addr (or TANDEM_GATEWAY_TARGET_ADDR) is required")
    if a.tokenizer is None:
        p.error("--tokenizer (or TANDEM_GATEWAY_TOKENIZER) is required")
    try:
        return GatewayConfig(
            target_addr=a.target_addr,
            tokenizer=Path(a.tokenizer),
            host=a.host,
            port=a.port,
            max_running=a.max_running,
            max_queue=a.max_queue,
            two_lane_batch=a.two_lane_batch,
            reflection=a.reflection,
            grace_s=a.grace,
            log_level=a.log_level,
            metrics_port=a.metrics_port,
            tls=security.server_tls_from_args(a),
            auth_tokens=security.load_tokens(a.auth_token, a.auth_token_file),
            target_tls=security.client_tls_from_args(a, "target"),
        )
    except ValueError as exc:
        p.error(str(exc))


@dataclass
class Gateway:
    """A started gateway: its server (listening on `port`), health and target client."""

    server: grpc.aio.Server
    port: int
    health: rpc.Health
    client: TargetClient
    servicer: GatewayServicer

    async def stop(self, grace: float | None = None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.client.close()


async def start_gateway(config: GatewayConfig, tokenizer: Any | None = None) -> Gateway:
    """Builds and starts a gateway inside the running loop; the target connects in the
    background (health turns SERVING when it does)."""
    if tokenizer is None:
        tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer)
    auth = [security.BearerTokenAuth(config.auth_tokens)] if config.auth_tokens else []
    server = rpc.make_server(max_message_bytes=config.max_message_bytes, interceptors=auth)
    health = rpc.add_health(server, [SERVICE_NAME])

    async def on_connection_change(connected: bool) -> None:
        await health.set_serving(connected)

    client = TargetClient(
        config.target_addr,
        on_connection_change=on_connection_change,
        rpc_timeout_s=config.target_timeout_s,
        max_message_bytes=config.max_message_bytes,
        tls=config.target_tls,
    )
    admission = Admission(max_running=config.max_running, max_queue=config.max_queue)
    servicer = GatewayServicer(config, tokenizer, client, admission)
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    rpc.maybe_add_reflection(server, [SERVICE_NAME], config.reflection)
    credentials = None if config.tls is None else security.server_credentials(config.tls)
    port = rpc.bind(server, rpc.format_address(config.host, config.port), credentials)
    await server.start()
    await client.start()
    return Gateway(server=server, port=port, health=health, client=client, servicer=servicer)


async def main(config: GatewayConfig) -> None:
    observability = telemetry.setup("gateway", metrics_port=config.metrics_port)
    gateway = await start_gateway(config)
    rpc.freeze_heap()  # the tokenizer's tables, above all
    logger.info(
        "gateway on %s, target %s",
        rpc.format_address(config.host, gateway.port),
        config.target_addr,
    )
    print(f"READY gateway {rpc.format_address(config.host, gateway.port)}", flush=True)
    await rpc.serve(
        gateway.server, gateway.health, grace=config.grace_s, on_shutdown=gateway.client.close
    )
    observability.shutdown()


if __name__ == "__main__":
    _config = parse_args()
    rpc.configure_logging(_config.log_level)
    asyncio.run(main(_config))
