"""``tandem serve`` as a user runs it (the command in a child process, the embedded reference model
on CPU in float32), its services SIGKILLed under load: a dead draft is restarted while gateway and
target serve on, the streams in flight come out identical and new requests speculate again once it
is back, and so do long streams in flight; a dead target is restarted and the gateway re-admits
every stream in flight, which comes out identical (tokens, text, logprobs, usage) to an undisturbed
run; a dead gateway ends its calls with UNAVAILABLE, is restarted, and the target freed what they
held; a target given up on after ``--max-restarts`` leaves its requests failing with UNAVAILABLE
saying why, once ``--failover-wait`` is over; a start-up error is one line with the reason and the
log."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.apps.demo import free_port
from tandem.apps.embedded import family_dir
from tandem.v1 import common_pb2
from tests.helpers.cli import run_cli
from tests.helpers.serve import Serve, Stream, server_info, start_serve, streams

pytestmark = pytest.mark.e2e

NEW_TOKENS = 48
PROMPTS = [f"def f{i}(x):\n    return" + " x" * (i % 3) for i in range(8)]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    # A generous draft deadline: the processes share two cores here, and these tests count
    # drafted tokens; a late draft only costs speed.
    running = start_serve(tmp_path_factory.mktemp("serve"), "--draft-deadline", "10")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def undisturbed(serve: Serve) -> list[Stream]:
    out = asyncio.run(streams(serve.port, PROMPTS, NEW_TOKENS))
    assert all(len(s.tokens) == NEW_TOKENS and s.complete is not None for s in out)
    return out


def assert_same(disturbed: list[Stream], undisturbed: list[Stream]) -> None:
    """One uninterrupted stream each: every stream was under way when the service died and
    ends as the undisturbed run did."""
    for got, want in zip(disturbed, undisturbed, strict=True):
        assert 0 < got.at_hook < NEW_TOKENS
        assert got.tokens == want.tokens
        assert got.text == want.text
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3)
        assert got.complete is not None and want.complete is not None
        assert got.complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert got.complete.usage.prompt_tokens == want.complete.usage.prompt_tokens
        assert got.complete.usage.completion_tokens == NEW_TOKENS


def test_a_dead_draft_is_restarted_and_costs_nothing_but_speed(
    serve: Serve, undisturbed: list[Stream]
) -> None:
    async def kill() -> None:
        serve.kill("draft_service")

    out = asyncio.run(streams(serve.port, PROMPTS, NEW_TOKENS, hook=kill))
    assert_same(out, undisturbed)
    assert serve.proc.poll() is None
    assert re.search(r"draft exited with -9; restarting in [0-9.]+ s", serve.said())
    serve.wait_for("draft restarted (restart 1)", 120)
    deadline = time.monotonic() + 60
    while asyncio.run(server_info(serve.port)).draft_state != common_pb2.DRAFT_STATE_HEALTHY:
        assert time.monotonic() < deadline, "the target never re-attached to the draft"
        time.sleep(0.2)
    again = asyncio.run(streams(serve.port, PROMPTS[:2], NEW_TOKENS))
    assert [s.tokens for s in again] == [s.tokens for s in undisturbed[:2]]
    assert sum(s.complete.usage.accepted_tokens for s in again if s.complete) > 0


def test_streams_in_flight_speculate_again_once_the_draft_is_back(serve: Serve) -> None:
    """Long streams outlast a draft's SIGKILL and restart: the target recomputes each (the new
    draft has none of their state) and admits it again, so they verify trees again; their
    tokens are the undisturbed run's."""
    long_tokens = 1000
    prompts = PROMPTS[:2]
    undisturbed = asyncio.run(streams(serve.port, prompts, long_tokens))

    async def kill() -> None:
        serve.kill("draft_service")

    out = asyncio.run(streams(serve.port, prompts, long_tokens, hook=kill))
    assert [s.tokens for s in out] == [s.tokens for s in undisturbed]
    for stream in out:
        assert stream.complete is not None
        usage = stream.complete.usage
        # Before the kill at most ``at_hook`` steps ran (each commits a token or more): the
        # steps with trees beyond those came after the draft was back.
        assert usage.drafted_steps > stream.at_hook + 20, usage
        assert usage.steps_without_tree.not_in_draft > 0, usage  # the outage, counted
    assert re.search(r"draft restarted \(restart \d+\)", serve.said())


