"""The target's traces and metrics (tandem.serving.telemetry): one span per request, per-step spans
behind ``TANDEM_STEP_TRACE_RATIO``, and the spec-decoding counters vLLM exports (drafts, draft
tokens, accepted tokens, accepted per position; with vLLM's names and labels through
``telemetry.views``: ``model_name`` the served model name, ``engine`` 0) plus fallback steps,
accept length, step time, KV pages and queue depth. All of it runs on the engine thread;
without ``telemetry.setup`` it is a no-op."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping

from opentelemetry import metrics, trace

from tandem.clock import StepTiming
from tandem.request import RequestOutput
from tandem.serving import telemetry
from tandem.spec.types import SpecStats
from tandem.target.engine import Engine

_SERVICE = {"tandem.service": "target"}


class TargetObserver:
    def __init__(
        self,
        engine: Engine,
        fallbacks: Callable[[], int],
        model_name: str = "",
        *,
        tracer_provider: trace.TracerProvider | None = None,  # None: the global ones
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self._tracer = trace.get_tracer("tandem.target", tracer_provider=tracer_provider)
        meter = metrics.get_meter("tandem.target", meter_provider=meter_provider)
        self._spans: dict[str, trace.Span] = {}
        self._streaming: set[str] = set()  # requests whose first token is out
        self._fallbacks = fallbacks  # the draft client's fallback-step count so far
        self._last_fallbacks = 0
        self._step_ratio = telemetry.step_trace_ratio()
        self._random = random.Random()
        self._vllm = {"model_name": model_name, "engine": "0"}  # vLLM's labels
        self._per_pos = [{**self._vllm, "position": str(p)} for p in range(64)]
        counter = meter.create_counter
        self.drafts = counter(
            "tandem.spec_decode.drafts", unit="{draft}", description="verify steps with a tree"
        )
        self.draft_tokens = counter(
            "tandem.spec_decode.draft_tokens",
            unit="{token}",
            description="draft tokens verified (tree nodes below the root)",
        )
        self.accepted_tokens = counter(
            "tandem.spec_decode.accepted_tokens",
            unit="{token}",
            description="draft tokens accepted",
        )
        self.accepted_per_pos = counter(
            "tandem.spec_decode.accepted_tokens_per_pos",
            unit="{token}",
            description="accepted drafts by depth (attribute position, from 0)",
        )
        self.verify_steps = counter(
            "tandem.spec_decode.verify_steps",
            unit="{step}",
            description="request verifications, K=0 included",
        )
        self.without_tree = counter(
            "tandem.spec_decode.steps_without_tree",
            unit="{step}",
            description="request decode steps without a draft token, by cause (attribute reason)",
        )
        self.fallback_steps = counter(
            "tandem.spec_decode.fallback_steps",
            unit="{step}",
            description="lane steps without trees because the draft was late or gone",
        )
        self.accept_length = meter.create_histogram(
            "tandem.spec_decode.accept_length",
            unit="{token}",
            description="committed tokens per request and verify step",
            explicit_bucket_boundaries_advisory=[float(n) for n in range(1, 18)],
        )
        self.step_duration = telemetry.latency_histogram(
            meter, "tandem.target.step.duration", "one engine step"
        )
        alloc = engine.kv.allocator
        scheduler = engine.scheduler
        telemetry.gauge(
            meter,
            "tandem.kv.pages_used",
            "{page}",
            "KV pages allocated",
            lambda: [(alloc.num_pages - alloc.num_free_pages, _SERVICE)],
        )
        telemetry.gauge(
            meter,
            "tandem.kv.pages_capacity",
            "{page}",
            "KV pages in the pool",
            lambda: [(alloc.num_pages, _SERVICE)],
        )
        telemetry.gauge(
            meter,
            "tandem.target.requests",
            "{request}",
            "requests at the target (attribute state: running or waiting)",
            lambda: [
                (len(scheduler.running), {"state": "running"}),
                (len(scheduler.waiting), {"state": "waiting"}),
            ],
        )

    def _position(self, position: int) -> dict[str, str]:
        if position < len(self._per_pos):
            return self._per_pos[position]
        return {**self._vllm, "position": str(position)}

    # -- requests ----------------------------------------------------------------------------

    def admitted(self, request_id: str, carrier: Mapping[str, str], lane: int) -> dict[str, str]:
        """Starts the request's span under the gateway's; its context, for the draft."""
        span = self._tracer.start_span(
            "tandem.target.request",
            context=telemetry.extract(carrier),
            attributes={"gen_ai.response.id": request_id, "tandem.lane": lane},
        )
        span.add_event("admitted")
        self._spans[request_id] = span
        out: dict[str, str] = {}
        telemetry.inject(out, span)
        return out

    def finished(
        self,
        request_id: str,
        reason: str,
        stats: SpecStats | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        span = self._spans.pop(request_id, None)
        self._streaming.discard(request_id)
        if span is None:
            return
        attributes: dict[str, str | int | float] = {"gen_ai.response.finish_reasons": reason}
        if stats is not None:
            attributes.update(
                {
                    "gen_ai.usage.input_tokens": prompt_tokens,
                    "gen_ai.usage.output_tokens": completion_tokens,
                    "tandem.spec.draft_tokens": stats.draft_tokens,
                    "tandem.spec.accepted_tokens": stats.accepted_tokens,
                    "tandem.spec.verify_steps": stats.verify_steps,
                    "tandem.spec.accept_length": stats.accept_length,
                }
            )
        span.set_attributes(attributes)
        span.add_event("finished", {"finish_reason": reason})
        span.end()

    def failed(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            span = self._spans.get(request_id)
            if span is not None:
                span.set_status(trace.StatusCode.ERROR, message)
            self.finished(request_id, "error")

    # -- steps -------------------------------------------------------------------------------

    def maybe_step_span(self) -> trace.Span | None:
        """A span for this step, for the sampled fraction of steps."""
        if self._step_ratio and self._random.random() < self._step_ratio:
            return self._tracer.start_span("tandem.target.step")
        return None

    def stepped(
        self,
        outputs: list[RequestOutput],
        stats: SpecStats,
        timing: StepTiming,
        lane: int,
        span: trace.Span | None,
    ) -> None:
        self.drafts.add(stats.drafts, self._vllm)
        self.draft_tokens.add(stats.draft_tokens, self._vllm)
        self.accepted_tokens.add(stats.accepted_tokens, self._vllm)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.add(count, self._position(position))
        self.verify_steps.add(stats.verify_steps)
        for cause, n in stats.without_tree.items():
            self.without_tree.add(n, {"reason": str(cause)})
        for length in stats.accept_lengths:
            self.accept_length.record(length)
        self.step_duration.record(timing.total_ns / 1e9, {"lane": lane})
        fallbacks = self._fallbacks()
        fell_back = fallbacks > self._last_fallbacks
        if fell_back:
            self.fallback_steps.add(fallbacks - self._last_fallbacks, {"lane": lane})
            self._last_fallbacks = fallbacks
        for output in outputs:
            request_span = self._spans.get(output.request_id)
            if request_span is None:
                continue
            if fell_back:
                request_span.add_event("fallback", {"tandem.lane": lane})
            if output.new_token_ids and output.request_id not in self._streaming:
                self._streaming.add(output.request_id)
                request_span.add_event("first_token")
        if span is not None:
            span.set_attributes(
                {
                    "tandem.lane": lane,
                    "tandem.batch_size": stats.verify_steps,
                    "tandem.spec.draft_tokens": stats.draft_tokens,
                    "tandem.spec.accepted_tokens": stats.accepted_tokens,
                    "tandem.step.forward_ns": timing.forward_ns,
                    "tandem.step.draft_wait_ns": timing.draft_wait_ns,
                }
            )
            span.end(end_time=time.time_ns())
