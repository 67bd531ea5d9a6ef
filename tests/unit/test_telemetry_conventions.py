"""The services' observers with the OTel SDK's in-memory exporters and a Prometheus page of
their own: the gateway's span and ``gen_ai.server.*`` histograms carry the GenAI conventions'
required attributes and the served model name; the target's spec-decoding counters come out
under Tandem's names and, asked for, vLLM's (names, labels, HELP); the pages pass the
``promtool check metrics`` rules (promtool itself where installed)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest

from draft_service.observe import DraftMetrics
from gateway.observe import GatewayObserver
from tandem.clock import StepTiming
from tandem.config import EngineConfig
from tandem.serving import telemetry
from tandem.spec.types import NoTree, SpecStats
from tandem.target.engine import Engine
from tandem.testing.random_model import make_checkpoint
from tandem.v1 import common_pb2, target_pb2
from target_service.observe import TargetObserver
from tests.helpers import metrics

MODEL = "code-7b"
REQUIRED = {"gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model"}


class Providers:
    def __init__(self, vllm_names: bool) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer = TracerProvider()
        self.tracer.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.registry = CollectorRegistry()
        prometheus = PrometheusMetricReader(registry=self.registry)
        self.meter = MeterProvider(
            metric_readers=[self.reader, prometheus], views=telemetry.views(vllm_names)
        )

    def page(self) -> str:
        return generate_latest(self.registry).decode()

    def points(self, name: str) -> list[dict]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            dict(point.attributes or {})
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


@pytest.fixture
def providers(request: pytest.FixtureRequest) -> Iterator[Providers]:
    made = Providers(getattr(request, "param", False))
    yield made
    made.meter.shutdown()
    made.tracer.shutdown()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = make_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=3, tokenizer=False)
    return Engine(EngineConfig(model=Path(path), num_pages=64))


def test_the_gateway_follows_the_genai_conventions(providers: Providers) -> None:
    observer = GatewayObserver(
        model=lambda: MODEL,
        queue=lambda: (1, 0),
        tracer_provider=providers.tracer,
        meter_provider=providers.meter,
    )
    admit = target_pb2.AdmitCommand(
        prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_new_tokens=4)
    )
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=4, draft_tokens=6)
    ok = observer.start("ok", admit)
    observer.finish(
        ok, common_pb2.FINISH_REASON_LENGTH, usage, received_ns=0, first_chunk_ns=10**7,
        now_ns=4 * 10**7,
    )  # fmt: skip
    failed = observer.start("failed", admit)
    observer.finish(
        failed, common_pb2.FINISH_REASON_ERROR, usage, received_ns=0, first_chunk_ns=10**7,
        now_ns=2 * 10**7, error="UNAVAILABLE target lost",
    )  # fmt: skip
    finished = providers.spans.get_finished_spans()
    spans = {str((span.attributes or {})["gen_ai.response.id"]): span for span in finished}
    for span in spans.values():
        assert span.name == f"text_completion {MODEL}"
        attributes = dict(span.attributes or {})
        assert set(attributes) >= REQUIRED and attributes["gen_ai.provider.name"] == "tandem"
        assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == MODEL
    assert "error.type" not in (spans["ok"].attributes or {})
    assert (spans["failed"].attributes or {})["error.type"] == "error"
    durations = providers.points("gen_ai.server.request.duration")
    assert len(durations) == 2 and all(set(p) >= REQUIRED for p in durations)
    assert sorted(p.get("error.type", "") for p in durations) == ["", "error"]
    for name in ("gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token"):
        (point,) = providers.points(name)  # successful responses only
        assert set(point) >= REQUIRED and point["gen_ai.request.model"] == MODEL
    assert metrics.problems(providers.page()) == []


def stepped(observer: TargetObserver) -> None:
    stats = SpecStats()
    stats.record(num_draft_nodes=4, num_accepted=2)
    stats.record(num_draft_nodes=4, num_accepted=1)
    stats.record(num_draft_nodes=0, num_accepted=0, missed=NoTree.LATE)
    observer.stepped([], stats, StepTiming(total_ns=10**6), lane=0, span=None)


def test_the_target_counters_by_tandem_names_pass_promtool(
    providers: Providers, engine: Engine
) -> None:
    stepped(TargetObserver(engine, lambda: 0, MODEL, meter_provider=providers.meter))
    DraftMetrics(lambda: (1, 8), meter_provider=providers.meter).stepped([], 0.01, lane=0)
    page = providers.page()
    samples = metrics.samples(page)
    assert samples[f"tandem_spec_decode_drafts_total{{model_name={MODEL}}}"] == 2
    assert samples[f"tandem_spec_decode_draft_tokens_total{{model_name={MODEL}}}"] == 8
    assert samples[f"tandem_spec_decode_accepted_tokens_total{{model_name={MODEL}}}"] == 3
    per_pos = "tandem_spec_decode_accepted_tokens_per_pos_total"
    assert samples[f"{per_pos}{{model_name={MODEL},position=0}}"] == 2
    assert samples[f"{per_pos}{{model_name={MODEL},position=1}}"] == 1
    assert samples["tandem_kv_pages_capacity{tandem_service=draft}"] == 8
    assert not any(name.startswith("vllm:") for name in samples)
    assert metrics.problems(page) == []


@pytest.mark.parametrize("providers", [True], indirect=True)
def test_the_target_counters_by_vllm_names(providers: Providers, engine: Engine) -> None:
    stepped(TargetObserver(engine, lambda: 0, MODEL, meter_provider=providers.meter))
    page = providers.page()
    samples = metrics.samples(page)
    labels = f"engine=0,model_name={MODEL}"
    assert samples[f"vllm:spec_decode_num_drafts_total{{{labels}}}"] == 2
    assert samples[f"vllm:spec_decode_num_draft_tokens_total{{{labels}}}"] == 8
    assert samples[f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}}"] == 3
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert samples[f"{per_pos}{{{labels},position=0}}"] == 2
    assert samples[f"{per_pos}{{{labels},position=1}}"] == 1
    assert samples[f"tandem_spec_decode_drafts_total{{model_name={MODEL}}}"] == 2  # kept
    helps = {
        "vllm:spec_decode_num_drafts_total": "Number of spec decoding drafts.",
        "vllm:spec_decode_num_draft_tokens_total": "Number of draft tokens.",
        "vllm:spec_decode_num_accepted_tokens_total": "Number of accepted tokens.",
        per_pos: "Accepted tokens per draft position.",
    }
    for name, text in helps.items():
        assert f"# HELP {name} {text}\n# TYPE {name} counter\n" in page
    # The OTLP names are vLLM's too (the collector's Prometheus exporter adds the _total).
    assert providers.points("vllm:spec_decode_num_drafts") == [{"model_name": MODEL, "engine": "0"}]
    # promtool's one objection is the colon, as on vLLM's own pages.
    colon = [f"promtool: {name} metric names should not contain ':'" for name in helps]
    assert sorted(metrics.problems(page)) == (sorted(colon) if shutil.which("promtool") else [])


def test_the_page_rules_find_what_promtool_found() -> None:
    # What promtool found on the pages before (exit 3), promtool or not.
    bad = "# HELP x_pages_total KV pages\n# TYPE x_pages_total gauge\nx_pages_total 1\n"
    bad += "# TYPE y_total counter\ny_total 2\n"
    found = metrics.problems(bad)
    assert [p for p in found if not p.startswith("promtool")] == [
        "x_pages_total: a gauge named like a counter or histogram",
        "y_total: no HELP",
    ]
    assert len(found) == (4 if shutil.which("promtool") else 2), found
