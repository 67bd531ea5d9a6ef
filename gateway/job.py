"""A Generate request at the gateway: `prepare` validates it, its prompt read, into a `Job`, the
record the servicer (`gateway/server.py`) keeps from receipt to its last message."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

from opentelemetry import propagate, trace

from gateway.config import GatewayConfig
from tandem import wire
from tandem.errors import InvalidRequest
from tandem.v1 import common_pb2, gateway_pb2, target_pb2

_MAX_REQUEST_ID_CHARS = 256


@dataclass(kw_only=True)
class Job:
    """One request at the gateway, from receipt to its last message."""

    request_id: str  # the client's (or assigned) id
    prompt_ids: list[int]
    admit: target_pb2.AdmitCommand  # what the target gets (explicit sampling values)
    stop_strings: tuple[str, ...]
    stop_token_ids: frozenset[int]
    detokenize: bool
    skip_special_tokens: bool
    continuous_usage: bool
    received_ns: int
    admitted_ns: int = 0
    first_chunk_ns: int = 0
    completion_ids: list[int] = field(default_factory=list)  # ids streamed to the client
    admitted: bool = False  # sent to the target
    span: trace.Span | None = None  # the request's span, until it ends
    aborting: bool = False  # an Abort call asked for it
    finished: bool = False  # its last message is decided
    closed: bool = False  # gone from the servicer: slot released, target told
    key: tuple[str, str] = ("", "")  # (principal, request id): the servicer's key for it
    # Its first target id (unique at this gateway): its admission slot and failover record
    # keep it when a re-admission gives it another (``gateway.failover``).
    origin: str = ""

    def __post_init__(self) -> None:
        self.origin = self.origin or self.admit.request_id

    @property
    def target_id(self) -> str:
        return self.admit.request_id


def prepare(
    request: gateway_pb2.GenerateRequest,
    *,
    prompt_ids: list[int],
    info: target_pb2.TargetServiceGetInfoResponse,
    config: GatewayConfig,
    running: Collection[str],
    received_ns: int,
    seq: int,
) -> Job:
    """Validates a request whose prompt is read (``gateway.prompt``: its size checked, its
    text tokenized); InvalidRequest names the offending field.

    The id on the control stream is the client's id plus the gateway's sequence number, so a
    client may reuse an id as soon as its request ended here, even while the target is still
    finishing the old one (vLLM's abort test does exactly that)."""
    if request.HasField("request_id"):
        request_id = request.request_id
        if not request_id or len(request_id) > _MAX_REQUEST_ID_CHARS:
            raise InvalidRequest("request_id", f"must be 1..{_MAX_REQUEST_ID_CHARS} characters")
        if request_id in running:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
    else:
        request_id = uuid.uuid4().hex
    room = info.max_model_len - len(prompt_ids)  # >= 1: the prompt reader checked
    sampling = request.sampling
    if sampling.HasField("max_new_tokens") and sampling.max_new_tokens > room:
        raise InvalidRequest(
            "sampling.max_new_tokens",
            f"{sampling.max_new_tokens} new tokens after {len(prompt_ids)} prompt tokens "
            f"exceed the {info.max_model_len}-token context",
        )
    params = wire.sampling_from_proto(sampling, default_max_new_tokens=room, field="sampling")
    if bad := [t for t in params.stop_token_ids if t >= info.vocab_size]:
        raise InvalidRequest("sampling.stop_token_ids", f"ids {bad[:4]} outside the vocabulary")
    stop_strings = tuple(sampling.stop_strings)
    if len(stop_strings) > config.max_stop_strings:
        raise InvalidRequest("sampling.stop_strings", f"at most {config.max_stop_strings}")
    if any(not s or len(s) > config.max_stop_string_chars for s in stop_strings):
        raise InvalidRequest(
            "sampling.stop_strings", f"each must be 1..{config.max_stop_string_chars} characters"
        )
    spec = request.speculation
    if spec.draft_kind not in (common_pb2.DRAFT_KIND_UNSPECIFIED, info.draft_kind):
        raise InvalidRequest("speculation.draft_kind", "is not the deployed draft kind")
    # S, K and N preferences wait for the lane policy; topk=0 is honoured as an opt-out.
    enabled = not (spec.HasField("enabled") and not spec.enabled)
    enabled = enabled and not (spec.HasField("topk") and spec.topk == 0)
    admit = target_pb2.AdmitCommand(
        request_id=f"{request_id}#{seq}",
        prompt_token_ids=prompt_ids,
        sampling=wire.sampling_to_proto(params),
        speculation=common_pb2.SpeculationParams(enabled=enabled, draft_kind=info.draft_kind),
    )
    admit.sampling.logprobs = sampling.logprobs
    propagate.inject(admit.trace_context.carrier)
    options = request.stream_options
    return Job(
        request_id=request_id,
        prompt_ids=prompt_ids,
        admit=admit,
        stop_strings=stop_strings,
        stop_token_ids=frozenset(params.stop_token_ids),
        detokenize=not options.HasField("detokenize") or options.detokenize,
        skip_special_tokens=options.skip_special_tokens,
        continuous_usage=options.continuous_usage,
        received_ns=received_ns,
    )
