"""Draft service configuration: what to load (a `DraftConfig`) and how to serve it.

Each setting's help, flag and ``TANDEM_DRAFT_*`` variable are declared on its field
(tandem.settings; ``python -m draft_service --help`` lists them); flags win over the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config import DraftConfig
from tandem.link.local import check_path
from tandem.serving.rpc import DEFAULT_MAX_MESSAGE_BYTES, format_address
from tandem.serving.security import ServerTLS
from tandem.serving.telemetry import METRICS_PORT, check_metrics_port
from tandem.settings import GRACE, HOST, LOG_LEVEL, PORT, REFLECTION, setting
from tandem.spec.types import SpecConfig

MIN_MESSAGE_BYTES = 64 * 1024  # room for a hello, a few outcomes and one small frame

# The largest S, K and N a Speculate stream may ask for (GetInfo reports them). Generous: the
# draft's work grows with them, but it has no fixed buffers that would cap them today.
DEFAULT_MAX_SPEC = SpecConfig(num_steps=8, topk=8, num_draft_tokens=64)


@dataclass(frozen=True, kw_only=True)
class DraftServiceConfig:
    """How one draft service loads its drafter and listens."""

    draft: DraftConfig  # kind, checkpoint, target, dtype, device, KV pool
    host: str = setting("127.0.0.1", like=HOST)
    port: int = setting(0, like=PORT)  # 0 = any free port (printed and logged once bound)
    max_spec: SpecConfig = field(default_factory=lambda: DEFAULT_MAX_SPEC)
    max_message_bytes: int = setting(  # per message, both directions
        DEFAULT_MAX_MESSAGE_BYTES,
        help="largest gRPC message, either direction, in bytes",
        env="MAX_MESSAGE_BYTES",
    )
    reflection: bool = setting(False, like=REFLECTION)  # grpcurl; off in production
    # SIGTERM: open streams get this long before they are cut.
    grace_s: float = setting(10.0, like=GRACE, env="GRACE_S")
    log_level: str = setting("INFO", like=LOG_LEVEL)
    tls: ServerTLS | None = None  # TLS (mTLS with require_client_cert) on the port; None = plain
    metrics_port: int | None = setting(None, like=METRICS_PORT)  # None: no /metrics
    # Also serve Speculate streams on this Unix socket (tandem.link.local), for a target on
    # this host; None = gRPC only.
    local_socket: str | None = setting(
        None,
        help="also serve Speculate streams on this Unix socket (mode 0600), which a target on "
        "this host uses instead of gRPC when it can open it",
        env="LOCAL_SOCKET",
        shown_default="none (gRPC only)",
    )
    # On a local stream that shares the device with its target (draft_service/chain.py), a
    # buffer of this many MiB for the target's prompt features (0: they travel inline).
    prompt_buffer_mb: int = setting(
        256,
        help="on a local stream that shares this device with its target (CUDA IPC, or shared "
        "memory on CPU), a buffer of this many MiB into which the target writes prompt "
        "features instead of sending them inline (0: inline)",
        env="PROMPT_BUFFER_MB",
    )

    def __post_init__(self) -> None:
        check_metrics_port(self.metrics_port)
        if not self.host:
            raise ValueError("host: must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a port number")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes: must be >= {MIN_MESSAGE_BYTES}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s}")
        if self.local_socket is not None:
            check_path(self.local_socket)
        if self.prompt_buffer_mb < 0:
            raise ValueError(f"prompt_buffer_mb: must be >= 0, got {self.prompt_buffer_mb}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"log_level: {self.log_level!r} is not a logging level")

    @property
    def bind_address(self) -> str:
        return format_address(self.host, self.port)
