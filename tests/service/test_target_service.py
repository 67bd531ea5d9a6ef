"""The target service over gRPC (in-process server on a loopback port): admits, commits,
aborts, refusals, and a closed gateway stream freeing everything it admitted."""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem import wire
from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.serving import rpc
from tandem.target.engine import Engine
from tandem.testing.random_model import make_checkpoint
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.__main__ import get_info, status
from target_service.config import TargetServiceConfig
from target_service.engine import Admit, TargetLoop
from target_service.server import TargetServicer

PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 500, 600, 700], [42]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=3, tokenizer=False)


class Running:
    def __init__(self, engine: Engine, server: grpc.aio.Server, port: int, loop: TargetLoop):
        self.engine, self.server, self.port, self.loop = engine, server, port, loop


async def start(target_dir: Path) -> Running:
    config = TargetServiceConfig(engine=EngineConfig(model=target_dir, num_pages=256))
    engine = Engine(config.engine)
    loop = TargetLoop(engine, status=lambda: status(engine, None), status_interval_s=0.05)
    server = rpc.make_server(max_message_bytes=config.max_message_bytes)
    target_pb2_grpc.add_TargetServiceServicer_to_server(
        TargetServicer(loop, get_info(engine, config)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop.start()
    return Running(engine, server, port, loop)


def admit(request_id: str, prompt: list[int], **sampling: Any) -> target_pb2.ControlRequest:
    params = SamplingParams(**{"max_new_tokens": 12, "ignore_eos": True, **sampling})
    return target_pb2.ControlRequest(
        admit=target_pb2.AdmitCommand(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=wire.sampling_to_proto(params),
        )
    )


async def collect(
    responses: AsyncIterator[target_pb2.ControlResponse], ids: set[str]
) -> dict[str, list[target_pb2.Commit]]:
    out: dict[str, list[target_pb2.Commit]] = {i: [] for i in ids}
    open_ = set(ids)
    statuses = 0
    async for response in responses:
        if response.WhichOneof("event") == "status":
            statuses += 1
            continue
        for commit in response.step.commits:
            out[commit.request_id].append(commit)
            if commit.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                open_.discard(commit.request_id)
        if not open_:
            break
    assert statuses > 0, "no TargetStatus was ever sent"
    return out


def test_commits_equal_the_in_process_engine(target_dir: Path) -> None:
    async def run() -> dict[str, list[target_pb2.Commit]]:
        svc = await start(target_dir)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                requests: asyncio.Queue[target_pb2.ControlRequest | None] = asyncio.Queue()
                for i, prompt in enumerate(PROMPTS):
                    requests.put_nowait(admit(f"r{i}", prompt))

                async def outgoing() -> AsyncIterator[target_pb2.ControlRequest]:
                    while (item := await requests.get()) is not None:
                        yield item

                call = stub.Control(outgoing())
                commits = await collect(call, {f"r{i}" for i in range(len(PROMPTS))})
                requests.put_nowait(None)
                info = await stub.GetInfo(target_pb2.TargetServiceGetInfoRequest())
                assert info.vocab_size == svc.engine.model.config.vocab_size
                return commits
        finally:
            svc.loop.stop()
            await svc.server.stop(0)

    commits = asyncio.run(run())
    expected = Engine(EngineConfig(model=target_dir)).generate(
        PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True)
    )
    for i, result in enumerate(expected):
        got = [t for c in commits[f"r{i}"] for t in c.token_ids]
        assert got == result.token_ids
        final = commits[f"r{i}"][-1]
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 12
        assert final.usage.prompt_tokens == len(PROMPTS[i])


def test_refusals_aborts_and_a_closed_stream(target_dir: Path) -> None:
    async def run() -> None:
        svc = await start(target_dir)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                call = stub.Control()
                await call.write(admit("bad", [10**6]))  # id outside the vocabulary
                await call.write(admit("long", PROMPTS[1], max_new_tokens=400))
                refusal = await call.read()
                while refusal.WhichOneof("event") != "step":
                    refusal = await call.read()
                (commit,) = refusal.step.commits
                assert commit.request_id == "bad"
                assert commit.finish_reason == common_pb2.FINISH_REASON_ERROR
                assert commit.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert commit.error.field == "prompt_ids"
                await call.write(admit("long", PROMPTS[0]))  # a duplicate id
                abort = target_pb2.ControlRequest(
                    abort=target_pb2.AbortCommand(request_ids=["long"])
                )
                await call.write(abort)
                seen: list[tuple[int, str]] = []
                while (common_pb2.FINISH_REASON_ABORT, "") not in seen:
                    response = await call.read()
                    seen += [
                        (c.finish_reason, c.error.field)
                        for c in response.step.commits
                        if c.request_id == "long" and c.finish_reason
                    ]
                # The duplicate admit is refused (naming the field); the original is aborted.
                assert seen == [
                    (common_pb2.FINISH_REASON_ERROR, "request_id"),
                    (common_pb2.FINISH_REASON_ABORT, ""),
                ]
                # A stream that closes with requests in flight frees all of them.
                await call.write(admit("orphan", PROMPTS[1], max_new_tokens=400))
                await call.read()
                await call.done_writing()
                call.cancel()
            alloc = svc.engine.kv.allocator
            for _ in range(100):
                if alloc.num_free_pages == alloc.num_pages and not svc.engine.has_unfinished():
                    break
                await asyncio.sleep(0.05)
            assert alloc.num_free_pages == alloc.num_pages
            assert not svc.engine.has_unfinished()
        finally:
            svc.loop.stop()
            await svc.server.stop(0)

    asyncio.run(run())


def test_a_bad_admit_refuses_that_request_only(target_dir: Path) -> None:
    """Admits the servicer cannot read (an empty id, a NaN temperature) are refused one by
    one, each naming its field; the stream and the valid requests on it go on to the end."""

    async def run() -> dict[str, list[target_pb2.Commit]]:
        svc = await start(target_dir)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                call = stub.Control()
                await call.write(admit("before", PROMPTS[0]))
                await call.write(admit("", PROMPTS[1]))
                nan = admit("nan", PROMPTS[1])
                nan.admit.sampling.temperature = float("nan")
                await call.write(nan)
                await call.write(admit("after", PROMPTS[2]))
                commits = await collect(call, {"before", "", "nan", "after"})
                await call.done_writing()
                return commits
        finally:
            svc.loop.stop()
            await svc.server.stop(0)

    commits = asyncio.run(run())
    for request_id, field in (("", "admit.request_id"), ("nan", "admit.sampling.temperature")):
        (refusal,) = commits[request_id]
        assert refusal.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert refusal.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert refusal.error.field == field, refusal.error
    for request_id in ("before", "after"):
        final = commits[request_id][-1]
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in commits[request_id]) == 12


