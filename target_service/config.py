"""Target service configuration: each setting's help, flag and ``TANDEM_TARGET_*`` variable
(tandem.settings; ``python -m target_service --help`` lists them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.config import DRAFT_KIND, EngineConfig
from tandem.serving.security import ClientTLS, ServerTLS
from tandem.serving.telemetry import METRICS_PORT, check_metrics_port
from tandem.settings import (
    DRAFT_DEADLINE,
    GRACE,
    HOST,
    LOG_LEVEL,
    PORT,
    REFLECTION,
    SERVED_MODEL_NAME,
    setting,
)
from tandem.spec.types import DRAFT_KINDS, SpecConfig

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True, kw_only=True)
class TargetServiceConfig:
    engine: EngineConfig
    host: str = setting("127.0.0.1", like=HOST)
    port: int = setting(0, like=PORT)
    draft_addr: str | None = setting(  # None: no speculation
        None, help="HOST:PORT of the draft service; without it, no speculation", env="DRAFT_ADDR"
    )
    # Reported to clients; the draft service decides what runs.
    draft_kind: str | None = setting(None, like=DRAFT_KIND, env="DRAFT_KIND")
    spec: SpecConfig | None = None  # S, K, N when a draft is configured
    # A step's trees must arrive within this, else K=0 that step.
    draft_deadline_s: float = setting(0.5, like=DRAFT_DEADLINE)
    draft_local_stream: bool = setting(  # the draft's local socket when it reports one (no TLS)
        True,
        help="when the draft reports a local socket this host can open, run the Speculate "
        "stream there instead of over gRPC (never with draft TLS)",
        env="DRAFT_LOCAL_STREAM",
    )
    status_interval_s: float = 0.25  # TargetStatus to the gateway at most this often
    # An idle engine's first admit waits up to this long for the rest of its burst (stopping
    # once none came for admission_gap_s, or once the waiting requests fill a step), so
    # prompts arriving together prefill together.
    admission_window_s: float = setting(
        0.05,
        help="seconds an idle target waits at most after a first request for the rest of its "
        "burst, so they prefill together (stops sooner once none came for --admission-gap, or "
        "once the waiting requests fill a step; 0: off)",
        env="ADMISSION_WINDOW",
        flag="admission-window",
    )
    admission_gap_s: float = setting(
        0.002,
        help="seconds without a new request that end an idle target's wait for a burst (a "
        "burst under way waits four times its mean spacing, at most five gaps)",
        env="ADMISSION_GAP",
        flag="admission-gap",
    )
    reflection: bool = setting(False, like=REFLECTION)
    served_model_name: str | None = setting(None, like=SERVED_MODEL_NAME)  # see model_name
    vllm_metric_names: bool = setting(
        False,
        help="also export the spec-decoding counters under vLLM's names and labels "
        "(vllm:spec_decode_num_*_total{model_name,engine}) for dashboards built for vLLM; "
        "promtool check metrics then flags their colons, as it flags vLLM's own",
        env="VLLM_METRIC_NAMES",
    )
    grace_s: float = setting(10.0, like=GRACE)  # SIGTERM: drain this long before exiting
    max_message_bytes: int = 64 << 20
    tls: ServerTLS | None = None  # TLS (mTLS with require_client_cert) on the port; None = plain
    draft_tls: ClientTLS | None = None  # TLS (mTLS with cert/key) to the draft; None = plain
    metrics_port: int | None = setting(None, like=METRICS_PORT)  # None: no /metrics
    log_level: str = setting("INFO", like=LOG_LEVEL, env="TANDEM_LOG_LEVEL")

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
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name: must not be empty")
        if self.log_level.upper() not in _LOG_LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {_LOG_LEVELS}")

    @property
    def model_dir(self) -> Path:
        return self.engine.model

    @property
    def model_name(self) -> str:
        """The served model name: ``served_model_name``, else the checkpoint's (never a path)."""
        return self.served_model_name or default_model_name(self.model_dir)


def default_model_name(model_dir: Path) -> str:
    """The checkpoint directory's name, or its family's where a ``family.json`` beside it says
    the directory is one member (the embedded model: ``tandem-code-ref``, not ``target``)."""
    path = model_dir.resolve()
    if (path.parent / "family.json").is_file():
        return path.parent.name
    return path.name
