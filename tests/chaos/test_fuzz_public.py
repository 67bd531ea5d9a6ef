"""Hypothesis-generated public requests against the three services in process (real gRPC
servers on loopback, tiny random models: tests/helpers/inproc_stack.py): every field of
GenerateRequest, AbortRequest, GetServerInfoRequest and GetModelInfoRequest with its extremes,
broken one field at a time, or as raw bytes (tests/helpers/fuzz_public.py), sent concurrently
in batches with Aborts naming the batch's requests. Valid requests are served (a well-formed
stream ending in one complete message; greedy output equal to the target's own greedy output
for the reference prompts), invalid ones refused with INVALID_ARGUMENT and a BadRequest naming
the broken field, never UNKNOWN or INTERNAL; afterwards the stack still serves, and neither KV
pool holds a page."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.target.engine import Engine
from tandem.v1 import common_pb2, gateway_pb2
from tests.helpers.fuzz_public import (
    ANY,
    FIELDS,
    REFERENCE_PROMPTS,
    REFERENCE_TOKENS,
    UNDECODABLE,
    VALID,
    Case,
    cases,
)
from tests.helpers.inproc_stack import MAX_MODEL_LEN, VOCAB, InProcessStack, make_checkpoints

pytestmark = pytest.mark.slow

BATCH = 20  # requests sent together
EXAMPLES = 105  # batches: at least 2,000 requests
MIN_REQUESTS = 2000
EOS = 2
SERVICE = "/tandem.v1.GatewayService/"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessStack]:
    running = InProcessStack(make_checkpoints(tmp_path_factory.mktemp("fuzz-public")))
    yield running
    running.close()


@pytest.fixture(scope="module")
def reference(stack: InProcessStack) -> dict[tuple[int, ...], list[int]]:
    """The target's own greedy continuation of each reference prompt (no draft)."""
    engine = Engine(EngineConfig(model=stack.config.engine.model, num_pages=64))
    params = SamplingParams(max_new_tokens=REFERENCE_TOKENS, ignore_eos=True)
    results = engine.generate([list(p) for p in REFERENCE_PROMPTS], params)
    return {tuple(p): r.token_ids for p, r in zip(REFERENCE_PROMPTS, results, strict=True)}


def _bad_request(exc: grpc.RpcError) -> str:
    """The field a refusal's BadRequest names ('' when it has none)."""
    for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                bad = error_details_pb2.BadRequest()
                if detail.Unpack(bad) and bad.field_violations:
                    return str(bad.field_violations[0].field)
    return ""


def _call(channel: grpc.Channel, case: Case, request_id: str) -> tuple[str, Any]:
    """(code name, responses or the refused field) of one case."""
    request: Any = case.request
    if case.raw is not None:
        payload, serialize = case.raw, None
    else:
        if case.method == "Generate" and case.named:
            request = gateway_pb2.GenerateRequest()
            request.CopyFrom(case.request)
            request.request_id = request_id
        payload, serialize = request, type(request).SerializeToString if request else None
        if request is None:
            payload = b""
    kind = channel.unary_stream if case.method == "Generate" else channel.unary_unary
    responses = {
        "Generate": gateway_pb2.GenerateResponse,
        "Abort": gateway_pb2.AbortResponse,
        "GetServerInfo": gateway_pb2.GetServerInfoResponse,
        "GetModelInfo": gateway_pb2.GetModelInfoResponse,
    }
    call = kind(
        f"{SERVICE}{case.method}",
        request_serializer=serialize,
        response_deserializer=responses[case.method].FromString,
    )
    try:
        if case.method == "Generate":
            return "OK", list(call(payload, timeout=60))
        return "OK", call(payload, timeout=30)
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        return code.name, _bad_request(exc) if code == grpc.StatusCode.INVALID_ARGUMENT else ""


