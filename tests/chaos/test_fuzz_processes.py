"""A smaller sample of the public fuzz (test_fuzz_public.py) against the three services as
production starts them (real processes, telemetry set up as ``python -m <service>`` sets it
up: its interceptors see every call): the same verdicts, no UNKNOWN or INTERNAL, and
afterwards both KV pools are empty and the stack still serves."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tandem.apps.launch import Stack
from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.target.engine import Engine
from tandem.v1 import gateway_pb2, gateway_pb2_grpc
from tests.chaos import test_fuzz_public as public
from tests.helpers.fuzz_public import REFERENCE_PROMPTS, REFERENCE_TOKENS, Case, cases
from tests.helpers.inproc_stack import MAX_MODEL_LEN, VOCAB, make_checkpoints
from tests.helpers.stacks import cpu_stack

pytestmark = pytest.mark.e2e

EXAMPLES = 15  # batches of public.BATCH: 300 requests


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[grpc.Channel, dict]]:
    root = tmp_path_factory.mktemp("fuzz-processes")
    ckpts = make_checkpoints(root)
    engine = Engine(EngineConfig(model=ckpts.target, num_pages=64))
    params = SamplingParams(max_new_tokens=REFERENCE_TOKENS, ignore_eos=True)
    results = engine.generate([list(p) for p in REFERENCE_PROMPTS], params)
    reference = {tuple(p): r.token_ids for p, r in zip(REFERENCE_PROMPTS, results, strict=True)}
    running: Stack = cpu_stack(
        ckpts.target,
        ckpts.draft,
    )
    running.start(log_dir=root / "logs")
    port = next(svc.port for svc in running.services if svc.name == "gateway")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, reference
    finally:
        channel.close()
        running.stop()


def test_generated_public_requests_against_the_processes(
    gateway: tuple[grpc.Channel, dict[tuple[int, ...], list[int]]],
) -> None:
    channel, reference = gateway
    counts: Counter[str] = Counter()
    pool = ThreadPoolExecutor(public.BATCH)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(cases(VOCAB, MAX_MODEL_LEN), min_size=public.BATCH, max_size=public.BATCH))
    def batches(batch: list[Case]) -> None:
        public.run_batch(channel, batch, reference, counts, pool)

    try:
        batches()
    finally:
        pool.shutdown()
        print(dict(sorted(counts.items())))
    assert counts["requests"] >= EXAMPLES * public.BATCH
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    deadline = time.monotonic() + 30
    while True:
        info = stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=10)
        left = (info.target_kv_usage.pages_used, info.draft_kv_usage.pages_used, info.num_running)
        if left == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == (0, 0, 0)
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=REFERENCE_PROMPTS[0]))
    request.sampling.temperature, request.sampling.ignore_eos = 0.0, True
    request.sampling.max_new_tokens = REFERENCE_TOKENS
    tokens = [t for r in stub.Generate(request, timeout=60) for t in r.chunk.token_ids]
    assert tokens == reference[tuple(REFERENCE_PROMPTS[0])]
