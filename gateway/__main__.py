"""``python -m gateway``: the public face. Loads the target's tokenizer, connects to the target's
control stream and serves `GatewayService` plus gRPC health.

Every flag has a ``TANDEM_GATEWAY_<FLAG>`` environment default (e.g. TANDEM_GATEWAY_PORT).
Health is NOT_SERVING while the target is not connected (at start, and whenever the stream
breaks until it is back); SIGTERM turns it NOT_SERVING and drains open calls for ``--grace``.
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
from tandem import serving
from tandem.errors import CheckpointError
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger("gateway")

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    env = serving.env_default
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
        )
    except ValueError as exc:
        p.error(str(exc))


def load_tokenizer(path: Path) -> Any:
    """The target's tokenizer, as ``tandem generate`` loads it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot load a tokenizer ({exc})") from exc


@dataclass
class Gateway:
    """A started gateway: its server (listening on `port`), health and target client."""

    server: grpc.aio.Server
    port: int
    health: serving.Health
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
    server = serving.make_server(max_message_bytes=config.max_message_bytes)
    health = serving.add_health(server, [SERVICE_NAME])

    async def on_connection_change(connected: bool) -> None:
        await health.set_serving(connected)

    client = TargetClient(
        config.target_addr,
        on_connection_change=on_connection_change,
        rpc_timeout_s=config.target_timeout_s,
        max_message_bytes=config.max_message_bytes,
    )
    admission = Admission(max_running=config.max_running, max_queue=config.max_queue)
    servicer = GatewayServicer(config, tokenizer, client, admission)
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    serving.maybe_add_reflection(server, [SERVICE_NAME], config.reflection)
    port = server.add_insecure_port(serving.format_address(config.host, config.port))
    await server.start()
    await client.start()
    return Gateway(server=server, port=port, health=health, client=client, servicer=servicer)


async def main(config: GatewayConfig) -> None:
    gateway = await start_gateway(config)
    logger.info(
        "gateway on %s, target %s",
        serving.format_address(config.host, gateway.port),
        config.target_addr,
    )
    print(f"READY gateway {serving.format_address(config.host, gateway.port)}", flush=True)
    await serving.serve(
        gateway.server, gateway.health, grace=config.grace_s, on_shutdown=gateway.client.close
    )


if __name__ == "__main__":
    _config = parse_args()
    serving.configure_logging(_config.log_level)
    asyncio.run(main(_config))
