"""The gateway's traces and metrics (tandem.serving.telemetry).

Each Generate call gets one request span named ``text_completion {model}`` with GenAI
semantic-convention attributes (``gen_ai.operation.name``, ``gen_ai.request.*``,
``gen_ai.response.finish_reasons``, ``gen_ai.usage.input_tokens``/``output_tokens``) plus the
speculation usage (``tandem.spec.*``) and events queued, admitted, first_token, finished. Its
context goes to the target in ``AdmitCommand.trace_context``, so the target's and the draft's
request spans join the same trace. Metrics: request outcomes, TTFT, TPOT and duration as the
GenAI server histograms, token usage counters (draft and accepted tokens included: they add
up to the target's spec-decoding counters), queue depth and running requests."""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry import metrics, trace

from tandem.serving import telemetry
from tandem.v1 import common_pb2, target_pb2

OPERATION = "text_completion"


class GatewayObserver:
    def __init__(
        self,
        model: Callable[[], str],
        queue: Callable[[], tuple[int, int]],
        connected: Callable[[], bool] = lambda: True,
    ) -> None:
        self._tracer = trace.get_tracer("tandem.gateway")
        self._model = model  # the target's model id, once known
        meter = metrics.get_meter("tandem.gateway")
        self.requests = meter.create_counter(
            "tandem.requests", description="finished requests (attribute finish_reason)"
        )
        self.usage = {
            key: meter.create_counter(f"tandem.usage.{key}", unit="{token}")
            for key in ("prompt_tokens", "completion_tokens", "draft_tokens", "accepted_tokens")
        }
        self.duration = telemetry.latency_histogram(meter, "gen_ai.server.request.duration")
        self.ttft = telemetry.latency_histogram(meter, "gen_ai.server.time_to_first_token")
        self.tpot = telemetry.latency_histogram(meter, "gen_ai.server.time_per_output_token")
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
            "1",
            "1 while the control stream to the target is up (its numbers are known), else 0",
            lambda: [(int(connected()), {})],
        )

    def start(self, request_id: str, admit: target_pb2.AdmitCommand) -> trace.Span:
        """The request's span (a child of the current RPC span); its context replaces what
        the admit carries to the target."""
        model = self._model()
        sampling = admit.sampling
        span = self._tracer.start_span(
            f"{OPERATION} {model}".strip(),
            kind=trace.SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": OPERATION,
                "gen_ai.request.model": model,
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
        span.set_attributes(
            {
                "gen_ai.response.finish_reasons": [name],
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
                "tandem.spec.draft_tokens": usage.draft_tokens,
                "tandem.spec.accepted_tokens": usage.accepted_tokens,
                "tandem.spec.verify_steps": usage.verify_steps,
                "tandem.spec.accept_length": usage.accept_length,
            }
        )
        if error is not None:
            span.set_status(trace.StatusCode.ERROR, error)
        span.add_event("finished", {"finish_reason": name})
        span.end()
        self.requests.add(1, {"finish_reason": name})
        for key, counter in self.usage.items():
            counter.add(getattr(usage, key))
        self.duration.record((now_ns - received_ns) / 1e9)
        if first_chunk_ns:
            self.ttft.record((first_chunk_ns - received_ns) / 1e9)
            if usage.completion_tokens > 1:
                tpot = (now_ns - first_chunk_ns) / 1e9 / (usage.completion_tokens - 1)
                self.tpot.record(tpot)
