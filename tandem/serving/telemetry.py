"""OpenTelemetry for the three services (docs/design.md section 9): traces and metrics.

``setup(service)`` runs once per process, first thing in ``main`` (before any server or channel
exists: the gRPC instrumentation patches their creation). It reads the standard variables:

- ``OTEL_SERVICE_NAME`` (default: the service's name), ``OTEL_RESOURCE_ATTRIBUTES``;
- ``OTEL_TRACES_EXPORTER`` = ``otlp`` (default) | ``console`` | ``none``; OTLP goes over gRPC
  to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``; default localhost:4317);
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default parentbased_always_on);
- ``OTEL_METRICS_EXPORTER`` = ``otlp`` | ``console`` | ``none``; the default is ``otlp`` when
  an OTLP endpoint is set and ``none`` otherwise (``/metrics`` is the local way to read them);
- ``TANDEM_STEP_TRACE_RATIO``: the fraction of target steps that get their own span (default
  0: per-step spans cost Python time on every step).

and ``metrics_port`` (each service's ``--metrics-port``) serves Prometheus text on
``http://HOST:PORT/metrics``, HOST being the service's ``--host``: metrics are exactly as
reachable as the service's port (loopback for target and draft by default, and for all three
under ``tandem serve``). Every metric has a description (its Prometheus HELP) and a name
``promtool check metrics`` accepts; the target's spec-decoding counters can also carry vLLM's
names (``views``).

Traces: the gRPC calls get server/client spans (opentelemetry-instrumentation-grpc, health
checks excluded). On top, each request has one span per service, all in one trace: the
gateway's ``text_completion {model}`` span (GenAI semantic-convention attributes, events
queued/admitted/first_token/finished) is the parent of the target's ``tandem.target.request``
(events admitted/fallback/finished, the request's token usage and accept length), whose
context travels in ``AdmitCommand.trace_context`` and on to the draft's
``tandem.draft.request`` in ``DraftAdmit.trace_context``: the internal streams are long-lived
and multiplexed, so the per-request fields carry the causality the stream spans cannot.

Without ``setup`` (tests, library use) every tracer and meter here is a no-op.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)

from tandem.settings import Setting

logger = logging.getLogger(__name__)

_EXPORTERS = ("otlp", "console", "none")
STEP_TRACE_RATIO_ENV = "TANDEM_STEP_TRACE_RATIO"
# Every service's metrics_port (checked by check_metrics_port).
METRICS_PORT = Setting(
    help="serve Prometheus metrics on http://HOST:PORT/metrics",
    env="METRICS_PORT",
    shown_default="no endpoint",
)


# gen_ai.provider.name on the GenAI spans and metrics: no well-known value applies (the server
# runs the model itself), so the conventions' custom value.
PROVIDER = "tandem"

# The target's spec-decoding counters under vLLM's names, labels (model_name, engine; position)
# and help, for the dashboards and queries built for vLLM, where the target's
# --vllm-metric-names asks for them (views): Prometheus's exporter guidelines reserve the colon
# for recording rules and ``promtool check metrics`` flags it (it flags vLLM's own pages so), so
# by default a page carries Tandem's names alone and passes promtool. OTel instrument names
# cannot hold the colon; a view's name can, and the Prometheus exporter keeps it (adding
# _total, as prometheus_client does for vLLM).
VLLM_SPEC_COUNTERS = {
    "tandem.spec_decode.drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "tandem.spec_decode.draft_tokens": (
        "vllm:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
    ),
    "tandem.spec_decode.accepted_tokens": (
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
    ),
    "tandem.spec_decode.accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
    ),
}


def views(vllm_names: bool = False) -> list[View]:
    """The meter provider's views: the spec-decoding counters under Tandem's names (labels
    model_name and position) and, with ``vllm_names``, under vLLM's too."""
    out = []
    for instrument, (name, description) in VLLM_SPEC_COUNTERS.items():
        out.append(View(instrument_name=instrument, attribute_keys={"model_name", "position"}))
        if vllm_names:
            out.append(View(instrument_name=instrument, name=name, description=description))
    return out


