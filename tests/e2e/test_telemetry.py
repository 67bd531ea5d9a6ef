"""Telemetry across the three real processes: one Generate call makes one trace with a request
span in each service (an in-test OTLP receiver collects them), and each service's /metrics
endpoint shows spec-decoding counters that add up to the usage the gateway returned."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tandem.apps.demo import free_port
from tandem.apps.launch import Stack, build_stack
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint
from tests.helpers.services import generate

pytestmark = pytest.mark.e2e


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
    tmp_path: Path, receiver: tuple[Receiver, int], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Stack, dict[str, int]]]:
    target = make_checkpoint(tmp_path / "target", "llama", seed=12, num_hidden_layers=2)
    draft = make_eagle3_checkpoint(tmp_path / "eagle3", target, draft_vocab_size=512, seed=2)
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


def test_one_generate_is_one_trace_across_three_processes(
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
    assert attrs["gen_ai.operation.name"].string_value == "text_completion"
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


def scrape(port: int) -> dict[str, float]:
    """Every sample of a /metrics page, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        text = page.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if not k.startswith("otel_scope")
            )
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


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
    assert target["tandem_spec_decode_draft_tokens_total"] == drafted
    assert target["tandem_spec_decode_accepted_tokens_total"] == accepted
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
    assert gateway["gen_ai_server_time_to_first_token_seconds_count"] == len(prompts)
    assert draft["tandem_draft_proposed_tokens_total"] >= drafted  # trees may be cut
    assert draft["tandem_kv_pages_used{tandem_service=draft}"] == 0
    assert target["tandem_kv_pages_used{tandem_service=target}"] == 0