def _check_stream(
    case: Case,
    responses: list[gateway_pb2.GenerateResponse],
    aborted: bool,
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    """A served Generate: chunks, then one complete message, all consistent with the request."""
    assert responses, "an empty stream"
    *chunks, last = responses
    assert all(r.HasField("chunk") for r in chunks), responses
    assert last.HasField("complete"), last
    assert len({r.request_id for r in responses}) == 1 and last.request_id
    tokens = [t for r in chunks for t in r.chunk.token_ids]
    assert all(t < VOCAB for t in tokens)
    complete = last.complete
    assert complete.usage.completion_tokens == len(tokens)
    reason = complete.finish_reason
    assert reason in (
        common_pb2.FINISH_REASON_STOP,
        common_pb2.FINISH_REASON_LENGTH,
        common_pb2.FINISH_REASON_ABORT,
    )
    assert reason != common_pb2.FINISH_REASON_ABORT or aborted, "aborted by nobody"
    request = case.request
    if case.raw is not None:  # parsed here as the gateway parsed it
        request = gateway_pb2.GenerateRequest.FromString(case.raw)
    assert isinstance(request, gateway_pb2.GenerateRequest)
    s = request.sampling
    for r in chunks:
        assert len(r.chunk.logprobs) == (len(r.chunk.token_ids) if s.logprobs else 0)
        assert all(not math.isnan(x) and x <= 1e-4 for x in r.chunk.logprobs)
    if request.WhichOneof("prompt") == "token_ids":
        assert complete.usage.prompt_tokens == len(request.token_ids.ids)
    room = MAX_MODEL_LEN - complete.usage.prompt_tokens
    budget = min(s.max_new_tokens, room) if s.HasField("max_new_tokens") else room
    assert len(tokens) <= budget
    if reason == common_pb2.FINISH_REASON_LENGTH:
        assert len(tokens) == budget
    if reason == common_pb2.FINISH_REASON_STOP and not s.stop_strings:
        assert tokens[-1] in s.stop_token_ids or (tokens[-1] == EOS and not s.ignore_eos)
    greedy = s.HasField("temperature") and s.temperature == 0.0
    plain = not s.HasField("repetition_penalty") or s.repetition_penalty == 1.0
    key = tuple(request.token_ids.ids)
    if greedy and plain and not s.stop_strings and key in reference:
        expected: list[int] = []
        for token in reference[key][:budget]:
            expected.append(token)
            if token in s.stop_token_ids or (token == EOS and not s.ignore_eos):
                break
        if reason == common_pb2.FINISH_REASON_ABORT:
            assert tokens == expected[: len(tokens)]
        else:
            assert tokens == expected, (case, tokens, expected)


def run_batch(
    channel: grpc.Channel,
    batch: list[Case],
    reference: dict[tuple[int, ...], list[int]],
    counts: Counter[str],
    pool: ThreadPoolExecutor,
) -> None:
    n = counts["batches"]
    counts["batches"] += 1
    names = [f"g{n}:{i}" for i in range(len(batch))]
    named = {i for i, c in enumerate(batch) if c.method == "Generate" and c.named and not c.raw}
    aborts: list[Case] = []
    for case in batch:
        if case.method == "Abort" and case.raw is None and case.request is not None:
            targets = [names[i % len(batch)] for i in case.aborts if i % len(batch) in named]
            request = gateway_pb2.AbortRequest(request_ids=[*case.request.request_ids, *targets])
            case = Case("Abort", request)
        aborts.append(case)
    results = list(pool.map(lambda c: _call(channel, c[0], c[1]), zip(aborts, names, strict=True)))
    aborted = {
        name
        for case, (code, answer) in zip(aborts, results, strict=True)
        if case.method == "Abort" and code == "OK" and case.raw is None
        for name in answer.aborted_request_ids
    }
    for i, (case, (code, answer)) in enumerate(zip(aborts, results, strict=True)):
        counts["requests"] += 1
        counts[f"{case.method} {code}"] += 1
        assert code not in ("UNKNOWN", "INTERNAL"), (case, code, answer)
        if case.expect == VALID:
            assert code == "OK", (case, code, answer)
        elif case.expect == ANY:
            assert code == "OK" or (code == "INVALID_ARGUMENT" and answer in FIELDS), (case, answer)
        else:
            assert code == "INVALID_ARGUMENT", (case, code, answer)
            assert answer == case.expect, (case, answer)
        if code != "OK":
            continue
        if case.method == "Generate":
            _check_stream(case, answer, names[i] in aborted, reference)
        elif case.method == "Abort" and case.raw is None:
            assert isinstance(case.request, gateway_pb2.AbortRequest)
            assert set(answer.aborted_request_ids) <= set(case.request.request_ids)
            assert all(name.startswith("g") for name in answer.aborted_request_ids)


def test_generated_public_requests(
    stack: InProcessStack, reference: dict[tuple[int, ...], list[int]]
) -> None:
    counts: Counter[str] = Counter()
    pool = ThreadPoolExecutor(BATCH)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # bounded: no shrinking of 20-request batches
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(cases(VOCAB, MAX_MODEL_LEN), min_size=BATCH, max_size=BATCH))
    def batches(batch: list[Case]) -> None:
        run_batch(stack.channel("gateway"), batch, reference, counts, pool)

    try:
        batches()
    finally:
        pool.shutdown()
        print(dict(sorted(counts.items())))
    assert counts["requests"] >= MIN_REQUESTS, counts
    for method in ("Generate OK", "Generate INVALID_ARGUMENT", "Abort OK", "GetServerInfo OK"):
        assert counts[method] >= 50, (method, counts)
    # The stack still serves, correctly, and nothing is left behind in either pool.
    prompt = REFERENCE_PROMPTS[0]
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt))
    request.sampling.temperature, request.sampling.ignore_eos = 0.0, True
    request.sampling.max_new_tokens = REFERENCE_TOKENS
    tokens = [t for r in stack.gateway.Generate(request, timeout=60) for t in r.chunk.token_ids]
    assert tokens == reference[tuple(prompt)]
    assert stack.wait_idle() == dict.fromkeys(stack.idle(), 0)
    assert UNDECODABLE in FIELDS
