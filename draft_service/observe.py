"""The draft's traces and metrics (tandem.serving.telemetry): one span per request it tracks (a
child of the target's request span, whose context comes in ``DraftAdmit.trace_context``) and
counters of its steps, trees and proposed tokens, with its KV pool as gauges. Without
``telemetry.setup`` all of it is a no-op."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from opentelemetry import metrics, trace

from tandem.serving import telemetry
from tandem.spec.types import DraftAdmit, Tree

_SERVICE = {"tandem.service": "draft"}


class DraftMetrics:
    """Process-wide instruments; ``kv`` reads (pages used, pages total) without blocking."""

    def __init__(
        self,
        kv: Callable[[], tuple[int, int]],
        meter_provider: metrics.MeterProvider | None = None,  # None: the global one
    ) -> None:
        meter = metrics.get_meter("tandem.draft", meter_provider=meter_provider)
        self.steps = meter.create_counter(
            "tandem.draft.steps", unit="{step}", description="Speculate messages answered"
        )
        self.trees = meter.create_counter(
            "tandem.draft.trees", unit="{tree}", description="trees sent"
        )
        self.proposed_tokens = meter.create_counter(
            "tandem.draft.proposed_tokens", unit="{token}", description="draft nodes in trees"
        )
        self.step_duration = telemetry.latency_histogram(
            meter, "tandem.draft.step.duration", "receipt to response"
        )
        telemetry.gauge(
            meter, "tandem.kv.pages_used", "{page}", "KV pages allocated",
            lambda: [(kv()[0], _SERVICE)],
        )  # fmt: skip
        telemetry.gauge(
            meter, "tandem.kv.pages_capacity", "{page}", "KV pages in the pool",
            lambda: [(kv()[1], _SERVICE)],
        )  # fmt: skip

    def stepped(self, trees: Iterable[Tree], seconds: float, lane: int) -> None:
        self.steps.add(1, {"lane": lane})
        for tree in trees:
            self.trees.add(1)
            self.proposed_tokens.add(len(tree) - 1)
        self.step_duration.record(seconds, {"lane": lane})


class StreamSpans:
    """The request spans of one Speculate stream."""

    def __init__(self) -> None:
        self._tracer = trace.get_tracer("tandem.draft")
        self._spans: dict[str, trace.Span] = {}

    def admitted(self, admits: Sequence[DraftAdmit]) -> None:
        for admit in admits:
            self.ended([admit.request_id], "readmitted")
            span = self._tracer.start_span(
                "tandem.draft.request",
                context=telemetry.extract(admit.trace_context),
                attributes={"gen_ai.response.id": admit.request_id},
            )
            span.add_event("admitted", {"tandem.prompt_tokens": len(admit.token_ids)})
            self._spans[admit.request_id] = span

    def ended(self, request_ids: Iterable[str], why: str) -> None:
        for request_id in request_ids:
            span = self._spans.pop(request_id, None)
            if span is not None:
                span.add_event(why)
                span.end()

    def close(self) -> None:
        self.ended(list(self._spans), "stream closed")