def test_a_cancelled_stream_leaves_no_task_behind(
    target_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway stream cancelled while the servicer waits for its next message: the wait for
    the outbox is cancelled with it (it was left pending, then destroyed: asyncio's "Task was
    destroyed but it is pending!" in the target's log whenever a gateway went away)."""

    def pending_gets() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if "Queue.get" in repr(t.get_coro())]

    async def run() -> None:
        svc = await start(target_dir)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                for _ in range(3):
                    call = stub.Control()
                    await call.read()  # a status: the servicer is in its loop
                    assert pending_gets(), "the servicer should be waiting on its outbox"
                    call.cancel()
                    for _ in range(100):
                        await asyncio.sleep(0.02)
                        gc.collect()
                        if not pending_gets():
                            break
                    assert not pending_gets()
        finally:
            svc.loop.stop()
            await svc.server.stop(0)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(run())
        gc.collect()
    assert "Task was destroyed but it is pending" not in caplog.text


def test_an_idle_target_prefills_a_burst_in_one_step(target_dir: Path) -> None:
    """An idle target's first admit waits for the rest of its burst: prompts 0.1 s apart, with
    a gap of 0.25 s, all prefill in the first step, however long the burst lasts within the
    window (here 0.4 s, more than the gap). A lone prompt then waits the gap, not a quarter of
    the window (1 s)."""
    engine = Engine(EngineConfig(model=target_dir, num_pages=256))
    loop, reports = _started_loop(engine, window_s=4.0, gap_s=0.25)
    try:
        committed, _ = _first_step(loop, reports, ["a", "b", "c", "d", "e"], 0.1)
        assert committed == {"a", "b", "c", "d", "e"}
        _idle_again(engine, reports)
        committed, after = _first_step(loop, reports, ["f"], 0.1)
        assert committed == {"f"} and after < 0.8
    finally:
        loop.stop()


def test_a_burst_with_a_hiccup_prefills_in_one_step(target_dir: Path) -> None:
    """Prompts 0.05 s apart with one pause of 0.2 s among them (the gap is 0.15 s): the burst
    under way waits up to four of its spacings, so all prefill in the first step; a lone
    prompt still waits one gap."""
    engine = Engine(EngineConfig(model=target_dir, num_pages=256))
    loop, reports = _started_loop(engine, window_s=4.0, gap_s=0.15)
    try:
        pauses = (0.05, 0.05, 0.05, 0.05, 0.2, 0.05)
        committed, _ = _first_step(loop, reports, list("abcdef"), pauses)
        assert committed == set("abcdef")
        _idle_again(engine, reports)
        committed, after = _first_step(loop, reports, ["g"], 0.05)
        assert committed == {"g"} and after < 0.6
    finally:
        loop.stop()


def test_a_burst_that_fills_a_step_stops_the_wait(target_dir: Path) -> None:
    """Once the waiting requests fill a step (here max_num_seqs = 2), an idle target starts at
    once: a request arriving later would wait for a later step anyway. Neither the gap nor the
    window (5 s each) is waited out."""
    engine = Engine(EngineConfig(model=target_dir, num_pages=256, max_num_seqs=2))
    loop, reports = _started_loop(engine, window_s=5.0, gap_s=5.0)
    try:
        committed, after = _first_step(loop, reports, ["a", "b"], 0.05)
        assert committed == {"a", "b"} and after < 1.0
    finally:
        loop.stop()


def _started_loop(
    engine: Engine, *, window_s: float, gap_s: float
) -> tuple[TargetLoop, queue.Queue[target_pb2.ControlResponse]]:
    """A started TargetLoop with those admission settings, and the queue its stream 1 fills."""
    loop = TargetLoop(
        engine,
        status=lambda: status(engine, None),
        status_interval_s=0.05,
        admission_window_s=window_s,
        admission_gap_s=gap_s,
    )
    reports: queue.Queue[target_pb2.ControlResponse] = queue.Queue()
    loop.attach(1, reports.put)
    loop.start()
    return loop, reports


def _first_step(
    loop: TargetLoop,
    reports: queue.Queue[target_pb2.ControlResponse],
    ids: list[str],
    apart_s: float | Sequence[float],
) -> tuple[set[str], float]:
    """The ids committed in the first step after admitting ``ids`` ``apart_s`` apart (or
    each after its own pause), and how long after the last admit that step reported."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    pauses = [apart_s] * len(ids) if isinstance(apart_s, float) else list(apart_s)
    for request_id, pause in zip(ids, pauses, strict=True):
        time.sleep(pause)
        loop.submit(Admit(1, request_id, PROMPTS[1], params, speculate=False))
    sent = time.monotonic()
    while (response := reports.get(timeout=30)).WhichOneof("event") != "step":
        pass
    return {c.request_id for c in response.step.commits}, time.monotonic() - sent


def _idle_again(engine: Engine, reports: queue.Queue[target_pb2.ControlResponse]) -> None:
    """Waits until the requests finished and drops what they reported."""
    _wait_idle(engine)
    while not reports.empty():
        reports.get_nowait()


def _wait_idle(engine: Engine, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while engine.has_unfinished():
        assert time.monotonic() < end, "requests still running"
        time.sleep(0.01)
