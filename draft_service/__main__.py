"""``python -m draft_service``: serve a draft model over gRPC (docs/design.md section 2).

The server listens first (health NOT_SERVING), loads and warms up the draft, then reports
SERVING; SIGTERM/SIGINT drain open streams for ``--grace`` seconds. The bound address is
printed on stdout as ``draft service listening on HOST:PORT`` (useful with ``--port 0``).

Every flag defaults to a ``TANDEM_DRAFT_*`` environment variable, named in its ``--help``
(flags win); ``--target`` and ``--draft-kind`` are required, ``--draft`` too except for ngram.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from draft_service.config import DraftServiceConfig
from draft_service.server import DraftServer, start
from tandem import settings
from tandem.config import DraftConfig
from tandem.serving import security, telemetry
from tandem.serving.rpc import configure_logging, freeze_heap, serve
from tandem.settings import Flags, SettingsParser

logger = logging.getLogger("draft_service")


ENV = "TANDEM_DRAFT_"
DRAFT = Flags(
    DraftConfig,
    (
        *("target", "path", "kind", "mtp_mode", "page_size", "num_pages", "device", "dtype"),
        *("cuda_graphs", "transposed_weights"),
    ),
    env_prefix=ENV,
)
SERVICE = Flags(
    DraftServiceConfig,
    (
        *("host", "port", "max_message_bytes", "reflection", "local_socket", "prompt_buffer_mb"),
        *("grace_s", "log_level", "metrics_port"),
    ),
    env_prefix=ENV,
)


def build_parser() -> SettingsParser:
    """Every flag of ``python -m draft_service`` with its TANDEM_DRAFT_* default (a bad
    variable raises ValueError naming it)."""
    return settings.build_parser(
        "python -m draft_service",
        "Serve a draft model over gRPC.",
        DRAFT,
        SERVICE,
        security.server_tls_flags(ENV),
    )


def parse_config(argv: Sequence[str] | None = None) -> DraftServiceConfig:
    """Flags (and their environment defaults) -> a validated config; exits with usage on
    an invalid value, naming the field."""
    parser = build_parser()
    args = parser.parse(argv)
    values = vars(args)
    try:
        return DraftServiceConfig(
            draft=DraftConfig(**DRAFT.pick(values)),
            tls=security.server_tls_from_args(args),
            **SERVICE.pick(values),
        )
    except ValueError as exc:
        parser.error(str(exc))


async def run(config: DraftServiceConfig) -> int:
    """Serves until a signal; returns the process exit code (1 if the draft failed to load)."""
    observability = telemetry.setup(
        "draft_service", metrics_port=config.metrics_port, metrics_host=config.host
    )
    server: DraftServer = await start(config)
    print(f"draft service listening on {server.address}", flush=True)
    stop = asyncio.Event()
    failed = False

    async def load() -> None:
        nonlocal failed
        try:
            await server.load()
            freeze_heap()
        except Exception:
            logger.exception("loading the draft failed")
            failed = True
            stop.set()

    loading = asyncio.create_task(load())
    await serve(
        server.server,
        server.health,
        grace=config.grace_s,
        on_shutdown=server.close,
        stop=stop,
    )
    loading.cancel()
    observability.shutdown()
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config = parse_config(argv)
    except ValueError as exc:  # a bad TANDEM_DRAFT_* value
        sys.exit(f"error: {exc}")
    configure_logging(config.log_level)
    sys.exit(asyncio.run(run(config)))


if __name__ == "__main__":
    main()
