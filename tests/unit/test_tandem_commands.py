"""The ``tandem`` commands hand on the configs they did before the settings were declared once
(tandem.settings): each command's flags and environment variables, caught where the command hands
its configs to the work (a recorder raises in place of the engine, the stack or the benchmark)."""

from __future__ import annotations

import os
import shlex
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.config import DraftConfig, EngineConfig
from tandem.spec.types import SpecConfig


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No TANDEM_* variable from the caller's shell."""
    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    yield


def argv(text: str) -> list[str]:
    return shlex.split(text)


class Caught(Exception):
    """Raised by a recorder in place of the work a command hands its configs to."""


def invoke(argv: list[str], env: dict[str, str] | None = None) -> Any:
    from typer.testing import CliRunner

    from tandem.apps.cli import app

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return CliRunner().invoke(app, argv, env=env)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "t", "llama")


def test_generate(monkeypatch: pytest.MonkeyPatch, checkpoint: Path, tmp_path: Path) -> None:
    from tandem.draft import build
    from tandem.target import engine

    seen: dict[str, Any] = {}

    def build_drafter(config: DraftConfig, layers: int) -> None:
        seen["draft"] = config

    class Engine:
        def __init__(self, config: EngineConfig, *, drafter: Any, spec: Any) -> None:
            seen.update(engine=config, spec=spec)
            raise Caught

    monkeypatch.setattr(build, "build_drafter", build_drafter)
    monkeypatch.setattr(engine, "Engine", Engine)

    def run(argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
        seen.clear()
        result = invoke(["generate", *argv, "w5"], env)
        assert isinstance(result.exception, Caught), result.output
        return dict(seen)

    assert run(["--target", str(checkpoint)]) == {
        "engine": EngineConfig(model=checkpoint),
        "spec": None,
    }
    draft = tmp_path / "d"
    flags = argv(
        "--page-size 32 --dtype bfloat16 --device cpu --max-num-seqs 8 "
        "--max-num-batched-tokens 512 --num-pages 100 --no-cuda-graphs --draft-kind mtp "
        "--mtp-mode target --spec-policy adaptive --no-overlap --device-chain "
        "--no-batch-invariant --spec-steps 4 --spec-topk 2 --spec-tokens 7"
    )
    given = {
        "engine": EngineConfig(
            model=checkpoint,
            dtype="bfloat16",
            page_size=32,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            num_pages=100,
            cuda_graphs=False,
            spec_policy="adaptive",
            overlap=False,
            device_chain=True,
        ),
        "draft": DraftConfig(
            kind="mtp",
            path=draft,
            target=checkpoint,
            mtp_mode="target",
            dtype="bfloat16",
            page_size=32,
        ),
        "spec": SpecConfig(num_steps=4, topk=2, num_draft_tokens=7),
    }
    assert run(["--target", str(checkpoint), "--draft", str(draft), *flags]) == given
    env = {"TANDEM_TARGET": str(checkpoint), "TANDEM_DRAFT": str(draft)}
    env |= {"TANDEM_DTYPE": "bfloat16", "TANDEM_DEVICE": "cpu"}
    assert run([*flags[6:], "--page-size", "32"], env) == given
    ngram = run(["--target", str(checkpoint), "--draft-kind", "ngram", "--spec-steps", "2"])
    assert ngram["draft"] == DraftConfig(kind="ngram", target=checkpoint)
    assert ngram["spec"] == SpecConfig(num_steps=2)
    eagle3 = run(["--target", str(checkpoint), "--draft", str(draft)])
    assert eagle3["draft"] == DraftConfig(kind="eagle3", path=draft, target=checkpoint)
    bad = invoke(["generate", "--target", str(checkpoint), "--spec-policy", "x", "w5"])
    assert bad.exit_code == 2 and "spec" in bad.output


def test_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tandem.apps import launch

    stacks: list[launch.Stack] = []

    def record(self: launch.Stack, **_: object) -> None:
        stacks.append(self)
        raise RuntimeError("recorded")

    monkeypatch.setattr(launch.Stack, "start", record)

    def run(argv: list[str], env: dict[str, str] | None = None) -> dict[str, list[str]]:
        stacks.clear()
        result = invoke(["serve", *argv], env)
        assert len(stacks) == 1, result.output
        return {svc.name: [svc.module, *svc.args] for svc in stacks[0].services}

    t, d = tmp_path / "t", tmp_path / "d"
    flags = argv(
        f"--draft {d} --draft-kind mtp --mtp-mode target --spec-steps 4 --spec-topk 2 "
        "--spec-tokens 7 --draft-deadline 0.25 --two-lane-batch 0 --page-size 32 "
        "--gateway-port 1 --target-port 2 --draft-port 3"
    )
    common = "--device cpu --dtype bfloat16 --page-size 32"
    given = {
        "draft": argv(
            f"draft_service --target {t} --draft-kind mtp --mtp-mode target --draft {d} "
            f"{common} --port 3"
        ),
        "target": argv(
            f"target_service --target {t} {common} --port 2 --draft-addr 127.0.0.1:3 "
            "--draft-kind mtp --draft-deadline 0.25 --spec-steps 4 --spec-topk 2 --spec-tokens 7"
        ),
        "gateway": argv(
            f"gateway --target-addr 127.0.0.1:2 --tokenizer {t} --port 1 --two-lane-batch 0"
        ),
    }
    assert run(["--target", str(t), *flags, "--device", "cpu", "--dtype", "bfloat16"]) == given
    env = {"TANDEM_TARGET": str(t), "TANDEM_DEVICE": "cpu", "TANDEM_DTYPE": "bfloat16"}
    assert run(flags, env) == given
    assert run(["--target", str(t)]) == {
        "target": argv(
            f"target_service --target {t} --device cpu --dtype float32 --page-size 16 --port 50052"
        ),
        "gateway": argv(
            f"gateway --target-addr 127.0.0.1:50052 --tokenizer {t} --port 50051 "
            "--two-lane-batch 16"
        ),
    }
    ngram = run(["--target", str(t), "--draft-kind", "ngram"])
    tail = "--draft-deadline 1.0 --spec-steps 3 --spec-topk 1"
    assert ngram["target"][-6:] == argv(tail)
    assert ngram["draft"][:6] == argv(f"draft_service --target {t} --draft-kind ngram --mtp-mode")


def test_demo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tandem.apps import demo

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: seen.append(kwargs))
    assert invoke(["demo"]).exit_code == 0
    assert seen.pop() == {
        "target": None,
        "draft": None,
        "draft_kind": None,
        "spec_args": ["--spec-steps", "3"],
        "prompt": "def fibonacci(n):",
        "max_new_tokens": 64,
        "work_dir": Path("out/demo"),
        "device": "cpu",
    }
    flags = argv("--draft d --draft-kind mtp --spec-steps 4 --prompt hi --max-new-tokens 9")
    flags += ["--work-dir", str(tmp_path)]
    given = {
        "target": Path("t"),
        "draft": Path("d"),
        "draft_kind": "mtp",
        "spec_args": ["--spec-steps", "4"],
        "prompt": "hi",
        "max_new_tokens": 9,
        "work_dir": tmp_path,
        "device": "cuda",
    }
    assert invoke(["demo", "--target", "t", "--device", "cuda", *flags]).exit_code == 0
    assert seen.pop() == given
    assert invoke(["demo", *flags], {"TANDEM_TARGET": "t", "TANDEM_DEVICE": "cuda"}).exit_code == 0
    assert seen.pop() == given


