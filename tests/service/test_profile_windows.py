"""The services' loops and their step-window profiles (``tandem.serving.profiling``, armed as
``tandem bench --profile-idle`` arms them): the target's loop writes a window its round did not
close once the round ends, and one still open when it stops; the draft's engine, sent nothing
(its target decoding with K=0), still notices the arm and writes a window once the target's is
there. One profiler per process: each test runs one loop."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import time
from pathlib import Path
from typing import Any

import pytest

from draft_service.engine import DraftEngine
from tandem.config import DraftConfig, EngineConfig
from tandem.sampling import SamplingParams
from tandem.serving import profiling
from tandem.target.engine import Engine
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint
from tandem.v1 import common_pb2, target_pb2
from target_service.__main__ import status
from target_service.engine import Admit, TargetLoop


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("profile-windows")
    target = make_checkpoint(root / "target", "llama", seed=4, num_hidden_layers=2)
    draft = make_eagle3_checkpoint(root / "eagle3", target, draft_vocab_size=256, seed=1)
    return target, draft


@pytest.fixture
def arm_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The bench's profiling environment (start after 3 steps, 50 steps): read by the loops."""
    arm = tmp_path / "arm"
    monkeypatch.setenv(profiling.ENV_DIR, str(tmp_path / "default"))
    monkeypatch.setenv(profiling.ENV_ARM_FILE, str(arm))
    monkeypatch.setenv(profiling.ENV_START_STEP, "3")
    monkeypatch.setenv(profiling.ENV_NUM_STEPS, "50")
    return arm


def _window(out_dir: Path, service: str, timeout_s: float = 5.0) -> dict[str, Any]:
    path = out_dir / f"{service}-{os.getpid()}.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {service} window in {out_dir}"
        time.sleep(0.02)
    window: dict[str, Any] = json.loads(path.read_text())["window"]
    return window


def _admit(request_id: str, new_tokens: int) -> Admit:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return Admit(1, request_id, [5, 6, 7, 8], params, speculate=False)


def test_the_target_loop_writes_the_window_its_round_did_not_close(
    ckpts: tuple[Path, Path], arm_file: Path, tmp_path: Path
) -> None:
    engine = Engine(EngineConfig(model=ckpts[0], num_pages=64))
    loop = TargetLoop(engine, status=lambda: status(engine, None), status_interval_s=0.05)
    commits: queue.Queue[target_pb2.Commit] = queue.Queue()
    loop.attach(1, lambda m: [commits.put(c) for c in m.step.commits])
    loop.start()
    try:
        profiling.arm(arm_file, tmp_path / "round")
        loop.submit(_admit("short", 8))  # 8 steps: the window (steps 4-53) cannot close
        while commits.get(timeout=30).finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            pass
        window = _window(tmp_path / "round", "target")
        assert window["closed"] == "idle" and window["first_step"] == 4
        assert 1 <= window["num_steps"] < 50  # steps 4 to the round's last
        profiling.arm(arm_file, tmp_path / "stopped")
        loop.submit(_admit("long", 60))
        for _ in range(10):
            commits.get(timeout=30)
    finally:
        loop.stop()
    window = _window(tmp_path / "stopped", "target", timeout_s=0)
    assert window["closed"] == "stop" and window["num_steps"] >= 1


def test_the_draft_engine_sent_nothing_follows_the_target_window(
    ckpts: tuple[Path, Path], arm_file: Path, tmp_path: Path
) -> None:
    target, draft = ckpts
    engine = DraftEngine(DraftConfig(kind="eagle3", path=draft, target=target, num_pages=64))
    try:
        asyncio.run(engine.load())
        out_dir = tmp_path / "round"
        profiling.arm(arm_file, out_dir)
        armed_ns = arm_file.stat().st_mtime_ns
        time.sleep(0.75)  # a few idle ticks: noticed, opened, waiting for another window
        assert not list(out_dir.glob("*.json"))
        other_written_ns = time.time_ns()
        (out_dir / "target-1.json").write_text("{}")
        window = _window(out_dir, "draft")
    finally:
        engine.close()
    assert (window["closed"], window["num_steps"]) == ("follow", 0)
    assert window["start_ns"] == armed_ns  # no step since the arm: the window starts there
    assert window["end_ns"] > other_written_ns
