"""The three services as real processes on loopback: greedy parity through the gateway with
concurrent streams, and a draft killed mid-run costing nothing but speed."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.apps.demo import free_port
from tandem.apps.launch import Service, Stack, build_stack
from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.target.engine import Engine
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint
from tandem.v1 import common_pb2
from tests.helpers.services import NEW_TOKENS, generate, restart_draft, server_info

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STREAMS = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e")
    target = make_checkpoint(root / "target", "llama", seed=12, num_hidden_layers=4)
    eagle3 = make_eagle3_checkpoint(root / "eagle3", target, draft_vocab_size=1024, seed=2)
    return {"target": target, "eagle3": eagle3}


def prompts() -> list[list[int]]:
    return [[(37 * i + 11 * j) % 5000 + 4 for j in range(1 + 3 * i)] for i in range(STREAMS)]


@pytest.fixture(scope="module")
def reference(ckpts: dict[str, Path]) -> list[list[int]]:
    """Target-only greedy output, which must also be transformers' generate."""
    from tests.checkpoints import hf_greedy

    engine = Engine(EngineConfig(model=ckpts["target"]))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [r.token_ids for r in engine.generate(prompts(), params)]
    assert hf_greedy(ckpts["target"], prompts(), NEW_TOKENS) == ours
    return ours


def start(
    ckpts: dict[str, Path], tmp: Path, draft: str, *spec: str, two_lane_batch: int = 16
) -> Stack:
    path = ckpts["target"] if draft == "model" else ckpts[draft]
    stack = build_stack(
        target=ckpts["target"],
        draft=path,
        draft_kind=draft,
        mtp_mode="chain",
        spec_args=list(spec),
        page_size=16,
        device="cpu",
        dtype="float32",
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        # Generous: three processes share two CPU cores here; a late draft only costs speed,
        # but these tests count drafted tokens.
        draft_deadline_s=10.0,
        two_lane_batch=two_lane_batch,
    )
    stack.start(log_dir=tmp / "logs")
    return stack


async def generate_watching_lanes(port: int) -> tuple[list[dict[str, Any]], set[int]]:
    """Runs the streams while polling GetServerInfo; the lane counts it reported."""
    seen: set[int] = set()
    run = asyncio.create_task(generate(port, prompts()))
    while not run.done():
        seen.add(len((await server_info(port)).lanes))
        await asyncio.sleep(0.05)
    return await run, seen


@pytest.mark.parametrize(
    ("draft", "spec", "lanes"),
    [
        ("eagle3", ("--spec-steps", "3"), 1),
        ("eagle3", ("--spec-steps", "3", "--spec-topk", "4", "--spec-tokens", "8"), 2),
        ("model", ("--spec-steps", "4"), 2),
        ("model", ("--spec-steps", "3", "--spec-topk", "2", "--spec-tokens", "6"), 1),
    ],
    ids=["eagle3-chain", "eagle3-tree-2lanes", "model-chain-2lanes", "model-tree"],
)
def test_greedy_through_the_gateway_equals_target_only(
    ckpts: dict[str, Path],
    reference: list[list[int]],
    tmp_path: Path,
    draft: str,
    spec: tuple[str, ...],
    lanes: int,
) -> None:
    # Two lanes from 4 running requests: the 8 streams run split in two.
    stack = start(ckpts, tmp_path, draft, *spec, two_lane_batch=4 if lanes == 2 else 16)
    try:
        gateway = stack.services[-1].port
        results, seen = asyncio.run(generate_watching_lanes(gateway))
        assert [r["tokens"] for r in results] == reference
        assert max(seen) == lanes, seen
        for r in results:
            usage = r["complete"].usage
            assert usage.completion_tokens == NEW_TOKENS and usage.verify_steps > 0
            assert usage.draft_tokens > 0
        if draft == "model":  # the target as its own draft: drafts are accepted
            assert all(r["complete"].usage.accepted_tokens > 0 for r in results)
        # Per-request opt-out: the same output, nothing drafted.
        (plain,) = asyncio.run(generate(gateway, prompts()[3:4], speculate=False))
        assert plain["tokens"] == reference[3]
        assert plain["complete"].usage.draft_tokens == 0
    finally:
        stack.stop()


