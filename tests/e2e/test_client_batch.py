"""The batch client against a real stack (the embedded reference model, three processes) whose
gateway admits 2 requests and queues 1: a batch many times that limit completes, retried
refusals included, with the outputs of a one-at-a-time run; GetServerInfo reports the
speculation config and the limits the client reads."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem.apps.client import GenerateFailed, RetryPolicy, generate_remote
from tandem.apps.demo import free_port
from tandem.apps.embedded import family_dir
from tandem.apps.launch import Stack, build_stack
from tandem.v1 import common_pb2
from tests.helpers.services import server_info

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MAX_RUNNING, MAX_QUEUE = 2, 1
NEW_TOKENS = 6
PROMPTS = [f"def f{i}(x):\n    return x{'+' * (i % 3)}{i}" for i in range(24)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    family = family_dir()
    services = build_stack(
        target=family / "target",
        draft=family / "eagle3",
        draft_kind="eagle3",
        mtp_mode="chain",
        spec_args=["--spec-steps", "2"],
        page_size=16,
        device="cpu",
        dtype="float32",
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        draft_deadline_s=10.0,
        extra_target_args=["--spec-policy", "adaptive"],
        extra_gateway_args=[
            *("--max-running", str(MAX_RUNNING), "--max-queue", str(MAX_QUEUE)),
            *("--max-request-bytes", str(64 << 10)),
        ],
    )
    services.start(log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield services
    finally:
        services.stop()


def gateway(stack: Stack) -> str:
    return f"127.0.0.1:{stack.services[-1].port}"


def run(stack: Stack, prompts: list[str], **options: Any) -> list[dict[str, Any]]:
    return generate_remote(
        gateway(stack),
        prompts,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        seed=None,
        max_new_tokens=NEW_TOKENS,
        ignore_eos=True,
        **options,
    )


def test_server_info_reports_speculation_and_limits(stack: Stack) -> None:
    info = asyncio.run(server_info(stack.services[-1].port))
    spec = info.speculation
    assert spec.enabled and spec.draft_kind == common_pb2.DRAFT_KIND_EAGLE3
    assert (spec.num_steps, spec.topk, spec.num_draft_tokens) == (2, 1, 3)
    assert info.spec_policy == common_pb2.SPEC_POLICY_ADAPTIVE
    assert (info.max_running, info.max_queue) == (MAX_RUNNING, MAX_QUEUE)


def test_a_batch_many_times_the_limit_completes_as_one_at_a_time(stack: Stack) -> None:
    sequential = run(stack, PROMPTS, max_in_flight=1)
    bounds: list[int] = []
    bounded = run(stack, PROMPTS, on_start=bounds.append)  # the server's max_running
    assert bounds == [MAX_RUNNING]
    # Far past running + queued: the gateway refuses some, the client waits as asked, retries.
    refusals: list[tuple[grpc.StatusCode, float]] = []
    done: list[dict[str, Any]] = []
    flooded = run(
        stack,
        PROMPTS,
        max_in_flight=len(PROMPTS),
        retry=RetryPolicy(attempts=50, max_backoff_s=2.0),
        on_done=lambda _, record: done.append(record),
        on_retry=lambda code, delay: refusals.append((code, delay)),
    )
    assert refusals and {code for code, _ in refusals} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert min(delay for _, delay in refusals) >= 1.0  # the gateway's RetryInfo delay
    assert len(done) == len(PROMPTS)
    for records in (bounded, flooded):
        assert [r["prompt"] for r in records] == PROMPTS
        assert [r["token_ids"] for r in records] == [r["token_ids"] for r in sequential]
        assert [r["text"] for r in records] == [r["text"] for r in sequential]
    assert all(len(r["token_ids"]) == NEW_TOKENS for r in sequential)
    assert all(r["finish_reason"] == "length" for r in flooded)


def test_the_cli_prints_every_prompt_once_in_order(stack: Stack, tmp_path: Path) -> None:
    sequential = run(stack, PROMPTS[:8], max_in_flight=1)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:8]))
    argv = [sys.executable, "-m", "tandem", "generate", f"@{prompts}", "--json"]
    argv += ["--server", gateway(stack), "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos"]
    argv += ["--max-in-flight", "8", "--progress"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["token_ids"] for line in lines] == [r["token_ids"] for r in sequential]
    assert "generating" in out.stderr  # the bar, asked for without a terminal


def test_a_request_too_large_is_not_retried(stack: Stack) -> None:
    retried: list[grpc.StatusCode] = []
    with pytest.raises(GenerateFailed) as failed:
        run(
            stack,
            ["x" * (80 << 10)],
            max_in_flight=1,
            on_retry=lambda code, _: retried.append(code),
        )
    assert failed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and failed.value.index == 0
    assert not retried
