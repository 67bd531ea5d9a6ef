"""Telemetry across the three real processes serving the embedded reference model: one Generate
call makes one trace with a request span in each service (an in-test OTLP receiver collects
them), with the GenAI conventions' attributes and the served model name; each service's
/metrics page passes ``promtool check metrics`` (where installed; the same rules through the
parser always) and shows spec-decoding counters, vLLM's names among them, that add up to the
usage the gateway returned."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tandem.apps import embedded
from tandem.apps.demo import free_port
from tandem.apps.launch import Stack, build_stack
from tests.helpers import metrics
from tests.helpers.services import generate

pytestmark = pytest.mark.e2e
MODEL = "tandem-code-ref"  # the embedded model's served name by default


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps every span with its service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []

    def Export(self, request: Any, context: Any) -> Any:
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append((attrs.get("service.name", ""), span))
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, port
    server.stop(None)


@pytest.fixture
def stack(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    receiver: tuple[Receiver, int],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[Stack, dict[str, int]]]:
    """The stack; parametrized indirectly with True, the target adds vLLM's metric names."""
    target, draft, _, _ = embedded.defaults(None, None, None)  # no served name: its default
    ports = {name: free_port() for name in ("draft", "target", "gateway")}
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver[1]}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "TANDEM_STEP_TRACE_RATIO": "1",
        "TANDEM_DRAFT_METRICS_PORT": str(ports["draft"]),
        "TANDEM_TARGET_METRICS_PORT": str(ports["target"]),
        "TANDEM_GATEWAY_METRICS_PORT": str(ports["gateway"]),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("TANDEM_TARGET_SERVED_MODEL_NAME", raising=False)
    vllm_names = getattr(request, "param", False)
    monkeypatch.setenv("TANDEM_TARGET_VLLM_METRIC_NAMES", "1" if vllm_names else "0")
    stack = build_stack(
        target=target,
        draft=draft,
        draft_kind="eagle3",
        mtp_mode="chain",
        spec_args=["--spec-steps", "3"],
        page_size=16,
        device="cpu",
        dtype="float32",
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        draft_deadline_s=10.0,
    )
    stack.start(log_dir=tmp_path / "logs")
    try:
        yield stack, ports
    finally:
        stack.stop()


def test_one_generate_is_one_trace_and_clean_metrics_pages(
    stack: tuple[Stack, dict[str, int]], receiver: tuple[Receiver, int]
) -> None:
    sink = receiver[0]
    (result,) = asyncio.run(generate(stack[0].services[-1].port, [[5, 6, 7, 8, 9]]))
    usage = result["complete"].usage
    assert usage.completion_tokens == len(result["tokens"]) > 0 and usage.draft_tokens > 0
    wanted = {
        "gateway": "text_completion",
        "target_service": "tandem.target.request",
        "draft_service": "tandem.draft.request",
    }
    deadline = time.monotonic() + 30
    found: dict[str, Any] = {}
    while time.monotonic() < deadline and len(found) < 3:
        for service, span in list(sink.spans):
            if service in wanted and span.name.startswith(wanted[service]):
                found[service] = span
        time.sleep(0.2)
    assert set(found) == set(wanted), (found.keys(), {(s, sp.name) for s, sp in sink.spans})
    assert len({span.trace_id for span in found.values()}) == 1, "spans in different traces"
    # Parent chain: gateway request span <- target request span <- draft request span.
    gw, tgt, dr = found["gateway"], found["target_service"], found["draft_service"]
    assert tgt.parent_span_id == gw.span_id and dr.parent_span_id == tgt.span_id
    attrs = {a.key: a.value for a in gw.attributes}
    # The GenAI conventions: operation, provider, the model by its served name (not a path).
    assert gw.name == f"text_completion {MODEL}" and gw.kind == gw.SPAN_KIND_SERVER
    assert attrs["gen_ai.operation.name"].string_value == "text_completion"
    assert attrs["gen_ai.provider.name"].string_value == "tandem"
    assert attrs["gen_ai.request.model"].string_value == MODEL
    assert attrs["gen_ai.response.model"].string_value == MODEL
    reasons = [v.string_value for v in attrs["gen_ai.response.finish_reasons"].array_value.values]
    assert reasons == ["length"]
    assert attrs["gen_ai.usage.output_tokens"].int_value == usage.completion_tokens
    assert attrs["gen_ai.usage.input_tokens"].int_value == usage.prompt_tokens == 5
    assert attrs["tandem.spec.draft_tokens"].int_value == usage.draft_tokens
    assert attrs["tandem.spec.accept_length"].double_value == pytest.approx(usage.accept_length)
    events = [e.name for e in gw.events]
    assert events[:2] == ["queued", "admitted"] and "first_token" in events
    assert events[-1] == "finished"
    # The gRPC calls themselves are traced too (the instrumentation), health checks not.
    names = {span.name for _, span in sink.spans}
    assert "/tandem.v1.GatewayService/Generate" in names
    assert not any("Health" in name for name in names)
    assert "tandem.target.step" in names  # TANDEM_STEP_TRACE_RATIO=1: every step
    # Every service's /metrics page passes promtool (and the same rules through the parser).
    for service, port in stack[1].items():
        text = metrics.page(port)
        assert metrics.problems(text) == [], (service, text)