def test_killing_the_draft_loses_nothing(
    ckpts: dict[str, Path], reference: list[list[int]], tmp_path: Path
) -> None:
    stack = start(ckpts, tmp_path, "model", "--spec-steps", "3", two_lane_batch=4)
    draft, gateway = stack.services[0], stack.services[-1].port
    try:

        async def scenario() -> tuple[list[dict[str, Any]], list[int]]:
            streaming = asyncio.Event()
            run = asyncio.create_task(generate(gateway, prompts(), first_chunk=streaming))
            await streaming.wait()  # the streams are running: now the draft dies
            assert draft.proc is not None
            draft.proc.send_signal(signal.SIGKILL)
            results = await run
            states = [(await server_info(gateway)).draft_state]
            for _ in range(50):  # the gateway learns it from the target's next status
                if states[-1] == common_pb2.DRAFT_STATE_UNHEALTHY:
                    break
                await asyncio.sleep(0.1)
                states.append((await server_info(gateway)).draft_state)
            return results, states

        results, states = asyncio.run(scenario())
        assert [r["tokens"] for r in results] == reference
        assert states[-1] == common_pb2.DRAFT_STATE_UNHEALTHY, states
        # The draft comes back on the same port; new requests speculate again.
        restart_draft(draft, gateway)
        again = asyncio.run(generate(gateway, prompts()[:2]))
        assert [r["tokens"] for r in again] == reference[:2]
        assert sum(r["complete"].usage.accepted_tokens for r in again) > 0
    finally:
        stack.stop()


def test_stack_stops_cleanly_on_sigterm(ckpts: dict[str, Path], tmp_path: Path) -> None:
    stack = start(ckpts, tmp_path, "eagle3", "--spec-steps", "2")
    stack.stop(grace_s=20)
    codes = [s.proc.returncode for s in stack.services if s.proc is not None]
    assert codes == [0, 0, 0], codes
    assert isinstance(stack.services[0], Service)


def run_demo(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem", "demo", "--max-new-tokens", "24", "--work-dir",
         str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "COLUMNS": "250", **env},  # rich wraps at the terminal width
    )  # fmt: skip


def test_demo_serves_the_embedded_model_and_reports(tmp_path: Path) -> None:
    proc = run_demo(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "embedded reference model" in proc.stderr
    assert proc.stdout.startswith("def fibonacci(n):") and len(proc.stdout) > len("def fib")
    found = re.search(r"accept length ([0-9.]+) \| draft tokens (\d+), accepted (\d+)", proc.stderr)
    assert found is not None, proc.stderr
    assert float(found[1]) > 1.5 and int(found[3]) > 0  # a trained draft: drafts are accepted


def test_demo_without_the_embedded_model_writes_random_ones(tmp_path: Path) -> None:
    proc = run_demo(tmp_path, TANDEM_EMBEDDED=str(tmp_path / "missing"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("w10 w20 w30") and len(proc.stdout.split()) == 3 + 24
    assert "accept length" in proc.stderr and "tokens/s" in proc.stderr


def test_generate_cli_through_the_server(
    ckpts: dict[str, Path], reference: list[list[int]], tmp_path: Path
) -> None:
    import json

    stack = start(ckpts, tmp_path, "eagle3", "--spec-steps", "3")
    try:
        args = [
            "generate",
            "--target",
            str(ckpts["target"]),
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--ignore-eos",
            "--json",
            "w10 w20 w30",
            "w4000 w17",
        ]
        local = subprocess.run(
            [sys.executable, "-m", "tandem", *args],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        server = f"127.0.0.1:{stack.services[-1].port}"
        remote = subprocess.run(
            [sys.executable, "-m", "tandem", *args, "--server", server],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        ours = [json.loads(line) for line in local.stdout.splitlines()]
        theirs = [json.loads(line) for line in remote.stdout.splitlines()]
        keys = {"prompt", "token_ids", "finish_reason", "completion_tokens"}
        assert [{k: r[k] for k in keys} for r in theirs] == [{k: r[k] for k in keys} for r in ours]
        for rec in theirs:
            assert {
                "text",
                "accept_length",
                "draft_tokens",
                "accepted_tokens",
                "verify_steps",
            } <= set(rec)
            assert rec["draft_tokens"] > 0
            # Streamed text continues the prompt (a leading space for word-level tokenizers).
            assert rec["text"].strip() == ours[theirs.index(rec)]["text"].strip()
    finally:
        stack.stop()
