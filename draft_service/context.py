"""What one Speculate stream needs of the draft service, whatever carries it (the gRPC stream
in ``server.py``, a local socket in ``local.py``): the engine that runs its steps, the metrics
they feed, the limits a stream may ask for, the hello that answers its first message, and
the device-sharing facilities of a local stream (the transport, the prompt buffer's size).

The service builds one ``StreamContext`` and hands it to every stream; a stream reaches
nothing else of the service.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from draft_service.config import DraftServiceConfig
from draft_service.engine import DraftEngine, DraftInfo
from draft_service.observe import DraftMetrics
from tandem import wire
from tandem.link.local import sharing_transport
from tandem.serving import step_log
from tandem.serving.step_log import StepLog
from tandem.spec.types import SpecConfig
from tandem.v1 import draft_pb2


@dataclass(frozen=True, kw_only=True)
class StreamContext:
    """The service's side of every stream (module docstring)."""

    engine: DraftEngine  # the drafter's worker thread: steps, releases, the loaded draft
    metrics: DraftMetrics
    max_spec: SpecConfig  # the largest S, K and N a stream may ask for
    max_message_bytes: int
    device: torch.device  # the draft's: what a local stream may share with its target
    prompt_buffer_bytes: int  # a device-sharing local stream's prompt buffer (0: inline)
    step_log: StepLog | None = None  # each step's timings (TANDEM_DRAFT_STEP_LOG), for benchmarks
    # Random per process: GetInfo and the hello report it, so a target that reaches the
    # local socket knows it is this service's.
    instance_id: str = field(default_factory=lambda: secrets.token_hex(8))
    _stream_ids: Iterator[int] = field(default_factory=itertools.count)

    @classmethod
    def create(cls, engine: DraftEngine, config: DraftServiceConfig) -> StreamContext:
        return cls(
            engine=engine,
            metrics=DraftMetrics(engine.last_kv_usage),
            max_spec=config.max_spec,
            max_message_bytes=config.max_message_bytes,
            device=torch.device(config.draft.device),
            prompt_buffer_bytes=config.prompt_buffer_mb << 20,
            step_log=StepLog.from_env(step_log.DRAFT_ENV),
        )

    def next_stream_id(self) -> int:
        return next(self._stream_ids)

    def hello(self, info: DraftInfo) -> draft_pb2.SpeculateHello:
        """The hello of a stream's first answer."""
        return draft_pb2.SpeculateHello(
            protocol_version=wire.PROTOCOL_VERSION,
            tensor_transports=[draft_pb2.TENSOR_TRANSPORT_INLINE],
            max_message_bytes=self.max_message_bytes,
            model_id=info.model_id,
            instance_id=self.instance_id,
        )

    def sharing(self, offered: Sequence[int], target_device: str = "") -> int:
        """The transport a local stream shares this draft's device by (0: none): the one its
        device type has, when the target offered it; for CUDA only when the target names this
        draft's GPU (``target_device``, its UUID: CUDA IPC maps one GPU's memory)."""
        return sharing_transport(self.device, offered, target_device)
