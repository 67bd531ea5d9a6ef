"""Gateway configuration: each setting's help, flag and ``TANDEM_GATEWAY_*`` variable
(tandem.settings; ``python -m gateway --help`` lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.serving.rpc import parse_address
from tandem.serving.security import MIN_TOKEN_CHARS, ClientTLS, ServerTLS
from tandem.serving.telemetry import METRICS_PORT, check_metrics_port
from tandem.settings import (
    FAILOVER_WAIT,
    GRACE,
    HOST,
    LOG_LEVEL,
    PORT,
    REFLECTION,
    SMG_PORT,
    TWO_LANE_BATCH,
    setting,
)

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Everything `python -m gateway` needs; validated on construction (ValueError names the
    field)."""

    target_addr: str = setting(help="HOST:PORT of the target service", env="TARGET_ADDR")
    tokenizer: Path = setting(
        help="the target checkpoint directory (its tokenizer files)", env="TOKENIZER"
    )
    host: str = setting("0.0.0.0", like=HOST)  # the public face: every interface by default
    port: int = setting(50051, like=PORT)
    max_running: int = setting(
        64, help="requests admitted at the target at once", env="MAX_RUNNING"
    )
    max_queue: int = setting(
        256,
        help="requests waiting for admission; beyond it RESOURCE_EXHAUSTED",
        env="MAX_QUEUE",
    )
    max_request_bytes: int = setting(
        8 << 20,
        help="largest public request message in bytes; a bigger one is refused with "
        "RESOURCE_EXHAUSTED before it is read",
        env="MAX_REQUEST_BYTES",
    )
    slow_reader_timeout_s: float = setting(
        30.0,
        help="seconds a Generate stream waits for its client to take a message before it is "
        "cut off, its admission slot and the target's pages freed",
        env="SLOW_READER_TIMEOUT",
        flag="slow-reader-timeout",
    )
    reflection: bool = setting(False, like=REFLECTION)
    grace_s: float = setting(10.0, like=GRACE)  # SIGTERM: drain this long before exiting
    log_level: str = setting("INFO", like=LOG_LEVEL)
    max_stop_strings: int = 8
    max_stop_string_chars: int = 256
    retry_after_s: float = 1.0  # RetryInfo.retry_delay sent with RESOURCE_EXHAUSTED
    target_timeout_s: float = 5.0  # unary calls to the target (GetInfo)
    max_message_bytes: int = 64 << 20  # the channel to the target, either direction
    two_lane_batch: int = setting(16, like=TWO_LANE_BATCH)  # 0 = always one lane
    failover_wait_s: float = setting(60.0, like=FAILOVER_WAIT)  # gateway/failover.py
    tls: ServerTLS | None = None  # TLS on the public port; None = plain
    # Accepted bearer tokens for the public API (health exempt); empty = no authentication.
    auth_tokens: tuple[str, ...] = field(default=(), repr=False)
    target_tls: ClientTLS | None = None  # TLS (mTLS with cert/key) to the target; None = plain
    metrics_port: int | None = setting(None, like=METRICS_PORT)  # None: no /metrics
    smg_port: int | None = setting(None, like=SMG_PORT)  # None: no worker protocol

    def __post_init__(self) -> None:
        check_metrics_port(self.metrics_port)
        try:
            _, target_port = parse_address(self.target_addr)
        except ValueError:
            raise ValueError(f"target_addr: expected HOST:PORT, got {self.target_addr!r}") from None
        if target_port == 0:
            raise ValueError("target_addr: port 0 is not a target's port")
        if not Path(self.tokenizer).is_dir():
            raise ValueError(f"tokenizer: {self.tokenizer} is not a directory")
        object.__setattr__(self, "tokenizer", Path(self.tokenizer))
        if not self.host:
            raise ValueError("host: must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a port number")
        if self.smg_port is not None and not 0 <= self.smg_port < 65536:
            raise ValueError(f"smg_port: {self.smg_port} is not a port number")
        if self.max_running < 1:
            raise ValueError(f"max_running: must be >= 1, got {self.max_running}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue: must be >= 0, got {self.max_queue}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s}")
        if self.log_level.upper() not in _LOG_LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {_LOG_LEVELS}")
        if self.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings: must be >= 0, got {self.max_stop_strings}")
        if self.max_stop_string_chars < 1:
            raise ValueError("max_stop_string_chars: must be >= 1")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s: must be > 0, got {self.retry_after_s}")
        if self.target_timeout_s <= 0:
            raise ValueError(f"target_timeout_s: must be > 0, got {self.target_timeout_s}")
        if not 0 <= self.failover_wait_s < float("inf"):
            raise ValueError(
                f"failover_wait_s: must be >= 0 and finite, got {self.failover_wait_s}"
            )
        if self.two_lane_batch < 0:
            raise ValueError(f"two_lane_batch: must be >= 0, got {self.two_lane_batch}")
        if self.max_message_bytes < 1 << 20:
            raise ValueError("max_message_bytes: must be at least 1 MiB")
        if self.max_request_bytes < 64 << 10:
            raise ValueError("max_request_bytes: must be at least 64 KiB")
        if self.slow_reader_timeout_s <= 0:
            raise ValueError(
                f"slow_reader_timeout_s: must be > 0, got {self.slow_reader_timeout_s}"
            )
        object.__setattr__(self, "auth_tokens", tuple(self.auth_tokens))
        if any(len(token) < MIN_TOKEN_CHARS for token in self.auth_tokens):
            raise ValueError(f"auth_tokens: each needs at least {MIN_TOKEN_CHARS} characters")


@dataclass(frozen=True, kw_only=True)
class TokenSources:
    """Where ``GatewayConfig.auth_tokens`` come from on the command line
    (``security.load_tokens``)."""

    auth_token: str | None = setting(
        None,
        help="accepted bearer token; prefer the variable or --auth-token-file (argv is visible)",
        env="AUTH_TOKEN",
        repr=False,
    )
    auth_token_file: Path | None = setting(
        None, help="file of accepted tokens, one per line (# comments)", env="AUTH_TOKEN_FILE"
    )
