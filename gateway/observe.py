"""The gateway's traces and metrics (tandem.serving.telemetry).

Each Generate call gets one request span named ``text_completion {model}`` with GenAI
semantic-convention attributes (``gen_ai.operation.name``, ``gen_ai.provider.name`` = ``tandem``,
``gen_ai.request.*``, ``gen_ai.response.model``, ``gen_ai.response.finish_reasons``,
``gen_ai.usage.input_tokens``/``output_tokens``, ``error.type`` when it failed) plus the
speculation usage (``tandem.spec.*``) and events queued, admitted, first_token, finished. Its
context goes to the target in ``AdmitCommand.trace_context``, so the target's and the draft's
request spans join the same trace. The model is the target's served name (its
``--served-model-name``), never a path. Metrics: request outcomes, TTFT, TPOT and duration as
the GenAI server histograms (with the attributes the conventions require), token usage counters
(draft and accepted tokens included: they add up to the target's spec-decoding counters), queue
depth and running requests."""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry import metrics, trace

from tandem.serving import telemetry
from tandem.v1 import common_pb2, target_pb2

OPERATION = "text_completion"
_USAGE = {
    "prompt_tokens": "prompt tokens of finished requests",
    "completion_tokens": "tokens returned to clients",
    "draft_tokens": "draft tokens verified for finished requests",
    "accepted_tokens": "draft tokens accepted for finished requests",
}
# The GenAI semantic conventions' model server histograms, with their descriptions.
_SERVER_HISTOGRAMS = (
    (
        "gen_ai.server.request.duration",
        "Generative AI server request duration such as time-to-last byte or last output token.",
    ),
    ("gen_ai.server.time_to_first_token", "Time to generate first token for successful responses."),
    (
        "gen_ai.server.time_per_output_token",
        "Time per output token generated after the first token for successful responses.",
    ),
)


class GatewayObserver:
    def __init__(
        self,
        model: Callable[[], str],
        queue: Callable[[], tuple[int, int]],
        connected: Callable[[], bool] = lambda: True,
        *,
        tracer_provider: trace.TracerProvider | None = None,  # None: the global ones
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self._tracer = trace.get_tracer("tandem.gateway", tracer_provider=tracer_provider)
        self._model = model  # the target's served model name, once known
        meter = metrics.get_meter("tandem.gateway", meter_provider=meter_provider)
        self.requests = meter.create_counter(
            "tandem.requests",
            unit="{request}",
            description="finished requests (attribute finish_reason)",
        )
        self.usage = {
            key: meter.create_counter(f"tandem.usage.{key}", unit="{token}", description=text)
            for key, text in _USAGE.items()
        }
        self.duration, self.ttft, self.tpot = (
            telemetry.latency_histogram(meter, name, text) for name, text in _SERVER_HISTOGRAMS
        )
        telemetry.gauge(
            meter,
            "tandem.gateway.requests",
            "{request}",
            "requests at the gateway (attribute state: running or queued)",
            lambda: [
                (queue()[0], {"state": "running"}),
                (queue()[1], {"state": "queued"}),
            ],
        )
        telemetry.gauge(
            meter,
            "tandem.gateway.target_connected",
            "",  # a 0/1 state, no unit (telemetry.gauge)
            "1 while the control stream to the target is up (its numbers are known), else 0",
            lambda: [(int(connected()), {})],
        )

    def _labels(self) -> dict[str, str]:
        """The attributes the GenAI conventions require (or ask for) on the server metrics;
        the model only once the target has named it."""
        model = self._model()
        labels = {"gen_ai.operation.name": OPERATION, "gen_ai.provider.name": telemetry.PROVIDER}
        if model:
            labels |= {"gen_ai.request.model": model, "gen_ai.response.model": model}
        return labels

    def start(self, request_id: str, admit: target_pb2.AdmitCommand) -> trace.Span:
        """The request's span (a child of the current RPC span); its context replaces what
        the admit carries to the target."""
        labels = self._labels()
        sampling = admit.sampling
        span = self._tracer.start_span(
            f"{OPERATION} {labels.get('gen_ai.request.model', '')}".strip(),
            kind=trace.SpanKind.SERVER,
            attributes={
                **{k: v for k, v in labels.items() if k != "gen_ai.response.model"},
                "gen_ai.request.max_tokens": sampling.max_new_tokens,
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "gen_ai.request.top_k": sampling.top_k,
                "gen_ai.request.stream": True,
                "gen_ai.response.id": request_id,
                "gen_ai.usage.input_tokens": len(admit.prompt_token_ids),
                "tandem.lane": admit.lane_id,
            },
        )
        if sampling.HasField("seed"):
            span.set_attribute("gen_ai.request.seed", sampling.seed)
        span.add_event("queued")
        admit.trace_context.carrier.clear()
        carrier: dict[str, str] = {}
        telemetry.inject(carrier, span)
        admit.trace_context.carrier.update(carrier)
        return span

    def finish(
        self,
        span: trace.Span,
        reason: common_pb2.FinishReason,
        usage: common_pb2.Usage,
        *,
        received_ns: int,
        first_chunk_ns: int,
        now_ns: int,
        error: str | None = None,
    ) -> None:
        name = common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
        labels = self._labels()
        span.set_attributes(
            {
                **{k: v for k, v in labels.items() if k == "gen_ai.response.model"},
                "gen_ai.response.finish_reasons": [name],
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
                "tandem.spec.draft_tokens": usage.draft_tokens,
                "tandem.spec.accepted_tokens": usage.accepted_tokens,
                "tandem.spec.verify_steps": usage.verify_steps,
                "tandem.spec.accept_length": usage.accept_length,
            }
        )
        if error is not None:  # error.type: low cardinality, the finish reason (abort, error)
            span.set_attribute("error.type", name)
            span.set_status(trace.StatusCode.ERROR, error)
        span.add_event("finished", {"finish_reason": name})
        span.end()
        self.requests.add(1, {"finish_reason": name})
        for key, counter in self.usage.items():
            counter.add(getattr(usage, key))
        failed = {"error.type": name} if error is not None else {}
        self.duration.record((now_ns - received_ns) / 1e9, {**labels, **failed})
        if first_chunk_ns and error is None:  # TTFT and TPOT: successful responses only
            self.ttft.record((first_chunk_ns - received_ns) / 1e9, labels)
            if usage.completion_tokens > 1:
                tpot = (now_ns - first_chunk_ns) / 1e9 / (usage.completion_tokens - 1)
                self.tpot.record(tpot, labels)
