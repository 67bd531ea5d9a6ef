"""Device-chain runs through the three services on one GPU (the target's ``--device-chain``,
the draft's local socket, CUDA IPC buffers and events): greedy output through the gateway
equals the same target's output without speculation; a draft killed mid-run costs nothing but
speed, and once restarted it runs chains again."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from tandem.apps.demo import free_port
from tandem.apps.launch import Stack, build_stack
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.services import restart_draft

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device"),
]

STREAMS = 6
LENGTHS = [24 + 16 * i for i in range(STREAMS)]
LONG = [400] * STREAMS  # long enough to kill the draft while a run is under way
RUN = re.compile(r"device chain: run (\d+) of \d+ requests starts")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chain-e2e")
    target = make_checkpoint(root / "target", "llama", seed=12, num_hidden_layers=4)
    eagle3 = make_eagle3_checkpoint(root / "eagle3", target, draft_vocab_size=1024, seed=2)
    return {"target": target, "eagle3": eagle3, "model": target}


def prompts() -> list[list[int]]:
    return [[(37 * i + 11 * j) % 5000 + 4 for j in range(1 + 3 * i)] for i in range(STREAMS)]


async def generate(
    port: int, lengths: list[int], *, speculate: bool = True
) -> list[tuple[list[int], int]]:
    """Each prompt's greedy tokens (``lengths[i]`` of them, so requests finish at different
    steps and runs start again) and draft tokens."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def one(ids: list[int], new_tokens: int) -> tuple[list[int], int]:
            request = gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=ids),
                sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True
                ),
            )
            request.speculation.enabled = speculate
            tokens: list[int] = []
            drafted = 0
            async for response in stub.Generate(request):
                if response.WhichOneof("payload") == "chunk":
                    tokens += response.chunk.token_ids
                elif response.WhichOneof("payload") == "complete":
                    drafted = response.complete.usage.draft_tokens
            assert len(tokens) == new_tokens
            return tokens, drafted

        pairs = zip(prompts(), lengths, strict=True)
        return list(await asyncio.gather(*(one(p, n) for p, n in pairs)))


def start(ckpts: dict[str, Path], tmp: Path, draft: str) -> Stack:
    stack = build_stack(
        target=ckpts["target"],
        draft=ckpts[draft],
        draft_kind=draft,
        mtp_mode="chain",
        spec_args=["--spec-steps", "3", "--spec-topk", "1"],
        page_size=16,
        device="cuda",
        dtype="float32",
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        draft_deadline_s=5.0,
        two_lane_batch=0,  # one lane (a run takes every lane; two are tests/spec's)
        local_stream=True,
        extra_target_args=["--device-chain", "--log-level", "DEBUG"],
    )
    stack.start(log_dir=tmp / "logs")
    return stack


def runs(stack: Stack) -> int:
    """Device-chain runs the target has started (its log)."""
    log = next(s.log for s in stack.services if s.name == "target")
    assert log is not None
    return len(RUN.findall(log.read_text(errors="replace")))


@pytest.mark.parametrize("draft", ["eagle3", "model"])
def test_greedy_through_the_services_equals_target_only(
    ckpts: dict[str, Path], tmp_path: Path, draft: str
) -> None:
    stack = start(ckpts, tmp_path, draft)
    try:
        gateway = stack.services[-1].port
        plain = asyncio.run(generate(gateway, LENGTHS, speculate=False))
        assert runs(stack) == 0
        chained = asyncio.run(generate(gateway, LENGTHS))
        assert [t for t, _ in chained] == [t for t, _ in plain]
        assert runs(stack) >= 3
        assert all(drafted > 0 for _, drafted in chained)
        assert not stack.dead()
    finally:
        stack.stop()


def test_a_draft_killed_mid_run_loses_nothing_and_comes_back(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    stack = start(ckpts, tmp_path, "model")  # the target as its own draft: long runs
    draft, gateway = stack.services[0], stack.services[-1].port
    try:
        reference = [t for t, _ in asyncio.run(generate(gateway, LONG, speculate=False))]

        async def scenario() -> list[list[int]]:
            run = asyncio.create_task(generate(gateway, LONG))
            deadline = time.monotonic() + 60
            while runs(stack) == 0:  # a run is under way: now the draft dies
                assert time.monotonic() < deadline, "no device-chain run started"
                await asyncio.sleep(0.01)
            assert draft.proc is not None
            draft.proc.send_signal(signal.SIGKILL)
            return [t for t, _ in await run]

        assert asyncio.run(scenario()) == reference
        assert not [s.name for s in stack.dead() if s.name != "draft"]
        before = runs(stack)
        restart_draft(draft, gateway)
        again = asyncio.run(generate(gateway, LONG))
        assert [t for t, _ in again] == reference
        assert runs(stack) > before
    finally:
        stack.stop()