@dataclass
class Telemetry:
    """What ``setup`` installed; ``shutdown()`` flushes pending spans and metrics."""

    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    metrics_port: int | None

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def setup(
    service: str,
    *,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    vllm_names: bool = False,
) -> Telemetry:
    """Installs the tracer and meter providers and the gRPC instrumentation for this process;
    ``vllm_names``: the spec-decoding counters under vLLM's names too (``views``)."""
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    resource = Resource.create(attributes)
    tracer_provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER
    processor = _span_processor(_exporter_name("OTEL_TRACES_EXPORTER", "otlp"))
    if processor is not None:
        tracer_provider.add_span_processor(processor)
    trace.set_tracer_provider(tracer_provider)

    readers: list[MetricReader] = []
    if metrics_port is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=metrics_host)
        readers.append(PrometheusMetricReader())
        logger.info("metrics on http://%s:%d/metrics", metrics_host, metrics_port)
    otlp_set = any(
        os.environ.get(name)
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    )
    metrics_exporter = _exporter_name("OTEL_METRICS_EXPORTER", "otlp" if otlp_set else "none")
    if metrics_exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    elif metrics_exporter == "console":
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
    meter_provider = MeterProvider(
        resource=resource, metric_readers=readers, views=views(vllm_names)
    )
    metrics.set_meter_provider(meter_provider)

    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
        filters,
    )

    no_health = filters.negate(filters.health_check())
    GrpcAioInstrumentorServer(filter_=no_health).instrument(tracer_provider=tracer_provider)
    GrpcAioInstrumentorClient(filter_=no_health).instrument(tracer_provider=tracer_provider)
    return Telemetry(tracer_provider, meter_provider, metrics_port)


def check_metrics_port(port: int | None) -> None:
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"metrics_port: {port} is not a port number")


def _exporter_name(variable: str, default: str) -> str:
    name = (os.environ.get(variable) or default).strip().lower()
    if name not in _EXPORTERS:
        raise ValueError(f"{variable}: {name!r} is not one of {', '.join(_EXPORTERS)}")
    return name


def _span_processor(name: str) -> SpanProcessor | None:
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return BatchSpanProcessor(OTLPSpanExporter())
    if name == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    return None


def step_trace_ratio() -> float:
    """``TANDEM_STEP_TRACE_RATIO`` in [0, 1]."""
    raw = os.environ.get(STEP_TRACE_RATIO_ENV, "0")
    try:
        ratio = float(raw)
    except ValueError:
        raise ValueError(f"{STEP_TRACE_RATIO_ENV}: {raw!r} is not a number") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{STEP_TRACE_RATIO_ENV}: {ratio} is not in [0, 1]")
    return ratio


# -- trace context in the internal streams' per-request fields ------------------------------


def inject(carrier: dict[str, str], span: trace.Span | None = None) -> None:
    """Writes the span's (or the current) context into a TraceContext.carrier map."""
    context = None if span is None else trace.set_span_in_context(span)
    propagate.inject(carrier, context=context)


def extract(carrier: Mapping[str, str]) -> Context:
    """The context a TraceContext.carrier map holds (empty when it holds none)."""
    return propagate.extract(dict(carrier))


# Seconds, for latency histograms (the SDK's default boundaries suit milliseconds).
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0
)  # fmt: skip


def latency_histogram(meter: metrics.Meter, name: str, description: str) -> metrics.Histogram:
    return meter.create_histogram(
        name,
        unit="s",
        description=description,
        explicit_bucket_boundaries_advisory=list(LATENCY_BUCKETS_S),
    )


def gauge(
    meter: metrics.Meter, name: str, unit: str, description: str, read: Callable[[], Iterable]
) -> None:
    """An observable gauge whose callback yields ``(value, attributes)`` pairs. A 0/1 state
    has unit ``""``, not ``"1"``: the collector's Prometheus exporter appends ``_ratio`` to a
    gauge of unit 1 and the SDK's does not, so the two would name it differently."""

    def callback(options: CallbackOptions) -> Iterable[Observation]:
        try:
            return [Observation(value, attrs) for value, attrs in read()]
        except Exception:  # a gauge must never break the exporter
            logger.exception("gauge %s failed", name)
            return []

    meter.create_observable_gauge(name, [callback], unit=unit, description=description)
