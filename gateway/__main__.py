"""``python -m gateway``: the public face. Loads the target's tokenizer, connects to the target's
control stream and serves `GatewayService` plus gRPC health.

Every flag has a ``TANDEM_GATEWAY_*`` environment default, named in its ``--help`` (flags win).
With ``--smg-port`` it also serves the SMG router's gRPC worker protocol on that port
(``gateway.smg``: ``smg launch --worker-urls grpc://HOST:PORT``), with its own gRPC health.
Health is NOT_SERVING while the target is not connected (at start, and whenever the stream
breaks until it is back); SIGTERM turns it NOT_SERVING and drains open calls for ``--grace``.

Security (``tandem.serving.security``, docs/operations.md): ``--tls-cert``/``--tls-key`` put the
public port on TLS, ``--auth-token``/``--auth-token-file`` require a bearer token on every call
except health, ``--target-tls-*`` secure the channel to the target (mTLS with a client certificate).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.admission import Admission
from gateway.config import GatewayConfig, TokenSources
from gateway.server import GatewayServicer
from gateway.smg.server import SERVICE_NAME as SMG_SERVICE_NAME
from gateway.smg.server import SmgWorkerServicer
from gateway.target_client import TargetClient
from tandem import settings
from tandem.models.tokenizer import load_tokenizer
from tandem.serving import rpc, security, telemetry
from tandem.settings import Flags, SettingsParser
from tandem.smg import sglang_scheduler_pb2_grpc
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger("gateway")

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


ENV = "TANDEM_GATEWAY_"
SERVICE = Flags(
    GatewayConfig,
    (
        *("target_addr", "tokenizer", "host", "port", "max_running", "max_queue"),
        *("max_request_bytes", "slow_reader_timeout_s"),
        *("two_lane_batch", "reflection", "grace_s", "log_level", "metrics_port"),
        "failover_wait_s",
        "smg_port",
    ),
    env_prefix=ENV,
)
TOKENS = Flags(
    TokenSources,
    ("auth_token", "auth_token_file"),
    env_prefix=ENV,
    title="authentication (public API; health is exempt)",
)


def build_parser() -> SettingsParser:
    """Every flag of ``python -m gateway`` with its TANDEM_GATEWAY_* default (a bad variable
    raises ValueError naming it)."""
    return settings.build_parser(
        "python -m gateway",
        __doc__,
        SERVICE,
        TOKENS,
        security.server_tls_flags(ENV),
        security.client_tls_flags("target", ENV),
    )


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    """Flags (and their environment defaults) -> a validated config; exits with usage on an
    invalid value, naming the field (unreadable or mismatched TLS files included)."""
    p = build_parser()
    a = p.parse(argv)
    try:
        return GatewayConfig(
            tls=security.server_tls_from_args(a),
            auth_tokens=security.load_tokens(a.auth_token, a.auth_token_file),
            target_tls=security.client_tls_from_args(a, "target"),
            **SERVICE.pick(vars(a)),
        )
    except ValueError as exc:
        p.error(str(exc))


@dataclass
class WorkerService:
    """The SMG worker protocol's server (``--smg-port``), listening on ``port``."""

    server: grpc.aio.Server
    port: int
    health: rpc.Health

    async def stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


@dataclass
class Gateway:
    """A started gateway: its server (listening on `port`), health and target client, and the
    SMG worker service when asked for."""

    server: grpc.aio.Server
    port: int
    health: rpc.Health
    client: TargetClient
    servicer: GatewayServicer
    smg: WorkerService | None = None

    async def stop(self, grace: float | None = None) -> None:
        await self.health.enter_graceful_shutdown()
        if self.smg is not None:
            await asyncio.gather(self.server.stop(grace), self.smg.stop(grace))
        else:
            await self.server.stop(grace)
        await self.client.close()
        self.servicer.prompts.close()


async def start_gateway(config: GatewayConfig, tokenizer: Any | None = None) -> Gateway:
    """Builds and starts a gateway inside the running loop; the target connects in the
    background (health turns SERVING when it does)."""
    if tokenizer is None:
        tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer)
    auth = [security.BearerTokenAuth(config.auth_tokens)] if config.auth_tokens else []
    server = rpc.make_server(
        max_message_bytes=config.max_request_bytes,
        interceptors=auth,
        screens={f"/{SERVICE_NAME}/Generate": lambda data: servicer.screen(data)},
    )
    health = rpc.add_health(server, [SERVICE_NAME])
    smg: WorkerService | None = None
    if config.smg_port is not None:
        smg_server = rpc.make_server(
            max_message_bytes=config.max_request_bytes,
            interceptors=auth,
            screens={f"/{SMG_SERVICE_NAME}/Generate": lambda data: worker.screen(data)},
        )
        smg = WorkerService(smg_server, 0, rpc.add_health(smg_server, [SMG_SERVICE_NAME]))

    async def on_connection_change(connected: bool) -> None:
        await health.set_serving(connected)
        if smg is not None:
            await smg.health.set_serving(connected)

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
    worker = SmgWorkerServicer(servicer)  # the screen above reads the model's length from it
    if smg is not None:
        sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(worker, smg.server)
        rpc.maybe_add_reflection(smg.server, [SMG_SERVICE_NAME], config.reflection)
        address = rpc.format_address(config.host, config.smg_port or 0)  # set: smg exists
        smg.port = rpc.bind(smg.server, address, credentials)
        await smg.server.start()
    await server.start()
    await client.start()
    return Gateway(
        server=server, port=port, health=health, client=client, servicer=servicer, smg=smg
    )


async def _drain_when(stop: asyncio.Event, worker: WorkerService, grace: float) -> None:
    await stop.wait()
    await worker.stop(grace)


async def main(config: GatewayConfig) -> None:
    observability = telemetry.setup(
        "gateway", metrics_port=config.metrics_port, metrics_host=config.host
    )
    gateway = await start_gateway(config)
    rpc.freeze_heap()  # the tokenizer's tables, above all
    logger.info(
        "gateway on %s, target %s",
        rpc.format_address(config.host, gateway.port),
        config.target_addr,
    )
    if gateway.smg is not None:
        logger.info("SMG worker protocol on %s", rpc.format_address(config.host, gateway.smg.port))
    print(f"READY gateway {rpc.format_address(config.host, gateway.port)}", flush=True)

    stop = asyncio.Event()  # set by SIGTERM/SIGINT (rpc.serve): both ports drain at once
    worker_drained = None
    if gateway.smg is not None:
        worker_drained = asyncio.create_task(_drain_when(stop, gateway.smg, config.grace_s))

    async def on_shutdown() -> None:
        if worker_drained is not None:
            await worker_drained
        await gateway.client.close()

    await rpc.serve(
        gateway.server, gateway.health, grace=config.grace_s, on_shutdown=on_shutdown, stop=stop
    )
    observability.shutdown()


if __name__ == "__main__":
    try:
        _config = parse_args()
    except ValueError as exc:  # a bad TANDEM_GATEWAY_* value
        sys.exit(f"error: {exc}")
    rpc.configure_logging(_config.log_level)
    asyncio.run(main(_config))
