"""Target service configuration (flags and ``TANDEM_TARGET_*`` environment variables)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.config import EngineConfig
from tandem.serving.security import ClientTLS, ServerTLS
from tandem.serving.telemetry import check_metrics_port
from tandem.spec.types import DRAFT_KINDS, SpecConfig


@dataclass(frozen=True, kw_only=True)
class TargetServiceConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port (logged)
    draft_addr: str | None = None  # HOST:PORT of the draft service; None = no speculation
    draft_kind: str | None = None  # reported to clients; the draft service decides
    spec: SpecConfig | None = None  # S, K, N when a draft is configured
    draft_deadline_s: float = 0.5  # a step's trees must arrive within this, else K=0 that step
    draft_local_stream: bool = True  # use the draft's local socket when it reports one (no TLS)
    status_interval_s: float = 0.25  # TargetStatus to the gateway at most this often
    # An idle engine's first admit waits up to this long for the rest of its burst (stopping
    # once none came for admission_gap_s, or once the waiting requests fill a step), so
    # prompts arriving together prefill together.
    admission_window_s: float = 0.05
    admission_gap_s: float = 0.002
    reflection: bool = False
    grace_s: float = 10.0  # SIGTERM: drain this long before exiting
    max_message_bytes: int = 64 << 20
    tls: ServerTLS | None = None  # TLS (mTLS with require_client_cert) on the port; None = plain
    draft_tls: ClientTLS | None = None  # TLS (mTLS with cert/key) to the draft; None = plain
    metrics_port: int | None = None  # Prometheus /metrics on this port; None = none

    def __post_init__(self) -> None:
        check_metrics_port(self.metrics_port)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a port number")
        if (self.draft_addr is None) != (self.spec is None):
            raise ValueError("draft_addr: a draft address and its speculation settings go together")
        if self.draft_kind is not None and self.draft_kind not in DRAFT_KINDS:
            raise ValueError(f"draft_kind: {self.draft_kind!r} is not one of {DRAFT_KINDS}")
        if self.draft_deadline_s <= 0:
            raise ValueError("draft_deadline_s: must be > 0")
        if self.admission_window_s < 0:
            raise ValueError("admission_window_s: must be >= 0")
        if self.admission_gap_s <= 0:
            raise ValueError("admission_gap_s: must be > 0")
        if self.grace_s < 0:
            raise ValueError("grace_s: must be >= 0")
        if self.draft_tls is not None and self.draft_addr is None:
            raise ValueError("draft_tls: TLS settings for a draft, but no draft_addr")

    @property
    def model_dir(self) -> Path:
        return self.engine.model