def test_a_dead_target_is_restarted_and_every_stream_goes_on(
    serve: Serve, undisturbed: list[Stream]
) -> None:
    async def kill() -> None:
        serve.kill("target_service")

    started = time.monotonic()
    out = asyncio.run(streams(serve.port, PROMPTS, NEW_TOKENS, hook=kill))
    took = time.monotonic() - started
    assert_same(out, undisturbed)
    # Each continuation is a new admission at the new target: it speculates.
    assert all(s.complete is not None and s.complete.usage.accepted_tokens > 0 for s in out)
    said = serve.said()
    assert re.search(r"target exited with -9; restarting in [0-9.]+ s", said), said
    assert "target restarted (restart 1), serving again" in said
    assert serve.proc.poll() is None
    print(f"8 streams across a target restart: {took:.1f} s")


def test_a_dead_gateway_ends_its_calls_and_is_restarted(
    serve: Serve, undisturbed: list[Stream]
) -> None:
    async def kill() -> None:
        serve.kill("gateway")

    with pytest.raises(grpc.aio.AioRpcError) as gone:
        asyncio.run(streams(serve.port, PROMPTS, NEW_TOKENS, hook=kill))
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
    serve.wait_for("gateway restarted (restart 1)", 120)
    deadline = time.monotonic() + 30
    while True:  # restarted is listening; SERVING once its control stream is up
        try:
            again = asyncio.run(streams(serve.port, PROMPTS[:2], NEW_TOKENS))
            break
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert time.monotonic() < deadline, exc
            time.sleep(0.5)
    assert [s.tokens for s in again] == [s.tokens for s in undisturbed[:2]]
    # The target aborted the dead gateway's requests: nothing else runs, no page is held.
    info = asyncio.run(server_info(serve.port))
    deadline = time.monotonic() + 20
    while info.num_running or info.target_kv_usage.pages_used:
        assert time.monotonic() < deadline, info
        time.sleep(0.3)
        info = asyncio.run(server_info(serve.port))


def test_a_target_given_up_on_fails_requests_with_the_reason(tmp_path: Path) -> None:
    target = str(family_dir() / "target")
    serve = start_serve(tmp_path, "--target", target, "--max-restarts", "0", "--failover-wait", "2")
    try:

        async def kill() -> None:
            serve.kill("target_service")

        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            asyncio.run(streams(serve.port, PROMPTS[:1], 400, hook=kill))
        waited = time.monotonic() - started
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "did not come back within 2 s" in (gone.value.details() or "")
        assert waited < 30, waited
        serve.wait_for("target exited with -9; given up after 0 restarts", 10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(streams(serve.port, PROMPTS[:1], 4))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "is not connected" in (refused.value.details() or "")
        assert serve.proc.poll() is None  # the gateway still answers
    finally:
        assert serve.stop() == 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--target", "/nonexistent/ckpt"], "CheckpointError: /nonexistent/ckpt: no config.json"),
        (["--device", "cuda"], "AssertionError: Torch not compiled with CUDA enabled"),
        (["--draft-kind", "eagle3", "--target", "TARGET"], "draft kind eagle3 needs a checkpoint"),
    ],
    ids=["missing-checkpoint", "cuda-without-cuda", "draft-kind-without-checkpoint"],
)
def test_a_start_up_error_is_one_line_with_the_log(
    tmp_path: Path, args: list[str], reason: str
) -> None:
    if "cuda" in args and _cuda():
        pytest.skip("CUDA is available here")
    args = [str(family_dir() / "target") if a == "TARGET" else a for a in args]
    ports = [f"--{name}-port={free_port()}" for name in ("gateway", "target", "draft")]
    done = run_cli("serve", *args, *ports, "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    (line,) = errors
    assert reason in line, line
    log = re.search(r"\(log: (\S+)\)$", line)
    assert log is not None, line
    assert Path(log[1]).parent == tmp_path / "logs"
    assert reason.split(": ")[-1] in Path(log[1]).read_text()
