"""``python -m draft_service``: serve a draft model over gRPC (docs/design.md section 2).

The server listens first (health NOT_SERVING), loads and warms up the draft, then reports
SERVING; SIGTERM/SIGINT drain open streams for ``--grace`` seconds. The bound address is
printed on stdout as ``draft service listening on HOST:PORT`` (useful with ``--port 0``).

Every flag defaults to an environment variable (flags win):

| flag | variable | default |
|---|---|---|
| ``--target`` | ``TANDEM_DRAFT_TARGET`` | required |
| ``--draft`` | ``TANDEM_DRAFT_PATH`` | required except for ngram |
| ``--draft-kind`` | ``TANDEM_DRAFT_KIND`` | required |
| ``--mtp-mode`` | ``TANDEM_DRAFT_MTP_MODE`` | chain |
| ``--page-size`` / ``--num-pages`` | ``TANDEM_DRAFT_PAGE_SIZE`` / ``_NUM_PAGES`` | 16 / 2048 |
| ``--device`` / ``--dtype`` | ``TANDEM_DRAFT_DEVICE`` / ``_DTYPE`` | cpu / float32 |
| ``--cuda-graphs`` / ``--no-cuda-graphs`` | ``TANDEM_DRAFT_CUDA_GRAPHS`` | on for CUDA devices |
| ``--host`` / ``--port`` | ``TANDEM_DRAFT_HOST`` / ``_PORT`` | 127.0.0.1 / 0 (any) |
| ``--max-message-bytes`` | ``TANDEM_DRAFT_MAX_MESSAGE_BYTES`` | 64 MiB |
| ``--reflection`` | ``TANDEM_DRAFT_REFLECTION`` | off |
| ``--local-socket`` | ``TANDEM_DRAFT_LOCAL_SOCKET`` | none (gRPC only) |
| ``--prompt-buffer-mb`` | ``TANDEM_DRAFT_PROMPT_BUFFER_MB`` | 256 (0: prompts inline) |
| ``--grace`` | ``TANDEM_DRAFT_GRACE_S`` | 10 |
| ``--log-level`` | ``TANDEM_DRAFT_LOG_LEVEL`` | INFO |
| ``--metrics-port`` | ``TANDEM_DRAFT_METRICS_PORT`` | none (no /metrics) |
| ``--tls-cert`` / ``--tls-key`` | ``TANDEM_DRAFT_TLS_CERT`` / ``_TLS_KEY`` | plain |
| ``--tls-client-ca`` | ``TANDEM_DRAFT_TLS_CLIENT_CA`` | none |
| ``--require-client-cert`` | ``TANDEM_DRAFT_REQUIRE_CLIENT_CERT`` | off (on = mutual TLS) |
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from draft_service.config import DraftServiceConfig
from draft_service.server import DraftServer, start
from tandem.config import DTYPES
from tandem.draft.build import DraftConfig
from tandem.serving import security, telemetry
from tandem.serving.rpc import (
    DEFAULT_MAX_MESSAGE_BYTES,
    configure_logging,
    env_default,
    freeze_heap,
    serve,
)
from tandem.spec.types import DRAFT_KINDS, MTP_MODES

logger = logging.getLogger("draft_service")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m draft_service", description="Serve a draft model over gRPC."
    )
    target = env_default("TANDEM_DRAFT_TARGET", None)
    kind = env_default("TANDEM_DRAFT_KIND", None)
    p.add_argument("--target", type=Path, default=target, required=target is None)
    p.add_argument("--draft", type=Path, default=env_default("TANDEM_DRAFT_PATH", None))
    p.add_argument("--draft-kind", choices=DRAFT_KINDS, default=kind, required=kind is None)
    p.add_argument(
        "--mtp-mode", choices=MTP_MODES, default=env_default("TANDEM_DRAFT_MTP_MODE", "chain")
    )
    p.add_argument("--page-size", type=int, default=env_default("TANDEM_DRAFT_PAGE_SIZE", 16))
    p.add_argument("--num-pages", type=int, default=env_default("TANDEM_DRAFT_NUM_PAGES", 2048))
    p.add_argument("--device", default=env_default("TANDEM_DRAFT_DEVICE", "cpu"))
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=env_default("TANDEM_DRAFT_DTYPE", "float32")
    )
    _cuda_flag(
        p,
        "--cuda-graphs",
        "TANDEM_DRAFT_CUDA_GRAPHS",
        "draft chains and extends through CUDA graphs",
    )
    _cuda_flag(
        p,
        "--transposed-weights",
        "TANDEM_DRAFT_TRANSPOSED_WEIGHTS",
        "store the draft's projection weights transposed, the faster GEMM layout for decoding "
        "on Hopper",
    )
    p.add_argument("--host", default=env_default("TANDEM_DRAFT_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env_default("TANDEM_DRAFT_PORT", 0))
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=env_default("TANDEM_DRAFT_MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES),
    )
    p.add_argument(
        "--reflection",
        action=argparse.BooleanOptionalAction,
        default=env_default("TANDEM_DRAFT_REFLECTION", False),
    )
    p.add_argument(
        "--local-socket",
        default=env_default("TANDEM_DRAFT_LOCAL_SOCKET", None),
        help="also serve Speculate streams on this Unix socket (mode 0600), which a target on "
        "this host uses instead of gRPC when it can open it (default: none)",
    )
    p.add_argument(
        "--prompt-buffer-mb",
        type=int,
        default=env_default("TANDEM_DRAFT_PROMPT_BUFFER_MB", 256),
        help="on a local stream that shares this device with its target (CUDA IPC, or shared "
        "memory on CPU), a buffer of this size into which the target writes prompt features "
        "instead of sending them inline (default: 256; 0: inline)",
    )
    p.add_argument("--grace", type=float, default=env_default("TANDEM_DRAFT_GRACE_S", 10.0))
    p.add_argument("--log-level", default=env_default("TANDEM_DRAFT_LOG_LEVEL", "INFO"))
    telemetry.add_metrics_argument(p, env_default("TANDEM_DRAFT_METRICS_PORT", None))
    security.add_server_tls_arguments(p, "TANDEM_DRAFT_")
    return p


def _cuda_flag(p: argparse.ArgumentParser, flag: str, env_name: str, help_text: str) -> None:
    """A --flag/--no-flag that is on for CUDA devices when neither it nor ``env_name`` is set
    (its value is then None)."""
    default = None
    if env_default(env_name, None) is not None:
        default = env_default(env_name, True)
    p.add_argument(
        flag,
        action=argparse.BooleanOptionalAction,
        default=default,
        help=f"{help_text} (default: on for CUDA devices)",
    )


def parse_config(argv: Sequence[str] | None = None) -> DraftServiceConfig:
    """Flags (and their environment defaults) -> a validated config; exits with usage on
    an invalid value, naming the field."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return DraftServiceConfig(
            draft=DraftConfig(
                kind=args.draft_kind,
                path=args.draft,
                target=args.target,
                mtp_mode=args.mtp_mode,
                dtype=args.dtype,
                device=args.device,
                page_size=args.page_size,
                num_pages=args.num_pages,
                cuda_graphs=args.cuda_graphs,
                transposed_weights=args.transposed_weights,
            ),
            host=args.host,
            port=args.port,
            max_message_bytes=args.max_message_bytes,
            reflection=args.reflection,
            grace_s=args.grace,
            log_level=args.log_level,
            tls=security.server_tls_from_args(args),
            metrics_port=args.metrics_port,
            local_socket=args.local_socket,
            prompt_buffer_mb=args.prompt_buffer_mb,
        )
    except ValueError as exc:
        parser.error(str(exc))


async def run(config: DraftServiceConfig) -> int:
    """Serves until a signal; returns the process exit code (1 if the draft failed to load)."""
    observability = telemetry.setup("draft_service", metrics_port=config.metrics_port)
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