def scrape(port: int) -> dict[str, float]:
    return metrics.samples(metrics.page(port))


VLLM = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
)


@pytest.mark.parametrize("stack", [True], indirect=True)
def test_metrics_add_up_to_the_usage(stack: tuple[Stack, dict[str, int]]) -> None:
    services, ports = stack
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(4)]
    results = asyncio.run(generate(services.services[-1].port, prompts))
    usages = [r["complete"].usage for r in results]
    drafted = sum(u.draft_tokens for u in usages)
    accepted = sum(u.accepted_tokens for u in usages)
    assert drafted > 0
    deadline = time.monotonic() + 20
    while True:  # the draft frees its pages once the target's idle loop tells it
        target, gateway, draft = (scrape(ports[n]) for n in ("target", "gateway", "draft"))
        if draft.get("tandem_kv_pages_used{tandem_service=draft}") == 0 or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    served = f"model_name={MODEL}"
    assert target[f"tandem_spec_decode_draft_tokens_total{{{served}}}"] == drafted
    assert target[f"tandem_spec_decode_accepted_tokens_total{{{served}}}"] == accepted
    assert target["tandem_spec_decode_verify_steps_total"] == sum(u.verify_steps for u in usages)
    per_pos = sum(
        v
        for k, v in target.items()
        if k.startswith("tandem_spec_decode_accepted_tokens_per_pos_total")
    )
    assert per_pos == accepted
    assert gateway["tandem_usage_draft_tokens_total"] == drafted
    assert gateway["tandem_usage_accepted_tokens_total"] == accepted
    assert gateway["tandem_usage_completion_tokens_total"] == sum(
        u.completion_tokens for u in usages
    )
    assert gateway["tandem_requests_total{finish_reason=length}"] == len(prompts)
    # vLLM's spec-decoding counters, by their names and labels: the page's only fault, for
    # promtool, is their colon (as on vLLM's own pages).
    faults = metrics.problems(metrics.page(ports["target"]))
    colons = [f"promtool: {name} metric names should not contain ':'" for name in VLLM]
    assert sorted(faults) == (sorted(colons) if shutil.which("promtool") else []), faults
    vllm = f"engine=0,model_name={MODEL}"
    assert target[f"vllm:spec_decode_num_drafts_total{{{vllm}}}"] == sum(
        u.drafted_steps for u in usages
    )
    assert target[f"vllm:spec_decode_num_draft_tokens_total{{{vllm}}}"] == drafted
    assert target[f"vllm:spec_decode_num_accepted_tokens_total{{{vllm}}}"] == accepted
    positions = {
        int(key.rpartition("position=")[2].rstrip("}")): value
        for key, value in target.items()
        if key.startswith(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{{vllm},")
    }
    assert sorted(positions) == list(range(len(positions))) and accepted > 0
    assert sum(positions.values()) == accepted  # depth i counts the drafts accepted past i
    by_depth = [positions[i] for i in range(len(positions))]
    assert by_depth == sorted(by_depth, reverse=True)
    assert by_depth[0] <= target[f"vllm:spec_decode_num_drafts_total{{{vllm}}}"]
    # The GenAI server histograms carry the attributes the conventions require.
    genai = (
        "gen_ai_operation_name=text_completion,gen_ai_provider_name=tandem,"
        f"gen_ai_request_model={MODEL},gen_ai_response_model={MODEL}"
    )
    for histogram in ("request_duration", "time_to_first_token", "time_per_output_token"):
        assert gateway[f"gen_ai_server_{histogram}_seconds_count{{{genai}}}"] == len(prompts)
    assert target["tandem_kv_pages_capacity{tandem_service=target}"] > 0
    assert draft["tandem_kv_pages_capacity{tandem_service=draft}"] > 0
    assert draft["tandem_draft_proposed_tokens_total"] >= drafted  # trees may be cut
    assert draft["tandem_kv_pages_used{tandem_service=draft}"] == 0
    assert target["tandem_kv_pages_used{tandem_service=target}"] == 0