def test_bench(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tandem.bench import run
    from tandem.bench.inprocess import Workload

    seen: list[Any] = []

    def run_bench(config: Any, say: Any) -> None:
        seen.append(config)
        raise Caught

    monkeypatch.setattr(run, "run_bench", run_bench)
    t = tmp_path / "t"
    result = invoke(["bench", "--target", str(t)])
    assert isinstance(result.exception, Caught), result.output
    assert seen.pop() == run.BenchConfig(
        target=t,
        draft=None,
        assistant=None,
        modes=("target-only", "spec", "services", "hf"),
        workload=Workload(prompt_len=128, new_tokens=128, warmup_tokens=16, rounds=1),
    )
    flags = ["--target", str(t)]
    flags += argv(
        "--draft d --assistant a --modes spec,k0 --batch-sizes 1,2 --prompt-len 8 --new-tokens 9 "
        "--warmup-tokens 0 --rounds 2 --spec-steps 4 --simulate-accept-length 2.5 --device cpu "
        "--draft-device cuda:1 --dtype bfloat16 --page-size 32 --spec-policy adaptive "
        "--two-lane-batch 0 --log-dir logs --profile-idle --profile-start 5 --no-batch-invariant"
    )
    result = invoke(["bench", *flags])
    assert isinstance(result.exception, Caught), result.output
    assert seen.pop() == run.BenchConfig(
        target=t,
        draft=Path("d"),
        assistant=Path("a"),
        modes=("spec", "k0"),
        batch_sizes=(1, 2),
        workload=Workload(prompt_len=8, new_tokens=9, warmup_tokens=0, rounds=2),
        spec_steps=4,
        simulate_accept_length=2.5,
        device="cpu",
        dtype="bfloat16",
        page_size=32,
        two_lane_batch=0,
        spec_policy="adaptive",
        log_dir=Path("logs"),
        draft_device="cuda:1",
        profile_idle=True,
        profile_start=5,
    )
    bad = invoke(["bench", "--target", str(t), "--spec-policy", "x"])
    assert bad.exit_code == 2 and "spec" in bad.output


def test_train_draft(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tandem.train import cli
    from tandem.train.draft import DraftSettings
    from tandem.train.loop import LoopSettings
    from tandem.train.standalone import StandaloneShape

    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli, "run_train_draft", lambda *args, **kwargs: seen.append((args, kwargs)))
    flags = argv(
        "--target t --kind mtp --out o --data a --data b --steps 7 --batch-size 3 --seq-len "
        "64 --lr 0.01 --warmup-steps 2 --max-seconds 9 --device cpu --dtype bfloat16 --seed 5 "
        "--ttt-steps 2 --num-heads 3 --draft-vocab-size 100 --draft-layers 1 --hard-weight "
        "0.25 --generate 4 --generated-fraction 0.3 --heldout-fraction 0.1 --max-data-mb 1.5 "
        "--log-every 2"
    )
    result = invoke(["train-draft", *flags])
    assert result.exit_code == 0, result.output
    args, kwargs = seen.pop()
    settings = DraftSettings(
        kind="mtp",
        loop=LoopSettings(
            steps=7, lr=0.01, warmup_steps=2, grad_clip=0.5, max_seconds=9.0, log_every=2
        ),
        batch_size=3,
        seq_len=64,
        ttt_steps=2,
        num_heads=3,
        draft_vocab_size=100,
        generated_fraction=0.3,
        hard_weight=0.25,
        model_shape=StandaloneShape(num_layers=1),
        seed=5,
        save_dtype="bfloat16",
    )
    assert args[:3] == (Path("t"), Path("o"), settings) and str(args[3]) == "cpu"
    assert kwargs == {
        "data": [Path("a"), Path("b")],
        "heldout_fraction": 0.1,
        "max_data_mb": 1.5,
        "generate": 4,
    }
    assert invoke(["train-draft", "--kind", "mtp", "--out", "o"]).exit_code == 2  # no --target
